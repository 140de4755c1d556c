"""Where a molds kernel runs, decided per call from the tensor it gets.

- A CUDA tensor: the compiled Triton kernel (the FP8 GEMMs also ask whether the GPU has
  FP8 matrix units: compute capability 8.9 or later).
- A CPU tensor: the op's PyTorch path (its reference, or a CPU version of it). With
  ``MOLDS_TRITON_INTERPRET=1`` the Triton kernel runs instead, in Triton's interpreter
  (numpy: slow, for tests and for reading a kernel step by step).

There is no Triton backend for CPUs on the package index, and Triton decides once, when
it is imported, whether its kernels (its own ``tl.max`` and ``tl.sum`` among them) are
compiled or interpreted. So on a machine without a GPU this module sets
``TRITON_INTERPRET=1`` before it imports triton: compiled kernels could not run there
anyway, and the interpreted ones can. ``describe`` gives the start line's words.
"""

from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():  # no GPU: Triton kernels can only run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # kernels are written against triton.language; without triton they are never launched
    import triton
    import triton.language as tl
except ImportError:  # a platform with no triton wheel: every op takes its PyTorch path
    triton = tl = None


def triton_available() -> bool:
    return triton is not None


def jit(fn):
    """``triton.jit`` (the function itself where triton is not installed: never launched)."""
    return fn if triton is None else triton.jit(fn)


@functools.cache
def interpreter_ready() -> bool:
    """Triton was imported in interpreter mode (its library functions are interpreted too)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction  # optional: the gpu extra

    return isinstance(tl.standard.max, InterpretedFunction)


def check_interpreter() -> None:
    """Before a Triton kernel runs on CPU tensors: the interpreter must be what triton loaded."""
    if not interpreter_ready():
        raise RuntimeError("Triton kernels run on CPU tensors only in Triton's interpreter, and triton was "
                           "imported without it: set TRITON_INTERPRET=1 in the environment before the process "
                           "starts" if triton is not None else "triton is not installed")


def _allocate(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


allocate = _allocate  # the kernel tests swap in one that poisons the buffer


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The output buffers of the Triton launchers (the tests poison them through
    ``allocate``, so an element a kernel forgets to write shows)."""
    return allocate(shape, dtype, device)


def runs_triton(t: torch.Tensor) -> bool:
    """Whether the custom op runs its Triton kernel on this tensor (else its PyTorch path)."""
    if t.is_cuda:
        return triton is not None and not interpreter_ready()
    return os.environ.get("MOLDS_TRITON_INTERPRET") == "1" and interpreter_ready()


@functools.cache
def fp8_matrix_units(index: int = 0) -> bool:
    """An NVIDIA GPU with FP8 tensor cores (Ada, Hopper, Blackwell: sm_89 and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index) >= (8, 9)


def describe(device: torch.device) -> str:
    """Where the Triton ops run on ``device``, in words."""
    if device.type == "cuda":
        return "Triton" if runs_triton(torch.empty(0, device=device)) else "PyTorch (triton is not usable here)"
    if runs_triton(torch.empty(0)):
        return "Triton interpreter (MOLDS_TRITON_INTERPRET=1: slow, for checking kernels)"
    return "PyTorch (a CPU: Triton kernels run here only in its interpreter, for tests)"
