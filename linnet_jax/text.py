"""A request's output as text: `Generation` (the result) and `Detokenizer` (the text as the ids arrive).

The detokenizer decodes each id once, in a small window of the ids before it (the prefix and read offsets
of vLLM's incremental detokenization and of transformers' TextStreamer): the window's text minus the text
of its first ids is the new text. A window whose text ends in U+FFFD ends inside a multi-byte character,
so its ids wait for the next. Stop strings are looked for in the new text and the few characters before
it only, and a reader is shown text up to a settled id, never a partial character or the start of a stop
string (how much of each stop string the text ends with is kept up to date character by character,
`StopPrefix`). The work is linear in the output: the text is never rebuilt from the first id.
"""

import bisect
import dataclasses

from linnet_jax.decode import RUNNING, STOP_ID

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 character to


@dataclasses.dataclass
class Generation:
    """One row's result: the new text and ids (no eos), why it stopped, and each chosen token's logprob."""

    text: str | None
    tokens: list[int]
    stop_reason: str  # "eos", "stop", "length" (or "cancelled", for the engine's requests)
    logprobs: list[float]


class StopPrefix:
    """How much of one stop string the text so far ends with: the longest prefix of the stop string that is a
    suffix of the text (`matched`), updated as text is fed (Knuth-Morris-Pratt), linear in the text."""

    def __init__(self, stop: str):
        self.stop, self.fallback, self.matched = stop, borders(stop), 0

    def feed(self, text: str) -> None:
        stop, fallback, matched = self.stop, self.fallback, self.matched
        for char in text:
            if matched == len(stop):
                matched = fallback[matched - 1]
            while matched and stop[matched] != char:
                matched = fallback[matched - 1]
            matched += stop[matched] == char
        self.matched = matched


def borders(text: str) -> list[int]:
    """KMP's failure function: for each i, the length of the longest proper prefix of text[:i + 1] that is
    also a suffix of it. [len(text)]"""
    lengths = [0] * len(text)
    for i in range(1, len(text)):
        length = lengths[i - 1]
        while length and text[i] != text[length]:
            length = lengths[length - 1]
        lengths[i] = length + (text[i] == text[length])
    return lengths


@dataclasses.dataclass
class Cursor:
    """How much of a Detokenizer's output a reader has been handed: up to settled point `point`, or all of it."""

    point: int = 0
    done: bool = False


class Detokenizer:
    """The text of a growing list of ids (`add`), decoded once per id, with the request's stop strings.

    Settled points are where the text so far is final: the ids[:settled_ids[k]] decode to the first
    settled_chars[k] characters, which are pieces[:k] joined. `pending` is the text of the ids after the
    last point (a character still incomplete). `stop_at` is where the first stop string begins, once
    one has appeared. With no tokenizer every id is a point and the text is None.
    """

    def __init__(self, tokenizer, stops=()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids: list[int] = []
        self.pieces: list[str] = []  # the text between consecutive settled points
        self.settled_ids, self.settled_chars = [0], [0]
        self.pending = ""
        self.stop_at: int | None = None
        self.shown = 0  # the last point a reader may be shown
        self._prefix = self._read = 0  # the window: ids[_prefix:]; ids[_prefix:_read] decode to _prefix_text
        self._prefix_text = ""
        self._searched = 0  # the settled points whose text has been searched for stop strings
        self._overlap = max(map(len, self.stops), default=1) - 1  # characters a stop string may reach back
        self._prefixes = [StopPrefix(stop) for stop in self.stops]
        self._fed = 0  # the settled points whose text the StopPrefixes have been fed

    def add(self, ids: list[int]) -> None:
        """Decode the new ids (one window each), then look for stop strings in the new text."""
        for token in ids:
            self._settle(int(token))
        if self.stops and self.stop_at is None:
            self._find_stop()
            self._feed_prefixes()
        self.shown = self._last_point(self._visible_chars())

    def _settle(self, token: int) -> None:
        """Append one id: settle its text (and any pending before it) unless a character is still incomplete."""
        self.ids.append(token)
        if self.tokenizer is None:
            self._point("")
            return
        window = self.tokenizer.decode(self.ids[self._prefix:])
        new = window[len(self._prefix_text):]
        if window.endswith(REPLACEMENT):
            self.pending = new
            return
        self.pending = ""
        self._point(new)
        if new:  # the window moves on past the ids whose text was just settled
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])

    def _point(self, piece: str) -> None:
        self.pieces.append(piece)
        self.settled_ids.append(len(self.ids))
        self.settled_chars.append(self.settled_chars[-1] + len(piece))

    def _find_stop(self) -> None:
        """The earliest stop string in the text settled since the last search (and the characters a stop string
        may reach back, and the pending text): no stop string lies wholly in the text searched before."""
        start = max(0, self.settled_chars[self._searched] - self._overlap)
        first = bisect.bisect_right(self.settled_chars, start) - 1
        text = "".join(self.pieces[first:]) + self.pending
        offset = self.settled_chars[first]
        found = [i for i in (text.find(s, start - offset) for s in self.stops) if i >= 0]
        if found:
            self.stop_at = offset + min(found)
        self._searched = len(self.pieces)

    def _feed_prefixes(self) -> None:
        """The text settled since the last feed, to each stop string's StopPrefix."""
        new = self.text_between(self._fed, len(self.pieces))
        for prefix in self._prefixes:
            prefix.feed(new)
        self._fed = len(self.pieces)

    def _visible_chars(self) -> int:
        """How much settled text a reader may see: what lies before a stop string, or before the beginning of one
        that the text ends with."""
        end = self.settled_chars[-1]
        if self.stop_at is not None or not self.stops:
            return end if self.stop_at is None else min(end, self.stop_at)
        return end - max(prefix.matched for prefix in self._prefixes)

    def _last_point(self, chars: int) -> int:
        """The last settled point at or before `chars` characters."""
        return bisect.bisect_right(self.settled_chars, max(chars, 0)) - 1

    def text_between(self, start: int, end: int) -> str:
        """The text between settled points start and end."""
        return "".join(self.pieces[start:end])

    def generation(self, reason: str, logprobs: list[float]) -> Generation:
        """The result: the whole text (a pending character's replacement included), cut before the first stop
        string (reason "stop" then), with the ids (and their logprobs) whose text lies wholly before the cut."""
        if self.tokenizer is None:
            return Generation(text=None, tokens=list(self.ids), stop_reason=reason, logprobs=list(logprobs))
        text = self.text_between(0, len(self.pieces)) + self.pending
        if self.stop_at is None:
            return Generation(text=text, tokens=list(self.ids), stop_reason=reason, logprobs=list(logprobs))
        text = text[:self.stop_at]
        keep = self._ids_before(text)
        return Generation(text=text, tokens=self.ids[:keep], stop_reason="stop", logprobs=list(logprobs[:keep]))

    def _ids_before(self, text: str) -> int:
        """The most ids whose text is a prefix of `text` (the text cut at a stop string): the last settled point
        before the cut, or one of the unsettled ids after it whose text (a replacement character that stays) is."""
        point = self._last_point(len(text))
        settled = self.settled_ids[point]
        after = self.settled_ids[point + 1] if point + 1 < len(self.settled_ids) else len(self.ids) + 1
        return next((n for n in range(after - 1, settled, -1) if text.startswith(self.tokenizer.decode(self.ids[:n]))),
                    settled)

    def unread(self, cursor: Cursor, final: Generation | None = None) -> tuple[str, slice]:
        """What a reader at `cursor` has not been handed (it moves the cursor): the text and the range of ids up
        to the shown point, or, given the final Generation, to its end."""
        start_ids, start_chars = self.settled_ids[cursor.point], self.settled_chars[cursor.point]
        if final is not None:
            cursor.done = True
            return (final.text or "")[start_chars:], slice(start_ids, len(final.tokens))
        text, end = self.text_between(cursor.point, self.shown), self.settled_ids[self.shown]
        cursor.point = self.shown
        return text, slice(start_ids, end)


def take(detokenizer: Detokenizer, tokens: list[int], finish: int, eos: set[int], constraint=None
         ) -> tuple[int, str | None]:
    """A row's new tokens into its detokenizer (and its grammar, `linnet_jax.structured.Constraint`, when it has
    one); finish: the row's state after them. Returns how many of the tokens are output (a stop id that finished
    the row is not) and why the row stopped (None while it runs): "stop" for a stop string, a stop id or a
    complete grammar, "eos" for one of the model's eos ids, "length" otherwise."""
    stop_id = tokens[-1] if finish == STOP_ID else None
    kept = len(tokens) - (stop_id is not None)
    detokenizer.add(tokens[:kept])
    if detokenizer.stop_at is not None:
        return kept, "stop"
    if stop_id is not None:
        return kept, "eos" if stop_id in eos else "stop"
    if finish == RUNNING:
        return kept, "stop" if constraint is not None and constraint.advance(tokens) else None
    return kept, "length"
