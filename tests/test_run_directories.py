"""Run directories, resume and fork semantics as a user meets them (issue: a trainer a
new user can trust)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from tests.faults.common import argv, metrics


def test_a_second_run_into_the_same_directory_is_refused(dataset, tmp_path):
    from molds.errors import RecipeError
    from molds.train import main

    out = str(tmp_path / "run")
    main(argv(dataset, out, "ddp", 2))
    before = open(os.path.join(out, "metrics.jsonl")).read()
    with pytest.raises(RecipeError, match=r"already holds a run .*--checkpoint.resume auto.*--run.overwrite true"):
        main(argv(dataset, out, "ddp", 2))
    assert open(os.path.join(out, "metrics.jsonl")).read() == before  # nothing touched
    main(argv(dataset, out, "ddp", 2, "--run.overwrite", "true"))  # start over: the old run is gone
    assert [r["step"] for r in metrics(out) if "train/loss" in r] == [1, 2]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step-00000002"]


def test_resume_continues_logs_without_duplicates(dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from molds.train import main

    out = str(tmp_path / "run")
    main(argv(dataset, out, "ddp", 5, "--checkpoint.interval_steps", "2"))  # checkpoints at 2, 4, 5
    os.remove(os.path.join(out, "checkpoints", "latest"))
    import shutil

    shutil.rmtree(os.path.join(out, "checkpoints", "step-00000005"))  # as if the run had died after step 4
    main(argv(dataset, out, "ddp", 6, "--checkpoint.resume", "auto"))
    steps = [r["step"] for r in metrics(out) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    acc = EventAccumulator(os.path.join(out, "tensorboard")).Reload()
    tb = [e.step for e in acc.Scalars("train/loss")]
    assert sorted(tb) == [1, 2, 3, 4, 5, 6]  # the events of the lost step 5 were purged


def test_learning_rate_change_on_resume_is_applied_and_recorded(dataset, tmp_path):
    from molds.errors import CheckpointError
    from molds.train import main

    out = str(tmp_path / "run")
    main(argv(dataset, out, "ddp", 2, "--optim.warmup_steps", "0", "--optim.min_lr_ratio", "1.0"))
    result = main(argv(dataset, out, "ddp", 4, "--optim.warmup_steps", "0", "--optim.min_lr_ratio", "1.0",
                       "--optim.lr", "1e-4", "--checkpoint.resume", "auto"))
    lrs = {r["step"]: r["train/lr"] for r in metrics(out) if "train/lr" in r}
    assert lrs[2] == pytest.approx(3e-3) and lrs[3] == pytest.approx(1e-4) and lrs[4] == pytest.approx(1e-4)
    lineage = json.load(open(os.path.join(result["checkpoint"], "lineage.json")))
    change = lineage["resume_changes"][0]
    assert change["at_step"] == 2 and change["changes"]["optim.lr"] == [3e-3, 1e-4]
    assert change["changes"]["trainer.max_steps"] == [2, 4]
    with pytest.raises(CheckpointError, match=r"model.hidden_size: 32 -> 64.*--checkpoint.fork true"):
        main(argv(dataset, out, "ddp", 6, "--model.hidden_size", "64", "--checkpoint.resume", "auto"))
    with pytest.raises(CheckpointError, match=r"optim.weight_decay"):
        main(argv(dataset, out, "ddp", 6, "--optim.weight_decay", "0.5", "--checkpoint.resume", "auto"))


def test_fork_keeps_weights_and_optionally_the_optimizer(dataset, tmp_path):
    from safetensors.torch import load_file

    from molds.train import main

    src = str(tmp_path / "src")
    main(argv(dataset, src, "ddp", 2))
    ckpt = os.path.join(src, "checkpoints", "step-00000002")
    for keep in (False, True):
        out = str(tmp_path / f"fork-{keep}")
        extra = ["--checkpoint.fork_optimizer", "true"] if keep else []
        # a fork may change anything, the model's width excepted (the weights must fit)
        main(argv(dataset, out, "ddp", 1, "--checkpoint.resume", src, "--checkpoint.fork", "true",
                  "--optim.weight_decay", "0.0", "--optim.lr", "0.0", "--optim.warmup_steps", "0", *extra))
        new = os.path.join(out, "checkpoints", "step-00000001")
        a, b = load_file(os.path.join(ckpt, "model.safetensors")), load_file(os.path.join(new, "model.safetensors"))
        assert all((a[k] == b[k]).all() for k in a)  # lr 0: the weights are the parent's
        state = json.load(open(os.path.join(new, "train_state.json")))
        assert state["optimizer_step"] == (3 if keep else 1)  # moments kept (step count continues) or fresh


#: run in a child as a user without root's override of file permissions: root's process drops
#: CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (capset), so a read-only directory refuses it as it
#: refuses any user; then the trainer runs, and its first line of error is printed
AS_A_USER = """
import ctypes, os, sys
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    header, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
    data[0].effective &= ~((1 << 1) | (1 << 2))
    assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
from molds.errors import RecipeError
from molds.train import main
try:
    main(sys.argv[1:])
except RecipeError as exc:
    print("RecipeError:", exc)
"""


def test_read_only_output_directory_is_refused_at_start(dataset, tmp_path):
    import subprocess
    import sys

    from molds.errors import RecipeError
    from molds.train import main

    blocker = tmp_path / "file"  # a path that cannot be a directory
    blocker.write_text("x")
    with pytest.raises(RecipeError, match="run.output_dir"):
        main(argv(dataset, str(blocker / "run"), "ddp", 2))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    proc = subprocess.run([sys.executable, "-c", AS_A_USER, *argv(dataset, str(ro / "run"), "ddp", 2)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"RecipeError: run.output_dir={ro / 'run'} is not writable (Permission denied)" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not os.path.exists(ro / "run")


def test_seq_len_truncation_is_warned_counted_and_logged(dataset, tmp_path, capsys):
    """The counts are those of the rows longer than ``seq_len``, read from the shards with
    pyarrow: a lookahead as large as the training split takes the whole epoch in at the first
    step, where the packer counts what it truncates."""
    import pyarrow.parquet as pq

    from molds.train import main

    manifest = json.load(open(os.path.join(dataset, "manifest.json")))
    lengths = [len(ids) for shard in manifest["splits"]["train"]
               for ids in pq.read_table(os.path.join(dataset, shard["uri"]), columns=["token_ids"])
               .column("token_ids").to_pylist()]
    # the shards hold the ids without BOS and EOS (the manifest says so), which the loader adds
    framed = 2 if manifest["tokenizer"]["ids_exclude_special_tokens"] else 0
    over = [n + framed - 40 for n in lengths if n + framed > 40]
    assert 0 < len(over) < len(lengths)
    out = str(tmp_path / "run")
    main(argv(dataset, out, "ddp", 3, "--data.seq_len", "40", "--data.lookahead", str(len(lengths))))
    err = capsys.readouterr().err
    assert "data.seq_len=40 is shorter than the longest molecule" in err and "truncated" in err
    rows = [r for r in metrics(out) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert (r["data/truncated_molecules"], r["data/truncated_tokens"]) == (len(over), sum(over)), r


def test_the_free_space_check_refuses_a_save_before_anything_is_written(dataset, tmp_path, monkeypatch):
    """Only ``shutil.disk_usage`` is patched (the run, its engine and its saves are real): the
    first save finds room, the second finds 1 MiB free of the about 1.4 MiB it needs."""
    import shutil

    from molds.checkpoint.layout import checkpoints_dir, complete_checkpoints
    from molds.errors import CheckpointError
    from molds.train import main

    out = str(tmp_path / "run")
    root = checkpoints_dir(out)
    real = shutil.disk_usage
    asked = []

    def disk_usage(path):
        usage = real(path)
        if os.path.abspath(path) != os.path.abspath(root):
            return usage
        asked.append(path)
        return usage if len(asked) == 1 else usage._replace(free=1 << 20)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with pytest.raises(CheckpointError, match=r"saving checkpoint step-00000004: .* has 1.0 MiB free, the checkpoint "
                                              r"needs about 1.\d MiB; nothing was written, the previous checkpoint"):
        main(argv(dataset, out, "ddp", 6, "--checkpoint.interval_steps", "2"))
    assert len(asked) == 2
    assert sorted(os.listdir(root)) == ["latest", "step-00000002"]  # no step 4, complete or partial
    assert [os.path.basename(c) for c in complete_checkpoints(root)] == ["step-00000002"]
    assert open(os.path.join(root, "latest")).read().strip() == "step-00000002"
    monkeypatch.setattr(shutil, "disk_usage", real)
    main(argv(dataset, out, "ddp", 6, "--checkpoint.interval_steps", "2", "--checkpoint.resume", "auto"))
    assert [r["step"] for r in metrics(out) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
