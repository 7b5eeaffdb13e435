"""The paged engine's policy, without JAX (DESIGN.md decision 20): which requests run, which pages they hold, what
one step carries; a runner runs its plan in one dispatch (`linnet_jax.serve.runner`), and `update` gives each
request the step's tokens.

    scheduler = Scheduler(pool, rows=8, max_len=8192, max_step_tokens=512, prefill_chunk=256)
    scheduler.add(Sequence(prompt, budget=64, request=...))
    while scheduler.busy:
        plan = scheduler.schedule()       # a StepPlan: plain data
        scheduler.update(plan, runner.run(plan))

A step carries every decoding sequence's next token and then the next chunks of prefilling prompts, oldest first,
up to max_step_tokens tokens (each chunk at most prefill_chunk). A waiting request is admitted, oldest first, when
a row is free and the pool can give every page it may need (its prompt and its budget, beyond the leading pages
it shares with cached prompts): it then never runs out, so nothing is preempted, and the pages are taken one at a
time as its tokens arrive, so a cached page stays cached until a page is really needed. A request that does not
fit waits; one that could never fit (more pages than the pool holds) is refused when added. A prompt whose
prefill completes publishes its full pages (`PagePool.publish`) for later prompts; a finished request releases
its pages.
"""

import dataclasses
import itertools
from collections import deque

from linnet_jax.serve.pages import PagePool

RUNNING, STOP_ID, LENGTH = 0, 1, 2  # a row's state after a step (`linnet_jax.decode`'s)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request as the scheduler tracks it: its prompt, its budget of new tokens, the runner's request row
    (`request`: opaque here) and what it holds and has produced."""

    prompt: list[int]
    budget: int  # the most tokens it may generate
    request: object = None  # the runner's description of how it samples (`linnet_jax.decode.Request`, one row)
    key: bytes = b""  # its prefix-cache key (the adapter load's)
    row: int | None = None  # its row of the runner's per-request state while admitted
    row_new: bool = False  # admitted, its row not yet given its request
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # positions whose keys and values are in its pages
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # each output token's, when the runner gives them
    finish: str | None = None  # "stop" (a stop id) or "length" once done
    id: int = dataclasses.field(default_factory=itertools.count().__next__)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    def positions_needed(self, max_len: int) -> int:
        """The positions it may ever hold: its prompt and its budget, within max_len."""
        return min(len(self.prompt) + self.budget, max_len)


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One sequence's part of a step: the tokens it feeds at positions start .., whether its row begins (`new`: the
    runner sets its request there) and whether the step chooses its next token (a decode, or its prompt's last
    chunk); its pages (its page table's row)."""

    sequence: Sequence
    tokens: tuple[int, ...]
    start: int
    new: bool
    choosing: bool
    pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one dispatch carries, in its token order: decoding sequences first, then prefill chunks."""

    scheduled: tuple[Scheduled, ...]

    @property
    def tokens(self) -> int:
        return sum(len(part.tokens) for part in self.scheduled)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a runner read back: per scheduled sequence, its chosen token, its row's state (RUNNING, STOP_ID or
    LENGTH) and that token's logprob; entries of sequences that chose nothing are ignored."""

    tokens: tuple[int, ...]
    states: tuple[int, ...]
    logprobs: tuple[float, ...] = ()


class Scheduler:
    """Admission, pages, chunking and finishing over a PagePool (see the module docstring)."""

    def __init__(self, pool: PagePool, rows: int, max_len: int, max_step_tokens: int, prefill_chunk: int):
        if max_step_tokens < rows:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must carry a token of each of the {rows} rows")
        self.pool, self.max_len = pool, max_len
        self.max_step_tokens, self.prefill_chunk = max_step_tokens, prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, oldest first
        self.free_rows = list(range(rows))
        self.promised = 0  # pages admitted sequences may still take

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, sequence: Sequence) -> None:
        """Queue a request; a ValueError when it could never fit (its prompt and budget past max_len or the pool)."""
        if len(sequence.prompt) >= self.max_len:
            raise ValueError(f"the prompt has {len(sequence.prompt)} tokens; max_len={self.max_len} positions hold "
                             f"prompt and new tokens together")
        if self.pool.pages_for(sequence.positions_needed(self.max_len)) > self.pool.pages:
            raise ValueError(f"the request needs {sequence.positions_needed(self.max_len)} positions, more than the "
                             f"pool's {self.pool.pages} pages of {self.pool.page_size}")
        self.waiting.append(sequence)

    def schedule(self) -> StepPlan:
        """The next step: admissions, then each decoding sequence's token, then prefill chunks (module docstring)."""
        self.admit()
        budget, scheduled = self.max_step_tokens, []
        for sequence in [s for s in self.running if not s.prefilling]:
            scheduled.append(self.part(sequence, (sequence.output[-1],), new=False))
            budget -= 1
        for sequence in [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            count = min(len(sequence.prompt) - sequence.computed, self.prefill_chunk, budget)
            chunk = tuple(sequence.prompt[sequence.computed:sequence.computed + count])
            scheduled.append(self.part(sequence, chunk, new=sequence.row_new))
            budget -= count
        return StepPlan(tuple(scheduled))

    def admit(self) -> None:
        """Admit waiting requests, oldest first, while a row is free and the pool can promise their pages."""
        while self.waiting and self.free_rows:
            sequence = self.waiting[0]
            shared = self.pool.lookup(sequence.prompt, sequence.key)
            needed = self.pool.pages_for(sequence.positions_needed(self.max_len)) - len(shared)
            if needed > self.pool.available - self.promised:
                self.pool.release(shared)
                return
            self.waiting.popleft()
            sequence.pages, sequence.computed = shared, len(shared) * self.pool.page_size
            sequence.row, sequence.row_new = self.free_rows.pop(0), True
            self.promised += needed
            self.running.append(sequence)

    def part(self, sequence: Sequence, tokens: tuple[int, ...], new: bool) -> Scheduled:
        """The sequence's part of the step, with the pages its new positions need taken from its promise."""
        needed = self.pool.pages_for(sequence.computed + len(tokens)) - len(sequence.pages)
        if needed > 0:
            sequence.pages += self.pool.allocate(needed)
            self.promised -= needed
        sequence.row_new = False
        choosing = sequence.computed + len(tokens) >= len(sequence.prompt)
        return Scheduled(sequence, tokens, sequence.computed, new, choosing, tuple(sequence.pages))

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """The step's effects: positions computed, a prompt's pages published when its prefill completes, chosen
        tokens given (a stop id is not output), finished sequences' pages and rows freed. Returns those finished."""
        finished = []
        for i, (part, token, state) in enumerate(zip(plan.scheduled, result.tokens, result.states)):
            sequence = part.sequence
            was_prefilling = sequence.prefilling
            sequence.computed += len(part.tokens)
            if was_prefilling and not sequence.prefilling:
                self.pool.publish(sequence.prompt, sequence.key, sequence.pages)
            if not part.choosing:
                continue
            if state != STOP_ID:
                sequence.output.append(token)
                sequence.logprobs += result.logprobs[i:i + 1]
            if state != RUNNING:
                sequence.finish = "stop" if state == STOP_ID else "length"
                finished.append(self.finish(sequence))
        return finished

    def finish(self, sequence: Sequence) -> Sequence:
        """Release a finished sequence's pages, the rest of its promise and its row."""
        unused = self.pool.pages_for(sequence.positions_needed(self.max_len)) - len(sequence.pages)
        self.promised -= max(unused, 0)
        self.pool.release(sequence.pages)
        self.running.remove(sequence)
        self.free_rows.append(sequence.row)
        return sequence
