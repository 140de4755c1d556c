"""How fast each pair architecture learns to copy: the decoder family (a prompt, then its
completion) beside the encoder-decoder (source to target), on the same random token
sequences, width, depth, optimizer and steps.

Why: reaction prediction is mostly copying (a product keeps nearly all of its reactants'
atoms, in an aligned spelling nearly in order), so an architecture that is slow to learn to
copy is slow to learn reactions. The encoder-decoder is also run with BART's fixed
initialization (``init_std`` 0.02) to show what its width-aware one changes.

One process, on the CPU, about a minute a model on 2 cores. The final line is JSON:
``steps_to_copy`` is the first logged step whose loss is under ``--threshold`` nats a token
(null: not within ``--steps``). The uniform guess over the sequence tokens scores ln(V - 6).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BOS, EOS, SEP, FIRST = 2, 3, 5, 6  # token ids of the batches below; sequence tokens are FIRST..V-1


def batches(args):
    import torch

    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.steps):
        yield torch.randint(FIRST, args.vocab, (args.batch, args.length), generator=g)


def decoder_loss(model, src):
    """``BOS src SEP src EOS``, scored on the second ``src EOS`` only."""
    import torch
    import torch.nn.functional as F

    n, length = src.shape
    seq = torch.cat([torch.full((n, 1), BOS), src, torch.full((n, 1), SEP), src, torch.full((n, 1), EOS)], 1)
    labels = seq[:, 1:].clone()
    labels[:, :length + 1] = -100
    logits = model(seq[:, :-1])["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


def seq2seq_loss(model, src):
    """The encoder reads ``BOS src EOS``, the decoder ``BOS src``, scored on ``src EOS``: the
    rows the data plane makes for pairs (``molds.data.bucketing.encoder_decoder_batch``)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from molds.chemistry.tokens import IGNORE_INDEX
    from molds.data.bucketing import encoder_decoder_batch

    rows = [np.concatenate([[BOS], s, [EOS]]) for s in src.numpy()]
    b = encoder_decoder_batch(rows, rows, np.arange(len(rows)), pad=0)
    logits = model(torch.from_numpy(b["input_ids"]), attention_mask=torch.from_numpy(b["attention_mask"]),
                   decoder_input_ids=torch.from_numpy(b["decoder_input_ids"]))["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), torch.from_numpy(b["labels"]).reshape(-1),
                           ignore_index=IGNORE_INDEX)


def build(name: str, args):
    import torch

    torch.manual_seed(args.seed)
    if name == "decoder":
        from molds.models.decoder import CausalDecoder, DecoderConfig

        return CausalDecoder(DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                                           num_heads=args.heads, num_kv_heads=max(1, args.heads // 2),
                                           max_position_embeddings=4 * args.length)), decoder_loss
    from molds.models.seq2seq import Seq2SeqConfig, Seq2SeqModel

    model = Seq2SeqModel(Seq2SeqConfig(vocab_size=args.vocab, hidden_size=args.hidden, encoder_layers=args.layers,
                                       decoder_layers=args.layers, num_heads=args.heads,
                                       intermediate_size=4 * args.hidden, max_position_embeddings=2 * args.length,
                                       dropout=0.0))
    if name == "seq2seq_bart_init":
        model._init_weights(0.02)
    return model, seq2seq_loss


def train(name: str, args) -> dict:
    import torch

    model, loss_of = build(name, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    curve, reached, t0 = [], None, time.perf_counter()
    for step, src in enumerate(batches(args), start=1):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / args.warmup)
        loss = loss_of(model, src)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            curve.append([step, round(loss.item(), 4)])
            if reached is None and loss.item() < args.threshold:
                reached = step
    return {"steps_to_copy": reached, "final_loss": curve[-1][1], "curve": curve,
            "parameters": sum(p.numel() for p in model.parameters()), "train_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["decoder", "seq2seq", "seq2seq_bart_init"],
                    choices=["decoder", "seq2seq", "seq2seq_bart_init"])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--length", type=int, default=30, help="tokens in each sequence to copy")
    ap.add_argument("--vocab", type=int, default=24, help="vocabulary size (sequence tokens: 6..vocab-1)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3, help="decoder blocks; the encoder-decoder has as many on each side")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threshold", type=float, default=0.1)
    ap.add_argument("--log_every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.vocab <= FIRST + 1:
        ap.error(f"--vocab must be above {FIRST + 1}")
    import torch

    from molds.runtime.lifecycle import cpu_description

    torch.set_num_threads(args.threads)
    result = {"steps": args.steps, "length": args.length, "vocab": args.vocab, "hidden": args.hidden,
              "layers": args.layers, "batch": args.batch, "lr": args.lr, "threshold": args.threshold,
              "uniform_loss": round(math.log(args.vocab - FIRST), 4), "cpu": cpu_description(), "models": {}}
    for name in args.models:
        result["models"][name] = train(name, args)
        print(f"{name}: steps_to_copy {result['models'][name]['steps_to_copy']}, "
              f"final loss {result['models'][name]['final_loss']}", file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
