"""Block-scaled FP8 quantization: the Triton kernels (compiled on a GPU where there is one,
else in Triton's interpreter on the CPU) equal torch's CPU casts and the PyTorch reference
bit for bit, on odd shapes, strides and dtypes; zero, tiny and non-finite tiles follow the
stated rule; the custom ops trace."""

from __future__ import annotations

import pytest
import torch

from molds.kernels.fp8 import (FORMATS, fp8_cast_triton, fp8_dequantize, fp8_dequantize_reference,
                               fp8_dequantize_triton, fp8_quantize, fp8_quantize_both, fp8_quantize_both_reference,
                               fp8_quantize_both_triton, fp8_quantize_reference, fp8_quantize_triton, padded_rows)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.cpu().view(torch.uint8)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN payloads aside."""
    a, b = a.cpu(), b.cpu()
    both_nan = a.isnan() & b.isnan()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())


def _cast_differences(x: torch.Tensor, fmt: str, device) -> str:
    """The inputs where the kernel's code differs from torch's CPU cast ('' if none). Values
    past e4m3's largest, infinities included, are held to the stated rule (saturate to +-448,
    as the pinned torch does; torch 2.11's CPU cast of fp16 turns them into NaN). On a GPU a NaN may come
    back with its sign dropped (the GPU's half -> float conversion returns the canonical NaN),
    so there any NaN code stands for any NaN."""
    dtype, _, _, fp8_max, saturates = FORMATS[fmt]
    got, want = fp8_cast_triton(x.to(device), fmt).cpu(), x.to(dtype)
    if saturates:
        over = x.float().abs() > fp8_max  # (False for NaN)
        want = torch.where(over, torch.full_like(x, fp8_max, dtype=torch.float32).copysign(x.float()), want.float())
        want = want.to(dtype)
    same = _bits(got) == _bits(want)
    if torch.device(device).type == "cuda":
        same |= got.float().isnan() & want.float().isnan()
    bad = (~same).nonzero().flatten()[:8].tolist()
    return "; ".join(f"{float(x[i])!r} ({x.view(torch.int16 if x.dtype == torch.float16 else torch.int32)[i]:#x}):"
                     f" {int(_bits(got)[i]):#04x} vs torch {int(_bits(want)[i]):#04x}" for i in bad)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_rounding_equals_torchs_cast_on_every_fp16_value_and_random_bits(fmt, gen, device):
    every_fp16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    assert _cast_differences(every_fp16, fmt, device) == ""
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int64).to(torch.int32)
    random_fp32 = bits.view(torch.float32)  # NaNs, infinities, subnormals, everything
    assert _cast_differences(random_fp32, fmt, device) == ""
    near_codes = torch.randn(1 << 16, generator=gen) * 2.0 ** torch.randint(-20, 18, (1 << 16,), generator=gen)
    assert _cast_differences(near_codes, fmt, device) == ""


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_decodes_every_code(fmt, device):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FORMATS[fmt][0]).view(2, 128)
    got = fp8_dequantize_triton(codes.to(device), torch.ones(2, 1, device=device), 1)
    assert _same_floats(got, codes.float())


CASES = [  # shape, format, tile rows, pow2, input dtype, transposed view
    ((1023, 777), "e4m3", 1, False, torch.float32, False),
    ((1023, 777), "e5m2", 128, True, torch.bfloat16, False),
    ((1, 300), "e4m3", 128, False, torch.float16, False),
    ((300, 257), "e5m2", 1, True, torch.float32, True),
    ((3, 130, 129), "e4m3", 128, False, torch.float32, False),  # a batch: experts' weights
]


@pytest.mark.parametrize("shape,fmt,tile_rows,pow2,dtype,transposed", CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-{c[1]}-{c[2]}-{'pow2' if c[3] else 'any'}-"
                              f"{str(c[4])[6:]}{'-T' if c[5] else ''}" for c in CASES])
def test_quantize_kernel_equals_the_reference(shape, fmt, tile_rows, pow2, dtype, transposed, gen, device):
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen) * 10).to(dtype)
    on_device = x.to(device)
    if transposed:  # a strided view, on either device
        x, on_device = x.reshape(shape[::-1]).t(), on_device.reshape(shape[::-1]).t()
        assert not x.is_contiguous() and not on_device.is_contiguous()
    q, s = fp8_quantize_triton(on_device, fmt, tile_rows, pow2)
    q_ref, s_ref = fp8_quantize_reference(x, fmt, tile_rows, pow2)
    assert q.dtype == FORMATS[fmt][0] and q.shape == x.shape
    assert torch.equal(_bits(q), _bits(q_ref))
    assert _same_floats(s, s_ref)
    if pow2:
        assert bool((torch.frexp(s).mantissa.abs() == 0.5).all())  # every scale a power of two
    deq = fp8_dequantize_triton(q, s, tile_rows).cpu()
    q, s = q.cpu(), s.cpu()
    assert _same_floats(deq, fp8_dequantize_reference(q_ref, s_ref, tile_rows))
    # the error the format implies: half a step at the element's magnitude (subnormal steps
    # below the smallest normal), in the tile's scaled units
    _, _, man, fp8_max, _ = FORMATS[fmt]
    bias = (1 << (FORMATS[fmt][1] - 1)) - 1
    full = s.repeat_interleave(tile_rows, -2)[..., :x.shape[-2], :].repeat_interleave(128, -1)[..., :x.shape[-1]]
    bound = x.double().abs() * 2.0 ** -(man + 1) + full.double() * 2.0 ** (-bias - man)
    assert bool(((deq.double() - x.double()).abs() <= bound * (1 + 1e-6)).all())


BOTH = [  # shape, format, pow2, input dtype, transposed view
    ((300, 257), "e4m3", False, torch.float32, False),
    ((129, 130), "e5m2", True, torch.bfloat16, True),
    ((1, 300), "e4m3", False, torch.float16, False),
    ((256, 128), "e5m2", False, torch.bfloat16, False),  # whole tiles: no padding
]


@pytest.mark.parametrize("shape,fmt,pow2,dtype,transposed", BOTH,
                         ids=[f"{'x'.join(map(str, c[0]))}-{c[1]}-{'pow2' if c[2] else 'any'}-{str(c[3])[6:]}"
                              f"{'-T' if c[4] else ''}" for c in BOTH])
def test_the_fused_quantization_writes_both_layouts_as_two_quantizations_would(shape, fmt, pow2, dtype, transposed,
                                                                                 gen, device):
    """One kernel, each tile read once: its 1x128 tiles along K equal ``fp8_quantize(x)``'s and
    along M ``fp8_quantize(x.t())``'s (torch's casts, the reference's rule), bit for bit; the
    transposed codes are padded with zeros to whole tiles, also where a tile holds a NaN or an
    infinity (its scale is NaN: the padding must not carry it)."""
    m, k = shape
    x = (torch.randn(shape, generator=gen) * torch.rand(k, generator=gen) * 10).to(dtype)
    x[m // 2, k // 3] = float("nan")
    x[m - 1, k - 1] = float("inf")
    if transposed:
        x = x.t().contiguous().t()
    got = fp8_quantize_both_triton(_moved(x, device), fmt, pow2)
    q_ref, s_ref = fp8_quantize_reference(x, fmt, 1, pow2)
    qt_ref, st_ref = fp8_quantize_reference(x.t(), fmt, 1, pow2)
    q, s, qt, st = (t.cpu() for t in got)
    assert q.shape == (m, k) and qt.shape == (k, padded_rows(m)) and padded_rows(m) % 128 == 0
    assert q.dtype == qt.dtype == FORMATS[fmt][0]
    assert torch.equal(_bits(q), _bits(q_ref)) and _same_floats(s, s_ref)
    assert torch.equal(_bits(qt[:, :m]), _bits(qt_ref)) and _same_floats(st, st_ref)
    assert not bool(_bits(qt[:, m:]).any())  # zero codes
    assert bool(st.isnan().any()) and bool(s.isnan().any())  # the non-finite tiles are there
    for a, b in zip(got, fp8_quantize_both_reference(x, fmt, pow2)):  # the reference says the same
        assert a.shape == b.shape and (torch.equal(_bits(a), _bits(b)) if a.dtype in
                                       (torch.float8_e4m3fn, torch.float8_e5m2) else _same_floats(a, b))


def _moved(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` with the same strides."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


def test_zero_tiny_and_non_finite_tiles_follow_the_rule(device):
    x = torch.randn(4, 384)
    x[0, :128] = 0.0  # a zero tile
    x[1, 128:256] = 1e-40  # a subnormal tile (float32)
    x[2, 3] = float("inf")  # one infinity: its tile only
    x[3, 300] = float("nan")  # one NaN: its tile only
    for impl, where in ((fp8_quantize_triton, device), (fp8_quantize_reference, "cpu")):
        q, s = (t.cpu() for t in impl(x.to(where), "e4m3", 1))
        assert s[0, 0] == 2.0**-126 and not bool(_bits(q[0, :128]).any())  # safe scale, zero codes
        deq = fp8_dequantize_reference(q, s, 1)
        assert bool((deq[0, :128] == 0).all())
        # a subnormal tile: the largest inverse scale (2^126); its values become fp8 subnormals,
        # within half a subnormal step (2^-10 of the scale)
        assert s[1, 1] == 2.0**-126 and bool(((deq[1, 128:256] - 1e-40).abs() <= 2.0**-136).all())
        assert s[2, 0].isnan() and bool(deq[2, :128].isnan().all())  # inf -> NaN, not 448
        assert s[3, 2].isnan() and bool(deq[3, 256:].isnan().all())
        finite = torch.ones_like(s, dtype=torch.bool)
        finite[2, 0] = finite[3, 2] = False
        assert bool(torch.isfinite(s[finite]).all())
        assert bool(torch.isfinite(deq[2, 128:]).all()) and bool(torch.isfinite(deq[3, :256]).all())


def test_custom_ops_route_to_the_kernel_and_trace(device, gen):
    from molds.kernels import fp8 as mod

    x = torch.randn(130, 200, generator=gen).to(device)
    calls = []
    real = mod.fp8_quantize_triton
    try:
        mod.fp8_quantize_triton = lambda *a: calls.append(1) or real(*a)
        q, s = fp8_quantize(x, "e5m2", 128)
    finally:
        mod.fp8_quantize_triton = real
    assert calls
    q_ref, s_ref = fp8_quantize_reference(x, "e5m2", 128)
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)
    assert torch.equal(fp8_dequantize(q, s, 128), fp8_dequantize_reference(q, s, 128))
    # to bf16 within one unit in the last place: the interpreter truncates fp32 -> bf16 where a
    # GPU rounds to nearest even (triton's interpreter, ``_convert_float``); a GPU's kernel and
    # torch may also differ in the last float32 bit of the product before that rounding
    torch.testing.assert_close(fp8_dequantize(q, s, 128, torch.bfloat16),
                               fp8_dequantize_reference(q, s, 128, torch.bfloat16), rtol=2**-7, atol=0)
    # the fake (meta) implementations agree with the real ops (opcheck's schema test cannot
    # compare fp8 outputs on a CPU: torch has no CPU arithmetic for them)
    both = fp8_quantize_both(x, "e4m3")  # the fused op routes to its kernel too (one launch)
    assert all(torch.equal(_bits(a), _bits(b)) if a.dtype == torch.float8_e4m3fn else _same_floats(a, b)
               for a, b in zip(both, fp8_quantize_both_reference(x.cpu(), "e4m3")))
    for op, args in ((torch.ops.molds.fp8_quantize.default, (x, "e4m3", 1, False)),
                     (torch.ops.molds.fp8_quantize_both.default, (x, "e5m2", False)),
                     (torch.ops.molds.fp8_dequantize.default, (q, s, 128, torch.float32))):
        torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
