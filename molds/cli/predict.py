"""``molds-predict CHECKPOINT --input FILE``: the top-k predictions of a pair model
(reaction prediction, retrosynthesis, Mol2Mol) for each source in a file.

    molds-predict runs/forward --input reactants.smi --beams 10 --out predictions.csv

The input holds one source a line (reactants for ``forward``, or ``reactants>reagents``; a
product for ``retro``; a molecule for ``mol2mol``), or is a CSV / TSV whose ``--column``
(default: ``smiles``) holds them, or an SD file (a record each), read as ``molds-preprocess``
reads its inputs (compressed, a byte-order mark, UTF-16, Excel's ``sep=`` line, a column name
but for case; an SD record RDKit refuses is a row noting the ETL's reason); canonicalized
as the ETL canonicalized the model's training sources (a forward model's reagents mixed in,
kept apart or dropped as its training pairs had them). The output is a CSV with one row per
prediction: ``row`` (the input's line or row), ``input``, ``rank``, ``prediction``
(canonical molecules), ``score`` (log-probability / length ** length_penalty; with
``--augment K``, the prediction's vote over K spellings of the source), ``text`` (what the
tokens spell) and ``note`` (why an input has no predictions: a molecule RDKit refuses, a
token the vocabulary lacks, too long for the model, ``no_valid_prediction`` when no beam is
a molecule). The predictions are the distinct valid ones in beam order, the candidates
``molds-eval``'s top-k counts (a beam that is no molecule, or that spells the molecules of
an earlier beam again, takes no rank); ``--all_beams`` writes every beam instead, noting
``invalid``, ``unfinished`` or ``repeat``.

For a property model (an encoder with property heads, ``molds-train`` with labels), one row
per input: ``row``, ``input``, ``canonical``, one column per task (the label columns the
model was trained on: a probability for classification, a value in the label's units for
regression) and ``note`` (why an input has no prediction; or that it was cut to the model's
length). ``--augment K``: the mean over the canonical spelling and K - 1 randomized ones.

    molds-predict runs/assay --input molecules.csv --column smiles --augment 8 --out scores.csv
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import sys

from ..chemistry.canonical import ATOM_MAP
from ..chemistry.tasks import TASKS, direction, lineage_block
from ..data.inputs import column_index, delimited_lines, detect_format, is_clean, is_padding, open_sd, open_text
from ..errors import InputError, MoldsError, run_cli
from ..runtime.allocator import bound_peak_memory
from ..runtime.atomic import atomic_file
from . import CHECKPOINT_HELP, new_parser, parse


def build_parser():
    p = new_parser("molds-predict", "The top-k predictions (beam search) of a pair model for each source of a file, "
                                    "or a property model's predictions for each molecule.")
    p.add_argument("checkpoint", type=str, help=CHECKPOINT_HELP)
    p.add_argument("--input", type=str, required=True,
                   help="sources, one a line (.smi/.txt: the first field), a CSV / TSV, or an SD file (a record each, "
                        "row: the line it starts on), read as molds-preprocess reads them (compressed, a byte-order "
                        "mark, UTF-16, Excel's sep= line)")
    p.add_argument("--delimiter", type=str, default=None,
                   help="a CSV's field delimiter when it is not a comma (a tab for .tsv / .tab names; an Excel sep= "
                        "first line is honoured), as molds-preprocess --delimiter")
    p.add_argument("--column", type=str, default=None,
                   help="the CSV / TSV column holding the sources (default: the one named smiles, but for case)")
    p.add_argument("--id_column", type=str, default=None,
                   help="a CSV / TSV column, or an SD tag (_Name: the record's title line), whose value each output "
                        "row carries in an id column, as molds-preprocess --id_column names them")
    p.add_argument("--beams", type=int, default=10, help="predictions per source (the beam width)")
    p.add_argument("--length_penalty", type=float, default=1.0,
                   help="a hypothesis scores log-probability / length ** this")
    p.add_argument("--max_tokens", type=int, default=0,
                   help="tokens per prediction at most (0: 1.5 x the manifest's longest pair + 8, within the model)")
    p.add_argument("--augment", type=int, default=1,
                   help="search each source in this many spellings (itself and others rooted at other atoms) and "
                        "rank the predictions by their votes, R-SMILES's test-time augmentation; score is then the "
                        "vote (1: the source alone)")
    p.add_argument("--seed", type=int, default=0, help="with --augment: the draw of the other spellings")
    p.add_argument("--task", default=None, choices=TASKS,
                   help="the direction you expect the checkpoint to predict in: refused in one line when it was "
                        "trained for another (default: whatever it was trained for, said on the summary line)")
    p.add_argument("--verify_with", type=str, default=None,
                   help="a forward model's run or checkpoint (the model a retro one is checked with): each "
                        "prediction's reactants are given to it, and the rows gain round_trip (yes: its first "
                        "prediction is the input product), forward_prediction and forward_score")
    p.add_argument("--all_beams", action="store_true",
                   help="write every beam as the search found it (a beam that is no molecule, or repeats an earlier "
                        "beam's molecules, noted as such) instead of the distinct valid predictions (--augment "
                        "writes the voted ones)")
    p.add_argument("--batch_size", type=int, default=64, help="sources searched together")
    p.add_argument("--chunk_size", type=int, default=65536,
                   help="a property model: sources read, predicted and written at a time (memory stays that of one "
                        "chunk, whatever the input's size)")
    p.add_argument("--out", type=str, default="-", help="output CSV (-: standard output)")
    return p


def read_sources(path: str, column: str | None, delimiter: str | None = None, id_column: str | None = None) -> list:
    """Every source of the input (``iter_sources``), as a list."""
    return list(iter_sources(path, column, delimiter, id_column))


def iter_sources(path: str, column: str | None, delimiter: str | None = None, id_column: str | None = None):
    """(line, text, note) of each source of the input, one at a time, read as
    ``molds-preprocess`` reads its files (``molds.data.inputs``: compressed by name; UTF-8
    with or without a byte-order mark, UTF-16 / UTF-32 by theirs). A CSV or TSV (by its name,
    or any file given ``--column`` or ``--delimiter``): the column ``--column`` names, else
    one named ``smiles``, found by name, else but for case; Excel's ``sep=`` line honoured; a
    row without the field is a source of no text (noted, not dropped). An SD file (by its
    name): each record RDKit reads, as its SMILES, the line its record starts on; a record it
    refuses has no text and the ETL's reason as its note. Otherwise one source a line, its
    first field. Blank lines and lines of padding (NUL, Ctrl-Z: ``is_padding``) are no
    sources, as for the ETL. ``note`` is None but for a refused SD record. With ``id_column``
    (a CSV / TSV column, found as ``--column`` is; an SD tag, exactly or but for case, or
    ``_Name``, the title line) each source is (line, text, note, id), id '' where a row has
    none; a column no header has, or a tag no record has, is refused in one line."""
    try:
        fmt = detect_format(path)
    except InputError:  # a name the ETL does not know: lines, or a table given --column
        fmt = None
    if fmt not in (None, "csv", "tsv", "smi", "sdf"):
        raise MoldsError(f"{path}: read as {fmt} by its name; molds-predict reads SMILES one a line (.smi, .txt), "
                         f"a CSV / TSV with a SMILES column (--column) or an SD file: write the sources out as one "
                         f"of them")
    try:
        if fmt == "sdf":
            yield from _sd_sources(path, id_column)
        elif fmt in ("csv", "tsv") or column is not None or delimiter is not None:
            yield from _table_sources(path, column, delimiter, id_column)
        else:
            if id_column is not None:
                raise MoldsError(f"{path}: --id_column names a CSV / TSV column or an SD tag; this file is read as "
                                 f"SMILES one a line (give a CSV with --column and --id_column)")
            with open_text(path) as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip() and not is_padding(line):
                        yield n, _readable(line.split()[0]), None
    except (OSError, EOFError, csv.Error) as exc:
        raise MoldsError(f"{path}: cannot read it: {type(exc).__name__}: {exc}") from None


def _sd_sources(path: str, id_column: str | None = None, batch: int = 256):
    """An SD file's records as the ETL splits and reads them (``molds.data.sdf``: one RDKit
    supplier a batch, each record alone where the batch does not align)."""
    from ..data.sdf import (  # RDKit: for an SD input alone
        TITLE_TAG, Misaligned, SDRecordParser, read_sd_records, resolve_tag, sd_tags,
    )

    parser = SDRecordParser(id_column if id_column == TITLE_TAG else None, ())
    seen: set[str] = set()  # the tags of the records read

    def read(records):
        if id_column is not None and id_column != TITLE_TAG:  # the tag as this batch spells it
            tags = sd_tags([d for _, d in records])
            seen.update(tags)
            parser.id_tag = resolve_tag(id_column, tags) or id_column
        try:
            parsed = list(parser.stream([d for _, d in records], [r for r, _ in records]))
        except Misaligned:
            parsed = parser.read_each([d for _, d in records], [r for r, _ in records])
        for (row, _), (mol, _, cid, _) in zip(records, parsed):
            source = (row, "", mol) if isinstance(mol, str) else (row, parser.Chem.MolToSmiles(mol), None)
            yield source if id_column is None else (*source, cid or "")

    def refused(row, reason):
        return (row, "", reason) if id_column is None else (row, "", reason, "")

    with open_sd(path) as fh:
        pending = []
        for row, _, data, reason in read_sd_records(fh):
            if reason is not None:
                yield from read(pending)
                pending = []
                if reason != "padding":
                    yield refused(row, reason)
            else:
                pending.append((row, data))
                if len(pending) == batch:
                    yield from read(pending)
                    pending = []
        yield from read(pending)
    if id_column is not None and id_column != TITLE_TAG and seen and resolve_tag(id_column, seen) is None:
        shown = ", ".join(sorted(seen)[:12]) + (", ..." if len(seen) > 12 else "")
        raise MoldsError(f"{path}: no record has the SD tag {id_column!r} (--id_column; _Name: the title line); "
                         f"its records have {shown}")


#: ``--delimiter`` for a header that seems split by this character
_DELIMITER_HINTS = ((";", "--delimiter ';'"), ("|", "--delimiter '|'"), ("\t", "--delimiter $'\\t'"),
                    (",", "--delimiter ','"))


def _table_sources(path: str, column: str | None, delimiter: str | None, id_column: str | None = None):
    if delimiter is not None and len(delimiter) != 1:
        raise MoldsError(f"--delimiter {delimiter!r}: give one character")
    lines = delimited_lines(path, delimiter)
    first = next(lines, None)
    if first is None:
        return
    try:
        at = column_index(path, first[1], column or "smiles", "SMILES", _DELIMITER_HINTS)
    except InputError as exc:
        if column is not None:
            raise
        raise InputError(f"{exc}: name the column with --column, or, for SMILES one a line without a header, "
                         f"name the file .smi or .txt") from None
    named = column_index(path, first[1], id_column, "id") if id_column is not None else None
    for n, row in lines:
        if row and not (len(row) == 1 and is_padding(row[0])):
            source = (n, _readable(row[at].strip()) if at < len(row) else "", None)
            yield source if named is None else (*source, _readable(row[named].strip()) if named < len(row) else "")


def _readable(text: str) -> str:
    """Bytes that are no UTF-8 (kept by the reader as lone surrogates) as U+FFFD: the source
    is then one RDKit refuses, noted in its row, and the output stays UTF-8."""
    if is_clean(text):
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace").replace("\0", "\ufffd")


def refuse_whole_reactions(path: str, sources: list[tuple], checkpoint: str, trained: dict) -> None:
    """A whole reaction (``reactants>reagents>products``) where a model reads one side is a
    file of the wrong kind: refused in one line that names the first such row, how many
    there are and what the model reads."""
    whole = [(row, text) for row, text, _ in sources if text.count(">") >= 2]
    if whole:
        row, text = whole[0]
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise MoldsError(f"{path} line {row}: {shown!r} is a whole reaction ({len(whole)} of {len(sources)} sources "
                         f"are); {checkpoint} is a {direction(trained)} model: give it {trained['source_format']} "
                         f"alone, one a line")


def run(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    from ..checkpoint import open_checkpoint  # after the parse: --help loads no torch
    from ..eval.pairs import (  # after the parse: --help loads no torch
        distinct,
        encoder_decoder,
        fits,
        predict,
        predict_augmented,
        read_back,
        round_trip,
        sides_of,
        target_budget,
        verifier,
    )

    if args.beams < 1 or args.batch_size < 1 or args.max_tokens < 0 or args.augment < 1 or args.chunk_size < 1:
        raise MoldsError("--beams, --batch_size, --augment and --chunk_size must be >= 1, --max_tokens >= 0")
    args.allocator = bound_peak_memory()  # before the first large allocation: batches of any shape, one after another
    loaded = open_checkpoint(args.checkpoint)
    if loaded.family == "encoder":
        return _properties(args, loaded)
    info = loaded.manifest.pairs
    if info is None or loaded.family not in ("decoder", "seq2seq"):
        raise MoldsError(f"{loaded.checkpoint} is no pair model (its manifest {loaded.manifest.path} holds molecules"
                         f"{'' if info is None else ', its family is ' + loaded.family}); molds-sample samples a "
                         f"molecule model")
    trained = loaded.lineage.get("pairs") or lineage_block(info)
    if args.task is not None and args.task != trained["task"]:
        raise MoldsError(f"{loaded.checkpoint} is a {direction(trained)} model, not a {args.task} one: "
                         f"give a checkpoint trained with molds-preprocess --task {args.task}")
    verify = None
    if args.verify_with:
        verify = open_checkpoint(args.verify_with)
        verifier(loaded, verify)
    sides = sides_of(loaded.manifest)
    sp, tok = loaded.specials, loaded.tokenizer
    limit = loaded.model.config.max_position_embeddings
    seq2seq = encoder_decoder(loaded.model)
    longest = max(int(s.get("max_token_length", 0)) for s in loaded.manifest.data["stats"]["splits"].values())
    sources = read_sources(args.input, args.column, args.delimiter, args.id_column)
    named = {s[0]: s[3] for s in sources} if args.id_column is not None else None  # line -> id
    sources = [s[:3] for s in sources]
    refuse_whole_reactions(args.input, sources, loaded.checkpoint, trained)
    mapped = sum(1 for _, text, _ in sources if ATOM_MAP.search(text))
    if mapped:
        print(f"[molds] {args.input}: atom maps removed from {mapped} of {len(sources)} sources (the model reads "
              f"{trained['source_format']} without them, as molds-preprocess wrote its training pairs)",
              file=sys.stderr)
    notes, ids, texts = {}, {}, {}
    for row, text, note in sources:
        if note is not None:  # an SD record RDKit refuses
            notes[row] = note
            continue
        canonical, reason = sides.source(text)
        if reason is not None:
            notes[row] = reason
            continue
        enc = tok(canonical, add_special_tokens=False)["input_ids"]
        if sp.unk in enc:
            notes[row] = "unknown_token"
        elif not fits(loaded.model, enc):
            notes[row] = "too_long"
        else:
            ids[row], texts[row] = enc, canonical
    rows = sorted(ids)
    if rows and args.augment > 1:
        voted, _, _, _ = predict_augmented(loaded, [texts[r] for r in rows], [ids[r] for r in rows],
                                           augment=args.augment, beams=args.beams, longest_target=longest,
                                           max_tokens=args.max_tokens, length_penalty=args.length_penalty,
                                           batch_size=args.batch_size, seed=args.seed, sides=sides)
        found = dict(zip(rows, voted))
    else:
        hyps = predict(loaded.model, sp, [ids[r] for r in rows], beams=args.beams,
                       max_tokens=target_budget(max(len(v) for v in ids.values()), longest, limit, args.max_tokens,
                                                seq2seq),
                       length_penalty=args.length_penalty, batch_size=args.batch_size) if rows else []
        found = dict(zip(rows, read_back(tok, hyps, sides)))
        if not args.all_beams:  # the candidates molds-eval ranks: each valid set of molecules once, in beam order
            found = {r: distinct(preds) for r, preds in found.items()}
    checks = {}
    if verify is not None:  # each prediction's reactants through the forward model
        checks = dict(zip(rows, round_trip(verify, [texts[r] for r in rows], [found[r] for r in rows],
                                           batch_size=args.batch_size)))
    with _output(args.out) as fh:
        w = csv.writer(fh, lineterminator="\n")
        extra = ["round_trip", "forward_prediction", "forward_score"] if verify is not None else []
        w.writerow(["row", *(["id"] if named is not None else []), "input", "rank", "prediction", "score", "text",
                    *extra, "note"])
        for row, text, _ in sources:
            head = [row, named[row]] if named is not None else [row]
            if row in notes:
                w.writerow([*head, text, "", "", "", "", *[""] * len(extra), notes[row]])
                continue
            if not found[row]:  # every beam was no molecule: the input is still accounted for
                w.writerow([*head, text, "", "", "", "", *[""] * len(extra), "no_valid_prediction"])
                continue
            seen = set()
            for rank, p in enumerate(found[row], 1):
                more = []
                if verify is not None:
                    c = checks[row][rank - 1]
                    more = ["", "", ""] if c is None else \
                        ["yes" if c.back else "no", c.product or "", f"{c.score:.6f}"]
                note = ("unfinished" if not p.ended else "invalid") if not p.side else ("repeat" if p.side in seen else "")
                seen.add(p.side)
                w.writerow([*head, text, rank, p.side or "", f"{p.score:.6f}", p.text, *more, note])
    summary = {"checkpoint": loaded.checkpoint, "task": info.get("task"), "reads": trained["source_format"],
               "writes": trained["target_format"], "inputs": len(sources), "atom_maps_removed": mapped,
               "predicted": len(rows), "refused": dict(sorted(
                   {r: sum(1 for v in notes.values() if v == r) for r in set(notes.values())}.items())),
               "beams": args.beams, "augment": args.augment, "all_beams": args.all_beams,
               "no_valid_prediction": sum(1 for r in rows if not found[r]), "out": args.out}
    if verify is not None:
        from ..eval.pairs import round_trip_accuracy  # after the parse: --help loads no torch

        summary.update(verified_with=verify.checkpoint, **round_trip_accuracy([checks[r] for r in rows]))
    print(f"[molds] {json.dumps(summary)}", file=sys.stderr)
    return 0


def _chunks(items, n: int):
    """Lists of ``n`` consecutive items (the last one shorter), read as they are needed."""
    items = iter(items)
    while chunk := list(itertools.islice(items, n)):
        yield chunk


@contextlib.contextmanager
def _output(out: str):
    """A text file to write the output CSV into as it is made: renamed to ``out`` when the
    block ends without error (nothing at ``out`` otherwise), or standard output for ``-``."""
    if out == "-":
        yield sys.stdout
        return
    with atomic_file(out) as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
        yield fh


def _properties(args, loaded) -> int:
    """An encoder's property predictions, one row per input."""
    from ..eval.properties import predict_properties, task_names  # torch and transformers: loaded only to predict

    if args.verify_with or args.task:
        raise MoldsError(f"{'--verify_with' if args.verify_with else '--task'} is for pair models; "
                         f"{loaded.checkpoint} is a property model")
    if not int(loaded.recipe["model"].get("num_tasks") or 0):
        raise MoldsError(f"{loaded.checkpoint} is an encoder without property heads (model.num_tasks 0): it predicts "
                         f"no property; fork it with labels first (docs/tutorials/fine-tune.md)")
    tasks = task_names(loaded)
    counts = {"inputs": 0, "predicted": 0, "truncated": 0, "spellings": 0, "spellings_skipped": 0}
    refused: dict[str, int] = {}
    # a chunk of sources at a time: memory stays that of one chunk, whatever the input's size;
    # the first read before anything is written, so that a file of the wrong kind writes nothing
    chunks = _chunks(iter_sources(args.input, args.column, args.delimiter, args.id_column), args.chunk_size)
    first = next(chunks, [])
    with _output(args.out) as fh:
        w = csv.writer(fh, lineterminator="\n")
        named = args.id_column is not None
        w.writerow(["row", *(["id"] if named else []), "input", "canonical", *tasks, "note"])
        for chunk in itertools.chain([first] if first else [], chunks):
            found = predict_properties(loaded, [s[1] for s in chunk], augment=args.augment, seed=args.seed)
            for i, (row, text, note, *cid) in enumerate(chunk):
                values = found.values.get(i)
                note = note or found.notes.get(i, "")  # an SD record RDKit refused: the ETL's reason
                if values is None:
                    refused[note] = refused.get(note, 0) + 1
                w.writerow([row, *cid, text, found.canonical.get(i, ""),
                            *([f"{v:.9g}" for v in values] if values is not None else [""] * len(tasks)), note])
            for key, n in (("inputs", len(chunk)), ("predicted", len(found.values)), ("truncated", found.truncated),
                           ("spellings", found.spellings), ("spellings_skipped", found.spellings_skipped)):
                counts[key] += n
    summary = {"checkpoint": loaded.checkpoint, "tasks": tasks, "task_type": loaded.recipe["model"]["task_type"],
               "inputs": counts["inputs"], "predicted": counts["predicted"], "refused": dict(sorted(refused.items())),
               "truncated": counts["truncated"], "augment": args.augment, "spellings": counts["spellings"],
               "spellings_skipped": counts["spellings_skipped"], "allocator": args.allocator, "out": args.out}
    print(f"[molds] {json.dumps(summary)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("molds-predict", run, argv)


if __name__ == "__main__":
    sys.exit(main())
