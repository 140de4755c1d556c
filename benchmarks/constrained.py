"""SAFE's design tasks on a trained SAFE model: how many samples keep the constraint, and
how many would have kept it by chance.

    python benchmarks/constrained.py --run runs/cpu-moses-safe --num 1000
    python benchmarks/constrained.py --run RUN --tasks tasks.json      # your own panel

Each task is one ``molds-sample RUN --num N --TASK VALUES`` (the command a user runs,
``molds/eval/constrained.py``): ``decorate`` a core at its ``[*]``, complete a
``scaffold``, write a ``linker`` between two fragments. Per task: the share of samples
that keep the constraint (one connected molecule containing the fragments, RDKit
substructure match), the share that are valid, the distinct molecules among those kept,
and the *chance* share: the same keep test over N free samples of the same model, so the
figure shows what the constraint adds. The default panel (below) uses fragments common in
MOSES-like molecules (250-350 Da); ``--tasks FILE`` takes a JSON list of
``{"task": ..., "values": [...]}``. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PANEL = [
    {"task": "decorate", "values": ["[*]c1ccc(N2CCOCC2)cc1"]},  # 4-morpholinophenyl
    {"task": "decorate", "values": ["[*]c1nc2ccccc2s1"]},  # benzothiazol-2-yl
    {"task": "decorate", "values": ["O=C([*])N1CCN(c2ccccc2)CC1"]},  # 4-phenylpiperazine amide
    {"task": "scaffold", "values": ["c1ccc2ncccc2c1"]},  # quinoline
    {"task": "scaffold", "values": ["c1ccc2[nH]ccc2c1"]},  # indole
    {"task": "scaffold", "values": ["C1CNCCN1"]},  # piperazine
    {"task": "linker", "values": ["[*]c1ccccc1", "[*]N1CCOCC1"]},  # phenyl ... morpholine
    {"task": "linker", "values": ["[*]c1ccncc1", "[*]C1CC1"]},  # pyridyl ... cyclopropyl
    {"task": "linker", "values": ["[*]c1ccc(F)cc1", "[*]N1CCCCC1"]},  # 4-fluorophenyl ... piperidine
]


def _lines(path: str) -> list[str]:
    return open(path, encoding="utf-8").read().split("\n")[:-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a SAFE model: run directory or checkpoint (as molds-sample takes)")
    ap.add_argument("--num", type=int, default=1000, help="samples per task, and free samples for the chance share")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", type=int, default=10, help="randomized SAFE spellings of each prefix")
    ap.add_argument("--tasks", default=None, help="JSON file: a list of {task, values} (default: the panel above)")
    ap.add_argument("--out", default=None, help="where the samples go (default: RUN/constrained)")
    args = ap.parse_args(argv)

    from rdkit import Chem, RDLogger

    from molds.checkpoint import open_checkpoint
    from molds.checkpoint.layout import run_directory
    from molds.chemistry.representation import of_manifest
    from molds.cli.sample import main as sample
    from molds.eval.constrained import keeps, plan
    from molds.runtime.lifecycle import cpu_description

    RDLogger.DisableLog("rdApp.*")
    tasks = PANEL if args.tasks is None else json.load(open(args.tasks, encoding="utf-8"))
    out = args.out or os.path.join(run_directory(args.run), "constrained")  # never inside a checkpoint
    os.makedirs(out, exist_ok=True)
    representation = of_manifest(open_checkpoint(args.run).manifest)
    common = ["--num", str(args.num), "--seed", str(args.seed)]

    t0 = time.perf_counter()
    free = os.path.join(out, "free.smi")
    if sample([args.run, *common, "--out", free]):
        raise SystemExit("molds-sample failed on the free samples")
    free_smiles = _lines(free)
    free_s = time.perf_counter() - t0

    rows = []
    for i, spec in enumerate(tasks):
        task, values = spec["task"], list(spec["values"])
        path = os.path.join(out, f"{i:02d}-{task}.smi")
        t0 = time.perf_counter()
        if sample([args.run, *common, f"--{task}", *values, "--variants", str(args.variants), "--out", path]):
            raise SystemExit(f"molds-sample --{task} {' '.join(values)} failed")
        seconds = time.perf_counter() - t0
        summary = json.load(open(path + ".constraint.json", encoding="utf-8"))
        design = plan(task, values, representation, args.variants, args.seed)
        kept = [s for s in _lines(path) if keeps(s, design)]
        assert len(kept) == summary["kept"], (len(kept), summary)  # the CLI's count and this one agree
        distinct = {Chem.MolToSmiles(Chem.MolFromSmiles(s)) for s in kept}
        chance = sum(keeps(s, design) for s in free_smiles)
        rows.append({"task": task, "values": values, "prefixes": summary["prefixes"], "samples": summary["samples"],
                     "kept_share": round(summary["kept_share"], 4),
                     "valid_share": round(summary["valid"] / summary["samples"], 4),
                     "distinct_kept": len(distinct), "chance_share": round(chance / len(free_smiles), 4),
                     "seconds": round(seconds, 1)})
        print(f"[constrained] --{task} {' '.join(values)}: kept {rows[-1]['kept_share']:.3f} "
              f"(chance {rows[-1]['chance_share']:.3f}), valid {rows[-1]['valid_share']:.3f}, "
              f"{len(distinct)} distinct kept", file=sys.stderr)

    def mean(key, task=None):
        values = [r[key] for r in rows if task in (None, r["task"])]
        return round(sum(values) / len(values), 4) if values else None

    print(json.dumps({"cpu": cpu_description(), "run": args.run, "representation": representation.name,
                      "num": args.num, "seed": args.seed, "variants": args.variants, "free_seconds": round(free_s, 1),
                      "tasks": rows, "mean_kept_share": mean("kept_share"), "mean_chance_share": mean("chance_share"),
                      **{f"mean_kept_share_{t}": mean("kept_share", t) for t in ("decorate", "scaffold", "linker")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
