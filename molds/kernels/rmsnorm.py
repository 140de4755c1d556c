"""Fused RMSNorm, forward and backward (``kernels.triton``).

Why it exists: in PyTorch, ``weight * F.rms_norm(x.float()).to(x.dtype)`` (HF's math,
``molds.models.decoder.rms_norm``, the reference) reads and writes the activation several
times (an upcast, the normalization, a downcast, the scale) and autograd keeps the
intermediates; a norm is memory-bound, so each pass costs its bytes. One kernel reads x
once and writes y once, keeping only 1/rms per row for the backward; the backward reads
x and dy once, writes dx once, and each program sums its rows' weight gradient into one
partial row (summed afterwards in a fixed order: deterministic, no atomics).

Same math as the reference: statistics and products in float32, the normalized value
rounded to x's dtype before the weight scales it, the result in the promoted dtype of
(weight, x).
"""

from __future__ import annotations

import torch

from ..models.decoder import rms_norm
from .launch import check_interpreter, empty, jit, runs_triton, tl


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@jit
def rms_norm_forward_kernel(X, W, Y, RSTD, N, H, eps, stride_x, stride_y, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.arange(0, BLOCK_H)
    w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    for r in range(0, ROWS):
        row = tl.program_id(0) * ROWS + r
        if row < N:
            x = tl.load(X + row * stride_x + cols, mask=cols < H, other=0.0)
            xf = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
            normed = (xf * rstd).to(x.dtype).to(tl.float32)
            tl.store(Y + row * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=cols < H)
            tl.store(RSTD + row, rstd)


@jit
def rms_norm_backward_kernel(DY, X, W, RSTD, DX, DW_PART, N, H, stride_dy, stride_x, stride_dx,
                             ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.arange(0, BLOCK_H)
    w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for r in range(0, ROWS):
        row = tl.program_id(0) * ROWS + r
        if row < N:
            x = tl.load(X + row * stride_x + cols, mask=cols < H, other=0.0)
            xf = x.to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=cols < H, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            n = xf * rstd
            dw += dy * n.to(x.dtype).to(tl.float32)
            dn = dy * w
            dx = rstd * (dn - n * (tl.sum(dn * n, axis=0) / H))
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=cols < H)
    tl.store(DW_PART + tl.program_id(0) * H + cols, dw, mask=cols < H)


def _block(h: int) -> int:
    return max(16, 1 << (h - 1).bit_length())


def _rows_per_program(n: int, device: torch.device) -> int:
    programs = torch.cuda.get_device_properties(device).multi_processor_count * 4 if device.type == "cuda" else 64
    return max(1, -(-n // programs))


def rms_norm_forward_triton(x2: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(y, rstd)`` for rows ``x2`` [N, H]."""
    if not x2.is_cuda:
        check_interpreter()
    n, h = x2.shape
    y = empty((n, h), torch.promote_types(weight.dtype, x2.dtype), x2.device)
    rstd = empty(n, torch.float32, x2.device)
    if n:
        rows = _rows_per_program(n, x2.device)
        rms_norm_forward_kernel[(-(-n // rows),)](x2, weight, y, rstd, n, h, eps, x2.stride(0), y.stride(0),
                                                  ROWS=rows, BLOCK_H=_block(h))
    return y, rstd


def rms_norm_backward_triton(dy2, x2, weight, rstd):
    """``(dx, dweight)``."""
    if not x2.is_cuda:
        check_interpreter()
    n, h = x2.shape
    dx = empty(x2.shape, x2.dtype, x2.device)
    rows = _rows_per_program(n, x2.device)
    programs = -(-n // rows)
    partial = empty((programs, h), torch.float32, x2.device)
    if n:
        rms_norm_backward_kernel[(programs,)](dy2, x2, weight, rstd, dx, partial, n, h, dy2.stride(0), x2.stride(0),
                                              dx.stride(0), ROWS=rows, BLOCK_H=_block(h))
    return dx, partial.sum(0).to(weight.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------- custom ops

@torch.library.custom_op("molds::rms_norm_forward", mutates_args=())
def _forward_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows(x)
    if runs_triton(x):
        y, rstd = rms_norm_forward_triton(x2, weight, eps)
    else:
        xf = x2.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        y = weight * (xf * rstd[:, None]).to(x.dtype)
    return y.view(*x.shape[:-1], x.shape[-1]), rstd


@_forward_op.register_fake
def _(x, weight, eps):
    return (x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)),
            x.new_empty(x.shape[:-1].numel(), dtype=torch.float32))


@torch.library.custom_op("molds::rms_norm_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x2, dy2 = _rows(x), _rows(dy)
    if runs_triton(x):
        dx, dw = rms_norm_backward_triton(dy2, x2, weight, rstd)
    else:
        xf, g = x2.float(), dy2.float()
        n = xf * rstd[:, None]
        dn = g * weight.float()
        dx = (rstd[:, None] * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype)
        dw = (g * n.to(x.dtype).float()).sum(0).to(weight.dtype)
    return dx.view(x.shape), dw


@_backward_op.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _backward_op(grad_y, x, weight, rstd)
    return dx, dw, None


_forward_op.register_autograd(_backward, setup_context=_setup)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``molds.models.decoder.rms_norm`` in one kernel each way (the ``RMSNorm.norm`` region)."""
    return _forward_op(x, weight, eps)[0]
