"""Fused linear + cross-entropy over the vocabulary (``kernels.triton``).

Why it exists: the LM head's logits are [tokens, vocab]; upcast to float32 for the loss,
then softmax and its gradient, they are the largest activations of a language model
with a large vocabulary (Liger Kernel's FusedLinearCrossEntropy and Apple's Cut
Cross-Entropy exist for that). Here the tokens go through in chunks: a chunk's logits
are computed, one kernel turns them in place into (softmax - one-hot) / valid tokens and
returns each row's loss, and that gradient is multiplied at once into the hidden
states' and the weight's gradients. The full float32 logits never exist; the forward
holds the two gradients (they are what the backward returns, scaled by the incoming
gradient). Without gradients (evaluation) only the losses are computed.

Rows whose target is ``ignore_index`` add nothing and get zero gradients; the loss is
the mean over the other rows (``F.cross_entropy``'s ``mean``; 0 / 0 = NaN when there
is none, as there). The reference is the plain composition,
``F.cross_entropy((hidden @ W^T).float(), targets)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .launch import check_interpreter, empty, jit, runs_triton, tl

IGNORE_INDEX = -100


def linear_cross_entropy_reference(hidden, weight, targets, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)


@jit
def cross_entropy_kernel(LOGITS, TARGET, LOSS, SCALE, V, stride_l, ignore_index, WITH_GRAD: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    """Row r: LOSS[r] = logsumexp - logit[target] (0 when ignored); with WITH_GRAD the row
    becomes (softmax - onehot) x SCALE in place (zeros when ignored)."""
    r = tl.program_id(0).to(tl.int64)
    row = LOGITS + r * stride_l
    target = tl.load(TARGET + r)
    m = -float("inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):  # online logsumexp
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    keep = target != ignore_index
    picked = tl.load(row + tl.where(keep, target, 0)).to(tl.float32)
    tl.store(LOSS + r, tl.where(keep, lse - picked, 0.0))
    if WITH_GRAD:
        scale = tl.load(SCALE)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(row + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - (cols == target).to(tl.float32)
            g = tl.where(keep, g * scale, 0.0)
            tl.store(row + cols, g.to(LOGITS.dtype.element_ty), mask=cols < V)


def cross_entropy_rows_triton(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, with_grad: bool,
                              ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    if not logits.is_cuda:
        check_interpreter()
    n, v = logits.shape
    loss = empty(n, torch.float32, logits.device)
    if n:
        cross_entropy_kernel[(n,)](logits, targets, loss, scale, v, logits.stride(0), ignore_index,
                                   WITH_GRAD=with_grad, BLOCK_V=min(4096, max(16, 1 << (v - 1).bit_length())))
    return loss


@torch.library.custom_op("molds::cross_entropy_rows", mutates_args=("logits",))
def _rows_op(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, with_grad: bool,
             ignore_index: int) -> torch.Tensor:
    """Per-row losses; with ``with_grad`` the logits are overwritten by their gradient
    times ``scale`` (a 0-d tensor: 1 / the valid rows of the whole batch)."""
    if runs_triton(logits):
        return cross_entropy_rows_triton(logits, targets, scale, with_grad, ignore_index)
    z = logits.float()
    keep = targets != ignore_index
    safe = targets.masked_fill(~keep, 0)
    lse = torch.logsumexp(z, -1)
    loss = torch.where(keep, lse - z.gather(1, safe[:, None]).squeeze(1), 0.0)
    if with_grad:
        g = torch.softmax(z, -1)
        g[torch.arange(len(safe), device=g.device), safe] -= 1.0
        logits.copy_(g.mul_(torch.where(keep, scale, 0.0)[:, None]))
    return loss


@_rows_op.register_fake
def _(logits, targets, scale, with_grad, ignore_index):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def _chunk_rows(tokens: int, vocab: int, width: int = 0, budget: int = 1 << 22) -> int:
    """Rows per chunk: about ``budget`` logits (16 MiB in float32) at a time, or more for a
    wide model. Each chunk also adds one float32 [V, H] product into the weight gradient, so
    chunks of fewer than T / ceil(V / H) rows would move more bytes through that sum than
    their logits take (Liger Kernel sizes its chunks by the same ratio); at that size a
    chunk's logits are about as large as the hidden states themselves."""
    rows = budget // max(1, vocab)
    if width > 0:
        rows = max(rows, -(-tokens // -(-vocab // width)))
    return max(1, min(tokens, rows))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, grads):
        t = hidden.shape[0]
        scale = 1.0 / (targets != ignore_index).sum().float()  # inf without a valid row: the loss is NaN
        dh = torch.empty_like(hidden) if grads else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = _chunk_rows(t, weight.shape[0], weight.shape[1])
        for start in range(0, t, step):
            h = hidden[start:start + step]
            logits = F.linear(h, weight).float()
            total += _rows_op(logits, targets[start:start + step], scale, grads, ignore_index).sum()
            if grads:
                g = logits.to(hidden.dtype)
                dh[start:start + step] = g @ weight.to(hidden.dtype)
                if h.dtype == torch.float32 and weight.dtype == torch.float32:
                    dw.addmm_(g.t(), h)  # no [V, H] temporary
                else:
                    dw += (g.t() @ h).float()
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        if dh is None:
            raise RuntimeError("linear_cross_entropy ran without gradients (torch.no_grad) and cannot backward")
        return dh * grad.to(dh.dtype), (dw * grad).to(ctx.weight_dtype), None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight^T`` against ``targets``, chunked, without the
    full logits; hidden [T, H], weight [V, H], targets [T]."""
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, grads)
