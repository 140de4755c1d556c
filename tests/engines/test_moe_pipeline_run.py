"""The MoE pipeline as a user runs it: ``deepspeed --num_gpus 4 molds/train.py`` with
pp = 2, ep = 2 on CPU ranks logs the moe/* and pipeline/* tags, samples molecules during
training from the model gathered from its stages, and checkpoints; the run
resumes with pp = 1, ep = 1 on one process; the checkpoint exports to
``Qwen3MoeForCausalLM`` with the same logits, and molds-sample / molds-eval take it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist.spawn import free_port
from tests.engines.test_pipeline import MOE

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _args(dataset, out, steps, *extra):
    return ["molds/train.py", "--data.manifest", dataset, "--data.seq_len", "128", "--data.micro_batch_size", "2",
            "--data.lookahead", "64", "--model.hidden_size", "32", "--model.num_layers", "4",
            "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.max_position_embeddings", "256", *MOE,
            "--model.moe_first_dense_layers", "1", "--parallel.engine", "pipeline", "--parallel.zero_stage", "1",
            "--parallel.partition_method", "uniform", "--trainer.max_steps", str(steps),
            "--trainer.precision", "fp32", "--logging.interval_steps", "2", "--logging.progress", "false",
            "--checkpoint.interval_steps", "3", "--eval.interval_steps", "3", "--eval.max_batches", "2",
            "--eval.samples", "16", "--eval.full_samples", "64", "--run.output_dir", out, *extra]


def exports_as_qwen3_moe(run: str, out: str) -> None:
    """The run's checkpoint exports to Qwen3-MoE with molds' own logits."""
    from transformers import AutoModelForCausalLM

    from molds.checkpoint import open_checkpoint
    from molds.export import export

    hf = AutoModelForCausalLM.from_pretrained(export(run, out), local_files_only=True).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ours = open_checkpoint(run).model
    ids = torch.randint(6, ours.config.vocab_size, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids)["logits"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_moe_pipeline_runs_resumes_exports(dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from molds.cli.evaluate import main as eval_main
    from molds.cli.sample import main as sample_main

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(free_port()),
           *_args(dataset, out, 6, "--parallel.pp_size", "2", "--parallel.ep_size", "2", "--trainer.grad_accum", "2")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    for tag in ("moe/aux_loss", "moe/load_max_over_mean", "moe/load_max_over_mean/layer01",
                "pipeline/step_s/stage0", "pipeline/step_s/stage1", "pipeline/bubble_fraction"):
        assert tag in train[-1], tag
    assert 0 < train[-1]["pipeline/bubble_fraction"] < 1  # 1F1B on 2 stages: the warm-up and drain idle
    assert any("eval/loss" in r for r in rows)
    # samples during training: drawn from the whole model gathered from the stages
    sampled = [r for r in rows if "eval/validity" in r]
    assert [r["step"] for r in sampled] == [3, 6]
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"tensors": 0}).Reload()
    # the final evaluation's 64 samples (all shown in TensorBoard), scored here by RDKit
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    tag = next(t for t in acc.Tags()["tensors"] if t.startswith("eval/samples"))
    shown = [e for e in acc.Tensors(tag) if e.step == 6][0].tensor_proto.string_val[0].decode().splitlines()
    shown = [line.strip() for line in shown if line.strip()]
    assert len(shown) == 64
    valid = sum(not line.startswith("(unfinished") and Chem.MolFromSmiles(line) is not None for line in shown)
    assert sampled[-1]["eval/validity"] == pytest.approx(valid / 64)
    assert "moe/tokens_per_expert/layer01" in acc.Tags()["histograms"]
    lineage = json.load(open(os.path.join(out, "checkpoints", "step-00000006", "lineage.json")))
    assert lineage["world_topology"]["pp_size"] == 2 and lineage["world_topology"]["ep_size"] == 2
    # resumed on 2 ranks at pp = 1, ep = 1: dp stays 2, so each rank reads the micro-batches it read
    # before, and an uninterrupted pp = 1, ep = 1 run on 2 ranks is the reference, step for step
    def launch(run_dir, steps, *extra):
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
               str(free_port()), *_args(dataset, run_dir, steps, "--parallel.pp_size", "1", "--parallel.ep_size", "1",
                                        "--trainer.grad_accum", "2", *extra)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stderr

    err = launch(out, 8, "--resume", "auto")
    assert "resumed from" in err and "parallel.ep_size: 2 -> 1" in err and "parallel.pp_size: 2 -> 1" in err
    ref = str(tmp_path / "ref")
    launch(ref, 8)

    def logged(run_dir):
        return {r["step"]: r["train/loss"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
                if "train/loss" in r}

    a, b = logged(out), logged(ref)
    assert sorted(a) == sorted(b) == [2, 4, 6, 8]
    # the same micro-batches on the same ranks: only float32's order of summation differs (the
    # stage boundary, the experts' all-to-all, DeepSpeed's gradient reduction), and Adam carries
    # it on: seen 3.7e-8 relative at steps 6 and 8; held to 1e-6. Two experts of one layer
    # swapped on resume moved step 8 by 4.9e-5 (tried by hand), fifty times the bound
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-6), (step, a, b)
    exports_as_qwen3_moe(out, str(tmp_path / "hf"))
    assert sample_main([out, "--num", "8", "--out", str(tmp_path / "s.smi")]) == 0
    assert len(open(tmp_path / "s.smi").read().splitlines()) == 8
    assert eval_main([out, "--num", "20", "--max_batches", "2", "--out", str(tmp_path / "ev")]) == 0
