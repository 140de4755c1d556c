"""Run a function on N gloo ranks in fresh processes (CPU), and collect what they return."""

from __future__ import annotations

import os
import socket
import tempfile

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: int = 600) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns each rank's result."""
    out_dir = tempfile.mkdtemp(prefix="molds-dist-")
    ctx = torch.multiprocessing.start_processes(_entry, args=(world, _free_port(), fn, args, out_dir),
                                                nprocs=world, join=False, start_method="spawn")
    while not ctx.join(timeout=timeout_s):
        pass
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
