"""molds-average: the mean of a run's last checkpoints is a checkpoint every reader opens,
resume refuses it (a fork of its weights alone is fine), and sources that are not one
model are refused with the file and key."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from molds.errors import CheckpointError
from tests.faults.common import argv as fault_argv


def _argv(dataset, out, *extra):
    return fault_argv(dataset, out, "ddp", 6, *extra, interval=2, hidden=32)


@pytest.fixture(scope="module")
def run_dir(dataset, tmp_path_factory):
    from molds.train import main

    out = str(tmp_path_factory.mktemp("avg") / "run")
    main(_argv(dataset, out))
    return out


def _step(run, n):
    return os.path.join(run, "checkpoints", f"step-{n:08d}")


def _rewrite(ckpt, tensors=None, lineage=None):
    """Change a copied checkpoint's files and its COMPLETE marker to match."""
    if tensors is not None:
        save_file(tensors, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    if lineage is not None:
        with open(os.path.join(ckpt, "lineage.json"), "w") as fh:
            json.dump(lineage, fh)
    marker = os.path.join(ckpt, "COMPLETE")
    record = json.load(open(marker))
    record["files"] = {n: os.path.getsize(os.path.join(ckpt, n)) for n in record["files"]}
    json.dump(record, open(marker, "w"))


def test_average_of_the_last_checkpoints_is_their_mean_and_opens_everywhere(run_dir, tmp_path, capsys):
    from molds.checkpoint import open_checkpoint
    from molds.cli.average import main as average_main
    from molds.cli.sample import main as sample_main
    from molds.export import export

    out = str(tmp_path / "avg")
    assert average_main([run_dir, out, "--last", "3"]) == 0
    sources = [load_file(os.path.join(_step(run_dir, s), "model.safetensors")) for s in (2, 4, 6)]
    got = load_file(os.path.join(out, "model.safetensors"))
    assert got.keys() == sources[0].keys()
    moved = 0
    for k, v in got.items():
        expect = torch.stack([s[k].double() for s in sources]).mean(0).float()
        assert v.dtype == sources[0][k].dtype
        torch.testing.assert_close(v, expect, rtol=0, atol=1e-7)
        moved += int(not torch.equal(v, sources[-1][k]))
    assert moved > len(got) // 2  # the weights trained between checkpoints: the mean is not the last one
    lineage = json.load(open(os.path.join(out, "lineage.json")))
    assert [s["step"] for s in lineage["averaged_from"]] == [2, 4, 6] and lineage["step"] == 6

    # the readers take it as any checkpoint: loaded weights are the mean, sampling and export run
    loaded = open_checkpoint(out)
    for name, p in loaded.model.named_parameters():
        assert p.abs().sum() > 0, name
    sd = {k: v for k, v in loaded.model.state_dict().items()}
    emb = [k for k in sd if "embed" in k][0]
    assert torch.equal(sd[emb], got[[k for k in got if "embed" in k][0]])
    assert sample_main([out, "--num", "4", "--max_tokens", "16", "--out", str(tmp_path / "s.smi")]) == 0
    assert len(open(tmp_path / "s.smi").read().splitlines()) == 4
    assert os.path.isfile(os.path.join(export(out, str(tmp_path / "hf")), "model.safetensors"))

    # the listed form agrees with --last, in any order
    out2 = str(tmp_path / "avg2")
    assert average_main([_step(run_dir, 6), _step(run_dir, 2), _step(run_dir, 4), "--out", out2]) == 0
    again = load_file(os.path.join(out2, "model.safetensors"))
    assert all(torch.equal(again[k], got[k]) for k in got)
    capsys.readouterr()


def test_resume_refuses_an_average_and_a_fork_takes_its_weights(run_dir, dataset, tmp_path):
    from molds.checkpoint import open_checkpoint
    from molds.checkpoint.average import average_checkpoints
    from molds.train import main

    avg = average_checkpoints([_step(run_dir, 4), _step(run_dir, 6)], str(tmp_path / "avg"))
    with pytest.raises(CheckpointError, match=r"is an average of checkpoints \(steps 4, 6\).*no optimizer state"):
        main(_argv(dataset, str(tmp_path / "resumed"), "--checkpoint.resume", avg))
    with pytest.raises(CheckpointError, match="is an average"):  # a fork that wants its optimizer moments
        main(_argv(dataset, str(tmp_path / "f1"), "--checkpoint.resume", avg, "--checkpoint.fork", "true",
                   "--checkpoint.fork_optimizer", "true"))
    fork = str(tmp_path / "fork")
    main(_argv(dataset, fork, "--checkpoint.resume", avg, "--checkpoint.fork", "true") + ["--trainer.max_steps", "2"])
    lineage = json.load(open(os.path.join(_step(fork, 2), "lineage.json")))
    assert lineage["parent"]["checkpoint"] == os.path.abspath(avg)
    assert open_checkpoint(fork).lineage["step"] == 2


def test_sources_that_are_not_one_model_are_refused(run_dir, tmp_path):
    from molds.checkpoint.average import average_checkpoints, last_checkpoints
    from molds.cli.average import main as average_main

    a, b = _step(run_dir, 4), _step(run_dir, 6)
    out = str(tmp_path / "out")

    def copy(name):
        dst = str(tmp_path / name)
        shutil.copytree(b, dst)
        return dst

    nan = copy("nan")
    t = load_file(os.path.join(nan, "model.safetensors"))
    key = sorted(t)[0]
    t[key] = t[key].clone()
    t[key].view(-1)[0] = float("nan")
    _rewrite(nan, tensors=t)
    with pytest.raises(CheckpointError, match=f"nan/model.safetensors: '{key}' holds non-finite values"):
        average_checkpoints([a, nan], out)

    shaped = copy("shaped")
    t = load_file(os.path.join(shaped, "model.safetensors"))
    t[key] = torch.cat([t[key], t[key]])
    _rewrite(shaped, tensors=t)
    with pytest.raises(CheckpointError, match=f"shaped/model.safetensors: '{key}' is torch.float32"):
        average_checkpoints([a, shaped], out)

    extra = copy("extra")
    t = load_file(os.path.join(extra, "model.safetensors"))
    t["stray.weight"] = torch.zeros(2)
    _rewrite(extra, tensors=t)
    with pytest.raises(CheckpointError, match="holds other tensors .*stray.weight"):
        average_checkpoints([a, extra], out)

    other = copy("other")
    lineage = json.load(open(os.path.join(other, "lineage.json")))
    lineage["recipe"]["model"]["num_layers"] = 3
    _rewrite(other, lineage=lineage)
    with pytest.raises(CheckpointError, match="hold different models"):
        average_checkpoints([a, other], out)
    lineage = json.load(open(os.path.join(b, "lineage.json")))
    lineage["vocab_hash"] = "0" * 64
    _rewrite(other, lineage=lineage)
    with pytest.raises(CheckpointError, match="differ in lineage 'vocab_hash'"):
        average_checkpoints([a, other], out)

    with pytest.raises(CheckpointError, match="listed twice"):
        average_checkpoints([a, a], out)
    with pytest.raises(CheckpointError, match="is one of the checkpoints being averaged"):
        average_checkpoints([a, b], b)
    avg = average_checkpoints([a, b], out)
    with pytest.raises(CheckpointError, match="is itself an average"):
        average_checkpoints([avg, a], str(tmp_path / "out2"))
    with pytest.raises(CheckpointError, match="7 checkpoints asked for, 3 complete ones"):
        last_checkpoints(run_dir, 7)
    assert average_main([run_dir, "--last", "2"]) == 2  # no output directory: a usage error
    assert not os.path.exists(str(tmp_path / "out2"))
    # every refusal left the earlier average whole
    assert sorted(os.listdir(out)) == ["COMPLETE", "lineage.json", "model.safetensors"]


def test_a_run_directory_means_its_averaged_model_while_it_is_current(run_dir, tmp_path, capsys):
    """molds-sample / molds-eval / molds-export RUN take RUN/averaged (what
    checkpoint.average_last writes) when it was made from the run's newest checkpoint; a
    stale or broken one is passed over, named; resume and averaging never take it."""
    from molds.checkpoint import open_checkpoint, resolve, resolve_model
    from molds.checkpoint.average import average_checkpoints

    run = str(tmp_path / "run")
    shutil.copytree(run_dir, run)
    assert resolve_model(run) == resolve(run) == _step(run, 6)  # no average: the latest checkpoint, quietly
    assert capsys.readouterr().err == ""
    avg = average_checkpoints([_step(run, 4), _step(run, 6)], os.path.join(run, "averaged"))
    assert resolve_model(run) == avg and resolve(run) == _step(run, 6)
    assert "its averaged model" in capsys.readouterr().err
    assert open_checkpoint(run).checkpoint == avg
    assert resolve_model(_step(run, 6)) == _step(run, 6)  # a named checkpoint is what was named

    stale = average_checkpoints([_step(run, 2), _step(run, 4)], os.path.join(run, "averaged"))
    assert resolve_model(run) == _step(run, 6)
    assert "averages checkpoints up to step 4, and the run's newest is step 6" in capsys.readouterr().err
    os.remove(os.path.join(stale, "COMPLETE"))
    assert resolve_model(run) == _step(run, 6)
    assert "no COMPLETE marker" in capsys.readouterr().err
