"""Block-scaled FP8 quantization: the Triton kernels (Triton's interpreter on a CPU) equal
torch's casts and the PyTorch reference bit for bit, on odd shapes, strides and dtypes;
zero, tiny and non-finite tiles follow the stated rule; the custom ops trace."""

from __future__ import annotations

import pytest
import torch

from molds.kernels.fp8 import (FORMATS, fp8_cast_triton, fp8_dequantize, fp8_dequantize_reference,
                               fp8_dequantize_triton, fp8_quantize, fp8_quantize_reference, fp8_quantize_triton)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN payloads aside."""
    both_nan = a.isnan() & b.isnan()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_rounding_equals_torchs_cast_on_every_fp16_value_and_random_bits(fmt, gen):
    dtype = FORMATS[fmt][0]
    every_fp16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    assert torch.equal(_bits(fp8_cast_triton(every_fp16, fmt)), _bits(every_fp16.to(dtype)))
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int64).to(torch.int32)
    random_fp32 = bits.view(torch.float32)  # NaNs, infinities, subnormals, everything
    assert torch.equal(_bits(fp8_cast_triton(random_fp32, fmt)), _bits(random_fp32.to(dtype)))
    near_codes = torch.randn(1 << 16, generator=gen) * 2.0 ** torch.randint(-20, 18, (1 << 16,), generator=gen)
    assert torch.equal(_bits(fp8_cast_triton(near_codes, fmt)), _bits(near_codes.to(dtype)))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_decodes_every_code(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FORMATS[fmt][0]).view(2, 128)
    got = fp8_dequantize_triton(codes, torch.ones(2, 1), 1)
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
def test_quantize_kernel_equals_the_reference(shape, fmt, tile_rows, pow2, dtype, transposed, gen):
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen) * 10).to(dtype)
    if transposed:
        x = x.reshape(shape[::-1]).t()  # a strided view
        assert not x.is_contiguous()
    q, s = fp8_quantize_triton(x, fmt, tile_rows, pow2)
    q_ref, s_ref = fp8_quantize_reference(x, fmt, tile_rows, pow2)
    assert q.dtype == FORMATS[fmt][0] and q.shape == x.shape
    assert torch.equal(_bits(q), _bits(q_ref))
    assert _same_floats(s, s_ref)
    if pow2:
        assert bool((torch.frexp(s).mantissa.abs() == 0.5).all())  # every scale a power of two
    deq = fp8_dequantize_triton(q, s, tile_rows)
    assert _same_floats(deq, fp8_dequantize_reference(q_ref, s_ref, tile_rows))
    # the error the format implies: half a step at the element's magnitude (subnormal steps
    # below the smallest normal), in the tile's scaled units
    _, _, man, fp8_max, _ = FORMATS[fmt]
    bias = (1 << (FORMATS[fmt][1] - 1)) - 1
    full = s.repeat_interleave(tile_rows, -2)[..., :x.shape[-2], :].repeat_interleave(128, -1)[..., :x.shape[-1]]
    bound = x.double().abs() * 2.0 ** -(man + 1) + full.double() * 2.0 ** (-bias - man)
    assert bool(((deq.double() - x.double()).abs() <= bound * (1 + 1e-6)).all())


def test_zero_tiny_and_non_finite_tiles_follow_the_rule():
    x = torch.randn(4, 384)
    x[0, :128] = 0.0  # a zero tile
    x[1, 128:256] = 1e-40  # a subnormal tile (float32)
    x[2, 3] = float("inf")  # one infinity: its tile only
    x[3, 300] = float("nan")  # one NaN: its tile only
    for impl in (fp8_quantize_triton, fp8_quantize_reference):
        q, s = impl(x, "e4m3", 1)
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


def test_custom_ops_route_to_the_kernel_and_trace(interpret, gen):
    from molds.kernels import fp8 as mod

    x = torch.randn(130, 200, generator=gen)
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
    # GPU rounds to nearest even (triton's interpreter, ``_convert_float``)
    torch.testing.assert_close(fp8_dequantize(q, s, 128, torch.bfloat16),
                               fp8_dequantize_reference(q, s, 128, torch.bfloat16), rtol=2**-7, atol=0)
    # the fake (meta) implementations agree with the real ops (opcheck's schema test cannot
    # compare fp8 outputs on a CPU: torch has no CPU arithmetic for them)
    for op, args in ((torch.ops.molds.fp8_quantize.default, (x, "e4m3", 1, False)),
                     (torch.ops.molds.fp8_dequantize.default, (q, s, 128, torch.float32))):
        torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
