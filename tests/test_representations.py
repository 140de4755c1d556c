"""A model trained on SELFIES or SAFE strings: the representation flows through training-time
samples, molds-sample (SMILES by default, the strings with --raw), molds-eval (the decoded
molecules are scored; the decodable share beside them) and the HF export (its tokenizer
spells the representation; docs/guides/representations.md says how to decode). Constrained sampling: every
sample starts with its prefix, and the share that keeps the constraint is the share whose
decoded molecule holds the fragments (checked here with RDKit directly)."""

from __future__ import annotations

import json
import os

import pytest

from tests.preprocessing.conftest import run_etl, sample_smiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=["selfies", "safe"])
def trained(request, tmp_path_factory):
    rep = request.param
    d = tmp_path_factory.mktemp(f"rep-{rep}")
    path = d / "in.csv"
    path.write_text("smiles\n" + "\n".join(sample_smiles(1500, offset=4000)) + "\n")
    data = str(d / "data")
    run_etl(data, [str(path)], representation=rep, split="random")
    from molds.train import main

    out = str(d / "run")
    main(["--recipe", os.path.join(ROOT, "recipes", "smoke", "gpt_moses.json"), "--data.manifest", data,
          "--data.seq_len", "256", "--model.hidden_size", "64", "--model.num_layers", "2",
          "--run.output_dir", out, "--trainer.max_steps", "60", "--trainer.precision", "fp32",
          "--eval.interval_steps", "60", "--eval.samples", "32", "--logging.interval_steps", "20"])
    return rep, data, out


def _decode(rep: str, text: str):
    """What the package decodes ``text`` to, RDKit-canonical where RDKit parses it."""
    if rep == "selfies":
        import selfies

        smiles = selfies.decoder(text)
    else:
        import safe

        smiles = safe.decode(text, ignore_errors=True)
    from rdkit import Chem

    mol = Chem.MolFromSmiles(smiles) if smiles else None
    return Chem.MolToSmiles(mol) if mol is not None else smiles


def test_decoded_samples_are_written_canonical():
    from rdkit import Chem

    from molds.chemistry.representation import get
    from molds.eval.sampling import texts_to_smiles

    selfies = get("selfies")
    text, _ = selfies.encode("Oc1ccccc1")
    assert selfies.decode(text) != "Oc1ccccc1"  # the package writes Kekulé SMILES
    assert texts_to_smiles([text, None], selfies, canonical=True) == ["Oc1ccccc1", None]
    assert texts_to_smiles([text], selfies) == [selfies.decode(text)]  # scoring canonicalizes on its own
    safe = get("safe")
    text, _ = safe.encode("CC(=O)Nc1ccc(O)cc1")
    want = Chem.MolToSmiles(Chem.MolFromSmiles("CC(=O)Nc1ccc(O)cc1"))
    assert texts_to_smiles([text], safe, canonical=True) == [want]

    class Unparseable:  # a decoder whose SMILES RDKit refuses: kept as decoded, for evaluation to count
        name = "x"

        def decode(self, text):
            return "C1CC"

    assert texts_to_smiles(["anything"], Unparseable(), canonical=True) == ["C1CC"]
    # SMILES texts stay as the model wrote them
    assert texts_to_smiles(["C1=CC=CC=C1"], canonical=True) == ["C1=CC=CC=C1"]


def test_samples_are_decoded_through_the_representation(trained, tmp_path):
    from molds.cli.sample import main as sample

    rep, data, out = trained
    assert sample([out, "--num", "48", "--seed", "3", "--out", str(tmp_path / "s.smi")]) == 0
    assert sample([out, "--num", "48", "--seed", "3", "--raw", "true", "--out", str(tmp_path / "raw.txt")]) == 0
    smiles = open(tmp_path / "s.smi").read().split("\n")[:-1]
    raw = open(tmp_path / "raw.txt").read().split("\n")[:-1]
    assert len(smiles) == len(raw) == 48
    finished = [(s, t) for s, t in zip(smiles, raw) if t]
    assert len(finished) >= 12, len(finished)  # seen 33 (SELFIES) and 26 (SAFE) of 48 after 60 steps
    for s, t in zip(smiles, raw):
        # what the package decodes the string to, canonical; a sample cut by the limit: an empty line
        assert s == ((_decode(rep, t) or "") if t else ""), (s, t)
    if rep == "selfies":
        assert all(t.startswith("[") for t in raw if t) and all(not s.startswith("[C]") for s in smiles)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    last = [r for r in rows if "eval/validity" in r][-1]
    assert last["eval/validity"] <= last["eval/decodable"] <= 1


def test_molds_eval_scores_decoded_molecules_and_export_says_how_to_decode(trained, tmp_path):
    from transformers import AutoTokenizer

    from molds.cli.evaluate import main as evaluate
    from molds.export import export

    rep, data, out = trained
    assert evaluate([out, "--num", "64", "--max_batches", "2", "--out", str(tmp_path / "ev")]) == 0
    report = json.load(open(tmp_path / "ev" / "eval.json"))
    seed = report["per_seed"][0]
    assert report["sampling"]["representation"] == rep and 0 <= seed["decodable"] <= 1
    assert seed["validity"] <= seed["decodable"] + 1e-9
    assert all(not e.startswith("[C]") for e in report["examples"])  # molecules, not SELFIES symbols
    hf = export(out, str(tmp_path / "hf"))
    card = open(os.path.join(hf, "README.md")).read()
    assert {"selfies": "selfies.decoder", "safe": "safe.decode"}[rep] in card
    tok = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    import pyarrow.parquet as pq

    from molds.data.manifest import Manifest

    row = pq.read_table(Manifest.load(data).shards("train")[0].path).slice(0, 1).to_pylist()[0]
    assert tok(row["text"], add_special_tokens=False)["input_ids"] == row["token_ids"]


def test_randomized_smiles_is_refused_on_another_representation(trained, tmp_path):
    from molds.errors import RecipeError
    from molds.train import main

    rep, data, _ = trained
    with pytest.raises(RecipeError, match=f"spells its molecules in {rep}"):
        main(["--recipe", os.path.join(ROOT, "recipes", "smoke", "gpt_moses.json"), "--data.manifest", data,
              "--run.output_dir", str(tmp_path / "r"), "--trainer.max_steps", "1", "--data.randomized_smiles", "0.5"])


def test_constrained_sampling_starts_every_sample_with_its_prefix(trained, tmp_path, capsys):
    from rdkit import Chem

    from molds.cli.sample import main as sample

    rep, data, out = trained
    if rep == "selfies":
        prefix = "[C][C][O]"
        assert sample([out, "--num", "24", "--prefix", prefix, "--raw", "true", "--out", str(tmp_path / "p.txt")]) == 0
        raw = [t for t in open(tmp_path / "p.txt").read().split("\n")[:-1] if t]
        assert raw and all(t.startswith(prefix) for t in raw)
        assert sample([out, "--num", "4", "--decorate", "[*]c1ccccc1"]) == 2
        assert "needs a model trained on SAFE" in capsys.readouterr().err
        return
    for task, values in (("--decorate", ["[*]c1ccc(N2CCOCC2)cc1"]), ("--linker", ["[*]c1ccccc1", "[*]N1CCOCC1"]),
                         ("--scaffold", ["c1ccc2ncccc2c1"])):
        name = task[2:]
        smi, raw = tmp_path / f"{name}.smi", tmp_path / f"{name}.txt"
        assert sample([out, "--num", "40", task, *values, "--variants", "3", "--out", str(smi)]) == 0
        assert sample([out, "--num", "40", task, *values, "--variants", "3", "--raw", "true", "--out", str(raw)]) == 0
        summary = json.load(open(f"{smi}.constraint.json"))
        texts = open(raw).read().split("\n")[:-1]
        smiles = open(smi).read().split("\n")[:-1]
        # every finished sample begins with a SAFE spelling of the constraint and a '.'
        from molds.chemistry.representation import get
        from molds.eval.constrained import plan

        prefixes = plan(name, values, get("safe"), 3, 0).prefixes
        assert all(any(t.startswith(p) for p in prefixes) for t in texts if t)
        queries = [Chem.DeleteSubstructs(Chem.MolFromSmiles(v), Chem.MolFromSmarts("[#0]")) for v in values]
        kept = 0
        for s in smiles:
            mol = Chem.MolFromSmiles(s) if s else None
            kept += bool(mol is not None and "." not in s and all(mol.HasSubstructMatch(q) for q in queries))
        assert summary["kept"] == kept and summary["samples"] == 40 and summary["constraint"] == name


@pytest.mark.parametrize("trained", ["safe"], indirect=True)  # SAFE's design tasks need a SAFE model
def test_constrained_benchmark_reports_kept_and_chance_shares(trained, tmp_path, capsys):
    import importlib.util

    rep, data, out = trained
    spec = importlib.util.spec_from_file_location("constrained_bench", os.path.join(ROOT, "benchmarks", "constrained.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    capsys.readouterr()
    assert bench.main(["--run", out, "--num", "12", "--variants", "2", "--out", str(tmp_path / "c")]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["representation"] == "safe" and len(line["tasks"]) == len(bench.PANEL)
    for row in line["tasks"]:
        kept = json.load(open(tmp_path / "c" / f"{line['tasks'].index(row):02d}-{row['task']}.smi.constraint.json"))
        assert row["kept_share"] == round(kept["kept_share"], 4) and row["samples"] == 12
        assert 0 <= row["chance_share"] <= 1 and row["distinct_kept"] <= kept["kept"]
    assert line["mean_kept_share"] == round(sum(r["kept_share"] for r in line["tasks"]) / len(line["tasks"]), 4)
