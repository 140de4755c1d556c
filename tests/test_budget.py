"""Time-budgeted training (molds.recipe.budget, ``trainer.max_time``): the schedule follows the
fraction of the budget spent, the run stops at the budget with its checkpoints at budget
fractions and the average of the last ones; a run killed halfway and resumed spends the
same total budget to within a step, continues the schedule from the fraction it reached,
and trains on exactly the molecules an uninterrupted run would, none twice, none skipped."""

from __future__ import annotations

import glob
import json
import os

import pytest
from torch.multiprocessing import ProcessExitedException

from molds.recipe.budget import Horizon, format_duration, parse_duration
from tests.dist.spawn import run_ranks
from tests.faults.common import died_by_sigkill_at


@pytest.mark.parametrize("text,seconds", [("2h", 7200), ("1h45m", 6300), ("90m", 5400), ("5400s", 5400),
                                          ("5400", 5400), ("1.5h", 5400), (" 2h 10m ", 7800)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("bad", ["2 hours", "h", "1h-5m", "", "10x"])
def test_a_bad_duration_is_refused(bad):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(bad)


def test_the_schedule_follows_the_budget_fraction():
    from molds.engines.optim import lr_lambda
    from molds.recipe.sections import OptimConfig

    optim = OptimConfig(lr=1.0, warmup_fraction=0.1, min_lr_ratio=0.05)
    h = Horizon(max_time_s=100.0)
    f = lr_lambda(optim, h)
    want = {0.0: 0.0, 0.05: 0.5, 0.1: 1.0, 0.55: 0.05 + 0.95 * 0.5, 1.0: 0.05}
    for fraction, factor in want.items():
        h.elapsed_s = 100.0 * fraction
        assert f(12345) == pytest.approx(factor), fraction  # the step does not matter
    # by steps, the numbers the recipes always had
    steps = lr_lambda(OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1), 110)
    assert steps(0) == pytest.approx(0.1) and steps(10) == pytest.approx(1.0) and steps(110) == pytest.approx(0.1)
    assert lr_lambda(OptimConfig(lr=1.0, warmup_steps=10), Horizon(max_steps=110))(60) == steps(60)


def _budgeted(rank, world, args, kill_at_save=0):
    """``main(args)`` recording every molecule this rank trains on (``<out>.gids-rank<r>``),
    killed by SIGKILL right after its ``kill_at_save``-th checkpoint is complete."""
    import signal

    import molds.checkpoint as ckpt
    from molds.train import main
    from tests.faults.common import killed_at, patch_everywhere, record_gids

    record_gids(rank, args)
    if kill_at_save:
        saves = {"n": 0}
        original = ckpt.save_checkpoint

        def save(*a, **k):
            path = original(*a, **k)
            saves["n"] += 1
            if saves["n"] == kill_at_save:
                killed_at(args, f"after save {kill_at_save}")
                os.kill(os.getpid(), signal.SIGKILL)
            return path

        patch_everywhere(original, save)
    return main(args)


def _argv(dataset, out, *extra):
    from tests.faults.common import argv

    return argv(dataset, out, "ddp", 1, "--trainer.max_steps", "null", *extra, interval=0)


def _lineage(checkpoint):
    return json.load(open(os.path.join(checkpoint, "lineage.json")))


@pytest.mark.slow
def test_a_budgeted_run_killed_and_resumed_spends_its_budget_and_sees_each_molecule_once(dataset, tmp_path):
    from molds.engines.optim import lr_lambda
    from molds.recipe.sections import OptimConfig
    from tests.faults.common import metrics

    budget = 16.0
    timed = ["--trainer.max_time", f"{budget:g}s", "--optim.warmup_steps", "null", "--optim.warmup_fraction", "0.1",
             "--checkpoint.interval_fraction", "0.25", "--checkpoint.average_last", "2", "--checkpoint.keep_last", "0"]
    out = str(tmp_path / "run")
    with pytest.raises(ProcessExitedException) as died:  # killed after its second checkpoint (half the budget)
        run_ranks(_budgeted, 1, _argv(dataset, out, *timed), 2)
    died_by_sigkill_at(died, out, "after save 2")
    half = sorted(glob.glob(os.path.join(out, "checkpoints", "step-*")))
    assert len(half) == 2
    carried = _lineage(half[-1])["horizon"]
    assert 0.5 <= carried["fraction"] < 0.75 and carried["max_time_s"] == budget
    os.rename(out + ".gids-rank0", out + ".gids-first")

    result = run_ranks(_budgeted, 1, _argv(dataset, out, *timed, "--checkpoint.resume", "auto"))[0]
    final = _lineage(result["checkpoint"])["horizon"]
    rows = [r for r in metrics(out) if "train/lr" in r]
    resumed_rows = [r for r in rows if r["step"] > carried["step"]]
    step_s = (final["elapsed_s"] - carried["elapsed_s"]) / (final["step"] - carried["step"])
    # the total: the budget, to within the step that crossed it (and its bookkeeping)
    assert budget <= final["elapsed_s"] <= budget + 3 * step_s + 0.5, (final, step_s)
    assert final["fraction"] == 1.0 and result["summary"]["horizon"]["step"] == final["step"]
    # the schedule continues from the fraction the checkpoint reached
    h = Horizon(max_time_s=budget)
    h.elapsed_s = carried["elapsed_s"]
    want = 3e-3 * lr_lambda(OptimConfig(lr=3e-3, warmup_fraction=0.1, min_lr_ratio=0.1), h)(0)
    assert resumed_rows[0]["step"] == carried["step"] + 1
    assert resumed_rows[0]["train/lr"] == pytest.approx(want, rel=1e-6)
    assert resumed_rows[-1]["train/lr"] == pytest.approx(3e-3 * 0.1, rel=0.05)  # decayed to its floor at the end
    # the final model: the mean of the last two checkpoints
    avg = _lineage(result["averaged"])
    sources = [os.path.basename(src["checkpoint"]) for src in avg["averaged_from"]]
    assert len(sources) == 2 and sources[-1] == os.path.basename(result["checkpoint"])
    # the molecules: exactly the stream an uninterrupted run reads, step for step
    first = [line.split() for line in open(out + ".gids-first")][:carried["step"]]
    second = [line.split() for line in open(out + ".gids-rank0")]
    ref = str(tmp_path / "ref")
    run_ranks(_budgeted, 1, _argv(dataset, ref, "--trainer.max_steps", str(final["step"]), "--optim.warmup_steps", "1"))
    reference = [line.split() for line in open(ref + ".gids-rank0")]
    assert first + second == reference


def test_the_recipe_check_refuses_mixed_lengths_and_knobs():
    from molds.errors import RecipeError
    from molds.recipe.parse import parse_recipe, validate

    smoke = os.path.join(os.path.dirname(__file__), "..", "recipes", "smoke", "dense_ddp.json")
    for extra, key in ((["--trainer.max_time", "2h"], "both set"),
                       (["--trainer.max_steps", "null", "--trainer.max_time", "soon"], "not a duration"),
                       (["--trainer.max_steps", "null", "--trainer.max_time", "1h", "--optim.warmup_steps", "10"],
                        "warmup_fraction"),
                       (["--optim.warmup_steps", "10", "--optim.warmup_fraction", "0.1"], "both set: give one"),
                       (["--checkpoint.average_last", "3", "--checkpoint.interval_steps", "0"],
                        "needs checkpoints during the run"),
                       (["--checkpoint.average_last", "3", "--checkpoint.interval_steps", "10",
                         "--checkpoint.keep_last", "2"], "keeps fewer")):
        recipe = parse_recipe(["--recipe", smoke, *extra])
        with pytest.raises(RecipeError, match=key):
            validate(recipe, 1)
    assert [parse_duration(t) for t in ("2h", "1h45m", "90m", "5400s", "5400", "0.5h")] == [7200, 6300, 5400, 5400,
                                                                                          5400, 1800]
    for bad in ("soon", "2d", "1h-5m", "", "h"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)
