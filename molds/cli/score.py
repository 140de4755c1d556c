"""``molds-score``: score a file of molecules with a scoring definition, before spending a
run on it.

    molds-score --input samples.smi --oracle osimertinib_mpo --out scored.csv
    molds-score --input mols.csv --smiles_column SMILES --scoring goal.json --out scored.csv
    molds-score --oracle median1 --print true          # the definition, as JSON

Writes a CSV: SMILES, total, valid, the reason a molecule scored 0 unmeasured, and each
component's raw value and score. A definition is checked before anything is read (an
unknown component or transform, a SMARTS RDKit cannot read, impossible parameters: one
line naming the key).
"""

from __future__ import annotations

import csv
import io
import json
import sys

from ..errors import MoldsError, run_cli
from ..runtime.atomic import write_text
from . import UsageError, new_parser, parse


def build_parser():
    p = new_parser("molds-score", "Score molecules with a scoring definition (a JSON file or a PMO oracle).")
    p.add_argument("--input", type=str, default=None,
                   help="molecules: a .smi / .txt file (the first field of each line) or a .csv / .tsv "
                        "(--smiles_column), gzipped or not")
    p.add_argument("--smiles_column", type=str, default="smiles", help="the SMILES column of a .csv / .tsv input")
    p.add_argument("--scoring", type=str, default=None, help="a JSON file holding a scoring definition")
    p.add_argument("--oracle", type=str, default=None,
                   help="a PMO oracle by name (molds.scoring.pmo.ORACLES), instead of --scoring")
    p.add_argument("--out", type=str, default="-", help="the CSV to write (-: standard output)")
    p.add_argument("--print", type=bool, default=False, help="print the definition (JSON) and stop")
    return p


def read_smiles(path: str, column: str) -> list[str]:
    """The molecules of a .smi / .txt (first whitespace field; an empty line is an empty
    molecule) or .csv / .tsv file (``column``, matched exactly, else case-insensitively),
    gzipped or not: molds-eval's reader (``molds.eval.evaluate.smiles_cells``)."""
    from ..eval.evaluate import smiles_cells  # here: molds-score --help loads no NumPy

    table, cells = smiles_cells(path, "molecules", need_column=True, column=column)
    return cells if table else [(cell.split() or [""])[0] for cell in cells]


def run(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    from ..scoring import Scorer  # after the parse: --help loads no torch

    if bool(args.scoring) == bool(args.oracle):
        raise UsageError("give one of --scoring FILE and --oracle NAME")
    if args.scoring:
        try:
            with open(args.scoring, encoding="utf-8") as fh:
                definition = json.load(fh)
        except OSError as exc:
            raise MoldsError(f"--scoring {args.scoring}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise MoldsError(f"--scoring {args.scoring}: not valid JSON ({exc})") from None
        where = args.scoring
    else:
        definition, where = {"oracle": args.oracle}, "--oracle"
    scorer = Scorer(definition, where)
    if args.print:
        print(json.dumps(scorer.definition, indent=2))
        return 0
    if not args.input:
        raise UsageError("--input: the molecules to score")
    scores = scorer(read_smiles(args.input, args.smiles_column))
    rows = list(scores.rows())
    fields = ["smiles", "total", "valid", "reason"] + [c for name in scores.components for c in (f"{name}_raw", name)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    if args.out == "-":
        sys.stdout.write(buf.getvalue())
    else:
        write_text(args.out, buf.getvalue())
    n, valid = len(rows), int(scores.valid.sum())
    best = max((r["total"] for r in rows), default=0.0)
    print(f"[molds] {scorer.name}: {n} molecules, {valid} valid, mean score {scores.total.mean() if n else 0:.4f}, "
          f"best {best:.4f}" + (f" -> {args.out}" if args.out != "-" else ""), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("molds-score", run, argv)


if __name__ == "__main__":
    sys.exit(main())
