"""Stop-and-resume gives the losses of an uninterrupted run (2 gloo ranks, CPU, fp32)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.dist.spawn import run_ranks


def _argv(dataset, out, engine, steps, extra=(), stage=2):
    return ["--data.manifest", dataset, "--data.seq_len", "128", "--data.micro_batch_size", "2",
            "--data.lookahead", "64", "--data.shuffle_window", "300",
            "--model.hidden_size", "64", "--model.num_layers", "2", "--model.num_heads", "4",
            "--model.num_kv_heads", "2", "--model.max_position_embeddings", "256",
            "--parallel.engine", engine, "--parallel.zero_stage", str(stage),
            "--optim.lr", "3e-3", "--optim.warmup_steps", "2",
            "--trainer.max_steps", str(steps), "--trainer.grad_accum", "2", "--trainer.precision", "fp32",
            "--checkpoint.interval_steps", "3", "--checkpoint.keep_last", "0",
            "--logging.interval_steps", "1", "--logging.progress", "false", "--logging.tensorboard", "true",
            "--run.output_dir", out, *extra]


def _main(rank, world, argv):
    from molds.train import main

    return main(argv)


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return {r["step"]: r["train/loss"] for r in map(json.loads, fh)}


@pytest.mark.parametrize("engine,stage", [("ddp", 0), ("zero", 2), ("zero", 3)], ids=["ddp", "zero2", "zero3"])
def test_resume_matches_uninterrupted(dataset, tmp_path, engine, stage):
    full = str(tmp_path / "full")
    run_ranks(_main, 2, _argv(dataset, full, engine, 7, stage=stage))
    ckpts = sorted(os.listdir(os.path.join(full, "checkpoints")))
    assert ckpts == ["latest", "step-00000003", "step-00000006", "step-00000007"]
    lineage = json.load(open(os.path.join(full, "checkpoints", "step-00000003", "lineage.json")))
    for key in ("recipe", "manifest_hash", "vocab_hash", "canonicalization_hash", "world_topology", "step",
                "code_version"):
        assert key in lineage
    assert os.listdir(os.path.join(full, "tensorboard"))

    resumed = str(tmp_path / "resumed")
    os.makedirs(os.path.join(resumed, "checkpoints"))
    shutil.copytree(os.path.join(full, "checkpoints", "step-00000003"),
                    os.path.join(resumed, "checkpoints", "step-00000003"))
    with open(os.path.join(resumed, "checkpoints", "latest"), "w") as fh:
        fh.write("step-00000003")
    run_ranks(_main, 2, _argv(dataset, resumed, engine, 7, ["--checkpoint.resume", "auto"], stage=stage))
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == [4, 5, 6, 7]
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step


def test_resume_refuses_another_manifest(dataset, tmp_path):
    from molds.checkpoint import CheckpointError
    from molds.train import main

    out = str(tmp_path / "run")
    main(_argv(dataset, out, "ddp", 1))
    other = str(tmp_path / "other")
    shutil.copytree(dataset, other)
    m = json.load(open(os.path.join(other, "manifest.json")))
    m["split"]["seed"] = 123  # different content, same files
    json.dump(m, open(os.path.join(other, "manifest.json"), "w"))
    argv = _argv(other, out, "ddp", 2, ["--checkpoint.resume", "auto"])
    with pytest.raises(CheckpointError, match="manifest"):
        main(argv)
    assert main(argv + ["--checkpoint.fork", "true"])["step"] == 2
