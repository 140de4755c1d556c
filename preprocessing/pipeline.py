"""The ETL driver: runs the stages on an engine and writes the output atomically."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import Counter

import numpy as np

from molds.chemistry.canonical import ChemOptions
from molds.data.inputs import detect_format
from molds.data.manifest import vocab_hash
from .config import PreprocessConfig
from .readers import Columns, InputError, expand_inputs
from .report import write_failure_report, write_outputs
from .split import SPLITS, check_fractions, large_group_size, plan_split
from .stages import (NUM_BUCKETS, StageOptions, evaluation_kept_whole, finalize_partition, load_group_table,
                     partition_smiles, partition_targets, partition_token_counts, partition_train_hashes,
                     reduce_partition, targets_in_two_splits, training_hashes, write_shard)
from .tokenizer import (GRAMMARS, SPECIAL_TOKENS, build_regex_tokenizer, load_external_tokenizer, regex_vocabulary,
                        respelling_tokens, save_tokenizer, train_bpe_tokenizer, vocab_from_counts)


class Progress:
    """Molecules read, per second, and rejected so far, on stderr."""

    def __init__(self, enabled: bool):
        self.bar = None
        self.rows = self.rejected = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(unit=" mol", desc="canonicalize", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)

    def advance(self, rows: int, rejected: int):
        self.rows += rows
        self.rejected += rejected
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix(rejected=self.rejected, refresh=False)

    def stage(self, name: str):
        if self.bar is not None:
            self.bar.set_description(name)
            self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _validate(cfg: PreprocessConfig) -> None:
    if not cfg.input:
        raise ValueError("--input: give at least one input file")
    if not cfg.output:
        raise ValueError("--output: give an output directory")
    check_fractions(cfg.split_fractions)
    if sorted(set(cfg.length_buckets)) != list(cfg.length_buckets) or not cfg.length_buckets:
        raise ValueError(f"--length_buckets must be strictly increasing, got {cfg.length_buckets}")
    if cfg.shard_size_mb <= 0 or min(cfg.chunk_rows, cfg.partition_rows, cfg.row_group_rows) < 1:
        raise ValueError("--shard_size_mb, --chunk_rows, --partition_rows and --row_group_rows must be positive")
    if cfg.tokenizer == "bpe" and not 16 < cfg.bpe_vocab_size <= 65535:
        raise ValueError("--bpe_vocab_size must be in (16, 65535]")
    if not 0 <= cfg.randomized_variants <= 64:
        raise ValueError(f"--randomized_variants must be in [0, 64], got {cfg.randomized_variants}")
    if cfg.randomized_variants and (cfg.representation != "smiles" or cfg.conformers != "none"
                                    or cfg.unit_template is not None):
        raise ValueError("--randomized_variants writes randomized SMILES: it needs --representation smiles, "
                         "--conformers none and no --unit_template")
    if cfg.canonical_first and not (cfg.randomized_variants and cfg.task != "none"):
        raise ValueError("--canonical_first chooses the first of each pair's root-aligned spellings: it needs --task "
                         "and --randomized_variants K")
    given = cfg.unit_template is not None or cfg.conformers == "sd"  # conformers the input holds
    if cfg.conformer_frame != "canonical" and not given:
        raise ValueError("--conformer_frame as_given keeps the frame of a conformer the input holds: it needs "
                         "--unit_template or --conformers sd (ETKDG's frame is arbitrary; its units are always in "
                         "the canonical one)")
    if cfg.conformers_per_molecule < 0:
        raise ValueError(f"--conformers_per_molecule must be 0 (all) or more, got {cfg.conformers_per_molecule}")
    if cfg.conformers_per_molecule != 1 and not given:
        raise ValueError("--conformers_per_molecule keeps several conformers the input holds for one molecule: it "
                         "needs --unit_template or --conformers sd (ETKDG makes one)")
    if cfg.conformer_rank_by is not None and (not given or cfg.conformers_per_molecule == 0):
        raise ValueError("--conformer_rank_by ranks the conformers a molecule keeps: it needs --unit_template or "
                         "--conformers sd, and --conformers_per_molecule other than 0 (0 keeps them all)")
    if cfg.conformer_rank_by is not None and not str(cfg.conformer_rank_by).strip():
        raise ValueError("--conformer_rank_by: give the JSONL key or SD tag of the number to rank by")
    embeds = {"conformer_mmff": (cfg.conformer_mmff, True), "conformer_timeout_s": (cfg.conformer_timeout_s, 2)}
    unused = [key for key, (value, default) in embeds.items() if value != default]
    if unused and cfg.conformers != "etkdg":  # an option that would change nothing is refused, not ignored
        raise ValueError(f"--{unused[0]} sets how --conformers etkdg embeds; "
                         + ("these conformers come from the input" if given else "no conformers are made"))
    if cfg.conformer_decimals != 2 and cfg.conformers == "none" and cfg.unit_template is None:
        raise ValueError("--conformer_decimals sets the digits of conformer units: it needs --conformers or "
                         "--unit_template")
    _check_pairs(cfg)
    _chem_options(cfg)  # the chemistry caps, checked before anything is created
    _representation(cfg)  # the representation's package, asked for by name when it is missing


def _check_pairs(cfg: PreprocessConfig) -> None:
    """The pair options (``--task``, ``--target_column``, ``--reagents``) and ``--split given``."""
    if cfg.split_column is not None and cfg.split != "given":
        raise ValueError(f"--split_column names each row's split: it needs --split given (not {cfg.split})")
    if cfg.split_column is not None and not cfg.split_column.strip():
        raise ValueError("--split_column: give the column naming each row's split")
    if cfg.split == "given" and [float(f) for f in cfg.split_fractions] != [0.8, 0.1, 0.1]:
        raise ValueError(f"--split_fractions {cfg.split_fractions} would change nothing: --split given keeps the "
                         f"input's own split")
    if cfg.task == "none":
        for option, value, default in (("target_column", cfg.target_column, None), ("reagents", cfg.reagents, "auto")):
            if value != default:
                raise ValueError(f"--{option} sets how pairs are read: it needs --task forward, retro or mol2mol")
        return
    if cfg.representation != "smiles" or cfg.conformers != "none" or cfg.unit_template is not None:
        raise ValueError(f"--task {cfg.task} writes pairs of canonical SMILES: it needs --representation smiles, "
                         f"--conformers none and no --unit_template")
    if cfg.dedupe_key != "canonical":
        raise ValueError(f"--task {cfg.task} deduplicates pairs by their canonical sides: it needs --dedupe_key "
                         f"canonical")
    if cfg.target_column is not None and not cfg.target_column.strip():
        raise ValueError("--target_column: give the column holding each pair's target")
    if cfg.target_column is not None and cfg.reagents != "auto":
        raise ValueError("--reagents sets what is done with a reaction's reagents; with --target_column the rows "
                         "are a source and a target, not reactions")


def _check_inputs_for_pairs(cfg: PreprocessConfig, inputs) -> None:
    """What a format cannot give to ``--task``, ``--target_column`` or ``--split given``, said by file."""
    from .split import split_of_file

    for _, path, fmt in inputs:
        if cfg.task != "none" and fmt == "sdf":
            raise InputError(f"--task {cfg.task} reads reaction SMILES or SMILES pairs; {path} is SD records")
        if cfg.target_column is not None and fmt == "smi":
            raise InputError(f"--target_column reads a column; {path} is a .smi file, one SMILES (or reaction) a "
                             f"line (use csv, tsv, parquet or jsonl)")
        if cfg.split_column is not None and fmt == "sdf":
            raise InputError(f"--split_column reads a column; {path} is SD records (name the files by split and "
                             f"leave --split_column out)")
        if cfg.split == "given" and cfg.split_column is None and fmt != "hf" and split_of_file(path) is None:
            raise InputError(f"--split given without --split_column takes each input's split from its name; "
                             f"{path} names none (or several) of train, val / valid / validation / dev, test")


def _pair_options(cfg: PreprocessConfig):
    """The ``molds.chemistry.pairs.PairOptions`` of ``--task``, None for molecules."""
    if cfg.task == "none":
        return None
    from molds.chemistry.pairs import PairOptions

    return PairOptions(task=cfg.task, reagents=cfg.reagents)


def representation_spec(cfg: PreprocessConfig) -> tuple[str, tuple]:
    """(name, options) of what the tokens spell: the representation, or conformer units."""
    if cfg.unit_template is not None:
        if cfg.conformers != "none":
            made = "makes them" if cfg.conformers == "etkdg" else "reads them from SD records"
            raise ValueError(f"--unit_template reads the conformers from JSON-lines fields and --conformers "
                             f"{cfg.conformers} {made}: give one of the two")
        if cfg.representation != "smiles":
            raise ValueError(f"--unit_template writes SMILES conformer units: it needs --representation smiles, "
                             f"not {cfg.representation}")
        return "conformer", (("decimals", cfg.conformer_decimals), ("template", cfg.unit_template),
                             ("frame", cfg.conformer_frame), ("keep_stereo", cfg.keep_stereo))
    if cfg.conformers == "none":
        return cfg.representation, ()
    if cfg.representation != "smiles":
        raise ValueError(f"--conformers {cfg.conformers} writes SMILES conformer units: it needs --representation "
                         f"smiles, not {cfg.representation}")
    if cfg.conformers == "sd":
        return "conformer", (("decimals", cfg.conformer_decimals), ("from_sd", True), ("frame", cfg.conformer_frame))
    options = (("seed", cfg.seed), ("mmff", cfg.conformer_mmff), ("timeout_s", cfg.conformer_timeout_s),
               ("decimals", cfg.conformer_decimals))
    return "conformer", options


def unit_fields(cfg: PreprocessConfig) -> tuple[str, ...]:
    """The JSONL keys ``--unit_template`` names (none without it)."""
    if cfg.unit_template is None:
        return ()
    from molds.chemistry.conformers import UnitTemplate

    return UnitTemplate(cfg.unit_template).fields


def _representation(cfg: PreprocessConfig):
    from molds.chemistry.representation import MissingPackage, get

    name, options = representation_spec(cfg)
    if name == "conformer" and not (1 <= cfg.conformer_timeout_s <= 3600 and 0 <= cfg.conformer_decimals <= 4):
        raise ValueError("--conformer_timeout_s must be in [1, 3600] and --conformer_decimals in [0, 4]")
    try:
        return get(name, **dict(options))
    except MissingPackage as exc:
        raise InputError(f"--representation {cfg.representation}: {exc}") from None
    except ValueError as exc:  # the unit template's own checks, by option name
        raise ValueError(f"--{exc}") from None


def _chem_options(cfg: PreprocessConfig) -> ChemOptions:
    try:
        return ChemOptions(cfg.keep_stereo, cfg.largest_fragment, cfg.uncharge, cfg.normalize, cfg.max_heavy_atoms,
                           cfg.max_smiles_length, cfg.scaffold, cfg.dedupe_key)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


def plan_partitions(spills, target_rows: int) -> list[list[tuple[str, int, int]]]:
    """Contiguous bucket ranges of about ``target_rows`` rows each, as the
    (spill path, first row, row count) slices each reduce task reads."""
    counts = np.zeros(NUM_BUCKETS, dtype=np.int64)
    for _, offsets in spills:
        counts += np.diff(offsets)
    ranges, lo, acc = [], 0, 0
    for b in range(NUM_BUCKETS):
        acc += int(counts[b])
        if acc >= target_rows:
            ranges.append((lo, b + 1))
            lo, acc = b + 1, 0
    if lo < NUM_BUCKETS and acc > 0:
        ranges.append((lo, NUM_BUCKETS))
    return [[(path, int(off[lo]), int(off[hi] - off[lo])) for path, off in spills if off[hi] > off[lo]]
            for lo, hi in ranges]


def _reduce(engine, spills, options, work_dir, cfg, stage):
    total = sum(int(o[-1]) for _, o in spills)
    target = max(1, min(cfg.partition_rows, -(-total // (4 * engine.workers))))
    return engine.run_tasks(reduce_partition, [(pieces, options, work_dir, i, stage)
                                               for i, pieces in enumerate(plan_partitions(spills, target))])


def _make_engine(cfg: PreprocessConfig):
    if cfg.engine == "ray":
        from .ray_engine import RayEngine

        return RayEngine(cfg.workers)
    from .local_engine import LocalEngine

    return LocalEngine(cfg.workers)


def grown_vocabulary(cfg) -> dict[str, int] | None:
    """The vocabulary of ``--tokenizer DIR`` when this run extends it (``--grow_vocab`` and a
    regex tokenizer molds wrote for this representation); None when the tokenizer is used as
    given."""
    if cfg.tokenizer in ("regex", "bpe") or not cfg.grow_vocab:
        return None
    found = regex_vocabulary(cfg.tokenizer)
    if found is None:
        return None
    vocab, pattern = found
    spelled = representation_spec(cfg)[0]
    if pattern != GRAMMARS[spelled].pattern:
        raise InputError(f"--tokenizer {cfg.tokenizer} splits another representation's strings than "
                         f"--representation {spelled}'s")
    return vocab


def _build_tokenizer(cfg, engine, parts, thresholds, map_tokens, tok_dir):
    """Returns (encoder spec, tokenizer manifest block)."""
    method = cfg.split
    spelled = representation_spec(cfg)[0]
    base = grown_vocabulary(cfg)
    # a vocabulary that is extended takes every kept molecule's tokens, so none is refused
    splits = {0} if cfg.vocab_from == "train" and base is None else {0, 1, 2}
    if cfg.tokenizer == "regex" or base is not None:
        if splits == {0, 1, 2}:
            counts = map_tokens or Counter()
        else:
            counts = sum(engine.run_tasks(partition_token_counts, [(p["staged"], p["groups"], method, thresholds,
                                                                    splits, spelled) for p in parts]),
                         Counter())
        # the stored rooted or randomized spellings may need a bond direction, tetrahedral tag or
        # ring number the canonical forms never wrote
        respelled = spelled == "smiles" and cfg.randomized_variants > 0
        vocab = vocab_from_counts(counts, respelling_tokens(counts) if respelled else (), base)
        save_tokenizer(build_regex_tokenizer(vocab, GRAMMARS[spelled]), tok_dir)
        info = {"kind": "regex"} if spelled == "smiles" else {"kind": "regex", "grammar": spelled}
        if base is None:
            return ("regex", vocab, spelled), info
        info["source"] = cfg.tokenizer
        added = sorted((t for t in vocab if t not in base), key=vocab.get)
        if added:
            info["extends"] = {"vocab_hash": vocab_hash(base), "vocab_size": len(base), "added_tokens": added}
        return ("regex", vocab, spelled, len(base)), info
    fast_file = os.path.join(tok_dir, "tokenizer.json")
    if cfg.tokenizer == "bpe":
        def corpus():
            for p in parts:
                yield from partition_smiles(p["staged"], p["groups"], method, thresholds, splits)

        tok = train_bpe_tokenizer(corpus(), cfg.bpe_vocab_size)
        save_tokenizer(tok, tok_dir)
        return ("hf", fast_file, tok.token_to_id(SPECIAL_TOKENS["unk_token"])), {"kind": "bpe"}
    fast = load_external_tokenizer(cfg.tokenizer)
    fast.save_pretrained(tok_dir)
    return ("hf", fast_file, fast.unk_token_id), {"kind": "external", "source": cfg.tokenizer}


def _plan_shards(finals, cfg):
    rows = sum(sum(f["segments"].values()) for f in finals)
    avg_bytes = max(1.0, sum(f["bytes"] for f in finals) / max(1, rows))
    per_shard = max(1, int(cfg.shard_size_mb * (1 << 20) // avg_bytes))
    keys = sorted({k for f in finals for k in f["segments"]})
    plans = []
    for split, lbucket in keys:
        pieces = [(f["path"], f["segment_start"][(split, lbucket)], f["segments"][(split, lbucket)])
                  for f in finals if (split, lbucket) in f["segments"]]
        total = sum(n for _, _, n in pieces)
        for k in range(-(-total // per_shard)):
            lo, hi = k * per_shard, min(total, (k + 1) * per_shard)
            chosen, pos = [], 0
            for path, start, n in pieces:
                a, b = max(lo, pos), min(hi, pos + n)
                if b > a:
                    chosen.append((path, start + a - pos, b - a))
                pos += n
            uri = f"{SPLITS[split]}/{SPLITS[split]}-b{lbucket:02d}-{k:05d}.parquet"
            plans.append((SPLITS[split], lbucket, uri, chosen))
    return plans


def run(cfg: PreprocessConfig) -> str:
    """Run the whole ETL; returns the path of the written manifest."""
    _validate(cfg)
    started = time.time()
    paths = expand_inputs(cfg.input)
    inputs = [(i, p, detect_format(p, cfg.input_format)) for i, p in enumerate(paths)]
    if cfg.unit_template is not None and any(fmt != "jsonl" for _, _, fmt in inputs):
        other = next((p, fmt) for _, p, fmt in inputs if fmt != "jsonl")
        raise InputError(f"--unit_template reads the fields of JSON-lines records; {other[0]} is {other[1]}")
    if cfg.conformers == "sd" and any(fmt != "sdf" for _, _, fmt in inputs):
        other = next((p, fmt) for _, p, fmt in inputs if fmt != "sdf")
        raise InputError(f"--conformers sd reads the 3D coordinates of SD records; {other[0]} is {other[1]}")
    _check_inputs_for_pairs(cfg, inputs)
    final_dir = os.path.abspath(cfg.output)
    if os.path.exists(final_dir) and not cfg.overwrite:
        raise FileExistsError(f"--output {cfg.output} exists; pass --overwrite true to replace it")
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = f"{final_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    work_dir = os.path.join(cfg.work_dir, f"molds-etl-{os.getpid()}") if cfg.work_dir else os.path.join(tmp_dir, "_work")
    os.makedirs(work_dir, exist_ok=True)
    chem = _chem_options(cfg)
    spelled, spelled_options = representation_spec(cfg)
    roles = (((cfg.target_column, "target"),) if cfg.target_column is not None else ()) + \
        (((cfg.split_column, "split"),) if cfg.split_column is not None else ())
    options = StageOptions(chem=chem, split=cfg.split, seed=cfg.seed, num_labels=len(cfg.label_columns),
                           check_regex=cfg.tokenizer == "regex" or grown_vocabulary(cfg) is not None,
                           two_stage=cfg.dedupe_key == "inchikey" and cfg.split not in ("random", "given"),
                           columns=Columns(cfg.smiles_column, cfg.id_column,
                                           tuple(cfg.label_columns) + tuple(name for name, _ in roles),
                                           unit_fields(cfg), cfg.conformer_rank_by, roles),
                           representation=spelled, representation_options=spelled_options, decimal=cfg.decimal,
                           per_molecule=cfg.conformers_per_molecule, pairs=_pair_options(cfg),
                           pair_target=cfg.target_column is not None,
                           split_from=None if cfg.split != "given" else "column" if cfg.split_column else "file")
    cols = options.columns
    engine = _make_engine(cfg)
    signal_guard = _InterruptOnTerm()  # SIGTERM unwinds like Ctrl-C, so the temporary output is removed
    progress = Progress(cfg.progress)
    timings = {}
    stats = None  # every row read, once the map stage has read them all
    try:
        t = time.time()
        spills, stats, map_tokens = engine.map_inputs(inputs, cols, cfg, options, work_dir, progress)
        timings["map_s"] = time.time() - t

        t = time.time()
        progress.stage("deduplicate")
        duplicates = conflicts = 0
        if options.two_stage:
            first = _reduce(engine, spills, options, work_dir, cfg, "regroup")
            duplicates += sum(r["duplicates"] for r in first)
            conflicts += sum(r["label_conflicts"] for r in first)
            spills = [r["spill"] for r in first if "spill" in r]
        parts = _reduce(engine, spills, options, work_dir, cfg, "final")
        duplicates += sum(r["duplicates"] for r in parts)
        conflicts += sum(r["label_conflicts"] for r in parts)
        if cfg.label_columns:
            stats.label_conflicts = conflicts
        parts = [p for p in parts if p["rows"]]
        kept = sum(p["rows"] for p in parts)
        if kept == 0:
            raise InputError(f"no valid molecule in the input ({stats.rows_in} rows, rejected: {dict(stats.rejected)})")
        timings["dedupe_s"] = time.time() - t

        t = time.time()
        progress.stage("split")

        large = None if cfg.split == "given" else large_group_size(cfg.split, kept, cfg.split_fractions)

        def tables():
            for p in parts:
                yield load_group_table(p["groups"], cfg.split, large)

        thresholds = None if cfg.split == "given" else plan_split(tables, kept, cfg.split_fractions, large)
        targets_first = {}  # pairs: each target held by two splits -> the first one, where it stays
        train_hashes = None  # pairs in a given split: the training pairs' hashes, to count what evaluation shares
        if evaluation_kept_whole(options):
            train_hashes = training_hashes(engine.run_tasks(
                partition_train_hashes, [(p["staged"], p["groups"], cfg.split, thresholds) for p in parts]))
        elif options.pairs is not None:
            targets_first = targets_in_two_splits(engine.run_tasks(
                partition_targets, [(p["staged"], p["groups"], cfg.split, thresholds) for p in parts]))
        timings["split_s"] = time.time() - t

        t = time.time()
        progress.stage("tokenize")
        tok_dir = os.path.join(tmp_dir, "tokenizer")
        encoder_spec, tok_info = _build_tokenizer(cfg, engine, parts, thresholds, map_tokens, tok_dir)
        finals = engine.run_tasks(finalize_partition, [(p, cfg.split, thresholds, encoder_spec, cfg.length_buckets,
                                                        cfg.vocab_from, work_dir, spelled,
                                                        (cfg.randomized_variants, cfg.seed, cfg.canonical_first),
                                                        targets_first, train_hashes)
                                                       for p in parts])
        for f in finals:
            stats.merge(f["stats"])
        timings["tokenize_s"] = time.time() - t

        t = time.time()
        progress.stage("write shards")
        plans = _plan_shards(finals, cfg)
        for split in SPLITS:
            os.makedirs(os.path.join(tmp_dir, split), exist_ok=True)
        written = engine.run_tasks(write_shard, [(pieces, os.path.join(tmp_dir, uri), cfg.row_group_rows)
                                                 for _, _, uri, pieces in plans])
        timings["write_s"] = time.time() - t
        timings["total_s"] = time.time() - started
        manifest_path = write_outputs(
            tmp_dir, cfg=cfg, inputs=[p for _, p, _ in inputs], chem=chem, tok_info=tok_info, stats=stats,
            duplicates=duplicates, plans=plans, written=written, finals=finals, timings=timings,
            special_tokens=SPECIAL_TOKENS, representation=_representation(cfg).describe(),
        )
        shutil.rmtree(work_dir, ignore_errors=True)
        _publish(tmp_dir, final_dir)
        if cfg.split != "given":  # a split asked for that received no row: every later use of it fails
            rows = {name: 0 for name in SPLITS}
            for (split, _, _, _), res in zip(plans, written):
                rows[split] += res["num_rows"]
            for name, fraction in zip(SPLITS, check_fractions(cfg.split_fractions)):
                if fraction > 0 and not rows[name]:
                    print(f"[molds-preprocess] warning: the {name} split holds no row (fraction {fraction:g} of "
                          f"{kept:,} rows): too few molecules or {cfg.split} groups for these fractions",
                          file=sys.stderr)
        return os.path.join(final_dir, os.path.basename(manifest_path))
    except BaseException as exc:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        read, where = None, None
        if getattr(exc, "stats", None) is not None:  # a partial read, or an interrupt while reading
            read, where = exc.stats, exc.where
        elif isinstance(exc, KeyboardInterrupt) and stats is not None:  # an interrupt after the reading
            read, where = stats, "every input, read to its end"
        if read is not None and read.rows_in:  # every row read is accounted for
            report = write_failure_report(final_dir, error=str(exc) or "interrupted", stats=read, where=where,
                                          inputs=[p for _, p, _ in inputs])
            if isinstance(exc, KeyboardInterrupt):
                print(f"[molds-preprocess] {exc or 'interrupted'}: {read.rows_in:,} rows read (up to {where}) are "
                      f"accounted in {report}; nothing was written to {cfg.output}", file=sys.stderr, flush=True)
                raise
            raise InputError(f"{exc}; see {report}; nothing was written to {cfg.output}") from exc
        if getattr(exc, "stats", None) is not None and not isinstance(exc, KeyboardInterrupt):
            raise InputError(str(exc.args[0]).split("; 0 rows were read")[0]) from exc
        raise
    finally:
        progress.close()
        engine.close()
        shutil.rmtree(work_dir, ignore_errors=True)
        signal_guard.close()


def _publish(tmp_dir: str, final_dir: str) -> None:
    """Rename the finished directory into place; an old one is removed only after."""
    from molds.runtime.atomic import publish_directory

    publish_directory(tmp_dir, final_dir, durable=True)
    for stale in (final_dir + ".failed-report.json", final_dir + ".failed-report.md"):
        if os.path.exists(stale):
            os.remove(stale)


class _InterruptOnTerm:
    """While the ETL runs, SIGTERM (a scheduler's kill, ``timeout``) raises
    KeyboardInterrupt in the driver, so the cleanup that Ctrl-C gets runs too."""

    def __init__(self):
        import signal
        import threading

        self.previous = None
        if threading.current_thread() is threading.main_thread():
            def handler(signum, frame):
                raise KeyboardInterrupt(f"signal {signum}")

            self.previous = signal.signal(signal.SIGTERM, handler)

    def close(self):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None
