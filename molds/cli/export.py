"""``molds-export CHECKPOINT OUT``: a checkpoint as a Hugging Face model directory.

    molds-export runs/smoke-dense-zero2 runs/smoke-dense-zero2/hf
"""

from __future__ import annotations

import sys

from ..errors import run_cli
from . import CHECKPOINT_HELP, new_parser, parse


def build_parser():
    p = new_parser("molds-export", "Write a checkpoint as a Hugging Face model directory (safetensors, config, "
                                   "the manifest's tokenizer) that transformers loads without molds.")
    p.add_argument("checkpoint", type=str, help=CHECKPOINT_HELP)
    p.add_argument("out", type=str, help="output directory (replaced atomically if it exists)")
    p.add_argument("--manifest", type=str, default=None,
                   help="take the tokenizer from this manifest (default: the one the checkpoint trained on)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the exported weights' dtype (float32: as trained)")
    return p


def run(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    from ..export import export  # after the parse: --help loads no torch

    print(export(args.checkpoint, args.out, manifest_dir=args.manifest, dtype=args.dtype))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("molds-export", run, argv)


if __name__ == "__main__":
    sys.exit(main())
