"""FP8 training for the decoder's linears and the experts' grouped GEMMs (``kernels.fp8``).

Why it exists: the matrix products are most of a transformer's FLOPs and FP8 matrix
units run them at twice BF16's rate. The recipe is DeepSeek-V3's (and torchao's for the
master weights): parameters stay in the optimizer's precision (ZeRO, the pipeline and
checkpoints see ordinary parameters) and are quantized at each use; every product
quantizes both operands block-wise (``molds.kernels.fp8``) and accumulates in float32
(``molds.kernels.fp8_gemm``):

    forward   y  = x W^T       x: e4m3 1x128 tiles along K, W: e4m3 128x128 blocks
    input     dx = dy W        dy: e5m2 1x128 along N, W: the forward's blocks, read transposed
    weight    dW = dy^T x      dy^T and x^T in 1x128 tiles along the tokens

Three quantizations a step, not five: x and dy each go through ``fp8_quantize_both``,
which reads a 128 x 128 tile once and writes it in both layouts (on a GPU one kernel;
1x128 tiles along K for the forward or input-gradient product, and along the tokens,
transposed and padded with zero codes to whole tiles, for the weight gradient). The
forward keeps x^T's FP8 tiles for the backward, not x itself (DeepSeek-V3 caches a
linear's input in FP8 the same way): one byte an element instead of two, and no second
pass over x. A frozen weight or an evaluation forward quantizes x one way only.

The weight gradient honours ``molds.models.wgrad.WeightGradStore`` as the BF16 linears
do: inside ``WeightGradStore.deferring()`` the backward returns the input gradient only
and queues the weight product for ``flush()`` (a zero-bubble schedule's W pass).

Experts: ``fp8_grouped_mm(x, w, offs=offs)`` has ``F.grouped_mm``'s signature (x [M, K]
rows sorted by expert, w [E, K, N]) and replaces it in ``Experts``; its weight gradient
contracts over one expert's tokens, so those are laid out from multiples of 128 first
(``fp8_gemm.pad_groups``) and no tile mixes two experts.

``Fp8Linear`` is an ``nn.Linear`` (same parameters, same state dict) whose forward is
``fp8_linear``; ``convert_to_fp8`` swaps a built model's modules (the converter that
``kernels.fp8`` applies).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..models.moe import Experts, Router
from ..models.wgrad import WeightGradStore, _accumulate as accumulate
from .fp8 import TILE, fp8_dequantize_reference, fp8_quantize, fp8_quantize_both, fp8_quantize_reference
from .fp8_gemm import fp8_grouped_mm as _grouped_product, fp8_grouped_wgrad, fp8_mm, pad_groups, scatter_rows


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """What a linear would return here: the autocast dtype inside autocast, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    accumulate(param, grad)


def _deferring() -> bool:
    return WeightGradStore.active()


def _defer(fn) -> None:
    WeightGradStore.put(fn)


def _through_fp8(t: torch.Tensor, fmt: str, tile_rows: int, pow2: bool) -> torch.Tensor:
    return fp8_dequantize_reference(*fp8_quantize_reference(t, fmt, tile_rows, pow2), tile_rows)


def fp8_linear_reference(x, weight, bias=None, pow2: bool = False) -> torch.Tensor:
    """The FP8 linear's forward in plain PyTorch: both operands rounded through their FP8
    blocks, then a float32 product."""
    x2 = _through_fp8(x.reshape(-1, x.shape[-1]), "e4m3", 1, pow2)
    y = torch.nn.functional.linear(x2, _through_fp8(weight, "e4m3", TILE, pow2), bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_experts_reference(x, w, offs, pow2: bool = False) -> torch.Tensor:
    """The FP8 expert GEMMs' forward in plain PyTorch (a product per expert)."""
    xq, wq = _through_fp8(x, "e4m3", 1, pow2), _through_fp8(w, "e4m3", TILE, pow2)
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(xq[start:end] @ wq[g])
        start = end
    return torch.cat(out)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, pow2, grad_format, wgrad):
        x2 = x.reshape(-1, x.shape[-1])
        if wgrad:  # the weight gradient will want x^T's tiles too
            qx, sx, qxt, sxt = fp8_quantize_both(x2, "e4m3", pow2)
        else:
            (qx, sx), qxt, sxt = fp8_quantize(x2, "e4m3", 1, pow2), None, None
        qw, sw = fp8_quantize(weight, "e4m3", TILE, pow2)
        y = fp8_mm(qx, sx, qw, sw, TILE, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(qxt, sxt, qw, sw)  # the input is kept in FP8 (DeepSeek-V3 caches it so)
        ctx.params = (weight, bias)  # to accumulate into when the weight gradient is deferred
        ctx.meta = (x.shape, x.dtype, pow2, grad_format)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        qxt, sxt, qw, sw = ctx.saved_tensors
        shape, x_dtype, pow2, fmt = ctx.meta
        weight, bias = ctx.params
        g2 = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if need_w:  # one pass over the gradient for both of its products
            qg, sg, qgt, sgt = fp8_quantize_both(g2, fmt, pow2)
        elif need_x:
            qg, sg = fp8_quantize(g2, fmt, 1, pow2)
        dx = fp8_mm(qg, sg, qw.t(), sw.t(), TILE, x_dtype).view(shape) if need_x else None

        def weight_grad():  # contracts over the tokens, padded with zero codes to whole tiles
            return fp8_mm(qgt, sgt, qxt, sxt, 1, torch.float32)

        if not (need_w or need_b):
            return dx, None, None, None, None, None, None
        if not _deferring():
            return (dx, weight_grad().to(weight.dtype) if need_w else None,
                    g2.float().sum(0).to(bias.dtype) if need_b else None, None, None, None, None)

        def deferred():
            if need_w:
                _accumulate(weight, weight_grad())
            if need_b:
                _accumulate(bias, g2.float().sum(0))

        _defer(deferred)
        return dx, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pow2: bool = False,
               grad_format: str = "e5m2") -> torch.Tensor:
    """``F.linear`` with both operands in block-scaled FP8 (forward and backward);
    ``grad_format`` is the format of the gradient flowing back (e5m2, or e4m3)."""
    wgrad = weight.requires_grad and torch.is_grad_enabled()  # (grad mode is off inside the Function's forward)
    return _Fp8Linear.apply(x, weight, bias, _out_dtype(x), pow2, grad_format, wgrad)


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose products run in FP8; the same parameters and state dict."""

    fp8_options: dict = {}  # pow2, grad_format (set per module by ``convert_to_fp8``)

    def forward(self, x):
        return self.linear(x, self.weight, self.bias)

    def linear(self, x, weight, bias=None):
        """This module's product on another weight (a pipeline stage holding the tied head)."""
        return fp8_linear(x, weight, bias, **self.fp8_options)


class _Fp8GroupedMM(torch.autograd.Function):
    """``F.grouped_mm(x, w, offs)`` for x [M, K] sorted by group and w [G, K, N], in FP8."""

    @staticmethod
    def forward(ctx, x, w, offs, out_dtype, pow2, grad_format):
        qx, sx = fp8_quantize(x, "e4m3", 1, pow2)
        qw, sw = fp8_quantize(w, "e4m3", TILE, pow2)  # 128x128 blocks of each expert's [K, N]
        y = _grouped_product(qx, sx, qw.transpose(1, 2), sw.transpose(1, 2), TILE, offs, out_dtype)
        ctx.save_for_backward(x, qw, sw, offs)
        ctx.param = w
        ctx.meta = (x.dtype, pow2, grad_format)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, qw, sw, offs = ctx.saved_tensors
        x_dtype, pow2, fmt = ctx.meta
        w = ctx.param
        grad = grad.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            qg, sg = fp8_quantize(grad, fmt, 1, pow2)
            dx = _grouped_product(qg, sg, qw, sw, TILE, offs, x_dtype)
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None, None, None

        def weight_grad():
            counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
            index, padded_offs, rows = pad_groups(counts)
            qa, sa = fp8_quantize(scatter_rows(x, index, rows).t(), "e4m3", 1, pow2)
            qb, sb = fp8_quantize(scatter_rows(grad, index, rows).t(), fmt, 1, pow2)
            return fp8_grouped_wgrad(qa, sa, qb, sb, padded_offs, torch.float32)

        if not _deferring():
            return dx, weight_grad().to(w.dtype), None, None, None, None
        _defer(lambda: _accumulate(w, weight_grad()))
        return dx, None, None, None, None, None


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, *, offs: torch.Tensor, pow2: bool = False,
                   grad_format: str = "e5m2") -> torch.Tensor:
    """``F.grouped_mm(x, w, offs=offs)`` (2-D x 3-D) in block-scaled FP8, forward and backward."""
    return _Fp8GroupedMM.apply(x, w, offs, _out_dtype(x), pow2, grad_format)


class Fp8GroupedMM:
    """``Experts.grouped_mm`` in FP8 with this converter's options (any shape and dtype:
    unlike ``F.grouped_mm`` it needs no 16-byte strides)."""

    any_shape = True

    def __init__(self, **options):
        self.options = options

    def __call__(self, x, w, *, offs):
        return fp8_grouped_mm(x, w, offs=offs, **self.options)


# ---------------------------------------------------------------- the converter

def convert_to_fp8(model: nn.Module, *, lm_head: bool = False, router: bool = False, pow2: bool = False,
                   grad_format: str = "e5m2", only=None) -> dict:
    """Swap ``model``'s linears (``nn.Linear`` -> ``Fp8Linear``) and experts' grouped GEMMs
    for FP8 ones, in place. The LM head and the MoE router stay as they are unless asked;
    embeddings and norms are no matrix products. ``only(module)``: whether to swap that
    linear or expert set (``kernels.fp8_products=faster``: ``Fp8Choice.takes``); all when
    None. Returns how many were swapped, by kind."""
    options = {"pow2": pow2, "grad_format": grad_format}
    head = getattr(model, "lm_head", None)
    counts = {"linear": 0, "experts": 0, "router": 0}
    for module in model.modules():
        if only is not None and (type(module) is nn.Linear or isinstance(module, Experts)) and not only(module):
            continue
        if type(module) is nn.Linear and (module is not head or lm_head):
            module.__class__ = Fp8Linear
            module.fp8_options = options
            counts["linear"] += 1
        elif isinstance(module, Experts):
            module.grouped_mm = Fp8GroupedMM(**options)
            counts["experts"] += 1
        elif isinstance(module, Router) and router:
            module.linear = functools.partial(fp8_linear, **options)
            counts["router"] += 1
    return counts
