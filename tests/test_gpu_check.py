"""benchmarks/gpu_check.py, the command a GPU window runs, tried here on CPU ranks at toy
sizes (``--dry-run``) so that it is never untried code when a GPU is lent. The figures a dry
run prints mean nothing; what is checked is that every section ran and reported what the
issue asks of it, checked against what each piece must add up to."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from tests.benchmark_scripts import benchmark_script

#: the dry run is the module fixture's set-up, counted in the first test's time: above
#: .ci/run's 1,200 s a test: only a hang guard, the dry run itself is not timed
pytestmark = pytest.mark.timeout(1800)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def _gpu_check():
    return benchmark_script("gpu_check")


def _run(args, cwd, timeout=900):
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_check")
    out = d / "out"
    # no --budget-s: a dry run times out no section (time bounds belong to the GPU run and the
    # benchmarks; the test holds the dry run to what it must produce); the subprocess's and
    # the module's timeouts only end a hang
    proc = _run(["--dry-run", "--out", str(out), "--commit", "abc123"], d, timeout=1700)
    return proc, out


def _why(proc, out) -> str:
    """A failed dry run's sections as its JSON has them (each one's status, failures and log
    tail: the JSON line itself runs to many thousand characters), else the output's tail."""
    try:
        sections = json.load(open(out / "gpu_check.json"))["sections"]
    except (OSError, ValueError, KeyError):
        return proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.dumps({k: v for k, v in sections.items() if v.get("status") != "ok"}, indent=1)[-8000:] + \
        "\n" + proc.stderr[-2000:]


def test_the_dry_run_runs_every_section_and_ends_with_its_json(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, _why(proc, out)
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.load(open(out / "gpu_check.json"))
    gc = _gpu_check()
    assert list(line["sections"]) == gc.SECTIONS
    assert all(s["status"] == "ok" for s in line["sections"].values()), line["sections"]
    assert line["dry_run"] is True and line["commit"] == "abc123"
    assert line["budget_s"] is None
    # OUT holds what the device tool carries back: at most 8 files, 2 folders down at most
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log"]
    log = open(out / "gpu_check.log").read()
    assert "----- training run moe_fp8" in log and "----- pytest tests/kernels" in log
    env = line["environment"]
    assert env["versions"]["torch"] and env["versions"]["deepspeed"] and env["bf16_matmul_tflops"] > 0
    assert env["hbm_bytes_per_s"] > 0
    assert set(line["targets"]) >= {"fp8_linear_4096_over_bf16", "fp8_real_shapes_over_bf16", "dense_zero3_mfu",
                                    "lm_head_memory_over_liger", "rms_norm_over_liger"}
    assert line["targets"]["fp8_real_shapes_over_bf16"]["value"] == line["real_shapes"]["fp8_over_bf16"]


def test_every_training_run_trained_and_reports_its_figures(dry_run):
    proc, out = dry_run
    training = json.load(open(out / "gpu_check.json"))["training"]
    names = [n for n, recipe, _ in _gpu_check().training_runs(True) if recipe]
    assert sorted(training["runs"]) == sorted(names)
    for name in names:
        r = training["runs"][name]
        assert r["rc"] == 0 and r["steps"] == 3, (name, r.get("error_tail"))
        assert sorted(map(int, r["loss"])) == [1, 2, 3] and all(math.isfinite(v) for v in r["loss"].values())
        assert r["tokens_per_s"] > 0 and r["peak_memory_mb"] > 0, (name, r)
        assert any(" parameters on " in s for s in r["start_lines"]), r["start_lines"]
        # what it logged is what came back: the same losses as the run's own metrics file
        rows = [json.loads(x) for x in open(f"{out}-work/logs/{name}.metrics.jsonl")]
        assert {str(x["step"]): x["train/loss"] for x in rows if "train/loss" in x} == r["loss"]
    assert any("fp8:" in s for s in training["runs"]["moe_fp8"]["start_lines"])
    assert any("triton:" in s for s in training["runs"]["moe_triton"]["start_lines"])
    assert not any("fp8:" in s or "triton:" in s for s in training["runs"]["moe_kernels_off"]["start_lines"])
    # the MFU target's model on both engines
    assert any(" parameters on zero " in s for s in training["runs"]["dense_zero3"]["start_lines"])
    assert any(" parameters on ddp " in s for s in training["runs"]["dense_zero3_ddp"]["start_lines"])
    assert not os.path.exists(f"{out}-work/runs/dense_zero3")  # removed once read: a GPU machine's disk is small


def test_fp32_parity_compares_the_same_steps_on_both_sides(dry_run):
    proc, out = dry_run
    parity = json.load(open(out / "gpu_check.json"))["training"]["fp32_parity"]
    gc = _gpu_check()
    assert parity["device_rc"] == 0 and parity["cpu_rc"] == 0
    assert parity["steps"] == gc.PARITY_STEPS and parity["within_bound"] is True
    # a dry run's "device" is the CPU too (under the launcher): fp32 on both sides, the same steps
    # on the same batches. Only the summation order may differ (the launcher's rank can get another
    # thread count), so the losses agree to float32 rounding, far inside what another batch would move
    dev, cpu = parity["device_loss"], parity["cpu_loss"]
    assert sorted(dev) == sorted(cpu) and len(cpu) == gc.PARITY_STEPS
    assert all(math.isclose(dev[s], cpu[s], rel_tol=1e-5) for s in cpu), (dev, cpu)


def test_compare_losses_holds_each_step_to_the_bounds():
    gc = _gpu_check()
    base = {s: 3.0 - 0.1 * s for s in range(1, gc.PARITY_STEPS + 1)}
    assert gc.compare_losses(base, dict(base))["within_bound"]
    first_off = base | {1: base[1] * (1 + 3 * gc.PARITY_FIRST_RTOL)}
    assert not gc.compare_losses(first_off, base)["within_bound"]
    late_off = base | {4: base[4] * (1 + 3 * gc.PARITY_RTOL)}
    assert not gc.compare_losses(late_off, base)["within_bound"]
    short = {s: v for s, v in base.items() if s < gc.PARITY_STEPS}
    assert not gc.compare_losses(short, base)["within_bound"]  # a run that stopped early is no match


def test_real_shapes_and_dualpipev_costs(dry_run):
    proc, out = dry_run
    line = json.load(open(out / "gpu_check.json"))
    shapes = line["real_shapes"]
    assert set(shapes["variants"]) == {"bf16", "bf16_triton", "bf16_triton_molds", "fp8", "fp8_triton",
                                         "fp8_rowwise", "fp8_tensorwise", "fp8_rowwise_experts"}
    v = shapes["variants"]
    assert shapes["fp8_over_bf16"] == pytest.approx(v["fp8"]["tokens_per_s"] / v["bf16"]["tokens_per_s"])
    for name, r in v.items():
        assert r["tokens_per_s"] == pytest.approx(shapes["tokens"] / r["s"])
    assert any(k.startswith("linear_q_") for k in shapes["fp8_over_bf16_products"])
    assert any(k.startswith("experts_") for k in shapes["fp8_over_bf16_products"])
    assert any(k.startswith("experts_rowwise_") for k in shapes["fp8_over_bf16_products"])
    # the width sweep: a square and an MLP-shaped linear at each hidden size, both gradient formats
    sweep = [k for k in shapes["fp8_over_bf16_products"] if k.startswith(("linear_e4m3_", "linear_e5m2_"))]
    assert {k.split("_")[1] for k in sweep} == {"e4m3", "e5m2"} and len(sweep) == 2 * 2 * 2  # hidden 64 and 128

    dp = line["dualpipev"]
    layers = dp["layers"]
    assert list(layers)[0] == "embed" and list(layers)[-1] == "head_loss"
    # the smoke twin's 4 blocks (one dense, three MoE): the first 3 timed, the 4th given the
    # median of the timed MoE blocks
    blocks = [layers[f"layer{i}"] for i in range(4)]
    assert dp["measured_layers"] == 3 and len(layers) == 4 + 3
    assert [b["measured"] for b in blocks] == [True, True, True, False]
    for key in ("F", "B", "I", "W", "FB", "params"):
        assert blocks[3][key] == pytest.approx(statistics.median([blocks[1][key], blocks[2][key]]))
    for layer in layers.values():
        assert all(layer[k] >= 0 for k in ("F", "B", "I", "W", "FB")) and layer["F"] > 0
    for p in (2, 4, 8):
        row = dp["schedules"][f"p{p}"]
        for name, stages in (("1f1b", p), ("stock_dualpipev", 2 * p), ("dualpipev", 2 * p)):
            sched = row[name]
            assert len(sched["stage_costs"]) == stages and sched["step_s"] > 0 and 0 <= sched["bubble"] < 1
            for key in ("F", "B", "I", "W", "FB"):  # each layer in exactly one stage
                assert sum(s[key] for s in sched["stage_costs"]) == pytest.approx(sum(x[key] for x in layers.values()))
            # no schedule beats doing every micro-batch's work on the busiest stage alone
            busiest = max(s["F"] + s["B"] for s in sched["stage_costs"])
            assert sched["step_s"] >= row["micro_batches"] * busiest * (1 - 1e-9) or name == "dualpipev"
        assert row["dualpipev_over_stock"] == pytest.approx(row["dualpipev"]["step_s"] / row["stock_dualpipev"]["step_s"])


def test_kernel_tests_and_benchmarks_sections(dry_run):
    proc, out = dry_run
    line = json.load(open(out / "gpu_check.json"))
    kt = line["kernel_tests"]
    assert kt["rc"] == 0 and kt["passed"] >= 1 and kt["failed"] == 0 and kt["failures"] == []
    assert line["kernel_benchmarks"]["rms_norm_s"] > 0


def test_parse_pytest_counts_outcomes_and_names_failures_in_cut_output():
    gc = _gpu_check()
    text = ("tests/kernels/test_fp8.py::test_a[1] PASSED                [ 10%]\n"
            "tests/kernels/test_fp8.py::test_b FAILED                   [ 20%]\n"
            "tests/kernels/test_fused.py::test_c SKIPPED (no gpu)       [ 30%]\n"
            "tests/kernels/test_fused.py::test_d ERROR                  [ 40%]\n"
            "tests/kernels/test_fused.py::test_e ")  # the window closed mid-test
    got = gc.parse_pytest(text)
    assert (got["passed"], got["failed"], got["skipped"], got["error"]) == (1, 1, 1, 1)
    assert got["failures"] == ["tests/kernels/test_fp8.py::test_b", "tests/kernels/test_fused.py::test_d"]


def test_a_failed_section_is_recorded_and_the_next_one_still_runs(tmp_path):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "manifest.json").write_text("{not json")  # what a killed earlier attempt may leave
    out = tmp_path / "out"
    proc = _run(["--dry-run", "--out", str(out), "--work", str(work), "--sections", "training", "environment"],
                tmp_path, timeout=300)
    assert proc.returncode == 1
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["sections"]["training"]["status"] == "failed"
    assert "manifest.json" in line["training"]["error"] and line["sections"]["training"]["log_tail"]
    assert line["sections"]["environment"]["status"] == "ok"


def test_a_section_the_budget_cannot_hold_is_skipped_and_said(tmp_path):
    out = tmp_path / "out"
    proc = _run(["--dry-run", "--out", str(out), "--budget-s", "5", "--sections", "environment"], tmp_path,
                timeout=120)
    assert proc.returncode == 1
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["sections"]["environment"]["status"] == "skipped"
    assert "out of budget" in line["sections"]["environment"]["why"]


def test_the_kernel_benchmarks_gpu_only_code_runs(monkeypatch):
    """benchmarks/kernel_ops.py's code that only a GPU runs (device times, the fused quantization's
    floor, the FP8 linear's parts for both gradient formats, the report of which products
    cuBLAS took, the targets read from them), run here on CPU tensors at toy sizes with the
    synchronized timer standing in for ``do_bench``: so that a GPU window never finds it
    broken. The figures mean nothing."""
    import torch

    kernels = benchmark_script("kernel_ops")
    monkeypatch.setattr(kernels, "device_time", lambda fn, device: min(kernels.time_pass(fn, device, 1)))
    monkeypatch.setattr(kernels, "_torchao", lambda *a: None)  # (torchao's Float8Linear wants FP8 units,
    monkeypatch.setattr(kernels, "_liger", lambda *a: None)  # Liger Kernel a GPU)
    device, results = torch.device("cpu"), {"hbm_bytes_per_s": 1e11}
    kernels.bench_ops(device, torch.float32, kernels.QUICK_SIZES, 1, results, True)
    kernels.bench_fp8(device, kernels.QUICK_SIZES, 1, results, True)
    for fmt in ("e5m2", "e4m3"):
        for part in ("quantize_x_both", "quantize_w", "forward_mm", "quantize_grad_both", "input_grad_mm",
                     "weight_grad_mm"):
            assert results[f"fp8_linear_{fmt}_part_{part}_device_s"] > 0
    assert isinstance(results["fp8_linear_products"], dict)  # (empty here: no cuBLAS on a CPU)
    for op in ("fp8_quantize_1x128", "fp8_quantize_both", "rms_norm", "swiglu", "moe_permute"):
        assert results[f"{op}_fraction_of_bandwidth"] > 0
    targets = _gpu_check().targets({"kernel_benchmarks": results})
    for name in ("fp8_linear_4096_over_bf16_device", "fp8_linear_e4m3_grads_4096_over_bf16_device",
                 "fp8_quantize_both_fraction_of_bandwidth"):
        assert targets[name]["value"] > 0 and targets[name]["met"] in (True, False)


def test_the_dense_mfu_target_takes_the_faster_engine_for_its_model():
    gc = _gpu_check()

    def mfu(runs):
        return gc.targets({"training": {"runs": runs}})["dense_zero3_mfu"]

    assert mfu({"dense_zero3": {"mfu": 0.05}, "dense_zero3_ddp": {"mfu": 0.4}}) == {
        "value": 0.4, "target": ">= 0.35", "met": True}
    assert mfu({"dense_zero3": {"mfu": 0.05}, "dense_zero3_ddp": {"skipped": "out of time"}})["value"] == 0.05
    assert mfu({"dense_zero3": {"mfu": 0.3}, "dense_zero3_ddp": {"mfu": 0.1}})["met"] is False
    assert mfu({})["value"] is None and mfu({})["met"] is None
