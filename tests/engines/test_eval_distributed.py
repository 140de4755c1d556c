"""Evaluation during training on 2 ZeRO-3 ranks: ranks stay in step (each forward
gathers parameters collectively) and the loss covers the split exactly once."""

from __future__ import annotations

import json
import os

from tests.dist.spawn import run_ranks
from tests.engines.test_resume import _argv, _main


def test_zero3_eval_matches_a_single_process_evaluation(dataset, tmp_path):
    from molds.checkpoint import open_checkpoint
    from molds.eval.scoring import model_forward, split_data_config, split_loss
    from molds.models.loss import build_loss

    out = str(tmp_path / "run")
    argv = _argv(dataset, out, "zero", 4, stage=3, extra=[
        "--eval.interval_steps", "2", "--eval.max_batches", "0", "--eval.samples", "6",
        "--eval.full_samples", "10", "--checkpoint.interval_steps", "0"])
    run_ranks(_main, 2, argv)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = {r["step"]: r for r in rows if "eval/loss" in r}
    assert sorted(evals) == [2, 4]  # a smoke eval at 2, the final full one at 4
    assert "eval/validity" in evals[2] and "eval/unfinished_or_special" in evals[4]  # samples from both ranks, scored
    # the whole valid split, scored by one process from the consolidated checkpoint
    loaded = open_checkpoint(os.path.join(out, "checkpoints"))
    forward = model_forward(loaded.model, build_loss(loaded.recipe["model"]))
    total, count = split_loss(forward, "decoder", split_data_config(loaded.recipe["data"], dataset, "valid"))
    assert abs(evals[4]["eval/loss"] - total / count) < 1e-5 * (total / count)
