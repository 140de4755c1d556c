"""Fault 6: a hung peer. The job ends within the configured collective timeout (plus the
launcher's teardown), with one line naming the rank that noticed and the operation, and
saying that the peers are alive (their heartbeats beat: one is stuck, none is lost)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.dist.spawn import free_port
from tests.faults.common import argv

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
INJECT = os.path.join(os.path.dirname(__file__), "inject")


@pytest.mark.slow
@pytest.mark.parametrize("launcher,engine", [("deepspeed", "zero"), ("torchrun", "ddp")])
def test_a_hung_peer_ends_the_job_within_the_timeout(dataset, tmp_path, launcher, engine):
    out = str(tmp_path / "run")
    args = ["molds/train.py", *argv(dataset, out, engine, 20, "--parallel.collective_timeout_s", "5")]
    if launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
               str(free_port()), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([INJECT, os.path.abspath(ROOT)]), MOLDS_TEST_FAULT="hang:1:3")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    hung = None  # when step 2 was logged: step 3, where rank 1 hangs, starts then
    deadline = time.monotonic() + 300
    while hung is None and proc.poll() is None and time.monotonic() < deadline:
        if os.path.exists(metrics) and any('"step": 2,' in line for line in open(metrics)):
            hung = time.monotonic()
        time.sleep(0.1)
    _, err = proc.communicate(timeout=300)
    took = time.monotonic() - (hung or deadline)
    assert hung is not None and proc.returncode != 0, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("molds-train: error")]
    assert line, err[-3000:]
    assert "[rank 0]" in line[0] and "step 3: forward/backward/optimizer did not complete" in line[0]
    assert "collective_timeout_s=5" in line[0] and "a peer is alive but stuck (hung)" in line[0]
    # the collective timeout (5 s), then the heartbeats read and the launcher's teardown: seen 9.9 s
    # (torchrun) and 11.3 s (deepspeed) after step 3 began, on 2 cores; held to the timeout + 20 s
    assert took < 25, f"the job ended {took:.1f} s after the hang began"
