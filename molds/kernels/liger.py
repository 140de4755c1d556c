"""Liger Kernel's fused RMSNorm, SwiGLU and linear + cross-entropy as backends of the ops
``kernels.triton`` swaps in (``kernels.fused_backend``).

Why: measured on an H200 (stop 36, ``benchmarks/kernel_ops.py``), Liger Kernel's versions of
these three ops were faster than molds' own (RMSNorm 1.2x, SwiGLU 1.1x, the LM head with
the loss 1.75x) and its LM head held a nineteenth of the memory. A well-kept library that
beats ours is the one to use; molds' kernels stay as the CPU path, the reference every
backend is tested against (``tests/kernels/test_liger.py``), and the choice where Liger
Kernel is not installed. Liger Kernel runs on CUDA GPUs only.

Each function here has the signature and the math of molds' op it replaces:

- ``liger_rms_norm(x, weight, eps)``: HF Llama's RMSNorm (statistics in float32, the
  normalized value rounded to x's dtype before the weight scales it: Liger's ``llama``
  casting mode); the result in the promoted dtype of (x, weight), as molds' is;
- ``liger_swiglu(gate, up)``: ``silu(gate) * up``;
- ``liger_linear_cross_entropy(hidden, weight, targets)``: the mean cross-entropy of
  ``hidden @ weight^T`` over the targets that are not ``IGNORE_INDEX``, without the full
  logits; under autocast both operands in the autocast dtype (what ``F.linear`` would use).
"""

from __future__ import annotations

import torch

from .cross_entropy import IGNORE_INDEX


def liger_available() -> bool:
    """Whether Liger Kernel imports here."""
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
        import liger_kernel.ops.rms_norm  # noqa: F401
        import liger_kernel.ops.swiglu  # noqa: F401
    except Exception:  # ImportError, or a triton / torch it cannot work with
        return False
    return True


def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # optional: the gpu extra

    shape = x.shape
    y = LigerRMSNormFunction.apply(x.reshape(-1, shape[-1]), weight, eps, 0.0, "llama", False)
    return y.view(shape).to(torch.promote_types(x.dtype, weight.dtype))


def liger_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction  # optional: the gpu extra

    return LigerSiLUMulFunction.apply(gate, up)


def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    from liger_kernel.ops.fused_linear_cross_entropy import (  # optional: the gpu extra
        LigerFusedLinearCrossEntropyFunction,
    )

    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    with torch.autocast(device, enabled=False):  # its products run in the dtype chosen above
        out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, targets, None, None, ignore_index)
    return (out[0] if isinstance(out, tuple) else out).float()
