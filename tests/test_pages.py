"""The paged KV cache's bookkeeping (`linnet_jax.serve.pages.PagePool`, issue 45), without a model or JAX: pages
held and released, a request that does not fit refused with nothing taken, prompts sharing their leading full
pages by reference and only on the same adapter load, unheld cached pages evicted least recently released
first."""

import subprocess
import sys

import pytest

from linnet_jax.serve import pages
from linnet_jax.serve.pages import PagePool

PAGE = 4


def prompt(*pages: int, tail: int = 1) -> list[int]:
    """Tokens of whole pages (page p: tokens 10p..10p+3), then `tail` tokens more."""
    return [10 * p + i for p in pages for i in range(PAGE)] + [999] * tail


def test_the_module_needs_no_jax():
    """Loaded alone (not through the package, whose root imports JAX), it imports no JAX."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('pages', sys.argv[1]); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code, pages.__file__]).returncode == 0


def test_pages_are_held_released_and_a_request_that_does_not_fit_takes_nothing():
    pool = PagePool(pages=6, page_size=PAGE)
    first, second = pool.allocate(4), pool.allocate(2)
    assert sorted(first + second) == list(range(6)) and pool.available == 0
    assert pool.allocate(1) is None and pool.available == 0  # waits: nothing taken
    pool.release(first)
    assert pool.available == 4 and pool.allocate(5) is None and len(pool.allocate(4)) == 4
    with pytest.raises(ValueError, match="no request holds it"):
        pool.release(first + first)
    assert pool.pages_for(9) == 3 and pool.pages_for(8) == 2
    for bad in (dict(pages=0, page_size=4), dict(pages=4, page_size=True), dict(pages=2.0, page_size=4)):
        with pytest.raises(ValueError, match="must be a positive int"):
            PagePool(**bad)


def test_prompts_share_their_leading_full_pages_by_reference():
    pool = PagePool(pages=8, page_size=PAGE)
    one = prompt(1, 2, 3)
    assert pool.lookup(one, b"") == []
    table = pool.allocate(pool.pages_for(len(one)))
    pool.publish(one, b"", table)
    two = prompt(1, 2, 5)  # the same first two pages
    shared = pool.lookup(two, b"")
    assert shared == table[:2] and [pool.holders[page] for page in shared] == [2, 2]
    assert pool.lookup(prompt(7, 2), b"") == []  # page 2 alike, after another first page: chained keys
    assert pool.lookup(prompt(1, 2), b"other adapter") == []
    exact = pool.lookup(prompt(1, 2, 3, tail=0), b"")  # its last token is computed again: two pages, not three
    assert exact == table[:2]
    assert pool.counters["hit_tokens"] == 4 * PAGE


def test_unheld_cached_pages_are_evicted_least_recently_released_first():
    pool = PagePool(pages=4, page_size=PAGE)
    old, new = prompt(1, tail=0) + [0], prompt(2, tail=0) + [0]
    for tokens in (old, new):
        table = pool.allocate(2)
        pool.publish(tokens, b"", table)
        pool.release(table)  # page 0 of each cached, its last page free
    assert pool.available == 4 and len(pool.cached) == 2
    taken = pool.allocate(3)  # two free pages, then the least recently released cached one: old's
    assert pool.lookup(old, b"") == [] and len(pool.lookup(new, b"")) == 1
    assert pool.counters["evicted_pages"] == 1 and pool.available == 0
    pool.release(taken)
