"""What every kind of run does at its start and end, whatever it trains: the process's
seeds per rank, library chatter filtered, the code version and machine for the lineage
(``cpu_description``: the CPU named in every figure), leaving the process group cleanly
(``molds/train.py`` and ``molds.goal`` share them), and ending the process once all of that
is done (``exit_process``)."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import platform
import random
import subprocess
import sys
import threading
import warnings

from molds import __version__


def leave_process_group(dist=None) -> None:
    import torch  # here: molds-predict --help loads no torch

    if dist is not None and dist.heartbeat is not None:
        dist.heartbeat.stop()
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _forget_deepspeed_groups()


def _forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the groups it made (its clone of the world, data / expert / model
    parallel groups, the ``mpu``) in module globals, and a later engine in the same process
    (``molds-eval --recipe`` trains one per seed) would use them after their process group
    is gone ("Group ... is not registered"). They are dropped with the group."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper() and "GROUP" in name:
            setattr(groups, name, {} if isinstance(value, dict) else None)
    groups.mpu = None


def exit_process(code: int) -> None:
    """End this process with ``code`` once what a normal exit does for the outside world is
    done: the threading module's exit hooks run (thread pools end their workers) and other
    threads that are not daemons finished, the ``atexit`` handlers run (logging's
    flush, multiprocessing's children, temporary directories), stdout and stderr flushed. What is
    left out is the interpreter tearing down its modules and the libraries' C++ state one object
    at a time: 2.5-3.7 s of a 2-core AVX2 EPYC after every run (torch, DeepSpeed, RDKit, SciPy
    loaded), paid by every rank of every launch, and the place where gloo's threads can still
    call into a Python that is going away. Every file the run writes is closed before this (its
    checkpoints are atomic; ``teardown`` closes the logs)."""
    # what the interpreter does first at exit: the threading module's exit hooks (a thread pool's
    # idle workers are told to end there: joined before them, they wait forever), then every
    # thread that is not a daemon joined
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or detached: nothing left to write
            pass
    os._exit(code)


def seed_rank(seed: int, rank: int) -> None:
    """Initialization is the same on every rank; what comes after (dropout, sampling)
    must not be: each rank's generators are seeded from (seed, rank)."""
    import numpy as np  # here: molds-predict --help loads no NumPy
    import torch  # here: molds-predict --help loads no torch

    s = (seed * 1_000_003 + rank * 7_919 + 1) % 2**31
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


def code_version() -> str:
    if os.environ.get("MOLDS_NO_GIT"):
        return __version__
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(__file__),
                             capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{__version__}+{rev}" if rev else __version__


def quiet_third_party() -> None:
    """Known-harmless warnings of DeepSpeed and torch on CPU, filtered once per process."""
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated.*")
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*is deprecated.*")
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not cuda() else os.environ.get("DS_ACCELERATOR", "cuda"))
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def cuda() -> bool:
    import torch  # here: molds-predict --help loads no torch

    return torch.cuda.is_available()


def machine(device) -> str:
    """What the run ran on, named in the lineage (a figure that does not name its CPU class
    cannot be re-run)."""
    import torch  # here: molds-predict --help loads no torch

    gpu = f"{torch.cuda.get_device_name(device)}; " if device.type == "cuda" else ""
    return f"{gpu}{cpu_description()}; torch {torch.__version__}"


CPU_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_description() -> str:
    """The CPU model, the flags that decide its matrix speed, and the core count."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            info = fh.read()
    except OSError:
        return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    lines = info.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith(("flags", "Features"))), [])
    units = [f for f in CPU_FLAGS if f in flags] or [f for f in ("bf16", "sve", "asimd") if f in flags]
    return f"{name} ({', '.join(units) or 'no listed vector flags'}; {os.cpu_count()} cores)"
