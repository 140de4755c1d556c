"""How long a CPU recipe's ranks wait for their data, with randomized SMILES written in the
training process (RDKit, ``data.randomized_from: rdkit``) against spellings the ETL stored
(``molds-preprocess --randomized_variants K``, ``data.randomized_from: manifest``), side by
side in one run.

    python benchmarks/data_wait.py --manifest data/moses-rv [--recipe recipes/cpu_moses.json]
                                   [--steps 800] [--rounds 1] [--skip 200] [--nproc 2]

Each (round, source) is one ``torchrun --nproc_per_node NPROC molds/train.py`` run of the
recipe for ``--steps`` steps (its time budget replaced by the step count; checkpoints only
at the end), logging every 50 steps. The figures are means over the logged windows after
``--skip`` steps (start-up and compilation left out; each window is 50 steps):
``data/wait_s_per_step`` (the time a rank's loop waits for its next batch, mean over the
ranks) and ``train/step_s`` (wall seconds per optimizer step), and the wait as a share of
the step. Means, not medians: the live spellings are written when the shuffle window
moves on, about every 150 steps, so one window in three waits ~45 ms a step and the others
~1 ms (a median reads the quiet ones). ``--score_only`` reads the runs already in ``--out``. The manifest must store variants for the train split. One JSON line: per source
its figures and per-round values, the step-time ratio live / stored (> 1: stored spellings
give more steps per hour), and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SOURCES = ("rdkit", "manifest")


def cpu_name() -> str:
    sys.path.insert(0, ROOT)
    from molds.runtime.lifecycle import cpu_description

    return cpu_description()


def run_one(args, source: str, out: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["torchrun", "--nproc_per_node", str(args.nproc), "--master_port", str(args.port),
           os.path.join(ROOT, "molds", "train.py"), "--recipe", args.recipe, "--data.manifest", args.manifest,
           "--data.randomized_from", source, "--trainer.max_time", "null", "--trainer.max_steps", str(args.steps),
           "--checkpoint.interval_fraction", "0", "--checkpoint.interval_steps", "0", "--checkpoint.average_last",
           "0", "--logging.interval_steps", "50", "--logging.tensorboard", "false", "--logging.progress", "false",
           "--run.output_dir", out]
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    with open(os.path.join(out, "stderr.log"), "w", encoding="utf-8") as fh:
        fh.write(proc.stderr)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{source}: molds/train.py exited with {proc.returncode}")
    return dict(figures(out, args.skip), wall_s=time.time() - t)


def figures(out: str, skip: int) -> dict:
    """A finished run's wait and step time, means over its logged windows after ``skip``."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"), encoding="utf-8")]
    rows = [r for r in rows if "train/step_s" in r and r["step"] > skip]
    if not rows:
        raise SystemExit(f"{out}: no logged window after step {skip}; raise --steps")
    wait = statistics.fmean(r["data/wait_s_per_step"] for r in rows)
    step = statistics.fmean(r["train/step_s"] for r in rows)
    note, log = "", os.path.join(out, "stderr.log")
    if os.path.exists(log):
        with open(log, encoding="utf-8") as fh:
            note = next((line for line in fh if "data.randomized_smiles=" in line), "")
    return {"wait_s_per_step": wait, "step_s": step, "wait_share": wait / step, "windows": len(rows),
            "wait_s_per_window": [round(r["data/wait_s_per_step"], 5) for r in rows], "source_note": note.strip()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", required=True, help="a manifest with stored variants (--randomized_variants K)")
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "cpu_moses.json"))
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--skip", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--port", type=int, default=29631)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-data-wait"))
    ap.add_argument("--score_only", action="store_true", help="read the runs already in --out")
    args = ap.parse_args(argv)
    with open(os.path.join(args.manifest, "manifest.json"), encoding="utf-8") as fh:
        info = json.load(fh).get("randomized")
    if not info:
        raise SystemExit(f"{args.manifest} stores no randomized variants: make it with molds-preprocess "
                         f"--randomized_variants K")
    per = {s: [] for s in SOURCES}
    for r in range(args.rounds):
        for s in SOURCES:
            out = os.path.join(args.out, f"{s}-{r}")
            per[s].append(figures(out, args.skip) if args.score_only else run_one(args, s, out))
            print(f"[data_wait] round {r} {s}: {json.dumps(per[s][-1])}", file=sys.stderr, flush=True)
    result = {"benchmark": "data_wait", "recipe": os.path.relpath(args.recipe, ROOT), "manifest": args.manifest,
              "variants": info["variants"], "steps": args.steps, "skip": args.skip, "nproc": args.nproc,
              "machine": cpu_name()}
    for s in SOURCES:
        result[s] = {k: statistics.fmean(x[k] for x in per[s]) for k in ("wait_s_per_step", "step_s", "wait_share")}
        result[s]["rounds"] = per[s]
    result["step_time_live_over_stored"] = result["rdkit"]["step_s"] / result["manifest"]["step_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
