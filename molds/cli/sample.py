"""``molds-sample CHECKPOINT``: SMILES sampled from a decoder checkpoint.

    molds-sample runs/gpt-moses --num 10000 --temperature 1.0 --top_k 0 --out samples.smi
"""

from __future__ import annotations

import sys

from . import CHECKPOINT_HELP, new_parser, parse


def build_parser():
    p = new_parser("molds-sample", "Sample SMILES from a decoder checkpoint, one per line (an empty line: a "
                                   "sample that never ended or holds a special token).")
    p.add_argument("checkpoint", type=str, help=CHECKPOINT_HELP)
    p.add_argument("--num", type=int, default=10000, help="how many samples")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    p.add_argument("--top_k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--max_tokens", type=int, default=0,
                   help="tokens per sample at most (0: 1.5 x the manifest's longest training molecule + 8)")
    p.add_argument("--batch_size", type=int, default=512, help="samples decoded together")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same molecules)")
    p.add_argument("--out", type=str, default="-", help="output file (-: standard output)")
    return p


def run(argv: list[str]) -> int:
    from ..atomic import write_text
    from ..checkpoint import open_checkpoint
    from ..errors import MoldsError
    from ..eval.sampling import default_max_tokens, forbidden_tokens, ids_to_smiles, sample_ids

    args = parse(build_parser(), argv)
    if args.num < 1 or args.temperature <= 0 or args.top_k < 0 or args.batch_size < 1 or args.max_tokens < 0:
        raise MoldsError("--num and --batch_size must be >= 1, --temperature > 0, --top_k and --max_tokens >= 0")
    loaded = open_checkpoint(args.checkpoint)
    if loaded.family != "decoder":
        raise MoldsError(f"{loaded.checkpoint} holds an encoder; sampling needs a decoder")
    max_tokens = args.max_tokens or default_max_tokens(loaded.manifest, loaded.model.config.max_position_embeddings)
    ids = sample_ids(loaded.model, args.num, bos=loaded.specials.bos, eos=loaded.specials.eos,
                     max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k,
                     batch_size=args.batch_size, seed=args.seed, forbid=forbidden_tokens(loaded.recipe, loaded.specials))
    lines = "".join((s or "") + "\n" for s in ids_to_smiles(loaded.tokenizer, ids))
    if args.out == "-":
        sys.stdout.write(lines)
    else:
        write_text(args.out, lines)
        print(f"[molds] {args.num} samples from {loaded.checkpoint} -> {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..errors import run_cli

    return run_cli("molds-sample", run, argv)


if __name__ == "__main__":
    sys.exit(main())
