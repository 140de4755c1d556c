"""Fault 1: SIGKILL one rank mid-run under each launcher. The whole job exits non-zero
within a bounded time, and ``--resume auto`` continues from the last complete checkpoint
with the losses an uninterrupted run has (constant learning rate, so the killed run's
length does not shape the schedule)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.dist.spawn import free_port, run_ranks
from tests.faults.common import argv, losses, train

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONSTANT_LR = ("--optim.min_lr_ratio", "1.0", "--optim.warmup_steps", "0")


def _launch(launcher, args):
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                str(free_port()), "molds/train.py", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(free_port()), "molds/train.py", *args]


@pytest.mark.slow
@pytest.mark.parametrize("launcher,engine", [("torchrun", "ddp"), ("deepspeed", "zero")])
def test_kill_a_rank_then_resume(dataset, tmp_path, launcher, engine):
    from molds.checkpoint import read_lineage, resolve

    out = str(tmp_path / "run")
    proc = subprocess.Popen(_launch(launcher, argv(dataset, out, engine, 100000, *CONSTANT_LR)), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = os.path.join(out, "metrics.jsonl")
        deadline = time.time() + 300
        while time.time() < deadline and not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 5):
            time.sleep(0.2)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "molds/train.py" in " ".join(p.cmdline())]
        assert len(ranks) >= 2, "training never started"
        killed = time.time()
        ranks[-1].send_signal(signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
        assert time.time() - killed < 60, "the job took too long to end"
    finally:
        if proc.poll() is None:
            proc.kill()
    step = read_lineage(resolve(out))["step"]
    assert step >= 2
    resumed_to = step + 3
    run_ranks(train, 2, argv(dataset, out, engine, resumed_to, *CONSTANT_LR, "--checkpoint.resume", "auto"))
    ref = str(tmp_path / "ref")
    run_ranks(train, 2, argv(dataset, ref, engine, resumed_to, *CONSTANT_LR))
    a, b = losses(ref), losses(out)
    assert sorted(b) == list(range(1, resumed_to + 1))  # the log continues from the checkpoint, no stale rows
    for s in range(step + 1, resumed_to + 1):
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-7), s
