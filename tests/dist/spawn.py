"""Run a function on N gloo ranks in fresh processes (CPU), and collect what they return."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from molds.runtime.distributed import free_port  # noqa: F401  (the tests' import)


def _entry(rank: int, world: int, port: int, fn, args, out_dir: str, env: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu", **env)
    torch.set_num_threads(1)
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # The rank has reported. Skip the interpreter's teardown of C++ state (gloo and DeepSpeed
    # op threads): CI once saw a ZeRO-3 rank abort there ("terminate called without an active
    # exception") after its result was written and its process group destroyed.
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout_s: float = 600, env: dict | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns each rank's result. A
    rank that raises fails the call; ranks still running after ``timeout_s`` are killed
    and the call fails."""
    out_dir = tempfile.mkdtemp(prefix="molds-dist-")
    ctx = torch.multiprocessing.start_processes(_entry, args=(world, free_port(), fn, args, out_dir, env or {}),
                                                nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish within {timeout_s} s")
    # results are written by this test's own child processes
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
