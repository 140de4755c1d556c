"""Process-group set-up for every launcher: ``deepspeed``, ``torchrun``, plain ``python``.

Without CUDA it picks gloo and DeepSpeed's CPU accelerator by itself. One timeout
(``parallel.collective_timeout_s``) applies to every process group molds or DeepSpeed
creates (the default group, DeepSpeed's data/expert/pipeline groups: they are created
with torch's default timeout, which is set here), so a hung or dead peer ends the job
instead of hanging it; ``collective(op)`` turns such a failure into a one-line error
naming the rank, the operation and the rank that was lost (``molds.runtime.heartbeat``). A single ``python`` process that needs a process
group (DeepSpeed engines) gets a one-rank gloo group on a free local port. On CPU ranks
each rank's torch threads share the machine's cores with the other ranks on it
(``share_cores``), unless ``OMP_NUM_THREADS`` says how many.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import os
import socket
import sys
from dataclasses import dataclass

import torch
from torch.distributed import distributed_c10d

from ..errors import CollectiveTimeout
from .heartbeat import start_heartbeat


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    timeout_s: float = 600.0
    heartbeat: object = None  # molds.runtime.heartbeat.Heartbeat: names a lost rank when a collective fails

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def free_port() -> int:
    """A TCP port free on this machine now (the OS's choice), for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_default_timeout(timeout_s: float) -> None:
    """Groups created later without an explicit timeout (DeepSpeed's) get this one."""
    td = datetime.timedelta(seconds=timeout_s)
    distributed_c10d.default_pg_timeout = td
    if hasattr(distributed_c10d, "default_pg_nccl_timeout"):
        distributed_c10d.default_pg_nccl_timeout = td


def local_ranks() -> int:
    """How many ranks this machine runs: torchrun and molds' own one-process runs set
    ``LOCAL_WORLD_SIZE``, DeepSpeed's launcher ``LOCAL_SIZE``."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or numactl's
    share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def share_cores() -> int:
    """Give this CPU rank, one of several on the machine, its share of the cores as torch
    threads; returns the count it runs with. ``OMP_NUM_THREADS``, where set, decides
    (torchrun sets it to 1 for more than one rank). DeepSpeed's launcher sets nothing
    (unless ``--bind_cores_to_rank``), and each rank then ran one OpenMP thread per core:
    ``deepspeed --num_gpus 4`` on 2 cores ran 8 threads, each spinning while another rank
    held its core (tests/engines/test_moe_fp8_run.py, four ranks: 114 s with them, 87 s at
    one thread per rank; 2-core EPYC, one run after the other)."""
    ranks = local_ranks()
    if ranks > 1 and not os.environ.get("OMP_NUM_THREADS"):  # one rank: torch's own choice, or its caller's
        threads = max(1, usable_cores() // ranks)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
    return torch.get_num_threads()


def init_distributed(timeout_s: float = 600.0, *, need_group: bool = False) -> DistInfo:
    """Join (or create) the process group. ``need_group``: create a one-rank group even
    for a single process (DeepSpeed's engines want one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:  # plain `python molds/train.py`: what a launcher would have set
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    set_default_timeout(timeout_s)
    backend = None
    if (world > 1 or need_group) and not torch.distributed.is_initialized():
        # small host-side collectives (flags, counters, objects) use CPU tensors: gloo
        # carries those, NCCL the CUDA tensors
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world,
                                             timeout=datetime.timedelta(seconds=timeout_s))
    elif torch.distributed.is_initialized():
        backend = torch.distributed.get_backend()
    if not cuda:  # DeepSpeed maps one for a single rank too
        atexit.register(release_deepspeed_shm, rank)
        share_cores()
    heartbeat = None
    if world > 1:
        heartbeat = start_heartbeat(rank, world)
    return DistInfo(rank, world, local_rank, device, backend, timeout_s, heartbeat)


def deepspeed_shm_path(rank: int) -> str:
    """The shared-memory segment DeepSpeed 0.19.8's CPU all-reduce creates for ``rank``
    (csrc/cpu/comm/shm.cpp: ``deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``,
    69 MB each)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_deepspeed_shm(rank: int) -> None:
    """Unlink this rank's DeepSpeed all-reduce segment at exit. DeepSpeed never unlinks it
    (its ``shared_close`` is not called), so every CPU run left 69 MB per rank in
    /dev/shm, i.e. in RAM: 12 GB after a few test suites on a 24 GiB machine. Every rank
    has mapped every peer's segment during initialization, and a mapping outlives the
    name, so unlinking at exit disturbs no rank still running."""
    try:
        os.unlink(deepspeed_shm_path(rank))
    except FileNotFoundError:
        pass
    except OSError as exc:  # not worth failing a finished run for; said
        print(f"[molds] warning: could not remove {deepspeed_shm_path(rank)} ({exc})", file=sys.stderr)


_TIMEOUT_MARKS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
                  "connection refused", "socket", "peer")


@contextlib.contextmanager
def collective(op: str, dist: DistInfo):
    """Run a step that talks to the other ranks; a timeout or a vanished peer becomes a
    ``CollectiveTimeout`` that names this rank, the operation and the timeout."""
    try:
        yield
    except RuntimeError as exc:  # torch's DistBackendError / gloo errors are RuntimeErrors
        text = str(exc).lower()
        if not dist.distributed or not any(m in text for m in _TIMEOUT_MARKS):
            raise
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        who = dist.heartbeat.lost_ranks() if dist.heartbeat is not None else "another rank is hung or has died"
        raise CollectiveTimeout(
            f"rank {dist.rank}: {op} did not complete (parallel.collective_timeout_s={dist.timeout_s:g}): {who} "
            f"({first})") from exc


@contextlib.contextmanager
def quiet_on_other_ranks(dist: DistInfo):
    """Library chatter printed by every rank (DeepSpeed's "op built successfully", say)
    is shown once: ranks other than 0 drop what they print inside this block."""
    if dist.is_main:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


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


def all_reduce_max(value: float, dist: DistInfo) -> float:
    if not dist.distributed:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


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
