"""Host memory allocator policies: a training process keeps freed memory for reuse
(``retain_freed_memory``); a prediction stream bounds its peak (``bound_peak_memory``,
below); the ETL command runs with glibc's larger per-thread cache (``rerun_with_malloc_cache``,
below).

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves blocks above its
mmap threshold (128 KiB, raised on the fly up to 32 MiB) with fresh ``mmap`` calls and
hands heap tops above its trim threshold back to the kernel, so a training step that
frees and re-allocates the same activations every step pays a page fault (and the
kernel's zeroing of the page) for every 4 KiB it touches again. Measured on the 2-core VMs
molds is tested on: the elementwise ops of an MoE layer, whose sorted tokens make a few
16-32 MiB activations, ran at 2-5x the cost of DeepSpeed's on 1-2 MiB per-expert pieces
(``benchmarks/moe_layer.py``), and a dense bf16 step of ``recipes/cpu_moses.json`` is 6-7 %
slower (``benchmarks/cpu_step.py``).

``retain_freed_memory`` fixes the thresholds, as ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` would at process start (and as the jemalloc/tcmalloc preloads
of ``torch.backends.xeon.run_cpu`` do for Intel's CPU recipes, without a second
allocator): blocks up to 256 MiB come from the heap (glibc's own threshold never rises
above 32 MiB, and the sorted token batch of a 4,096-token top-8 MoE layer is 32 MiB) and
freed memory stays in the process for the next step. The price is that the process's
resident size stays at its peak instead of shrinking between steps. Set
``MOLDS_SYSTEM_ALLOCATOR=1`` to keep the C library's defaults.

Written with ctypes because no maintained Python package exposes ``mallopt``; on a C
library without it (musl, macOS) this is a no-op that says so.

``rerun_with_malloc_cache`` is the ETL's policy (``molds-preprocess``), whose time is RDKit's:
RDKit allocates and frees dozens of same-sized objects a molecule, glibc's malloc and free
are about a third of a bare RDKit loop's instructions (callgrind), and glibc's per-thread
cache of freed blocks holds only 7 a size. With 256 (``TCACHE_TUNABLE``) most of those calls
stay in the cache; together with molecules used as the SD supplier reads them, the map
stage's work on an SD record is ~16 % faster (docs/benchmarks/etl.md, "SD files"). No ``mallopt`` sets it:
glibc reads ``GLIBC_TUNABLES`` only when a process starts, so the command re-runs itself
once, at start, with it added; its workers are forked and inherit it.
``MOLDS_SYSTEM_ALLOCATOR=1`` keeps the C library's defaults here too.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # above glibc's dynamic maximum (32 MiB), which an MoE layer's sorted batch exceeds
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of free heap top in the process

_state: str | None = None


def retain_freed_memory() -> str:
    """Apply the policy once per process. Returns what is in force: ``"retain"``,
    ``"system"`` (``MOLDS_SYSTEM_ALLOCATOR=1``) or ``"unavailable (...)"``."""
    return _apply("retain", ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


#: ``bound_peak_memory``'s fixed mmap threshold
BOUNDED_MMAP_THRESHOLD = 8 << 20


def bound_peak_memory() -> str:
    """The policy of a process that predicts batch after batch of varying shapes for as long as
    its input lasts (``molds-predict``): glibc's mmap threshold fixed at 8 MiB. Left to itself,
    glibc raises the threshold each time a mapped block is freed (up to 32 MiB), so the
    activations of later batches come from the heap, whose free pieces of other sizes it
    keeps: the process's peak grew chunk after chunk of the same molecules (954 to 1,054 MiB
    over 12 chunks of 2,000 HIV molecules, a BBBP model, the 2-core EPYC) where with the fixed
    threshold it stays flat (806 MiB) at about the same speed (a 1 MiB threshold: 700 MiB but
    a quarter slower): ``benchmarks/predict_memory.py``. Returns what is in force:
    ``"bounded"``, ``"system"`` (``MOLDS_SYSTEM_ALLOCATOR=1``) or ``"unavailable (...)"``."""
    return _apply("bounded", ((M_MMAP_THRESHOLD, BOUNDED_MMAP_THRESHOLD),))


def _apply(name: str, settings) -> str:
    """``mallopt`` each (parameter, value) once per process (the first policy asked for stays)."""
    global _state
    if _state is not None:
        return _state
    if os.environ.get("MOLDS_SYSTEM_ALLOCATOR", "") not in ("", "0"):
        _state = "system"
        return _state
    if not sys.platform.startswith("linux"):
        _state = f"unavailable ({sys.platform})"
        return _state
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError) as exc:
        _state = f"unavailable ({exc.__class__.__name__})"
        return _state
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in settings)
    _state = name if ok else "unavailable (mallopt refused)"
    return _state


TCACHE_TUNABLE = "glibc.malloc.tcache_count=256"
_RERUN = "MOLDS_ALLOCATOR_RERUN"  # set for the re-run: one re-run at most


def rerun_with_malloc_cache() -> str:
    """Re-run this command at once (``os.execv`` of ``sys.orig_argv``) with ``TCACHE_TUNABLE``
    added to ``GLIBC_TUNABLES``; returns only when it does not, saying why: ``"in force"``
    (this is the re-run, or the setting was there), ``"user"`` (``GLIBC_TUNABLES`` already
    sets ``tcache_count``: the user's value stands), ``"system"``
    (``MOLDS_SYSTEM_ALLOCATOR=1``), ``"lost"`` (this is the re-run and the setting did not
    arrive: something in between resets ``GLIBC_TUNABLES``; it goes on, never loops) or
    ``"unavailable (...)"`` (not glibc, or the command cannot be re-run as it started).
    Only for a command's own process: a caller in Python keeps its process's settings."""
    rerun = os.environ.pop(_RERUN, None)  # not handed on to the workers
    current = os.environ.get("GLIBC_TUNABLES", "")
    if TCACHE_TUNABLE in current.split(":"):
        return "in force"
    if "glibc.malloc.tcache_count" in current:
        return "user"
    if os.environ.get("MOLDS_SYSTEM_ALLOCATOR", "") not in ("", "0"):
        return "system"
    if rerun:
        return "lost"
    if platform.libc_ver()[0] != "glibc":
        return f"unavailable ({sys.platform}, not glibc)"
    argv = list(getattr(sys, "orig_argv", []))
    if not argv or not sys.executable:
        return "unavailable (no command line to re-run)"
    os.environ["GLIBC_TUNABLES"] = f"{current}:{TCACHE_TUNABLE}" if current else TCACHE_TUNABLE
    os.environ[_RERUN] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, argv)
    except OSError as exc:  # not re-runnable here: go on with the C library's defaults
        os.environ.pop(_RERUN, None)
        if current:
            os.environ["GLIBC_TUNABLES"] = current
        else:
            os.environ.pop("GLIBC_TUNABLES", None)
        return f"unavailable ({exc.__class__.__name__})"
