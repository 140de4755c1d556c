"""Sampling SMILES from a causal decoder, and ``molds-sample CHECKPOINT``.

    molds-sample runs/gpt-moses/checkpoints/step-2000 --num 10000 --temperature 1.0 --top_k 0 --out samples.smi

Every sample starts from the beginning-of-sequence token and is decoded with a
key/value cache (``CausalDecoder.decode``) until its end token or ``max_tokens``; one
that never ends is reported as unfinished (None: invalid for the metrics, an empty line
in the output file). Sampling is seeded: the same checkpoint, seed and settings give the
same molecules. The same function samples during training, on every rank at once:
``stop_together`` lets ranks agree on when a batch is finished, so that under ZeRO-3
(where each forward gathers parameters collectively) no rank leaves early.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch


@torch.no_grad()
def sample_ids(model, num: int, *, bos: int, eos: int, max_tokens: int, temperature: float = 1.0, top_k: int = 0,
               batch_size: int = 512, seed: int = 0, device=None,
               stop_together: Callable[[bool], bool] | None = None) -> list[list[int] | None]:
    """``num`` token-id lists (without bos/eos), or None for a sample that never ended."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    device = device or next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = len(model.model.layers)
    out: list[list[int] | None] = []
    while len(out) < num:
        n = min(batch_size, num - len(out))
        cache = [{} for _ in range(layers)]
        logits = model.decode(torch.full((n, 1), bos, dtype=torch.long, device=device), cache, 0)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        steps = []
        for t in range(max_tokens):
            logits = logits.float() / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1)
            nxt = nxt.masked_fill(done, eos)
            steps.append(nxt)
            done |= nxt == eos
            finished = bool(done.all())
            if (stop_together(finished) if stop_together else finished) or t == max_tokens - 1:
                break
            logits = model.decode(nxt[:, None], cache, t + 1)
        ids = torch.stack(steps, 1).tolist()
        for row in ids:
            out.append(row[:row.index(eos)] if eos in row else None)
    return out


def ids_to_smiles(tokenizer, samples: list[list[int] | None]) -> list[str | None]:
    """Decoded SMILES; None for an unfinished sample or one holding a special token
    (<pad>, <mask>, ... inside a molecule is not a molecule)."""
    special = set(tokenizer.all_special_ids)
    return [None if ids is None or special.intersection(ids) else tokenizer.decode(ids).replace(" ", "")
            for ids in samples]


def default_max_tokens(manifest, model_max_positions: int) -> int:
    """Room for the longest training molecule plus a margin, within the model's positions."""
    longest = manifest.data["stats"]["splits"]["train"].get("max_token_length") or model_max_positions
    return max(1, min(model_max_positions - 1, int(longest * 1.5) + 8))


def main(argv: list[str] | None = None) -> int:
    from molds.eval.evaluate import load_model

    ap = argparse.ArgumentParser(prog="molds-sample", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory (runs/NAME/checkpoints/step-N)")
    ap.add_argument("--num", type=int, default=10000)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top_k", "--top-k", type=int, default=0, help="0: the full distribution")
    ap.add_argument("--max_tokens", type=int, default=0, help="0: from the manifest's longest training molecule")
    ap.add_argument("--batch_size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="-", help="output file, one SMILES per line (-: stdout)")
    args = ap.parse_args(argv)
    loaded = load_model(args.checkpoint)
    if loaded.family != "decoder":
        raise SystemExit(f"molds-sample: {args.checkpoint} holds an encoder; sampling needs a decoder")
    max_tokens = args.max_tokens or default_max_tokens(loaded.manifest, loaded.model.config.max_position_embeddings)
    ids = sample_ids(loaded.model, args.num, bos=loaded.specials["bos"], eos=loaded.specials["eos"],
                     max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k,
                     batch_size=args.batch_size, seed=args.seed)
    lines = "".join((s or "") + "\n" for s in ids_to_smiles(loaded.tokenizer, ids))
    if args.out == "-":
        sys.stdout.write(lines)
    else:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(lines)
        os.replace(tmp, args.out)
        print(f"[molds] {args.num} samples -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
