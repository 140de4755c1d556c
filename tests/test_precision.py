"""trainer.precision resolved by measurement (molds.recipe.precision): ``auto`` takes bf16 only
where a bf16 matrix product of the model's shape measured faster than fp32; the ranks
agree; an explicit choice that measured slower runs and is said; the peak a CPU's MFU is
taken against is that measurement."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from molds.recipe.precision import Precision, gemm_shape, matmul_rate, resolve_precision
from molds.runtime.lifecycle import cpu_description

CPU = torch.device("cpu")
SHAPE = (256, 64, 192)


def _stub(fp32: float, bf16: float):
    calls = []

    def measure(dtype, shape, device, seconds=0.05):
        calls.append((dtype, shape))
        return bf16 if dtype == torch.bfloat16 else fp32

    return measure, calls


@pytest.mark.parametrize("fp32,bf16,want", [(100.0, 480.0, torch.bfloat16), (100.0, 2.4, None), (50.0, 50.0, None)],
                         ids=["bf16-faster", "fp32-faster", "tie"])
def test_auto_takes_bf16_only_where_it_measured_faster(fp32, bf16, want):
    measure, calls = _stub(fp32, bf16)
    p = resolve_precision("auto", CPU, SHAPE, measure=measure)
    assert p.dtype == want and p.warning() is None
    assert [str(d) for d, _ in calls] == ["torch.float32", "torch.bfloat16"] * 3 and calls[0][1] == SHAPE
    assert p.peak_gflops == (bf16 if want is torch.bfloat16 else fp32)
    assert f"bf16 {bf16:,.1f} and fp32 {fp32:,.1f} GFLOP/s" in p.describe()


def test_a_slow_spell_during_the_measurement_does_not_decide():
    """The rounds alternate and the fastest of each dtype counts: a round slowed by another
    job (here fp32's first, by 20x) does not turn the choice."""
    seen = {torch.float32: iter([5.0, 100.0, 98.0]), torch.bfloat16: iter([60.0, 61.0, 59.0])}

    def measure(dtype, shape, device, seconds=0.05):
        return next(seen[dtype])

    p = resolve_precision("auto", CPU, SHAPE, measure=measure)
    assert p.dtype is None and (p.fp32_gflops, p.bf16_gflops) == (100.0, 61.0)


def test_an_explicit_choice_runs_and_says_when_it_measured_slower():
    measure, _ = _stub(100.0, 2.5)
    p = resolve_precision("bf16", CPU, SHAPE, measure=measure)
    assert p.dtype == torch.bfloat16 and p.peak_gflops == 2.5
    assert "40.0x slower than fp32" in p.warning() and "'auto' would take fp32" in p.warning()
    measure, _ = _stub(100.0, 480.0)
    p = resolve_precision("fp32", CPU, SHAPE, measure=measure)
    assert p.dtype is None and "4.8x faster" in p.warning()


def test_the_ranks_decide_on_their_mean_rates():
    """Two ranks that measured on either side of the line take the same precision."""
    per_rank = [[100.0, 90.0], [100.0, 130.0]]  # fp32, bf16 of each rank

    def agree(rates):
        return [sum(r[i] for r in per_rank) / len(per_rank) for i in range(2)]

    choices = set()
    for fp32, bf16 in per_rank:
        measure, _ = _stub(fp32, bf16)
        choices.add(resolve_precision("auto", CPU, SHAPE, agree=agree, measure=measure).dtype)
    assert choices == {torch.bfloat16}  # mean bf16 110 > fp32 100


def test_on_this_machine_the_choice_follows_the_measured_rates():
    p = resolve_precision("auto", CPU, SHAPE)
    assert p.fp32_gflops > 0 and p.bf16_gflops > 0
    assert (p.dtype == torch.bfloat16) == (p.bf16_gflops > p.fp32_gflops)
    assert cpu_description() in p.describe()
    assert p.cpu_class == ("bf16-native" if p.bf16_gflops > p.fp32_gflops else "fp32-only")


def test_without_native_bf16_auto_takes_fp32():
    """oneDNN limited to AVX2 (what a CPU without AVX-512 BF16 or AMX has) emulates bf16
    products: ``auto`` measures that and takes fp32, on either class of machine."""
    code = ("import torch; from molds.recipe.precision import resolve_precision; "
            "p = resolve_precision('auto', torch.device('cpu'), (256, 64, 192)); print(p.name, p.describe())")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2",
               OMP_NUM_THREADS="1")  # as each torchrun rank runs; two threads on a busy 2-core machine wait on each other
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("fp32 "), out.stdout


def test_the_measured_shape_is_the_models_and_the_timing_is_short():
    from molds.recipe.parse import parse_recipe

    recipe = parse_recipe(["--recipe", os.path.join(os.path.dirname(__file__), "..", "recipes", "cpu_moses.json")])
    assert gemm_shape(recipe) == (1024, 192, 512)  # 16 x 256 tokens capped at 1,024; 8/3 x 192 -> 512
    import time

    start = time.perf_counter()
    assert matmul_rate(torch.float32, (1024, 192, 512), CPU) > 0
    assert time.perf_counter() - start < 2.0


def test_a_cpu_runs_mfu_against_the_measured_rate():
    from molds.metrics.logger import device_peak_tflops

    p = Precision("auto", None, 100.0, 3.0, SHAPE, "cpu")
    peak, text = device_peak_tflops(CPU, None, p)
    assert peak == pytest.approx(0.1) and "measured fp32 matrix rate" in text
    assert device_peak_tflops(CPU, 2.0, p) == (2.0, "logging.peak_tflops=2.0")


@pytest.mark.parametrize("asked,resumed,want,kept", [
    ("auto", "float32", None, True), ("auto", "bfloat16", torch.bfloat16, True),
    ("bf16", "float32", torch.bfloat16, False), ("fp32", "bfloat16", None, False),
    ("auto", "float16", torch.bfloat16, False), ("auto", None, torch.bfloat16, False)],
    ids=["auto-keeps-fp32", "auto-keeps-bf16", "explicit-bf16", "explicit-fp32", "unknown-dtype", "no-lineage"])
def test_a_resume_keeps_its_runs_precision_unless_told(asked, resumed, want, kept):
    """On a resume ``auto`` keeps what the checkpoint's run computed in (here against a
    measurement that says bf16); an explicit choice, or a lineage naming no dtype molds
    computes in, goes by the usual rule."""
    measure, _ = _stub(100.0, 480.0)
    p = resolve_precision(asked, CPU, SHAPE, measure=measure, resumed=resumed)
    assert (p.dtype, p.kept) == (want, kept)
    assert ("kept from the checkpoint's run" in p.describe()) == kept
    assert p.peak_gflops == (480.0 if want is torch.bfloat16 else 100.0)  # MFU against the rate it runs at
