"""Sampling, molds-eval and the evaluation run during training."""

from __future__ import annotations

import json
import os

import pytest
import torch

from molds.models.decoder import CausalDecoder, DecoderConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed=0):
    torch.manual_seed(seed)
    return CausalDecoder(DecoderConfig(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)).eval()


def test_cached_decoding_equals_the_full_forward():
    model = _model().double()
    ids = torch.randint(6, 30, (3, 11))
    full = model(ids)["logits"]
    cache = [{} for _ in model.model.layers]
    with torch.no_grad():
        got = [model.decode(ids[:, :4], cache, 0)]  # a prompt, then one token at a time
        for t in range(4, 11):
            got.append(model.decode(ids[:, t:t + 1], cache, t))
    torch.testing.assert_close(torch.stack(got, 1), full[:, 3:], rtol=0, atol=1e-10)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    from molds.eval.sampling import sample_ids

    model = _model()
    kw = dict(bos=2, eos=3, max_tokens=12, batch_size=5)
    a = sample_ids(model, 7, seed=1, **kw)
    assert a == sample_ids(model, 7, seed=1, **kw) and len(a) == 7
    assert a != sample_ids(model, 7, seed=2, **kw)
    greedy = sample_ids(model, 2, top_k=1, seed=3, **kw)
    ids, cache = torch.tensor([[2]]), [{} for _ in model.model.layers]
    want = []
    with torch.no_grad():
        for t in range(12):
            nxt = int(model.decode(ids, cache, t).argmax())
            if nxt == 3:
                break
            want.append(nxt)
            ids = torch.tensor([[nxt]])
    expect = want if len(want) < 12 else None  # never ended within max_tokens: unfinished
    assert greedy == [expect, expect]


class _MarkovChain(torch.nn.Module):
    """A stand-in model whose next-token logits depend on the last token only (row ``table[last]``),
    so what ``sample_ids`` may draw at each step is known exactly."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # sample_ids reads the device from the parameters
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Identity()])

    def decode(self, ids, cache, start):
        return self.table[ids[:, -1]]


def test_top_k_draws_only_the_k_likeliest_tokens_in_their_renormalized_proportions():
    """``--top_k K`` (the CPU MOSES tutorial samples with 8): every token drawn is among the K
    likeliest after the one before it, and the first tokens come in the proportions of the
    softmax over those K alone; without top-k the same chain draws outside them."""
    from molds.eval.sampling import sample_ids

    vocab, bos, eos, k = 12, 0, 1, 4
    g = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=g) * 1.5
    table[:, bos] = -30.0  # bos is never drawn
    table[:, eos] = table.max(dim=1).values + 0.5  # the likeliest everywhere: every sample ends
    chain = _MarkovChain(table)
    allowed = {row: set(torch.topk(table[row], k).indices.tolist()) for row in range(vocab)}

    def transitions(samples):
        for s in samples:
            if s is None:
                continue
            path = [bos, *s, eos]
            yield from zip(path, path[1:])

    n = 20000
    kw = dict(bos=bos, eos=eos, max_tokens=40, batch_size=n)
    drawn = sample_ids(chain, n, top_k=k, seed=1, **kw)
    assert sum(s is None for s in drawn) < n // 100
    assert all(b in allowed[a] for a, b in transitions(drawn))
    firsts = torch.tensor([s[0] if s else eos for s in drawn if s is not None])
    seen = torch.bincount(firsts, minlength=vocab).double() / len(firsts)
    top = torch.topk(table[bos], k)
    want = torch.zeros(vocab, dtype=torch.double)
    want[top.indices] = torch.softmax(top.values.double(), 0)
    assert 0.5 * (seen - want).abs().sum() < 0.02, (seen, want)  # total variation of 20,000 draws
    free = sample_ids(chain, n, top_k=0, seed=1, **kw)
    assert any(b not in allowed[a] for a, b in transitions(free))


@pytest.mark.slow
def test_trained_decoder_beats_untrained_and_logs_its_evaluation(dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from molds.cli.evaluate import main as eval_main
    from molds.eval.evaluate import evaluate_checkpoint
    from molds.eval.sampling import ids_to_smiles, sample_ids
    from molds.metrics.generation import generation_metrics
    from molds.train import main

    out = str(tmp_path / "run")
    result = main(["--recipe", os.path.join(ROOT, "recipes", "smoke", "gpt_moses.json"), "--data.manifest", dataset,
                   "--data.seq_len", "256", "--data.micro_batch_size", "4", "--run.output_dir", out,
                   "--eval.interval_steps", "300", "--eval.samples", "32", "--eval.full_samples", "64",
                   "--eval.full_interval_steps", "600", "--eval.fcd", "true", "--trainer.max_steps", "1200"])
    report = evaluate_checkpoint(result["checkpoint"], split="test", num=300, seeds=(0,), max_batches=5)
    trained = report["per_seed"][0]["validity"]
    # the same architecture, untrained, sampled the same way
    from molds.checkpoint import open_checkpoint

    loaded = open_checkpoint(result["checkpoint"])
    fresh = CausalDecoder(loaded.model.config).eval()
    ids = sample_ids(fresh, 300, bos=loaded.specials.bos, eos=loaded.specials.eos, max_tokens=80, seed=0)
    untrained = generation_metrics(ids_to_smiles(loaded.tokenizer, ids), loaded.manifest)["validity"]
    # 1,200 steps on 2,400 molecules: 0.42 measured here (600 steps: 0.22); an untrained model: 0.01
    assert trained >= 0.3 and trained >= untrained + 0.25, (trained, untrained)
    assert report["loss"] < 1.5 and report["per_seed"][0]["novelty"] is not None
    # the property diagnostics: against the test split, within the training ranges mostly;
    # the share that hit the length limit is the share of samples that never ended, drawn
    # again here as molds-eval draws them
    from molds.eval.sampling import forbidden_tokens

    first = report["per_seed"][0]
    assert all(first[f"w_{p}"] >= 0 for p in ("weight", "logp", "sa", "qed", "heavy_atoms", "rotatable_bonds"))
    assert 0 <= first["out_of_train_range"] < 0.5 and "split test" in first["property_reference"]
    again = sample_ids(loaded.model, 300, bos=loaded.specials.bos, eos=loaded.specials.eos,
                       max_tokens=report["sampling"]["max_tokens"], seed=0,
                       forbid=forbidden_tokens(loaded.recipe, loaded.specials))
    assert first["hit_length_limit"] == sum(i is None for i in again) / 300
    assert {"token_length", "weight", "rings"} <= set(first["histograms"])
    assert report["sampling"]["softmax"].startswith("float32")

    # the evaluation during training: smoke evals at 300 and 900, full ones at 600 and 1200,
    # each full one with the property distances and the FCD: a trajectory a user can watch
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = {r["step"]: r for r in rows if "eval/loss" in r}
    assert sorted(evals) == [300, 600, 900, 1200]
    assert "eval/validity" in evals[300] and "eval/novelty" in evals[1200] and "eval/int_div" in evals[1200]
    drift = {"eval/fcd", "eval/w_weight", "eval/w_logp", "eval/w_sa", "eval/w_qed", "eval/out_of_train_range",
             "eval/hit_length_limit"}
    assert drift <= set(evals[600]) and drift <= set(evals[1200]) and "eval/fcd" not in evals[900]
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"images": 0, "tensors": 0}).Reload()
    tags = acc.Tags()
    assert [e.step for e in acc.Scalars("eval/fcd")] == [600, 1200]
    assert [e.step for e in acc.Scalars("eval/w_weight")] == [600, 1200]
    # each FCD is fcd_torch's own, of that evaluation's samples (logged as text) against the
    # same fixed draw of the split's molecules
    from fcd_torch import FCD
    from rdkit import Chem, RDLogger

    from molds.metrics.generation import reference_smiles

    reference = reference_smiles(loaded.manifest, "valid", 10000, 0)
    checked = []
    RDLogger.DisableLog("rdApp.*")
    for event in acc.Tensors("eval/samples/text_summary"):
        if event.step not in (600, 1200):
            continue
        shown = [line.strip() for line in event.tensor_proto.string_val[0].decode().splitlines()]
        mols = [Chem.MolFromSmiles(s) for s in shown if not s.startswith("(")]
        canonical = [Chem.MolToSmiles(m) for m in mols if m is not None]
        want = FCD(device="cpu", n_jobs=1)(gen=canonical, ref=reference)
        assert evals[event.step]["eval/fcd"] == pytest.approx(want, rel=1e-4, abs=1e-4), event.step
        checked.append(event.step)
    assert checked == [600, 1200]
    assert "eval/samples_grid" in tags["images"]
    assert {"eval/sample_token_length", "eval/train_token_length", "eval/property/weight",
            "eval/reference/weight", "eval/property/rotatable_bonds"} <= set(tags["histograms"])
    assert any(t.startswith("eval/samples") for t in tags["tensors"])
    assert any("hparams" in d for d in os.listdir(os.path.join(out, "tensorboard")))

    # molds-sample: one line per sample, the same file again for the same seed
    from molds.cli.sample import main as sample_main

    for name in ("a.smi", "b.smi"):
        assert sample_main([out, "--num", "40", "--seed", "5", "--out", str(tmp_path / name)]) == 0
    lines = open(tmp_path / "a.smi").read().splitlines()
    assert len(lines) == 40 and lines == open(tmp_path / "b.smi").read().splitlines()

    # molds-eval on the run directory: JSON and markdown reports
    assert eval_main([out, "--split", "test", "--num", "100", "--seeds", "0,1", "--max_batches", "3",
                      "--out", str(tmp_path / "ev")]) == 0
    rep = json.load(open(tmp_path / "ev" / "eval.json"))
    assert rep["metrics"]["validity"]["values"] == [s["validity"] for s in rep["per_seed"]]
    assert "validity" in open(tmp_path / "ev" / "eval.md").read()


def test_property_eval_over_training_seeds(dataset, tmp_path):
    from molds.cli.evaluate import main as eval_main

    recipe = os.path.join(ROOT, "recipes", "smoke", "mlm_multitask_zero2.json")
    out = str(tmp_path / "ev")
    # the recipe's own engine, ZeRO: a DeepSpeed engine per seed in one process (the second
    # once used the first one's groups, gone with its process group)
    assert eval_main(["--recipe", recipe, "--seeds", "0,1", "--split", "test", "--out", out,
                      f"--data.manifest={dataset}", "--trainer.max_steps=8",
                      "--model.num_tasks=2", "--logging.progress=false"]) == 0
    rep = json.load(open(os.path.join(out, "eval.json")))
    assert rep["training_seeds"] == [0, 1] and len(rep["per_seed"]) == 2
    per_task = rep["per_seed"][0]["property"]["per_task"]
    assert per_task["y1"]["auroc"] is not None and per_task["y2"]["note"] == "labels are not 0/1"
    assert set(rep["metrics"]["auroc"]) == {"mean", "std", "values"}
    assert rep["per_seed"][0]["property"] != rep["per_seed"][1]["property"]  # two differently seeded trainings
    # one picture per training seed, each that seed's ROC points, linked from eval.md
    assert rep["figures"] == ["roc-seed0.png", "roc-seed1.png"]
    md = open(os.path.join(out, "eval.md")).read()
    for name in rep["figures"]:
        with open(os.path.join(out, name), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md
    assert rep["per_seed"][0]["property"]["roc"] != rep["per_seed"][1]["property"]["roc"]


def test_encoder_eval_during_training_matches_molds_eval(dataset, tmp_path):
    """Encoders: masked-token loss at every eval, property metrics in the final full one,
    equal to what molds-eval computes on the checkpoint."""
    from molds.eval.evaluate import evaluate_checkpoint
    from molds.train import main
    from tests.engines.test_encoder import _argv

    out = str(tmp_path / "run")
    result = main(_argv(dataset, out, "ddp", 6, extra=["--eval.interval_steps", "3", "--eval.max_batches", "0"]))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = {r["step"]: r for r in rows if "eval/loss" in r}
    assert sorted(evals) == [3, 6] and "eval/auroc" not in evals[3]
    report = evaluate_checkpoint(result["checkpoint"], split="valid")
    assert abs(evals[6]["eval/auroc"] - report["metrics"]["auroc"]) < 1e-6
    assert abs(evals[6]["eval/bedroc20"] - report["metrics"]["bedroc20"]) < 1e-6


def test_a_sample_holding_a_special_token_is_no_smiles(dataset):
    from transformers import AutoTokenizer

    from molds.data.manifest import Manifest
    from molds.eval.sampling import ids_to_smiles

    tok = AutoTokenizer.from_pretrained(Manifest.load(dataset).tokenizer_path)
    ids = tok("CC(=O)O", add_special_tokens=False)["input_ids"]
    assert ids_to_smiles(tok, [ids, ids[:2] + [tok.pad_token_id] + ids[2:], ids + [tok.mask_token_id], None]) == [
        "CC(=O)O", None, None, None]


def test_molds_eval_scores_a_file_of_samples(dataset, tmp_path, capsys, monkeypatch):
    import pyarrow.parquet as pq

    from molds.data.manifest import Manifest
    from molds.cli.evaluate import main as eval_main

    train = pq.read_table(Manifest.load(dataset).shards("train")[0].path, columns=["canonical_smiles"])
    known = train.column(0).to_pylist()[0]
    path = tmp_path / "other.smi"
    path.write_text(f"{known}\nCC O\n\nOCC(F)(F)F\nC1CC\n")  # whitespace inside is no SMILES
    assert eval_main(["--samples", str(path), "--manifest", dataset, "--out", str(tmp_path / "ev")]) == 0
    rep = json.load(open(tmp_path / "ev" / "eval.json"))
    assert rep["metrics"]["samples"] == 5 and rep["metrics"]["valid"] == 2
    assert rep["metrics"]["novelty"] == 0.5
    assert rep["metrics"]["w_weight"] > 0 and "w_weight" in open(tmp_path / "ev" / "eval.md").read()
    assert "other.smi" in open(tmp_path / "ev" / "eval.md").read()

    # the same samples as MOSES's scripts write them (a CSV with a SMILES column, gzipped or
    # not) and as a TSV: the same figures, the empty cell a failed sample
    import gzip

    rows = [known, "CC O", "", "OCC(F)(F)F", "C1CC"]
    (tmp_path / "other.csv").write_text("id,SMILES\n" + "".join(f'{i},"{r}"\n' for i, r in enumerate(rows)))
    with gzip.open(tmp_path / "other.csv.gz", "wt") as fh:
        fh.write((tmp_path / "other.csv").read_text())
    (tmp_path / "other.tsv").write_text("smiles\tx\n" + "".join(f"{r}\t1\n" for r in rows))
    for name in ("other.csv", "other.csv.gz", "other.tsv"):
        assert eval_main(["--samples", str(tmp_path / name), "--manifest", dataset, "--out", str(tmp_path / f"ev-{name}")]) == 0
        again = json.load(open(tmp_path / f"ev-{name}" / "eval.json"))["metrics"]
        assert {k: again[k] for k in ("samples", "valid", "novelty")} == {"samples": 5, "valid": 2, "novelty": 0.5}, name
    # --reference: MOSES's similarity metrics and the property distances against one file, read once
    import molds.eval.evaluate as evaluate

    reads = []
    real_read = evaluate.read_smiles_file
    monkeypatch.setattr(evaluate, "read_smiles_file", lambda p: reads.append(p) or real_read(p))
    (tmp_path / "ref.smi").write_text("CCO\nc1ccccc1O name\nCC(=O)Nc1ccc(O)cc1\n")
    assert eval_main(["--samples", str(path), "--manifest", dataset, "--reference", str(tmp_path / "ref.smi"),
                      "--out", str(tmp_path / "ev-ref")]) == 0
    ref = json.load(open(tmp_path / "ev-ref" / "eval.json"))["metrics"]
    assert ref["moses_reference_molecules"] == 3 and len(reads) == 1
    assert "ref.smi (3 of its 3 molecules)" in open(tmp_path / "ev-ref" / "eval.md").read()
    (tmp_path / "bad.csv").write_text("id,smi\n1,CCO\n")
    assert eval_main(["--samples", str(tmp_path / "bad.csv"), "--manifest", dataset, "--out", str(tmp_path / "b")]) != 0
    assert "bad.csv: a csv file of samples needs a SMILES column; its header is ['id', 'smi']" in capsys.readouterr().err
