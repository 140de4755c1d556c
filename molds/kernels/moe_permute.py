"""Token permute / unpermute for the mixture-of-experts block (``kernels.triton``).

Why it exists: between the router and the experts every token's row is copied once per
(token, slot) pair into expert order, and after the experts the k output rows of each
token are weighted and summed back. In PyTorch that is ``index_select`` and
``index_add`` (``molds.models.moe.permute_tokens`` / ``unpermute_tokens``, the
references), whose backward passes scatter with atomic additions: on a GPU their
summation order, and so the low bits of the result, change from run to run. Here both
directions are gathers: a token's rows are found through a CSR view of ``token_of``
(its pairs in ascending order), so each output row is summed by one program in a fixed
order, the same as ``index_add``'s on a CPU. Four kernels:

    permute      out[i] = y[token_of[i]]                      (gather rows)
    its backward dy[t]  = sum over t's pairs i of dout[i]      (gather-sum)
    unpermute    out[t] = sum over t's pairs i of w[i] x[i]    (gather-sum, weighted)
    its backward dx[i]  = w[i] dout[token_of[i]],  dw[i] = <dout[token_of[i]], x[i]>

Rows are processed in float32 and stored in the tensor's dtype.
"""

from __future__ import annotations

import torch

from ..models.moe import permute_tokens, unpermute_tokens
from .launch import check_interpreter, empty, jit, runs_triton, tl


def permute_reference(y: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    return permute_tokens(y, token_of)


def unpermute_reference(x, token_of, weight_of, num_tokens: int) -> torch.Tensor:
    return unpermute_tokens(x, token_of, weight_of, num_tokens)


def pairs_by_token(token_of: torch.Tensor, num_tokens: int):
    """CSR of the pairs per token: ``order`` (pair indices grouped by token, ascending
    within a token) and ``start`` [num_tokens + 1]."""
    order = torch.argsort(token_of, stable=True)
    start = torch.zeros(num_tokens + 1, dtype=torch.int64, device=token_of.device)
    start[1:] = torch.cumsum(torch.bincount(token_of, minlength=num_tokens), 0)
    return order, start


# ---------------------------------------------------------------- Triton

@jit
def gather_rows_kernel(SRC, INDEX, OUT, H, stride_src, stride_out, BLOCK_H: tl.constexpr):
    """OUT[i] = SRC[INDEX[i]] (one program per row)."""
    i = tl.program_id(0)
    src = tl.load(INDEX + i)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(SRC + src * stride_src + cols, mask=cols < H, other=0.0)
        tl.store(OUT + i * stride_out + cols, v, mask=cols < H)


@jit
def gather_sum_kernel(SRC, WEIGHT, ORDER, START, OUT, H, stride_src, stride_out, WEIGHTED: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """OUT[t] = sum over p in START[t] .. START[t+1]-1 of (WEIGHT[ORDER[p]] x) SRC[ORDER[p]]."""
    t = tl.program_id(0)
    first = tl.load(START + t)
    last = tl.load(START + t + 1)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for p in range(first, last):
            i = tl.load(ORDER + p)
            v = tl.load(SRC + i * stride_src + cols, mask=cols < H, other=0.0).to(tl.float32)
            if WEIGHTED:
                v = v * tl.load(WEIGHT + i).to(tl.float32)
            acc += v
        tl.store(OUT + t * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=cols < H)


@jit
def unpermute_backward_kernel(DOUT, X, WEIGHT, TOKEN, DX, DW, H, stride_dout, stride_x, stride_dx,
                              BLOCK_H: tl.constexpr):
    """Pair i: DX[i] = WEIGHT[i] DOUT[TOKEN[i]], DW[i] = <DOUT[TOKEN[i]], X[i]>."""
    i = tl.program_id(0)
    t = tl.load(TOKEN + i)
    w = tl.load(WEIGHT + i).to(tl.float32)
    dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        g = tl.load(DOUT + t * stride_dout + cols, mask=cols < H, other=0.0).to(tl.float32)
        x = tl.load(X + i * stride_x + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(DX + i * stride_dx + cols, (g * w).to(DX.dtype.element_ty), mask=cols < H)
        dot += g * x
    tl.store(DW + i, tl.sum(dot, axis=0).to(DW.dtype.element_ty))


def _block(h: int) -> int:
    return min(1024, max(16, 1 << (h - 1).bit_length()))


def _rows(t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t


def permute_triton(y: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    if not y.is_cuda:
        check_interpreter()
    y = _rows(y)
    out = empty((len(token_of), y.shape[1]), y.dtype, y.device)
    if out.numel():
        gather_rows_kernel[(len(token_of),)](y, token_of, out, y.shape[1], y.stride(0), out.stride(0),
                                             BLOCK_H=_block(y.shape[1]))
    return out


def gather_sum_triton(src, weight, order, start, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    if not src.is_cuda:
        check_interpreter()
    src = _rows(src)
    out = empty((num_tokens, src.shape[1]), dtype, src.device)
    if out.numel():
        gather_sum_kernel[(num_tokens,)](src, src if weight is None else weight, order, start, out, src.shape[1],
                                         src.stride(0), out.stride(0), WEIGHTED=weight is not None,
                                         BLOCK_H=_block(src.shape[1]))
    return out


def unpermute_triton(x, token_of, weight_of, num_tokens: int) -> torch.Tensor:
    order, start = pairs_by_token(token_of, num_tokens)
    return gather_sum_triton(x, weight_of, order, start, num_tokens, torch.result_type(x, weight_of))


def unpermute_backward_triton(dout, x, weight_of, token_of):
    if not dout.is_cuda:
        check_interpreter()
    dout, x = _rows(dout), _rows(x)
    dx = empty(x.shape, x.dtype, x.device)
    dw = empty(weight_of.shape, weight_of.dtype, x.device)
    if len(token_of):
        unpermute_backward_kernel[(len(token_of),)](dout, x, weight_of, token_of, dx, dw, x.shape[1], dout.stride(0),
                                                    x.stride(0), dx.stride(0), BLOCK_H=_block(x.shape[1]))
    return dx, dw


# ---------------------------------------------------------------- custom ops with autograd

@torch.library.custom_op("molds::moe_permute", mutates_args=())
def _permute_op(y: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    return permute_triton(y, token_of) if runs_triton(y) else permute_reference(y, token_of)


@_permute_op.register_fake
def _(y, token_of):
    return y.new_empty((token_of.shape[0], y.shape[1]))


@torch.library.custom_op("molds::moe_permute_backward", mutates_args=())
def _permute_backward_op(dout: torch.Tensor, token_of: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if runs_triton(dout):
        order, start = pairs_by_token(token_of, num_tokens)
        return gather_sum_triton(dout, None, order, start, num_tokens, dout.dtype)
    return dout.new_zeros(num_tokens, dout.shape[1]).index_add(0, token_of, dout)


@_permute_backward_op.register_fake
def _(dout, token_of, num_tokens):
    return dout.new_empty((num_tokens, dout.shape[1]))


def _permute_setup(ctx, inputs, output):
    y, token_of = inputs
    ctx.save_for_backward(token_of)
    ctx.num_tokens = y.shape[0]


def _permute_backward(ctx, grad):
    (token_of,) = ctx.saved_tensors
    return _permute_backward_op(grad.contiguous(), token_of, ctx.num_tokens), None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("molds::moe_unpermute", mutates_args=())
def _unpermute_op(x: torch.Tensor, token_of: torch.Tensor, weight_of: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if runs_triton(x):
        return unpermute_triton(x, token_of, weight_of, num_tokens)
    return unpermute_reference(x, token_of, weight_of, num_tokens)


@_unpermute_op.register_fake
def _(x, token_of, weight_of, num_tokens):
    return x.new_empty((num_tokens, x.shape[1]), dtype=torch.result_type(x, weight_of))


@torch.library.custom_op("molds::moe_unpermute_backward", mutates_args=())
def _unpermute_backward_op(dout: torch.Tensor, x: torch.Tensor, weight_of: torch.Tensor,
                           token_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if runs_triton(dout):
        return unpermute_backward_triton(dout, x, weight_of, token_of)
    g = dout.index_select(0, token_of)
    return (g * weight_of[:, None]).to(x.dtype), (g.float() * x.float()).sum(1).to(weight_of.dtype)


@_unpermute_backward_op.register_fake
def _(dout, x, weight_of, token_of):
    return torch.empty_like(x), torch.empty_like(weight_of)


def _unpermute_setup(ctx, inputs, output):
    x, token_of, weight_of, _ = inputs
    ctx.save_for_backward(x, token_of, weight_of)


def _unpermute_backward(ctx, grad):
    x, token_of, weight_of = ctx.saved_tensors
    dx, dw = _unpermute_backward_op(grad.contiguous(), x, weight_of, token_of)
    return dx, None, dw, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def moe_permute(y: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    """``permute_tokens`` as a custom op (Triton on a GPU, deterministic backward)."""
    return _permute_op(y, token_of)


def moe_unpermute(x: torch.Tensor, token_of: torch.Tensor, weight_of: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``unpermute_tokens`` as a custom op (Triton on a GPU, no atomics either way)."""
    return _unpermute_op(x, token_of, weight_of, num_tokens)
