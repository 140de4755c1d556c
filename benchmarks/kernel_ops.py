"""molds' kernels (``kernels.fp8``, ``kernels.triton``) against their references and peers.

    python benchmarks/kernel_ops.py [--rounds 5] [--quick]

(Not ``kernels.py``: a script of that name, with ``benchmarks/`` on the path, shadows Hugging
Face's ``kernels`` package, which transformers imports, and every script here that imports
transformers would fail.)

Each op runs forward + backward (quantization: forward only) on the shapes below, and is
timed against its plain-PyTorch reference in the same run, alternating the two so a
machine's drift hits both; median of ``--rounds`` (``*_s``: one call, the host's overhead and a
synchronization included). On a GPU also the device time of a call within a stream of calls
(``*_device_s``: triton.testing.do_bench, as Liger Kernel and torchao time their kernels),
which the fractions of the bandwidth are taken from. Memory: on a GPU the peak bytes
allocated during the pass above what was there before (``*_peak_mb``); on a CPU, where
torch keeps no allocator statistics, the activation memory the pass holds from its
forward for its backward (``*_saved_mb``).

On a CPU (no Triton there: the ops take their PyTorch paths) it answers what switching a
kernel on costs a CPU user: each op's CPU path against its eager reference, and the FP8
linear's CPU path (block quantization and an emulated float32 product) against the BF16
and float32 linears.

On a GPU it adds, per op: Liger Kernel's version where it has one (RMSNorm, SwiGLU, fused
linear + cross-entropy: ``kernels.fused_backend``) and torchao's tensor-wise and row-wise
Float8 linears (``kernels.fp8_recipe``), and the physical limit: the bytes an op must
move over the measured HBM bandwidth (a device-to-device copy), the FLOPs of a product
over the measured BF16 / FP8 matrix rate. Targets (issue 43): memory-bound ops at >= 80 %
of the bandwidth, at least Liger's speed, the FP8 linear >= 1.2x the BF16 linear at
4096^3.

Prints one JSON line (the last line of output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_name() -> str:
    from molds.runtime.lifecycle import cpu_description

    return cpu_description()


# ---------------------------------------------------------------- measuring

def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_pass(fn, device, rounds: int) -> list[float]:
    """Seconds per call of ``fn``, one per round (after one untimed call)."""
    fn()
    _sync(device)
    out = []
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def device_time(fn, device) -> float | None:
    """A CUDA device: the median device time of one call of ``fn`` among a stream of them
    (triton.testing.do_bench: CUDA events around each call, the L2 cache flushed between
    calls, the host enqueueing ahead as in a training step), seconds. What a kernel costs
    the GPU; ``time_pass`` is what one call costs the caller, host overhead and synchronization
    included. None on a CPU."""
    if device.type != "cuda":
        return None
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3


def peak_bytes(fn, device) -> int:
    """A CUDA device: the peak bytes allocated by one call of ``fn`` above what was there
    before. A CPU (torch keeps no allocation statistics there): the bytes of the tensors
    autograd holds from the forward for the backward (activation memory), each storage once,
    the inputs' own storage not counted."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return saved_tensor_bytes(fn, getattr(fn, "leaves", ()))[0]


def saved_tensor_bytes(fn, exclude=()) -> tuple[int, object]:
    """The bytes of the tensors autograd holds from ``fn()``'s forward for its backward
    (activation memory, compiled regions' included), each storage once, the storages of
    ``exclude`` (inputs, weights) not counted; and what ``fn`` returned."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    held = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(held.values()), out


def compare(name, ours, theirs, device, rounds, results, label="reference"):
    """Time ``ours`` and ``theirs`` alternately; record medians, their ratio and peaks."""
    a, b = [], []
    for _ in range(rounds):
        a += time_pass(ours, device, 1)
        b += time_pass(theirs, device, 1)
    ta, tb = statistics.median(a), statistics.median(b)
    results[f"{name}_s"] = ta
    results[f"{name}_{label}_s"] = tb
    results[f"{name}_speedup_over_{label}"] = tb / ta
    da, db = device_time(ours, device), device_time(theirs, device)
    if da is not None:
        results[f"{name}_device_s"] = da
        results[f"{name}_{label}_device_s"] = db
        results[f"{name}_device_speedup_over_{label}"] = db / da
    kind = "peak" if device.type == "cuda" else "saved"
    results[f"{name}_{kind}_mb"] = peak_bytes(ours, device) / 2**20
    results[f"{name}_{label}_{kind}_mb"] = peak_bytes(theirs, device) / 2**20
    return ta if da is None else da


def fwd_bwd(fn, inputs):
    """A closure running ``fn`` forward and backward on fresh leaves of ``inputs``."""
    import torch

    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]

    def run():
        for t in leaves:
            t.grad = None
        y = fn(*leaves)
        y.backward(torch.ones_like(y) if y.dim() else None)

    run.leaves = leaves
    return run


# ---------------------------------------------------------------- the ops

def bench_ops(device, dtype, sizes, rounds, results, gpu):
    import torch
    import torch.nn.functional as F

    from molds.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
    from molds.kernels.fp8 import fp8_quantize, fp8_quantize_both
    from molds.kernels.moe_permute import moe_permute, moe_unpermute, permute_reference, unpermute_reference
    from molds.kernels.rmsnorm import fused_rms_norm, rms_norm_reference
    from molds.kernels.swiglu import fused_swiglu, swiglu_reference

    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    el = dtype.itemsize
    bandwidth = results.get("hbm_bytes_per_s")
    floors = {}

    # quantization: read x once, write codes and scales
    m, k = sizes["quantize"]
    x = randn(m, k)
    one = lambda: fp8_quantize(x, "e4m3", 1)  # noqa: E731
    both = lambda: fp8_quantize_both(x, "e4m3")  # noqa: E731  (the linear's: both layouts, one read)
    results["fp8_quantize_1x128_s"] = t = min(time_pass(one, device, rounds))
    results["fp8_quantize_both_s"] = t2 = min(time_pass(both, device, rounds))
    if gpu:
        results["fp8_quantize_1x128_device_s"] = t = device_time(one, device)
        results["fp8_quantize_both_device_s"] = t2 = device_time(both, device)
    scales = m * -(-k // 128) * 4
    floors["fp8_quantize_1x128"] = (m * k * (el + 1) + scales, t)
    floors["fp8_quantize_both"] = (m * k * (el + 2) + scales + k * -(-m // 128) * 4, t2)

    n, h = sizes["rms_norm"]
    x, w = randn(n, h), randn(h)
    t = compare("rms_norm", fwd_bwd(lambda x, w: fused_rms_norm(x, w, 1e-6), [x, w]),
                fwd_bwd(lambda x, w: rms_norm_reference(x, w, 1e-6), [x, w]), device, rounds, results)
    floors["rms_norm"] = (n * h * el * 5, t)  # x, y forward; x, dy, dx backward

    n, h = sizes["swiglu"]
    a, b = randn(n, h), randn(n, h)
    t = compare("swiglu", fwd_bwd(fused_swiglu, [a, b]), fwd_bwd(swiglu_reference, [a, b]), device, rounds, results)
    floors["swiglu"] = (n * h * el * 8, t)  # gate, up, y; gate, up, dy, dgate, dup

    tokens, h, experts, topk = sizes["permute"]
    scores = torch.rand(tokens, experts, generator=g, device=device)
    top_w, top_e = torch.topk(scores, topk, dim=-1)
    order = torch.argsort(top_e.reshape(-1), stable=True)
    token_of, weight_of = order // topk, (top_w / top_w.sum(-1, keepdim=True)).reshape(-1)[order].to(dtype)
    y, rows = randn(tokens, h), randn(len(token_of), h)
    t = compare("moe_permute", fwd_bwd(lambda y: moe_permute(y, token_of), [y]),
                fwd_bwd(lambda y: permute_reference(y, token_of), [y]), device, rounds, results)
    floors["moe_permute"] = (2 * (tokens + len(token_of)) * h * el, t)
    t = compare("moe_unpermute", fwd_bwd(lambda r, w: moe_unpermute(r, token_of, w, tokens), [rows, weight_of]),
                fwd_bwd(lambda r, w: unpermute_reference(r, token_of, w, tokens), [rows, weight_of]),
                device, rounds, results)
    floors["moe_unpermute"] = ((3 * len(token_of) + 2 * tokens) * h * el, t)

    tokens, h, vocab = sizes["linear_cross_entropy"]
    hidden, weight = randn(tokens, h), randn(vocab, h, scale=0.02)
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    compare("linear_cross_entropy", fwd_bwd(lambda a, b: linear_cross_entropy(a, b, targets), [hidden, weight]),
            fwd_bwd(lambda a, b: linear_cross_entropy_reference(a, b, targets), [hidden, weight]), device, rounds,
            results)

    if gpu:
        if bandwidth:
            for name, (nbytes, seconds) in floors.items():
                results[f"{name}_fraction_of_bandwidth"] = nbytes / seconds / bandwidth
        _liger(device, dtype, sizes, rounds, results, randn, targets)


def _liger(device, dtype, sizes, rounds, results, randn, targets):
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        results["liger"] = "not installed (pip install liger-kernel)"
        return
    from molds.kernels.cross_entropy import linear_cross_entropy
    from molds.kernels.rmsnorm import fused_rms_norm
    from molds.kernels.swiglu import fused_swiglu

    n, h = sizes["rms_norm"]
    x, w = randn(n, h), randn(h)
    compare("rms_norm", fwd_bwd(lambda x, w: fused_rms_norm(x, w, 1e-6), [x, w]),
            fwd_bwd(lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6), [x, w]), device, rounds, results, "liger")
    n, h = sizes["swiglu"]
    a, b = randn(n, h), randn(n, h)
    compare("swiglu", fwd_bwd(fused_swiglu, [a, b]), fwd_bwd(LigerSiLUMulFunction.apply, [a, b]), device, rounds,
            results, "liger")
    tokens, h, vocab = sizes["linear_cross_entropy"]
    hidden, weight = randn(tokens, h), randn(vocab, h, scale=0.02)
    compare("linear_cross_entropy", fwd_bwd(lambda a, b: linear_cross_entropy(a, b, targets), [hidden, weight]),
            fwd_bwd(lambda a, b: LigerFusedLinearCrossEntropyFunction.apply(a, b, targets)[0], [hidden, weight]),
            device, rounds, results, "liger")


def bench_fp8(device, sizes, rounds, results, gpu):
    """The FP8 linear and expert GEMMs against BF16 (and float32 on a CPU)."""
    import torch
    import torch.nn.functional as F

    from molds.kernels.fp8_linear import fp8_grouped_mm, fp8_linear

    g = torch.Generator(device=device).manual_seed(0)
    m, k, n = sizes["fp8_linear"]
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02)  # master weights in float32
    flops = 6 * m * k * n  # forward and both backward products
    ours = fwd_bwd(lambda x, w: fp8_linear(x, w), [x, w])
    with torch.autocast(device.type, dtype=torch.bfloat16):
        t = compare("fp8_linear", ours, fwd_bwd(lambda x, w: F.linear(x, w), [x, w]), device, rounds, results,
                    "bf16_linear")
    results["fp8_linear_tflops"] = flops / t / 1e12
    if not gpu:
        compare("fp8_linear", ours, fwd_bwd(lambda x, w: F.linear(x, w), [x.float(), w]), device, rounds, results,
                "fp32_linear")
    tokens, hidden, width, experts = sizes["fp8_experts"]
    counts = torch.full((experts,), tokens // experts)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(device)
    xe = torch.randn(int(counts.sum()), hidden, generator=g, device=device).to(torch.bfloat16)
    we = torch.randn(experts, hidden, width, generator=g, device=device) * 0.02
    with torch.autocast(device.type, dtype=torch.bfloat16):
        compare("fp8_experts", fwd_bwd(lambda a, b: fp8_grouped_mm(a, b, offs=offs), [xe, we]),
                fwd_bwd(lambda a, b: F.grouped_mm(a, b.to(torch.bfloat16), offs=offs), [xe, we]), device, rounds,
                results, "bf16_grouped_mm")
    rowwise = _rowwise_grouped(device)
    if rowwise is not None:  # torchao's row-wise grouped GEMM (kernels.fp8_experts), emulated off a Hopper GPU
        results["fp8_rowwise_experts_path"] = "torchao" if rowwise.hardware else "emulated"
        with torch.autocast(device.type, dtype=torch.bfloat16):
            compare("fp8_rowwise_experts", fwd_bwd(lambda a, b: rowwise(a, b, offs=offs), [xe, we]),
                    fwd_bwd(lambda a, b: F.grouped_mm(a, b.to(torch.bfloat16), offs=offs), [xe, we]), device, rounds,
                    results, "bf16_grouped_mm")
    if gpu:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            e4m3 = fwd_bwd(lambda x, w: fp8_linear(x, w, grad_format="e4m3"), [x, w])
            results["fp8_linear_e4m3_grads_s"] = statistics.median(time_pass(e4m3, device, rounds))
            results["fp8_linear_e4m3_grads_device_s"] = device_time(e4m3, device)
            results["fp8_linear_e4m3_grads_device_speedup_over_bf16_linear"] = (
                results["fp8_linear_bf16_linear_device_s"] / results["fp8_linear_e4m3_grads_device_s"])
        _fp8_linear_parts(device, x, w, rounds, results)
        _torchao(device, x, w, rounds, results)


def _rowwise_grouped(device):
    """``kernels.fp8_experts``' grouped GEMM for ``device`` (None: torchao is not installed)."""
    try:
        from molds.kernels.fp8_torchao import RowwiseGroupedMM, grouped_fp8_units
    except ImportError:
        return None
    return RowwiseGroupedMM(hardware=grouped_fp8_units(device))


def _fp8_linear_parts(device, x, w, rounds, results):
    """Where the FP8 linear's time goes, for each gradient format: each quantization and each
    product of one forward and backward timed alone (``fp8_linear_<fmt>_part_*_s``; medians;
    with the device time, ``*_device_s``), and which path each kind of product took (cuBLAS's
    ``scaled_mm`` or the Triton kernel, with the reason: ``fp8_linear_products``)."""
    import torch

    from molds.kernels.fp8 import fp8_quantize, fp8_quantize_both
    from molds.kernels.fp8_gemm import fp8_mm, scaled_mm_report

    g = torch.randn(x.shape[0], w.shape[0], device=device).to(torch.bfloat16)
    qx, sx, qxt, sxt = fp8_quantize_both(x, "e4m3")
    qw, sw = fp8_quantize(w, "e4m3", 128)
    for fmt in ("e5m2", "e4m3"):
        qg, sg, qgt, sgt = fp8_quantize_both(g, fmt)
        parts = {"quantize_x_both": lambda: fp8_quantize_both(x, "e4m3"),
                 "quantize_w": lambda: fp8_quantize(w, "e4m3", 128),
                 "forward_mm": lambda: fp8_mm(qx, sx, qw, sw, 128, torch.bfloat16),
                 "quantize_grad_both": lambda fmt=fmt: fp8_quantize_both(g, fmt),
                 "input_grad_mm": lambda qg=qg, sg=sg: fp8_mm(qg, sg, qw.t(), sw.t(), 128, torch.bfloat16),
                 "weight_grad_mm": lambda qgt=qgt, sgt=sgt: fp8_mm(qgt, sgt, qxt, sxt, 1, torch.float32)}
        for name, fn in parts.items():
            results[f"fp8_linear_{fmt}_part_{name}_s"] = statistics.median(time_pass(fn, device, rounds))
            t = device_time(fn, device)
            if t is not None:
                results[f"fp8_linear_{fmt}_part_{name}_device_s"] = t
    results["fp8_linear_products"] = scaled_mm_report()


def _torchao(device, x, w, rounds, results):
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        results["torchao"] = "not installed (pip install torchao)"
        return
    import torch

    from torchao.float8 import Float8LinearConfig

    from molds.kernels.fp8_linear import fp8_linear

    for recipe in ("tensorwise", "rowwise"):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=device)
        with torch.no_grad():
            lin.weight.copy_(w)
        # a bare Linear is returned converted, not swapped in place
        lin = convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(recipe))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            compare("fp8_linear", fwd_bwd(lambda x, w: fp8_linear(x, w), [x, w]), fwd_bwd(lin, [x]), device, rounds,
                    results, f"torchao_float8_{recipe}")
            results[f"torchao_float8_{recipe}_over_bf16_linear"] = (results["fp8_linear_bf16_linear_s"]
                                                                   / results[f"fp8_linear_torchao_float8_{recipe}_s"])


def hardware_limits(device, results, copy_elements: int = 1 << 28, side: int = 8192):
    """Measured memory bandwidth (a device-to-device copy of ``copy_elements`` float32, read
    + write) and matrix rates (BF16 at ``side``^3; FP8 where the GPU has FP8 matrix units),
    best of 5."""
    import torch

    a = torch.empty(copy_elements, device=device)
    b = torch.empty_like(a)
    t = min(time_pass(lambda: b.copy_(a), device, 5))
    results["hbm_bytes_per_s"] = 2 * a.numel() * 4 / t
    del a, b
    x = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    t = min(time_pass(lambda: x @ x, device, 5))
    results["bf16_matmul_tflops"] = 2 * side**3 / t / 1e12
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        q = x.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        t = min(time_pass(lambda: torch._scaled_mm(q, q.t(), one, one, out_dtype=torch.bfloat16), device, 5))
        results["fp8_matmul_tflops"] = 2 * side**3 / t / 1e12


CPU_SIZES = {"quantize": (2048, 2048), "rms_norm": (4096, 512), "swiglu": (4096, 1024),
             "permute": (4096, 256, 64, 8), "linear_cross_entropy": (2048, 256, 8192),
             "fp8_linear": (1024, 1024, 1024), "fp8_experts": (4096, 256, 128, 16)}
GPU_SIZES = {"quantize": (8192, 8192), "rms_norm": (16384, 4096), "swiglu": (16384, 8192),
             "permute": (16384, 2048, 64, 8), "linear_cross_entropy": (8192, 4096, 32768),
             "fp8_linear": (4096, 4096, 4096), "fp8_experts": (32768, 2048, 1024, 64)}
QUICK_SIZES = {"quantize": (256, 300), "rms_norm": (64, 96), "swiglu": (64, 96), "permute": (64, 32, 8, 2),
               "linear_cross_entropy": (64, 32, 100), "fp8_linear": (64, 128, 96), "fp8_experts": (128, 64, 32, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (checks that the script runs)")
    args = ap.parse_args()
    import torch

    import molds.kernels.launch  # noqa: F401  (sets TRITON_INTERPRET on a machine without a GPU)

    from molds.kernels import fp8_gemm_path
    from molds.kernels.launch import describe

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    torch.set_num_threads(os.cpu_count() or 1)
    sizes = QUICK_SIZES if args.quick else GPU_SIZES if gpu else CPU_SIZES
    results = {"device": torch.cuda.get_device_name() if gpu else "cpu", "cpu": cpu_name(),
               "torch": torch.__version__, "triton_ops": describe(device), "fp8_products": fp8_gemm_path(device),
               "sizes": sizes, "rounds": args.rounds}
    if gpu:
        hardware_limits(device, results)
    dtype = torch.bfloat16 if gpu else torch.float32
    bench_ops(device, dtype, sizes, args.rounds, results, gpu)
    bench_fp8(device, sizes, args.rounds, results, gpu)
    if gpu and "fp8_matmul_tflops" in results:
        results["fp8_linear_fraction_of_fp8_rate"] = results["fp8_linear_tflops"] / results["fp8_matmul_tflops"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
