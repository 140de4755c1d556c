"""molds' beam search (what ``molds-predict`` runs) against transformers' ``generate`` on the
model ``molds-export`` wrote, side by side in one run: the same sources, the same beams, the
same predictions, sources searched per second.

    python benchmarks/predict_speed.py --run RUN [--split test] [--num 64] [--beams 10] [--batch_size 64]
                                       [--rounds 3]

RUN is a pair model's run or checkpoint (a decoder or the encoder-decoder; ``molds-train``
on ``molds-preprocess --task ...``). ``--num`` sources of its manifest's ``--split`` (evenly
spread over it, as ``molds-eval --num`` takes them) are searched, each way once per round, the
rounds interleaved so machine drift hits both:

- ``molds``: ``molds.eval.pairs.predict``, ``--batch_size`` sources at a time, shortest
  first, padded and masked, each input leaving the batch when its search ends, as
  ``molds-predict`` and ``molds-eval`` search;
- ``transformers``: ``generate(num_beams=k, num_return_sequences=k)`` on the export, one
  source a call (``molds.eval.pairs.generate_exported``, the call a user of the export writes;
  with padding, a batch of sources would not give the same beams: the positions and the
  padded keys change the scores), with the forbidden tokens suppressed as molds forbids them.

``same_products``: sources whose top k (tokens, ended or not) are the same both ways, and the
largest score gap. ``sources_per_s``: sources searched a second, over the median round (for
a retrosynthesis model the sources are products); ``predictions_per_s``: that times the
beams. One final JSON line; ``molds_over_transformers`` is molds' rate over transformers'
(the target: at least 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a pair model's run directory or checkpoint")
    ap.add_argument("--num", type=int, default=64, help="sources of --split searched")
    ap.add_argument("--split", default="test", help="the manifest's split the sources come from")
    ap.add_argument("--beams", type=int, default=10)
    ap.add_argument("--batch_size", type=int, default=64, help="molds: sources searched together, at most")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max_tokens", type=int, default=0,
                    help="tokens a prediction may take (0: molds-eval's budget for these sources)")
    args = ap.parse_args(argv)
    if min(args.num, args.beams, args.batch_size, args.rounds) < 1:
        ap.error("--num, --beams, --batch_size and --rounds must be >= 1")

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from molds.checkpoint import open_checkpoint
    from molds.eval.pairs import generate_exported, predict, rows_budget, split_pairs
    from molds.export import export
    from molds.runtime.lifecycle import cpu_description

    loaded = open_checkpoint(args.run)
    if loaded.manifest.pairs is None or loaded.family not in ("decoder", "seq2seq"):
        raise SystemExit(f"{args.run}: not a pair model (molds-train on molds-preprocess --task ...)")
    sp, seq2seq = loaded.specials, loaded.family == "seq2seq"
    rows = split_pairs(loaded.manifest, args.split, args.num)
    if not rows:
        raise SystemExit(f"{loaded.manifest.path}: no {args.split} pairs")
    sources = [r["source_token_ids"] for r in rows]
    max_tokens = rows_budget(rows, loaded.model, args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = export(loaded.checkpoint, os.path.join(tmp, "hf"))
        hf = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(
            hf_dir, local_files_only=True).eval()
    threads = torch.get_num_threads()

    def ours():
        return predict(loaded.model, sp, sources, beams=args.beams, max_tokens=max_tokens,
                       batch_size=args.batch_size)

    def theirs():
        with torch.no_grad():
            return [generate_exported(hf, sp, s, beams=args.beams, max_tokens=max_tokens) for s in sources]

    seconds = {"molds": [], "transformers": []}
    found = {}
    ours(), theirs()  # warm-up: first calls allocate
    for _ in range(args.rounds):
        for name, fn in (("molds", ours), ("transformers", theirs)):
            t = time.perf_counter()
            found[name] = fn()
            seconds[name].append(time.perf_counter() - t)
    same, worst = 0, 0.0
    for hyps, other in zip(found["molds"], found["transformers"]):
        gap = max((abs(h.score - score) for h, (_, _, score) in zip(hyps, other)), default=0.0)
        worst = max(worst, gap)
        same += [(h.ids, h.ended) for h in hyps] == [(t, ended) for t, ended, _ in other] and gap < 1e-4
    # sources searched a second (for retrosynthesis, products; each gives ``beams`` predictions)
    rate = {name: len(sources) / statistics.median(s) for name, s in seconds.items()}
    line = {"benchmark": "predict_speed", "run": os.path.abspath(loaded.checkpoint), "family": loaded.family,
            "task": loaded.manifest.pairs.get("task"), "exported_as": type(hf).__name__, "split": args.split,
            "sources": len(sources),
            "beams": args.beams, "max_tokens": max_tokens, "batch_size": args.batch_size, "rounds": args.rounds,
            "seconds": {k: [round(x, 4) for x in v] for k, v in seconds.items()},
            "sources_per_s": {k: round(v, 3) for k, v in rate.items()},
            "predictions_per_s": {k: round(v * args.beams, 2) for k, v in rate.items()},
            "molds_over_transformers": round(rate["molds"] / rate["transformers"], 3),
            "same_products": same, "max_score_gap": float(f"{worst:.2g}"), "torch_threads": threads,
            "cpu": cpu_description()}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
