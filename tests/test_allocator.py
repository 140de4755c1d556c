"""molds.allocator: a large activation comes from the heap and stays in the process once
freed (the C library's defaults map it fresh and hand it back to the kernel, and the
next step faults its pages in again). Checked with glibc's own accounting (mallinfo2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, json, torch
from molds.allocator import retain_freed_memory
state = retain_freed_memory()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = Info
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


def test_system_allocator_opt_out_is_reported(monkeypatch):
    import molds.allocator as a

    monkeypatch.setattr(a, "_state", None)
    monkeypatch.setenv("MOLDS_SYSTEM_ALLOCATOR", "1")
    assert a.retain_freed_memory() == "system"
    monkeypatch.setattr(a, "_state", None)
