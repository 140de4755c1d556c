"""Fault 5: a NaN/inf step (an injected NaN loss, and a real divergence at lr 1e6).
``stop`` ends the run with nothing non-finite saved; ``skip`` drops the step and counts
it; ``rollback`` reloads the last checkpoint and goes on past the bad batch; the bound
holds; no policy ever saves non-finite weights or prunes the newest finite checkpoint."""

from __future__ import annotations

import os

import pytest

from tests.dist.spawn import run_ranks
from tests.faults.common import argv, losses, metrics, train, train_with


def _finite_checkpoints(out):
    import torch
    from safetensors.torch import load_file

    root = os.path.join(out, "checkpoints")
    steps = []
    for d in sorted(os.listdir(root)):
        if d.startswith("step-") and not d.endswith(".tmp"):
            weights = load_file(os.path.join(root, d, "model.safetensors"))
            assert all(torch.isfinite(t).all() for t in weights.values()), d
            steps.append(int(d[5:]))
    return steps


def test_stop_saves_nothing_non_finite(dataset, tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(Exception, match=r"NonFiniteError.*step 3: loss nan.*not finite.*trainer.on_nonfinite=stop"):
        run_ranks(train_with, 1, argv(dataset, out, "ddp", 6), "nan", 3)
    assert _finite_checkpoints(out) == [2]
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step-00000002"


def test_zeros_own_overflow_skip_is_counted_in_the_metrics(dataset, tmp_path):
    """ZeRO in bf16, where molds turns DeepSpeed's overflow check on: the NaN step is
    skipped by DeepSpeed itself, and ``train/skipped_steps_deepspeed`` says so (0 before
    the bad step, 1 from it on), beside molds' own count."""
    out = str(tmp_path / "run")
    run_ranks(train_with, 1, argv(dataset, out, "zero", 5, "--trainer.precision", "bf16",
                                  "--trainer.on_nonfinite", "skip"), "nan", 3)
    rows = [r for r in metrics(out) if "train/loss" in r]
    counted = {r["step"]: r["train/skipped_steps_deepspeed"] for r in rows}
    assert counted == {1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0, 5: 1.0}, counted  # step 3 is the one after the skip
    assert [r["train/nonfinite_steps"] for r in rows][-1] == 1


@pytest.mark.parametrize("engine,world", [("ddp", 1), pytest.param("zero", 2, marks=pytest.mark.slow)])
def test_skip_drops_the_step_and_counts_it(dataset, tmp_path, engine, world):
    out = str(tmp_path / "run")
    run_ranks(train_with, world, argv(dataset, out, engine, 6, "--trainer.on_nonfinite", "skip"), "nan", 3)
    rows = metrics(out)
    assert max(r["step"] for r in rows) == 6  # six applied steps: the skipped one did not count
    assert [r["train/nonfinite_steps"] for r in rows if "train/loss" in r][-1] == 1
    assert _finite_checkpoints(out) == [2, 4, 6]
    ref = str(tmp_path / "ref")
    run_ranks(train, world, argv(dataset, ref, engine, 2))
    assert losses(out)[2] == pytest.approx(losses(ref)[2], rel=1e-6)  # before the bad step: the same run


def test_rollback_reloads_and_moves_past_the_batch(dataset, tmp_path):
    out = str(tmp_path / "run")
    run_ranks(train_with, 1, argv(dataset, out, "ddp", 6, "--trainer.on_nonfinite", "rollback"), "nan", 4)
    rows = metrics(out)
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4, 5, 6]  # the log was rewound, not duplicated
    assert [r.get("train/rollbacks") for r in rows if "train/loss" in r][-1] == 1
    assert _finite_checkpoints(out) == [2, 4, 6]
    # what a rollback promises, run without one: steps 1-2 on batches 1-2, then (batch 3's step
    # undone, batch 4 the bad one) steps 3-6 on batches 5-8 from step 2's weights and moments
    ref = str(tmp_path / "ref")
    run_ranks(train_with, 1, argv(dataset, ref, "ddp", 6), "drop-batches", 3)
    a, b = losses(ref), losses(out)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6), (step, a, b)
    plain = str(tmp_path / "plain")
    run_ranks(train, 1, argv(dataset, plain, "ddp", 3))
    assert b[3] != pytest.approx(losses(plain)[3], rel=1e-6)  # not the step 3 a run without the fault takes


def test_the_bound_stops_a_run_that_keeps_failing(dataset, tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(Exception, match="more than trainer.max_nonfinite_steps=0"):
        run_ranks(train_with, 1, argv(dataset, out, "ddp", 6, "--trainer.on_nonfinite", "skip",
                                      "--trainer.max_nonfinite_steps", "0"), "nan", 3)


def test_a_real_divergence_stops_and_keeps_the_last_good_checkpoint(dataset, tmp_path):
    """lr 1e6 (its declared range refuses it when parsed; the test widens it): the weights blow up within a few steps. The run exits with an error, no
    checkpoint holds NaN, and keep_last=1 never pruned the last finite one."""
    out = str(tmp_path / "run")
    with pytest.raises(Exception, match="not finite"):
        run_ranks(train_with, 1, argv(dataset, out, "ddp", 40, "--optim.lr", "1e6", "--optim.warmup_steps", "0",
                                      "--checkpoint.interval_steps", "1", "--checkpoint.keep_last", "1",
                                      "--optim.grad_clip", "0"), "wide-lr")
    kept = _finite_checkpoints(out)
    from molds.errors import RecipeError
    from molds.recipe.parse import parse_recipe

    with pytest.raises(RecipeError, match=r"optim.lr=1000000.0 is outside its range"):
        parse_recipe(argv(dataset, out, "ddp", 4, "--optim.lr", "1e6"))
    assert len(kept) == 1 and open(os.path.join(out, "checkpoints", "latest")).read() == f"step-{kept[0]:08d}"
