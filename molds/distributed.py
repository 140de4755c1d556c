"""Process-group set-up for every launcher: ``deepspeed``, ``torchrun``, plain ``python``.

Without CUDA it picks gloo and DeepSpeed's CPU accelerator by itself. Collectives get a
finite timeout, so a rank that dies ends the others instead of hanging them forever.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_s: float = 600.0) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = None
    if world > 1 and not torch.distributed.is_initialized():
        # small host-side collectives (flags, counters, objects) use CPU tensors: gloo
        # carries those, NCCL the CUDA tensors
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world,
                                             timeout=datetime.timedelta(seconds=timeout_s))
    elif torch.distributed.is_initialized():
        backend = torch.distributed.get_backend()
    return DistInfo(rank, world, local_rank, device, backend)


def all_reduce_mean(value: float, dist: DistInfo, device=None) -> float:
    if not dist.distributed:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device or torch.device("cpu"))
    torch.distributed.all_reduce(t)
    return float(t.item()) / dist.world_size


def all_reduce_sum(values: list[float], dist: DistInfo) -> list[float]:
    if not dist.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.tolist()


def all_have(flag: bool, dist: DistInfo) -> bool:
    """True only if every rank says True (e.g. "I have a batch"): ranks stop together."""
    if not dist.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def gather_objects(obj, dist: DistInfo) -> list:
    if not dist.distributed:
        return [obj]
    out = [None] * dist.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def barrier(dist: DistInfo) -> None:
    if dist.distributed:
        torch.distributed.barrier()
