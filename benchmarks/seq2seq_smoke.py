"""The pair smoke recipes as a user runs them, end to end, on the bundled samples: each one
trains under the deepspeed launcher, is interrupted after its first checkpoint, resumes
to the recipe's last step, exports to transformers, and is scored on its held-out split.

    python benchmarks/seq2seq_smoke.py [--recipes seq2seq_forward seq2seq_retro seq2seq_mol2mol
        bart_forward] [--nproc 2] [--num 0] [--beams 10] [--output_dir runs/seq2seq-smoke]

For each ``recipes/smoke/NAME.json``:
1. Data: the ETL command of ``docs/guides/pairs.md`` for the manifest the recipe reads
   (``molds/sample_data/moses_sample_reactions.csv.gz`` as ``forward`` or ``retro``,
   ``moses_sample_mmp.csv.gz`` as ``mol2mol``), split 80/10/10 by the product side's
   scaffolds, into ``--output_dir``.
2. ``deepspeed --num_gpus N molds/train.py --recipe recipes/smoke/NAME.json``. Once the
   first checkpoint is complete the launcher's process group gets SIGTERM (an interrupted
   job), and the same command with ``--checkpoint.resume auto`` trains on to the recipe's
   ``trainer.max_steps``.
3. ``molds-export``; transformers' ``generate(num_beams=k)`` on the export and molds' beam
   search on the checkpoint, for ``--agree`` test sources: how many give the same top k.
4. ``molds-eval``'s top-k exact match (canonical molecules, any order) on the test split
   (``--num`` pairs, 0: all) with ``--beams`` beams.

The encoder-decoder (``bart_forward``) starts, as Chemformer's does, from its denoising
pretraining (``recipes/smoke/bart_pretrain.json``, docs/guides/pairs.md): before step 2, the
sample's molecules that are in no bundled reaction (``make_pairs.py molecules --exclude``)
are preprocessed with the reactions' vocabulary and the pretraining recipe runs to its end;
its first launch then forks it (``--checkpoint.resume PRETRAINED --checkpoint.fork true``).

One JSON line: per recipe the pairs per split, the step the interruption left and the step
the resume reached, the train and test loss, top-1/3/5/10, invalid beams (for mol2mol the
similarity to the source), the export agreement, the seconds of each stage, and the CPU;
each recipe's entry is also written to ``OUTPUT_DIR/NAME.json`` as it ends.
``--max_steps S --interval I`` shorten every recipe (the test's tiny run; its pretraining molecules
keep 2 stored spellings, not 8); with ``--num``, the
shortened run's evaluations search that many test sources too (a pair recipe's own 64 and
200 beam searches would take most of a tiny run's time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SAMPLES = os.path.join(ROOT, "molds", "sample_data")
REACTIONS = ["--input", os.path.join(SAMPLES, "moses_sample_reactions.csv.gz"),
             "--smiles-column", "reactants>reagents>production", "--id-column", "id"]
#: the ETL arguments of each manifest a smoke pair recipe reads (docs/guides/pairs.md, section 1)
DATA = {"reactions-forward": [*REACTIONS, "--task", "forward", "--randomized-variants", "8"],
        "reactions-retro": [*REACTIONS, "--task", "retro", "--randomized-variants", "8"],
        "mmp": ["--input", os.path.join(SAMPLES, "moses_sample_mmp.csv.gz"), "--smiles-column", "source",
                "--target-column", "target", "--task", "mol2mol"]}


#: recipes that start from another recipe's run (a fork of its last checkpoint)
STARTS_FROM = {"bart_forward": "bart_pretrain"}


def pretraining_molecules(pairs_manifest: str, out: str, variants: int = 8) -> None:
    """The sample's molecules in no bundled reaction, preprocessed with the pairs' vocabulary
    and ``variants`` stored spellings each (docs/guides/pairs.md, denoising pretraining: 8)."""
    if os.path.exists(os.path.join(out, "manifest.json")):
        return
    from molds.sample_data.make_pairs import main as make_pairs

    csv_path = out + ".csv"
    make_pairs(["molecules", "--exclude", os.path.join(SAMPLES, "moses_sample_reactions.csv.gz"), "--out", csv_path])
    subprocess.run(["molds-preprocess", "--input", csv_path, "--smiles-column", "SMILES", "--split", "scaffold",
                    "--split-fractions", "0.8,0.1,0.1", "--tokenizer", os.path.join(pairs_manifest, "tokenizer"),
                    "--randomized-variants", str(variants), "--workers", "2", "--progress", "false", "--output", out],
                   check=True, stdout=subprocess.DEVNULL)


def pretrain(args, name: str, pairs_manifest: str) -> tuple[str, dict]:
    """Run ``recipes/smoke/NAME.json`` (denoising) to its end on the pretraining molecules;
    its run directory and what it cost."""
    from molds.eval.evaluate import evaluate_checkpoint

    manifest = os.path.join(args.output_dir, "data-pretrain-molecules")
    t0 = time.perf_counter()
    # a shortened run reads a few hundred of them: 2 stored spellings, not the guide's 8 (a quarter of the ETL)
    pretraining_molecules(pairs_manifest, manifest, variants=2 if args.max_steps else 8)
    etl_s = time.perf_counter() - t0
    out = os.path.join(args.output_dir, name)
    seconds, _ = launch(args, os.path.join(ROOT, "recipes", "smoke", f"{name}.json"), manifest, out,
                        "--run.overwrite", "true", "--checkpoint.resume", "null", "--checkpoint.fork", "false")
    report = evaluate_checkpoint(out, split="test", num=0, max_batches=0)
    from molds.data.manifest import Manifest

    return out, {"recipe": f"recipes/smoke/{name}.json", "molecules": Manifest.load(manifest).data["stats"]["splits"][
        "train"]["rows"], "etl_s": round(etl_s, 1), "train_s": round(seconds, 1),
        "test_denoising_loss": round(report["loss"], 4)}


def preprocess(name: str, out: str) -> dict:
    from molds.data.manifest import Manifest

    if not os.path.exists(os.path.join(out, "manifest.json")):
        subprocess.run(["molds-preprocess", *DATA[name], "--split", "scaffold", "--split-fractions", "0.8,0.1,0.1",
                        "--tokenizer", "regex", "--workers", "2", "--progress", "false", "--output", out],
                       check=True, stdout=subprocess.DEVNULL)
    return {s: v["rows"] for s, v in Manifest.load(out).data["stats"]["splits"].items()}


def launch(args, recipe: str, manifest: str, out: str, *extra: str, stop_after_first_checkpoint: bool = False):
    """Run the recipe under the deepspeed launcher; with ``stop_after_first_checkpoint`` send
    the job SIGTERM once a checkpoint is complete. Returns (seconds, what it printed)."""
    from molds.checkpoint.layout import checkpoints_dir, complete_checkpoints
    from molds.runtime.distributed import free_port

    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.nproc),
           "--master_port", str(free_port()), os.path.join(ROOT, "molds", "train.py"), "--recipe", recipe,
           "--data.manifest", manifest, "--run.output_dir", out, "--logging.progress", "false", *extra]
    if args.max_steps:
        cmd += ["--trainer.max_steps", str(args.max_steps), "--checkpoint.interval_steps", str(args.interval),
                "--eval.interval_steps", str(args.interval), "--eval.full_interval_steps", str(args.max_steps),
                "--optim.warmup_steps", "2", "--logging.interval_steps", "1"]
        if args.num:  # the evaluations during the shortened run search as many sources as the final one
            cmd += ["--eval.samples", str(args.num), "--eval.full_samples", str(args.num)]
    log = open(out + ".log", "w" if stop_after_first_checkpoint else "a")
    start = log.tell()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    killed = False
    while proc.poll() is None:
        time.sleep(0.5)
        if stop_after_first_checkpoint and os.path.isdir(checkpoints_dir(out)) and \
                complete_checkpoints(checkpoints_dir(out)):
            os.killpg(proc.pid, signal.SIGTERM)
            killed = True
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            break
    seconds = time.perf_counter() - t0
    log.close()
    with open(out + ".log") as fh:
        fh.seek(start)
        tail = fh.read()  # what this launch printed
    if stop_after_first_checkpoint and not killed:
        raise SystemExit(f"{recipe}: the run ended (exit {proc.returncode}) before it could be interrupted; "
                         f"{out}.log:\n{tail[-4000:]}")
    if not stop_after_first_checkpoint and proc.returncode != 0:
        raise SystemExit(f"{recipe}: the run failed (exit {proc.returncode}); {out}.log:\n{tail[-4000:]}")
    return seconds, tail


def export_agreement(checkpoint: str, manifest: str, out: str, n: int, beams: int) -> dict:
    """Export the checkpoint; for ``n`` test sources, does transformers' generate on the export
    find the top ``beams`` molds' beam search finds (the same tokens, ends and scores)?"""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from molds.checkpoint import open_checkpoint
    from molds.data.manifest import Manifest
    from molds.eval.pairs import generate_exported, predict, split_pairs
    from molds.export import export

    loaded = open_checkpoint(checkpoint)
    sp, seq2seq = loaded.specials, loaded.family == "seq2seq"
    hf_dir = export(checkpoint, out)
    hf = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(hf_dir).eval()
    rows = split_pairs(Manifest.load(manifest), "test", n)
    longest = max(r["target_length"] for r in rows) + 8
    ours = predict(loaded.model, sp, [r["source_token_ids"] for r in rows], beams=beams, max_tokens=longest)
    same, worst = 0, 0.0
    for r, hyps in zip(rows, ours):
        theirs = generate_exported(hf, sp, r["source_token_ids"], beams=beams, max_tokens=longest)
        gap = max(abs(h.score - score) for h, (_, _, score) in zip(hyps, theirs))
        worst = max(worst, gap)
        same += [(h.ids, h.ended) for h in hyps] == [(t, ended) for t, ended, _ in theirs] and gap < 1e-4
    return {"exported_as": type(hf).__name__, "sources": len(rows), "beams": beams, "same_top_k": same,
            "max_score_gap": float(f"{worst:.2g}")}


def smoke(args, name: str) -> dict:
    from molds.checkpoint import read_lineage
    from molds.checkpoint.layout import checkpoints_dir, complete_checkpoints
    from molds.eval.evaluate import evaluate_checkpoint

    recipe = os.path.join(ROOT, "recipes", "smoke", f"{name}.json")
    body = json.load(open(recipe))
    data_name = os.path.basename(body["data"]["manifest"])
    manifest = os.path.join(args.output_dir, f"data-{data_name}")
    t0 = time.perf_counter()
    entry = {"recipe": os.path.relpath(recipe, ROOT), "family": body["model"]["family"], "pairs": preprocess(
        data_name, manifest), "etl_s": round(time.perf_counter() - t0, 1)}
    start = []
    if name in STARTS_FROM:  # its pretraining first, then a fork of it
        pretrained, entry["pretraining"] = pretrain(args, STARTS_FROM[name], manifest)
        start = ["--checkpoint.resume", pretrained, "--checkpoint.fork", "true"]
    out = os.path.join(args.output_dir, name)
    first_s, _ = launch(args, recipe, manifest, out, "--run.overwrite", "true", *start,
                        stop_after_first_checkpoint=True)
    done = complete_checkpoints(checkpoints_dir(out))
    if not done:
        raise SystemExit(f"{name}: no checkpoint before the interruption; see {out}.log")
    entry["interrupted_at_step"] = read_lineage(done[-1])["step"]
    second_s, tail = launch(args, recipe, manifest, out, "--checkpoint.resume", "auto")
    if "resumed from" not in tail:
        raise SystemExit(f"{name}: the second launch did not say it resumed; see {out}.log")
    final = complete_checkpoints(checkpoints_dir(out))[-1]
    entry["resumed_to_step"] = read_lineage(final)["step"]
    entry["train_s"] = round(first_s + second_s, 1)
    logged = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    entry["train_loss_last"] = round([r for r in logged if "train/loss" in r][-1]["train/loss"], 4)
    during = [r for r in logged if "eval/top1" in r]
    if during:
        entry["eval_during_training"] = {k: v for k, v in during[-1].items() if k.startswith("eval/top") or k == "step"}
    t0 = time.perf_counter()
    entry["export"] = export_agreement(final, manifest, os.path.join(out, "hf"), args.agree, min(args.beams, 5))
    entry["export_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    report = evaluate_checkpoint(final, split="test", num=args.num or (1 << 30), beams=args.beams, max_batches=0)
    keep = ("inputs", "top1", "top3", "top5", "top10", "invalid_beams", "invalid_top1", "similarity_to_source",
            "returns_source")
    entry.update(test_loss=round(report["loss"], 4), **{k: report["pairs"][k] for k in keep if k in report["pairs"]})
    entry["eval_s"] = round(time.perf_counter() - t0, 1)
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["seq2seq_forward", "seq2seq_retro", "seq2seq_mol2mol",
                                                     "bart_forward"])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--num", type=int, default=0, help="test pairs scored (0: the whole test split)")
    ap.add_argument("--beams", type=int, default=10)
    ap.add_argument("--agree", type=int, default=20, help="test sources searched on the export and the checkpoint")
    ap.add_argument("--max_steps", type=int, default=0, help="shorten every recipe to this many steps (0: as written)")
    ap.add_argument("--interval", type=int, default=0, help="with --max_steps: checkpoint and evaluate this often")
    ap.add_argument("--output_dir", default=os.path.join(ROOT, "runs", "seq2seq-smoke"))
    args = ap.parse_args(argv)
    if bool(args.max_steps) != bool(args.interval):
        ap.error("--max_steps and --interval go together")
    for name in args.recipes:
        if not os.path.exists(os.path.join(ROOT, "recipes", "smoke", f"{name}.json")):
            ap.error(f"--recipes: no recipes/smoke/{name}.json")
    os.makedirs(args.output_dir, exist_ok=True)
    from molds.runtime.lifecycle import cpu_description

    result = {"nproc": args.nproc, "beams": args.beams, "max_steps": args.max_steps or "as written", "recipes": {},
              "cpu": cpu_description()}
    for name in args.recipes:
        result["recipes"][name] = smoke(args, name)
        with open(os.path.join(args.output_dir, f"{name}.json"), "w") as fh:  # each recipe's entry as it ends
            json.dump(result["recipes"][name], fh)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
