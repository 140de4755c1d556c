"""Pair models end to end, each test on both families that train on pairs: a decoder (prompt
and completion) and the encoder-decoder (``model.family: seq2seq``). The trainer on the pair
shards, ``molds-predict`` (its inputs canonicalized and tokenized as the ETL did, its rows
the beam search's), ``molds-eval`` (top-k accuracy), and the accuracy rule itself held to
RDKit: a prediction matches when it is the same molecules in any order or spelling."""

from __future__ import annotations

import csv
import io
import json
import os

import pyarrow.parquet as pq
import pytest
from rdkit import Chem

from molds.eval.pairs import Prediction, topk_accuracy

#: how each family reads the pair shards: packed prompt + completion rows, or source / target batches
FAMILIES = {
    "decoder": ({"mode": "packed", "seq_len": 192, "micro_batch_size": 4, "lookahead": 64},
                {"family": "decoder", "num_kv_heads": 2}),
    "seq2seq": ({"mode": "bucketed", "max_length": 192, "max_tokens_per_batch": 768, "bucket_pool": 64},
                {"family": "seq2seq", "dropout": 0.0}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(tmp_path_factory, request):
    from molds.train import main as train
    from tests.data.conftest import pair_manifest

    d = tmp_path_factory.mktemp(f"pairmodel-{request.param}")
    data = pair_manifest(d, 400, "retro")
    data_keys, model_keys = FAMILIES[request.param]
    recipe = {
        "run": {"name": "retro-test", "output_dir": str(d / "run"), "seed": 0},
        "data": {"manifest": data, "too_long": "reject", **data_keys},
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 256, **model_keys},
        "parallel": {"engine": "ddp"},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "trainer": {"max_steps": 12, "precision": "fp32"},
        "checkpoint": {"interval_steps": 12},
        "eval": {"interval_steps": 6, "full_interval_steps": 12, "samples": 4, "full_samples": 6, "beams": 3,
                 "max_batches": 2},
        "logging": {"interval_steps": 4, "tensorboard": False, "progress": False},
    }
    (d / "recipe.json").write_text(json.dumps(recipe))
    result = train(["--recipe", str(d / "recipe.json")])
    return d, data, result["checkpoint"]


def test_a_resumed_pair_run_ends_where_the_uninterrupted_one_does(trained, tmp_path):
    """4 steps, then a resume to 8, give the weights 8 uninterrupted steps give: the pair
    stream's cursor is restored as the molecule stream's is."""
    import torch
    from safetensors.torch import load_file

    from molds.train import main as train

    d, _, _ = trained
    common = ["--recipe", str(d / "recipe.json"), "--eval.interval_steps", "0", "--eval.full_interval_steps", "0",
              "--checkpoint.interval_steps", "4", "--optim.warmup_steps", "0", "--optim.min_lr_ratio", "1.0"]
    # (a constant rate: a run stopped at 4 by max_steps has the schedule a run of 8 has)
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    a = train([*common, "--run.output_dir", whole, "--trainer.max_steps", "8"])
    train([*common, "--run.output_dir", parts, "--trainer.max_steps", "4"])
    b = train([*common, "--run.output_dir", parts, "--trainer.max_steps", "8", "--checkpoint.resume", "auto"])
    wa = load_file(os.path.join(a["checkpoint"], "model.safetensors"))
    wb = load_file(os.path.join(b["checkpoint"], "model.safetensors"))
    assert b["checkpoint"].endswith("step-00000008") and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_predict_writes_each_sources_beams_as_the_search_finds_them(trained, capsys):
    from molds.checkpoint import open_checkpoint
    from molds.cli.predict import main as predict_cli
    from molds.data.manifest import Manifest
    from molds.eval.pairs import predict, read_back

    d, data, checkpoint = trained
    m = Manifest.load(data)
    rows = pq.read_table(m.shards("test")[0].path).to_pylist()[:4]
    lines = []
    for r in rows:  # each source in another spelling: the model must see the ETL's canonical tokens
        mol = Chem.MolFromSmiles(r["source_smiles"])
        lines.append(Chem.MolToSmiles(mol, doRandom=True, canonical=False))
    lines += ["C1CC", "CC[Se]CC>CC"]  # unparsable; a reaction where a product is expected
    (d / "in.smi").write_text("\n".join(lines) + "\n\n")
    out = d / "pred.csv"
    assert predict_cli([checkpoint, "--input", str(d / "in.smi"), "--beams", "3", "--max_tokens", "40",
                        "--all_beams", "--out", str(out)]) == 0
    table = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["note"] for r in table if r["row"] in ("5", "6")] == ["parse_error", "not_a_reaction"]
    assert predict_cli([checkpoint, "--input", str(d / "in.smi"), "--beams", "3", "--max_tokens", "40",
                        "--out", str(d / "distinct.csv")]) == 0
    kept = list(csv.DictReader(open(d / "distinct.csv")))
    loaded = open_checkpoint(checkpoint)
    direct = predict(loaded.model, loaded.specials, [r["source_token_ids"] for r in rows], beams=3, max_tokens=40)
    from molds.chemistry.canonical import ChemOptions
    from molds.chemistry.pairs import PairCanonicalizer, PairOptions

    want = read_back(loaded.tokenizer, direct, PairCanonicalizer(ChemOptions.of_manifest(m), PairOptions("retro")))
    for i, preds in enumerate(want, 1):
        got = [r for r in table if r["row"] == str(i)]
        assert [int(r["rank"]) for r in got] == [1, 2, 3]
        assert [r["text"] for r in got] == [p.text for p in preds]
        assert [float(r["score"]) for r in got] == pytest.approx([p.score for p in preds], abs=1e-5)
        seen = []
        for r, p in zip(got, preds):  # --all_beams notes what the default leaves out
            assert r["note"] == ("repeat" if p.side in seen else "") if p.side else r["note"] in ("invalid", "unfinished")
            seen.append(p.side)
        # by default: each valid set of molecules once, in beam order, ranked from 1 (molds-eval's candidates)
        mine = [r for r in kept if r["row"] == str(i)]
        want_sides = list(dict.fromkeys(p.side for p in preds if p.side))
        if want_sides:
            assert [(int(r["rank"]), r["prediction"]) for r in mine] == list(enumerate(want_sides, 1))
            assert all(r["note"] == "" for r in mine)
        else:
            assert [(r["rank"], r["note"]) for r in mine] == [("", "no_valid_prediction")]
    # the same sources in a CSV with an id column: each output row carries its source's id
    with open(d / "in.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([["smiles", "id"]] + [[s, f"r{i}"] for i, s in enumerate(lines)])
    assert predict_cli([checkpoint, "--input", str(d / "in.csv"), "--id_column", "id", "--beams", "3",
                        "--max_tokens", "40", "--out", str(d / "ids.csv")]) == 0
    named = list(csv.DictReader(open(d / "ids.csv")))
    assert [(int(r["row"]) - 2, r["id"]) for r in named] == [(int(r["id"][1:]), r["id"]) for r in named]
    assert [{k: v for k, v in r.items() if k not in ("row", "id")} for r in named] == \
        [{k: v for k, v in r.items() if k != "row"} for r in kept]


def test_votes_rank_by_best_place_then_by_their_sum():
    """Test-time augmentation's ranking, worked by hand: three spellings' beams (invalid ones
    and a side spelled twice in one list give no vote)."""
    from molds.eval.pairs import vote

    def preds(*sides):
        return [Prediction(s, s or "?", -1.0, True) for s in sides]

    lists = [preds("X", "W", None, "X", "Z"), preds("Y", "W", "X"), preds(None, "Z", "W")]
    # places: X 0 / 2 / -, W 1 / 1 / 1, Z 2 / - / 0, Y - / 0 / -
    # votes: X 1 + 1/3, W 3 x 1/2, Z 1/3 + 1, Y 1. X, Z and Y each took a first place and W
    # none, so W comes last for all its votes; X and Z tie, and X was seen first
    got = vote(lists, keep=4)
    assert [p.side for p in got] == ["X", "Z", "Y", "W"]
    assert [p.score for p in got] == pytest.approx([4 / 3, 4 / 3, 1.0, 1.5])
    assert [p.side for p in vote(lists, keep=2)] == ["X", "Z"]
    # one spelling: its valid sides, each once, in beam order
    assert [p.side for p in vote([preds("A", None, "B", "A", "C")], keep=5)] == ["A", "B", "C"]


def test_augmented_predictions_search_each_spelling_and_vote(trained):
    """``predict_augmented``: each source and its other spellings (drawn from the seed as
    ``rooted_spellings`` draws them), each searched as a source alone would be, voted per
    source; molds-eval and molds-predict take ``--augment``."""
    import numpy as np

    from molds.checkpoint import open_checkpoint
    from molds.chemistry.pairs import rooted_spellings
    from molds.cli.predict import main as predict_cli
    from molds.eval.evaluate import evaluate_checkpoint
    from molds.eval.pairs import predict, predict_augmented, read_back, sides_of, split_pairs, vote

    d, data, checkpoint = trained
    loaded = open_checkpoint(checkpoint)
    tok, sp, sides = loaded.tokenizer, loaded.specials, sides_of(loaded.manifest)
    rows = split_pairs(loaded.manifest, "test", 4)
    sources = [r["source_smiles"] for r in rows]
    voted, raw, counts, budget = predict_augmented(loaded, sources, [r["source_token_ids"] for r in rows], augment=3,
                                                   beams=3, longest_target=20, max_tokens=24, seed=5)
    rng = np.random.default_rng(5)
    at = 0
    for r, text, got, n in zip(rows, sources, voted, counts):
        spellings = rooted_spellings(text, rng=rng, count=3)
        assert tok(spellings[0], add_special_tokens=False)["input_ids"] == r["source_token_ids"]
        assert n == len(spellings) and n > 1
        alone = []
        for spelling in spellings:
            hyps = predict(loaded.model, sp, [tok(spelling, add_special_tokens=False)["input_ids"]], beams=3,
                           max_tokens=budget)
            mine = read_back(tok, hyps, sides)[0]
            assert [p.text for p in mine] == [p.text for p in raw[at]]
            assert [p.score for p in mine] == pytest.approx([p.score for p in raw[at]], abs=1e-5)
            alone.append(mine)
            at += 1
        assert got == vote(alone, 3)
    assert at == len(raw)
    report = evaluate_checkpoint(checkpoint, split="test", num=4, beams=3, augment=3)["pairs"]
    assert report["augment"] == 3 and 1 < report["spellings_per_source"] <= 3 and report["inputs"] == 4
    assert 0 <= report["top1"] <= report["top3"] <= 1
    (d / "aug.smi").write_text("\n".join(sources) + "\n")
    assert predict_cli([checkpoint, "--input", str(d / "aug.smi"), "--beams", "3", "--augment", "3", "--seed", "5",
                        "--max_tokens", "24", "--out", str(d / "aug.csv")]) == 0
    table = list(csv.DictReader(io.StringIO((d / "aug.csv").read_text())))
    for i, got in enumerate(voted, 1):
        mine = [x for x in table if x["row"] == str(i)]
        if not got:  # no spelling gave a molecule: one row says so
            assert [(x["prediction"], x["note"]) for x in mine] == [("", "no_valid_prediction")]
            continue
        assert [(x["prediction"], float(x["score"])) for x in mine] == \
            [(p.side, pytest.approx(p.score, abs=1e-5)) for p in got]


def test_a_checkpoint_refuses_input_of_another_direction_in_one_line(trained, tmp_path, capsys):
    """The checkpoint keeps its task and formats; molds-predict refuses another --task and a
    file of whole reactions, removes atom maps and says so (the same beams as the unmapped
    source); molds-eval refuses a manifest of another direction with the same vocabulary."""
    from molds.checkpoint import read_lineage
    from molds.cli.evaluate import main as eval_cli
    from molds.cli.predict import main as predict_cli
    from molds.data.manifest import Manifest
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run as preprocess

    d, data, checkpoint = trained
    block = read_lineage(checkpoint)["pairs"]
    assert block["task"] == "retro" and block["source_format"] == "a product" and block["target_format"] == "reactants"

    def refused(argv):
        capsys.readouterr()
        assert predict_cli(argv) != 0
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1, err
        return err[0]

    source = pq.read_table(Manifest.load(data).shards("test")[0].path).column("source_smiles")[0].as_py()
    plain = tmp_path / "plain.smi"
    plain.write_text(source + "\n")
    line = refused([checkpoint, "--input", str(plain), "--task", "forward", "--out", str(tmp_path / "x.csv")])
    assert "is a retro (a product -> reactants) model, not a forward one" in line, line
    whole = tmp_path / "reactions.smi"
    whole.write_text(f"{source}\nCC(=O)O.OCC>>CC(=O)OCC\nCCN>O>CCNC=O\n")
    line = refused([checkpoint, "--input", str(whole), "--out", str(tmp_path / "x.csv")])
    assert f"{whole} line 2: 'CC(=O)O.OCC>>CC(=O)OCC' is a whole reaction (2 of 3 sources are)" in line, line
    assert "give it a product alone" in line, line
    assert not (tmp_path / "x.csv").exists()

    mol = Chem.MolFromSmiles(source)
    for atom in mol.GetAtoms():
        atom.SetAtomMapNum(atom.GetIdx() + 1)
    mapped = tmp_path / "mapped.smi"
    mapped.write_text(Chem.MolToSmiles(mol) + "\n")
    assert ":1]" in mapped.read_text()
    outs = {}
    for name, path in (("plain", plain), ("mapped", mapped)):
        capsys.readouterr()
        assert predict_cli([checkpoint, "--input", str(path), "--beams", "2", "--max_tokens", "30", "--task", "retro",
                            "--all_beams", "--out", str(tmp_path / f"{name}.csv")]) == 0
        err = capsys.readouterr().err
        summary = json.loads(err.strip().splitlines()[-1].removeprefix("[molds] "))
        assert summary["atom_maps_removed"] == (name == "mapped") and summary["reads"] == "a product", summary
        assert (f"{path}: atom maps removed from 1 of 1 sources" in err) == (name == "mapped"), err
        outs[name] = [(r["rank"], r["text"], r["score"]) for r in csv.DictReader(open(tmp_path / f"{name}.csv"))]
    assert outs["mapped"] == outs["plain"] and len(outs["plain"]) == 2

    forward = str(tmp_path / "forward")
    preprocess(PreprocessConfig(input=[str(d / "reactions.csv")], output=forward,
                                smiles_column="reactants>reagents>production", id_column="id", task="forward",
                                tokenizer=os.path.join(data, "tokenizer"), grow_vocab=False, workers=1,
                                progress=False))
    assert Manifest.load(forward).data["tokenizer"]["vocab_hash"] == Manifest.load(data).data["tokenizer"]["vocab_hash"]
    capsys.readouterr()
    assert eval_cli([checkpoint, "--manifest", forward, "--num", "2", "--out", str(tmp_path / "ev")]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "was trained on retro (a product -> reactants)" in err[0], err
    assert forward in err[0] and "holds forward (reactants and reagents, one '.'-joined side -> products)" in err[0], err


def test_sampling_a_pair_model_is_refused(trained):
    from molds.cli.sample import run as sample
    from molds.errors import MoldsError

    _, _, checkpoint = trained
    with pytest.raises(MoldsError, match="retro pair model: it completes a source, and molds-predict"):
        sample([checkpoint, "--num", "2"])


def test_eval_reports_top_k_accuracy_of_the_split(trained):
    from molds.eval.evaluate import evaluate_checkpoint

    _, _, checkpoint = trained
    report = evaluate_checkpoint(checkpoint, split="test", num=6, beams=5)
    pairs = report["pairs"]
    assert pairs["task"] == "retro" and pairs["inputs"] == 6 and pairs["beams"] == 5
    assert set(report["metrics"]) >= {"top1", "top3", "top5", "invalid_beams"} and "top10" not in report["metrics"]
    assert 0 <= pairs["top1"] <= pairs["top3"] <= pairs["top5"] <= 1
    assert report["loss"] > 0 and len(pairs["examples"]) == 6


def test_the_run_scores_its_beams_as_molds_eval_scores_the_checkpoint(trained):
    """The full evaluation at the last step (eval/top1, eval/top3 in metrics.jsonl) equals
    molds-eval on the checkpoint of that step, same split, pairs and beam width."""
    from molds.eval.evaluate import evaluate_checkpoint

    d, _, checkpoint = trained
    logged = {}
    with open(d / "run" / "metrics.jsonl") as fh:
        for line in fh:
            rec = json.loads(line)
            if any(k.startswith("eval/top") for k in rec):
                logged[rec["step"]] = rec
    assert set(logged) == {6, 12}
    assert "eval/top1" in logged[6] and "eval/top3" not in logged[6]  # the smoke evaluation decodes greedily
    report = evaluate_checkpoint(checkpoint, split="valid", num=6, beams=3, max_batches=2)
    for k in ("top1", "top3", "invalid_beams", "top1_score"):  # top1_score: the same beams, whatever their quality
        assert logged[12][f"eval/{k}"] == pytest.approx(report["pairs"][k], abs=1e-5)


def pred(side):
    return Prediction(side, side or "x", 0.0, True)


def test_top_k_is_an_exact_match_of_canonical_sides():
    def canon(text):
        return ".".join(sorted(Chem.MolToSmiles(Chem.MolFromSmiles(p)) for p in text.split(".")))

    targets = [canon("OCC.c1ccccc1"), canon("CC(=O)O"), canon("CCN")]
    predictions = [
        [pred(canon("c1ccccc1.CCO")), pred(None)],  # the same molecules, another order: a top-1 hit
        [pred(canon("CC(=O)OC")), pred(canon("OC(C)=O")), pred(None)],  # a hit at rank 2
        [pred(canon("CCO")), pred(canon("CCCN")), pred(canon("NCC"))],  # a hit at rank 3
        # a repeated reactant set (another spelling) and a beam that is no molecule take no place: rank 2
        [pred(canon("CCO")), pred(None), pred(canon("OCC")), pred(canon("ClCC"))],
    ]
    targets.append(canon("CCCl"))
    got = topk_accuracy(predictions, targets, ks=(1, 2, 3))
    assert got["top1"] == pytest.approx(1 / 4) and got["top2"] == pytest.approx(3 / 4) and got["top3"] == 1.0
    assert got["invalid_beams"] == pytest.approx(3 / 12) and got["invalid_top1"] == 0.0
    assert got["distinct_predictions"] == pytest.approx((1 + 2 + 3 + 2) / 4)
    with pytest.raises(ValueError, match="2 predictions for 4 targets"):
        topk_accuracy(predictions[:2], targets)


def test_mol2mol_similarity_and_property_change_equal_rdkit_read_directly():
    from rdkit import DataStructs
    from rdkit.Chem import QED, Crippen, rdFingerprintGenerator

    from molds.eval.pairs import similarity_to_source

    sources = ["CCOc1ccccc1", "CC(=O)Nc1ccccc1", "CCN"]
    firsts = ["CCCOc1ccccc1", "CC(=O)Nc1ccccc1", None]  # a near molecule, the source itself, an invalid beam
    got = similarity_to_source([[pred(f)] for f in firsts], sources)
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    pairs = [(Chem.MolFromSmiles(f), Chem.MolFromSmiles(s)) for f, s in zip(firsts[:2], sources[:2])]
    sims = [DataStructs.TanimotoSimilarity(gen.GetFingerprint(a), gen.GetFingerprint(b)) for a, b in pairs]
    assert got["scored"] == 2 and got["returns_source"] == 0.5
    assert got["similarity_to_source"] == pytest.approx(sum(sims) / 2)
    assert got["delta_logp"] == pytest.approx(sum(Crippen.MolLogP(a) - Crippen.MolLogP(b) for a, b in pairs) / 2)
    assert got["abs_delta_qed"] == pytest.approx(sum(abs(QED.qed(a) - QED.qed(b)) for a, b in pairs) / 2)


def test_a_pair_model_is_refused_as_a_goal_prior(trained, tmp_path):
    from molds.errors import RecipeError
    from molds.train import main

    _, _, checkpoint = trained
    with pytest.raises(RecipeError, match="retro pair model, which completes a source"):
        main(["--goal.prior", checkpoint, "--goal.scoring", json.dumps({"oracle": "qed"}), "--goal.batch_size", "4",
              "--trainer.max_steps", "1", "--run.output_dir", str(tmp_path / "g"), "--logging.progress", "false"])


def test_the_export_generates_the_beams_molds_predict_writes(trained, tmp_path):
    """transformers' ``generate(num_beams=k)`` on the exported model, loaded from disk
    (``LlamaForCausalLM`` for the decoder, ``BartForConditionalGeneration`` for the
    encoder-decoder), finds the top k molds' search finds on the same checkpoint: the same
    tokens, the same ends and scores. The encoder-decoder's export carries the tokens a target
    never holds in its generation config; the decoder's caller passes them."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from molds.checkpoint import open_checkpoint
    from molds.data.manifest import Manifest
    from molds.eval.pairs import forbidden_in_targets, generate_exported, predict
    from molds.export import export

    _, data, checkpoint = trained
    loaded = open_checkpoint(checkpoint)
    sp, seq2seq = loaded.specials, loaded.family == "seq2seq"
    hf_dir = export(checkpoint, str(tmp_path / "hf"))
    hf = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(hf_dir).eval()
    rows = pq.read_table(Manifest.load(data).shards("test")[0].path).to_pylist()[:3]
    k, n = 3, 12
    ours = predict(loaded.model, sp, [r["source_token_ids"] for r in rows], beams=k, max_tokens=n)
    if seq2seq:
        assert sorted(hf.generation_config.suppress_tokens) == list(forbidden_in_targets(sp))
    for r, hyps in zip(rows, ours):
        theirs = generate_exported(hf, sp, r["source_token_ids"], beams=k, max_tokens=n)
        assert [(h.ids, h.ended) for h in hyps] == [(t, ended) for t, ended, _ in theirs]
        assert [h.score for h in hyps] == pytest.approx([score for _, _, score in theirs], abs=1e-4)


def test_the_split_loss_is_the_mean_over_target_tokens_of_each_pair_run_alone(trained):
    """``molds-eval``'s loss on a pair split is the mean negative log-likelihood per scored
    token (each target token and its EOS) over the whole split, recomputed pair by pair: the
    decoder on ``<bos> source <sep> target <eos>`` alone, the encoder-decoder on its source and
    target alone."""
    import torch
    import torch.nn.functional as F

    from molds.checkpoint import open_checkpoint
    from molds.data.manifest import Manifest
    from molds.eval.evaluate import evaluate_checkpoint

    _, data, checkpoint = trained
    loaded = open_checkpoint(checkpoint)
    sp, model = loaded.specials, loaded.model.eval()
    rows = [r for s in Manifest.load(data).shards("valid") for r in pq.read_table(s.path).to_pylist()]
    nll = count = 0.0
    with torch.no_grad():
        for r in rows:
            src, tgt = r["source_token_ids"], r["target_token_ids"]
            if len(src) + len(tgt) + 3 > 192:  # over the recipe's length: left out by the loader too
                continue
            want = torch.tensor([*tgt, sp.eos])
            if loaded.family == "seq2seq":
                logits = model(torch.tensor([[sp.bos, *src, sp.eos]]),
                               decoder_input_ids=torch.tensor([[sp.bos, *tgt]]))["logits"][0]
            else:
                ids = torch.tensor([[sp.bos, *src, sp.sep, *tgt, sp.eos]])
                logits = model(ids, position_ids=torch.arange(ids.shape[1])[None])["logits"][0, len(src) + 1:-1]
            nll += float(F.cross_entropy(logits.double(), want, reduction="sum"))
            count += len(want)
    report = evaluate_checkpoint(checkpoint, split="valid", num=2, beams=1)
    assert report["loss"] == pytest.approx(nll / count, rel=1e-5)


@pytest.mark.slow
def test_eval_top_k_equals_one_computed_from_transformers_beams_and_the_shards(tmp_path):
    """molds-eval's top-1 and top-3 on a model that learned its task (copying 600 of the
    sample's molecules, mol2mol, trained until about half its first beams are right) equal
    a top-k computed here without molds' search or scoring: transformers' ``generate`` with
    beams on the exported model, the pairs read from the test shards (evenly spaced), every
    beam and target compared as RDKit canonical SMILES, each molecule counted at its first
    beam. A misalignment of beams and targets would show; it could hide behind a model that
    scores near zero."""
    import gzip

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molds.cli.evaluate import main as eval_cli
    from molds.data.manifest import Manifest
    from molds.export import export
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run as preprocess
    from molds.train import main as train

    with gzip.open(os.path.join(os.path.dirname(__file__), "..", "molds", "sample_data", "moses_sample.csv.gz"),
                   "rt") as fh:
        smiles = sorted((line.split(",")[0].strip() for line in list(fh)[1:]), key=len)[:600]
    (tmp_path / "copy.csv").write_text("source,target\n" + "".join(f"{s},{s}\n" for s in smiles))
    data = str(tmp_path / "pairs")
    preprocess(PreprocessConfig(input=[str(tmp_path / "copy.csv")], output=data, smiles_column="source",
                                target_column="target", task="mol2mol", workers=1, progress=False))
    out = str(tmp_path / "run")
    train(["--data.manifest", data, "--data.too_long", "reject", "--data.mode", "packed", "--data.seq_len", "192",
           "--data.micro_batch_size", "8", "--data.lookahead", "64", "--model.family", "decoder",
           "--model.hidden_size", "64", "--model.num_layers", "2", "--model.num_heads", "4",
           "--model.num_kv_heads", "2", "--model.max_position_embeddings", "256", "--parallel.engine", "ddp",
           "--optim.lr", "3e-3", "--optim.warmup_steps", "20", "--trainer.max_steps", "900",
           "--trainer.precision", "fp32", "--checkpoint.interval_steps", "900", "--eval.interval_steps", "0",
           "--eval.full_interval_steps", "0", "--logging.tensorboard", "false", "--logging.progress", "false",
           "--run.output_dir", out])
    n, beams = 40, 3
    assert eval_cli([out, "--split", "test", "--num", str(n), "--beams", str(beams), "--out", str(tmp_path / "ev")]) == 0
    report = json.load(open(tmp_path / "ev" / "eval.json"))
    pairs = report["pairs"]

    rows = [r for s in Manifest.load(data).shards("test") for r in pq.read_table(s.path).to_pylist()]
    rows = [rows[i * len(rows) // n] for i in range(n)]  # --num takes pairs evenly spaced through the split
    hf_dir = export(out, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    special = {tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
    bos, sep, eos, pad = tok.bos_token_id, tok.sep_token_id, tok.eos_token_id, tok.pad_token_id
    hits = {1: 0, 3: 0}
    for r in rows:
        prompt = torch.tensor([[bos, *r["source_token_ids"], sep]])
        got = hf.generate(prompt, num_beams=beams, num_return_sequences=beams, max_new_tokens=pairs["max_tokens"],
                          do_sample=False, length_penalty=1.0, early_stopping=False, eos_token_id=eos,
                          pad_token_id=pad, suppress_tokens=sorted(special - {eos}))
        answers = []
        for seq in got[:, prompt.shape[1]:].tolist():
            if eos not in seq:  # never ended: no molecule, no place
                continue
            mol = Chem.MolFromSmiles("".join(tok.convert_ids_to_tokens(seq[:seq.index(eos)])))
            if mol is not None and Chem.MolToSmiles(mol) not in answers:  # each molecule once, as it first came
                answers.append(Chem.MolToSmiles(mol))
        want = Chem.MolToSmiles(Chem.MolFromSmiles(r["target_smiles"]))
        for k in hits:
            hits[k] += want in answers[:k]
    assert pairs["inputs"] == n and report["metrics"]["top1"] == pairs["top1"]
    assert pairs["top1"] == pytest.approx(hits[1] / n) and pairs["top3"] == pytest.approx(hits[3] / n), (pairs, hits)
    assert 0.2 <= pairs["top1"] < 1, pairs  # learned, not perfectly: a misalignment would show


def test_the_predict_speed_benchmark_times_both_searches_on_the_same_beams(trained, capsys):
    """``benchmarks/predict_speed.py``: molds' search and transformers' ``generate`` on the
    export find the same top k for every source, and the line's rates are its seconds'."""
    import statistics

    from benchmarks.predict_speed import main as bench

    _, _, checkpoint = trained
    capsys.readouterr()
    assert bench(["--run", checkpoint, "--num", "4", "--beams", "3", "--rounds", "2", "--max_tokens", "20"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["sources"] == 4 and line["beams"] == 3 and line["same_products"] == 4, line
    assert line["exported_as"] in ("LlamaForCausalLM", "BartForConditionalGeneration")
    for name in ("molds", "transformers"):
        assert len(line["seconds"][name]) == 2
        # 4 sources searched in each timed call, 3 beams each
        assert line["sources_per_s"][name] == pytest.approx(4 / statistics.median(line["seconds"][name]), rel=1e-2)
        assert line["predictions_per_s"][name] == pytest.approx(12 / statistics.median(line["seconds"][name]),
                                                                rel=1e-2)
    assert line["molds_over_transformers"] == pytest.approx(
        line["sources_per_s"]["molds"] / line["sources_per_s"]["transformers"], rel=1e-2)


@pytest.mark.slow
def test_a_round_trip_gives_each_retro_prediction_to_the_forward_model(tmp_path, capsys):
    """``--verify_with``: each retro prediction's reactants go to a forward model, whose first
    prediction is checked here with transformers' greedy ``generate`` on its export and
    compared with the input product as RDKit canonical SMILES; molds-eval's round-trip
    accuracy is the share molds-predict's rows give; a round trip the other way is refused.
    Two copy models (each side is the other), so that most round trips succeed and some fail."""
    import gzip

    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from molds.cli.evaluate import main as eval_cli
    from molds.cli.predict import main as predict_cli
    from molds.data.manifest import Manifest
    from molds.export import export
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run as preprocess
    from molds.train import main as train

    with gzip.open(os.path.join(os.path.dirname(__file__), "..", "molds", "sample_data", "moses_sample.csv.gz"),
                   "rt") as fh:
        smiles = sorted((line.split(",")[0].strip() for line in list(fh)[1:]), key=len)[:600]
    (tmp_path / "copy.csv").write_text("source,target\n" + "".join(f"{s},{s}\n" for s in smiles))
    runs = {}
    for task in ("retro", "forward"):
        data = str(tmp_path / f"pairs-{task}")
        preprocess(PreprocessConfig(input=[str(tmp_path / "copy.csv")], output=data, smiles_column="source",
                                    target_column="target", task=task, workers=1, progress=False))
        runs[task] = str(tmp_path / f"run-{task}")
        train(["--data.manifest", data, "--data.too_long", "reject", "--data.mode", "bucketed",
               "--data.max_length", "192", "--data.max_tokens_per_batch", "768", "--data.bucket_pool", "64",
               "--model.family", "seq2seq", "--model.hidden_size", "64", "--model.num_layers", "2",
               "--model.num_heads", "4", "--model.max_position_embeddings", "256", "--model.dropout", "0.0",
               "--parallel.engine", "ddp", "--optim.lr", "3e-3", "--optim.warmup_steps", "20",
               "--trainer.max_steps", "300" if task == "retro" else "200", "--trainer.precision", "fp32",
               "--checkpoint.interval_steps", "300", "--eval.interval_steps", "0", "--eval.full_interval_steps", "0",
               "--logging.tensorboard", "false", "--logging.progress", "false", "--run.output_dir", runs[task]])
    n = 30
    products = [r["source_smiles"] for s in Manifest.load(str(tmp_path / "pairs-retro")).shards("test")
                for r in pq.read_table(s.path).to_pylist()]
    assert len(products) > n
    products = [products[i * len(products) // n] for i in range(n)]  # as molds-eval --num takes them
    (tmp_path / "products.smi").write_text("".join(f"{p}\n" for p in products))
    out = tmp_path / "pred.csv"
    capsys.readouterr()
    assert predict_cli([runs["retro"], "--input", str(tmp_path / "products.smi"), "--beams", "2",
                        "--verify_with", runs["forward"], "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1].removeprefix("[molds] "))
    table = list(csv.DictReader(open(out)))
    assert sorted({int(r["row"]) for r in table}) == list(range(1, n + 1))  # every input, its distinct predictions
    assert all(len({r["prediction"] for r in table if r["row"] == str(i)}) == sum(r["row"] == str(i) for r in table)
               for i in range(1, n + 1))

    hf_dir = export(runs["forward"], str(tmp_path / "hf"))
    hf = AutoModelForSeq2SeqLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    checked = 0
    for r in table:
        if not r["prediction"]:
            assert r["round_trip"] == "", r
            continue
        ids = [tok.bos_token_id, *tok(r["prediction"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
        with torch.no_grad():
            seq = hf.generate(torch.tensor([ids]), num_beams=1, do_sample=False, max_new_tokens=100)[0, 1:].tolist()
        seq = seq[:seq.index(tok.eos_token_id)] if tok.eos_token_id in seq else None
        mol = Chem.MolFromSmiles("".join(tok.convert_ids_to_tokens(seq))) if seq else None
        back = Chem.MolToSmiles(mol) if mol is not None else ""
        assert r["forward_prediction"] == back, r
        assert r["round_trip"] == ("yes" if back == Chem.MolToSmiles(Chem.MolFromSmiles(r["input"])) else "no"), r
        checked += 1
    firsts = [r["round_trip"] == "yes" for r in table if r["rank"] == "1"]
    share = sum(firsts) / n
    assert checked >= n and 0.3 <= share < 1, (checked, share)  # most come back, not all
    assert summary["round_trip_top1"] == pytest.approx(share)
    predicted = [r for r in table if r["prediction"]]
    assert summary["round_trip_beams"] == pytest.approx(sum(r["round_trip"] == "yes" for r in table) / len(predicted))

    assert eval_cli([runs["retro"], "--split", "test", "--num", str(n), "--beams", "2", "--verify_with",
                     runs["forward"], "--out", str(tmp_path / "ev")]) == 0
    report = json.load(open(tmp_path / "ev" / "eval.json"))
    assert report["metrics"]["round_trip_top1"] == pytest.approx(share)
    capsys.readouterr()
    assert predict_cli([runs["forward"], "--input", str(tmp_path / "products.smi"), "--verify_with", runs["retro"],
                        "--out", str(tmp_path / "x.csv")]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "checks a retro model's predictions with a forward model" in err[0], err
