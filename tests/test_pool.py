"""``molds.runtime.pool.chunked_map``: the same results, in the same order, on one process
and on a pool of spawned ones."""

import os

import pytest

from molds.runtime.pool import chunked_map


def _tagged(chunk: list[int]) -> list[tuple[int, int]]:
    """Each item squared, with the process that did it."""
    return [(x * x, os.getpid()) for x in chunk]


def test_chunks_on_spawned_processes_come_back_in_the_items_order():
    items = list(range(103))[::-1]  # a last chunk shorter than the others
    pooled = chunked_map(_tagged, items, workers=2, chunk=10)
    assert [v for v, _ in pooled] == [x * x for x in items]
    assert os.getpid() not in {pid for _, pid in pooled}  # the pool did the work
    alone = chunked_map(_tagged, items, workers=1, chunk=10)
    assert [v for v, _ in alone] == [x * x for x in items] and {pid for _, pid in alone} == {os.getpid()}
    # one chunk of work starts no pool, whatever the workers
    assert {pid for _, pid in chunked_map(_tagged, items, workers=2, chunk=500)} == {os.getpid()}
    assert chunked_map(_tagged, [], workers=2) == []


def test_a_chunk_of_no_items_is_refused():
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        chunked_map(_tagged, [1, 2], chunk=0)
