"""Block-scaled FP8 quantize / dequantize: the number format under molds' FP8 GEMMs.

Why it exists: FP8 matrix units (Ada, Hopper, Blackwell) run twice BF16's rate, but an
8-bit float holds 2-3 mantissa bits over a narrow range, so a tensor is only usable in
FP8 with a scale per small block. DeepSeek-V3's recipe, used here: activations and
gradients in 1x128 tiles (one scale per row and 128 consecutive elements of the
contraction dimension), weights in 128x128 blocks (the same blocks whichever way the
weight is read, so W and W^T share one quantization). Formats: ``e4m3`` (torch's
``float8_e4m3fn``, max 448) for weights and activations, ``e5m2`` (max 57344) for
gradients, whose range matters more than their precision.

The rule for a tile with largest magnitude ``amax`` (``FP8_MAX`` the format's largest):

    inv   = min(FP8_MAX / amax, 2^126)      IEEE division; a zero or tiny tile gets 2^126,
                                            so every stored scale is a finite normal float
    inv   = 2^floor(log2 inv)               with ``pow2`` (exact scaling, exact dequantize)
    q     = fp8(x * inv)                    round to nearest even, as torch's cast
    scale = 1 / inv                         stored (float32); dequantize is q * scale

A tile holding NaN or an infinity gets ``scale = NaN`` and NaN codes: it dequantizes to
NaN, so the step's loss or gradient is non-finite and the run's non-finite policy
(``trainer.on_nonfinite``) sees it, instead of an infinity saturating to 448 (what the
e4m3 cast alone does) and training on finite garbage.

Matching torch bit for bit: Triton's interpreter converts fp32 to fp8 with its own
numpy code (``triton/runtime/interpreter.py``, ``_convert_float``, triton issue #8322),
which rounds ties away from zero, ORs the mantissa carry into the exponent instead of
adding it (126.24 becomes 64 in e4m3), rounds subnormals twice and neither saturates nor
keeps NaN; it also decodes fp8 NaN and infinity codes as finite numbers. On a GPU,
``.to(tl.float8e4nv)`` compiles to ``cvt.rn.satfinite`` (round to nearest even,
saturating), which equals torch's cast on every finite input. So ``fp8_code`` rounds
with integer operations on the float's bits (exact in the interpreter and on a GPU alike)
and ``fp8_value`` decodes the same way; tests hold both to torch's casts on all 65,536
fp16 values, random fp32 bit patterns (NaN, infinities and subnormals included) and every
fp8 code. The quantize kernel uses ``fp8_code`` in the interpreter and the GPU's own cast
on a GPU: every value it casts is scaled into the format's range (or NaN, in a tile whose
scale is NaN), where the two agree, and the integer rounding costs about 30 integer
operations an element, which made the kernel compute-bound on an H200 (8192 x 8192 in
0.22 ms, 23 % of the bandwidth).
"""

from __future__ import annotations

import torch

from .launch import check_interpreter, empty, jit, runs_triton, tl

#: format name -> (torch dtype, exponent bits, mantissa bits, largest finite value, saturates)
FORMATS = {
    "e4m3": (torch.float8_e4m3fn, 4, 3, 448.0, True),
    "e5m2": (torch.float8_e5m2, 5, 2, 57344.0, False),
}
#: the contraction-dimension width of a tile (and the side of a weight block)
TILE = 128
#: the largest inverse scale (so the smallest stored scale is 2^-126, a normal float)
MAX_INV_SCALE = 2.0**126


def _check(fmt: str, tile_rows: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format {fmt!r}: one of {', '.join(FORMATS)}")
    if tile_rows not in (1, TILE):
        raise ValueError(f"fp8 tile rows {tile_rows}: 1 (1x128 tiles) or 128 (128x128 blocks)")


def scale_shape(rows: int, cols: int, tile_rows: int) -> tuple[int, int]:
    return -(-rows // tile_rows), -(-cols // TILE)


# ---------------------------------------------------------------- PyTorch reference

def _as_batch(x: torch.Tensor) -> torch.Tensor:
    if x.dim() not in (2, 3):
        raise ValueError(f"fp8 quantization takes a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    return x if x.dim() == 3 else x.unsqueeze(0)


def fp8_quantize_reference(x: torch.Tensor, fmt: str = "e4m3", tile_rows: int = 1, pow2: bool = False):
    """``(q, scale)`` of ``x`` [M, K] (or a batch [B, M, K], each matrix on its own):
    ``q`` in the format's dtype (contiguous), ``scale`` [(B,) ceil(M / tile_rows),
    ceil(K / 128)] float32. The rule is the module's."""
    _check(fmt, tile_rows)
    dtype, _, _, fp8_max, _ = FORMATS[fmt]
    xb = _as_batch(x)
    b, m, k = xb.shape
    sm, sk = scale_shape(m, k, tile_rows)
    padded = xb.new_zeros((b, sm * tile_rows, sk * TILE), dtype=torch.float32)
    padded[:, :m, :k] = xb
    tiles = padded.view(b, sm, tile_rows, sk, TILE)
    mag = tiles.abs().masked_fill(tiles.isnan(), float("inf"))
    amax = mag.amax(dim=(2, 4))  # [b, sm, sk]
    inv = (torch.full_like(amax, fp8_max) / amax).clamp(max=MAX_INV_SCALE)
    if pow2:
        inv = (inv.view(torch.int32) & 0x7F800000).view(torch.float32)
    inv = inv.masked_fill(amax == float("inf"), float("nan"))
    q = (tiles * inv[:, :, None, :, None]).to(dtype).view(b, sm * tile_rows, sk * TILE)[:, :m, :k].contiguous()
    scale = 1.0 / inv
    return (q, scale) if x.dim() == 3 else (q[0], scale[0])


def padded_rows(m: int) -> int:
    """The token axis of a transposed quantization, padded to whole 128-wide tiles (zero codes):
    cuBLAS wants a product's contraction side divisible by 16, and a weight gradient contracts
    over the tokens."""
    return -(-m // TILE) * TILE


def fp8_quantize_both_reference(x: torch.Tensor, fmt: str = "e4m3", pow2: bool = False):
    """``(q, scale, qt, scale_t)`` of a matrix ``x`` [M, K]: ``fp8_quantize_reference(x, fmt,
    1, pow2)`` (1x128 tiles along K) and the same of ``x.t()`` (1x128 tiles along M), the
    latter's codes padded with zeros to ``padded_rows(M)`` columns: ``qt`` [K, Mp],
    ``scale_t`` [K, ceil(M / 128)]. What a linear needs of its input (the forward product,
    and the weight gradient later) and of its output gradient (the input gradient, and the
    weight gradient)."""
    if x.dim() != 2:
        raise ValueError(f"fp8_quantize_both takes a matrix, got shape {tuple(x.shape)}")
    q, s = fp8_quantize_reference(x, fmt, 1, pow2)
    qt_, st = fp8_quantize_reference(x.t(), fmt, 1, pow2)
    m = x.shape[0]
    qt = qt_.new_zeros((x.shape[1], padded_rows(m)))
    qt[:, :m] = qt_
    return q, s, qt, st


def fp8_dequantize_reference(q: torch.Tensor, scale: torch.Tensor, tile_rows: int = 1,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per tile (any strides; a batch too), in ``dtype`` (computed in float32)."""
    m, k = q.shape[-2:]
    s = scale.repeat_interleave(tile_rows, -2)[..., :m, :].repeat_interleave(TILE, -1)[..., :k]
    return (q.float() * s).to(dtype)


# ---------------------------------------------------------------- Triton

@jit
def fp8_code(x, EXP: tl.constexpr, MAN: tl.constexpr, SATURATE: tl.constexpr):
    """fp32 -> the fp8 code (uint8), rounded to nearest even, with torch's overflow rule
    (e4m3fn saturates at 448, e5m2 overflows to infinity) and NaN kept."""
    BIAS: tl.constexpr = (1 << (EXP - 1)) - 1
    SHIFT: tl.constexpr = 23 - MAN
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << (EXP + MAN)
    u = bits & 0x7FFFFFFF
    # normal range: rebias the exponent, round the dropped bits to nearest even
    # (integer addition carries a mantissa overflow into the exponent)
    t = u - ((127 - BIAS) << 23)
    normal = (t + ((1 << (SHIFT - 1)) - 1) + ((t >> SHIFT) & 1)) >> SHIFT
    # below the smallest normal: the significand over the subnormal step, nearest even
    sig = (u & 0x7FFFFF) | 0x800000
    shift = tl.minimum((151 - BIAS - MAN) - (u >> 23).to(tl.int32), 31).to(tl.uint32)
    sub = sig >> shift
    rem = sig - (sub << shift)
    half = (tl.full(u.shape, 1, tl.uint32) << shift) >> 1
    sub = sub + ((rem > half) | ((rem == half) & ((sub & 1) == 1))).to(tl.uint32)
    code = tl.where(u >= ((128 - BIAS) << 23), normal, sub)
    if SATURATE:
        code = tl.minimum(code, (1 << (EXP + MAN)) - 2)
    else:
        code = tl.minimum(code, ((1 << EXP) - 1) << MAN)
    code = tl.where(u > 0x7F800000, (1 << (EXP + MAN)) - 1, code)
    return (code | sign).to(tl.uint8)


@jit
def fp8_value(c, EXP: tl.constexpr, MAN: tl.constexpr, SATURATE: tl.constexpr):
    """An fp8 code (uint8) -> its fp32 value (exact), NaN and infinity included."""
    BIAS: tl.constexpr = (1 << (EXP - 1)) - 1
    code = c.to(tl.uint32)
    sign = ((code >> (EXP + MAN)) & 1) << 31
    e = (code >> MAN) & ((1 << EXP) - 1)
    m = code & ((1 << MAN) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MAN))).to(tl.float32, bitcast=True)
    SUB_STEP: tl.constexpr = 2.0 ** (1 - BIAS - MAN)
    v = tl.where(e == 0, m.to(tl.float32) * SUB_STEP, normal)
    top = e == (1 << EXP) - 1
    if SATURATE:  # e4m3fn: only S.1111.111 is NaN
        v = tl.where(top & (m == (1 << MAN) - 1), float("nan"), v)
    else:  # e5m2: IEEE-style infinities and NaNs
        v = tl.where(top, tl.where(m == 0, float("inf"), float("nan")), v)
    # the sign as a bit: compiled Triton negates as 0 - v, which turns the code -0 into +0
    return (v.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@jit
def inverse_scale(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """The module's rule: FP8_MAX / amax, at most 2^126, optionally a power of two; NaN
    where the tile was not finite (``amax`` is +inf there)."""
    inv = tl.minimum(tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax), 2.0**126)
    if POW2:
        inv = (inv.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(amax == float("inf"), float("nan"), inv)


@jit
def scaled_code(y, EXP: tl.constexpr, MAN: tl.constexpr, SATURATE: tl.constexpr, HW_CAST: tl.constexpr):
    """The fp8 code of a value already scaled into the format's range (or NaN): the GPU's
    own cast there (``cvt.rn.satfinite``, see the module's docstring), ``fp8_code`` in the
    interpreter."""
    if HW_CAST:
        if EXP == 4:
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        code = fp8_code(y, EXP, MAN, SATURATE)
    return code


@jit
def quantize_kernel(X, Q, S, M, K, stride_xb, stride_xm, stride_xk, stride_qb, stride_qm, stride_sb, stride_sm,
                    FP8_MAX: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr, SATURATE: tl.constexpr,
                    POW2: tl.constexpr, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    HW_CAST: tl.constexpr):
    pid_m, pid_k, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    X += pid_b * stride_xb
    Q += pid_b * stride_qb
    S += pid_b * stride_sb
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    mag = tl.where(x != x, float("inf"), tl.abs(x))
    amax = tl.max(mag, axis=1, keep_dims=True)  # [BLOCK_M, 1]: one scale per row
    if TILE_M != 1:
        amax = tl.max(amax, axis=0, keep_dims=True)  # [1, 1]: one scale per block
    inv = inverse_scale(amax, FP8_MAX, POW2)
    code = scaled_code(x * inv, EXP, MAN, SATURATE, HW_CAST)
    tl.store(Q + rows[:, None] * stride_qm + cols[None, :], code, mask=mask)
    scale = tl.math.div_rn(tl.full(inv.shape, 1.0, tl.float32), inv)
    if TILE_M == 1:
        tl.store(S + rows[:, None] * stride_sm + pid_k, scale, mask=(rows < M)[:, None])
    else:
        tl.store(S + pid_m * stride_sm + pid_k + tl.zeros([1, 1], dtype=tl.int32), scale)


@jit
def quantize_both_kernel(X, Q, S, QT, ST, M, K, stride_xm, stride_xk, stride_qm, stride_sm, stride_qtk, stride_stk,
                         FP8_MAX: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr, SATURATE: tl.constexpr,
                         POW2: tl.constexpr, HW_CAST: tl.constexpr, BLOCK: tl.constexpr):
    """One 128 x 128 tile of X, read once: its 1x128 tiles along K (Q, S) and along M,
    written transposed (QT [K, Mp], ST [K, ceil(M / 128)]; rows past M are zero codes)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    row_in, col_in = rows < M, cols < K
    mask = row_in[:, None] & col_in[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    mag = tl.where(x != x, float("inf"), tl.abs(x))
    inv = inverse_scale(tl.max(mag, axis=1, keep_dims=True), FP8_MAX, POW2)  # [BLOCK, 1]: along K
    tl.store(Q + rows[:, None] * stride_qm + cols[None, :], scaled_code(x * inv, EXP, MAN, SATURATE, HW_CAST),
             mask=mask)
    tl.store(S + rows[:, None] * stride_sm + pid_k, tl.math.div_rn(tl.full(inv.shape, 1.0, tl.float32), inv),
             mask=row_in[:, None])
    inv_t = inverse_scale(tl.max(mag, axis=0, keep_dims=True), FP8_MAX, POW2)  # [1, BLOCK]: along M
    code_t = scaled_code(x * inv_t, EXP, MAN, SATURATE, HW_CAST)
    code_t = tl.where(row_in[:, None], code_t, tl.zeros_like(code_t))  # the padding: zero even in a NaN tile
    tl.store(QT + cols[:, None] * stride_qtk + rows[None, :], tl.trans(code_t), mask=col_in[:, None])
    tl.store(ST + cols[None, :] * stride_stk + pid_m, tl.math.div_rn(tl.full(inv_t.shape, 1.0, tl.float32), inv_t),
             mask=col_in[None, :])


@jit
def dequantize_kernel(Q, S, Y, M, K, stride_qb, stride_qm, stride_qk, stride_sb, stride_sm, stride_sk,
                      stride_yb, stride_ym, EXP: tl.constexpr, MAN: tl.constexpr, SATURATE: tl.constexpr,
                      TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_k, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    code = tl.load(Q + pid_b * stride_qb + rows[:, None] * stride_qm + cols[None, :] * stride_qk, mask=mask, other=0)
    s = tl.load(S + pid_b * stride_sb + (rows // TILE_M) * stride_sm + pid_k * stride_sk, mask=rows < M, other=1.0)
    v = fp8_value(code, EXP, MAN, SATURATE) * s[:, None]
    tl.store(Y + pid_b * stride_yb + rows[:, None] * stride_ym + cols[None, :], v.to(Y.dtype.element_ty), mask=mask)


@jit
def cast_kernel(X, Q, n, EXP: tl.constexpr, MAN: tl.constexpr, SATURATE: tl.constexpr, BLOCK: tl.constexpr):
    """Q = fp8(X) element by element, no scaling (``fp8_cast_triton``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Q + offs, fp8_code(x, EXP, MAN, SATURATE), mask=offs < n)


def fp8_cast_triton(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """``x.to(fp8)`` through ``fp8_code``: the rounding every quantize kernel uses, on its own."""
    if not x.is_cuda:
        check_interpreter()
    dtype, e, m_bits, _, sat = FORMATS[fmt]
    x = x.contiguous()
    q = empty(x.shape, dtype, x.device)
    if x.numel():
        cast_kernel[(-(-x.numel() // 4096),)](x, q.view(torch.uint8), x.numel(), EXP=e, MAN=m_bits, SATURATE=sat,
                                                BLOCK=4096)
    return q


def _rows_per_program(tile_rows: int) -> int:
    return TILE if tile_rows == TILE else 32


def fp8_quantize_triton(x: torch.Tensor, fmt: str = "e4m3", tile_rows: int = 1, pow2: bool = False):
    """The Triton kernel (any strides; compiled on a GPU, interpreted on a CPU)."""
    _check(fmt, tile_rows)
    if not x.is_cuda:
        check_interpreter()
    dtype, e, m_bits, fp8_max, sat = FORMATS[fmt]
    xb = _as_batch(x)
    b, m, k = xb.shape
    q = empty((b, m, k), dtype, x.device)
    scale = empty((b, *scale_shape(m, k, tile_rows)), torch.float32, x.device)
    if x.numel():
        rows = _rows_per_program(tile_rows)
        qv = q.view(torch.uint8)
        quantize_kernel[(-(-m // rows), -(-k // TILE), b)](
            xb, qv, scale, m, k, *xb.stride(), qv.stride(0), qv.stride(1), scale.stride(0), scale.stride(1),
            FP8_MAX=fp8_max, EXP=e, MAN=m_bits, SATURATE=sat, POW2=pow2, TILE_M=tile_rows, BLOCK_M=rows,
            BLOCK_K=TILE, HW_CAST=x.is_cuda, num_warps=8 if tile_rows == TILE else 4)
    return (q, scale) if x.dim() == 3 else (q[0], scale[0])


def fp8_quantize_both_triton(x: torch.Tensor, fmt: str = "e4m3", pow2: bool = False):
    """The fused kernel: each 128 x 128 tile of ``x`` read once, both layouts written (any
    strides of ``x``; compiled on a GPU, interpreted on a CPU)."""
    if not x.is_cuda:
        check_interpreter()
    if fmt not in FORMATS or x.dim() != 2:
        raise ValueError(f"fp8_quantize_both: a matrix and one of {', '.join(FORMATS)} (got {tuple(x.shape)}, "
                         f"{fmt!r})")
    dtype, e, m_bits, fp8_max, sat = FORMATS[fmt]
    m, k = x.shape
    mb, kb = -(-m // TILE), -(-k // TILE)
    q, s = empty((m, k), dtype, x.device), empty((m, kb), torch.float32, x.device)
    qt, st = empty((k, mb * TILE), dtype, x.device), empty((k, mb), torch.float32, x.device)
    if x.numel():
        qv, qtv = q.view(torch.uint8), qt.view(torch.uint8)
        quantize_both_kernel[(mb, kb)](x, qv, s, qtv, st, m, k, *x.stride(), qv.stride(0), s.stride(0),
                                       qtv.stride(0), st.stride(0), FP8_MAX=fp8_max, EXP=e, MAN=m_bits,
                                       SATURATE=sat, POW2=pow2, HW_CAST=x.is_cuda, BLOCK=TILE, num_warps=8)
    return q, s, qt, st


def fp8_dequantize_triton(q: torch.Tensor, scale: torch.Tensor, tile_rows: int = 1,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Triton kernel (any strides of ``q`` and ``scale``)."""
    if not q.is_cuda:
        check_interpreter()
    _, e, m_bits, _, sat = FORMATS[format_of(q.dtype)]
    qb, sb = _as_batch(q), _as_batch(scale)
    b, m, k = qb.shape
    y = empty((b, m, k), dtype, q.device)
    if q.numel():
        rows = _rows_per_program(tile_rows)
        qv = qb.view(torch.uint8)
        dequantize_kernel[(-(-m // rows), -(-k // TILE), b)](
            qv, sb, y, m, k, *qv.stride(), *sb.stride(), y.stride(0), y.stride(1), EXP=e, MAN=m_bits,
            SATURATE=sat, TILE_M=tile_rows, BLOCK_M=rows, BLOCK_K=TILE)
    return y if q.dim() == 3 else y[0]


def format_of(dtype: torch.dtype) -> str:
    for name, (d, *_) in FORMATS.items():
        if d == dtype:
            return name
    raise ValueError(f"{dtype} is not an fp8 format molds uses ({', '.join(FORMATS)})")


# ---------------------------------------------------------------- custom ops (what models and torch.compile see)

@torch.library.custom_op("molds::fp8_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, fmt: str, tile_rows: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if runs_triton(x):
        return fp8_quantize_triton(x, fmt, tile_rows, pow2)
    return fp8_quantize_reference(x, fmt, tile_rows, pow2)


@_quantize_op.register_fake
def _(x, fmt, tile_rows, pow2):
    *lead, m, k = x.shape
    return (x.new_empty(x.shape, dtype=FORMATS[fmt][0]),
            x.new_empty((*lead, *scale_shape(m, k, tile_rows)), dtype=torch.float32))


@torch.library.custom_op("molds::fp8_quantize_both", mutates_args=())
def _quantize_both_op(x: torch.Tensor, fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    if runs_triton(x):
        return fp8_quantize_both_triton(x, fmt, pow2)
    return fp8_quantize_both_reference(x, fmt, pow2)


@_quantize_both_op.register_fake
def _(x, fmt, pow2):
    m, k = x.shape
    dtype = FORMATS[fmt][0]
    return (x.new_empty((m, k), dtype=dtype), x.new_empty((m, -(-k // TILE)), dtype=torch.float32),
            x.new_empty((k, padded_rows(m)), dtype=dtype), x.new_empty((k, -(-m // TILE)), dtype=torch.float32))


@torch.library.custom_op("molds::fp8_dequantize", mutates_args=())
def _dequantize_op(q: torch.Tensor, scale: torch.Tensor, tile_rows: int, dtype: torch.dtype) -> torch.Tensor:
    if runs_triton(q):
        return fp8_dequantize_triton(q, scale, tile_rows, dtype)
    return fp8_dequantize_reference(q, scale, tile_rows, dtype)


@_dequantize_op.register_fake
def _(q, scale, tile_rows, dtype):
    return q.new_empty(q.shape, dtype=dtype)


def eager_launch(*tensors: torch.Tensor) -> bool:
    """Whether a call may go straight to its Triton launcher, past the custom op: plain CUDA
    tensors, nothing tracing (torch.compile, a fake or dispatch mode). The custom op's
    dispatch costs tens of microseconds a call in eager mode, on the order of a small
    kernel; torch.compile and the modes still see the op."""
    return (not torch.compiler.is_compiling()  # (first: under torch.compile nothing else is evaluated)
            and all(type(t) is torch.Tensor and t.is_cuda for t in tensors)
            and torch._C._len_torch_dispatch_stack() == 0 and runs_triton(tensors[0]))


def fp8_quantize(x: torch.Tensor, fmt: str = "e4m3", tile_rows: int = 1, pow2: bool = False):
    """``(q, scale)`` of a matrix (or a batch of them), any strides: a transposed view
    quantizes along its own rows. 1x128 tiles (``tile_rows=1``) or 128x128 blocks
    (``tile_rows=128``)."""
    _check(fmt, tile_rows)
    _as_batch(x)
    if eager_launch(x):
        return fp8_quantize_triton(x, fmt, tile_rows, pow2)
    return _quantize_op(x, fmt, tile_rows, pow2)


def fp8_quantize_both(x: torch.Tensor, fmt: str = "e4m3", pow2: bool = False):
    """``(q, scale, qt, scale_t)``: ``x`` [M, K] in 1x128 tiles along K, and ``x.t()`` in 1x128
    tiles along M with its codes padded to ``padded_rows(M)`` columns
    (``fp8_quantize_both_reference``); on a GPU one kernel reads ``x`` once for both."""
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format {fmt!r}: one of {', '.join(FORMATS)}")
    if x.dim() != 2:
        raise ValueError(f"fp8_quantize_both takes a matrix, got shape {tuple(x.shape)}")
    if eager_launch(x):
        return fp8_quantize_both_triton(x, fmt, pow2)
    return _quantize_both_op(x, fmt, pow2)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, tile_rows: int = 1,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _dequantize_op(q, scale, tile_rows, dtype)
