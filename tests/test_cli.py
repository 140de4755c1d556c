"""The console scripts as a user meets them: one style, every option described with its
default, one-line errors printed once, a real (non-editable) install, and every engine
runnable as a plain one-process ``python molds/train.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.dist.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "recipes", "smoke")


def _run(args, **kw):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.parametrize("module,needles", [
    ("molds.train", ["--checkpoint.resume", "--resume auto", "--fork true", "--optim.lr", "Peak learning rate",
                     "default: 0.0003)", "--debug"]),
    ("molds.cli.sample", ["--num", "how many samples", "default: 10000)", "--temperature", "default: 1.0)",
                          "a checkpoint reference"]),
    ("molds.cli.evaluate", ["--seeds", "default: 0)", "--fcd", "--samples", "--recipe", "a checkpoint reference"]),
    ("molds.cli.export", ["checkpoint out", "a checkpoint reference", "--manifest", "--dtype",
                          "default: float32)"]),
    ("molds.cli.average", ["--last", "the N newest complete checkpoints", "default: 0)", "--out",
                           "a checkpoint reference"]),
    ("molds.preprocessing.cli", ["--smiles_column", "default: smiles)", "--max_heavy_atoms"]),
    ("molds.cli.schedule", ["--schedule", "default: dualpipev)", "--micro-batches", "default: 16)", "--costs",
                            "--out"]),
    ("molds.cli.score", ["--oracle", "a PMO oracle by name", "--scoring", "--smiles_column", "default: smiles)"]),
])
def test_help_shows_every_option_with_default_and_description(module, needles):
    proc = _run([sys.executable, "-m", module, "--help"])
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for needle in needles:
        assert " ".join(needle.split()) in text, (module, needle)


def test_train_run_as_a_file_shadows_no_top_level_package():
    """``deepspeed molds/train.py`` runs the file as a script, and Python puts molds/ first on
    the path, where ``molds/kernels/`` would stand in for Hugging Face's ``kernels`` (which
    transformers imports: the encoder family failed to build). The script takes molds/ off
    the path before anything is imported; the checkout's root comes first instead."""
    code = """
import os, runpy, sys, importlib.util
here = os.path.abspath("molds")
sys.path.insert(0, here)  # what Python does for `python molds/train.py`
sys.argv = ["molds/train.py", "--help"]
try:
    runpy.run_path("molds/train.py", run_name="__main__")
except SystemExit:
    pass
spec = importlib.util.find_spec("kernels")
print("ON_PATH", here in [os.path.abspath(p or os.curdir) for p in sys.path], sys.path[0] == os.path.dirname(here),
      spec.origin if spec else None)
"""
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ON_PATH"))
    _, on_path, root_first, origin = line.split(" ", 3)
    assert on_path == "False" and root_first == "True", line
    assert not origin.startswith(os.path.join(ROOT, "molds")), line


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and "Traceback" not in line]


@pytest.mark.parametrize("case", ["config", "data", "checkpoint"])
def test_user_errors_are_one_line_printed_once(dataset, tmp_path, case):
    args = ["molds/train.py", "--recipe", os.path.join(SMOKE, "dense_ddp.json"), "--logging.progress", "false",
            "--run.output_dir", str(tmp_path / "run"), "--data.manifest", dataset]
    if case == "config":
        args += ["--trainer.max_step", "3"]
    elif case == "data":
        args[args.index(dataset)] = str(tmp_path / "no-such-data")
    else:
        args += ["--checkpoint.resume", str(tmp_path / "no-such-checkpoint")]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port())]
    proc = _run(launcher + args)
    assert proc.returncode != 0
    mine = [line for line in proc.stderr.splitlines() if line.startswith("molds-train")]
    assert len(mine) == 1, proc.stderr  # once, from rank 0, not once per rank
    assert mine[0].startswith("molds-train: error: ")
    # no traceback from molds (torchrun prints its own report of a child that failed)
    assert not [line for line in proc.stderr.splitlines() if 'File "' in line and "/molds/" in line]
    want = {"config": "trainer.max_step", "data": "no-such-data", "checkpoint": "no-such-checkpoint"}[case]
    assert want in mine[0]
    assert "usage:" not in proc.stderr  # no usage dump before the line that matters
    debug = _run([sys.executable] + args + ["--debug"])  # the traceback on request
    assert "Traceback" in debug.stderr


NOISE_SCRIPT = r"""
import enum, logging, os, sys
import torch
from molds.errors import run_cli

def main(argv):
    from transformers import RobertaForMaskedLM  # imports torchao, which logs as it loads
    import torch.utils._pytree as pytree
    cpu = torch.version.cuda is None and torch.version.hip is None
    # the records the filter must drop where they arise, and their neighbours it must keep
    logging.getLogger("torchao").warning("Failed to load %s: Could not load this library",
                                         os.path.join("site-packages", "torchao", "_C_x.so"))
    logging.getLogger("torchao").warning("KEPT: another torchao line")
    class Mine(enum.Enum):
        A = 1
    pytree.log.warning("%s is an Enum subclass and is now natively supported", Mine)
    Other = enum.Enum("Other", "B", module="torchao.quantization")
    pytree.log.warning("%s is an Enum subclass and is now natively supported", Other)
    print("CPU" if cpu else "CUDA", file=sys.stderr)

sys.exit(run_cli("noise", main, []))
"""


def test_console_scripts_drop_the_known_third_party_noise_and_nothing_else():
    """torchao's CUDA extensions failing to load into a CPU build of torch, and torch's notice
    to torchao about its enums: four lines on every model-building command, dropped; the same
    loggers' other records still shown."""
    proc = _run([sys.executable, "-c", NOISE_SCRIPT])
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "KEPT: another torchao line" in err
    assert "Mine'> is an Enum subclass" in err  # an enum of another package: torch's notice stays
    assert "Other'> is an Enum subclass" not in err and "KernelPreference" not in err
    if err.strip().splitlines()[-1] == "CPU":
        assert "Failed to load" not in err, err
    else:  # a CUDA build of torch: a failed load of torchao's extensions means something there
        assert "_C_x.so" in err


@pytest.mark.parametrize("recipe", ["dense_ddp.json", "dense_zero2.json", "dense_zero3.json"])
def test_every_engine_runs_as_one_plain_process(dataset, tmp_path, recipe):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = _run([sys.executable, "molds/train.py", "--recipe", os.path.join(SMOKE, recipe), "--data.manifest",
                 dataset, "--trainer.max_steps", "2", "--run.output_dir", str(tmp_path / "run"),
                 "--logging.progress", "false", "--eval.interval_steps", "0", "--checkpoint.interval_steps", "0"],
                env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one step = 4 sequences (4 per micro-batch x 1 accumulation x 1 data-parallel)" in proc.stderr
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "step-00000002" / "COMPLETE")


@pytest.mark.slow
def test_non_editable_install_into_a_fresh_venv(tmp_path):
    """setup.py finds every package: a plain (non-editable) install into a new virtual
    environment (reusing this one's dependencies) runs every console script and the
    quick start's first step."""
    venv = tmp_path / "venv"
    # no pip of its own: this environment's pip installs into it, building with this environment's setuptools
    assert _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)]).returncode == 0
    py = str(venv / "bin" / "python")
    build = tmp_path / "src"
    import shutil

    shutil.copytree(ROOT, build, ignore=shutil.ignore_patterns(".git", "runs", "*.egg-info", "__pycache__", "build"))
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "."],
                          cwd=build, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    here = tmp_path / "elsewhere"  # not the checkout: only the installed package can answer
    here.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check = subprocess.run([py, "-c", "import molds, os; print(molds.__file__)"], cwd=here, capture_output=True,
                           text=True, env=env)
    assert str(venv) in check.stdout, check.stdout + check.stderr  # the install, not the source tree
    for script in ("molds-preprocess", "molds-train", "molds-sample", "molds-eval", "molds-export", "molds-average",
                   "molds-schedule", "molds-score", "molds-predict"):
        proc = subprocess.run([str(venv / "bin" / script), "--help"], cwd=here, capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0 and "usage" in proc.stdout.lower(), (script, proc.stderr[-2000:])
    sample = os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz")
    proc = subprocess.run([str(venv / "bin" / "molds-preprocess"), "--input", sample, "--smiles-column", "SMILES",
                           "--output", str(here / "data"), "--workers", "2", "--progress", "false"],
                          cwd=here, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.path.exists(here / "data" / "manifest.json")
