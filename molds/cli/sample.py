"""``molds-sample CHECKPOINT``: molecules sampled from a decoder checkpoint.

    molds-sample runs/gpt-moses --num 10000 --temperature 1.0 --top_k 0 --out samples.smi
    molds-sample runs/safe --num 1000 --decorate '[*]c1ccc(N2CCOCC2)cc1' --out decorated.smi
    molds-sample runs/safe --linker '[*]c1ccccc1' '[*]N1CCOCC1'    # SAFE's design tasks (molds.eval.constrained)
    molds-sample runs/selfies --raw true                            # the SELFIES strings, not their SMILES

Writes SMILES, whatever the model spells (SELFIES and SAFE are decoded through the
manifest's representation); ``--raw`` writes what the tokens spell instead.
"""

from __future__ import annotations

import json
import sys

from ..chemistry.representation import of_manifest
from ..errors import MoldsError, run_cli
from ..runtime.atomic import write_text
from . import CHECKPOINT_HELP, UsageError, new_parser, parse


def build_parser():
    p = new_parser("molds-sample", "Sample molecules from a decoder checkpoint, one SMILES per line (an empty line: a "
                                   "sample that never ended, holds a special token, or, from a SELFIES or SAFE "
                                   "model, decodes to no SMILES; a SMILES model's invalid SMILES is written as it "
                                   "was sampled, and molds-eval counts it invalid).")
    p.add_argument("checkpoint", type=str, help=CHECKPOINT_HELP)
    p.add_argument("--num", type=int, default=10000, help="how many samples")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    p.add_argument("--top_k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--max_tokens", type=int, default=0,
                   help="tokens per sample at most (0: 1.5 x the manifest's longest training molecule + 8)")
    p.add_argument("--batch_size", type=int, default=512, help="samples decoded together")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same molecules)")
    p.add_argument("--out", type=str, default="-", help="output file (-: standard output)")
    p.add_argument("--raw", type=bool, default=False,
                   help="write what the tokens spell (SELFIES, SAFE) instead of the SMILES it decodes to")
    p.add_argument("--prefix", type=str, default=None,
                   help="every sample starts with this text, in the model's representation")
    p.add_argument("--scaffold", type=str, default=None,
                   help="SAFE models: molecules that contain this scaffold (SMILES; [*] marks where it grows)")
    p.add_argument("--decorate", type=str, default=None,
                   help="SAFE models: side chains for this core at its [*] attachment points")
    p.add_argument("--linker", type=str, nargs=2, default=None, metavar=("FRAG1", "FRAG2"),
                   help="SAFE models: a linker joining two fragments, each with an [*] attachment point")
    p.add_argument("--variants", type=int, default=10,
                   help="constrained tasks: randomized SAFE spellings of each prefix, shared among the samples")
    return p


def _constraint(args):
    given = [(name, getattr(args, name)) for name in ("prefix", "scaffold", "decorate", "linker")
             if getattr(args, name)]
    if len(given) > 1:
        raise UsageError(f"give one of --prefix, --scaffold, --decorate, --linker (got {[n for n, _ in given]})")
    if not given:
        return None
    name, value = given[0]
    return name, list(value) if isinstance(value, (list, tuple)) else [value]


def run(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    from ..checkpoint import open_checkpoint  # after the parse: --help loads no torch
    from ..eval.constrained import keeps, plan, sample_design  # after the parse: --help loads no torch
    from ..eval.sampling import (  # after the parse: --help loads no torch
        default_max_tokens,
        forbidden_tokens,
        ids_to_texts,
        sample_ids,
        texts_to_smiles,
    )

    if args.num < 1 or args.temperature <= 0 or args.top_k < 0 or args.batch_size < 1 or args.max_tokens < 0 \
            or args.variants < 1:
        raise MoldsError("--num, --batch_size and --variants must be >= 1, --temperature > 0, --top_k and "
                         "--max_tokens >= 0")
    loaded = open_checkpoint(args.checkpoint)
    if loaded.manifest.pairs is not None:
        raise MoldsError(f"{loaded.checkpoint} is a {loaded.manifest.pairs.get('task')} pair model: it completes a "
                         f"source, and molds-predict writes its predictions")
    if loaded.family != "decoder":
        raise MoldsError(f"{loaded.checkpoint} holds an encoder; sampling needs a decoder")
    max_tokens = args.max_tokens or default_max_tokens(loaded.manifest, loaded.model.config.max_position_embeddings)
    common = dict(bos=loaded.specials.bos, eos=loaded.specials.eos, max_tokens=max_tokens, temperature=args.temperature,
                  top_k=args.top_k, batch_size=args.batch_size, forbid=forbidden_tokens(loaded.recipe, loaded.specials))
    constraint = _constraint(args)
    if constraint is None:
        design, ids = None, sample_ids(loaded.model, args.num, seed=args.seed, **common)
    else:
        design = plan(*constraint, of_manifest(loaded.manifest), args.variants, args.seed)
        ids = sample_design(loaded.model, loaded.tokenizer, design, args.num, seed=args.seed, **common)
    texts = ids_to_texts(loaded.tokenizer, ids)
    smiles = texts_to_smiles(texts, of_manifest(loaded.manifest), canonical=True)
    lines = "".join((s or "") + "\n" for s in (texts if args.raw else smiles))
    if args.out == "-":
        sys.stdout.write(lines)
    else:
        write_text(args.out, lines)
        print(f"[molds] {args.num} samples from {loaded.checkpoint} -> {args.out}", file=sys.stderr)
    if design is not None:
        from rdkit import Chem, rdBase  # here: molds-sample --help loads no RDKit

        with rdBase.BlockLogs():
            valid = sum(bool(s) and Chem.MolFromSmiles(s) is not None for s in smiles)
        kept = sum(keeps(s, design) for s in smiles)
        summary = {"constraint": design.task, "prefixes": len(design.prefixes), "samples": len(smiles),
                   "valid": valid, "kept": kept, "kept_share": kept / len(smiles), "kept_means": design.what}
        print(f"[molds] --{design.task}: {kept} of {len(smiles)} samples keep {design.what} "
              f"({valid} valid; {len(design.prefixes)} prefixes) {json.dumps(summary)}", file=sys.stderr)
        if args.out != "-":
            write_text(args.out + ".constraint.json", json.dumps(summary, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("molds-sample", run, argv)


if __name__ == "__main__":
    sys.exit(main())
