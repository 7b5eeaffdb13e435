"""A submitted request's handle (`Handle`: its stream of `Piece`s and its Generation), filled by the engine's
scheduler thread and read from any thread or from asyncio. A piece's text is detokenized on the scheduler thread as
its tokens arrive (`linnet_jax.text`), never under a lock that the event loop takes."""

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from linnet_jax.structured import Constraint
from linnet_jax.text import Cursor, Detokenizer, Generation, take

if TYPE_CHECKING:
    from linnet_jax.serve.engine import Engine


@dataclasses.dataclass
class Piece:
    """New output of one request: text (held back while a stop string or a partial character may change it),
    the new token ids and their logprobs."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # per token, its top_logprobs most likely (id, logprob); or []


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
        """Stop generating: its row and pages are freed before the engine's next step."""
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
