"""Prompt logprobs: how likely the model finds each token of a prompt given the ones before it.

`prompt_logprobs(model, ids)` runs one full forward over the prompt, right-padded to a bucket of its length
(so prompts of many lengths share few programs), and returns each token's logprob after the first with its
most likely alternatives: what `/v1/completions` reports under `echo` (lm-eval's loglikelihood requests).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.decode import TOP_LOGPROBS
from linnet_jax.inputs import bucket
from linnet_jax.loaded import Model, as_token_batch
from linnet_jax.models import Params, forward
from linnet_jax.models.config import Config


@functools.partial(jax.jit, static_argnums=(1,))
def next_token_logprobs(params: Params, config: Config, tokens: jax.Array, positions: jax.Array
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For tokens [1, T]: the logprob of each token t + 1 after tokens ..t ([T - 1]), and the TOP_LOGPROBS most
    likely tokens there (ids [T - 1, TOP_LOGPROBS], logprobs)."""
    logits, _ = forward(params, config, tokens, positions)
    logprobs = jax.nn.log_softmax(logits[0, :-1])  # [T - 1, V], float32
    chosen = jnp.take_along_axis(logprobs, tokens[0, 1:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    return chosen, top_ids, top_logprobs


def prompt_logprobs(model: Model, ids: list[int]) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each prompt token's logprob given the tokens before it (tokens 1 .. n - 1; the first has none), and its
    TOP_LOGPROBS most likely (id, logprob) alternatives, most likely first."""
    tokens = as_token_batch(ids, model.config.vocab_size, "prompt")[0]
    width = bucket(len(tokens), model.config.max_position_embeddings)
    padded, positions = np.zeros((1, width), np.int32), np.full((1, width), -1, np.int32)
    padded[0, :len(tokens)], positions[0, :len(tokens)] = tokens, np.arange(len(tokens))
    chosen, top_ids, top_logprobs = (np.asarray(a)[:len(tokens) - 1] for a in
                                     next_token_logprobs(model.params, model.config, padded, positions))
    return chosen.tolist(), [list(zip(i.tolist(), lp.tolist())) for i, lp in zip(top_ids, top_logprobs)]
