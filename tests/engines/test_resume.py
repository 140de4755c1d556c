"""Stop-and-resume gives the losses of an uninterrupted run (2 gloo ranks, CPU, fp32),
and the canonical checkpoint moves between engines and world sizes."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.dist.spawn import run_ranks

SLOW = pytest.mark.slow  # also in the default suite: the other cases of the same test


def _argv(dataset, out, engine, steps, extra=(), stage=2):
    from tests.faults.common import argv

    return argv(dataset, out, engine, steps, "--logging.tensorboard", "true", *extra, stage=stage, interval=3,
                accum=2, hidden=64)


def _main(rank, world, argv):
    from molds.train import main

    return main(argv)


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return {r["step"]: r["train/loss"] for r in map(json.loads, fh) if "train/loss" in r}


def copy_checkpoint(src_run, step, dst_run):
    """A run directory holding only checkpoint ``step`` of ``src_run``."""
    name = f"step-{step:08d}"
    os.makedirs(os.path.join(dst_run, "checkpoints"))
    shutil.copytree(os.path.join(src_run, "checkpoints", name), os.path.join(dst_run, "checkpoints", name))
    with open(os.path.join(dst_run, "checkpoints", "latest"), "w") as fh:
        fh.write(name)


@pytest.mark.parametrize("engine,stage", [("ddp", 0), ("zero", 2), pytest.param("zero", 3, marks=pytest.mark.slow)],
                         ids=["ddp", "zero2", "zero3"])
def test_resume_matches_uninterrupted(dataset, tmp_path, engine, stage):
    full = str(tmp_path / "full")
    run_ranks(_main, 2, _argv(dataset, full, engine, 7, stage=stage))
    ckpts = sorted(os.listdir(os.path.join(full, "checkpoints")))
    assert ckpts == ["latest", "step-00000003", "step-00000006", "step-00000007"]
    step3 = os.path.join(full, "checkpoints", "step-00000003")
    assert sorted(os.listdir(step3)) == ["COMPLETE", "data_state.json", "lineage.json", "model.safetensors",
                                         "optimizer.safetensors", "rng-rank00000.json", "rng-rank00001.json",
                                         "train_state.json"]  # the canonical layout, nothing pickled
    lineage = json.load(open(os.path.join(step3, "lineage.json")))
    for key in ("recipe", "manifest_hash", "vocab_hash", "canonicalization_hash", "world_topology", "step",
                "code_version", "engine", "schedule", "global_batch_sequences"):
        assert key in lineage
    assert lineage["world_topology"] == {"world_size": 2, "rank": 0, "dp_size": 2, "dp_rank": 0, "pp_size": 1,
                                         "pp_rank": 0, "ep_size": 1, "ep_rank": 0}
    assert os.listdir(os.path.join(full, "tensorboard"))

    resumed = str(tmp_path / "resumed")
    copy_checkpoint(full, 3, resumed)
    run_ranks(_main, 2, _argv(dataset, resumed, engine, 7, ["--checkpoint.resume", "auto"], stage=stage))
    a, b = losses(full), losses(resumed)
    assert sorted(b) == [4, 5, 6, 7]
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step


def _reload_and_save(rank, world, argv, source, target):
    """Build the run the recipe describes, load ``source`` into its engine and save it
    again at the same step into ``target``: resharding in and out."""
    from molds.checkpoint import restore, save_checkpoint
    from molds.recipe.parse import parse_recipe
    from molds.train import setup

    run = setup(parse_recipe(argv))
    step, data_state = restore(source, run.engine, run.dist)
    save_checkpoint(target, run.engine, run.dist, step, data_state, run.lineage, keep_last=0)
    run.log.close()


@pytest.mark.parametrize("engine,stage,world", [("zero", 2, 1), ("zero", 3, 1), pytest.param("ddp", 0, 1, marks=SLOW),
                                                 pytest.param("zero", 1, 2, marks=SLOW)],
                         ids=["zero2-to-1rank", "zero3-to-1rank", "zero2-to-ddp", "zero2-to-zero1"])
def test_canonical_state_moves_between_engines_and_world_sizes(dataset, tmp_path, engine, stage, world):
    """A ZeRO-2 checkpoint of 2 ranks, loaded on another engine / stage / world size and
    saved again: weights and optimizer moments are what they were, to the bit."""
    from safetensors.torch import load_file

    src = str(tmp_path / "src")
    run_ranks(_main, 2, _argv(dataset, src, "zero", 3, stage=2))
    source = os.path.join(src, "checkpoints", "step-00000003")
    out = str(tmp_path / "dst")
    accum = ["--trainer.grad_accum", str(4 // (2 * world))]
    run_ranks(_reload_and_save, world, _argv(dataset, str(tmp_path / "w"), engine, 3, accum, stage=stage), source,
              out)
    target = os.path.join(out, "checkpoints", "step-00000003")
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(os.path.join(source, name)), load_file(os.path.join(target, name))
        assert a.keys() == b.keys() and len(a) > 10
        for k in a:
            assert (a[k] == b[k]).all(), (name, k)
    meta = [json.load(open(os.path.join(d, "train_state.json"))) for d in (source, target)]
    assert meta[0] == meta[1] and meta[0]["optimizer_step"] == 3


def test_resume_refuses_another_manifest_and_a_fork_starts_fresh(dataset, tmp_path):
    from molds.errors import CheckpointError
    from molds.train import main

    out = str(tmp_path / "run")
    main(_argv(dataset, out, "ddp", 1))
    other = str(tmp_path / "other")
    shutil.copytree(dataset, other)
    m = json.load(open(os.path.join(other, "manifest.json")))
    m["split"]["seed"] = 123  # different content, same files
    json.dump(m, open(os.path.join(other, "manifest.json"), "w"))
    argv = _argv(other, out, "ddp", 2, ["--checkpoint.resume", "auto"])
    with pytest.raises(CheckpointError, match="another manifest"):
        main(argv)
    forked = str(tmp_path / "fork")
    result = main(_argv(other, forked, "ddp", 2, ["--checkpoint.resume", out, "--checkpoint.fork", "true"]))
    assert result["step"] == 2
    lineage = json.load(open(os.path.join(result["checkpoint"], "lineage.json")))
    assert lineage["parent"]["step"] == 1 and lineage["parent"]["checkpoint"].endswith("step-00000001")
    assert lineage["manifest_hash"] != lineage["parent"]["manifest_hash"]
    state = json.load(open(os.path.join(result["checkpoint"], "data_state.json")))
    assert all(v["epoch"] == 0 for v in state["vranks"].values())  # a fresh cursor on the new manifest
    assert sorted(losses(forked)) == [1, 2]
    # a manifest tokenized with another vocabulary of the same size (the tokens in another
    # order, as another data set's frequencies give): the weights would fit, the ids would not
    relabelled = str(tmp_path / "relabelled")
    shutil.copytree(dataset, relabelled)
    tok_file = os.path.join(relabelled, "tokenizer", "tokenizer.json")
    tok = json.load(open(tok_file))
    vocab = tok["model"]["vocab"]
    a, b = sorted((t for t, i in vocab.items() if i > 10), key=vocab.get)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    json.dump(tok, open(tok_file, "w"))
    m = json.load(open(os.path.join(relabelled, "manifest.json")))
    from molds.data.manifest import vocab_hash

    m["tokenizer"]["vocab_hash"] = vocab_hash(vocab)
    json.dump(m, open(os.path.join(relabelled, "manifest.json"), "w"))
    with pytest.raises(CheckpointError, match=r"cannot fork .* tokenizer vocabulary .*--tokenizer .*/tokenizer"):
        main(_argv(relabelled, str(tmp_path / "fork2"), "ddp", 2, ["--checkpoint.resume", out,
                                                                   "--checkpoint.fork", "true"]))


def test_auto_resumes_in_the_precision_of_the_run_it_continues(dataset, tmp_path, capfd):
    """``trainer.precision=auto`` is measured at start; on a resume it keeps what the
    checkpoint's run computed in, so a machine that now measures the other way round (a
    busy one, rates close together) still continues with the uninterrupted run's losses.
    The first run here takes the precision that ``auto`` does not measure to be faster."""
    import torch

    from molds.recipe.parse import parse_recipe
    from molds.recipe.precision import gemm_shape, resolve_precision
    from molds.train import main

    full = str(tmp_path / "full")
    shape = gemm_shape(parse_recipe(_argv(dataset, full, "ddp", 4)))
    measured = resolve_precision("auto", torch.device("cpu"), shape)
    other = "fp32" if measured.dtype is torch.bfloat16 else "bf16"
    main(_argv(dataset, full, "ddp", 4, ["--trainer.precision", other]))
    resumed = str(tmp_path / "resumed")
    copy_checkpoint(full, 3, resumed)
    capfd.readouterr()
    main(_argv(dataset, resumed, "ddp", 4, ["--trainer.precision", "auto", "--checkpoint.resume", "auto"]))
    err = capfd.readouterr().err
    assert f"precision auto -> {other}:" in err and f"{other} kept from the checkpoint's run" in err, err
    lineage = json.load(open(os.path.join(resumed, "checkpoints", "step-00000004", "lineage.json")))
    assert lineage["plan"]["dtype"] == ("bfloat16" if other == "bf16" else "float32")
    assert losses(resumed)[4] == pytest.approx(losses(full)[4], rel=1e-6, abs=1e-7)


def test_fp8_products_faster_records_its_choice_and_a_resume_keeps_it(dataset, tmp_path, capfd):
    """``kernels.fp8_products=faster`` through train.py: the start line gives every
    product's measured ratio, the lineage records the choice, and a resume takes it from
    the checkpoint instead of measuring again, with the uninterrupted run's losses."""
    from molds.train import main

    fp8 = ["--kernels.fp8", "true", "--kernels.fp8_products", "faster"]
    full = str(tmp_path / "full")
    capfd.readouterr()
    main(_argv(dataset, full, "ddp", 4, fp8))
    err = capfd.readouterr().err
    assert "fp8 products (kernels.fp8_products=faster):" in err and "which a resume keeps" not in err, err
    first = json.load(open(os.path.join(full, "checkpoints", "step-00000004", "lineage.json")))["fp8_products"]
    assert first["products"] and not first["kept"]
    assert all(p["fp8"] == (p["fp8_s"] < p["base_s"]) for p in first["products"])
    resumed = str(tmp_path / "resumed")
    copy_checkpoint(full, 3, resumed)
    main(_argv(dataset, resumed, "ddp", 4, fp8 + ["--checkpoint.resume", "auto"]))
    err = capfd.readouterr().err
    assert "which a resume keeps" in err, err
    again = json.load(open(os.path.join(resumed, "checkpoints", "step-00000004", "lineage.json")))["fp8_products"]
    assert again["products"] == first["products"] and again["kept"]
    assert losses(resumed)[4] == pytest.approx(losses(full)[4], rel=1e-6, abs=1e-7)


def test_profile_steps_says_where_the_steps_went(dataset, tmp_path, capfd):
    """``logging.profile_steps``: the steps after the first logging window are profiled;
    the line, the ``profile/*`` figures and the Chrome trace agree with each other, and
    the categories and the time outside operators add up to the step."""
    from molds.train import main

    out = str(tmp_path / "run")
    capfd.readouterr()
    main(_argv(dataset, out, "ddp", 9, ["--logging.profile_steps", "2", "--logging.interval_steps", "3"]))
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("[molds] profile of steps"))
    assert line.startswith("[molds] profile of steps 4-5:") and "aten::" in line, line  # interval 3: after step 3
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    prof = next(r for r in rows if "profile/step_ms" in r)
    assert prof["step"] == 5
    parts = sum(v for k, v in prof.items() if k.startswith("profile/") and k != "profile/step_ms")
    assert parts == pytest.approx(prof["profile/step_ms"], rel=0.01, abs=0.05)
    assert prof["profile/gemm_ms"] > 0 and prof["profile/optimizer_ms"] > 0
    # an unprofiled window (steps 7-9) against the profiled steps: the same order of time
    logged = next(r for r in rows if r["step"] == 9 and "train/step_s" in r)
    assert 0.2 * logged["train/step_s"] * 1e3 < prof["profile/step_ms"] < 5 * logged["train/step_s"] * 1e3
    trace = json.load(open(os.path.join(out, "profile", "steps-4-5.json")))
    assert any(ev.get("name", "").startswith("aten::") for ev in trace["traceEvents"])
