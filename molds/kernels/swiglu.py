"""Fused SwiGLU, forward and backward (``kernels.triton``).

Why it exists: ``F.silu(gate) * up`` (``molds.models.decoder.swiglu``, the reference) is
two elementwise kernels forward, and autograd keeps silu(gate) for the backward, which
is four more passes; on the widest activations of the model (the MLP's and every
expert's intermediate width) that is most of a decoder's memory traffic outside the
GEMMs. Here the forward reads gate and up once and writes the product; the backward
reads gate, up and the incoming gradient once and writes both gradients, recomputing
the sigmoid instead of storing it. Arithmetic in float32, silu(gate) rounded to the
input dtype before the product as PyTorch does; results in the inputs' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.decoder import swiglu
from .launch import check_interpreter, empty, jit, runs_triton, tl


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu(gate, up)


@jit
def swiglu_forward_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    silu = (gf * tl.sigmoid(gf)).to(g.dtype).to(tl.float32)
    tl.store(Y + offs, (silu * u).to(Y.dtype.element_ty), mask=mask)


@jit
def swiglu_backward_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    sig = tl.sigmoid(gf)
    silu = gf * sig
    tl.store(DU + offs, (dy * silu.to(g.dtype).to(tl.float32)).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * sig * (1.0 + gf * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


_BLOCK = 1024


def swiglu_forward_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not gate.is_cuda:
        check_interpreter()
    gate, up = gate.contiguous(), up.contiguous()
    y = empty(gate.shape, torch.promote_types(gate.dtype, up.dtype), gate.device)
    n = gate.numel()
    if n:
        swiglu_forward_kernel[(-(-n // _BLOCK),)](gate, up, y, n, BLOCK=_BLOCK)
    return y


def swiglu_backward_triton(dy, gate, up):
    if not gate.is_cuda:
        check_interpreter()
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = empty(gate.shape, gate.dtype, gate.device), empty(up.shape, up.dtype, up.device)
    n = gate.numel()
    if n:
        swiglu_backward_kernel[(-(-n // _BLOCK),)](dy, gate, up, dg, du, n, BLOCK=_BLOCK)
    return dg, du


@torch.library.custom_op("molds::swiglu", mutates_args=())
def _forward_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_forward_triton(gate, up) if runs_triton(gate) else F.silu(gate) * up


@_forward_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("molds::swiglu_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if runs_triton(gate):
        return swiglu_backward_triton(dy, gate, up)
    return torch.ops.aten.silu_backward(dy * up, gate), dy * F.silu(gate)  # aten's fused silu gradient


@_backward_op.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return _backward_op(grad, gate, up)


_forward_op.register_autograd(_backward, setup_context=_setup)


def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel each way (the ``MLP.act`` / ``Experts.act`` region)."""
    return _forward_op(gate, up)
