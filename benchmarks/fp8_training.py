"""FP8 on and off in training: the smoke MoE recipe's loss curves side by side.

    python benchmarks/fp8_training.py [--steps 300] [--nproc 4] [--manifest runs/quickstart/data]
                                      [--e4m3_gradients] [--rowwise_experts]

Trains ``recipes/smoke/moe_fp8.json`` (MoE decoder with a shared expert, pp = 2, ep = 2 on
``--nproc`` CPU ranks under the deepspeed launcher) three times for ``--steps`` steps:
``kernels.fp8`` on (seed 0), off (seed 0), and off with another seed (``run.seed 1``: other
initial weights, the same data order); with ``--e4m3_gradients`` a fourth, FP8 with
``kernels.fp8_grad_format e4m3`` (seed 0); with ``--rowwise_experts`` another, torchao's
row-wise recipe on the linears and the experts (``kernels.fp8_recipe rowwise``,
``kernels.fp8_experts``; seed 0). The yardstick for "FP8 trains like the model it
approximates" is the third run: FP8's effect on the curve should be no larger than what a
different initialization does. Figures: the train loss logged every 10 steps, its mean
absolute difference over the second half of the run (fp8 vs off, and seed 0 vs seed 1),
the final validation loss of each, and the validity of 1,000 SMILES sampled from each
final checkpoint with ``molds-sample`` and, for the FP8 run, from its Hugging Face export
with ``generate``. Prints one JSON line.

The bundled sample is preprocessed into ``--manifest`` first when that is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


ROWWISE_EXPERTS = ["--kernels.fp8_recipe", "rowwise", "--kernels.fp8_grad_format", "e4m3", "--kernels.fp8_experts",
                   "true"]


def train(manifest, out, steps, nproc, seed, fp8, port, grad_format=None, extra=()):
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(port),
           "molds/train.py", "--recipe", "recipes/smoke/moe_fp8.json", "--data.manifest", manifest,
           "--run.output_dir", out, "--run.overwrite", "true", "--run.seed", str(seed),
           "--kernels.fp8", "true" if fp8 else "false", "--trainer.max_steps", str(steps),
           "--checkpoint.interval_steps", "0", "--eval.interval_steps", str(steps), "--logging.progress", "false"]
    if grad_format:
        cmd += ["--kernels.fp8_grad_format", grad_format]
    cmd += list(extra)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu")))
    if proc.returncode:
        sys.exit(proc.stderr[-4000:])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    curve = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    final = [r["eval/loss"] for r in rows if "eval/loss" in r]
    return {"curve": curve, "valid_loss": final[-1] if final else None, "train_s": time.perf_counter() - start}


def validity(lines) -> float:
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    return sum(bool(s) and Chem.MolFromSmiles(s) is not None for s in lines) / len(lines)


def sampled_validity(run_dir, n, tmp):
    from molds.cli.sample import main as sample

    out = os.path.join(tmp, "samples.smi")
    assert sample([run_dir, "--num", str(n), "--seed", "0", "--out", out]) == 0
    return validity(open(out).read().splitlines())


def exported_validity(run_dir, n, tmp):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molds.checkpoint import open_checkpoint
    from molds.export import export

    hf_dir = export(run_dir, os.path.join(tmp, "hf"))
    specials = open_checkpoint(run_dir, with_tokenizer=False).specials
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    torch.manual_seed(0)
    texts = []
    with torch.no_grad():
        for start in range(0, n, 250):
            out = hf.generate(torch.full((min(250, n - start), 1), specials.bos), do_sample=True, top_k=0,
                              max_new_tokens=120, pad_token_id=specials.pad, eos_token_id=specials.eos)
            for row in out[:, 1:].tolist():
                ended = specials.eos in row
                row = row[:row.index(specials.eos)] if ended else row
                texts.append(tok.decode(row).replace(" ", "") if ended else "")
    return validity(texts)


def late_gap(a: dict, b: dict) -> float:
    """Mean absolute difference of two loss curves over the second half of the steps."""
    steps = sorted(set(a) & set(b))
    late = steps[len(steps) // 2:]
    return sum(abs(a[s] - b[s]) for s in late) / len(late)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--manifest", default="runs/quickstart/data")
    ap.add_argument("--output_dir", default="runs/fp8-training")
    ap.add_argument("--e4m3_gradients", action="store_true",
                    help="a fourth run: FP8 with kernels.fp8_grad_format e4m3 (the format cuBLAS takes on Hopper)")
    ap.add_argument("--rowwise_experts", action="store_true",
                    help="another run: torchao's row-wise recipe on the linears and the experts (kernels.fp8_experts)")
    args = ap.parse_args()
    from molds.runtime.distributed import free_port

    manifest = os.path.abspath(args.manifest)
    if not os.path.isfile(os.path.join(manifest, "manifest.json")):
        subprocess.run(["molds-preprocess", "--input", os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz"),
                        "--smiles-column", "SMILES", "--output", manifest, "--split", "scaffold", "--split-fractions",
                        "0.8,0.1,0.1", "--tokenizer", "regex", "--workers", "2"], check=True, cwd=ROOT)
    out = os.path.abspath(args.output_dir)
    runs = {}
    plan = [("fp8", 0, True, None, ()), ("off", 0, False, None, ()), ("off_seed1", 1, False, None, ())]
    if args.e4m3_gradients:
        plan.append(("fp8_e4m3", 0, True, "e4m3", ()))
    if args.rowwise_experts:
        plan.append(("fp8_rowwise_experts", 0, True, None, ROWWISE_EXPERTS))
    for name, seed, fp8, fmt, extra in plan:
        runs[name] = train(manifest, os.path.join(out, name), args.steps, args.nproc, seed, fp8, free_port(), fmt,
                           extra)
    from benchmarks.kernels import cpu_name

    result = {"cpu": cpu_name(), "steps": args.steps, "nproc": args.nproc, "manifest": manifest,
              "fp8_vs_off_late_mean_abs_loss_gap": late_gap(runs["fp8"]["curve"], runs["off"]["curve"]),
              "seed0_vs_seed1_late_mean_abs_loss_gap": late_gap(runs["off"]["curve"], runs["off_seed1"]["curve"])}
    if "fp8_e4m3" in runs:
        result["fp8_e4m3_vs_off_late_mean_abs_loss_gap"] = late_gap(runs["fp8_e4m3"]["curve"], runs["off"]["curve"])
        result["fp8_e4m3_vs_fp8_late_mean_abs_loss_gap"] = late_gap(runs["fp8_e4m3"]["curve"], runs["fp8"]["curve"])
    if "fp8_rowwise_experts" in runs:
        result["fp8_rowwise_experts_vs_off_late_mean_abs_loss_gap"] = late_gap(runs["fp8_rowwise_experts"]["curve"],
                                                                               runs["off"]["curve"])
    for name, r in runs.items():
        result[f"{name}_valid_loss"] = r["valid_loss"]
        result[f"{name}_final_train_loss"] = r["curve"][max(r["curve"])]
        result[f"{name}_train_s"] = r["train_s"]
        result[f"{name}_curve"] = [round(r["curve"][s], 4) for s in sorted(r["curve"])]
        result[f"{name}_sampled_validity"] = sampled_validity(os.path.join(out, name), args.samples,
                                                              os.path.join(out, name))
    result["fp8_exported_generate_validity"] = exported_validity(os.path.join(out, "fp8"), args.samples,
                                                                 os.path.join(out, "fp8"))
    result["fp8_within_seed_variation"] = (result["fp8_vs_off_late_mean_abs_loss_gap"]
                                           <= result["seed0_vs_seed1_late_mean_abs_loss_gap"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
