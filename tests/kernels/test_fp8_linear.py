"""FP8 products: the Triton block-scaled GEMMs (dense and grouped; compiled on a GPU where
there is one, else in the interpreter) equal their float32 emulation on the CPU; the FP8
linear and the FP8 expert GEMMs stay within the error FP8 implies against float64, forward
and backward; their weight gradients defer through ``WeightGradStore`` and flush to the
same values; cuBLAS's products are kept only where they agree with the kernel.

The bound (``_product_bound``): each operand element is rounded once, to half a step of
its format at its magnitude (2^-(m+1) relative: e4m3 2^-4, e5m2 2^-3) or, in a tile's
subnormal range, half a subnormal step times the tile's scale. For C = A B^T with
operand errors e_a, e_b the error of an element is at most
sum_k (e_a |b| + |a| e_b + e_a e_b) plus float32 accumulation, K 2^-24 sum_k |a||b|.
The test computes this per element from the operands and holds every element to it, and
checks that the bound is not vacuous (the observed error reaches a fair part of it).
"""

from __future__ import annotations

import pytest
import torch

from molds.kernels.fp8 import FORMATS, fp8_quantize
from molds.kernels.fp8_gemm import (fp8_grouped_mm_reference, fp8_grouped_mm_triton, fp8_grouped_wgrad_reference,
                                    fp8_grouped_wgrad_triton, fp8_mm_reference, fp8_mm_triton, pad_groups,
                                    scatter_rows)
from molds.kernels.fp8_linear import fp8_experts_reference, fp8_grouped_mm, fp8_linear, fp8_linear_reference
from molds.models.wgrad import WeightGradStore


def _rel(a, b):
    return float((a.detach().double() - b.double()).norm() / b.double().norm())


def _element_error(x: torch.Tensor, fmt: str, tile_rows: int) -> torch.Tensor:
    """Bound on |dequantize(quantize(x)) - x| per element (float64, on the CPU)."""
    _, exp, man, _, _ = FORMATS[fmt]
    bias = (1 << (exp - 1)) - 1
    x = x.cpu()
    _, s = fp8_quantize(x, fmt, tile_rows)
    full = s.repeat_interleave(tile_rows, -2)[..., :x.shape[-2], :].repeat_interleave(128, -1)[..., :x.shape[-1]]
    return x.double().abs() * 2.0 ** -(man + 1) + full.double() * 2.0 ** (-bias - man)


def _product_bound(a, fa, ta, bt, fb, tb):
    """Per-element bound on the error of A @ Bt^T with A quantized (fa, ta x 128 tiles along
    its rows) and Bt (fb, tb x 128)."""
    ea, eb = _element_error(a, fa, ta), _element_error(bt, fb, tb)
    aa, bb = a.double().abs(), bt.double().abs()
    k = a.shape[1]
    return ea @ bb.t() + aa @ eb.t() + ea @ eb.t() + k * 2.0**-24 * ((aa + ea) @ (bb + eb).t())


def _within(got, exact, bound, tight: bool = True):
    err = (got.detach().cpu().double() - exact.cpu()).abs()
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3f}"
    if tight:  # the bound is not vacuous
        assert float((err / bound).max()) > 0.05


@pytest.mark.parametrize("m,k,n,fa,fb,tb,transposed", [
    (1023, 777, 129, "e4m3", "e4m3", 128, False),  # a forward product: activations x a weight
    (257, 300, 200, "e5m2", "e4m3", 128, True),  # an input gradient: the weight's blocks read transposed
    (129, 1, 300, "e5m2", "e4m3", 1, False),  # a weight gradient: K = tokens, 1x128 tiles on both
])
def test_triton_gemm_equals_its_emulation(m, k, n, fa, fb, tb, transposed, gen, device):
    a = torch.randn(m, k, generator=gen)
    bt = torch.randn(k, n, generator=gen).t() if transposed else torch.randn(n, k, generator=gen) * 0.1
    qa, sa = fp8_quantize(a, fa, 1)
    if transposed:  # the weight [k, n] quantized in blocks, used as its transpose
        qb, sb = fp8_quantize(bt.t(), fb, tb)
        qb, sb = qb.t(), sb.t()
    else:
        qb, sb = fp8_quantize(bt, fb, tb)
    want = fp8_mm_reference(qa, sa, qb, sb, tb, torch.float32)
    qa, sa, qb, sb = (_moved(t, device) for t in (qa, sa, qb, sb))
    got = fp8_mm_triton(qa, sa, qb, sb, tb, torch.float32)
    _close(got, want)
    bf = fp8_mm_triton(qa, sa, qb, sb, tb, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and _rel(bf.cpu(), want) < 2**-7


def _moved(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` with the same strides (a transposed view stays one)."""
    if t.device == torch.device(device):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


_ON_GPU = torch.cuda.is_available()  # the kernel tests' device (tests/kernels/conftest.py)


def _close(got, want):
    """Equal up to float32 summation order (the kernel adds 128-wide partial products). On a
    GPU the FP8 tensor cores add each 128-wide block's products with fewer bits than float32
    (about 14 on Hopper: DeepSeek-V3, section 3.3.2; the kernels and cuBLAS promote each
    block's sum to float32 after it): there, within 2^-9 of the largest element (seen on an
    H200: 2-3e-4 of it, against 1e-5 on a CPU)."""
    got, want = got.cpu(), want.cpu()
    assert not got.isnan().any()
    atol = (2**-9 if _ON_GPU else 1e-5) * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0 if _ON_GPU else 1e-5, atol=atol)



def _groups(gen, sizes=(0, 130, 1, 300, 57)):
    counts = torch.tensor(sizes)
    return counts, torch.cumsum(counts, 0).to(torch.int32), int(counts.sum())


def test_grouped_triton_gemms_equal_their_emulation(gen, device):
    counts, offs, m = _groups(gen)
    g, k, n = len(counts), 200, 72
    x, w, dy = torch.randn(m, k, generator=gen), torch.randn(g, k, n, generator=gen) * 0.05, torch.randn(m, n, generator=gen)
    qx, sx = fp8_quantize(x, "e4m3", 1)
    qw, sw = fp8_quantize(w, "e4m3", 128)

    def both(*args):  # the kernel on the device, the emulation on the CPU
        moved = [_moved(a, device) if isinstance(a, torch.Tensor) else a for a in args]
        return fp8_grouped_mm_triton(*moved), fp8_grouped_mm_reference(*args)

    _close(*both(qx, sx, qw.transpose(1, 2), sw.transpose(1, 2), 128, offs, torch.float32))
    qg, sg = fp8_quantize(dy, "e5m2", 1)
    _close(*both(qg, sg, qw, sw, 128, offs, torch.float32))
    index, padded_offs, rows = pad_groups(counts)
    assert padded_offs.tolist() == [0, 256, 384, 768, 896]
    qa, sa = fp8_quantize(scatter_rows(x, index, rows).t(), "e4m3", 1)
    qb, sb = fp8_quantize(scatter_rows(dy, index, rows).t(), "e5m2", 1)
    got = fp8_grouped_wgrad_triton(*(_moved(t, device) for t in (qa, sa, qb, sb, padded_offs)), torch.float32)
    _close(got, fp8_grouped_wgrad_reference(qa, sa, qb, sb, padded_offs, torch.float32))
    assert bool((got[0] == 0).all())  # an expert with no token has a zero gradient


@pytest.mark.parametrize("triton,shape", [(False, (3, 111, 300, 257)), (True, (3, 111, 300, 257)),
                                          (True, (2, 128, 256, 384))], ids=["cpu-path", "triton", "triton-aligned"])
def test_fp8_linear_is_within_the_fp8_bound_forward_and_backward(triton, shape, gen, request):
    """A 3-D input with K not a multiple of 128, and one whose sides cuBLAS takes (on a Hopper
    GPU its block-scaled products run that one: ``scaled_mm``)."""
    device = request.getfixturevalue("device") if triton else "cpu"
    d0, d1, k, n = shape
    x = torch.randn(d0, d1, k, generator=gen, dtype=torch.float64).float()
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen)
    xr, wr, br = (t.clone().to(device).requires_grad_() for t in (x, w, b))
    y = fp8_linear(xr, wr, br)
    x2 = x.reshape(-1, k)
    exact = x2.double() @ w.double().t() + b.double()
    _within(y.reshape(-1, n), exact, _product_bound(x2, "e4m3", 1, w, "e4m3", 128))
    dy = torch.randn(d0, d1, n, generator=gen)
    y.backward(dy.to(device))
    g2 = dy.reshape(-1, n)
    _within(xr.grad.reshape(-1, k), g2.double() @ w.double(), _product_bound(g2, "e5m2", 1, w.t(), "e4m3", 128))
    _within(wr.grad, g2.double().t() @ x2.double(), _product_bound(g2.t(), "e5m2", 1, x2.t(), "e4m3", 1))
    torch.testing.assert_close(br.grad.cpu(), g2.sum(0))
    assert y.dtype == torch.float32 and _rel(y.reshape(-1, n).cpu(), exact) < 0.06  # e4m3: ~2^-4 per operand
    _close(y.detach(), fp8_linear_reference(x, w, b))  # the plain-PyTorch definition


def test_fp8_linear_under_autocast_and_with_e4m3_gradients(gen):
    x = torch.randn(64, 256, generator=gen, requires_grad=True)
    w = (torch.randn(128, 256, generator=gen) * 0.05).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w, grad_format="e4m3")
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    exact = torch.ones(64, 128, dtype=torch.float64) @ w.detach().double()
    bound = _product_bound(torch.ones(64, 128), "e4m3", 1, w.detach().t(), "e4m3", 128)
    _within(x.grad, exact, bound)


def test_weight_gradients_defer_and_flush_to_the_same_values(gen):
    x = torch.randn(200, 96, generator=gen, requires_grad=True)
    w = (torch.randn(130, 96, generator=gen) * 0.1).requires_grad_()
    counts, offs, m = _groups(gen, (5, 0, 90, 33))
    ex = torch.randn(m, 40, generator=gen, requires_grad=True)
    ew = (torch.randn(4, 40, 24, generator=gen) * 0.1).requires_grad_()

    def backward():
        (fp8_linear(x, w).square().sum() + fp8_grouped_mm(ex, ew, offs=offs).square().sum()).backward()

    backward()
    want = [t.grad.clone() for t in (x, w, ex, ew)]
    for t in (x, w, ex, ew):
        t.grad = None
    store = WeightGradStore()
    with store.deferring():
        backward()
        assert w.grad is None and ew.grad is None  # queued
        assert store.pending() == 2
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=0)  # the input gradients came at once
    torch.testing.assert_close(ex.grad, want[2], rtol=0, atol=0)
    assert store.flush() == 2
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=0)
    torch.testing.assert_close(ew.grad, want[3], rtol=0, atol=0)


@pytest.mark.parametrize("triton", [False, True], ids=["cpu-path", "triton"])
def test_fp8_expert_gemms_are_within_the_fp8_bound(triton, gen, request):
    device = request.getfixturevalue("device") if triton else "cpu"
    counts, offs, m = _groups(gen, (0, 130, 1, 140, 57))
    k, n = 136, 40
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(len(counts), k, n, generator=gen) * 0.05
    xr, wr = (t.clone().to(device).requires_grad_() for t in (x, w))
    y = fp8_grouped_mm(xr, wr, offs=offs.to(device))
    _close(y.detach(), fp8_experts_reference(x, w, offs))
    dy = torch.randn(m, n, generator=gen)
    y.backward(dy.to(device))
    y, x_grad, w_grad = y.detach().cpu(), xr.grad.cpu(), wr.grad.cpu()
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    for g, (s, e) in enumerate(zip(starts, ends)):
        if s == e:
            assert bool((w_grad[g] == 0).all())
            continue
        xg, wg, dg = x[s:e], w[g], dy[s:e]
        _within(y[s:e], xg.double() @ wg.double(), _product_bound(xg, "e4m3", 1, wg.t(), "e4m3", 128))
        _within(x_grad[s:e], dg.double() @ wg.double().t(), _product_bound(dg, "e5m2", 1, wg, "e4m3", 128))
        # (one token: each 1x128 tile along the tokens holds one element, which FP8 represents exactly)
        _within(w_grad[g], xg.double().t() @ dg.double(), _product_bound(xg.t(), "e4m3", 1, dg.t(), "e5m2", 1),
                tight=e - s > 1)


def test_cublas_products_are_kept_only_where_they_agree_with_the_kernel(gen, device, monkeypatch, capsys):
    """A torch that takes a scale layout but reads it otherwise must not train on wrong
    products: the first cuBLAS product of each kind is checked against the Triton kernel
    (here cuBLAS is a stand-in: one right, one off by 10 %)."""
    from molds.kernels import fp8_gemm

    a = torch.randn(130, 256, generator=gen)
    bt = torch.randn(96, 256, generator=gen) * 0.1
    qa, sa = fp8_quantize(a, "e4m3", 1)
    qb, sb = fp8_quantize(bt, "e4m3", 128)
    want = fp8_mm_reference(qa, sa, qb, sb, 128, torch.float32)
    monkeypatch.setattr(fp8_gemm, "_hopper", lambda t: True)
    for factor, kept in ((1.0, True), (1.1, False)):
        monkeypatch.setattr(fp8_gemm, "_SCALED_MM_REFUSED", {})
        monkeypatch.setattr(fp8_gemm, "_SCALED_MM_LAYOUT", {})
        calls = []

        def cublas(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype, factor=factor, calls=calls):
            calls.append(1)
            return fp8_mm_reference(a, scale_a, b.t(), scale_b.t(), 128, output_dtype) * factor

        monkeypatch.setattr(torch.nn.functional, "scaled_mm", cublas)
        per_call = []
        for _ in range(2):
            got = fp8_gemm.fp8_mm(*(t.to(device) for t in (qa, sa, qb, sb)), 128, torch.float32)
            _close(got, want)  # the right product either way: cuBLAS's where it agrees, else the kernel's
            per_call.append(len(calls) - sum(per_call))
        assert bool(fp8_gemm._SCALED_MM_LAYOUT) == kept and bool(fp8_gemm._SCALED_MM_REFUSED) != kept
        # kept: the first layout, once a call; refused: every layout tried once, then never offered again
        assert per_call == ([1, 1] if kept else [len(fp8_gemm._scale_b_layouts(sb, 128)), 0])
        err = capsys.readouterr().err
        assert ("differs from the Triton kernel's" in err) != kept


def test_the_linear_quantizes_three_times_a_step_and_keeps_its_input_in_fp8(gen, monkeypatch):
    """x and the output gradient each go through the fused two-layout quantization (one pass
    each), the weight through its blocks: three quantizations for the three products, where
    quantizing each operand of each product on its own takes five. What the backward keeps of
    the input is its FP8 tiles (one byte an element), not the input. An evaluation forward
    quantizes x one way only."""
    from molds.kernels import fp8_linear as mod

    calls = []
    for name in ("fp8_quantize", "fp8_quantize_both"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x = torch.randn(300, 256, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(200, 256, generator=gen) * 0.05).requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8_linear(x, w)
    assert sorted(calls) == ["fp8_quantize", "fp8_quantize_both"]
    assert all(t.dtype in (torch.float8_e4m3fn, torch.float32) for t in saved)
    assert not any(t.shape == x.shape for t in saved)  # (not x, nor a view of it)
    y.float().square().sum().backward()
    assert sorted(calls) == ["fp8_quantize", "fp8_quantize_both", "fp8_quantize_both"]
    assert x.grad is not None and w.grad is not None
    calls.clear()
    with torch.no_grad():
        fp8_linear(x, w)
    assert calls == ["fp8_quantize", "fp8_quantize"]


def _cublas_stand_in(calls):
    """torch.nn.functional.scaled_mm as torch 2.11's ``ScaledBlas.cpp`` checks block-scaled
    operands on a Hopper GPU (``_scaled_block1x128_block128x128``,
    ``_scaled_block1x128_block1x128``; the e4m3-only and divisible-by-16 refusals as the H200
    gave them, benchmarks/results/2026-11-27-h200-*.log), computing the product in float32 from
    the scales it was given. A model of torch's contract, not cuBLAS: the real one runs in
    benchmarks/gpu_check.py."""
    import torch.nn.functional as F

    def check(t, shape, strides, what):
        if tuple(t.shape) != shape or t.stride() != strides:
            raise RuntimeError(f"{what} must have shape {shape} and strides {strides}; got {tuple(t.shape)}, "
                               f"{t.stride()}")

    def scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
        if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
            raise RuntimeError("Invalid scaling configuration. - For TensorWise scaling, ...")
        m, k = a.shape
        n = b.shape[1]
        if k % 16:
            raise RuntimeError(f"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: "
                               f"({m}x{k}).")
        if b.stride(0) != 1:
            raise RuntimeError("Only multiplication of row-major and column-major matrices is supported by cuBLASLt")
        kb = -(-k // 128)
        assert recipe_a == F.ScalingType.BlockWise1x128
        check(scale_a, (m, kb), (1, m), "scale_a")
        if recipe_b == F.ScalingType.BlockWise128x128:
            kb4 = -(-kb // 4) * 4
            check(scale_b, (kb4, -(-n // 128)), (1, kb4), "scale_b")
            sb, tile = scale_b[:kb].t(), 128
        else:
            check(scale_b, (n, kb), (1, n), "scale_b")
            sb, tile = scale_b, 1
        calls.append(tile)
        return fp8_mm_reference(a, scale_a, b.t(), sb, tile, output_dtype)

    return scaled_mm


def test_an_e4m3_linears_three_products_reach_cublas_in_the_layouts_torch_checks(gen, monkeypatch, capsys):
    """On a Hopper GPU every product of a linear with e4m3 gradients goes to cuBLAS: the
    weight's scales padded to a multiple of 4 blocks along K (22 blocks of a 2816-wide K were
    refused on the H200), the weight gradient's token axis padded to whole tiles (8,191 tokens
    were refused: not divisible by 16). With e5m2 gradients cuBLAS takes the forward only and
    the refusal is said once, naming the formats."""
    from molds.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "_hopper", lambda t: True)
    x = torch.randn(300, 304, generator=gen)  # 300 tokens; K = 304: 3 blocks, not a multiple of 4
    w = torch.randn(208, 304, generator=gen) * 0.05  # N = 208: 2 blocks along the input gradient's K
    dy = torch.randn(300, 208, generator=gen)
    for fmt, taken in (("e4m3", [128, 128, 1]), ("e5m2", [128])):
        monkeypatch.setattr(fp8_gemm, "_SCALED_MM_REFUSED", {})
        monkeypatch.setattr(fp8_gemm, "_SCALED_MM_LAYOUT", {})
        calls = []
        monkeypatch.setattr(torch.nn.functional, "scaled_mm", _cublas_stand_in(calls))
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xr, wr, grad_format=fmt)
        y.backward(dy)
        assert calls == taken
        err = capsys.readouterr().err
        assert ("refused" in err) == (fmt == "e5m2")
        if fmt == "e5m2":
            assert "float8_e5m2 x float8_e4m3fn" in err and "Invalid scaling configuration" in err
        # the same values as the products computed without cuBLAS
        monkeypatch.setattr(fp8_gemm, "_hopper", lambda t: False)
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        yc = fp8_linear(xc, wc, grad_format=fmt)
        yc.backward(dy)
        monkeypatch.setattr(fp8_gemm, "_hopper", lambda t: True)
        for got, want in ((y, yc), (xr.grad, xc.grad), (wr.grad, wc.grad)):
            _close(got.detach(), want.detach())
