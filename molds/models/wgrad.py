"""Deferrable weight gradients: the seam a zero-bubble schedule (DualPipeV) needs.

A zero-bubble schedule splits a layer's backward in two: the input gradient ("B"),
which the previous stage is waiting for, now; the weight gradient ("W"), which nobody
waits for, later, in a slot that would otherwise be a bubble. DeepSeek's DualPipe does
this with a ``WeightGradStore`` that its fused linear kernels push closures into; torch's
``ScheduleDualPipeV`` asks the stage module for a separate weight-gradient pass.

Here it is one context and two autograd functions, applied to a built model by
``defer_weight_grads(model)`` (a converter, like ``molds.kernels``: model files do not know
about it):

- ``nn.Linear`` modules become ``DeferrableLinear`` (same parameters, same state dict);
- the MoE router's product (``Router.linear``) becomes ``deferrable_linear``, the experts'
  grouped GEMMs (``Experts.grouped_mm``) ``deferrable_grouped_mm``.

Outside a ``WeightGradStore.deferring()`` context both compute every gradient at once,
exactly like the modules they replace. Inside it, their backward returns the input gradient
only and queues the weight gradient; ``run(key)`` / ``flush()`` compute the queued ones, in
order, and add them into ``param.grad``. Embeddings and norm weights are not deferred (a
gather and an elementwise product: nothing worth moving). Float64 experts, which run one
GEMM per expert instead of a grouped GEMM, are not deferred either. What a schedule must
respect: a deferred gradient exists only after it ran, so the gradient reduction and the
optimizer step come after the last one, and gradient hooks on deferred parameters do not
fire (an optimizer that accumulates through hooks, DeepSpeed's BF16 wrapper among them,
must be handed the gradients after each run: ``molds.engines.dualpipev`` does).

The queues belong to the schedule: a ``WeightGradStore`` instance holds one group of
closures per key (the schedule's (chunk, micro-batch)), filled by one input-only backward
and run by that key's W step (``molds.engines.schedule``: W(chunk, mb) runs exactly the
group I(chunk, mb) queued). Which store a running backward fills is process-wide state,
not thread-local, on purpose: on a GPU autograd runs backward functions on its own device
thread, not the thread that called ``backward()``, and one backward runs at a time.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .moe import Experts, Router

_capturing: list | None = None  # the group the running backward fills (None: nothing is deferred)


class WeightGradStore:
    """Deferred weight gradients, grouped by key (a schedule's (chunk, micro-batch))."""

    def __init__(self):
        self.groups: dict[Hashable, list[Callable[[], None]]] = {}  # in the order they were queued

    @contextlib.contextmanager
    def deferring(self, key: Hashable = None):
        """Backward passes inside queue their weight gradients under ``key``."""
        global _capturing
        if _capturing is not None:
            raise RuntimeError("a WeightGradStore is already deferring (one backward at a time)")
        group = self.groups.setdefault(key, [])
        _capturing = group
        try:
            yield self
        finally:
            _capturing = None
            if not group:
                del self.groups[key]

    @staticmethod
    def active() -> bool:
        """Whether the running backward defers its weight gradients (what the ops ask)."""
        return _capturing is not None

    @staticmethod
    def put(fn: Callable[[], None]) -> None:
        if _capturing is None:
            raise RuntimeError("WeightGradStore.put outside deferring()")
        _capturing.append(fn)

    def pending(self, key: Hashable = ...) -> int:
        """Queued closures: under ``key``, or all."""
        if key is not ...:
            return len(self.groups.get(key, ()))
        return sum(len(g) for g in self.groups.values())

    def run(self, key: Hashable) -> int:
        """Compute the weight gradients queued under ``key``, oldest first; how many ran."""
        group = self.groups.pop(key, [])
        with torch.no_grad():
            for fn in group:
                fn()
        return len(group)

    def flush(self) -> int:
        """Compute every queued weight gradient, group by group in queue order."""
        return sum(self.run(key) for key in list(self.groups))

    def clear(self) -> None:
        """Drop what is queued (after a failed step: its gradients are discarded anyway)."""
        self.groups.clear()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        # the parameters themselves, to accumulate into when the gradient is deferred
        ctx.params = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        # under autocast the forward ran in a lower precision than its saved inputs: match it
        x, weight = x.to(grad.dtype), weight.to(grad.dtype)
        dx = grad @ weight if ctx.needs_input_grad[0] else None
        need_w, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if not (need_w or need_b):
            return dx, None, None
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        if not WeightGradStore.active():
            return dx, (g2.t() @ x2 if need_w else None), (g2.sum(0) if need_b else None)
        w, b = ctx.params

        def weight_grad():
            if need_w:
                _accumulate(w, g2.t() @ x2)
            if need_b:
                _accumulate(b, g2.sum(0))

        WeightGradStore.put(weight_grad)
        return dx, None, None


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose weight (and bias) gradient ``WeightGradStore`` can defer."""
    return _Linear.apply(x, weight, bias)


class DeferrableLinear(nn.Linear):
    """``nn.Linear`` on ``deferrable_linear``: the same parameters and state dict."""

    def forward(self, x):
        return deferrable_linear(x, self.weight, self.bias)


class _GroupedMM(torch.autograd.Function):
    """``F.grouped_mm(x, w, offs)`` for x [M, K] sorted by group and w [G, K, N]."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        ctx.param = w
        return F.grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        x, w = x.to(grad.dtype), w.to(grad.dtype)
        dx = F.grouped_mm(grad, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None
        if not WeightGradStore.active():
            return dx, F.grouped_mm(x.t(), grad, offs=offs), None  # per group: x_g^T grad_g (empty: 0)

        param = ctx.param

        def weight_grad():
            _accumulate(param, F.grouped_mm(x.t(), grad, offs=offs))

        WeightGradStore.put(weight_grad)
        return dx, None, None


def deferrable_grouped_mm(x: torch.Tensor, w: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm`` (2D x 3D with offsets) whose weight gradient can be deferred."""
    return _GroupedMM.apply(x, w, offs)


def defer_weight_grads(model: nn.Module) -> nn.Module:
    """Make the weight gradients of ``model``'s linears and experts deferrable (in place;
    parameters, state dict and results unchanged). The FP8 ones of ``molds.kernels``
    (``kernels.fp8``) defer through ``WeightGradStore`` already and are left as they are."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DeferrableLinear
        elif isinstance(module, Router) and module.linear is F.linear:
            module.linear = deferrable_linear
        elif isinstance(module, Experts) and module.grouped_mm is F.grouped_mm:
            module.grouped_mm = deferrable_grouped_mm
    return model
