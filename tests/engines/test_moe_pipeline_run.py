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
    assert [r["step"] for r in sampled] == [3, 6] and all(0 <= r["eval/validity"] <= 1 for r in sampled)
    acc = EventAccumulator(os.path.join(out, "tensorboard")).Reload()
    assert "moe/tokens_per_expert/layer01" in acc.Tags()["histograms"]
    lineage = json.load(open(os.path.join(out, "checkpoints", "step-00000006", "lineage.json")))
    assert lineage["world_topology"]["pp_size"] == 2 and lineage["world_topology"]["ep_size"] == 2
    # one process, pp = 1, ep = 1, the same 8 sequences per step
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, *_args(dataset, out, 8, "--parallel.pp_size", "1", "--parallel.ep_size",
                                                  "1", "--trainer.grad_accum", "4", "--resume", "auto")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr and "parallel.ep_size: 2 -> 1" in proc.stderr
    steps = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))
             if "train/loss" in json.loads(line)]
    assert steps == [2, 4, 6, 8]
    exports_as_qwen3_moe(out, str(tmp_path / "hf"))
    assert sample_main([out, "--num", "8", "--out", str(tmp_path / "s.smi")]) == 0
    assert len(open(tmp_path / "s.smi").read().splitlines()) == 8
    assert eval_main([out, "--num", "20", "--max_batches", "2", "--out", str(tmp_path / "ev")]) == 0
