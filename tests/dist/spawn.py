"""Run a function on N gloo ranks in fresh processes (CPU), and collect what they return.

The ranks are forked from a server process that has imported the heavy libraries once
(``tests/dist/preload.py``: torch, DeepSpeed, transformers, RDKit and molds' training modules),
so a rank starts in a tenth of a second where a spawned interpreter took 4-10 s to import
them again (the suite starts many groups of ranks). Each rank is still a process of
its own that has run nothing but those imports, as a spawned one is: it gets the calling
process's environment, working directory, standard output and error at the call (the server
was started earlier, from another test), and unpickles the function and its arguments only
then, so a module it imports for them reads that environment."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import sys
import tempfile
import time
from multiprocessing import reduction

import torch

from molds.runtime.distributed import free_port  # noqa: F401  (the tests' import)

#: what the server imports before it forks a rank (one module that imports each heavy library
#: and survives one that fails: the server dies on any other exception in a preloaded import)
PRELOAD = ["tests.dist.preload"]


class _Stream:
    """One of the caller's file descriptors, handed to the rank through the server (a rank
    forked from it would otherwise write to the server's stdout, which is whatever pytest
    captured when the server started)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _Stream._opened, (reduction.DupFd(self.fd),)

    @staticmethod
    def _opened(dup) -> int:
        return dup.detach()


def _entry(rank: int, world: int, port: int, payload: bytes, out_dir: str, environ: dict, env: dict,
           streams: tuple):
    for fd, target in zip(streams, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)  # the caller's, at the call
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu", **env)
    torch.set_num_threads(1)
    fn, args = pickle.loads(payload)  # after the environment: the modules it imports read this one
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # The rank has reported. Skip the interpreter's teardown of C++ state (gloo and DeepSpeed
    # op threads): CI once saw a ZeRO-3 rank abort there ("terminate called without an active
    # exception") after its result was written and its process group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_server() -> None:
    """The fork server, started once a process: its imports see DeepSpeed's CPU accelerator,
    as every rank sets it, whatever GPU the machine has."""
    if getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is not None:
        return  # (ensure_running below is idempotent too; this only spares the environment's round trip)
    multiprocessing.set_forkserver_preload(PRELOAD)
    before = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = before


def run_ranks(fn, world: int, *args, timeout_s: float = 600, env: dict | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns each rank's result. A
    rank that raises fails the call; ranks still running after ``timeout_s`` are killed
    and the call fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    _start_server()
    payload = pickle.dumps((fn, args))
    streams = (_Stream(1), _Stream(2))
    with tempfile.TemporaryDirectory(prefix="molds-dist-", ignore_cleanup_errors=True) as out_dir:
        ctx = torch.multiprocessing.start_processes(
            _entry, args=(world, free_port(), payload, out_dir, dict(os.environ), env or {}, streams),
            nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish within {timeout_s} s")
        # results are written by this test's own child processes
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
