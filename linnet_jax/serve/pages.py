"""The paged KV cache's bookkeeping, on the host and without JAX: a pool of `pages` pages of `page_size` positions
shared by every request, each request's pages (its page table's row), and the prefix cache as shared pages.

A page is free, held (its count: the requests whose tables name it), or cached: a full page of a prompt's prefix
that no request holds, kept for a later prompt that starts the same way and evicted least recently released first
when a request needs a page and none is free. A full page is known by its key, a hash chained over the adapter's
prefix-cache key, every earlier page's tokens and its own, so a page is shared only by prompts equal up to its end
and on the same adapter load (vLLM's block hashes).

    pool = PagePool(pages=4096, page_size=16)
    shared = pool.lookup(prompt, key)        # the prompt's leading cached pages, now held for it
    fresh = pool.allocate(n)                 # n more pages, or None while the pool cannot give them (wait)
    pool.publish(prompt, key, shared + fresh)   # its full prompt pages, once prefilled, cached for later prompts
    pool.release(shared + fresh)             # at its end: cached pages stay until evicted, the others are free

A lookup leaves the prompt's last token to compute (its logits choose the first new token), so it returns at most
(len(prompt) - 1) // page_size pages. Not thread-safe: the scheduler owns it.
"""

import hashlib
import numbers
from collections import OrderedDict, deque


def check_positive(name: str, value) -> None:
    """A ValueError naming `name` unless value is a positive int (numpy's too; not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class PagePool:
    """The pool's pages: free, held (counted) and cached (see the module docstring)."""

    def __init__(self, pages: int, page_size: int):
        check_positive("pages", pages)
        check_positive("page_size", page_size)
        self.page_size = page_size
        self.free: deque[int] = deque(range(pages))  # never used, or evicted
        self.holders = [0] * pages  # page -> the requests holding it
        self.cached: OrderedDict[int, None] = OrderedDict()  # unheld cached pages, least recently released first
        self.page_of: dict[bytes, int] = {}  # a full page's key -> its page
        self.key_of: dict[int, bytes] = {}  # and back
        self.counters = {"lookup_tokens": 0, "hit_tokens": 0, "evicted_pages": 0}

    @property
    def pages(self) -> int:
        return len(self.holders)

    @property
    def available(self) -> int:
        """Pages an `allocate` can give now: free ones and cached ones it would evict."""
        return len(self.free) + len(self.cached)

    def pages_for(self, positions: int) -> int:
        """Pages that hold `positions` positions."""
        return -(-positions // self.page_size)

    def page_keys(self, tokens: list[int], key: bytes) -> list[bytes]:
        """The chained key of each full page of `tokens` (key: the adapter load's prefix-cache key)."""
        keys, chain = [], hashlib.blake2b(key, digest_size=16).digest()
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            page = ",".join(map(str, tokens[start:start + self.page_size])).encode()
            chain = hashlib.blake2b(chain + page, digest_size=16).digest()
            keys.append(chain)
        return keys

    def peek(self, prompt: list[int], key: bytes) -> list[int]:
        """The prompt's leading pages that are cached (at most (len(prompt) - 1) // page_size), nothing held."""
        hits = []
        for page_key in self.page_keys(prompt[:len(prompt) - 1], key):
            if page_key not in self.page_of:
                break
            hits.append(self.page_of[page_key])
        return hits

    def lookup(self, prompt: list[int], key: bytes) -> list[int]:
        """The prompt's leading pages that are cached (`peek`), now held for it; counted in `counters`."""
        hits = self.peek(prompt, key)
        self.hold(hits)
        self.counters["lookup_tokens"] += len(prompt)
        self.counters["hit_tokens"] += len(hits) * self.page_size
        return hits

    def hold(self, pages: list[int]) -> None:
        """One more holder for each page (a cached one is no longer evictable)."""
        for page in pages:
            self.cached.pop(page, None)
            self.holders[page] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, held, free ones first and then evicting the least recently released cached ones; None
        (and nothing taken) when the pool has fewer available."""
        if count > self.available:
            return None
        taken = [self.free.popleft() if self.free else self.evict() for _ in range(count)]
        self.hold(taken)
        return taken

    def evict(self) -> int:
        """The least recently released cached page, forgotten."""
        page, _ = self.cached.popitem(last=False)
        del self.page_of[self.key_of.pop(page)]
        self.counters["evicted_pages"] += 1
        return page

    def publish(self, prompt: list[int], key: bytes, table: list[int]) -> None:
        """The full pages of `prompt` (its tokens so far whose keys and values are written: its table's leading pages)
        cached under their keys; a key cached already keeps its page (two prompts computed the same page at once)."""
        for page_key, page in zip(self.page_keys(prompt, key), table):
            if page_key not in self.page_of and page not in self.key_of:
                self.page_of[page_key], self.key_of[page] = page, page_key

    def forget(self, pages: list[int]) -> None:
        """Uncache these unheld pages (their keys and values are not to be shared): free again."""
        for page in pages:
            if page in self.cached:
                del self.cached[page]
                del self.page_of[self.key_of.pop(page)]
                self.free.append(page)

    def release(self, pages: list[int]) -> None:
        """One holder less for each page: at none, a cached page becomes evictable (most recently released last),
        another one free. A ValueError for a page that no request holds."""
        for page in pages:
            if self.holders[page] < 1:
                raise ValueError(f"page {page} is released but no request holds it")
            self.holders[page] -= 1
            if self.holders[page] == 0:
                if page in self.key_of:
                    self.cached[page] = None
                else:
                    self.free.append(page)
