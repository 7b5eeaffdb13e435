"""`Engine`: continuous batching over a paged KV cache, one token-packed step per dispatch (DESIGN.md decision 20).

The engine is three parts around a step plan, as vLLM v1 splits its own (`schedule() -> SchedulerOutput`,
`execute_model`, `update_from_output`):
  - the policy, `linnet_jax.serve.scheduler.Scheduler` (no JAX): admission by the pages a request may need,
    chunking, n-gram drafts, the prefix cache as shared pages (`linnet_jax.serve.pages.PagePool`); it returns a
    plain-data `StepPlan` and `update(plan, result)` gives each request its tokens and finish;
  - the device side, `linnet_jax.serve.runner.PagedRunner`: the pool of pages, each row's request state and the
    adapter table; it runs a plan in one dispatch and reads its results back once;
  - this class: the scheduler thread and its lifecycle, the requests' `Handle`s (`linnet_jax.serve.handle`), their
    grammars and adapters, failures, and lockstep.

One scheduler thread owns the state. Each iteration it takes the requests that arrived, drops cancelled ones, asks
the scheduler for a plan (every decoding request's next token, or its last token and its drafts, then the next
chunks of waiting prompts, at most `max_step_tokens` tokens in all), sets the rows' grammar masks, runs the plan in
one dispatch and hands each request its new tokens. A request that needs more pages than the pool can promise now
waits for running ones to finish (nothing is preempted, nothing fails); one that could never fit is refused at
`submit`. Every program's shape is a bucket (the step's tokens: powers of two from 16 up to max_step_tokens), so
nothing compiles after `warmup()`; `step_log` records what each step carried.
A request with a grammar (`structured`, `linnet_jax.structured`) has its row's mask of allowed tokens computed on the
host after each of its tokens, and no drafts; the other rows' masks allow every token, so the programs are the same
with or without grammars.
With `loras`, requests may name an adapter (`submit(..., lora=NAME)`): the step takes the engine's adapter table
(`linnet_jax.adapters.AdapterTable`) and each token its request's entry, so a step that mixes adapters is one
dispatch, and `load_lora` and `unload_lora` change the served set between steps without compiling anything.
Requests are submitted from any thread (`submit`), or from asyncio (`Handle.__aiter__`); a full queue refuses a
request (`QueueFull`) rather than buffering it without bound. A request's tokens are the ones `generate` gives for
the same arguments: everything it owns lives in its row and its pages.
If the scheduler thread fails (out of memory, say), every queued and running request ends with stop reason
"error", `failure` holds the exception, and the engine admits nothing more (`EngineFailed`). A request whose own
tokens cannot be taken (its grammar can never be completed, an adapter gave an id outside the vocabulary) ends
alone with "error", its handle's `failure` saying why, its pages zeroed, and the engine goes on.
Every device program the scheduler runs goes through one seam, `_run(program, *host inputs)`. With a `lockstep`
(`linnet_jax.serve.lockstep`), one engine spans several `jax.distributed` processes: the leader's `_run` first
sends the call (a step's plan as host arrays) to the followers, whose `follow()` runs the same calls on their part
of the state. Without one, `_run` sends nothing.
"""

import dataclasses
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from linnet_jax.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, AdapterTable
from linnet_jax.decode import TOP_LOGPROBS, TRACES
from linnet_jax.inputs import RequestError, check_max_new_tokens, eos_ids, make_prompts, sampling_options, seed_key
from linnet_jax.loaded import Model
from linnet_jax.serve.handle import Handle, Piece
from linnet_jax.serve.lockstep import Lockstep
from linnet_jax.serve.pages import PagePool, check_positive
from linnet_jax.serve.runner import Chosen, PagedRunner
from linnet_jax.serve.scheduler import Scheduler, Sequence, StepPlan
from linnet_jax.speculative import Ngram, check_fits, speculative_config
from linnet_jax.structured import Constraint, bitmasks, constraint, with_bitmasks

__all__ = ["CHOICES", "DEFAULT_KV_CACHE_GB", "DEFAULT_PAGE_SIZE", "Engine", "EngineFailed", "Handle", "Piece",
           "QueueFull", "Step"]

CHOICES = 2**32  # the streams of one seed a request may draw (`choice`)
# Positions per page. On 2 CPU cores a 16-request decode step of SmolLM2-135M at 300 tokens each took 331 ms with
# pages of 64 and 386 ms with pages of 16 (benchmarks/paged_step.py, RESULTS.md): fewer, larger gathers.
DEFAULT_PAGE_SIZE = 64
# The pool holds slots × max_len positions, at most this many GiB (2 GiB: 46,000 positions of SmolLM2-135M in
# float32, 2.9 times what 16 requests of 2,900 positions hold); --kv-cache-gb sets it.
DEFAULT_KV_CACHE_GB = 2.0
# The device programs `_run` runs (each the method `_<name>`): all a follower of a multi-process engine runs.
PROGRAMS = frozenset({"agree", "compile_all", "step", "scrub", "masks"})


class QueueFull(RuntimeError):
    """The engine's queue holds max_queue requests already: try again later."""


class EngineFailed(RuntimeError):
    """The engine's scheduler thread failed (`Engine.failure` says why): it serves nothing more."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One dispatch, as `Engine.step_log` records it: the sequences decoding and the prompt chunks it carried, the
    tokens it fed (of which `drafts` were speculative drafts), the tokens it produced, its program's token bucket
    and the page columns its attention read (the longest sequence's pages)."""

    decoding: int
    prefilling: int
    tokens: int
    drafts: int
    emitted: int
    program_tokens: int
    columns: int


@dataclasses.dataclass(eq=False)
class Work:
    """A validated request: its handle, its grammar (None: unconstrained) and its sequence for the scheduler."""

    handle: Handle
    rule: Constraint | None
    sequence: Sequence
    adapter: int = 0  # its entry in the adapter table (0: the base model)


def step_tokens(slots: int, prefill_chunk: int, speculative: Ngram | None, max_step_tokens: int | None) -> int:
    """max_step_tokens, or its default: two chunks, and at least every slot's token and drafts."""
    if max_step_tokens is not None:
        return max_step_tokens
    return max(2 * prefill_chunk, slots * (1 + (speculative.num_speculative_tokens if speculative else 0)))


def page_bytes(model: Model, page_size: int) -> int:
    """The bytes of one page of the pool: keys and values of page_size positions in every layer."""
    config = model.config
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * model.params.dtype.itemsize


def kv_pages(model: Model, slots: int, max_len: int, page_size: int, kv_cache_gb: float | None) -> int:
    """The pool's pages: kv_cache_gb GiB of them, or (None) enough for slots × max_len positions within
    DEFAULT_KV_CACHE_GB; a ValueError when they cannot hold one request of max_len positions."""
    size = page_bytes(model, page_size)
    most = int((DEFAULT_KV_CACHE_GB if kv_cache_gb is None else kv_cache_gb) * 2**30 // size)
    one = -(-max_len // page_size)
    if kv_cache_gb is None:
        return max(one, min(most, slots * one))
    if most < one:
        raise ValueError(f"kv_cache_gb={kv_cache_gb} holds {most} pages of {page_size} positions "
                         f"({size / 2**20:.2f} MiB each), fewer than one request of max_len={max_len} needs "
                         f"({one}); expected at least {one * size / 2**30:.3f}")
    return most


class Engine:
    """Continuous batching of up to `slots` requests of up to `max_len` positions over a paged KV cache (see the
    module docstring).

    engine = Engine(model, slots=16, max_len=8192, max_queue=256)
    handle = engine.submit("Hello", max_tokens=32)   # a prompt, a conversation or token ids
    for piece in handle: print(piece.text, end="")
    engine.close()

    max_len: the longest request, prompt and new tokens (default: the model's context). page_size: positions per
    page; kv_cache_gb: the pool's size (default: slots × max_len positions, at most DEFAULT_KV_CACHE_GB GiB).
    prefill_chunk: the most tokens of one prompt in a step (longer prompts take several, decoding requests running
    in each); max_step_tokens: the most tokens one step carries (default 2 × prefill_chunk, at least one for each
    slot with its drafts). prefix_cache: prompts share the cached full pages of prompts that started the same way.
    speculative: n-gram drafts verified in the step (`linnet_jax.speculative`; vLLM's speculative_config names).
    loras: {name: a PEFT adapter directory's path, or a Lora} served beside the base model ({} for none yet: adapters
    loaded later, `load_lora`); None: no adapters, no table. max_loras: the most adapters loaded at once (the table
    holds them and the base's zeros); max_lora_rank: the largest rank taken (lower ones are zero-padded to it).
    lockstep: this process's end of a multi-process engine (`linnet_jax.serve.lockstep.Lockstep`; the model on a
    mesh over every process's devices, every process making its engine with the same settings): the leader's
    engine schedules and serves, a follower's runs the leader's programs (`follow`). Adapters are refused with one.
    """

    def __init__(self, model: Model, slots: int = 16, max_len: int | None = None, max_queue: int = 256, *,
                 page_size: int = DEFAULT_PAGE_SIZE, kv_cache_gb: float | None = None, prefill_chunk: int = 256,
                 max_step_tokens: int | None = None, prefix_cache: bool = True,
                 speculative: dict | Ngram | None = None, loras: dict | None = None,
                 max_loras: int = DEFAULT_MAX_LORAS, max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
                 lockstep: Lockstep | None = None):
        context = model.config.max_position_embeddings
        max_len = context if max_len is None else max_len
        self.speculative = speculative_config(speculative)
        width = 1 + (self.speculative.num_speculative_tokens if self.speculative else 0)
        for name, value in (("slots", slots), ("max_len", max_len), ("max_queue", max_queue),
                            ("page_size", page_size), ("prefill_chunk", prefill_chunk)):
            check_positive(name, value)
        max_step_tokens = step_tokens(slots, prefill_chunk, self.speculative, max_step_tokens)
        check_positive("max_step_tokens", max_step_tokens)
        if not 2 <= max_len <= context:
            raise ValueError(f"max_len must be in [2, {context}] (the model's context), got {max_len}")
        if max_step_tokens < prefill_chunk:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must hold one chunk: ≥ prefill_chunk "
                             f"({prefill_chunk})")
        if kv_cache_gb is not None and (isinstance(kv_cache_gb, bool) or not isinstance(kv_cache_gb, (int, float))
                                        or not 0 < kv_cache_gb < float("inf")):
            raise ValueError(f"kv_cache_gb must be a finite number > 0, got {kv_cache_gb!r}")
        if lockstep is not None and loras is not None:
            raise ValueError("loras are not served by a multi-process engine (lockstep): its followers would need "
                             "every adapter's weights; serve adapters from one process")
        check_fits(self.speculative, int(slots), int(max_len), int(max_step_tokens))
        self.model, self.max_len, self.max_queue, self.lockstep = model, int(max_len), int(max_queue), lockstep
        self.slots = int(slots)
        self.page_size, self.prefill_chunk, self.max_step_tokens = int(page_size), int(prefill_chunk), int(max_step_tokens)
        self.prefix_cache = bool(prefix_cache)
        self.eos = eos_ids(model)
        self.adapters = None if loras is None else AdapterTable(model, max_loras, max_lora_rank)
        if loras is not None and len(loras) > self.adapters.max_loras:
            raise ValueError(f"{len(loras)} loras given, more than max_loras={self.adapters.max_loras}")
        adapters = {name: (source, self.adapters.read(source)) for name, source in (loras or {}).items()}
        pages = kv_pages(model, int(slots), self.max_len, self.page_size, kv_cache_gb)
        self.pool = PagePool(pages, self.page_size)
        self.runner = PagedRunner(model, int(slots), pages, self.page_size, self.max_len, self.max_step_tokens,
                                  width - 1)
        self.scheduler = Scheduler(self.pool, int(slots), self.max_len, self.max_step_tokens, self.prefill_chunk,
                                   self.speculative, self.runner.token_buckets)
        self._masked = False  # whether the rows' masks hold a grammar's (else every token is allowed)
        self.works: dict[Sequence, Work] = {}  # every request submitted and not finished
        self.queue: deque[Work] = deque()  # arrived, not yet given to the scheduler
        self.counters = {"tokens_generated": 0, "requests_finished": 0}
        self.step_log: deque[Step] = deque(maxlen=65536)  # the latest dispatches
        self.on_finish: list[Callable[[Handle], None]] = []  # metrics hooks, called on the scheduler thread
        self.on_failure: list[Callable[[Exception], None]] = []  # called on the scheduler thread when it fails
        self.failure: Exception | None = None
        self.warm_traces: int | None = None
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

    def submit(self, prompt=None, *, tokens=None, max_tokens: int | None = None, temperature=0.0, top_k=0, top_p=1.0,
               min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None,
               seed: int | None = None, choice: int = 0, stop=None, stop_token_ids=None, ignore_eos: bool = False,
               chat: bool | None = None, top_logprobs: int = 0, structured=None, lora: str | None = None) -> Handle:
        """Queue one request: a prompt (text or a conversation) or `tokens` (ids). Returns its Handle.

        max_tokens: at most what a request has room for (max_len minus the prompt), which is the default; a larger
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
            raise RequestError("prompt", f"the prompt has {len(ids)} tokens; the engine's requests hold at most "
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
        rule = None if structured is None else constraint(self.model, structured)
        # the repetition penalty reads every prompt token, which a prompt starting from cached pages never feeds
        sequence = Sequence(ids, budget=max_tokens, request=options.requests(max_tokens), constrained=rule is not None,
                            shares=self.prefix_cache and repetition_penalty == 1.0, top=int(top_logprobs))
        work = Work(handle=Handle(self, len(ids), options.stops), rule=rule, sequence=sequence)
        with self._wake:
            self.check_alive()
            if self._closing:
                raise RuntimeError("the engine is shutting down: it admits no new requests")
            if len(self.queue) + len(self.scheduler.waiting) >= self.max_queue:
                raise QueueFull(f"the queue holds max_queue={self.max_queue} requests; try again later")
            if lora is not None:
                work.adapter, sequence.key = self._adapter_entry(lora)
                sequence.request = sequence.request.replace(adapter=np.full((1,), work.adapter, np.int32))
            self.works[sequence] = work
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
        return {work.adapter for work in self.works.values()}

    def warmup(self) -> None:
        """Compile every program the engine uses (the step at each token bucket, the pages' scrub, the adapter
        table's entry writes), then count compiles from here on (`compiles_after_warmup`). Each program runs once over rows that hold nothing, which changes no request.
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
        """Run each program once over nothing (`warmup`)."""
        self.runner.compile_all(self._table)
        if self.adapters is not None:
            self.adapters.put(0, None)  # the base's entry: zeros again

    @property
    def compiles_after_warmup(self) -> int | None:
        """Programs traced since `warmup()` (None before it): a warm engine compiles nothing."""
        return None if self.warm_traces is None else sum(TRACES.values()) - self.warm_traces

    def stats(self) -> dict[str, int]:
        """Running and queued requests, busy slots, tokens generated and requests finished so far, the prefix
        cache's lookups and hits in tokens, and the pool's pages: all, held by requests, and cached."""
        with self._wake:
            busy, pool = len(self.scheduler.running), self.pool
            return {"running": busy, "queued": len(self.works) - busy, "busy_slots": busy, "slots": self.slots,
                    **self.counters, "prefix_cache_hit_tokens": pool.counters["hit_tokens"],
                    "prefix_cache_lookup_tokens": pool.counters["lookup_tokens"], "kv_cache_pages": pool.pages,
                    "kv_cache_pages_held": pool.pages - len(pool.free) - len(pool.cached),
                    "kv_cache_pages_cached": len(pool.cached)}

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
            for work in self.works.values():
                if work.sequence.row is None:  # queued
                    work.handle.cancelled = True
            self._wake.notify_all()
        end = time.monotonic() + (deadline or 0)
        while self.scheduler.running and self.failure is None and not self._hurried and time.monotonic() < end:
            time.sleep(0.02)
        with self._wake:
            works = list(self.works.values())
        for work in works:
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

    # --- the scheduler thread ------------------------------------------------------------------------------------

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
            failed = list(self.works.values())
            self.works.clear()
            self.queue.clear()
            self._wake.notify_all()
        for work in failed:
            work.handle.failure = error
            work.handle._finish("error")
        for hook in self.on_failure:
            hook(error)

    def _schedule(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopped or self.queue or self.scheduler.busy or self._tasks)
                if self._stopped and not self.scheduler.busy and not self.queue:
                    return
                tasks, self._tasks = list(self._tasks), deque()
                arrived = [work for work in self.queue if not work.handle.cancelled]
                cancelled = [work for work in self.queue if work.handle.cancelled]
                self.queue = deque()
            for work in cancelled:  # cancelled before the scheduler saw it
                self._finish(work, "cancelled")
            for task in tasks:
                task()
            for work in arrived:
                self.scheduler.add(work.sequence)
            self._release()
            plan = self.scheduler.schedule()
            if plan.scheduled:
                self._advance(plan)

    def _release(self) -> None:
        """End cancelled requests: out of the queue, or their pages and rows freed."""
        with self._wake:
            cancelled = [work for work in self.works.values() if work.handle.cancelled]
        for work in cancelled:
            self.scheduler.remove(work.sequence)
            self._finish(work, "cancelled")

    def _advance(self, plan: StepPlan) -> None:
        """Run one plan (its rows' grammar masks set first) and hand each request its tokens."""
        self._allow()
        chosen = self._run("step", self.runner.inputs(plan))
        result = self.runner.result(plan, chosen)
        finished = set(self.scheduler.update(plan, result))
        parts = plan.scheduled
        self.step_log.append(Step(decoding=sum(not part.prompt for part in parts),
                                  prefilling=sum(part.prompt for part in parts), tokens=plan.tokens,
                                  drafts=sum(part.drafts for part in parts), emitted=sum(map(len, result.tokens)),
                                  program_tokens=self.runner.shapes[-1][0], columns=self.runner.shapes[-1][1]))
        for i, part in enumerate(parts):
            if part.choosing:
                work, count = self.works[part.sequence], len(result.tokens[i])
                top = self._top(work, chosen.top_ids[i, :count], chosen.top_logprobs[i, :count])
                self._deliver(work, list(result.tokens[i]), list(result.logprobs[i]), top, result.states[i],
                              part.sequence in finished)

    @staticmethod
    def _top(work: Work, ids: np.ndarray, logprobs: np.ndarray) -> list[list[tuple[int, float]]]:
        """Per token, the request's top_logprobs most likely (id, logprob) pairs ([] when it asked for none)."""
        k = work.sequence.top
        if not k:
            return []
        return [list(zip(row_ids[:k].tolist(), row_logprobs[:k].tolist())) for row_ids, row_logprobs in zip(ids, logprobs)]

    def _deliver(self, work: Work, tokens: list[int], logprobs: list[float], top: list, state: int,
                 finished: bool) -> None:
        """A request's new tokens (state: its row's finish state after them; finished: the scheduler has ended it);
        the request finished when its row did or a stop string appeared, and failed alone (stop reason "error",
        its handle's `failure`, its pages zeroed) when they cannot be taken. A stop id that finished the row never
        reaches the stream."""
        self.counters["tokens_generated"] += len(tokens)
        try:
            reason = work.handle._add(tokens, logprobs, top, state, self.eos, work.rule)
        except Exception as error:  # its own tokens or grammar (an id outside the vocabulary, a grammar that can
            work.handle.failure, reason = error, "error"  # never be completed): it fails alone, the others go on
        if reason is None:
            return
        if not finished:
            self.scheduler.remove(work.sequence)
        if reason == "error":
            self._zero_pages(work.sequence)
        self._finish(work, reason)

    def _zero_pages(self, sequence: Sequence) -> None:
        """Zero the pages a failed request computed and no other request holds (they may hold NaN), uncached; the
        cached pages it started from stay."""
        own = [page for page in sequence.pages[sequence.shared:] if self.pool.holders[page] == 0]
        self.pool.forget(own)
        pages = np.full(self.runner.columns, self.pool.pages, np.int32)
        pages[:len(own)] = own
        self._run("scrub", pages)

    def _finish(self, work: Work, reason: str) -> None:
        """The request's Generation, as generate makes it. reason: "eos", "stop", "length", "cancelled" or "error"."""
        with self._wake:
            self.works.pop(work.sequence, None)
        self.counters["requests_finished"] += 1
        work.handle._finish(reason)
        for hook in self.on_finish:
            hook(work.handle)

    def _allow(self) -> None:
        """Each row's mask of the tokens its request's grammar allows next (every token for the others), while any
        request has a grammar, and once more after the last one has gone."""
        rules = [None] * self.slots
        for sequence in self.scheduler.running:
            rules[sequence.row] = self.works[sequence].rule
        if self._masked or any(rules):
            self._run("masks", bitmasks(rules, self.model.config.vocab_size))
            self._masked = any(rules)

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
                "pages": self.pool.pages, "page_size": self.page_size, "prefill_chunk": self.prefill_chunk,
                "max_step_tokens": self.max_step_tokens, "prefix_cache": self.prefix_cache,
                "speculative": repr(self.speculative)}

    def _agree(self, settings: dict) -> None:
        """A ValueError naming each setting in which this process's engine differs from the leader's (`settings`)."""
        differ = [f"{name} {value!r} here, {settings.get(name)!r} on the leader"
                  for name, value in self._settings().items() if settings.get(name) != value]
        if differ:
            raise ValueError(f"this process's engine differs from the leader's: {'; '.join(differ)} (start every "
                             f"process with the same flags)")

    def _step(self, inputs: dict) -> Chosen:
        """One step of the runner over a plan's host inputs (`PagedRunner.inputs`)."""
        return self.runner.execute(inputs, self._table)

    def _scrub(self, pages: np.ndarray) -> None:
        """Pages [M] of the pool zeroed (the pool's size: none)."""
        self.runner.scrub(pages)

    def _masks(self, masks: np.ndarray) -> None:
        """Each row's bitmask of allowed tokens [B, W] into the state."""
        self.runner.state = with_bitmasks(self.runner.state, masks)
