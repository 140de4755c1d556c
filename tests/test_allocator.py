"""molds.runtime.allocator: a large activation comes from the heap and stays in the process once
freed (the C library's defaults map it fresh and hand it back to the kernel, and the
next step faults its pages in again). Checked with glibc's own accounting (mallinfo2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MALLINFO = r"""
import ctypes, json, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = Info
"""

SCRIPT = MALLINFO + r"""
from molds.runtime.allocator import retain_freed_memory
state = retain_freed_memory()
before = mallinfo2()
t = torch.empty(6 << 20)  # a 24 MiB activation, the first this large in the process
t.fill_(1.0)
alive = mallinfo2()
del t
after = mallinfo2()
print(json.dumps({"state": state, "mapped_while_alive": alive.hblkhd - before.hblkhd,
                  "free_heap_after": after.fordblks}))
"""


def _run(system: bool) -> dict:
    env = dict(os.environ, MOLDS_SYSTEM_ALLOCATOR="1" if system else "0")
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(key, None)  # the C library's defaults, whatever the caller's environment says
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_mallinfo2() -> bool:
    import ctypes

    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 (mallopt, mallinfo2)")
def test_large_activations_come_from_the_heap_and_stay():
    size = 24 << 20
    retained, system = _run(system=False), _run(system=True)
    assert retained["state"] == "retain" and system["state"] == "system"
    assert system["mapped_while_alive"] >= size, system  # its own mmap, unmapped at free
    assert retained["mapped_while_alive"] == 0, retained
    assert retained["free_heap_after"] >= size, retained  # kept for the next step


BOUNDED = MALLINFO + r"""
from molds.runtime.allocator import bound_peak_memory
state = bound_peak_memory()
t = torch.empty(6 << 20)  # a 24 MiB activation of one batch, freed
t.fill_(1.0)
del t
before = mallinfo2()
t = torch.empty(4 << 20)  # the next batch's 16 MiB one
t.fill_(1.0)
alive = mallinfo2()
del t
after = mallinfo2()
print(json.dumps({"state": state, "mapped_while_alive": alive.hblkhd - before.hblkhd,
                  "heap_growth_after": after.arena - before.arena}))
"""


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 (mallopt, mallinfo2)")
def test_a_prediction_streams_activations_stay_out_of_the_heap():
    """bound_peak_memory (molds-predict): after a larger block was freed, the next batch's
    16 MiB activation is still its own mapping, handed back when freed; the C library's
    default raised its threshold at the first free and serves it from a heap that grows."""
    size = 16 << 20
    runs = {}
    for system in (False, True):
        env = dict(os.environ, MOLDS_SYSTEM_ALLOCATOR="1" if system else "0")
        for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
            env.pop(key, None)
        out = subprocess.run([sys.executable, "-c", BOUNDED], env=env, capture_output=True, text=True, check=True)
        runs[system] = json.loads(out.stdout.strip().splitlines()[-1])
    bounded, system = runs[False], runs[True]
    assert bounded["state"] == "bounded" and system["state"] == "system"
    assert bounded["mapped_while_alive"] >= size and bounded["heap_growth_after"] < size, bounded
    assert system["mapped_while_alive"] == 0 and system["heap_growth_after"] >= size, system


def test_system_allocator_opt_out_is_reported(monkeypatch):
    import molds.runtime.allocator as a

    monkeypatch.setattr(a, "_state", None)
    monkeypatch.setenv("MOLDS_SYSTEM_ALLOCATOR", "1")
    assert a.retain_freed_memory() == "system"
    monkeypatch.setattr(a, "_state", None)


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
def test_the_etl_command_re_runs_itself_once_with_the_malloc_cache(monkeypatch):
    """rerun_with_malloc_cache re-runs the command line as it was started, with the tcache
    tunable added; the re-run goes on (it never loops, even when the setting was lost on the
    way); a user's tcache_count and MOLDS_SYSTEM_ALLOCATOR=1 are left alone."""
    from molds.runtime import allocator

    execs = []
    monkeypatch.setattr(os, "execv", lambda path, argv: execs.append((path, argv, dict(os.environ))))
    for name in ("GLIBC_TUNABLES", allocator._RERUN, "MOLDS_SYSTEM_ALLOCATOR"):
        monkeypatch.setenv(name, "")  # whatever the calls below set is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "molds.preprocessing.cli", "--input", "x.csv"])
    allocator.rerun_with_malloc_cache()
    assert len(execs) == 1
    path, argv, env = execs[0]
    assert (path, argv) == (sys.executable, sys.orig_argv)
    assert env["GLIBC_TUNABLES"] == allocator.TCACHE_TUNABLE and env[allocator._RERUN] == "1"
    # the re-run: the setting arrived, and the marker is not handed on
    assert allocator.rerun_with_malloc_cache() == "in force" and allocator._RERUN not in os.environ
    # the re-run whose GLIBC_TUNABLES was lost on the way: no second re-run
    os.environ[allocator._RERUN] = "1"
    del os.environ["GLIBC_TUNABLES"]
    assert allocator.rerun_with_malloc_cache() == "lost" and len(execs) == 1
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.tcache_count=9"
    assert allocator.rerun_with_malloc_cache() == "user"
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.mxfast=64"
    os.environ["MOLDS_SYSTEM_ALLOCATOR"] = "1"
    assert allocator.rerun_with_malloc_cache() == "system" and len(execs) == 1
