"""`Engine`: continuous batching over fixed cache slots, on the decode core's primitives.

One scheduler thread owns the decode state. Each iteration it
  - frees the slots of finished and cancelled requests,
  - gives queued requests free slots,
  - prefills the next chunk of up to `prefill_batch` waiting prompts in one dispatch (`extend`: at most
    `prefill_chunk` tokens of each, `max_step_tokens` in all), so that a long prompt holds the requests
    decoding for one chunk at a time, never for its whole prefill; before its first chunk a prompt copies the
    cached blocks of its prefix in (`linnet_jax.prefix_cache`), or waits for those another prompt is computing,
  - gives the requests that arrived meanwhile their free slots (so the decode dispatch below is one step),
  - advances every decoding slot `steps_per_dispatch` decode steps in one device call (fewer where steps are
    slow: a dispatch lasts about DISPATCH_SECONDS, so a request arriving meanwhile waits little for its prefill),
    or one step that verifies each slot's n-gram drafts (`linnet_jax.speculative`),
  - hands each request its new tokens.
A request with a grammar (`structured`, `linnet_jax.structured`) has its slot's mask of allowed tokens computed
on the host after each of its tokens, so a dispatch that carries one decodes one step, and its slot gets no
drafts; the other slots' masks allow every token, so the programs are the same with or without grammars.
Every dispatch's shape is a bucket (rows: powers of two up to prefill_batch; columns: `prefill_widths`, powers of
two from 16 up to prefill_chunk and three quarters of those from 128), so nothing compiles after `warmup()`;
`step_log` records what each carried.
With `loras`, requests may name an adapter (`submit(..., lora=NAME)`): every program takes the engine's adapter
table (`linnet_jax.adapters.AdapterTable`) and each row its entry, so a batch that mixes adapters is one dispatch,
and `load_lora` and `unload_lora` change the served set between dispatches without compiling anything. An
engine without `loras` has no table: its programs are those of the base model alone.
Requests are submitted from any thread (`submit`), or from asyncio (`Handle.__aiter__`); a full
queue refuses a request (`QueueFull`) rather than buffering it without bound. A request's tokens
are the ones `generate` gives for the same arguments: everything it owns lives in its slot.
If the scheduler thread fails (out of memory, say), every queued and running request ends with stop reason
"error", `failure` holds the exception, and the engine admits nothing more (`EngineFailed`). A request whose own
tokens cannot be taken (its grammar can never be completed, an adapter gave an id outside the vocabulary) ends
alone with "error", its handle's `failure` saying why, and the engine goes on.
Every device program the scheduler runs goes through one seam, `_run(program, *host inputs)`. With a `lockstep`
(`linnet_jax.serve.lockstep`), one engine spans several `jax.distributed` processes: the leader's `_run` first
sends the call to the followers, whose `follow()` runs the same calls on their part of the state; the programs read
their outputs back as replicated arrays (`sharding.hosts`), which every process reads alike. Without one, `_run`
sends nothing.
"""

import asyncio
import dataclasses
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np

from linnet_jax.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, AdapterTable
from linnet_jax.decode import TOP_LOGPROBS, TRACES, decode, free, scrub, verify
from linnet_jax.inputs import (MIN_BUCKET, RequestError, check_max_new_tokens, eos_ids, extend_rows, make_prompts,
                               new_slots, prefill_widths, sampling_options, seed_key)
from linnet_jax.loaded import Model
from linnet_jax.prefix_cache import PrefixCache
from linnet_jax.serve.lockstep import Lockstep
from linnet_jax.sharding import hosts
from linnet_jax.speculative import Ngram, check_fits, draft_arrays, propose, speculative_config
from linnet_jax.structured import Constraint, bitmasks, constraint, with_bitmasks
from linnet_jax.text import Cursor, Detokenizer, Generation, take


DEFAULT_MAX_LEN = 640  # positions per slot, or the model's context when that is shorter
CHOICES = 2**32  # the streams of one seed a request may draw (`choice`)
# A decode dispatch runs steps_per_dispatch steps, or as many as take about this long when steps are slow (at least
# one): a request arriving during a dispatch waits for its end before its prefill. SmolLM2's 16-row step on 2 CPU
# cores takes 90 ms, so there a dispatch is one step; a GPU's few-ms steps keep steps_per_dispatch.
DISPATCH_SECONDS = 0.1
# The device programs `_run` runs (each the method `_<name>`): all a follower of a multi-process engine runs.
PROGRAMS = frozenset({"agree", "compile_all", "extend", "decode", "verify", "free", "scrub", "masks", "restore",
                      "store"})


def powers_up_to(most: int) -> list[int]:
    """Powers of two below `most`, and `most`: the row counts a program is compiled for."""
    sizes = [1]
    while sizes[-1] * 2 < most:
        sizes.append(sizes[-1] * 2)
    return sizes + [most] * (sizes[-1] < most)


class QueueFull(RuntimeError):
    """The engine's queue holds max_queue requests already: try again later."""


class EngineFailed(RuntimeError):
    """The engine's scheduler thread failed (`Engine.failure` says why): it serves nothing more."""


@dataclasses.dataclass
class Piece:
    """New output of one request: text (held back while a stop string or a partial character may change it),
    the new token ids and their logprobs."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # per token, its top_logprobs most likely (id, logprob); or []


@dataclasses.dataclass(frozen=True)
class Step:
    """One dispatch, as `Engine.step_log` records it: its kind ("prefill", "decode" or "verify"), the requests it
    carried, the tokens it fed (prompt tokens; decoding rows × steps; decoding rows + drafts), the tokens
    it produced, the rows its program ran over (a bucket: padding rows and the slots past a decode's last
    running one included), and a prefill's columns (`Engine.prefill_widths`: its chunks padded to them; 0 for a
    decode or verify)."""

    kind: str
    rows: int
    tokens: int
    emitted: int
    program_rows: int
    program_width: int = 0


@dataclasses.dataclass
class Work:
    """A validated request waiting for, or holding, a slot."""

    prompt: list[int]
    request: object  # linnet_jax.decode.Request, one row
    top_logprobs: int  # how many alternatives to report beside each token (0: none)
    handle: "Handle"
    rule: Constraint | None  # its grammar, advanced by its tokens (None: unconstrained)
    prefilled: int = 0  # prompt tokens in the slot's cache
    adapter: int = 0  # its entry in the adapter table (0: the base model)
    prefix_key: bytes = b""  # its adapter's prefix-cache key (`AdapterTable.keys`)
    restored: int | None = None  # prompt tokens copied from the prefix cache (None: not looked up yet)

    @property
    def decoding(self) -> bool:
        """The prompt is prefilled (and its first token chosen)."""
        return self.prefilled == len(self.prompt)


class Handle:
    """One submitted request. Iterate it (or `async for`) for `Piece`s; `result()` for the `Generation`."""

    def __init__(self, engine: "Engine", prompt_tokens: int, stops: tuple[str, ...]):
        self.engine, self.prompt_tokens = engine, prompt_tokens
        self.text = Detokenizer(engine.model.tokenizer, stops)  # the ids so far, and their text
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.generation: Generation | None = None
        self.failure: Exception | None = None  # why it ended with "error": the engine's failure, or its own
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._changed = threading.Condition()
        self._listeners: list[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        return self.generation is not None

    @property
    def tokens(self) -> list[int]:
        """The ids generated so far (the stop id that ended the request aside)."""
        return self.text.ids

    def cancel(self) -> None:
        """Stop generating: the slot is freed before the engine's next decode dispatch."""
        self.cancelled = True
        self.engine.wake()

    def result(self, timeout: float | None = None) -> Generation:
        """The finished Generation (waits for it); stop_reason "cancelled" when cancelled."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"the request did not finish within {timeout} s")
        return self.generation

    def _news(self, cursor: Cursor) -> bool:
        return self.done or self.text.shown > cursor.point

    def __iter__(self) -> Iterator[Piece]:
        cursor = Cursor()
        while not cursor.done:
            with self._changed:
                self._changed.wait_for(lambda: self._news(cursor))
            piece = self._next_piece(cursor)
            if piece is not None:
                yield piece

    async def __aiter__(self) -> AsyncIterator[Piece]:
        loop, changed = asyncio.get_running_loop(), asyncio.Event()
        notify = lambda: loop.call_soon_threadsafe(changed.set)  # noqa: E731
        with self._changed:
            self._listeners.append(notify)
        cursor = Cursor()
        try:
            while not cursor.done:
                if not self._news(cursor):
                    await changed.wait()
                changed.clear()
                piece = self._next_piece(cursor)
                if piece is not None:
                    yield piece
        finally:
            with self._changed:
                self._listeners.remove(notify)

    def _next_piece(self, cursor: Cursor) -> Piece | None:
        """What is new since `cursor` (moved on), or None. Text that a stop string or a partial character may still
        change is held back, with its tokens; the final piece ends exactly at the Generation's text and tokens."""
        with self._changed:
            final = self.generation
            text, ids = self.text.unread(cursor, final)
            tokens = (final.tokens if final else self.text.ids)[ids]
            logprobs = (final.logprobs if final else self.logprobs)[ids]
            piece = Piece(text=text, tokens=tokens, logprobs=logprobs, top_logprobs=self.top[ids])
        return piece if (piece.text or piece.tokens) else None

    def _add(self, tokens: list[int], logprobs: list[float], top: list, finish: int, eos: set[int],
             rule: Constraint | None) -> str | None:
        """A dispatch's new tokens of this request (finish: its row's state after them), detokenized here on the
        scheduler thread (and its grammar advanced); returns why the request stopped (`linnet_jax.text.take`), or
        None while it runs."""
        with self._changed:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            kept, reason = take(self.text, tokens, finish, eos, rule)
            self.logprobs += logprobs[:kept]
            self.top += top[:kept]
        self._notify()
        return reason

    def _finish(self, reason: str) -> None:
        """The request's Generation, as generate makes it. reason: "eos", "stop", "length", "cancelled" or
        "error" (`failure` says why)."""
        with self._changed:
            self.generation = self.text.generation(reason, self.logprobs)
        self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
            listeners = list(self._listeners)
        for notify in listeners:
            notify()


class Engine:
    """Continuous batching over `slots` cache rows of `max_len` positions each (see the module docstring).

    engine = Engine(model, slots=16, max_len=640, max_queue=256)
    handle = engine.submit("Hello", max_tokens=32)   # a prompt, a conversation or token ids
    for piece in handle: print(piece.text, end="")
    engine.close()

    prefill_batch: prompts prefilled together in one dispatch; prefill_chunk: the most tokens of one prompt in
    a dispatch (longer prompts take several, decode dispatches running between them); max_step_tokens: the
    most tokens (rows × columns, padding included) one prefill dispatch carries (default prefill_batch ×
    prefill_chunk). prefix_cache: keep prompts' leading blocks of prefix_block tokens (at most
    prefix_cache_gb GiB) and copy them into slots of prompts that start the same way. speculative: n-gram
    drafts verified in one forward (`linnet_jax.speculative`; vLLM's speculative_config names).
    loras: {name: a PEFT adapter directory's path, or a Lora} served beside the base model ({} for none yet: adapters
    loaded later, `load_lora`); None: no adapters, no table. max_loras: the most adapters loaded at once (the table
    holds them and the base's zeros); max_lora_rank: the largest rank taken (lower ones are zero-padded to it).
    lockstep: this process's end of a multi-process engine (`linnet_jax.serve.lockstep.Lockstep`; the model on a
    mesh over every process's devices, every process making its engine with the same settings): the leader's
    engine schedules and serves, a follower's runs the leader's programs (`follow`). Adapters are refused with one.
    """

    def __init__(self, model: Model, slots: int = 16, max_len: int | None = None, max_queue: int = 256, *,
                 steps_per_dispatch: int = 8, prefill_batch: int = 4, prefill_chunk: int = 256,
                 max_step_tokens: int | None = None, prefix_cache: bool = True, prefix_block: int = 64,
                 prefix_cache_gb: float = 1.0, speculative: dict | Ngram | None = None, loras: dict | None = None,
                 max_loras: int = DEFAULT_MAX_LORAS, max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
                 lockstep: Lockstep | None = None):
        max_step_tokens = prefill_batch * prefill_chunk if max_step_tokens is None else max_step_tokens
        max_len = min(DEFAULT_MAX_LEN, model.config.max_position_embeddings) if max_len is None else max_len
        for name, value in (("slots", slots), ("max_len", max_len), ("max_queue", max_queue),
                            ("steps_per_dispatch", steps_per_dispatch), ("prefill_batch", prefill_batch),
                            ("prefill_chunk", prefill_chunk), ("max_step_tokens", max_step_tokens),
                            ("prefix_block", prefix_block)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not MIN_BUCKET <= max_len <= model.config.max_position_embeddings:
            raise ValueError(f"max_len must be in [{MIN_BUCKET}, {model.config.max_position_embeddings}] (the model's "
                             f"context), got {max_len}")
        if prefill_chunk < MIN_BUCKET or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two ≥ {MIN_BUCKET}, got {prefill_chunk}")
        if max_step_tokens < prefill_chunk:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must hold one chunk: ≥ prefill_chunk "
                             f"({prefill_chunk})")
        if lockstep is not None and loras is not None:
            raise ValueError("loras are not served by a multi-process engine (lockstep): its followers would need "
                             "every adapter's weights; serve adapters from one process")
        if not isinstance(prefix_cache_gb, (int, float)) or isinstance(prefix_cache_gb, bool) \
                or not 0 < prefix_cache_gb < float("inf"):
            raise ValueError(f"prefix_cache_gb must be a finite number > 0, got {prefix_cache_gb!r}")
        self.model, self.max_len, self.max_queue, self.lockstep = model, int(max_len), int(max_queue), lockstep
        self.eos = eos_ids(model)
        self.steps, self.prefill_batch = int(steps_per_dispatch), int(prefill_batch)
        self.prefill_chunk, self.max_step_tokens = int(prefill_chunk), int(max_step_tokens)
        self.speculative = speculative_config(speculative)
        check_fits(self.speculative, int(slots), self.max_len, self.max_step_tokens)
        self.adapters = None if loras is None else AdapterTable(model, max_loras, max_lora_rank)
        if loras is not None and len(loras) > self.adapters.max_loras:
            raise ValueError(f"{len(loras)} loras given, more than max_loras={self.adapters.max_loras}")
        adapters = {name: (source, self.adapters.read(source)) for name, source in (loras or {}).items()}
        self.state = new_slots(model, int(slots), self.max_len)
        self._masked = False  # whether the state's masks hold a grammar's (else every token is allowed)
        self.prefixes = PrefixCache(model, self.max_len, int(prefix_block), prefix_cache_gb,
                                    most=16 * int(slots) * (self.max_len // int(prefix_block))) if prefix_cache else None
        self.owners: list[Work | None] = [None] * int(slots)
        self.queue: deque[Work] = deque()
        self.counters = {"tokens_generated": 0, "requests_finished": 0}
        self.step_log: deque[Step] = deque(maxlen=65536)  # the latest dispatches
        self.on_finish: list[Callable[[Handle], None]] = []  # metrics hooks, called on the scheduler thread
        self.on_failure: list[Callable[[Exception], None]] = []  # called on the scheduler thread when it fails
        self.failure: Exception | None = None
        self.warm_traces: int | None = None
        self._step_seconds = 0.0  # the last decode dispatch's time per step (0: none yet)
        self._tasks: deque[Callable[[], None]] = deque()  # work run on the scheduler thread (warmup)
        self._wake = threading.Condition()
        self._closing = self._stopped = self._hurried = False
        self._thread = threading.Thread(target=self._loop, name="linnet-jax-engine", daemon=True)
        if lockstep is None or lockstep.leader:  # a follower runs the leader's calls instead (`follow`)
            self._thread.start()
        for name, (source, lora) in adapters.items():
            self._install(name, source, lora)
        if lockstep is not None and lockstep.leader:  # first of all, the followers check their settings
            self._on_scheduler(lambda: self._run("agree", self._settings()))

    # --- the public API --------------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return len(self.owners)

    def submit(self, prompt=None, *, tokens=None, max_tokens: int | None = None, temperature=0.0, top_k=0, top_p=1.0,
               min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None,
               seed: int | None = None, choice: int = 0, stop=None, stop_token_ids=None, ignore_eos: bool = False,
               chat: bool | None = None, top_logprobs: int = 0, structured=None, lora: str | None = None) -> Handle:
        """Queue one request: a prompt (text or a conversation) or `tokens` (ids). Returns its Handle.

        max_tokens: at most what the slot has room for (max_len minus the prompt), which is the default; a larger
        budget is clamped to it, finishing with "length" as vLLM does. seed: None draws one
        at random for a sampled request; choice i draws stream i of the seed (OpenAI's n), as row i of
        `generate(..., seed=seed)` does (its key alone is made, whatever the choice). top_logprobs: report that many
        most likely tokens (≤ TOP_LOGPROBS) beside each. presence_penalty, frequency_penalty, logit_bias and
        structured (a grammar the output follows) as `generate` takes them, for one prompt. lora: the name of a
        loaded adapter (None: the base model). A RequestError (a ValueError) names the field that is wrong;
        QueueFull when the queue is full; EngineFailed once the scheduler has failed.
        """
        prompts = make_prompts(self.model, prompt, tokens, chat)
        if len(prompts.prompts) != 1:
            raise RequestError("prompt", "submit takes one prompt (a string, a conversation or a list of ids)")
        ids = prompts.prompts[0]
        if len(ids) >= self.max_len:
            raise RequestError("prompt", f"the prompt has {len(ids)} tokens; the engine's slots hold "
                                         f"max_len={self.max_len} positions, prompt and new tokens together")
        room = self.max_len - len(ids)
        max_tokens = room if max_tokens is None else min(check_max_new_tokens(max_tokens, "max_tokens"), room)
        if isinstance(choice, bool) or not isinstance(choice, (int, np.integer)) or not 0 <= choice < CHOICES:
            raise RequestError("choice", f"choice must be an int in [0, 2**32) (a stream of the seed), got {choice!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer)) \
                or not 0 <= top_logprobs <= TOP_LOGPROBS:
            raise RequestError("top_logprobs", f"top_logprobs must be an int in [0, {TOP_LOGPROBS}], "
                                               f"got {top_logprobs!r}")
        seed = secrets.randbits(63) if seed is None else seed
        options = sampling_options(self.model, 1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                   repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                   frequency_penalty=frequency_penalty, logit_bias=logit_bias, seed=seed, stop=stop,
                                   stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        stream = dataclasses.replace(options.sampling, keys=seed_key(seed, int(choice))[None])  # row `choice`'s key
        options = dataclasses.replace(options, sampling=stream)
        work = Work(prompt=ids, request=options.requests(max_tokens), top_logprobs=int(top_logprobs),
                    handle=Handle(self, len(ids), options.stops),
                    rule=None if structured is None else constraint(self.model, structured))
        with self._wake:
            self.check_alive()
            if self._closing:
                raise RuntimeError("the engine is shutting down: it admits no new requests")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"the queue holds max_queue={self.max_queue} requests; try again later")
            if lora is not None:
                work.adapter, work.prefix_key = self._adapter_entry(lora)
                work.request = work.request.replace(adapter=np.full((1,), work.adapter, np.int32))
            self.queue.append(work)
            self._wake.notify_all()
        return work.handle

    def _adapter_entry(self, lora: str | None) -> tuple[int, bytes]:
        """(Under the lock) the table entry and prefix-cache key of adapter `lora`; a RequestError naming `lora`
        when the engine serves no adapter of that name."""
        if self.adapters is None:
            raise RequestError("lora", f"this engine serves no adapters (made without loras), got lora={lora!r}")
        return self.adapters.entry(lora)

    def load_lora(self, name: str, source) -> None:
        """Serve adapter `source` (a PEFT adapter directory's path, or a Lora) as `name` from now on, while requests
        run: its entry of the table is written between two dispatches, which compiles nothing. A RequestError
        (a ValueError) naming `lora_path` or `lora_name` when the adapter does not fit the model or the table
        (rank above max_lora_rank, targets the model lacks, another base's shapes), the name is taken or the
        table is full."""
        if self.adapters is None:
            raise RequestError("lora_name", "this engine serves no adapters: make it with loras={} (or --max-loras)")
        self._install(name, source, self.adapters.read(source))

    def _install(self, name: str, source, lora) -> None:
        with self._wake:
            entry = self.adapters.reserve(name, self._entries_in_use())
        try:
            self._on_scheduler(lambda: self.adapters.put(entry, lora))
        except BaseException:
            with self._wake:
                self.adapters.held[entry] = None
            raise
        with self._wake:
            self.adapters.publish(name, entry, source)

    def unload_lora(self, name: str) -> None:
        """Serve adapter `name` no more: new requests naming it are refused; the ones queued or running finish with
        it (its entry is reused once they have). A RequestError naming `lora_name` when none of that name is
        loaded."""
        if self.adapters is None:
            raise RequestError("lora_name", "this engine serves no adapters (made without loras)")
        with self._wake:
            self.adapters.release(name)

    @property
    def loras(self) -> dict[str, str | None]:
        """The adapters served: {name: its PEFT directory (None when given as a Lora)}."""
        if self.adapters is None:
            return {}
        with self._wake:
            return dict(self.adapters.sources)

    def _entries_in_use(self) -> set[int]:
        """(Under the lock) the table entries of queued and running requests."""
        return {work.adapter for work in (*self.queue, *self.owners) if work is not None}

    def warmup(self) -> None:
        """Compile every program the engine uses (each prefill shape, decode and verify with and without top
        logprobs, free, the prefix cache's copies, the adapter table's entry writes), then count compiles from here
        on (`compiles_after_warmup`). Each program runs once over rows that hold nothing, which changes no request.
        EngineFailed if the scheduler fails meanwhile (out of memory, say)."""
        self._on_scheduler(lambda: self._run("compile_all"))
        self.warm_traces = sum(TRACES.values())

    def _on_scheduler(self, task: Callable[[], None]) -> None:
        """Run `task` on the scheduler thread, between two dispatches, and wait for it. EngineFailed if the
        scheduler fails meanwhile (out of memory, say)."""
        done = []

        def run():
            task()
            with self._wake:
                done.append(True)
                self._wake.notify_all()

        with self._wake:
            self._tasks.append(run)
            self._wake.notify_all()
            self._wake.wait_for(lambda: done or self.failure is not None or self._stopped)
            self.check_alive()
            if not done:
                raise RuntimeError("the engine has stopped")

    def _compile_all(self) -> None:
        """Run each program once over rows that hold nothing (`warmup`)."""
        model, nothing = self.model, self.slots  # a row past the state: writes nothing
        request = sampling_options(model, 1).requests(1)
        for rows in self.row_buckets():
            for width in self.prefill_widths():
                for start in (0, 1):  # a prompt's first chunk (its own keys only), and a later one
                    self._extend([nothing], [[0]], [start], [request], [False], rows, width)
        for top in (False, True):
            for rows in self.decode_row_buckets():
                self._decode(top, self.steps, rows)
                if self.speculative:
                    self._verify([[]] * self.slots, top, rows)
        self._free(0)
        self._scrub(nothing)
        if self.prefixes:
            self.state = self.prefixes.compile(self.state)
        if self.adapters is not None:
            self.adapters.put(0, None)  # the base's entry: zeros again

    def row_buckets(self) -> list[int]:
        """The rows of a prefill dispatch: powers of two up to prefill_batch, and prefill_batch."""
        return powers_up_to(self.prefill_batch)

    def prefill_widths(self) -> list[int]:
        """The columns of a prefill dispatch (`inputs.prefill_widths` of its chunk and slots)."""
        return prefill_widths(self.prefill_chunk, self.max_len)

    def decode_row_buckets(self) -> list[int]:
        """The leading rows a decode dispatch runs over: powers of two up to the slots, and the slots (all of them
        on a mesh, whose devices each hold a share of the rows)."""
        return powers_up_to(self.slots) if self.model.layout is None else [self.slots]

    @property
    def compiles_after_warmup(self) -> int | None:
        """Programs traced since `warmup()` (None before it): a warm engine compiles nothing."""
        return None if self.warm_traces is None else sum(TRACES.values()) - self.warm_traces

    def stats(self) -> dict[str, int]:
        """Running and queued requests, busy slots, tokens generated and requests finished so far, and the prefix
        cache's lookups and hits in tokens."""
        with self._wake:
            busy = sum(owner is not None for owner in self.owners)
            prefixes = self.prefixes
            return {"running": busy, "queued": len(self.queue), "busy_slots": busy, "slots": self.slots,
                    **self.counters, "prefix_cache_hit_tokens": prefixes.hit_tokens if prefixes else 0,
                    "prefix_cache_lookup_tokens": prefixes.lookup_tokens if prefixes else 0}

    @property
    def closing(self) -> bool:
        """Whether the engine has stopped admitting requests (closed, closing, or failed)."""
        return self._closing

    def wake(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def check_alive(self) -> None:
        """EngineFailed once the scheduler thread has failed."""
        if self.failure is not None:
            raise EngineFailed(f"the engine failed: {type(self.failure).__name__}: {self.failure}") from self.failure

    def close(self, deadline: float | None = None) -> None:
        """Stop admitting; let running requests finish (cancelling what is left after `deadline` seconds;
        None cancels at once; `hurry()` cuts the wait short), and stop the scheduler thread."""
        with self._wake:
            self._closing = True
            for work in self.queue:
                work.handle.cancelled = True
            self._wake.notify_all()
        end = time.monotonic() + (deadline or 0)
        while any(self.owners) and not self._hurried and time.monotonic() < end:
            time.sleep(0.02)
        for work in self.owners:
            if work is not None:
                work.handle.cancel()
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        self._thread.join()

    def hurry(self) -> None:
        """Make a close() that waits for running requests cancel them now. It only sets a flag, so a signal
        handler may call it."""
        self._hurried = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the scheduler ---------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._schedule()
        except Exception as error:  # any failure must reach the waiting requests, never strand them
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        """The scheduler failed: admit nothing more, end every queued and running request with "error", and call
        the on_failure hooks."""
        with self._wake:
            self.failure, self._closing = error, True
            failed = [*self.queue, *(work for work in self.owners if work is not None)]
            self.queue.clear()
            self.owners = [None] * len(self.owners)
            self._wake.notify_all()
        for work in failed:
            work.handle.failure = error
            work.handle._finish("error")
        for hook in self.on_failure:
            hook(error)

    def _schedule(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopped or self.queue or any(self.owners) or self._tasks)
                if self._stopped and not any(self.owners) and not self.queue:
                    return
                tasks, self._tasks = list(self._tasks), deque()
            for task in tasks:
                task()
            self._release()
            self._admit()
            self._prefill()
            if any(work is not None and work.decoding for work in self.owners):
                self._dispatch()

    def _release(self) -> None:
        """Free the slots of cancelled requests, and drop cancelled ones from the queue."""
        with self._wake:
            for work in [w for w in self.queue if w.handle.cancelled]:
                self.queue.remove(work)
                self._finish(work, "cancelled")
        for slot, work in enumerate(self.owners):
            if work is not None and work.handle.cancelled:
                self._vacate(slot, "cancelled")

    def _admit(self) -> None:
        """Give queued requests the free slots (a request cancelled while queued ends, without one)."""
        while True:
            slot = next((s for s, owner in enumerate(self.owners) if owner is None), None)
            with self._wake:
                if slot is None or not self.queue:
                    return
                work = self.queue.popleft()
                if work.handle.cancelled:
                    self._finish(work, "cancelled")
                else:
                    self.owners[slot] = work

    def _leading_block(self, work: Work) -> tuple | None:
        """The prompt's first prefix-cache block with its adapter's key, where the prompt could reuse it."""
        block = self.prefixes.block
        return (work.prefix_key, *work.prompt[:block]) if len(work.prompt) > block else None

    def _ready(self, slot: int, work: Work, waiting: list[tuple[int, Work]]) -> bool:
        """Whether the waiting prompt can prefill now, with its cached prefix blocks copied in the first time. One
        that starts with the block another prompt is computing (a burst sharing a system prompt) waits for it to be
        stored, then copies it instead of computing it again."""
        if work.restored is not None or not self.prefixes:
            return True
        leading = self._leading_block(work)
        if leading is not None and any(other.restored == 0 and self._leading_block(other) == leading
                                       for _, other in waiting):
            return False
        work.restored = work.prefilled = self._run("restore", slot, work.prompt, work.prefix_key)
        return True

    def _prefill(self) -> None:
        """The next chunks of the waiting prompts, in one dispatch of at most prefill_batch rows and
        max_step_tokens tokens (`_fill`); the prompts it completes get their first token."""
        waiting = [(slot, work) for slot, work in enumerate(self.owners) if work is not None and not work.decoding]
        waiting.sort(key=lambda item: item[1].handle.submitted)
        ready = [item for item in waiting if self._ready(*item, waiting)]
        if not ready:
            return
        chosen, width = self._fill(ready)
        rows = self._rows_for(len(chosen))
        self._allow()
        columns = self._run(
            "extend", [slot for slot, _, _ in chosen],
            [work.prompt[work.prefilled:work.prefilled + n] for _, work, n in chosen],
            [work.prefilled for _, work, _ in chosen], [work.request for _, work, _ in chosen],
            [work.prefilled + n == len(work.prompt) for _, work, n in chosen], rows, width)
        done = []
        for slot, work, n in chosen:
            work.prefilled += n
            if work.decoding:
                done.append((slot, work))
        self.step_log.append(Step("prefill", len(chosen), sum(n for _, _, n in chosen), len(done), rows, width))
        if not done:
            return
        token, logprob, top_ids, top_logprobs, finish = columns
        for slot, work in done:
            if self.prefixes:
                self._run("store", slot, work.prompt, work.prefix_key)
            self._deliver(slot, [int(token[slot])], [float(logprob[slot])],
                          self._top(work, top_ids[slot][None], top_logprobs[slot][None]), int(finish[slot]))

    def _chunk(self, work: Work) -> int:
        """The prompt's next chunk: its tokens left, at most prefill_chunk."""
        return min(len(work.prompt) - work.prefilled, self.prefill_chunk)

    def _fill(self, ready: list[tuple[int, Work]]) -> tuple[list[tuple[int, Work, int]], int]:
        """The chunks of one prefill dispatch, (slot, work, length) each, and its width. The oldest waiting prompt
        always goes (first come, first served), its chunk setting the width; the others that fill that width best
        join it: first those of its kind (a first chunk, whose attention reads its own keys only, or a later
        one), the longest that fit; then longer ones, cut to the width. The dispatch keeps the leading ones that
        give the most tokens per row, counting one row more for what any dispatch costs besides its rows: padding
        is compute spent on nothing, and every dispatch brings a decode step after it."""
        (slot, head), others = ready[0], ready[1:]
        width = next(width for width in self.prefill_widths() if width >= self._chunk(head))
        others.sort(key=lambda item: (bool(item[1].prefilled) != bool(head.prefilled),
                                      self._chunk(item[1]) > width, width - self._chunk(item[1])))
        chosen = [(slot, head, self._chunk(head))]
        for slot, work in others[:self.prefill_batch - 1]:
            if self._rows_for(len(chosen) + 1) * width > self.max_step_tokens:
                break
            chosen.append((slot, work, min(self._chunk(work), width)))
        filled = lambda count: sum(n for _, _, n in chosen[:count]) / (self._rows_for(count) + 1)  # noqa: E731
        return chosen[:max(range(1, len(chosen) + 1), key=lambda count: (filled(count), count))], width

    def _rows_for(self, count: int) -> int:
        """The prefill rows bucket that holds `count` prompts."""
        return next(size for size in self.row_buckets() if size >= count)

    @property
    def _table(self):
        """The adapter table the programs take (None: no adapters)."""
        return self.adapters and self.adapters.table

    # --- the device programs: each runs through `_run` (the seam), takes host inputs and returns host values ---

    def _run(self, program: str, *inputs):
        """Run device program `_<program>(*inputs)` (one of PROGRAMS) on this process's state; the leader of a
        multi-process engine first sends the call to its followers, which run it too (`follow`)."""
        if self.lockstep is not None:
            self.lockstep.send(program, inputs)
        return getattr(self, f"_{program}")(*inputs)

    def follow(self) -> None:
        """(A follower of a multi-process engine) run the leader's calls, in its order, until the leader stops."""
        if self.lockstep is None or self.lockstep.leader:
            raise RuntimeError("follow() is for a follower process's engine (made with a follower's lockstep)")
        for program, inputs in self.lockstep.calls():
            if program not in PROGRAMS:
                raise ValueError(f"the leader sent an unknown program {program!r}; expected one of {sorted(PROGRAMS)}")
            getattr(self, f"_{program}")(*inputs)

    def _settings(self) -> dict:
        """What the engines of a multi-process run must share: the model and every program's shapes."""
        return {"model": repr(self.model), "slots": self.slots, "max_len": self.max_len,
                "steps_per_dispatch": self.steps, "prefill_batch": self.prefill_batch,
                "prefill_chunk": self.prefill_chunk, "max_step_tokens": self.max_step_tokens,
                "prefix_cache": self.prefixes and [self.prefixes.block, self.prefixes.capacity],
                "speculative": repr(self.speculative)}

    def _agree(self, settings: dict) -> None:
        """A ValueError naming each setting in which this process's engine differs from the leader's (`settings`)."""
        differ = [f"{name} {value!r} here, {settings.get(name)!r} on the leader"
                  for name, value in self._settings().items() if settings.get(name) != value]
        if differ:
            raise ValueError(f"this process's engine differs from the leader's: {'; '.join(differ)} (start every "
                             f"process with the same flags)")

    def _extend(self, rows: list[int], chunks: list[list[int]], starts: list[int], requests: list, last: list[bool],
                height: int, width: int) -> tuple[np.ndarray, ...] | None:
        """Prompt chunks into rows of the state (`inputs.extend_rows`). Where a chunk ends its prompt, the state's
        token, logprob, top_ids, top_logprobs and finish columns on the host (else None)."""
        self.state = extend_rows(self.model, self.state, rows, chunks, starts, requests, last, height, width,
                                 self._table)
        if any(last):
            state = self.state
            return hosts(state.token, state.logprob, state.top_ids, state.top_logprobs, state.finish)
        return None

    def _decode(self, top: bool, steps: int, rows: int) -> tuple[np.ndarray | None, ...]:
        """Up to `steps` decode steps of every running slot, all among the first `rows`; what they emitted
        (`_emitted`)."""
        model = self.model
        self.state, emitted = decode(model.decode_params, model.config, self.state, np.int32(steps), self.steps,
                                     model.layout and model.layout.constrain, top, model.plan, lora=self._table,
                                     rows=rows)
        return self._emitted(emitted, top)

    def _verify(self, drafts: list[list[int]], top: bool, rows: int) -> tuple[np.ndarray | None, ...]:
        """One step verifying each slot's drafts, every running slot among the first `rows`; what it emitted
        (`_emitted`)."""
        model = self.model
        tokens, counts = draft_arrays(drafts, self.speculative.num_speculative_tokens)
        self.state, emitted = verify(model.decode_params, model.config, self.state, tokens, counts,
                                     model.layout and model.layout.constrain, top, model.plan, lora=self._table,
                                     rows=rows)
        return self._emitted(emitted, top)

    def _emitted(self, emitted, top: bool) -> tuple[np.ndarray | None, ...]:
        """(tokens [B, n], logprobs [B, n], counts [B], the state's finish [B], top ids and top logprobs
        [B, n, TOP_LOGPROBS] or None unless `top`) on the host."""
        columns = (emitted.tokens, emitted.logprobs, emitted.count, self.state.finish)
        values = hosts(*columns, *((emitted.top_ids, emitted.top_logprobs) if top else ()))
        return values if top else (*values, None, None)

    def _free(self, slot: int) -> None:
        self.state = free(self.state, np.int32(slot))

    def _scrub(self, slot: int) -> None:
        self.state = scrub(self.state, np.int32(slot))

    def _masks(self, masks: np.ndarray) -> None:
        """Each slot's bitmask of allowed tokens [B, W] into the state."""
        self.state = with_bitmasks(self.state, masks)

    def _restore(self, slot: int, prompt: list[int], key: bytes) -> int:
        """The prompt's cached prefix blocks copied into the slot; returns how many tokens they hold."""
        hit = self.prefixes.lookup(prompt, key)
        if hit:
            self.state = self.prefixes.restore(self.state, slot, prompt, hit)
        return len(hit) * self.prefixes.block

    def _store(self, slot: int, prompt: list[int], key: bytes) -> None:
        """The slot's prefilled prompt's whole blocks into the prefix cache."""
        self.prefixes.store(self.state, slot, prompt, key)

    def _allow(self) -> None:
        """Each slot's mask of the tokens its request's grammar allows next (every token for the others) into the
        decode state, while any request has a grammar, and once more after the last one has gone."""
        rules = [None if work is None else work.rule for work in self.owners]
        if self._masked or any(rules):
            self._run("masks", bitmasks(rules, self.model.config.vocab_size))
            self._masked = any(rules)

    def _drafts(self) -> list[list[int]]:
        """Each decoding slot's n-gram drafts (none past its room), [] for the others and for constrained slots."""
        drafts = []
        for work in self.owners:
            if work is None or not work.decoding or work.rule is not None:
                drafts.append([])
                continue
            history = work.prompt + work.handle.tokens
            drafts.append(propose(history, self.speculative, self.max_len - len(history)))
        return drafts

    def _dispatch(self) -> None:
        """steps_per_dispatch decode steps over every decoding slot (fewer where that would take over
        DISPATCH_SECONDS; one while a prompt waits for the next prefill dispatch: it joins the decoding rows sooner;
        one while a slot's grammar needs its next mask), or one step verifying their drafts; hand out the tokens. A
        request that arrived during the prefill dispatch takes its free slot first, so it too waits one step."""
        self._admit()
        top = any(work is not None and work.top_logprobs for work in self.owners)
        drafts = self._drafts() if self.speculative else []
        rows, program_rows = sum(work is not None and work.decoding for work in self.owners), self._decode_rows()
        self._allow()
        if any(drafts):
            tokens, logprobs, counts, finish, top_ids, top_logprobs = self._run("verify", drafts, top, program_rows)
            kind, fed = "verify", rows + sum(map(len, drafts))
        else:
            single = any(work is not None and (not work.decoding or work.rule is not None) for work in self.owners)
            steps = 1 if single else self._decode_steps()
            start = time.perf_counter()
            tokens, logprobs, counts, finish, top_ids, top_logprobs = self._run("decode", top, steps, program_rows)
            self._step_seconds = (time.perf_counter() - start) / steps
            kind, fed = "decode", rows * steps
        self.step_log.append(Step(kind, rows, fed, int(counts.sum()), program_rows))
        for slot, work in enumerate(self.owners):
            if work is not None and counts[slot]:
                n = counts[slot]
                alternatives = self._top(work, top_ids[slot, :n], top_logprobs[slot, :n]) if top else []
                self._deliver(slot, tokens[slot, :n].tolist(), logprobs[slot, :n].tolist(), alternatives,
                              int(finish[slot]))

    def _decode_rows(self) -> int:
        """The fewest leading rows (`decode_row_buckets`) that hold every decoding slot: slots are given lowest
        first, so a lone request decodes at the cost of one row, not of every slot."""
        last = max(slot for slot, work in enumerate(self.owners) if work is not None and work.decoding)
        return next(rows for rows in self.decode_row_buckets() if rows > last)

    def _decode_steps(self) -> int:
        """steps_per_dispatch, or as many steps as the last decode dispatch's took DISPATCH_SECONDS for (≥ 1)."""
        if not self._step_seconds:
            return self.steps
        return max(1, min(self.steps, int(DISPATCH_SECONDS / self._step_seconds)))

    @staticmethod
    def _top(work: Work, ids: np.ndarray, logprobs: np.ndarray) -> list[list[tuple[int, float]]]:
        """Per token, the request's top_logprobs most likely (id, logprob) pairs ([] when it asked for none)."""
        if not work.top_logprobs:
            return []
        k = work.top_logprobs
        return [list(zip(row_ids[:k].tolist(), row_logprobs[:k].tolist())) for row_ids, row_logprobs in zip(ids, logprobs)]

    def _deliver(self, slot: int, tokens: list[int], logprobs: list[float], top: list, finish: int) -> None:
        """A slot's new tokens to its request (finish: its row's finish state after them); the request finished
        when its row did or a stop string appeared, and failed alone (stop reason "error", its handle's `failure`)
        when they cannot be taken. A stop id that finished the row never reaches the stream."""
        self.counters["tokens_generated"] += len(tokens)
        work = self.owners[slot]
        try:
            reason = work.handle._add(tokens, logprobs, top, finish, self.eos, work.rule)
        except Exception as error:  # its own tokens or grammar (an id outside the vocabulary, a grammar that can
            work.handle.failure, reason = error, "error"  # never be completed): it fails alone, the others go on
        if reason is not None:
            self._vacate(slot, reason)

    def _vacate(self, slot: int, reason: str) -> None:
        """Free the slot (its keys and values zeroed after a request that failed) and finish its request."""
        self._run("scrub" if reason == "error" else "free", slot)
        with self._wake:
            work, self.owners[slot] = self.owners[slot], None
        self._finish(work, reason)

    def _finish(self, work: Work, reason: str) -> None:
        """The request's Generation, as generate makes it. reason: "eos", "stop", "length", "cancelled" or "error"."""
        self.counters["requests_finished"] += 1
        work.handle._finish(reason)
        for hook in self.on_finish:
            hook(work.handle)
