"""The PMO protocol (Gao et al., "Sample Efficiency Matters", NeurIPS 2022) on molds' goal
runs: the 20 RDKit-only oracles, each with a budget of 10,000 unique valid molecules,
scored by the area under the top-10 curve (read every 100 calls, divided by the budget),
over N seeds; with ``--compare`` the same prior under plain REINVENT (no replay memory,
no augmentation, no diversity filter) in the same run, so the two sums sit side by side.

    python benchmarks/pmo.py --prior runs/cpu-moses --seeds 3 --jobs 2 --out runs/pmo --compare
    python benchmarks/pmo.py --prior runs/cpu-moses --tasks qed,median1 --seeds 1 --budget 1000

Each (setting, task, seed) is one ``molds/train.py`` run of ``recipes/goal_pmo.json`` in
its own process (``--jobs`` at a time, each with ``--threads`` torch threads), written
under ``OUT/SETTING/TASK/seed-S``; a finished run is read again, not re-run (delete it to
re-run). The figures come from each run's ``scored.csv`` (every call, in order), so they
are PMO's own: AUC top-10 (mol_opt's ``top_auc``), the top-10 mean, the internal diversity
of the top 100 (1 - mean pairwise Tanimoto of Morgan r=2 2048-bit fingerprints) and the
validity of what the agent sampled. The last line is one JSON object: the sum of AUC top-10
per setting, per task mean and std, wall time, CPU, and the published sums for the same 20
tasks (computed from PMO's per-task tables: REINVENT 11.59, Graph GA 11.44, Mol GA 12.23,
Genetic GFN 13.59; the published runs used a ZINC250k prior and, for some tasks, TDC's
oracles before its 2022 change). Per-task published figures are not bundled: compare
against the paper's tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PUBLISHED_SUMS = {"REINVENT": 11.59, "Graph GA": 11.44, "Mol GA": 12.23, "Genetic GFN": 13.59}
#: plain REINVENT: the augmented-likelihood loss alone
PLAIN = ["--goal.replay_size", "0", "--goal.replay_samples", "0", "--goal.replay_randomized", "false",
         "--goal.diversity_filter", "none"]


def parse_args(argv=None):
    from molds.scoring.pmo import ORACLES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prior", required=True, help="the prior: a decoder checkpoint or run directory")
    p.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "goal_pmo.json"))
    p.add_argument("--tasks", default=",".join(ORACLES), help="comma-separated PMO oracle names (default: all 20)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--budget", type=int, default=10000, help="oracle calls per run (PMO: 10,000)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)), help="runs at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--max_steps", type=int, default=0, help="also stop each run after this many steps (0: budget only)")
    p.add_argument("--compare", action="store_true", help="also run plain REINVENT (no replay, no filter)")
    p.add_argument("--out", default="runs/pmo")
    p.add_argument("extra", nargs="*", help="after --: more molds/train.py overrides for every run")
    return p.parse_args(argv)


def run_one(args, setting: str, task: str, seed: int) -> dict:
    out = os.path.join(args.out, setting, task, f"seed-{seed}")
    done = os.path.join(out, "topk.csv")
    t0 = time.perf_counter()
    if not os.path.exists(done):
        cmd = [sys.executable, os.path.join(ROOT, "molds", "train.py"), "--recipe", args.recipe,
               "--goal.prior", args.prior, "--goal.scoring", json.dumps({"oracle": task}), "--run.seed", str(seed),
               "--goal.max_oracle_calls", str(args.budget), "--run.output_dir", out, "--run.overwrite", "true",
               "--logging.progress", "false", "--logging.interval_steps", "1"]
        if args.max_steps:
            cmd += ["--trainer.max_steps", str(args.max_steps)]
        if setting == "plain":
            cmd += PLAIN
        cmd += args.extra
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   MOLDS_NO_GIT="1")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(args.out, setting, task, f"seed-{seed}.log"), "w") as log:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"{setting} {task} seed {seed} failed (exit {proc.returncode}): see {log.name}")
    return {"setting": setting, "task": task, "seed": seed, "wall_s": time.perf_counter() - t0,
            **figures(out, args.budget)}


def figures(out: str, budget: int) -> dict:
    from molds.goal.ledger import pmo_auc

    with open(os.path.join(out, "scored.csv"), newline="") as fh:
        rows = list(csv.DictReader(fh))
    history = [float(r["score"]) for r in rows]
    top = sorted(rows, key=lambda r: -float(r["score"]))[:100]
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    validity = [m["goal/validity"] for m in metrics if "goal/validity" in m]
    # the run's own time (its steps, each logged: --logging.interval_steps 1 above): unlike
    # wall_s, also there for a run an earlier invocation finished
    loop_s = sum(m.get("goal/step_s", 0.0) for m in metrics)
    return {"auc_top10": pmo_auc(history, budget), "top10_mean": sum(sorted(history)[-10:]) / max(1, min(10, len(history))),
            "calls": len(history), "diversity_top100": internal_diversity([r["smiles"] for r in top]),
            "validity": sum(validity) / len(validity) if validity else 0.0, "loop_s": loop_s}


def internal_diversity(smiles: list) -> float:
    from rdkit import Chem, DataStructs
    from rdkit.Chem import rdFingerprintGenerator

    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    fps = [gen.GetFingerprint(m) for m in (Chem.MolFromSmiles(s) for s in smiles) if m is not None]
    if len(fps) < 2:
        return 0.0
    sims = [x for i in range(1, len(fps)) for x in DataStructs.BulkTanimotoSimilarity(fps[i], fps[:i])]
    return 1.0 - sum(sims) / len(sims)


def main(argv=None):
    from molds.runtime.lifecycle import cpu_description

    args = parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    from molds.scoring.pmo import ORACLES

    unknown = [t for t in tasks if t not in ORACLES]
    if unknown:
        raise SystemExit(f"--tasks: not PMO's RDKit-only oracles: {unknown} (they are {list(ORACLES)})")
    settings = ["molds"] + (["plain"] if args.compare else [])
    jobs = [(s, t, seed) for s in settings for t in tasks for seed in range(args.seeds)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda j: run_one(args, *j), jobs))
    wall = time.perf_counter() - t0
    summary = {"cpu": cpu_description(), "prior": args.prior, "tasks": len(tasks), "seeds": args.seeds,
               "budget": args.budget, "jobs": args.jobs, "wall_s": wall, "published_sums_20_tasks": PUBLISHED_SUMS}
    for s in settings:
        per_task = {}
        for t in tasks:
            mine = [r for r in results if r["setting"] == s and r["task"] == t]
            aucs = [r["auc_top10"] for r in mine]
            per_task[t] = {"auc_top10_mean": statistics.fmean(aucs),
                           "auc_top10_std": statistics.stdev(aucs) if len(aucs) > 1 else 0.0,
                           "top10_mean": statistics.fmean(r["top10_mean"] for r in mine),
                           "diversity_top100": statistics.fmean(r["diversity_top100"] for r in mine),
                           "validity": statistics.fmean(r["validity"] for r in mine),
                           "calls": statistics.fmean(r["calls"] for r in mine)}
            print(f"{s:6s} {t:28s} AUC top-10 {per_task[t]['auc_top10_mean']:.3f} +- "
                  f"{per_task[t]['auc_top10_std']:.3f}  top-10 {per_task[t]['top10_mean']:.3f}  "
                  f"diversity {per_task[t]['diversity_top100']:.3f}  validity {per_task[t]['validity']:.3f}",
                  file=sys.stderr)
        # the sum's spread over seeds: the sum of each seed's AUCs over the tasks
        by_seed = [sum(r["auc_top10"] for r in results if r["setting"] == s and r["seed"] == seed)
                   for seed in range(args.seeds)]
        loop_s = sum(r["loop_s"] for r in results if r["setting"] == s)
        summary[s] = {"auc_top10_sum": sum(v["auc_top10_mean"] for v in per_task.values()),
                      "auc_top10_sum_by_seed": by_seed, "per_task": per_task,
                      # the steps of every run of this setting, summed (over "jobs": the wall
                      # time the setting alone takes at that many jobs, start-up not counted)
                      "loop_s": loop_s}
    if args.compare:
        summary["molds_minus_plain"] = summary["molds"]["auc_top10_sum"] - summary["plain"]["auc_top10_sum"]
        for s in settings:  # the spread of the summed AUC over seeds: max - min
            by_seed = summary[s]["auc_top10_sum_by_seed"]
            summary[f"{s}_seed_spread"] = max(by_seed) - min(by_seed)
        # seed by seed: the same seed's sums side by side
        summary["molds_minus_plain_by_seed"] = [m - p for m, p in zip(summary["molds"]["auc_top10_sum_by_seed"],
                                                                      summary["plain"]["auc_top10_sum_by_seed"])]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
