"""molds-preprocess --task: reactions and molecule pairs through the whole ETL, held to RDKit
(each molecule of each side canonicalized alone, from the clean SMILES the reactions were
made of) and to the contracts: every row accounted for, pairs deduplicated as pairs, product
scaffolds in one split, no target in two splits, and the public layouts of USPTO-50k
(``id,class,reactants>reagents>production`` CSVs, one per split) and USPTO-MIT
(``reaction edits`` lines in train.txt / valid.txt / test.txt)."""

from __future__ import annotations

import csv
import json
import os
import random

import pyarrow.parquet as pq
import pytest
from rdkit import Chem
from rdkit.Chem import rdChemReactions

from .conftest import run_etl, sample_smiles

# (name, template making the product from one MOSES molecule, co-reactants, reagents); the
# substrate is the MOSES molecule unless the template runs backwards (``reverse``: the
# template makes the substrate from the MOSES molecule, which is then the product)
TEMPLATES = [
    ("acetylation", "[N;H2,H1;!$(N-C=O);!$(N-S);!a:1]>>CC(=O)[N:1]", "CC(=O)Cl", "CCN(CC)CC", False),
    ("boc_removal", "[N;H2,H1;!$(N-C=O);!$(N-S);!a:1]>>CC(C)(C)OC(=O)[N:1]", "", "O=C(O)C(F)(F)F", True),
    ("o_methylation", "[OH:1][c:2]>>C[O:1][c:2]", "CI", "O=C([O-])[O-].[K+].[K+]", False),
    ("ester_hydrolysis", "[CH3][O:1][C:2]=[O:3]>>[OH:1][C:2]=[O:3]", "", "[Na+].[OH-]", False),
]


def canonical(smiles: str) -> str:
    return Chem.MolToSmiles(Chem.MolFromSmiles(smiles))


def side(*smiles: str) -> str:
    """The reference side: each molecule canonicalized alone by RDKit, in sorted order."""
    return ".".join(sorted(canonical(s) for part in smiles for s in part.split(".") if s))


def spelled(smiles: str, rng: random.Random, mapped: bool) -> str:
    """Another SMILES of the same molecules: random atom order, and atom maps on every atom."""
    out = []
    for part in smiles.split("."):
        mol = Chem.MolFromSmiles(part)
        if mapped:
            for atom in mol.GetAtoms():
                atom.SetAtomMapNum(rng.randint(1, 60))
        out.append(Chem.MolToSmiles(mol, doRandom=True, canonical=False))
    rng.shuffle(out)
    return ".".join(out)


def make_reactions(n_molecules: int, offset: int = 0, sites: int = 1) -> list[dict]:
    """Reactions of real MOSES molecules under the templates: clean reactant, reagent and
    product SMILES with the template's name; ``sites`` > 1 also reacts a molecule at its
    other matching sites (one reactant set, several products)."""
    found = []
    for smiles in sample_smiles(n_molecules, offset):
        mol = Chem.MolFromSmiles(smiles)
        for name, smarts, co, reagents, reverse in TEMPLATES:
            rxn = rdChemReactions.ReactionFromSmarts(smarts)
            made = set()
            for (other,) in rxn.RunReactants((mol,))[:sites]:
                try:
                    Chem.SanitizeMol(other)
                except Exception:  # noqa: BLE001 - a product the template cannot make
                    continue
                other = Chem.MolToSmiles(other)
                if other in made:
                    continue
                made.add(other)
                substrate, product = (other, smiles) if reverse else (smiles, other)
                found.append({"name": name, "reactants": ".".join(filter(None, [substrate, co])),
                              "reagents": reagents, "product": product})
    return found


def written(r: dict, rng: random.Random, mapped: bool) -> str:
    return (f"{spelled(r['reactants'], rng, mapped)}>{spelled(r['reagents'], rng, False) if r['reagents'] else ''}"
            f">{spelled(r['product'], rng, mapped)}")


def shard_rows(out: str, manifest: dict) -> list[dict]:
    rows = []
    for split, shards in manifest["splits"].items():
        for s in shards:
            for row in pq.read_table(os.path.join(out, s["uri"])).to_pylist():
                rows.append({**row, "split": split})
    return rows


def decode(out: str, ids) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer", "tokenizer.json"))
    return "".join(tok.id_to_token(i) for i in ids)


def accounted(m: dict) -> bool:
    s = m["stats"]
    return s["rows_in"] == s["rows_out"] + s["duplicates"] + sum(s["rejected"].values())


@pytest.fixture(scope="module")
def reactions():
    found = make_reactions(600)
    names = {r["name"] for r in found}
    assert len(found) >= 150 and names == {t[0] for t in TEMPLATES}, (len(found), names)
    return found


@pytest.fixture(scope="module")
def uspto_50k(reactions, tmp_path_factory):
    """Three CSVs in USPTO-50k's layout, written with atom maps and random spellings, and
    dirty rows: a duplicate in another spelling, a reaction that is no reaction, an empty
    product side, an unparsable reactant, a product that is also a reactant, and one product
    in train and in test."""
    rng = random.Random(7)
    d = tmp_path_factory.mktemp("uspto50k")
    rows = {"train": [], "val": [], "test": []}
    expected = {}
    for i, r in enumerate(reactions):
        split = "train" if i % 10 < 8 else "val" if i % 10 == 8 else "test"
        rid = f"R{i}"
        rows[split].append([rid, str(TEMPLATES.index(next(t for t in TEMPLATES if t[0] == r["name"])) + 1),
                            written(r, rng, mapped=i % 2 == 0)])
        expected[rid] = (split, r)
    first = reactions[0]
    rows["train"].append(["dup", "1", written(first, rng, mapped=True)])  # the same pair again
    rows["train"].append(["noreaction", "1", "CCO.CC(=O)O"])  # no '>'
    rows["val"].append(["noproduct", "1", f"{first['reactants']}>>"])
    rows["val"].append(["unparsable", "1", "C1CC.CCO>>CCOC"])
    rows["test"].append(["noop", "1", "CCO.CC(=O)O>>CCO"])
    rows["test"].append(["leak", "1", written({**first, "reagents": "CN(C)C=O"}, rng, mapped=False)])
    again = next(r for i, r in enumerate(reactions) if i % 10 == 8)
    rows["val"].append(["valdup", "1", written(again, rng, mapped=False)])  # the first validation pair twice
    for split, body in rows.items():
        with open(d / f"raw_{split}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["id", "class", "reactants>reagents>production"])
            w.writerows(body)
    return d, expected, rows


@pytest.mark.parametrize("task", ["forward", "retro"])
def test_uspto_50k_layout_each_side_equals_rdkit_and_every_row_is_accounted(uspto_50k, task, tmp_path):
    d, expected, rows = uspto_50k
    out = str(tmp_path / "out")
    m = run_etl(out, [str(d / f"raw_{s}.csv") for s in ("train", "val", "test")], task=task,
                smiles_column="reactants>reagents>production", id_column="id", label_columns=["class"],
                split="given")
    assert accounted(m)
    rejected = m["stats"]["rejected"]
    assert rejected == {"not_a_reaction": 1, "empty_side": 1, "parse_error": 1, "no_op_reaction": 1}, rejected
    # the published split kept whole: only training's duplicate goes; the validation pair given
    # twice and the test reaction that repeats a training one stay where the files put them
    assert m["stats"]["duplicates"] == 1
    got = {r["compound_id"]: r for r in shard_rows(out, m)}
    assert "dup" not in got and got["leak"]["split"] == "test" and got["valdup"]["split"] == "valid"
    assert m["stats"]["splits"]["valid"]["rows"] == sum(r[0] in got for r in rows["val"]) == len(rows["val"]) - 2
    # what each evaluation split shares with training, counted from the shards' own rows
    train = [(r["source_smiles"], r["target_smiles"]) for r in got.values() if r["split"] == "train"]
    for split in ("valid", "test"):
        rows_here = [(r["source_smiles"], r["target_smiles"]) for r in got.values() if r["split"] == split]
        assert m["stats"]["splits"][split]["shared_with_train"] == {
            "pairs": sum(p in set(train) for p in rows_here),
            "sources": sum(a in {x for x, _ in train} for a, _ in rows_here),
            "targets": sum(b in {y for _, y in train} for _, b in rows_here)}, split
    # the leak: for retro the same pair as R0 (its reagents are dropped), for forward R0's product
    assert m["stats"]["splits"]["test"]["shared_with_train"]["targets"] >= 1
    assert m["stats"]["splits"]["test"]["shared_with_train"]["pairs"] >= (1 if task == "retro" else 0)
    assert "shared_with_train" not in m["stats"]["splits"]["train"]
    split_name = {"train": "train", "val": "valid", "test": "test"}
    for rid, (split, r) in expected.items():
        row = got[rid]
        assert row["split"] == split_name[split]
        if task == "forward":  # reagents mixed among the reactants
            source, target = side(r["reactants"], r["reagents"]), side(r["product"])
        else:  # reagents dropped
            source, target = side(r["product"]), side(r["reactants"])
        assert (row["source_smiles"], row["target_smiles"]) == (source, target), rid
        assert decode(out, row["source_token_ids"]) == source and decode(out, row["target_token_ids"]) == target
        assert row["token_length"] == row["source_length"] + row["target_length"]
        assert row["source_length"] == len(row["source_token_ids"])
        assert row["labels"] == [float(next(x[1] for x in rows[split] if x[0] == rid))]
    assert m["pairs"]["task"] == task and m["split"] == {"method": "given", "from": "each input's file name",
                                                          "seed": 0}
    assert "canonical_smiles" not in m["columns"] and "source_token_ids" in m["columns"]

    # the pairs molds-eval --num scores: spread over the split, whose shards are length buckets
    # shortest first, not its first (shortest) rows; all of them, in order, when it holds no more
    from molds.data.manifest import Manifest
    from molds.eval.pairs import split_pairs

    train = [r["compound_id"] for r in shard_rows(out, m) if r["split"] == "train"]
    assert len(m["splits"]["train"]) > 2, "one length bucket: the spread is not tested"
    assert [r["compound_id"] for r in split_pairs(Manifest.load(out), "train", len(train) + 5)] == train
    k = len(train) // 5
    at = [train.index(r["compound_id"]) for r in split_pairs(Manifest.load(out), "train", k)]
    gap = -(-len(train) // k)
    assert len(at) == k and at == sorted(set(at)) and at[0] == 0 and at[-1] >= len(train) - gap
    assert all(b - a <= gap for a, b in zip(at, at[1:])), at


def test_uspto_mit_lines_reactions_with_edits(reactions, tmp_path):
    """USPTO-MIT's files: one ``reactants>reagents>products edits`` line per reaction, the
    reagents already among the reactants; the split from the file name."""
    rng = random.Random(3)
    for name, part in (("train", reactions[:60]), ("valid", reactions[60:70]), ("test", reactions[70:80])):
        with open(tmp_path / f"{name}.txt", "w") as fh:
            for r in part:
                mixed = ".".join(filter(None, [r["reactants"], r["reagents"]]))
                fh.write(f"{spelled(mixed, rng, True)}>>{spelled(r['product'], rng, True)} 1-2-1.0;3-4-0.0\n")
    out = str(tmp_path / "out")
    m = run_etl(out, [str(tmp_path / f"{n}.txt") for n in ("train", "valid", "test")], task="forward",
                split="given")
    assert accounted(m) and not m["stats"]["rejected"]
    got = sorted((r["split"], r["source_smiles"], r["target_smiles"]) for r in shard_rows(out, m))
    want = []
    seen = set()
    for name, part in (("train", reactions[:60]), ("valid", reactions[60:70]), ("test", reactions[70:80])):
        for r in part:
            pair = (side(r["reactants"], r["reagents"]), side(r["product"]))
            if name != "train" or pair not in seen:  # training deduplicated; the published evaluation kept whole
                seen.add(pair)
                want.append((name, *pair))
    assert got == sorted(want)


@pytest.mark.parametrize("task,split", [("retro", "random"), ("retro", "scaffold"), ("forward", "random"),
                                        ("mol2mol", "scaffold_random")])
def test_no_product_scaffold_and_no_target_in_two_splits(task, split, tmp_path):
    """Many reactions make one product (one molecule reacted at several sites), and one
    reactant set makes several products: the split keeps each product-side group in one
    split, and a target in two splits stays only in the first; the refusals are counted. Two
    workers and small partitions give the same shards as one worker."""
    reactions = make_reactions(300, offset=600, sites=3)
    rng = random.Random(11)
    (tmp_path / "data").mkdir()  # a folder whose name names no split (pytest's tmp_path names "test")
    path = tmp_path / "data" / "in.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["rxn"] if task != "mol2mol" else ["a", "b"])
        for i, r in enumerate(reactions):
            if task == "mol2mol":  # the substrate to the product: a molecule to a near one
                w.writerow([spelled(r["reactants"].split(".")[0], rng, False), spelled(r["product"], rng, False)])
            else:
                w.writerow([written(r, rng, mapped=i % 3 == 0)])
    columns = {"smiles_column": "a", "target_column": "b"} if task == "mol2mol" else {"smiles_column": "rxn"}
    outs = []
    for workers, chunk in ((1, 10_000), (2, 17)):
        out = str(tmp_path / f"out{workers}")
        m = run_etl(out, [str(path)], task=task, split=split, split_fractions=[0.6, 0.2, 0.2], workers=workers,
                    chunk_rows=chunk, partition_rows=40, **columns)
        assert accounted(m) and set(m["stats"]["rejected"]) <= {"target_in_two_splits"}
        outs.append((out, m))
    (out, m), (out2, m2) = outs
    rows = shard_rows(out, m)
    assert sorted(map(str, rows)) == sorted(map(str, shard_rows(out2, m2)))  # worker-independent
    assert m["stats"]["rejected"] == m2["stats"]["rejected"]
    where_target, where_group = {}, {}
    for r in rows:
        where_target.setdefault(r["target_smiles"], set()).add(r["split"])
        product = r["source_smiles"] if task == "retro" else r["target_smiles"]
        group = product if split == "random" else r["scaffold"]
        where_group.setdefault(group, set()).add(r["split"])
    assert all(len(s) == 1 for s in where_target.values())
    if task != "retro":  # retro's refused rows may split a product group; forward's and mol2mol's cannot
        assert all(len(s) == 1 for s in where_group.values())
    assert {r["split"] for r in rows} == {"train", "valid", "test"}
    # every distinct pair of the input is kept or refused because its target is kept in another split
    if task == "mol2mol":
        pairs = {(side(r["reactants"].split(".")[0]), side(r["product"])) for r in reactions}
    elif task == "retro":
        pairs = {(side(r["product"]), side(r["reactants"])) for r in reactions}
    else:
        pairs = {(side(r["reactants"], r["reagents"]), side(r["product"])) for r in reactions}
    kept = {(r["source_smiles"], r["target_smiles"]) for r in rows}
    assert kept <= pairs and m["stats"]["duplicates"] == len(reactions) - len(pairs)
    refused = m["stats"]["rejected"].get("target_in_two_splits", 0)
    assert len(pairs - kept) == refused and all(t in where_target for _, t in pairs - kept)
    if task == "retro" and split == "random":  # one reactant set reacted at two sites, its products apart
        assert refused > 0
    elif task != "retro":  # a target is a product: its group keeps it in one split
        assert refused == 0


def test_two_columns_with_a_split_column(tmp_path):
    path = tmp_path / "pairs.csv"
    body = [
        ["CCO", "CC=O", "train"],
        ["OCC", "O=CC", "Train"],  # the same pair, spelled otherwise: a duplicate
        ["c1ccccc1O", "COc1ccccc1", "val"],
        ["CCN", "", "test"],  # no target
        ["CCCl", "CCBr", "holdout"],  # no split of that name
        ["CC(=O)O", "CC(=O)OC", "TEST"],
        ["CCC", "CCC1", "train"],  # the target does not parse
    ]
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["src", "tgt", "fold"])
        w.writerows(body)
    out = str(tmp_path / "out")
    m = run_etl(out, [str(path)], task="mol2mol", smiles_column="src", target_column="tgt", split="given",
                split_column="fold")
    assert accounted(m)
    assert m["stats"]["rejected"] == {"empty_side": 1, "bad_split": 1, "parse_error": 1}
    assert m["stats"]["duplicates"] == 1
    got = {(r["split"], r["source_smiles"], r["target_smiles"]) for r in shard_rows(out, m)}
    assert got == {("train", "CCO", "CC=O"), ("valid", "Oc1ccccc1", "COc1ccccc1"), ("test", "CC(=O)O", "COC(C)=O")}
    assert m["inputs"]["target_column"] == "tgt" and m["split"]["from"] == "column 'fold'"
    report = json.load(open(os.path.join(out, "report.json")))
    assert report["rejected_examples"]["bad_split"][0][1] == "holdout"


def test_molecules_split_by_a_column_too(tmp_path):
    path = tmp_path / "mols.csv"
    smiles = sample_smiles(30)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["smiles", "split"])
        for i, s in enumerate(smiles):
            w.writerow([s, ("train", "valid", "test")[i % 3]])
    out = str(tmp_path / "out")
    m = run_etl(out, [str(path)], split="given", split_column="split")
    assert accounted(m) and "pairs" not in m
    for split, shards in m["splits"].items():
        for s in shards:
            for row in pq.read_table(os.path.join(out, s["uri"])).to_pylist():
                i = next(k for k, x in enumerate(smiles) if canonical(x) == row["canonical_smiles"])
                assert ("train", "valid", "test")[i % 3] == split


@pytest.mark.parametrize("options,message", [
    ({"target_column": "b"}, "--target_column sets how pairs are read: it needs --task"),
    ({"reagents": "mix"}, "--reagents sets how pairs are read"),
    ({"split_column": "fold"}, "--split_column names each row's split: it needs --split given"),
    ({"task": "forward", "representation": "selfies"}, "it needs --representation smiles"),
    ({"task": "forward", "dedupe_key": "inchikey"}, "it needs --dedupe_key canonical"),
    ({"task": "mol2mol", "target_column": "b", "reagents": "drop"}, "not reactions"),
    ({"split": "given", "split_column": "b", "split_fractions": [0.5, 0.5]}, "would change nothing"),
])
def test_options_that_do_not_fit_are_refused_by_name(options, message, tmp_path):
    (tmp_path / "a.csv").write_text("smiles,b\nCCO,CC\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        run_etl(str(tmp_path / "out"), [str(tmp_path / "a.csv")], **options)
    assert not os.path.exists(tmp_path / "out")


def test_inputs_that_cannot_give_what_is_asked_are_named(tmp_path):
    from molds.errors import InputError

    (tmp_path / "pairs.smi").write_text("CCO>>CC=O\n")
    (tmp_path / "data").mkdir()  # a folder whose name names no split (pytest's tmp_path names "test")
    (tmp_path / "data" / "uspto.csv").write_text("rxn\nCCO>>CC=O\n")
    with pytest.raises(InputError, match="pairs.smi is a .smi file"):
        run_etl(str(tmp_path / "o1"), [str(tmp_path / "pairs.smi")], task="mol2mol", target_column="b")
    with pytest.raises(InputError, match="uspto.csv names none"):
        run_etl(str(tmp_path / "o2"), [str(tmp_path / "data" / "uspto.csv")], task="forward", smiles_column="rxn",
                split="given")
    with pytest.raises(InputError, match="no target column 'product'"):
        run_etl(str(tmp_path / "o3"), [str(tmp_path / "data" / "uspto.csv")], task="forward", smiles_column="rxn",
                target_column="product")


def test_a_pair_manifest_is_refused_where_molecules_are_read(uspto_50k, tmp_path):
    from molds.errors import ManifestError
    from molds.eval.evaluate import evaluate_samples

    d, _, _ = uspto_50k
    out = str(tmp_path / "out")
    run_etl(out, [str(d / "raw_train.csv")], task="forward", smiles_column="reactants>reagents>production",
            split_fractions=[1.0, 0.0, 0.0])
    (tmp_path / "samples.smi").write_text("CCO\n")
    with pytest.raises(ManifestError, match="shards hold forward pairs .* molds-eval --samples reads molecule"):
        evaluate_samples(str(tmp_path / "samples.smi"), out)


def test_a_target_token_outside_the_train_vocabulary_is_counted_in_its_split(tmp_path):
    """With the vocabulary from train only, a valid pair whose target alone holds a token train
    never saw is kept and counted as a row with unknown tokens; its source is all known."""
    path = tmp_path / "pairs.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["src", "tgt", "fold"])
        w.writerows([["CCO", "CC=O", "train"], ["c1ccccc1O", "COc1ccccc1", "train"], ["CCO", "CC[Se]C", "valid"],
                     ["OCCC", "COCCC", "test"]])
    out = str(tmp_path / "out")
    m = run_etl(out, [str(path)], task="mol2mol", smiles_column="src", target_column="tgt", split="given",
                split_column="fold", vocab_from="train")
    assert accounted(m) and m["stats"]["rows_out"] == 4
    assert [m["stats"]["splits"][s]["rows_with_unknown_tokens"] for s in ("train", "valid", "test")] == [0, 1, 0]
