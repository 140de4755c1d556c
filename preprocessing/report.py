"""manifest.json, report.md and report.json (timings, rejection examples) of an ETL run."""

from __future__ import annotations

import datetime
import json
import os
import re

from molds import __version__
from molds.data.manifest import FORMAT_VERSION, vocab_hash

from molds.chemistry.canonical import REJECT_REASONS
from molds.data.sdf import LEADING_BLANK_LINES
from .split import SPLITS

_DECIMAL_COMMA = re.compile(r"'\s*[-+]?\d*,\d+\s*'")  # a label example such as ['5,2']


def _merge_hist(finals, split: int) -> list[int]:
    out: list[int] = []
    for f in finals:
        h = f["length_hist"][split]
        if len(h) > len(out):
            out.extend([0] * (len(h) - len(out)))
        for i, v in enumerate(h):
            out[i] += v
    return out


def write_outputs(out_dir, *, cfg, inputs, chem, tok_info, stats, duplicates, plans, written, finals, timings,
                  special_tokens, representation=None) -> str:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(out_dir, "tokenizer", "tokenizer.json")).get_vocab(with_added_tokens=True)
    splits = {name: [] for name in SPLITS}
    for (split, lbucket, uri, _), res in zip(plans, written):
        splits[split].append({"uri": uri, "num_rows": res["num_rows"], "token_count": res["token_count"],
                              "length_bucket": lbucket, "sha256": res["sha256"]})
    rows_out = sum(s["num_rows"] for shards in splits.values() for s in shards)
    rejected = {reason: int(stats.rejected[reason]) for reason in REJECT_REASONS if stats.rejected.get(reason)}
    split_stats = {}
    for i, name in enumerate(SPLITS):
        hist = _merge_hist(finals, i)
        nonzero = [n for n, c in enumerate(hist) if c]
        split_stats[name] = {
            "min_token_length": nonzero[0] if nonzero else 0,
            "max_token_length": nonzero[-1] if nonzero else 0,
            "rows": sum(s["num_rows"] for s in splits[name]),
            "tokens": sum(s["token_count"] for s in splits[name]),
            "groups": sum(f["groups"][i] for f in finals),
            "rows_with_unknown_tokens": sum(f["unknown_rows"][i] for f in finals),
            **({"rows_with_added_tokens": sum(f["added_rows"][i] for f in finals)}
               if "extends" in tok_info else {}),
        }
        if i and any("shared_with_train" in f for f in finals):  # a given split's evaluation pairs, kept whole
            split_stats[name]["shared_with_train"] = {
                kind: sum(f["shared_with_train"][i][kind] for f in finals if "shared_with_train" in f)
                for kind in ("pairs", "sources", "targets")}
    manifest = {
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "generator": {"name": "molds-preprocess", "version": __version__},
        "inputs": {"paths": inputs, "smiles_column": cfg.smiles_column, "id_column": cfg.id_column,
                   **({"target_column": cfg.target_column} if cfg.target_column is not None else {}),
                   **({"split_column": cfg.split_column} if cfg.split_column is not None else {})},
        "canonicalization": chem.describe(),
        "dedupe": {"key": cfg.dedupe_key,
                   "keeps": "first occurrence in input order" if cfg.conformer_rank_by is None else
                   f"the lowest {cfg.conformer_rank_by} first, ties in input order",
                   **({"conformers_per_molecule": cfg.conformers_per_molecule}  # 0: all; identical units once
                      if cfg.conformers_per_molecule != 1 else {}),
                   **({"conformers_ranked_by": cfg.conformer_rank_by} if cfg.conformer_rank_by is not None else {}),
                   **({"labels": "a duplicate's labels go with it, also where they differ from the kept row's "
                                 "(counted: stats.duplicates_with_other_labels)"} if cfg.label_columns else {})},
        "scaffold": {"kind": cfg.scaffold, "include_chirality": False},
        "split": _split_block(cfg),
        "tokenizer": {
            **tok_info,
            "path": "tokenizer",
            "vocab_size": len(vocab),
            "vocab_hash": vocab_hash(vocab),
            "vocab_from": cfg.vocab_from,
            "special_tokens": dict(special_tokens),
            "ids_exclude_special_tokens": True,
        },
        "length_buckets": {"boundaries": list(cfg.length_buckets), "measure": "token_length",
                           "rule": "bucket i holds boundaries[i-1] < token_length <= boundaries[i]; the last is open"},
        "labels": ({"columns": list(cfg.label_columns), "missing": "NaN", "decimal": cfg.decimal}
                   if cfg.label_columns else None),
        "columns": ["compound_id", "raw_smiles", "canonical_smiles", "scaffold", "token_ids", "token_length"]
        + (["labels"] if cfg.label_columns else []) + ["source"],
        "splits": splits,
        "stats": {
            "rows_in": stats.rows_in,
            "rows_out": rows_out,
            "duplicates": int(duplicates),
            **({"duplicates_with_other_labels": int(stats.label_conflicts)}
               if stats.label_conflicts is not None else {}),
            "rejected": rejected,
            "splits": split_stats,
        },
    }
    if cfg.task != "none":  # pairs: both sides' columns instead of one molecule's
        from molds.chemistry.pairs import PairOptions

        manifest["pairs"] = {**PairOptions(cfg.task, cfg.reagents).describe(),
                             "read_from": ("source and target columns" if cfg.target_column is not None
                                           else "reaction SMILES (reactants>reagents>products)"),
                             "targets": ("the given split kept whole: only the training pairs are deduplicated; "
                                         "what an evaluation split shares with training is counted in "
                                         "stats.splits.<split>.shared_with_train, not removed"
                                         if cfg.split == "given" else
                                         "each target in one split: a pair whose target an earlier split holds is "
                                         "refused (target_in_two_splits)")}
        if cfg.target_column is not None:
            del manifest["pairs"]["reagents"]
        manifest["length_buckets"]["measure"] = "token_length = source_length + target_length"
        manifest["columns"] = (["compound_id", "raw_smiles", "source_smiles", "target_smiles", "scaffold",
                                "source_token_ids", "source_length", "target_token_ids", "target_length",
                                "token_length"] + (["labels"] if cfg.label_columns else []) + ["source"])
    if representation and representation.get("name", "smiles") != "smiles":  # SMILES manifests keep their keys
        manifest["representation"] = representation
        manifest["stats"]["representation"] = dict(sorted(stats.notes.items()))
        manifest["columns"].insert(manifest["columns"].index("canonical_smiles") + 1, "text")
    if cfg.randomized_variants:
        from rdkit import rdBase

        manifest["randomized"] = {
            "variants": cfg.randomized_variants, "splits": ["train"], "column": "randomized_token_ids",
            "form": ("root-aligned pairs (R-SMILES): source <sep> target, the source's molecules each rooted at a "
                     "random atom in a random order, the target's molecules rooted at corresponding atoms "
                     "(molds.chemistry.pairs.aligned_spellings)"
                     + ("; the first spelling writes the source canonically" if cfg.canonical_first else "")
                     if cfg.task != "none" else
                     "restricted randomized SMILES (atoms renumbered at random, RDKit MolToSmiles canonical=False)"),
            **({"canonical_first": cfg.canonical_first} if cfg.task != "none" else {}),
            "seed": cfg.seed, "rdkit": rdBase.rdkitVersion,
            "failed": int(stats.notes.get("randomized_failed", 0)),
            "rule": "a spelling RDKit or the vocabulary cannot take is stored as an empty list and read canonical",
        }
        manifest["columns"].insert(manifest["columns"].index("token_length") + 1, "randomized_token_ids")
    if stats.sd_repaired:  # SD records read after dropping blank lines before their header
        manifest["stats"][LEADING_BLANK_LINES] = stats.sd_repaired
    if stats.cxsmiles:  # rows whose SMILES carried a CXSMILES extension, read with it
        manifest["stats"]["cxsmiles_rows"] = stats.cxsmiles
    if stats.truncated:  # --on_truncated keep: where each cut-short input was cut
        manifest["stats"]["truncated_inputs"] = list(stats.truncated)
    accounted = rows_out + manifest["stats"]["duplicates"] + sum(rejected.values())
    if accounted != stats.rows_in:
        raise RuntimeError(f"row accounting broken: {stats.rows_in} in, {accounted} accounted for")
    path = os.path.join(out_dir, "manifest.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2)
        fh.write("\n")
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as fh:
        fh.write(_report(manifest, stats, finals, timings, cfg))
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as fh:
        json.dump({"engine": cfg.engine, "workers": cfg.workers or os.cpu_count(),
                   "timings_s": {k: round(v, 3) for k, v in timings.items()},
                   # glibc's malloc settings the run had (molds-preprocess raises tcache_count)
                   "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
                   "rejected_examples": stats.examples}, fh, indent=2)
    return path


def _split_block(cfg) -> dict:
    """The manifest's ``split``: how rows were split, and what may not straddle two splits."""
    if cfg.split == "given":
        given = f"column {cfg.split_column!r}" if cfg.split_column is not None else "each input's file name"
        return {"method": "given", "from": given, "seed": cfg.seed}
    if cfg.task != "none":
        product = "source" if cfg.task == "retro" else "target"
        group = f"the {product} side (the products)" if cfg.split == "random" else \
            f"the scaffolds of the {product} side (the products)"
    else:
        group = "molecule" if cfg.split == "random" else "scaffold"
    return {"method": cfg.split, "fractions": list(cfg.split_fractions), "seed": cfg.seed, "group": group}


def _report(m, stats, finals, timings, cfg) -> str:
    s = m["stats"]
    grown = "extends" in m["tokenizer"]
    lines = [
        "# molds-preprocess report", "",
        f"- created: {m['created']} by molds {m['generator']['version']}",
        f"- inputs: {', '.join(m['inputs']['paths'])}",
        f"- rows in: {s['rows_in']:,}; written: {s['rows_out']:,}; duplicates: {s['duplicates']:,}; "
        f"rejected: {sum(s['rejected'].values()):,}",
        *([f"- duplicates whose labels differ from the kept row's (the first in input order is kept, its labels "
           f"with it): {s['duplicates_with_other_labels']:,}"] if "duplicates_with_other_labels" in s else []),
        f"- canonicalization: RDKit {m['canonicalization']['rdkit_version']}, options hash "
        f"`{m['canonicalization']['hash'][:16]}`",
        f"- tokenizer: {m['tokenizer']['kind']}, {m['tokenizer']['vocab_size']} tokens "
        f"(from {m['tokenizer']['vocab_from']}), vocab hash `{m['tokenizer']['vocab_hash'][:16]}`",
        *([f"- vocabulary grown: the {m['tokenizer']['extends']['vocab_size']} tokens of `{m['tokenizer']['source']}` "
           f"(vocab hash `{m['tokenizer']['extends']['vocab_hash'][:16]}`, ids unchanged) and "
           f"{len(m['tokenizer']['extends']['added_tokens'])} added after them: "
           + " ".join(f"`{t}`" for t in m["tokenizer"]["extends"]["added_tokens"][:50])
           + (" ..." if len(m["tokenizer"]["extends"]["added_tokens"]) > 50 else "")]
          if "extends" in m["tokenizer"] else []),
        f"- split: {m['split']['method']} {m['split'].get('fractions', m['split'].get('from'))} seed "
        f"{m['split']['seed']}",
        *([f"- pairs: task {m['pairs']['task']}, read from {m['pairs']['read_from']}"
           + (f", reagents {m['pairs']['reagents']}" if "reagents" in m["pairs"] else "")] if "pairs" in m else []),
        *([f"- conformers kept a molecule: {m['dedupe'].get('conformers_per_molecule', 1) or 'all'} (its distinct "
           f"units, {m['dedupe']['keeps']}); the molecule's other conformers are among the duplicates"]
          if "conformers_per_molecule" in m["dedupe"] or "conformers_ranked_by" in m["dedupe"] else []),
        *[f"- **cut short** (compressed input ends early; read up to here, the rest is lost): `{where}`"
          for where in s.get("truncated_inputs", [])],
        *([f"- SD records with blank lines before their header, read without them: {s[LEADING_BLANK_LINES]:,}"]
          if s.get(LEADING_BLANK_LINES) else []),
        *([f"- SMILES read with their CXSMILES extension (`SMILES |...|`; canonical SMILES keep what SMILES "
           f"spell, not its labels, enhanced-stereo groups or coordinates): {s['cxsmiles_rows']:,}"]
          if s.get("cxsmiles_rows") else []), "",
        "## Splits", "", "| split | rows | tokens | groups | shards | rows with unknown tokens |"
        + (" rows with added tokens |" if grown else ""), "|---|---|---|---|---|---|" + ("---|" if grown else ""),
    ]
    for name in SPLITS:
        st = s["splits"][name]
        lines.append(f"| {name} | {st['rows']:,} | {st['tokens']:,} | {st['groups']:,} | {len(m['splits'][name])} | "
                     f"{st['rows_with_unknown_tokens']:,} |"
                     + (f" {st['rows_with_added_tokens']:,} |" if grown else ""))
    shared = [(name, s["splits"][name]["shared_with_train"]) for name in SPLITS
              if "shared_with_train" in s["splits"][name]]
    if shared:
        lines += ["", "Kept as the input split them (`--split given`: only training pairs are deduplicated); "
                      "evaluation rows that share with a training pair:", "",
                  "| split | the same pair | the same source | the same target |", "|---|---|---|---|"]
        lines += [f"| {name} | {c['pairs']:,} | {c['sources']:,} | {c['targets']:,} |" for name, c in shared]
    lines += ["", "## Rejected rows", ""]
    if not s["rejected"]:
        lines.append("None.")
    for reason, count in sorted(s["rejected"].items(), key=lambda kv: -kv[1]):
        lines.append(f"- **{reason}** ({count:,}): {REJECT_REASONS[reason]}")
        for source, raw in stats.examples.get(reason, []):
            lines.append(f"  - `{source}`: `{raw}`" if raw is not None else f"  - `{source}`")
        if reason == "bad_label" and cfg.decimal == "." and any(
                raw and _DECIMAL_COMMA.search(raw) for _, raw in stats.examples.get(reason, [])):
            lines.append("  - values with a decimal comma: `--decimal ,` reads them")
    lines += ["", "## Token lengths (without BOS/EOS)", "", "| length | train | valid | test |", "|---|---|---|---|"]
    hists = [_merge_hist(finals, i) for i in range(3)]
    width = max(len(h) for h in hists)
    step = max(1, -(-width // 25))
    for lo in range(0, width, step):
        cells = [sum(h[lo:lo + step]) for h in hists]
        if any(cells):
            lines.append(f"| {lo}-{lo + step - 1} | " + " | ".join(f"{c:,}" for c in cells) + " |")
    lines += ["", "## Throughput", "", f"- workers: {cfg.workers or os.cpu_count()}, engine: {cfg.engine}"]
    for k, v in timings.items():
        lines.append(f"- {k}: {v:.2f}")
    if timings.get("total_s"):
        lines.append(f"- molecules/s (rows in / total): {s['rows_in'] / timings['total_s']:,.0f}")
    return "\n".join(lines) + "\n"


def write_failure_report(final_dir: str, *, error: str, stats, where: str, inputs: list[str]) -> str:
    """``OUT.failed-report.{json,md}``: every row read before a failure, accounted for
    (canonicalized so far, or rejected with its reason). Nothing else is written."""
    from molds.runtime.atomic import write_json, write_text

    rejected = dict(stats.rejected)
    canonical = stats.rows_in - sum(rejected.values())
    base = final_dir.rstrip("/") + ".failed-report"
    write_json(base + ".json", {"error": error, "read_up_to": where, "inputs": inputs, "rows_in": stats.rows_in,
                                "canonicalized": canonical, "rejected": rejected,
                                "rejected_examples": stats.examples}, indent=2)
    lines = ["# molds-preprocess: failed, nothing written", "", f"- error: {error}", f"- read up to: {where}",
             f"- rows read: {stats.rows_in:,}; canonicalized: {canonical:,}; rejected: {sum(rejected.values()):,}",
             "", "## Rejected rows", ""]
    for reason, count in sorted(rejected.items(), key=lambda kv: -kv[1]):
        lines.append(f"- **{reason}** ({count:,}): {REJECT_REASONS[reason]}")
        for source, raw in stats.examples.get(reason, []):
            lines.append(f"  - `{source}`: `{raw}`" if raw is not None else f"  - `{source}`")
    write_text(base + ".md", "\n".join(lines) + "\n")
    return base + ".md"
