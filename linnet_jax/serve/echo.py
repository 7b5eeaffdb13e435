"""`echo` on /v1/completions: each choice's text and logprobs begin with its prompt's, in OpenAI's legacy shape
(what lm-eval's `local-completions` loglikelihood requests read).

A prompt's logprobs come from full forwards over its ids (`linnet_jax.score`), off the event loop and one
request at a time. The first token's logprob is null (nothing comes before it). A generation that ended on a
stop id (eos, or one of `stop_token_ids`) has that id's entry last, as vLLM gives it, so a choice of
`max_tokens` 1 always holds the prompt's entries and one more (lm-eval drops the last one): its logprob is
the scored distribution's after the prompt and the generated tokens; when several stop ids could have ended
it, the most likely of them (exact for greedy requests). A stop string ends the entries at the last token
wholly before it, as the text does.
"""

import threading

from linnet_jax.inputs import eos_ids, make_prompts
from linnet_jax.score import score
from linnet_jax.serve.errors import BAD_INPUT, APIError, request_error
from linnet_jax.serve.protocol import CompletionRequest, Output

SCORING = threading.Lock()  # one scoring forward at a time: they share the device with the engine


def prompt_ids(model, prompts: list[dict], limit: int) -> list[list[int]]:
    """Each prompt's ids, as the engine encodes it; a 400 naming `prompt` for one it refuses or one longer
    than `limit` (the server's max_len)."""
    ids = []
    for prompt in prompts:
        try:
            ids += make_prompts(model, prompt.get("prompt"), prompt.get("tokens"), prompt.get("chat")).prompts
        except BAD_INPUT as error:
            raise request_error(error, "prompt") from error
        if len(ids[-1]) > limit:
            raise APIError(400, f"the prompt has {len(ids[-1])} tokens; this server scores at most "
                                f"max_len={limit}", "prompt")
    return ids


def stop_ids(model, body: CompletionRequest, reason: str | None) -> set[int]:
    """The ids that could have ended a generation that stopped for `reason` (the engine's: "eos", "stop", ...)
    without a stop string: none when it ran out of room or tokens, or stop strings may have ended it."""
    eos = eos_ids(model)
    active = set(body.stop_token_ids or ()) | (set() if body.ignore_eos else eos)
    if reason == "eos":
        return active & eos
    if reason == "stop" and not body.stop:
        return active - eos
    return set()


def echoes(model, prompts: list[dict], ids: list[list[int]], generated: list[Output], stopped: list[set[int]],
           top: int, logprobs: bool) -> list[tuple[Output, Output]]:
    """For each choice (prompt-major: len(generated) // len(ids) per prompt), its prompt as an Output (text,
    ids, each token's logprob after the first with its `top` most likely alternatives; the first token's are
    placeholders) and the entry of the stop id that ended its generation (`stopped`: the ids that could have;
    an empty Output when none did or no logprobs are asked for). CPU and device work: run it off the event loop."""
    n = len(generated) // len(ids)
    texts = [prompt["prompt"] if "prompt" in prompt else (model.tokenizer.decode(row) if model.tokenizer else "")
             for prompt, row in zip(prompts, ids)]
    if not logprobs:
        return [(Output(text=texts[i // n], tokens=ids[i // n]), Output()) for i in range(len(generated))]
    longer = [i for i, output in enumerate(generated) if stopped[i] and output.tokens]
    with SCORING:
        scores = score(model, ids + [ids[i // n] + generated[i].tokens for i in longer])
    prompt_outputs = [Output(text=text, tokens=row, logprobs=[0.0, *scored.logprobs],
                             top_logprobs=[[], *(pairs[:top] for pairs in scored.top[:-1])] if top else [])
                      for text, row, scored in zip(texts, ids, scores)]
    result = []
    for i in range(len(generated)):
        stop = Output()
        if stopped[i]:
            after = scores[len(ids) + longer.index(i)] if i in longer else scores[i // n]
            chosen = max(sorted(stopped[i]), key=lambda token: after.next_logprobs[token])
            stop = Output(tokens=[chosen], logprobs=[float(after.next_logprobs[chosen])],
                          top_logprobs=[after.top[-1][:top]] if top else [])
        result.append((prompt_outputs[i // n], stop))
    return result
