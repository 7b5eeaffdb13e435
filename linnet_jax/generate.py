"""`generate`: batched, bucketed decoding on the decode core's per-slot primitives (`linnet_jax.decode`).

A call becomes: every prompt (`linnet_jax.inputs`) prefilled into its own row of a decode state of a
bucketed length, in one dispatch of T columns (a bucket: powers of two from 16), then `decode` steps with the loop on the device until every row has stopped. Everything a request owns (sampling
values, random key, stop ids, max_new_tokens) is an array in its row, so a new prompt length inside a
bucket, max_new_tokens, temperature or seed reuses the compiled programs, and a row's tokens do not
depend on the rows beside it. A row with a grammar (`structured`, `linnet_jax.structured`) chooses among the
tokens it allows, its mask computed on the host after each token, so that such a call decodes one step per
dispatch. Each row's text is detokenized as its ids arrive (`linnet_jax.text`);
streaming and stop strings run `decode` a few steps at a time.
"""

from collections.abc import Iterator

import numpy as np

from linnet_jax.adapters import call_table
from linnet_jax.decode import FREE, LENGTH, RUNNING, STOP_ID, TRACES, decode, verify
from linnet_jax.inputs import (RequestError, SamplingOptions, bucket, check_max_new_tokens, eos_ids,
                               extend_rows, make_prompts, new_slots, sampling_options)
from linnet_jax.loaded import Model
from linnet_jax.models.config import Config
from linnet_jax.models.lora import LoraTable
from linnet_jax.sharding import host
from linnet_jax.speculative import Ngram, draft_arrays, propose, speculative_config
from linnet_jax.structured import Constraint, bitmasks, constraints, with_bitmasks
from linnet_jax.text import Cursor, Detokenizer, Generation, take

STREAM_CHUNK = 4  # decode steps per dispatch when streaming
STOP_STRING_CHUNK = 32  # decode steps per dispatch when stop strings are watched

__all__ = ["FREE", "Generation", "LENGTH", "RUNNING", "STOP_ID", "TRACES", "generate"]


def plan_cache(config: Config, prompts: list[list[int]], max_new_tokens: int, max_len) -> int:
    """The decode state's slots per row, or a RequestError before any work when the request cannot fit.

    Default: a bucket of the longest prompt's bucket plus max_new_tokens (the same for every prompt
    length inside a bucket, so nothing retraces)."""
    longest = max(len(p) for p in prompts)
    context = config.max_position_embeddings
    if longest + max_new_tokens > context:
        raise RequestError("max_new_tokens", f"the longest prompt ({longest} tokens) plus max_new_tokens "
                                             f"({max_new_tokens}) exceeds the model's context of {context} positions")
    if max_len is None:
        return bucket(bucket(longest) + max_new_tokens, context)
    if isinstance(max_len, (bool, np.bool_)) or not isinstance(max_len, (int, np.integer)) or not 0 < max_len <= context:
        raise RequestError("max_len", f"max_len must be an int in [1, {context}] (the model's context), "
                                      f"got {max_len!r}")
    if max_len < longest + max_new_tokens:
        raise RequestError("max_len", f"max_len={max_len} is too small: the longest prompt ({longest} tokens) and "
                                      f"max_new_tokens={max_new_tokens} need {longest + max_new_tokens} cache slots")
    return int(max_len)


def run(model: Model, prompts: list[list[int]], options: SamplingOptions, max_new_tokens: int, max_len: int,
        chunk: int | None, speculative: Ngram | None = None, rules: list[Constraint | None] | None = None,
        table: LoraTable | None = None, entries: list[int] | None = None
        ) -> Iterator[tuple[list[list[int]], list[list[float]], np.ndarray]]:
    """Prefill every prompt into its row, then decode `chunk` steps per dispatch (to the end when None), or
    verify each row's n-gram drafts one step per dispatch (speculative; a plain step when no row has one),
    yielding each row's new tokens and their logprobs, and every row's finish state [B], after the prefill and
    after each dispatch. rules: each row's grammar (None: free), which the consumer advances with the tokens
    yielded before the next dispatch; while a row has one, each dispatch decodes one step, and that row gets no
    drafts. table, entries: the adapter table and each row's entry in it (`linnet_jax.adapters.call_table`), or
    None."""
    config, params = model.config, model.decode_params
    constrain = model.layout and model.layout.constrain
    rows = range(len(prompts))
    rules = rules or [None] * len(prompts)
    entries = entries or [0] * len(prompts)
    constrained = any(rule is not None for rule in rules)

    def allow(slots):  # each constrained row's mask for the next token
        return with_bitmasks(slots, bitmasks(rules, config.vocab_size)) if constrained else slots

    slots = extend_rows(model, allow(new_slots(model, len(prompts), max_len)), list(rows), prompts,
                        [0] * len(prompts), [options.row(row).requests(max_new_tokens, entries[row]) for row in rows],
                        [True] * len(prompts), lora=table)
    finish = host(slots.finish)
    histories = [prompt + [token] for prompt, token in zip(prompts, host(slots.token).tolist())]
    yield [[t] for t in host(slots.token).tolist()], [[p] for p in host(slots.logprob).tolist()], finish
    # a plain dispatch: one step while a row is constrained, or under speculation (a step where no row has a draft)
    steps = 1 if constrained or speculative else (max_new_tokens - 1 if chunk is None else chunk)
    out_len = bucket(steps) if chunk is None else chunk
    while (finish == RUNNING).any():
        drafts = [propose(history, speculative, max_len - len(history)) if finish[row] == RUNNING
                  and rules[row] is None else [] for row, history in enumerate(histories)] if speculative else []
        if any(drafts):
            slots, emitted = verify(params, config, allow(slots),
                                    *draft_arrays(drafts, speculative.num_speculative_tokens), constrain, plan=model.plan,
                                    lora=table)
        else:
            slots, emitted = decode(params, config, allow(slots), np.int32(steps), out_len, constrain,
                                    plan=model.plan, lora=table)
        tokens, logprobs, counts = host(emitted.tokens), host(emitted.logprobs), host(emitted.count)
        finish = host(slots.finish)
        new = [tokens[row, :count].tolist() for row, count in enumerate(counts)]
        for history, tokens_ in zip(histories, new):
            history += tokens_
        yield new, [logprobs[row, :count].tolist() for row, count in enumerate(counts)], finish


class Rows:
    """Each row's output as the dispatches arrive: its text (detokenized once per token), its logprobs, and why it
    stopped (None while it runs). A row that has stopped takes no more tokens."""

    def __init__(self, tokenizer, stops: tuple[str, ...], eos: set[int], rules: list[Constraint | None]):
        self.texts = [Detokenizer(tokenizer, stops) for _ in rules]
        self.logprobs: list[list[float]] = [[] for _ in rules]
        self.reasons: list[str | None] = [None] * len(rules)
        self.eos, self.rules = eos, rules

    def add(self, tokens: list[list[int]], logprobs: list[list[float]], finish: np.ndarray) -> None:
        """One dispatch's new tokens and logprobs per row, and every row's finish state after it (each row's grammar
        advanced by its tokens)."""
        for row, text in enumerate(self.texts):
            if self.reasons[row] is None:
                kept, self.reasons[row] = take(text, tokens[row], int(finish[row]), self.eos, self.rules[row])
                self.logprobs[row] += logprobs[row][:kept]

    @property
    def stopped(self) -> bool:
        return all(reason is not None for reason in self.reasons)

    def generations(self) -> list[Generation]:
        """Each row's Generation ("length" for a row still running when the loop ended)."""
        return [text.generation(reason or "length", logprobs)
                for text, reason, logprobs in zip(self.texts, self.reasons, self.logprobs)]


def generate(model: Model, prompt=None, max_new_tokens: int = 128, *, tokens=None, max_len: int | None = None,
             temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0, logit_bias=None, seed=0, stop: str | list[str] | None = None,
             stop_token_ids=None, ignore_eos: bool = False, chat: bool | None = None, stream: bool = False,
             return_details: bool = False, speculative=None, structured=None, lora=None):
    """Generate from text, conversations or ids. See the README for every input and result form.

    prompt: a string, a list of strings, a conversation ([{"role", "content"}, ...]) or a list of
    them; or tokens: a list of id lists. Greedy at temperature 0; otherwise temperature, top_k,
    top_p, min_p and repetition_penalty (numbers, or one per prompt), seeded: seed is one int (row b
    draws stream b of it) or one per prompt (each prompt draws as it would alone). presence_penalty and
    frequency_penalty (OpenAI's, in [-2, 2], over the generated tokens; numbers or one per prompt) and logit_bias
    ({token id: bias in [-100, 100]}, at most 300; one dict or one per prompt) apply after the repetition penalty.
    structured: the output follows a grammar, {"json": schema}, {"regex": pattern}, {"choice": [strings]} or
    {"grammar": Lark or GBNF text}, one for every prompt or one (or None) per prompt; a row whose grammar is
    complete stops with "stop". Stops at the
    model's eos ids and stop_token_ids (unless ignore_eos), at stop strings, or after max_new_tokens.
    max_len: the cache slots per row (prompt + new tokens); default a bucket that fits them.
    stream=True (one prompt) returns an iterator of text pieces. speculative: n-gram drafts from each row's own
    prompt and output, verified in one forward per step (`linnet_jax.speculative`; vLLM's names, e.g.
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}): the
    same tokens as without it, greedy or seeded, in fewer steps when the output repeats the context.
    lora: LoRA adapters (a PEFT adapter directory's path, as `export.peft` writes it, or a `Lora`) for every
    prompt, or a list of one per prompt (None: the base model), all served in one batch.
    A value that cannot be honoured raises a RequestError (a ValueError) naming its argument.
    """
    prompts = make_prompts(model, prompt, tokens, chat)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    if stream and not (prompts.single and prompts.as_text):
        raise RequestError("stream", "stream=True takes one text prompt or conversation, not a batch or token ids")
    if stream and return_details:
        raise RequestError("stream", "stream=True yields text pieces; return_details=True is for a call that "
                                     "returns the result")
    batch = len(prompts.prompts)
    options = sampling_options(model, batch, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                               repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty, logit_bias=logit_bias, seed=seed, stop=stop,
                               stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    speculative = speculative_config(speculative)
    rules = constraints(model, structured, batch) if structured is not None else [None] * batch
    max_len = plan_cache(model.config, prompts.prompts, max_new_tokens, max_len)
    table, entries = call_table(model, lora, batch)
    chunk = STREAM_CHUNK if stream else (STOP_STRING_CHUNK if options.stops else None)
    dispatches = run(model, prompts.prompts, options, max_new_tokens, max_len, chunk, speculative, rules, table,
                     entries)
    rows = Rows(model.tokenizer, options.stops, eos_ids(model), rules)
    if stream:
        return _stream(rows, dispatches)
    for dispatch in dispatches:
        rows.add(*dispatch)
        if rows.stopped:
            break
    results = rows.generations()
    results = results if return_details else [r.text if prompts.as_text else r.tokens for r in results]
    return results[0] if prompts.single else results


def _stream(rows: Rows, dispatches) -> Iterator[str]:
    """Yield the new text of row 0 after each dispatch: what a stop string or a partial character may not change."""
    cursor, text = Cursor(), rows.texts[0]
    for dispatch in dispatches:
        rows.add(*dispatch)
        final = rows.generations()[0] if rows.stopped else None
        piece, _ = text.unread(cursor, final)
        if piece:
            yield piece
        if final is not None:
            return
