"""Prompt logprobs: how likely the model finds each token of a sequence given the ones before it.

`score(model, sequences)` runs full forwards (no cache) over id sequences, right-padded to a bucket of the
longest one's length and batched (rows × width ≤ SCORE_TOKENS per dispatch, rows a power of two), so requests of
many lengths and sizes share few programs. For each sequence it gives each token's logprob after the first, the
TOP_LOGPROBS most likely tokens at every position (the last one's: what would come next) and the whole
distribution of the next token after it: what `/v1/completions` reports under `echo` (lm-eval's loglikelihood
requests). Equal to `linnet_jax.logits` followed by a log-softmax.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from linnet_jax.decode import TOP_LOGPROBS
from linnet_jax.inputs import bucket
from linnet_jax.loaded import Model, as_token_batch, on_device
from linnet_jax.models import Params, forward
from linnet_jax.models.config import Config

SCORE_TOKENS = 2048  # rows × width of one scoring dispatch (a longer sequence goes alone)


@dataclasses.dataclass
class Scores:
    """One sequence's scores: `logprobs[t]`, token t + 1's logprob given tokens ..t; `top[t]`, the TOP_LOGPROBS
    most likely (id, logprob) after tokens ..t, most likely first (one more than logprobs: the last is what
    would follow the sequence); `next_logprobs`, the logprob of every vocabulary id after the whole sequence."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    next_logprobs: np.ndarray


@functools.partial(jax.jit, static_argnums=(1, 5))
def _score(params: Params, config: Config, tokens: jax.Array, positions: jax.Array, lengths: jax.Array,
           layout) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """tokens, positions [B, T] (-1 at padding), lengths [B] → each token's logprob after the previous ones
    [B, T - 1], the most likely ids and logprobs at each position [B, T, TOP_LOGPROBS], the distribution after
    each row's last real token [B, V]."""
    logits, _ = forward(params, config, tokens, positions, constrain=layout and layout.constrain)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32))  # [B, T, V]
    chosen = jnp.take_along_axis(logprobs[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    after = jnp.take_along_axis(logprobs, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return chosen, top_ids, top_logprobs, after


def score(model: Model, sequences: list[list[int]]) -> list[Scores]:
    """Each sequence's Scores (see the module's doc), in order; each sequence holds at least one id."""
    rows = [as_token_batch(ids, model.config.vocab_size, "prompt")[0] for ids in sequences]
    scores: list[Scores] = [None] * len(rows)  # type: ignore[list-item]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # similar lengths share a dispatch
    start = 0
    while start < len(order):
        width = bucket(len(rows[order[start]]))
        group = order[start:start + max(1, SCORE_TOKENS // width)]
        start += len(group)
        batch = 1 << (len(group) - 1).bit_length()  # a power of two; padding rows hold one token
        tokens, positions = np.zeros((batch, width), np.int32), np.full((batch, width), -1, np.int32)
        positions[:, 0], lengths = 0, np.ones(batch, np.int32)
        for row, i in enumerate(group):
            n = len(rows[i])
            tokens[row, :n], positions[row, :n], lengths[row] = rows[i], np.arange(n), n
        inputs = on_device(model, {"token_ids": tokens, "positions": positions}, ("batch", "seq"))
        chosen, top_ids, top_logprobs, after = (np.asarray(a) for a in _score(
            model.params, model.config, inputs["token_ids"], inputs["positions"], jnp.asarray(lengths), model.layout))
        for row, i in enumerate(group):
            n = len(rows[i])
            scores[i] = Scores(logprobs=chosen[row, :n - 1].tolist(),
                               top=[list(zip(ids, lps)) for ids, lps in
                                    zip(top_ids[row, :n].tolist(), top_logprobs[row, :n].tolist())],
                               next_logprobs=after[row])
    return scores
