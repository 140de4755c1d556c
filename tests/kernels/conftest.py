"""What every kernel test shares: poisoned output buffers, the device the kernels run on
(a GPU's compiled kernels, or the interpreter on CPU tensors), fresh random data."""

from __future__ import annotations

import warnings

import pytest
import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _poisoned_empty(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype in FP8:
        t.view(torch.uint8).fill_(0x7F)  # a NaN code in both formats
    elif dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(-7)
    return t


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every Triton launcher's output starts as NaN (fp8: NaN codes), so an element a kernel
    does not write shows in the comparison with the reference."""
    from molds.kernels import launch

    monkeypatch.setattr(launch, "allocate", _poisoned_empty)
    with warnings.catch_warnings():  # the interpreter's numpy divides by zero on purpose (448 / 0 -> inf)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@pytest.fixture
def interpret(monkeypatch):
    """The custom ops run their Triton kernels on CPU tensors (in Triton's interpreter)."""
    from molds.kernels.launch import interpreter_ready

    assert interpreter_ready(), "triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)"
    monkeypatch.setenv("MOLDS_TRITON_INTERPRET", "1")


@pytest.fixture
def device(request):
    """Where a kernel test's Triton kernels run: compiled, on CUDA tensors, on a machine with a
    GPU; else on CPU tensors in Triton's interpreter. The tests make their data on the CPU
    (with ``gen``), move it here, and compare with the PyTorch reference run on the CPU copy."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    request.getfixturevalue("interpret")
    return torch.device("cpu")


@pytest.fixture
def gen():
    """A generator with a fresh seed each run (printed when a test fails)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item()) ^ int.from_bytes(__import__("os").urandom(4), "little")
    print(f"random seed {seed}")
    return torch.Generator().manual_seed(seed)
