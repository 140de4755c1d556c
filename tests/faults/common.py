"""Shared pieces of the fault-injection suite: a tiny recipe, runs on N gloo ranks with a
fault patched in (test-only: molds has no fault hooks), and the files a run leaves."""

from __future__ import annotations

import json
import os


def argv(dataset, out, engine="ddp", steps=6, *extra, stage=2, interval=2, accum=1, hidden=32):
    return ["--data.manifest", dataset, "--data.seq_len", "128", "--data.micro_batch_size", "2",
            "--data.lookahead", "64", "--data.shuffle_window", "300",
            "--model.hidden_size", str(hidden), "--model.num_layers", "2", "--model.num_heads", "4",
            "--model.num_kv_heads", "2", "--model.max_position_embeddings", "256",
            "--parallel.engine", engine, "--parallel.zero_stage", str(stage),
            "--optim.lr", "3e-3", "--optim.warmup_steps", "2",
            "--trainer.max_steps", str(steps), "--trainer.grad_accum", str(accum), "--trainer.precision", "fp32",
            "--checkpoint.interval_steps", str(interval), "--checkpoint.keep_last", "0",
            "--logging.interval_steps", "1", "--logging.progress", "false",
            "--run.output_dir", out, *extra]


def metrics(out) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def losses(out) -> dict:
    return {r["step"]: r["train/loss"] for r in metrics(out) if "train/loss" in r}


def record_gids(rank, args):
    """Patch the loader so this rank appends every molecule id it trains on, one batch per
    line, to ``<run.output_dir>.gids-rank<rank>``."""
    from molds.data import loader as loader_mod

    original_iter = loader_mod.MoleculeLoader.__iter__
    record = f"{args[args.index('--run.output_dir') + 1]}.gids-rank{rank}"

    def recording(self):
        for batch in original_iter(self):
            with open(record, "a") as fh:
                fh.write(" ".join(map(str, batch["gids"].tolist())) + "\n")
            yield batch

    loader_mod.MoleculeLoader.__iter__ = recording


def killed_at(args, point: str) -> None:
    """Say, in ``<run.output_dir>.killed``, where a test is about to SIGKILL its rank (the test
    then checks that the rank died by SIGKILL, and there)."""
    with open(args[args.index("--run.output_dir") + 1] + ".killed", "w") as fh:
        fh.write(point)


def died_by_sigkill_at(excinfo, out: str, point: str) -> None:
    """The rank ended by SIGKILL (not by an error of its own), at ``point``."""
    import signal

    exc = excinfo.value
    assert getattr(exc, "signal_name", None) == signal.Signals.SIGKILL.name, repr(exc)
    assert open(out + ".killed").read() == point


def patch_everywhere(original, replacement) -> None:
    """Put ``replacement`` wherever molds holds ``original``: its own module and every module
    that imported it by name (an import binds the function when the module loads, so patching
    only the module that defines it would miss them). Modules imported later read it from
    the patched ones."""
    import sys

    held = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "molds" or name.startswith("molds.")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)
                held += 1
    assert held, f"no molds module holds {original!r}"


def train(rank, world, args):
    from molds.train import main

    return main(args)


def train_with(rank, world, args, fault: str, at: int = 0, who: int = 0):
    """``main(args)`` with one fault patched in on rank ``who`` (every rank for "nan")."""
    import json
    import math
    import signal
    import time

    import molds.checkpoint as ckpt
    import molds.checkpoint.state as state
    import molds.train as train_mod

    if fault == "fsize":  # files larger than ``at`` bytes cannot be written (EFBIG): a full disk, in effect
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (at, at))
    elif fault == "edit-manifest" and rank == who:  # after step ``at``, someone edits the manifest
        from molds.engines.ddp import DDPEngine

        original_step = DDPEngine.train_step
        steps = {"n": 0}
        manifest_dir = args[args.index("--data.manifest") + 1]

        def editing(self, micro):
            result = original_step(self, micro)
            steps["n"] += 1
            if steps["n"] == at:
                path = os.path.join(manifest_dir, "manifest.json")
                body = json.load(open(path))
                body["stats"]["edited_by"] = "someone else"
                json.dump(body, open(path, "w"))
            return result

        DDPEngine.train_step = editing
    elif fault == "drop-batches":  # the ``at``-th training batch and the next are never trained on
        from molds.data import loader as loader_mod

        original_iter = loader_mod.MoleculeLoader.__iter__

        def dropping(self):
            for i, batch in enumerate(original_iter(self), 1):
                if self.cfg.split == "train" and i in (at, at + 1):
                    continue
                yield batch

        loader_mod.MoleculeLoader.__iter__ = dropping
    elif fault == "record-gids":  # every molecule this rank trains on, appended to a file
        record_gids(rank, args)
    elif fault == "wide-lr":  # let optim.lr reach absurd values (its declared range refuses them)
        from molds.recipe.sections import OptimConfig

        OptimConfig.RANGES["lr"] = (0.0, 1e12)
    elif fault == "nan":  # the loss of step ``at`` is NaN (on every rank): its gradients are NaN
        real = train_mod.build_loss if hasattr(train_mod, "build_loss") else None
        from molds.models import loss as loss_mod

        original = loss_mod.build_loss
        calls = {"n": 0}

        def build_loss(section):
            fn = original(section)

            def poisoned(outputs, batch):
                calls["n"] += 1
                value = fn(outputs, batch)
                return value * math.nan if calls["n"] == at else value

            return poisoned

        loss_mod.build_loss = build_loss
        del real
    elif fault == "hang" and rank == who:  # this rank stops answering at its step ``at``
        from molds.engines.ddp import DDPEngine

        original_step = DDPEngine.train_step
        count = {"n": 0}

        def hung(self, micro):
            count["n"] += 1
            if count["n"] == at:
                time.sleep(3600)
            return original_step(self, micro)

        DDPEngine.train_step = hung
    elif fault.startswith("kill-") and rank == who:  # SIGKILL this rank at a point inside the ``at``-th save
        saves = {"n": 0}

        def kill_if(point):
            if fault == f"kill-{point}" and saves["n"] == at:
                killed_at(args, f"{point} in save {at}")
                os.kill(os.getpid(), signal.SIGKILL)

        original_save = ckpt.save_checkpoint

        def counting_save(*a, **k):
            saves["n"] += 1
            return original_save(*a, **k)

        patch_everywhere(original_save, counting_save)
        for module, name, point in ((state, "write_model", "model"), (state, "write_optimizer", "optimizer"),
                                    (ckpt, "write_complete_marker", "marker"), (ckpt, "write_latest", "latest")):
            original = getattr(module, name)

            def wrapped(*a, _original=original, _point=point, **k):
                kill_if(f"before-{_point}")
                result = _original(*a, **k)
                kill_if(f"after-{_point}")
                return result

            patch_everywhere(original, wrapped)
        import molds.runtime.atomic as atomic

        original_publish = atomic.publish_directory

        def publish(*a, **k):
            kill_if("before-rename")
            original_publish(*a, **k)
            kill_if("after-rename")

        patch_everywhere(original_publish, publish)
    return train_mod.main(args)
