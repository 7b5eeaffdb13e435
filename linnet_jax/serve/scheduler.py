"""The paged engine's policy, without JAX (DESIGN.md decision 20): which requests run, which pages they hold, what
one step carries; a runner runs its plan in one dispatch (`linnet_jax.serve.runner`), and `update` gives each
request the step's tokens.

    scheduler = Scheduler(pool, rows=8, max_len=8192, max_step_tokens=512, prefill_chunk=256)
    scheduler.add(Sequence(prompt, budget=64, request=...))
    while scheduler.busy:
        plan = scheduler.schedule()       # a StepPlan: plain data
        scheduler.update(plan, runner.run(plan))

A step carries every decoding sequence's next token (and, with `speculative`, its n-gram drafts,
`linnet_jax.speculative`; none for a sequence with a grammar) and then the next chunks of prefilling prompts, oldest
first, up to max_step_tokens tokens (each chunk at most prefill_chunk), cut so that the step fills one of
`step_sizes` (the runner's programs) rather than padding up to the next. A waiting request is admitted, oldest first, when
a row is free and the pool can give every page it may need (its prompt and its budget, beyond the leading pages
it shares with cached prompts): it then never runs out, so nothing is preempted, and the pages are taken one at a
time as its tokens arrive, so a cached page stays cached until a page is really needed. A request that does not
fit waits; one that could never fit (more pages than the pool holds) is refused when added. A prompt whose
prefill completes publishes its full pages (`PagePool.publish`) for later prompts; a finished request releases
its pages. A prompt whose next page (after those cached) is one another admitted prompt is computing waits (the
requests behind it go on) until that page is published, then shares it: a burst of prompts with one system prompt
computes it once.
"""

import dataclasses
import itertools
from collections import deque

from linnet_jax.serve.pages import PagePool
from linnet_jax.speculative import Ngram, propose

RUNNING, STOP_ID, LENGTH = 0, 1, 2  # a row's state after a step (`linnet_jax.decode`'s)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request as the scheduler tracks it: its prompt, its budget of new tokens, the runner's request row
    (`request`: opaque here) and what it holds and has produced."""

    prompt: list[int]
    budget: int  # the most tokens it may generate
    request: object = None  # the runner's description of how it samples (`linnet_jax.decode.Request`, one row)
    key: bytes = b""  # its prefix-cache key (the adapter load's)
    shares: bool = True  # it may start from cached pages (else it computes its whole prompt)
    constrained: bool = False  # a grammar chooses its tokens one at a time: no drafts
    top: int = 0  # the alternatives it reports beside each token
    row: int | None = None  # its row of the runner's per-request state while admitted
    row_new: bool = False  # admitted, its row not yet given its request
    pages: list[int] = dataclasses.field(default_factory=list)
    shared: int = 0  # its leading pages that were cached when it was admitted (computed by other requests)
    computed: int = 0  # positions whose keys and values are in its pages
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # each output token's, when the runner gives them
    finish: str | None = None  # "stop" (a stop id) or "length" once done
    id: int = dataclasses.field(default_factory=itertools.count().__next__)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.output

    def positions_needed(self, max_len: int) -> int:
        """The positions it may ever hold: its prompt and its budget, within max_len."""
        return min(len(self.prompt) + self.budget, max_len)


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One sequence's part of a step: the tokens it feeds at positions start .. (prompt tokens, or a decode's last
    token and `drafts` drafts after it), whether its row begins (`new`: the runner sets its request there) and
    whether the step chooses its next tokens (a decode, or its prompt's last chunk); its pages (its page table's
    row)."""

    sequence: Sequence
    tokens: tuple[int, ...]
    start: int
    new: bool
    choosing: bool
    pages: tuple[int, ...]
    drafts: int = 0

    @property
    def prompt(self) -> bool:
        return self.start < len(self.sequence.prompt)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one dispatch carries, in its token order: decoding sequences first, then prefill chunks."""

    scheduled: tuple[Scheduled, ...]

    @property
    def tokens(self) -> int:
        return sum(len(part.tokens) for part in self.scheduled)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a runner read back: per scheduled sequence, the tokens it chose (a stop id last when it stopped on one;
    a decode's accepted drafts and one more), its row's state after them (RUNNING, STOP_ID or LENGTH) and their
    logprobs; entries of sequences that chose nothing are ignored."""

    tokens: tuple[tuple[int, ...], ...]
    states: tuple[int, ...]
    logprobs: tuple[tuple[float, ...], ...] = ()


class Scheduler:
    """Admission, pages, chunking and finishing over a PagePool (see the module docstring)."""

    def __init__(self, pool: PagePool, rows: int, max_len: int, max_step_tokens: int, prefill_chunk: int,
                 speculative: Ngram | None = None, step_sizes: list[int] | None = None):
        width = 1 + (speculative.num_speculative_tokens if speculative else 0)
        if max_step_tokens < rows * width:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must carry a token of each of the {rows} rows"
                             + (f" and its {width - 1} drafts" if width > 1 else ""))
        self.pool, self.max_len, self.speculative = pool, max_len, speculative
        self.step_sizes = sorted(step_sizes or [max_step_tokens])
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
        scheduled = []
        for sequence in [s for s in self.running if not s.prefilling]:
            drafts = tuple(self.drafts(sequence))
            scheduled.append(self.part(sequence, (sequence.output[-1], *drafts), new=False, drafts=len(drafts)))
        prefilling = [s for s in self.running if s.prefilling]
        used = sum(len(part.tokens) for part in scheduled)
        demand = used + sum(min(len(s.prompt) - s.computed, self.prefill_chunk) for s in prefilling)
        budget = self.step_size(used, demand) - used
        for sequence in prefilling:
            if budget <= 0:
                break
            count = min(len(sequence.prompt) - sequence.computed, self.prefill_chunk, budget)
            chunk = tuple(sequence.prompt[sequence.computed:sequence.computed + count])
            scheduled.append(self.part(sequence, chunk, new=sequence.row_new))
            budget -= count
        return StepPlan(tuple(scheduled))

    def step_size(self, used: int, demand: int) -> int:
        """The tokens of a step whose decodes take `used` and that could carry `demand`: the largest step size (the
        runner's token buckets) within the demand that leaves the prompt chunks at least half of theirs, so that they
        fill the step's program without padding; else the smallest that holds the demand; at most max_step_tokens."""
        if demand == used:
            return used
        within = [size for size in self.step_sizes
                  if 2 * (size - used) >= demand - used and size <= min(demand, self.max_step_tokens)]
        if within:
            return within[-1]
        return min(next((size for size in self.step_sizes if size >= demand), demand), self.max_step_tokens)

    def drafts(self, sequence: Sequence) -> list[int]:
        """A decoding sequence's n-gram drafts: none without speculation or with a grammar, and none past its
        promised positions (its budget and max_len)."""
        if self.speculative is None or sequence.constrained:
            return []
        room = sequence.positions_needed(self.max_len) - len(sequence.history)
        return propose(sequence.history, self.speculative, room)

    def admit(self) -> None:
        """Admit waiting requests, oldest first, while a row is free and the pool can promise their pages; a prompt
        whose next shareable page another admitted prompt is computing waits for it (module docstring)."""
        deferred = []
        while self.waiting and self.free_rows:
            sequence = self.waiting.popleft()
            hits = self.pool.peek(sequence.prompt, sequence.key) if sequence.shares else []
            if self.computing_next(sequence, len(hits)):
                deferred.append(sequence)
                continue
            needed = self.pool.pages_for(sequence.positions_needed(self.max_len)) - len(hits)
            unheld = sum(self.pool.holders[page] == 0 for page in hits)  # cached pages it would take off the shelf
            if needed > self.pool.available - unheld - self.promised:
                self.waiting.appendleft(sequence)
                break
            shared = self.pool.lookup(sequence.prompt, sequence.key) if sequence.shares else []
            sequence.pages, sequence.shared = shared, len(shared)
            sequence.computed = len(shared) * self.pool.page_size
            sequence.row, sequence.row_new = self.free_rows.pop(0), True
            self.promised += needed
            self.running.append(sequence)
        self.waiting.extendleft(reversed(deferred))

    def computing_next(self, sequence: Sequence, cached: int) -> bool:
        """Whether an admitted prompt is computing the page that the sequence, whose first `cached` pages are
        cached, would share next (it is published with the chunk that completes it)."""
        end = (cached + 1) * self.pool.page_size
        if not sequence.shares or len(sequence.prompt) <= end:
            return False
        return any(other.computed < end and other.shares and other.key == sequence.key
                   and other.prompt[:end] == sequence.prompt[:end] for other in self.running)

    def part(self, sequence: Sequence, tokens: tuple[int, ...], new: bool, drafts: int = 0) -> Scheduled:
        """The sequence's part of the step, with the pages its new positions need taken from its promise."""
        needed = self.pool.pages_for(sequence.computed + len(tokens)) - len(sequence.pages)
        if needed > 0:
            sequence.pages += self.pool.allocate(needed)
            self.promised -= needed
        sequence.row_new = False
        choosing = sequence.computed + len(tokens) >= len(sequence.prompt)
        return Scheduled(sequence, tokens, sequence.computed, new, choosing, tuple(sequence.pages), drafts)

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """The step's effects: positions computed (a decode's: its last token and its accepted drafts), a prompt's
        pages published when its prefill completes, chosen tokens given (a stop id is not output), finished
        sequences' pages and rows freed. Returns those finished."""
        finished = []
        for i, (part, tokens, state) in enumerate(zip(plan.scheduled, result.tokens, result.states)):
            sequence = part.sequence
            sequence.computed += len(part.tokens) if part.prompt else len(tokens)
            if part.prompt:  # the full pages computed so far, for later prompts (and for those waiting on its lead)
                self.pool.publish(sequence.prompt[:sequence.computed], sequence.key, sequence.pages)
            if not part.choosing:
                continue
            kept = len(tokens) - (state == STOP_ID)
            sequence.output += tokens[:kept]
            sequence.logprobs += result.logprobs[i][:kept] if result.logprobs else []
            if state != RUNNING:
                sequence.finish = "stop" if state == STOP_ID else "length"
                finished.append(self.finish(sequence))
        return finished

    def remove(self, sequence: Sequence) -> None:
        """Drop a sequence before its end (cancelled, or a stop string ended it): out of the queue, or its pages,
        promise and row released."""
        if sequence in self.running:
            self.finish(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    def finish(self, sequence: Sequence) -> Sequence:
        """Release a finished sequence's pages, the rest of its promise and its row."""
        unused = self.pool.pages_for(sequence.positions_needed(self.max_len)) - len(sequence.pages)
        self.promised -= max(unused, 0)
        self.pool.release(sequence.pages[::-1])  # its last pages evicted first: a prompt's first pages serve longest
        self.running.remove(sequence)
        self.free_rows.append(sequence.row)
        return sequence
