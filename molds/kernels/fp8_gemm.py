"""Block-scaled FP8 matrix products: dense and grouped by expert.

Why they exist: an FP8 product only means something with its scales applied per tile
(``molds.kernels.fp8``), and no single library call covers every case molds needs on
every device: torch's ``scaled_mm`` takes 1x128 x 128x128 block scales on Hopper only
(cuBLAS), its ``scaled_grouped_mm`` no block scales at all, and there is nothing on a
CPU. So each product here has three paths, chosen per call:

- ``scaled_mm`` on a Hopper GPU (cuBLAS: A in 1x128 tiles, B in 128x128 blocks or 1x128
  tiles, e4m3 with e4m3 or e5m2), so the forward product, the input gradient and the
  weight gradient of a linear; a configuration cuBLAS refuses falls back to Triton, said
  once on stderr;
- the Triton kernels below on any GPU with FP8 matrix units (and in the interpreter on a
  CPU, for tests). Following DeepSeek-V3 (Hopper's FP8 tensor cores accumulate with
  reduced precision), each 128-wide K block is one ``tl.dot`` and its partial sum is
  scaled and added into a float32 accumulator outside the dot;
- a PyTorch emulation elsewhere (CPU, older GPUs): both operands dequantized to float32
  and multiplied there, which is the same function with float32 accumulation.

The operand convention is the weight's: C = A @ Bt^T with A [M, K] in 1x128 tiles and
Bt [N, K] in 128x128 blocks (a weight; ``tile_b=128``) or 1x128 tiles (``tile_b=1``: a
transposed activation or gradient, for weight gradients). Any strides.

Grouped products (mixture-of-experts): the rows of A are sorted by group, ``offs`` holds
each group's end (``F.grouped_mm``'s convention), and group g multiplies by Bt[g]. A
weight gradient contracts over the rows of one group, so there the tiles along M must
not cross groups: ``pad_groups`` lays each group out from a multiple of 128 (DeepSeek
pads expert segments the same way) and ``fp8_grouped_wgrad`` works on that layout.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .fp8 import TILE, eager_launch, fp8_dequantize_reference
from .launch import check_interpreter, empty, fp8_matrix_units, jit, runs_triton, tl

# ---------------------------------------------------------------- PyTorch path (reference and CPU)


def fp8_mm_reference(a, sa, bt, sb, tile_b: int, out_dtype: torch.dtype) -> torch.Tensor:
    """A @ Bt^T with both operands dequantized to float32."""
    return (fp8_dequantize_reference(a, sa, 1) @ fp8_dequantize_reference(bt, sb, tile_b).t()).to(out_dtype)


def _grouped_mm_fp32(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(x, w, offs)`` in float32 (a loop of products where its strides do not fit)."""
    if x.shape[1] % 4 == 0 and w.shape[2] % 4 == 0:
        return F.grouped_mm(x, w.contiguous(), offs=offs)
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[g])
        start = end
    return torch.cat(out) if out else x.new_zeros(0, w.shape[2])


def fp8_grouped_mm_reference(a, sa, bt, sb, tile_b: int, offs: torch.Tensor, out_dtype: torch.dtype):
    """Per group g: A[rows of g] @ Bt[g]^T, both dequantized to float32."""
    w = fp8_dequantize_reference(bt, sb, tile_b).transpose(1, 2)  # [G, K, N]
    return _grouped_mm_fp32(fp8_dequantize_reference(a, sa, 1), w, offs).to(out_dtype)


def fp8_grouped_wgrad_reference(at, sa, bt, sb, offs_padded: torch.Tensor, out_dtype: torch.dtype):
    """Per group g: At[:, cols of g] @ Bt[:, cols of g]^T -> [G, K, N], on the padded layout."""
    a, b = fp8_dequantize_reference(at, sa, 1), fp8_dequantize_reference(bt, sb, 1)
    out, start = [], 0
    for end in offs_padded.tolist():
        out.append(a[:, start:end] @ b[:, start:end].t())
        start = end
    return torch.stack(out).to(out_dtype)


# ---------------------------------------------------------------- the padded group layout

def pad_groups(counts: torch.Tensor, multiple: int = TILE):
    """For groups of ``counts`` rows laid out one after the other: where each row goes when
    every group starts at a multiple of ``multiple`` (``index`` [M]), the padded groups'
    ends (``offs`` [G], int32) and the padded row count. One host sync (the total)."""
    counts = counts.to(torch.int64)
    padded = (counts + multiple - 1) // multiple * multiple
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    total = int(counts.sum())
    group = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts, output_size=total)
    index = torch.arange(total, device=counts.device) - start[group] + pstart[group]
    return index, torch.cumsum(padded, 0).to(torch.int32), int(padded.sum()) if len(padded) else 0


def scatter_rows(x: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``x``'s rows at ``index`` of a zero matrix of ``rows`` rows."""
    return x.new_zeros(rows, x.shape[1]).index_copy_(0, index, x)


# ---------------------------------------------------------------- Triton

@jit
def _scaled_block_dot(A, Bt, SA, SB, rows, cols, kb, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                      stride_sam, stride_sak, stride_sbn, stride_sbk, TILE_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """One 128-wide K block of A[rows] @ Bt[cols]^T, scaled (float32)."""
    ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(A + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
    b = tl.load(Bt + cols[:, None] * stride_bn + ks[None, :] * stride_bk,
                mask=(cols < N)[:, None] & (ks < K)[None, :], other=0.0)
    part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
    sa = tl.load(SA + rows * stride_sam + kb * stride_sak, mask=rows < M, other=0.0)
    sb = tl.load(SB + (cols // TILE_B) * stride_sbn + kb * stride_sbk, mask=cols < N, other=0.0)
    return part * sa[:, None] * sb[None, :]


@jit
def block_scaled_mm_kernel(A, Bt, SA, SB, C, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                           stride_sam, stride_sak, stride_sbn, stride_sbk, stride_cm, stride_cn,
                           TILE_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        acc += _scaled_block_dot(A, Bt, SA, SB, rows, cols, kb, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                                 stride_sam, stride_sak, stride_sbn, stride_sbk, TILE_B, BLOCK_K)
    tl.store(C + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@jit
def grouped_block_scaled_mm_kernel(A, Bt, SA, SB, C, TILE_GROUP, TILE_ROW0, TILE_ROW1, G, N, K,
                                   stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_sam, stride_sak,
                                   stride_sbg, stride_sbn, stride_sbk, stride_cm, stride_cn,
                                   TILE_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr):
    """Program (t, n): rows TILE_ROW0[t] .. TILE_ROW1[t] - 1, all of group TILE_GROUP[t]."""
    t = tl.program_id(0)
    g = tl.load(TILE_GROUP + t)
    if g < G:
        row0 = tl.load(TILE_ROW0 + t)
        row1 = tl.load(TILE_ROW1 + t)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            acc += _scaled_block_dot(A, Bt + g * stride_bg, SA, SB + g * stride_sbg, rows, cols, kb, row1, N, K,
                                     stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn,
                                     stride_sbk, TILE_B, BLOCK_K)
        tl.store(C + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
                 mask=(rows < row1)[:, None] & (cols < N)[None, :])


@jit
def grouped_wgrad_kernel(At, Bt, SA, SB, C, BOUNDS, K, N, stride_ak, stride_am, stride_bn, stride_bm,
                         stride_sak, stride_sam, stride_sbn, stride_sbm, stride_cg, stride_ck, stride_cn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (g, k, n): C[g] = At[:, cols of g] @ Bt[:, cols of g]^T, the contraction over
    group g's columns BOUNDS[g] .. BOUNDS[g + 1] - 1 of the padded layout (multiples of 128)."""
    g = tl.program_id(0)
    start = tl.load(BOUNDS + g)
    end = tl.load(BOUNDS + g + 1)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(start // BLOCK_K, end // BLOCK_K):
        acc += _scaled_block_dot(At, Bt, SA, SB, rows, cols, kb, K, N, end, stride_ak, stride_am, stride_bn,
                                 stride_bm, stride_sak, stride_sam, stride_sbn, stride_sbm, 1, BLOCK_K)
    tl.store(C + g * stride_cg + rows[:, None] * stride_ck + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(rows < K)[:, None] & (cols < N)[None, :])


_BLOCK_M, _BLOCK_N = 64, 128


def _launch_check(t: torch.Tensor) -> None:
    if not t.is_cuda:
        check_interpreter()


def fp8_mm_triton(a, sa, bt, sb, tile_b: int, out_dtype: torch.dtype) -> torch.Tensor:
    _launch_check(a)
    m, k = a.shape
    n = bt.shape[0]
    c = empty((m, n), out_dtype, a.device)
    if c.numel():
        grid = (-(-m // _BLOCK_M), -(-n // _BLOCK_N))
        block_scaled_mm_kernel[grid](a, bt, sa, sb, c, m, n, k, *a.stride(), *bt.stride(), *sa.stride(), *sb.stride(),
                                     *c.stride(), TILE_B=tile_b, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=TILE)
    return c


def _tile_map(offs: torch.Tensor, rows: int, block: int):
    """The grouped kernel's row tiles: for an upper bound of tiles, each one's group (G for
    an unused tile), first row and end row; no host sync."""
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + block - 1) // block
    tile_end = torch.cumsum(tiles, 0)
    bound = -(-rows // block) + len(offs)
    t = torch.arange(bound, device=offs.device)
    group = torch.searchsorted(tile_end, t, right=True)
    g = group.clamp(max=len(offs) - 1)
    first = ends[g] - counts[g] + (t - (tile_end[g] - tiles[g])) * block
    return group.to(torch.int32), first.to(torch.int32), torch.minimum(first + block, ends[g]).to(torch.int32)


def fp8_grouped_mm_triton(a, sa, bt, sb, tile_b: int, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    _launch_check(a)
    m, k = a.shape
    g, n, _ = bt.shape
    c = empty((m, n), out_dtype, a.device)
    if m:  # rows past the last group (none in molds) are zero
        c.masked_fill_((torch.arange(m, device=a.device) >= offs[-1].to(torch.int64))[:, None], 0)
    if m and n and g:
        group, row0, row1 = _tile_map(offs, m, _BLOCK_M)
        grid = (len(group), -(-n // _BLOCK_N))
        grouped_block_scaled_mm_kernel[grid](a, bt, sa, sb, c, group, row0, row1, g, n, k, *a.stride(), *bt.stride(),
                                             *sa.stride(), *sb.stride(), *c.stride(), TILE_B=tile_b, BLOCK_M=_BLOCK_M,
                                             BLOCK_N=_BLOCK_N, BLOCK_K=TILE)
    return c


def fp8_grouped_wgrad_triton(at, sa, bt, sb, offs_padded: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    _launch_check(at)
    k, n = at.shape[0], bt.shape[0]
    g = len(offs_padded)
    c = empty((g, k, n), out_dtype, at.device)
    if c.numel():
        bounds = torch.cat([offs_padded.new_zeros(1), offs_padded])
        grid = (g, -(-k // _BLOCK_M), -(-n // _BLOCK_N))
        grouped_wgrad_kernel[grid](at, bt, sa, sb, c, bounds, k, n, *at.stride(), *bt.stride(), *sa.stride(),
                                   *sb.stride(), *c.stride(), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=TILE)
    return c


# ---------------------------------------------------------------- scaled_mm (Hopper)

_SCALED_MM_REFUSED: dict = {}  # kind of product -> why cuBLAS did not take it
_SCALED_MM_LAYOUT: dict = {}  # kind of product -> the index of the scale layout it took


def _kind(key) -> str:
    a, b, tile_b, k128, n128, k16, out = key
    k = "K a multiple of 128" if k128 else "K a multiple of 16" if k16 else "K not a multiple of 16"
    return (f"{str(a)[6:]} x {str(b)[6:]} -> {str(out)[6:]}, B in {tile_b}x128 tiles, {k}, "
            f"N {'' if n128 else 'not '}a multiple of 128")


def scaled_mm_report() -> dict:
    """Which kinds of block-scaled product this process gave cuBLAS (``scaled_mm``) and
    which it refused, with the reason: what a benchmark or the start line names."""
    return ({_kind(k): f"cuBLAS (scale layout {i})" for k, i in _SCALED_MM_LAYOUT.items()}
            | {_kind(k): f"Triton: cuBLAS refused ({why})" for k, why in _SCALED_MM_REFUSED.items()})


def _scale_b_layouts(sb: torch.Tensor, tile_b: int) -> list:
    """Bt's scales as torch's block-scaled product may want them. 128x128 blocks: [K/128, N/128]
    with strides (1, K/128), K/128 padded to a multiple of 4 (torch 2.11's
    ``_scaled_block1x128_block128x128`` checks ``round_up(ceil_div(K, 128), 4)`` rows: a
    2816-wide K has 22 blocks, 24 wanted; cuBLAS reads the first 22), or unpadded. 1x128
    tiles: [K/128, N] (ATen's main branch checks Bt's scales outer-dim-major), or [N, K/128]
    outer-dim-major (torch 2.11 checks that shape). Each index means the same layout
    whatever the shape (the layout kept for a kind of product is an index)."""
    if tile_b == TILE:
        nb, kb = sb.shape
        padded = sb.new_ones((nb, -(-kb // 4) * 4))
        padded[:, :kb] = sb
        return [padded.t(), sb.contiguous().t()]
    return [sb.t().contiguous(), sb.t().contiguous().t()]


def _agrees(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """cuBLAS's product against the Triton kernel's on the same operands: the same non-finite
    elements, the rest within 2^-6 of the largest (both accumulate each 128-wide block in the
    tensor cores and add the blocks in float32: they differ by 2^-9 of it at most, seen 2-3e-4
    on an H200; a scale read from the wrong block is off by the ratio of two scales)."""
    out, ref = out.float(), ref.float()
    finite = ref.isfinite()
    if not torch.equal(finite, out.isfinite()):
        return False, float("inf")
    if not bool(finite.any()):
        return True, 0.0
    err = float((out - ref)[finite].abs().max()) / max(float(ref[finite].abs().max()), 1e-30)
    return err <= 2**-6, err


def _scaled_mm(a, sa, bt, sb, tile_b: int, out_dtype):
    """cuBLAS's block-scaled FP8 product (A in 1x128 tiles; Bt in 128x128 blocks or 1x128
    tiles), or None where it does not take these operands (the reason said once per kind of
    product). torch checks the scales' layouts (``is_blockwise_*_scaling`` in ATen's
    ``ScaledBlas.cpp``): A's 1x128 scales outer-dim-major ([M, K/128] with strides (1, M)),
    Bt's as ``_scale_b_layouts`` tries them; B itself column-major (Bt contiguous). Which
    layouts a torch takes has changed between versions, and a layout it takes but reads
    otherwise would be silently wrong, so the first product of each kind is also run by the
    Triton kernel and kept only where the two agree (``_agrees``); the layout is then kept
    for that kind of product."""
    key = (a.dtype, bt.dtype, tile_b, a.shape[1] % TILE == 0, bt.shape[0] % TILE == 0, a.shape[1] % 16 == 0,
           out_dtype)
    if key in _SCALED_MM_REFUSED:
        return None
    st = getattr(F, "ScalingType", None)
    if st is None:
        _SCALED_MM_REFUSED[key] = "this torch has no torch.nn.functional.ScalingType"
        return None
    bt = bt.contiguous()  # (``_mm_op`` has made a CUDA operand contiguous already)
    scale_a = sa.t().contiguous().t()
    recipe_b = st.BlockWise128x128 if tile_b == TILE else st.BlockWise1x128
    layouts = _scale_b_layouts(sb, tile_b)
    known = key in _SCALED_MM_LAYOUT
    order = [_SCALED_MM_LAYOUT[key]] if known else range(len(layouts))
    reasons = []
    for i in order:
        try:
            out = F.scaled_mm(a.contiguous(), bt.t(), scale_a, st.BlockWise1x128, layouts[i], recipe_b,
                              output_dtype=out_dtype)
        except (RuntimeError, ValueError) as exc:
            reasons.append(" ".join(str(exc).split())[:160])
            continue
        if not known:  # (the float32 emulation where triton is not usable)
            check = fp8_mm_triton if runs_triton(a) else fp8_mm_reference
            ok, err = _agrees(out, check(a, sa, bt, sb, tile_b, out_dtype))
            if not ok:
                reasons.append(f"scale layout {i}: its result differs from the Triton kernel's (or the "
                               f"emulation's) on the same operands by {err:.3g} of the largest element")
                continue
        _SCALED_MM_LAYOUT[key] = i
        return out
    _SCALED_MM_REFUSED[key] = " / ".join(reasons)
    print(f"[molds] fp8: torch scaled_mm refused a block-scaled product ({str(a.dtype)[6:]} x {str(bt.dtype)[6:]}, "
          f"B in {tile_b}x128 tiles) of shape {tuple(a.shape)} x {tuple(bt.shape)} ({' / '.join(reasons)}); "
          f"the Triton kernel runs these", file=sys.stderr)
    return None


def _hopper(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) == (9, 0)


# ---------------------------------------------------------------- custom ops

def _fp8_units(t: torch.Tensor) -> bool:
    return t.is_cuda and fp8_matrix_units(t.device.index or 0)


def _mm(a, sa, bt, sb, tile_b: int, out_dtype: torch.dtype) -> torch.Tensor:
    if a.is_cuda and not bt.is_contiguous():  # an input gradient's transposed weight: cuBLAS takes B only
        # column-major, and a strided read of B in the Triton kernel costs ~5x the product (seen
        # on an H200: 1.5 ms at 4096^3); a copy of its codes costs one pass over N x K bytes,
        # and the square blocks' scales transpose with them
        bt, sb = bt.contiguous(), sb.contiguous()
    if _hopper(a) and torch.float8_e4m3fn in (a.dtype, bt.dtype):  # cuBLAS has no e5m2 x e5m2
        out = _scaled_mm(a, sa, bt, sb, tile_b, out_dtype)
        if out is not None:
            return out
    if runs_triton(a) and (not a.is_cuda or _fp8_units(a)):
        return fp8_mm_triton(a, sa, bt, sb, tile_b, out_dtype)
    return fp8_mm_reference(a, sa, bt, sb, tile_b, out_dtype)


@torch.library.custom_op("molds::fp8_mm", mutates_args=())
def _mm_op(a: torch.Tensor, sa: torch.Tensor, bt: torch.Tensor, sb: torch.Tensor, tile_b: int,
           out_dtype: torch.dtype) -> torch.Tensor:
    return _mm(a, sa, bt, sb, tile_b, out_dtype)


@_mm_op.register_fake
def _(a, sa, bt, sb, tile_b, out_dtype):
    return a.new_empty((a.shape[0], bt.shape[0]), dtype=out_dtype)


@torch.library.custom_op("molds::fp8_grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, sa: torch.Tensor, bt: torch.Tensor, sb: torch.Tensor, tile_b: int,
                   offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if runs_triton(a) and (not a.is_cuda or _fp8_units(a)):
        return fp8_grouped_mm_triton(a, sa, bt, sb, tile_b, offs, out_dtype)
    return fp8_grouped_mm_reference(a, sa, bt, sb, tile_b, offs, out_dtype)


@_grouped_mm_op.register_fake
def _(a, sa, bt, sb, tile_b, offs, out_dtype):
    return a.new_empty((a.shape[0], bt.shape[1]), dtype=out_dtype)


@torch.library.custom_op("molds::fp8_grouped_wgrad", mutates_args=())
def _grouped_wgrad_op(at: torch.Tensor, sa: torch.Tensor, bt: torch.Tensor, sb: torch.Tensor,
                      offs_padded: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if runs_triton(at) and (not at.is_cuda or _fp8_units(at)):
        return fp8_grouped_wgrad_triton(at, sa, bt, sb, offs_padded, out_dtype)
    return fp8_grouped_wgrad_reference(at, sa, bt, sb, offs_padded, out_dtype)


@_grouped_wgrad_op.register_fake
def _(at, sa, bt, sb, offs_padded, out_dtype):
    return at.new_empty((offs_padded.shape[0], at.shape[0], bt.shape[0]), dtype=out_dtype)


def fp8_mm(a, sa, bt, sb, tile_b: int, out_dtype: torch.dtype) -> torch.Tensor:
    """A @ Bt^T of quantized operands (A [M, K] in 1x128 tiles, Bt [N, K] in ``tile_b`` x 128)."""
    if eager_launch(a, sa, bt, sb):  # past the custom op's dispatch (``fp8.eager_launch``)
        return _mm(a, sa, bt, sb, tile_b, out_dtype)
    return _mm_op(a, sa, bt, sb, tile_b, out_dtype)


def fp8_grouped_mm(a, sa, bt, sb, tile_b: int, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per group g (rows up to ``offs[g]``): A[rows] @ Bt[g]^T; Bt [G, N, K] in ``tile_b`` x 128."""
    return _grouped_mm_op(a, sa, bt, sb, tile_b, offs, out_dtype)


def fp8_grouped_wgrad(at, sa, bt, sb, offs_padded: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per group g: At[:, g's columns] @ Bt[:, g's columns]^T -> [G, K, N]; At [K, Mp] and Bt
    [N, Mp] in 1x128 tiles of the padded layout (``pad_groups``)."""
    return _grouped_wgrad_op(at, sa, bt, sb, offs_padded, out_dtype)
