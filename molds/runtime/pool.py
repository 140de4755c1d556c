"""``chunked_map``: a function over a list's chunks, in order, on a pool of spawned processes.

RDKit work over hundreds of thousands of molecules (the parents that keep benchmark molecules
out of a pretraining corpus, descriptors of a corpus) is per molecule and stateless, so it
splits into chunks. ``spawn``, not ``fork``: a parent that has started torch's or RDKit's
threads must not be forked. One chunk, or one worker, runs in this process and starts no pool.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def chunked_map(fn: Callable[[list[T]], list[R]], items: list[T], workers: int = 1, chunk: int = 2000) -> list[R]:
    """``fn`` (a module-level function: the pool pickles it by name) on consecutive chunks of
    ``chunk`` items, on ``workers`` processes when there is more than one chunk; its results
    joined in the items' order."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    chunks = [items[i:i + chunk] for i in range(0, len(items), chunk)]
    if workers <= 1 or len(chunks) <= 1:
        return [r for c in chunks for r in fn(c)]
    import multiprocessing as mp  # here: a caller on one process starts no pool

    with mp.get_context("spawn").Pool(min(workers, len(chunks))) as pool:
        return [r for part in pool.map(fn, chunks) for r in part]
