"""The one command a GPU window runs: everything molds has to show on one GPU, in one go.

    source .whl/install-offline.sh && python benchmarks/gpu_check.py --out $OUT --commit SHA
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check      # the same steps, CPU ranks, toy sizes

GPU time comes in windows of minutes on a machine without network access, so this script
is prepared (and tried: ``--dry-run`` is in the default test suite) before a window opens.
It runs these sections, each in a process of its own with a time limit, so that one that
crashes the CUDA context or hangs costs only itself:

- ``environment``: card, driver, CUDA, torch, triton, deepspeed, Liger Kernel and torchao
  versions; the measured memory bandwidth (a device-to-device copy) and BF16 and FP8
  matrix rates (what MFU is taken against: ``--logging.peak_tflops``).
- ``training``: the bundled sample preprocessed, then short runs under the deepspeed
  launcher on one rank of each recipe family that fits one GPU: the dense decoder on DDP,
  ZeRO-2 and ZeRO-3 (``recipes/dense_zero3.json``: the MFU target's model, also on DDP), the MLM
  encoder, the BART encoder-decoder (``recipes/bart_retro.json`` on the bundled forward
  reactions), and the MoE decoder of ``recipes/moe_fp8.json`` at pp 1, ep 1 (2 of its 16
  layers, one dense and one MoE, at full width, and 4 micro-batches a step: each run fits
  its 120 s) with kernels off, ``kernels.triton`` and ``kernels.fp8``. Each reports
  tokens/s and MFU (medians of the logged windows after the second: the first holds
  start-up and compilation, the second the steps profiled by ``logging.profile_steps``),
  peak memory, its loss curve, where a step's time goes (``profile``) and its start lines.
  Then fp32 parity: ``recipes/smoke/dense_ddp.json``'s first steps in fp32 on the device
  (TF32 off: ``NVIDIA_TF32_OVERRIDE=0``) against the same run on the CPU.
- ``real_shapes``: two layers (one dense, one MoE) of ``recipes/moe_fp8.json``'s model at
  full width, forward + backward under bf16 autocast, kernels off / triton / fp8 /
  fp8 + triton / torchao's row-wise (linears; linears and experts) and tensor-wise:
  tokens/s and the FP8-over-BF16 ratios; and every distinct product of the model (its
  linears in the recipe's gradient format, the experts' grouped GEMM, block-wise and
  row-wise), expert widths 256-2048, and a square and an MLP-shaped linear at hidden 1024,
  2048 and 4096 in both gradient formats, FP8 against BF16: what sizing ``moe_fp8.json`` so
  that FP8 pays is read from.
- ``dualpipev``: the MoE model's per-layer F, B, I (input gradient, weight gradients
  deferred), W and F&B times measured on the device (its first 4 blocks; the later blocks,
  of the same shapes, take the median of the measured ones of their kind), summed per
  pipeline stage (DeepSpeed's
  partition by parameters: 2P stages for the V schedules, P for 1F1B) and fed, stage by
  stage, to ``molds.engines.schedule.simulate`` for 1F1B, DeepSpeed's stock DualPipeV and
  molds' at P = 2, 4 and 8. One device has no all-to-all: the costs hold none, which the
  figures say.
- ``kernel_benchmarks``: ``benchmarks/kernel_ops.py`` (each op against its reference, Liger
  Kernel, torchao and the card's limits).
- ``kernel_tests``: ``pytest tests/kernels``, compiled on CUDA tensors (whatever time is left).

Writes ``OUT/gpu_check.json`` (rewritten after every section, so a window that closes early
keeps what was done) and ``OUT/gpu_check.log`` (every process's output), nothing else there
(the device tool carries back a few files only); data, run directories and each run's
metrics stay in ``--work``. Prints the JSON as its last line. ``targets`` holds issue
43's GPU targets with the measured value of each. Default budget 450 s (8 minutes with
start-up), each section capped so the later ones get their turn; a dry run's budget is its
caps' sum, so that a loaded CPU slows it down without skipping a section.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SECTIONS = ["environment", "training", "real_shapes", "dualpipev", "kernel_benchmarks", "kernel_tests"]
#: seconds each section may take at most (the last one takes what is left)
CAPS = {"environment": 45, "training": 240, "real_shapes": 60, "dualpipev": 60, "kernel_benchmarks": 60,
        "kernel_tests": 600}
#: a dry run has no window to fit and no section is timed out (beside the test suite's other
#: worker it ran 4x slower than on an idle machine): only ``--budget-s``, when given, bounds it
#: what molds imports (setup.py's requirements) and the peers it is measured against: the
#: environment section names any the machine lacks (the wheels carried there may miss one)
MODULES = ("torch", "deepspeed", "transformers", "tokenizers", "datasets", "rdkit", "pyarrow", "numpy", "fsspec", "isal",
           "xxhash", "jsonargparse", "tensorboard", "safetensors", "tqdm", "psutil", "sklearn", "scipy", "PIL",
           "fcd_torch", "triton", "liger_kernel", "torchao")
SAMPLE = os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz")
LABELLED = os.path.join(ROOT, "molds", "sample_data", "moses_sample_labels.csv.gz")
REACTIONS = os.path.join(ROOT, "molds", "sample_data", "moses_sample_reactions.csv.gz")
MOE_RECIPE = os.path.join(ROOT, "recipes", "moe_fp8.json")
#: fp32 parity: the relative loss difference allowed between device and CPU, at step 1 (the
#: same weights and batch: only the order of summation differs) and over the first steps
PARITY_STEPS, PARITY_FIRST_RTOL, PARITY_RTOL = 5, 1e-4, 1e-3


# ---------------------------------------------------------------- the sections' context

class Context:
    def __init__(self, args, name: str):
        self.args, self.name, self.dry = args, name, args.dry_run
        self.runs = getattr(args, "runs", None)
        self.out, self.work = args.out, args.work
        self.deadline = time.monotonic() + args.seconds
        self.path = section_path(args.work, name)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, result: dict) -> None:
        write_json(self.path, result)

    def environment(self) -> dict:
        path = section_path(self.work, "environment")
        return json.load(open(path)) if os.path.exists(path) else {}

    def device(self):
        import torch

        return torch.device("cuda" if torch.cuda.is_available() and not self.dry else "cpu")


def section_path(work: str, name: str) -> str:
    """Where a section's JSON is kept while it runs (the work directory: OUT holds only
    gpu_check.json and gpu_check.log, as few files as the device tool carries back)."""
    return os.path.join(work, "sections", f"{name}.json")


def echo(path: str, title: str) -> None:
    """A file's text into this process's output (the check's one log)."""
    with open(path, errors="replace") as fh:
        print(f"----- {title} ({path})\n{fh.read()}----- end of {title}", flush=True)


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def say(*parts) -> None:
    print("[gpu_check]", *parts, flush=True)


def run_logged(cmd, log_path: str, timeout: float, env=None, cwd=ROOT) -> tuple[int | None, float]:
    """Run ``cmd`` with its output in ``log_path`` (and the process group killed at
    ``timeout``); (return code or None when it timed out, seconds)."""
    start = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=None if math.isinf(timeout) else max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.perf_counter() - start


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------- environment

def section_environment(ctx) -> dict:
    import importlib.metadata as md
    import importlib.util
    import platform

    import torch

    from molds.runtime.lifecycle import cpu_description

    versions = {}
    for pkg in ("torch", "triton", "deepspeed", "transformers", "liger-kernel", "torchao", "rdkit", "pyarrow"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    env = {"python": platform.python_version(), "versions": versions, "cpu": cpu_description(),
           "cpu_count": os.cpu_count(), "cuda": torch.version.cuda,
           "missing_modules": [m for m in MODULES if importlib.util.find_spec(m) is None]}
    device = ctx.device()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(card=props.name, capability=list(torch.cuda.get_device_capability(device)),
                   memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,power.limit,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = smi.stdout.strip()
            env["driver"] = smi.stdout.split(",")[0].strip() or None
        except (OSError, subprocess.TimeoutExpired) as exc:
            env["driver"] = f"nvidia-smi failed: {exc}"
    else:
        env["card"] = "cpu (dry run)" if ctx.dry else "cpu"
    ctx.save(env)
    env.update(measure_rates(device, dry=ctx.dry))
    return env


def measure_rates(device, dry: bool) -> dict:
    """``benchmarks/kernel_ops.py``'s measured limits (bandwidth, BF16 and FP8 matrix rates);
    small sizes in a dry run."""
    from kernel_ops import hardware_limits

    out = {"matmul_side": 512 if dry else 8192}
    hardware_limits(device, out, copy_elements=(1 << 22) if dry else (1 << 28), side=out["matmul_side"])
    return out


# ---------------------------------------------------------------- training

def training_runs(dry: bool) -> list[tuple[str, str, list[str]]]:
    """(name, recipe, overrides) of each run, most wanted first (a window that closes early
    keeps those): the full-size recipes on a GPU, their smoke twins shrunk further in a dry
    run. ``fp32_parity`` is the device-against-CPU check."""
    rec = os.path.join(ROOT, "recipes", "smoke" if dry else "")
    moe = ["--run.min_gpus", "0", "--parallel.pp_size", "1", "--parallel.ep_size", "1", "--parallel.schedule", "1f1b"]
    if not dry:  # one dense and one MoE block at full width, a quarter of the recipe's step: a run fits its 120 s
        moe += ["--model.num_layers", "2", "--trainer.grad_accum", "4"]
    tiny = ["--model.hidden_size", "32"] if dry else []
    every = ["--kernels.fp8_products", "all"]  # FP8 on or off as named, whatever the recipe's choice
    return [
        ("dense_zero3", os.path.join(rec, "dense_zero3.json"), tiny),
        # the MFU target's model on DDP: on one GPU ZeRO-3 saves no memory and costs its
        # per-module gather hooks (on a 2-core EPYC, 84 ms a step of the 16-layer model at
        # width 64 against 27-36 ms on DDP)
        ("dense_zero3_ddp", os.path.join(rec, "dense_zero3.json"), tiny + ["--parallel.engine", "ddp"]),
        ("moe_kernels_off", os.path.join(rec, "moe_fp8.json"), moe + ["--kernels.fp8", "false", *every,
                                                                      "--kernels.triton", "false"]),
        ("moe_fp8", os.path.join(rec, "moe_fp8.json"), moe + ["--kernels.fp8", "true", *every,
                                                              "--kernels.triton", "false"]),
        ("fp32_parity", "", []),
        ("moe_triton", os.path.join(rec, "moe_fp8.json"), moe + ["--kernels.fp8", "false", *every,
                                                                 "--kernels.triton", "true"]),
        ("dense_zero2", os.path.join(rec, "dense_zero2.json"), tiny),
        ("mlm_zero2", os.path.join(rec, "mlm_multitask_zero2.json"), tiny + ["--model.num_tasks", "2"]),
        ("dense_ddp", os.path.join(rec, "dense_ddp.json"), tiny),
        # the encoder-decoder on the bundled forward reactions (Chemformer's size on a GPU)
        ("bart_zero2", os.path.join(rec, "bart_forward.json" if dry else "bart_retro.json"), tiny),
    ] + ([] if dry else [  # a GPU's figure; on a CPU it converts nothing (tests/kernels/test_fp8_select.py)
        # the recipe's own kernels: FP8 where measured faster (kernels.fp8_products=faster), Triton
        ("moe_recipe_kernels", os.path.join(rec, "moe_fp8.json"), moe + ["--kernels.fp8_products", "faster"]),
    ])


#: a dry run preprocesses the first rows of each bundled file only: its runs train 3 steps
#: and what it checks is that every section runs, not what the data holds
DRY_ROWS = 4000


def dry_input(ctx, src: str) -> str:
    """``src`` itself, or in a dry run its header and first ``DRY_ROWS`` rows, written once
    into the work directory."""
    if not ctx.dry:
        return src
    dest = os.path.join(ctx.work, "inputs", os.path.basename(src))
    if not os.path.exists(dest):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with gzip.open(src, "rt", encoding="utf-8") as fh:
            head = [line for _, line in zip(range(DRY_ROWS + 1), fh)]
        with gzip.open(dest + ".tmp", "wt", encoding="utf-8") as fh:
            fh.writelines(head)
        os.replace(dest + ".tmp", dest)
    return dest


def prepare_data(ctx) -> dict:
    """The bundled sample, its labelled twin and its forward reactions (their first rows in a
    dry run), preprocessed into the work directory."""
    from molds.data.manifest import Manifest
    try:  # installed (setup.py maps preprocessing/ to molds.preprocessing)
        from molds.preprocessing.cli import main as preprocess
    except ModuleNotFoundError:  # the checkout at ROOT shadows the installed molds
        from preprocessing.cli import main as preprocess

    out = {}
    for name, src, extra in (("data", SAMPLE, ["--smiles-column", "SMILES"]),
                             ("labelled", LABELLED, ["--smiles-column", "SMILES",
                                                     "--label-columns", "logp_gt_3,tpsa_gt_90"]),
                             # 8 root-aligned spellings a pair: the bart recipes read half their pairs in them
                             ("reactions", REACTIONS, ["--smiles-column", "reactants>reagents>production",
                                                       "--id-column", "id", "--task", "forward",
                                                       "--randomized-variants", "8"])):
        dest = os.path.join(ctx.work, name)
        if not os.path.exists(os.path.join(dest, "manifest.json")):
            rc = preprocess(["--input", dry_input(ctx, src), "--output", dest, "--split", "scaffold",
                             "--split-fractions", "0.8,0.1,0.1", "--tokenizer", "regex", "--workers",
                             str(min(8, os.cpu_count() or 1)), "--overwrite", "true", "--progress", "false", *extra])
            if rc:
                raise RuntimeError(f"molds-preprocess of {src} failed (exit {rc})")
        Manifest.load(dest)  # what an earlier section (or run) left is checked before it is used
        out[name] = dest
    return out


def launcher(port: int) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port)]


def train_once(ctx, name: str, recipe: str, overrides: list[str], manifest: str, *, steps: int, every: int,
               env_extra: dict | None = None, cmd_prefix: list[str] | None = None) -> dict:
    """One short run; its figures from metrics.jsonl and its start lines from its output."""
    from molds.metrics.logger import read_metrics

    run_dir = os.path.join(ctx.work, "runs", name)
    logs = os.path.join(ctx.work, "logs")
    os.makedirs(logs, exist_ok=True)
    log = os.path.join(logs, f"{name}.log")
    open(log, "w").close()
    env = dict(os.environ, **(env_extra or {}))
    if ctx.dry:
        env.setdefault("DS_ACCELERATOR", "cpu")
    peak = ctx.environment().get("bf16_matmul_tflops")
    cmd = (cmd_prefix or launcher(29500 + sum(map(ord, name)) % 400)) + [
        os.path.join(ROOT, "molds", "train.py"), "--recipe", recipe, "--data.manifest", manifest,
        "--run.output_dir", run_dir, "--run.overwrite", "true", "--trainer.max_steps", str(steps),
        "--logging.interval_steps", str(every), "--logging.progress", "false", "--eval.interval_steps", "0",
        "--eval.full_interval_steps", "0", "--checkpoint.interval_steps", "0", "--checkpoint.average_last", "0",
        # where a step goes: the steps of the second window (one run of a dry run tries it)
        *(["--logging.profile_steps", "3"] if not ctx.dry or name == "dense_zero3" else []),
        *(["--logging.peak_tflops", f"{peak:.6g}"] if peak and not ctx.dry else []), *overrides]
    rc, seconds = run_logged(cmd, log, ctx.left() - 5 if ctx.dry else min(ctx.left() - 5, 120), env=env)
    echo(log, f"training run {name}")
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        shutil.copy(os.path.join(run_dir, "metrics.jsonl"), os.path.join(logs, f"{name}.metrics.jsonl"))
    shutil.rmtree(run_dir, ignore_errors=True)  # a GPU machine's disk: checkpoints of every run would not fit
    train = [r for r in rows if "train/loss" in r]
    # the first window holds start-up and compilation, the second the profiled steps
    later = train[2:] or train[1:] or train

    def median(key):
        vals = [r[key] for r in later if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    text = open(log, errors="replace").read()
    result = {"rc": rc, "timed_out": rc is None, "wall_s": seconds, "steps": train[-1]["step"] if train else 0,
              "command": " ".join(cmd[cmd.index(os.path.join(ROOT, "molds", "train.py")):]).replace(ROOT + "/", ""),
              "loss": {r["step"]: r["train/loss"] for r in train}, "tokens_per_s": median("train/tokens_per_sec"),
              "mfu": median("train/mfu"), "step_s": median("train/step_s"),
              "peak_memory_mb": max((r.get("train/peak_memory_mb") or r.get("train/peak_rss_mb") or 0 for r in train),
                                    default=None),
              "profile": next(({k.removeprefix("profile/"): v for k, v in r.items() if k.startswith("profile/")}
                               for r in rows if "profile/step_ms" in r), None),
              "start_lines": [line for line in text.splitlines()
                              if line.startswith("[molds]") and any(k in line for k in (" of ", "precision", "kernels:"))]}
    if rc != 0:
        result["error_tail"] = tail(log, 40)
    return result


def section_training(ctx) -> dict:
    result = {"runs": {}}
    t = time.perf_counter()
    data = prepare_data(ctx)
    result["preprocess_s"] = time.perf_counter() - t
    steps, every = (3, 1) if ctx.dry else (30, 5)
    # a GPU trains in bf16; a dry run in what its CPU runs fastest (auto: bf16 where the CPU has it,
    # fp32 where bf16 is emulated: on an AVX2-only EPYC the section took 223 s so, 247 s in bf16)
    precision = "auto" if ctx.dry else "bf16"
    for name, recipe, overrides in training_runs(ctx.dry):
        if ctx.runs and name not in ctx.runs:
            continue
        if ctx.left() < (30 if name == "fp32_parity" else 20):
            (result["runs"] if recipe else result)[name] = {"skipped": "out of time"}
            continue
        say("training", name)
        if name == "fp32_parity":
            result[name] = fp32_parity(ctx, data["data"])
        else:
            manifest = data["labelled" if name.startswith("mlm") else "reactions" if name.startswith("bart")
                            else "data"]
            # a dry run starts its first run under the launcher, as a GPU window starts each, and
            # the others as one plain process (the same molds/train.py; the launcher costs ~4 s a run
            # on 2 cores); the fp32 parity's device side also goes through the launcher
            plain = ctx.dry and bool(result["runs"])
            result["runs"][name] = train_once(ctx, name, recipe, overrides + ["--trainer.precision", precision],
                                              manifest, steps=steps, every=every,
                                              cmd_prefix=[sys.executable] if plain else None)
        ctx.save(result)
    result["failures"] = [f"{n}: {'timed out' if r.get('timed_out') else 'exit %s' % r.get('rc')}"
                          for n, r in result["runs"].items() if r.get("rc") != 0 and "skipped" not in r]
    parity = result.get("fp32_parity", {})
    if "within_bound" in parity and not parity["within_bound"]:
        result["failures"].append("fp32_parity: device and CPU losses differ beyond the bound")
    return result


def fp32_parity(ctx, manifest: str) -> dict:
    """The smoke dense recipe's first steps in fp32 on the device (under the launcher, TF32
    off) and on the CPU (one plain process): the loss of each step side by side."""
    recipe = os.path.join(ROOT, "recipes", "smoke", "dense_ddp.json")
    common = ["--trainer.precision", "fp32", "--model.dropout", "0"]
    device = train_once(ctx, "fp32_device", recipe, common, manifest, steps=PARITY_STEPS, every=1,
                        env_extra={"NVIDIA_TF32_OVERRIDE": "0"})
    cpu = train_once(ctx, "fp32_cpu", recipe, common, manifest, steps=PARITY_STEPS, every=1,
                     env_extra={"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}, cmd_prefix=[sys.executable])
    return compare_losses(device["loss"], cpu["loss"]) | {"device_rc": device["rc"], "cpu_rc": cpu["rc"]}


def compare_losses(device: dict, cpu: dict) -> dict:
    """Step by step relative difference of two loss curves, held to the parity bounds."""
    steps = sorted(set(device) & set(cpu), key=int)
    rel = {s: abs(device[s] - cpu[s]) / max(abs(cpu[s]), 1e-12) for s in steps}
    first = rel[steps[0]] if steps else None
    ok = (len(steps) == PARITY_STEPS and first <= PARITY_FIRST_RTOL and max(rel.values()) <= PARITY_RTOL)
    return {"steps": len(steps), "relative_difference": rel, "first_step_bound": PARITY_FIRST_RTOL,
            "bound": PARITY_RTOL, "within_bound": ok, "device_loss": device, "cpu_loss": cpu}


# ---------------------------------------------------------------- real layer shapes and DualPipeV

def moe_recipe(ctx, layers: int | None):
    """``recipes/moe_fp8.json`` (its smoke twin in a dry run) for one device, its tokenizer."""
    from molds.chemistry.tokens import tokenizer_info
    from molds.data.manifest import Manifest
    from molds.recipe.parse import parse_recipe

    data = prepare_data(ctx)["data"]
    path = os.path.join(ROOT, "recipes", "smoke", "moe_fp8.json") if ctx.dry else MOE_RECIPE
    argv = ["--recipe", path, "--data.manifest", data, "--run.min_gpus", "0", "--parallel.pp_size", "1",
            "--parallel.ep_size", "1", "--parallel.schedule", "1f1b"]
    if layers:
        argv += ["--model.num_layers", str(layers)]
    recipe = parse_recipe(argv)
    return recipe, tokenizer_info(Manifest.load(data))


def section_real_shapes(ctx) -> dict:
    from layer_costs import real_shapes

    recipe, tok = moe_recipe(ctx, layers=2)
    return real_shapes(recipe, tok, ctx.device(), rounds=1 if ctx.dry else 10, save=ctx.save,
                       widths=None if ctx.dry else (256, 512, 1024, 2048),
                       hidden_widths=(64,) if ctx.dry else (1024, 2048, 4096))


def section_dualpipev(ctx) -> dict:
    from layer_costs import dualpipev_costs

    recipe, tok = moe_recipe(ctx, layers=None)
    # the first blocks measured, the later ones given their kind's costs (the full model is
    # billions of parameters; its smoke twin's four blocks: three measured, the fourth given)
    return dualpipev_costs(recipe, tok, ctx.device(), rounds=2 if ctx.dry else 5, save=ctx.save,
                           measure_layers=3 if ctx.dry else 4)


# ---------------------------------------------------------------- the kernels' own benchmark and tests

def section_kernel_benchmarks(ctx) -> dict:
    log = os.path.join(ctx.work, "kernel_benchmarks.log")
    open(log, "w").close()
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "kernel_ops.py")] + (["--quick", "--rounds", "1"]
                                                                              if ctx.dry else ["--rounds", "5"])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if ctx.dry else None
    rc, seconds = run_logged(cmd, log, ctx.left() - 2, env=env)
    echo(log, "benchmarks/kernel_ops.py")
    lines = [line for line in tail(log, 5).splitlines() if line.startswith("{")]
    if rc != 0 or not lines:
        raise RuntimeError(f"benchmarks/kernel_ops.py {'timed out' if rc is None else f'exit {rc}'}:\n{tail(log)}")
    return json.loads(lines[-1]) | {"seconds": seconds}


TEST_LINE = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def parse_pytest(text: str) -> dict:
    """Counts and failing node ids from ``pytest -v`` output (complete or cut short)."""
    outcomes = {}
    for line in text.splitlines():
        m = TEST_LINE.match(line.strip())
        if m:
            outcomes[m.group(1)] = m.group(2)
    counts = {k.lower(): sum(v == k for v in outcomes.values()) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    return counts | {"failures": sorted(t for t, v in outcomes.items() if v in ("FAILED", "ERROR"))}


def section_kernel_tests(ctx) -> dict:
    log = os.path.join(ctx.work, "kernel_tests.log")
    open(log, "w").close()
    target = ["tests/kernels/test_fused.py", "-k", "swiglu"] if ctx.dry else ["tests/kernels"]
    cmd = [sys.executable, "-m", "pytest", *target, "-v", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    rc, seconds = run_logged(cmd, log, ctx.left() - 2)
    echo(log, "pytest tests/kernels")
    with open(log, errors="replace") as fh:
        result = parse_pytest(fh.read())
    result |= {"rc": rc, "timed_out": rc is None, "seconds": seconds, "target": " ".join(target)}
    result["failures"] = result["failures"] + (["pytest timed out"] if rc is None else
                                               [f"pytest exit {rc}"] if rc and not result["failures"] else [])
    return result


# ---------------------------------------------------------------- the whole check

def targets(results: dict) -> dict:
    """Issue 43's GPU targets, each with its measured value (None: not measured this time)."""
    kb = results.get("kernel_benchmarks", {})
    runs = results.get("training", {}).get("runs", {})
    shapes = results.get("real_shapes", {})

    def entry(value, bound, higher=True):
        met = None if value is None else (value >= bound if higher else value <= bound)
        return {"value": value, "target": f"{'>=' if higher else '<='} {bound}", "met": met}

    def ratio(a, b):
        return kb[a] / kb[b] if kb.get(a) and kb.get(b) else None

    # the model of recipes/dense_zero3.json, on the engine that ran it faster here
    dense_mfu = [r["mfu"] for r in (runs.get("dense_zero3"), runs.get("dense_zero3_ddp"))
                 if r and r.get("mfu") is not None]
    out = {"fp8_linear_4096_over_bf16": entry(kb.get("fp8_linear_speedup_over_bf16_linear"), 1.2),
           # the same in device time (a stream of calls: what a training step sees when the host runs ahead)
           "fp8_linear_4096_over_bf16_device": entry(kb.get("fp8_linear_device_speedup_over_bf16_linear"), 1.2),
           "fp8_linear_e4m3_grads_4096_over_bf16_device": entry(
               kb.get("fp8_linear_e4m3_grads_device_speedup_over_bf16_linear"), 1.2),
           "torchao_rowwise_4096_over_bf16": entry(kb.get("torchao_float8_rowwise_over_bf16_linear"), 1.2),
           "torchao_tensorwise_4096_over_bf16": entry(kb.get("torchao_float8_tensorwise_over_bf16_linear"), 1.2),
           "fp8_real_shapes_over_bf16": entry(shapes.get("fp8_over_bf16"), 1.15),
           "fp8_rowwise_real_shapes_over_bf16": entry(shapes.get("fp8_rowwise_over_bf16"), 1.15),
           "fp8_tensorwise_real_shapes_over_bf16": entry(shapes.get("fp8_tensorwise_over_bf16"), 1.15),
           "fp8_rowwise_experts_real_shapes_over_bf16": entry(shapes.get("fp8_rowwise_experts_over_bf16"), 1.15),
           "lm_head_memory_over_liger": entry(ratio("linear_cross_entropy_peak_mb",
                                                    "linear_cross_entropy_liger_peak_mb"), 1.5, higher=False),
           "dense_zero3_mfu": entry(max(dense_mfu, default=None), 0.35)}
    for op in ("rms_norm", "swiglu", "linear_cross_entropy"):
        out[f"{op}_over_liger"] = entry(kb.get(f"{op}_speedup_over_liger"), 1.0)
        out[f"{op}_over_liger_device"] = entry(kb.get(f"{op}_device_speedup_over_liger"), 1.0)
    # (the fractions of the bandwidth are taken from device times: benchmarks/kernel_ops.py's device_time)
    for op in ("rms_norm", "swiglu", "moe_permute", "moe_unpermute", "fp8_quantize_1x128", "fp8_quantize_both"):
        out[f"{op}_fraction_of_bandwidth"] = entry(kb.get(f"{op}_fraction_of_bandwidth"), 0.8)
    return out


def commit_of(given: str | None) -> str:
    if given:
        return given
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def orchestrate(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "gpu_check.log")
    caps = None if args.dry_run else CAPS
    start = time.monotonic()
    deadline = start + args.budget_s
    results = {"script": "benchmarks/gpu_check.py", "dry_run": args.dry_run, "commit": commit_of(args.commit),
               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "budget_s": None if math.isinf(args.budget_s) else args.budget_s, "sections": {}}
    path = os.path.join(args.out, "gpu_check.json")
    chosen = args.sections or SECTIONS
    for i, name in enumerate(chosen):
        left = deadline - time.monotonic()
        seconds = left if i == len(chosen) - 1 or caps is None else min(caps[name], left)
        if seconds < 10:
            results["sections"][name] = {"status": "skipped", "why": f"out of budget ({left:.0f} s left)"}
            continue
        say(name if math.isinf(seconds) else f"{name} (at most {seconds:.0f} s)")
        cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--out", args.out, "--work", args.work,
               "--seconds", f"{seconds:.1f}"] + (["--dry-run"] if args.dry_run else []) + (
                  ["--runs", *args.runs] if args.runs else [])
        section_file = section_path(args.work, name)
        if os.path.exists(section_file):  # an earlier check's, in a reused work directory
            os.remove(section_file)
        rc, took = run_logged(cmd, log, seconds + 15)
        if os.path.exists(section_file):
            results[name] = json.load(open(section_file))
        failures = results.get(name, {}).get("failures") or []
        status = "timed_out" if rc is None else "failed" if rc or failures else "ok"
        results["sections"][name] = {"status": status, "seconds": round(took, 1)}
        if failures:
            results["sections"][name]["failures"] = failures
        if rc != 0:
            results["sections"][name]["log_tail"] = tail(log, 25)
        results["targets"] = targets(results)
        results["wall_s"] = time.monotonic() - start
        write_json(path, results)
    return results


def run_section(args) -> int:
    ctx = Context(args, args.section)
    try:
        result = globals()[f"section_{args.section}"](ctx)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        partial = json.load(open(ctx.path)) if os.path.exists(ctx.path) else {}
        ctx.save(partial | {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    ctx.save(result)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu_check.json, the log and each run's metrics")
    ap.add_argument("--work", default=None, help="scratch directory (data, run directories; default OUT/../"
                    "gpu-check-work, kept out of OUT so the device tool does not carry checkpoints back)")
    ap.add_argument("--dry-run", action="store_true", help="the same steps at toy sizes on CPU ranks")
    ap.add_argument("--commit", default=None, help="the commit this tree is (a copied tree has no .git)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for everything (default 450; a dry run: no bound)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=None, help="run only these, in this order")
    ap.add_argument("--runs", nargs="+", choices=[n for n, _, _ in training_runs(False)], default=None,
                    help="the training section runs only these (a second window finishing what the first could not)")
    ap.add_argument("--section", choices=SECTIONS, default=None, help=argparse.SUPPRESS)  # one section (a child)
    ap.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = math.inf if args.dry_run else 450.0
    args.out = os.path.abspath(args.out)
    args.work = os.path.abspath(args.work or os.path.join(os.path.dirname(args.out),
                                                          os.path.basename(args.out) + "-work"))
    os.makedirs(args.work, exist_ok=True)
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # toy sizes on the CPU, whatever the machine has
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # one thread a process: toy sizes gain nothing from more, and OpenMP threads that spin
        # beside another busy process (the test suite's other worker) slow down many times over
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.section:
        return run_section(args)
    results = orchestrate(args)
    print(json.dumps(results))
    return 0 if all(s["status"] == "ok" for s in results["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
