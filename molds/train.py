"""Train a chemical language model from one JSON recipe.

    deepspeed molds/train.py --recipe recipes/smoke/dense_zero2.json
    torchrun --nproc_per_node 2 molds/train.py --recipe recipes/smoke/dense_ddp.json
    python molds/train.py --recipe recipes/smoke/dense_zero2.json --optim.lr 1e-3   # one process
    molds-train --recipe ... --print_config

``main`` reads top to bottom: parse and check the recipe, ``setup`` (ranks, output
directory, data, model, engine, resume), the loop (step, log, evaluate, checkpoint),
``finish`` (final evaluation and checkpoint, summary). Setup and teardown are named
functions; the loop is what is left. What the run prints and logs (its start summary and
warnings, each logging window's scalars) is ``molds.metrics.run_report``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

if __name__ == "__main__":  # `deepspeed molds/train.py`, `python molds/train.py` from a checkout
    # Python put this file's directory, molds/, first on the path, where molds' packages would
    # stand in for top-level ones of the same name (transformers imports Hugging Face's
    # `kernels`, and would get molds/kernels/): the checkout's root takes its place
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

from molds.checkpoint import read_lineage, restore, same_features, save_checkpoint
from molds.checkpoint.average import average_checkpoints, last_checkpoints
from molds.checkpoint.layout import checkpoints_dir, complete_checkpoints
from molds.checkpoint.resume import (
    check_resume,
    fine_tune_heads,
    flatten,
    resized_vocabulary,
    resumed_dtype,
    resumed_fp8_products,
)
from molds.checkpoint.rundir import plan_resume, prepare_output_dir
from molds.chemistry.features import feature_moments, feature_names, molecule_features, remember, scaled
from molds.chemistry.tasks import lineage_block
from molds.chemistry.tokens import tokenizer_info
from molds.data.manifest import Manifest, first_label_outside, label_moments, split_smiles
from molds.engines import build_engine
from molds.errors import CheckpointError, ManifestError, MoldsError, NonFiniteError, RecipeError, run_cli  # noqa: E402
from molds.metrics.step_profile import ProfileWindow
from molds.recipe.budget import format_duration
from molds.recipe.parse import check_machine, parse_recipe
from molds.recipe.plan import resolve_plan
from molds.runtime.allocator import retain_freed_memory
from molds.runtime.atomic import write_json
from molds.runtime.distributed import (
    all_have,
    all_reduce_max,
    all_reduce_sum,
    collective,
    gather_objects,
    init_distributed,
)
from molds.runtime.lifecycle import (  # noqa: E402
    code_version as _code_version,
    exit_process as _exit_process,
    leave_process_group as _leave_process_group,
    machine as _machine,
    quiet_third_party as _quiet_third_party,
    seed_rank as _seed_rank,
)


@dataclass
class Run:
    """Everything the loop needs, built by ``setup``."""

    recipe: object
    dist: object
    manifest: object
    tokenizer: object
    batching: object
    loader: object
    engine: object
    lineage: dict
    log: object
    evaluator: object
    flops: dict  # the model's FLOPs per unit of each batch statistic (``flops_coefficients``)
    plan: object = None  # molds.recipe.plan.Plan: the recipe resolved for this run
    step: int = 0
    start_step: int = 0
    resumed_from: str | None = None
    last_checkpoint: str | None = None
    fresh_heads: tuple | None = None  # a fine-tuning fork: (prefixes, tensors, what changed)
    # a fork onto a vocabulary that begins as its: (old size, new size, tensors, {new token: the token it starts from})
    resized: tuple | None = None
    counters: dict = field(default_factory=lambda: {"nonfinite_steps": 0, "rollbacks": 0})


def main(argv: list[str] | None = None) -> dict:
    if argv is None:
        argv = sys.argv[1:]
    argv = [a for a in argv if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    recipe = parse_recipe(argv)
    check_machine(recipe, argv)  # a recipe sized for GPUs on a machine without them: its twin
    if not recipe.goal.prior and (recipe.goal.scoring is not None or recipe.goal.stages is not None):
        raise RecipeError("goal.scoring / goal.stages are set but goal.prior is not: a goal run steers a prior "
                          "decoder checkpoint (set goal.prior), a training run has no objective to score")
    if recipe.goal.prior:  # goal-directed fine-tuning of a prior (molds.goal)
        from molds.goal.loop import run_goal  # here: molds-train --help loads no RDKit or Triton

        return run_goal(recipe)
    plan = resolve_plan(recipe, int(os.environ.get("WORLD_SIZE", "1")))  # checked before any process group starts
    try:
        run = setup(recipe, plan)
    except BaseException:
        _leave_process_group()
        raise
    try:
        train(run)
        return finish(run)
    finally:
        teardown(run)


def _after_elastic_restart(recipe, dist):
    """Under ``torchrun --max-restarts N`` a failed attempt is started again with the same
    command line: the run continues from its newest complete checkpoint by itself
    (``checkpoint.resume`` becomes ``auto``, said on stderr), so the restarted job sees
    each molecule once and ends as an uninterrupted one would. The ranks agree on it: the
    node whose rank failed counts a restart (``TORCHELASTIC_RESTART_COUNT``), the others
    only re-join the rendezvous with their count unchanged. Before its first checkpoint the
    attempt starts over as the recipe says. ``run.output_dir`` must be on a filesystem
    every node sees."""
    restart = int(all_reduce_max(float(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), dist))
    if not restart or recipe.checkpoint.resume == "auto" and not recipe.checkpoint.fork:
        return recipe
    if not complete_checkpoints(checkpoints_dir(recipe.run.output_dir)):
        return recipe
    if dist.is_main:
        print(f"[molds] torchrun restart {restart} (of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}): "
              f"continuing {recipe.run.output_dir} from its newest checkpoint (checkpoint.resume "
              f"{recipe.checkpoint.resume!r} -> 'auto'{', fork off' if recipe.checkpoint.fork else ''})",
              file=sys.stderr)
    return dataclasses.replace(recipe, checkpoint=dataclasses.replace(recipe.checkpoint, resume="auto", fork=False))


def train(run: Run) -> None:
    """The loop: take micro-batches, step, log, evaluate, checkpoint."""
    from molds.data.loader import batch_tensors  # here: molds-train --help loads no pyarrow or fsspec
    from molds.metrics.run_report import (  # here: molds-train --help loads no Triton or fsspec
        count, log_window, new_window, progress_bar,
    )
    recipe, dist, engine, horizon = run.recipe, run.dist, run.engine, run.plan.horizon
    accum = run.batching.grad_accum
    batches = iter(run.loader)
    window = new_window()
    bar = progress_bar(run)
    profile = ProfileWindow.of(recipe, run.step) if dist.is_main else None
    horizon.start(run.step, horizon.elapsed_s)  # the budget's clock runs from here (and what a resume carried)
    while not horizon.done:
        micro = []
        try:
            for _ in range(accum):
                b = next(batches, None)
                if b is None:
                    break
                micro.append(b)
        except MoldsError as exc:  # a shard this rank read: this rank reports it
            exc.shared = False
            raise
        with collective(f"step {run.step + 1}: agreeing that every rank has its batches", dist):
            if not all_have(len(micro) == accum, dist):  # every rank stops together: no collective left waiting
                break
        if profile is not None:
            profile.before(run.step + 1)
        with collective(f"step {run.step + 1}: forward/backward/optimizer", dist):
            result = engine.train_step([batch_tensors(b, dist.device) for b in micro])
        count(window, micro)
        with collective(f"step {run.step + 1}: agreeing that the step is finite", dist):
            finite = all_have(not result.skipped and math.isfinite(result.loss), dist)
        if not finite:
            _non_finite(run, result)
            continue
        run.step += 1
        before = horizon.fraction
        if horizon.timed:
            with collective(f"step {run.step}: agreeing on the time spent", dist):
                horizon.advance(run.step, agree=lambda s: all_reduce_max(s, dist))
        else:
            horizon.advance(run.step)
        last = horizon.done
        if profile is not None:
            profile.after(run.step, run.log, final=last)
        if bar is not None:
            bar.update(1)
        if run.step % recipe.logging.interval_steps == 0 or last:
            with collective(f"step {run.step}: gathering metrics", dist):
                log_window(run, window, result, bar)
            window = new_window()
        kind = run.evaluator.due(run.step) if not last else None
        if kind:
            with collective(f"step {run.step}: {kind} evaluation", dist):
                run.evaluator.run(run.step, kind)
        if not last and _checkpoint_due(recipe.checkpoint, run.step, before, horizon.fraction):
            save(run)
    if profile is not None:
        profile.close(run.step, run.log)
    if bar is not None:
        bar.close()


def finish(run: Run) -> dict:
    """The final evaluation and checkpoint, and the run's summary."""
    recipe, dist = run.recipe, run.dist
    if run.evaluator.enabled and run.step > run.start_step:  # the final evaluation, and hparams beside it
        with collective("final evaluation", dist):
            run.evaluator.run(run.step, "full")
        run.log.hparams(_hparams(recipe), run.evaluator.final)
    if run.resumed_from and run.step == run.start_step:
        final = run.resumed_from  # nothing trained since: the checkpoint we started from is the last one
    else:
        final = save(run)
    averaged = _average_last(run) if recipe.checkpoint.average_last else None
    stats = run.loader.totals()
    pp = run.engine.topology.pp_size  # the stages of a pipeline read the same batches
    truncated, truncated_tokens = (x / pp for x in all_reduce_sum([stats["truncated"], stats["truncated_tokens"]],
                                                                   dist))
    summary = {"steps": run.step, "checkpoint": final, "averaged": averaged,
               "horizon": run.plan.horizon.state(), "nonfinite_steps": run.counters["nonfinite_steps"],
               "rollbacks": run.counters["rollbacks"], "truncated_molecules": int(truncated),
               "truncated_tokens": int(truncated_tokens), "skipped_shards": run.loader.skipped["shards"],
               "skipped_rows": run.loader.skipped["rows"]}
    if dist.is_main:
        notes = [f"{k.replace('_', ' ')} {v}" for k, v in summary.items()
                 if k not in ("steps", "checkpoint", "averaged", "horizon") and v]
        spent = ""
        if run.plan.horizon.timed:
            spent = f" in {format_duration(run.plan.horizon.elapsed_s)} of {run.plan.horizon.describe()}"
        print(f"[molds] {run.step} steps{spent}; checkpoint {final}" + (f"; averaged model {averaged}" if averaged
                                                                         else "")
              + (f"; {', '.join(notes)}" if notes else ""), file=sys.stderr)
    return {"step": run.step, "checkpoint": final, "averaged": averaged, "summary": summary}


def _checkpoint_due(cfg, step: int, before: float, fraction: float) -> bool:
    """``checkpoint.interval_steps`` reached, or the run passed another multiple of
    ``checkpoint.interval_fraction`` of its length during this step."""
    if cfg.interval_steps and step % cfg.interval_steps == 0:
        return True
    if cfg.interval_fraction:
        return int(fraction / cfg.interval_fraction + 1e-9) > int(before / cfg.interval_fraction + 1e-9)
    return False


def _average_last(run: Run) -> str:
    """``checkpoint.average_last``: the mean of the run's last N checkpoints as RUN/averaged
    (rank 0 writes it; every rank waits for it)."""
    out = os.path.join(run.recipe.run.output_dir, "averaged")
    n = run.recipe.checkpoint.average_last
    ok, error = True, None
    with collective("averaging the last checkpoints", run.dist):
        if run.dist.is_main:
            try:
                have = len(complete_checkpoints(checkpoints_dir(run.recipe.run.output_dir)))
                if have < n:
                    print(f"[molds] warning: checkpoint.average_last={n} but the run has {have} checkpoints; "
                          f"averaging those", file=sys.stderr)
                average_checkpoints(last_checkpoints(run.recipe.run.output_dir, min(n, have)), out)
            except MoldsError as exc:
                ok, error = False, exc
        if not all_have(ok, run.dist):
            if error is not None:
                raise error
            raise MoldsError(f"averaging the last {n} checkpoints into {out} failed on rank 0")
    return out


def teardown(run: Run) -> None:
    """Close the logs and leave the process group, so every rank exits cleanly: the
    engine (DDP's reducer, DeepSpeed's groups) is released before the group it uses, or
    gloo's threads can still be calling into Python while the interpreter shuts down."""
    run.log.close()
    run.engine = run.evaluator = run.loader = None
    _leave_process_group(run.dist)


# ---------------------------------------------------------------- setup

def setup(recipe, plan=None) -> Run:
    """Ranks, output directory, data, model, engine, resume, logger, evaluator. ``plan``:
    the recipe resolved for this world size (``molds.recipe.plan``; resolved here when not given)."""
    from molds.data.loader import MoleculeLoader  # here: molds-train --help loads no pyarrow or fsspec
    from molds.eval.training import TrainingEvaluator  # here: molds-train --help loads no Triton or pyarrow
    from molds.kernels import apply_kernels, kernel_summary  # here: molds-train --help loads no Triton
    from molds.kernels.fp8_select import choose_for_run  # here: molds-train --help loads no Triton
    from molds.models import build_model, count_parameters  # here: molds-train --help loads no Triton
    from molds.models.loss import build_loss  # here: molds-train --help loads no Triton
    _quiet_third_party()
    allocator = retain_freed_memory()  # before the first large allocation
    dist = init_distributed(recipe.parallel.collective_timeout_s,
                            need_group=recipe.parallel.engine in ("zero", "pipeline"))
    recipe = _after_elastic_restart(recipe, dist)
    manifest = Manifest.load(recipe.data.manifest)
    if recipe.model.family == "seq2seq" and manifest.pairs is None and not recipe.data.mask_span_mean:
        raise RecipeError(f"model.family=seq2seq translates a source into a target: {manifest.path} holds "
                          f"molecules, not pairs (molds-preprocess --task forward|retro|mol2mol writes pairs); "
                          f"to pretrain on molecules by denoising, set data.mask_span_mean and "
                          f"data.mlm_probability")
    tokenizer = tokenizer_info(manifest)
    m = recipe.model
    if m.family == "encoder" and m.num_tasks and recipe.data.with_labels:  # before anything is written
        columns = manifest.label_columns
        if len(columns) != m.num_tasks:
            raise RecipeError(f"model.num_tasks={m.num_tasks}, but {manifest.path} holds {len(columns)} label "
                              f"columns {columns[:8]}{'...' if len(columns) > 8 else ''}: one head per label column")
        if m.task_type == "classification":
            _require_unit_labels(manifest)
    resume_from = plan_resume(recipe)  # which checkpoint, or none
    saved = read_lineage(resume_from) if resume_from is not None else None  # read once, for every resume rule
    prepare_output_dir(recipe, dist, resuming=resume_from is not None and not recipe.checkpoint.fork)
    plan = (plan or resolve_plan(recipe, dist.world_size)).on_device(recipe, dist, resumed_dtype(recipe, saved))
    if plan.world_size != dist.world_size:
        raise RuntimeError(f"the plan is for {plan.world_size} ranks, the process group has {dist.world_size}")
    batching = plan.batching
    # the same on every rank; for the pipeline only its structure (each rank materializes its own stages)
    model = build_model(recipe.model, tokenizer, seed=recipe.run.seed,
                        device="meta" if recipe.parallel.engine == "pipeline" else None)
    if getattr(model, "regression", False) and (saved is None or recipe.checkpoint.fork):
        _standardize_labels(model, manifest, dist)  # a resume keeps the checkpoint's scale
    if getattr(model, "features", False) and (saved is None or recipe.checkpoint.fork):
        _standardize_features(model, manifest, dist)
    label_columns = manifest.label_columns if recipe.data.with_labels else None
    fresh_heads = fine_tune_heads(recipe, saved, model, label_columns)  # the bare model's own, before any engine
    resized = resized_vocabulary(recipe, saved, resume_from, manifest, model)
    flops = model.flops_coefficients()
    parameters = count_parameters(model)
    loss = build_loss(recipe.model)
    fp8_choice = choose_for_run(recipe, model, dist, plan.dtype, resumed_fp8_products(recipe, saved))
    apply_kernels(model, recipe.kernels, loss, dist.device, fp8_choice)
    kernels = kernel_summary(model, dist.device)  # before an engine cuts the model into stages
    engine = build_engine(recipe, model, loss, dist, plan)
    _seed_rank(recipe.run.seed, dist.rank)  # dropout and sampling differ between ranks
    topo = engine.topology
    loader = MoleculeLoader(dataclasses.replace(recipe.data, max_steps=None), rank=topo.dp_rank,
                            world_size=topo.dp_size, features=getattr(model.config, "molecule_features", ""))
    lineage = {
        "recipe": recipe.to_dict(), "manifest_hash": manifest.hash, "manifest": manifest.path,
        **({"manifest_dir": os.path.abspath(manifest.base)} if "://" not in manifest.path else {}),
        "vocab_hash": tokenizer.vocab_hash, "vocab_size": tokenizer.vocab_size,
        **({"vocab_extends": {k: manifest.data["tokenizer"]["extends"][k] for k in ("vocab_hash", "vocab_size")}}
           if "extends" in manifest.data["tokenizer"] else {}),
        "canonicalization_hash": manifest.data["canonicalization"].get("hash"),
        "pairs": lineage_block(manifest.pairs),  # the direction and formats molds-predict holds inputs to
        **({"labels": list(label_columns)} if label_columns and getattr(model, "TASK_HEADS", None) else {}),
        **_features_lineage(model.config.molecule_features if getattr(model, "features", False) else ""),
        "code_version": _code_version(), "engine": engine.name, "schedule": recipe.parallel.schedule,
        "world_topology": topo.as_dict(), "world_size": dist.world_size,
        "global_batch_sequences": batching.global_batch, "grad_accum": batching.grad_accum,
        "parameters": parameters, "host_allocator": allocator, "kernels": kernels, "plan": plan.summary(),
        "precision": plan.precision.describe(), "machine": _machine(dist.device),
    }
    if fp8_choice is not None:
        lineage["fp8_products"] = fp8_choice.as_dict()
    run = Run(recipe, dist, manifest, tokenizer, batching, loader, engine, lineage, None, None, flops, plan,
              fresh_heads=fresh_heads, resized=resized)
    if resume_from is not None:
        _resume(run, resume_from, saved)
    if getattr(model, "regression", False):  # what the predictions are scaled by, after any restore
        lineage["label_scale"] = {"mean": model.label_mean.float().tolist(), "std": model.label_std.float().tolist()}
    if dist.is_main:
        write_json(os.path.join(recipe.run.output_dir, "recipe.json"), recipe.to_dict(), indent=2)
    from molds.metrics.logger import MetricsLogger  # here: molds-train --help loads no fsspec or TensorBoard

    run.log = MetricsLogger(recipe.run.output_dir, dist.is_main, recipe.logging.tensorboard,
                            start_step=run.step if run.resumed_from and not recipe.checkpoint.fork else None)
    run.evaluator = TrainingEvaluator(recipe, engine, dist, manifest, tokenizer, run.log)
    from molds.metrics.run_report import start_summary  # here: molds-train --help loads no Triton or fsspec

    start_summary(run, parameters)
    return run


def _require_unit_labels(manifest) -> None:
    """A classification head learns labels from 0 to 1 (classes, or probabilities): any other
    value in the train split is refused in one line, before a step is taken."""
    found = first_label_outside(manifest, "train")
    if found is not None:
        name, row, value = found
        raise RecipeError(f"model.task_type=classification learns labels from 0 to 1 (classes 0 and 1, or "
                          f"probabilities), but label {name!r} of {manifest.path}'s train split is {value:g} (row "
                          f"{row} of the split): set --model.task_type regression, or give labels from 0 to 1")


def _standardize_labels(model, manifest, dist) -> None:
    """A regression head learns labels standardized by the training split's mean and
    standard deviation per task; its predictions come back in the labels' units."""
    mean, std, count = label_moments(manifest, "train")
    if len(mean) != model.config.num_tasks:  # (the label columns match the heads: checked at the start)
        raise RecipeError(f"model.num_tasks={model.config.num_tasks}, but the train split of {manifest.path} has "
                          f"no rows to take the labels' scale from")
    model.set_label_scale(mean, std)
    if dist.is_main:
        names = manifest.label_columns or [f"task{i}" for i in range(len(mean))]
        print("[molds] regression labels standardized by the train split's mean and standard deviation: "
              + ", ".join(f"{n} {m:.4g} +- {s:.4g} ({c:,} labels)" for n, m, s, c in zip(names, mean, std, count)),
              file=sys.stderr)


def _features_lineage(kind: str) -> dict:
    """What a checkpoint whose heads read molecule features keeps of them: the set, the
    features' names in the order read, and the RDKit that computed them."""
    if not kind:
        return {}
    import rdkit  # here: only a model with molecule features loads RDKit

    return {"molecule_features": {"kind": kind, "names": feature_names(kind), "rdkit": rdkit.__version__}}


def _standardize_features(model, manifest, dist) -> None:
    """Property heads that read molecule features read them standardized by the training
    split's mean and standard deviation of each (but those ``molds.chemistry.features`` reads
    as they are: a fingerprint's counts). Each rank computes every ``world_size``-th
    molecule of the split and the ranks exchange them, so each holds the whole split's
    features (kept by the process for the loader's passes) for a ``world_size``-th of the
    cost."""
    kind = model.config.molecule_features
    t0 = time.perf_counter()
    smiles = split_smiles(manifest, "train")
    if not smiles:
        raise RecipeError(f"model.molecule_features={kind}: the train split of {manifest.path} has no rows to "
                          f"take the features' scale from")
    world, rank = dist.world_size, dist.rank
    shares = gather_objects(molecule_features(smiles[rank::world], kind), dist)
    features = np.empty((len(smiles), len(feature_names(kind))), dtype=np.float32)
    for r, part in enumerate(shares):
        features[r::world] = part
    remember(smiles, kind, features)
    mean, std = feature_moments(features, kind)
    model.set_feature_scale(mean, std)
    if dist.is_main:
        unscaled = int((~scaled(kind)).sum())
        pooled = "the mean of its tokens' states" if model.config.pooling == "mean" else "its first token's state"
        print(f"[molds] model.molecule_features={kind}: the property heads read {len(mean)} features of each "
              f"molecule beside {pooled}, {f'{len(mean) - unscaled} of them ' if unscaled else ''}standardized "
              f"by the train split's {len(smiles):,} molecules "
              f"({time.perf_counter() - t0:.0f} s to compute on {world} rank{'s' if world > 1 else ''})",
              file=sys.stderr)


def _resume(run: Run, path: str, saved: dict) -> None:
    """Continue or fork ``path``, whose lineage is ``saved``."""
    recipe, dist = run.recipe, run.dist
    fork = recipe.checkpoint.fork
    changes = check_resume(path, saved, run.lineage, fork, resized=run.resized is not None)
    reads = run.lineage.get("molecule_features")
    if reads and not run.fresh_heads:  # heads kept from the checkpoint read the features RDKit computes here
        same_features(path, saved, reads["kind"])
    if fork:
        fresh, resized = run.fresh_heads, run.resized
        replaced = (tuple(fresh[0]) if fresh else ()) + (tuple(resized[2]) if resized else ())
        tensors = {**(fresh[1] if fresh else {}), **(resized[2] if resized else {})}
        step, _ = restore(path, run.engine, dist, optimizer=recipe.checkpoint.fork_optimizer, seed=recipe.run.seed,
                          keep_schedule=False, fresh=(replaced, tensors) if replaced else None)
        if fresh:
            run.lineage["fresh_heads"] = {"prefixes": list(fresh[0]), "changes": fresh[2]}
        if resized:
            run.lineage["vocabulary_resized"] = {"from": resized[0], "to": resized[1], "tensors": sorted(resized[2]),
                                                 "new_token_rows": recipe.checkpoint.new_token_rows,
                                                 "started_from": resized[3]}
        run.lineage["parent"] = {"checkpoint": os.path.abspath(path), "step": step,
                                 "manifest_hash": saved.get("manifest_hash"), "run": saved.get("recipe", {}).get("run")}
        if dist.is_main:
            print(f"[molds] forked from {path} (its step {step}): weights"
                  f"{' and optimizer moments' if recipe.checkpoint.fork_optimizer else ''} kept, step 0, fresh data "
                  f"cursor on {run.manifest.path}", file=sys.stderr)
            if resized and resized[1] > resized[0]:
                by_element = {t: e for t, e in resized[3].items() if e is not None}
                shown = ", ".join(f"{t} as {e}" for t, e in list(by_element.items())[:8])
                shown += f" and {len(by_element) - 8} more" if len(by_element) > 8 else ""
                rows = (f"from the checkpoint's token of the same element for {len(by_element)} ({shown}), at the "
                        f"mean of the checkpoint's for {len(resized[3]) - len(by_element)}" if by_element
                        else "at the mean of the checkpoint's")
                print(f"[molds] the vocabulary grows from {resized[0]} to {resized[1]} tokens (the manifest's "
                      f"tokenizer adds {resized[1] - resized[0]} to the checkpoint's, whose ids stay): "
                      f"{', '.join(sorted(resized[2]))} take their new rows {rows} "
                      f"(checkpoint.new_token_rows {recipe.checkpoint.new_token_rows})", file=sys.stderr)
            elif resized:
                print(f"[molds] the vocabulary shrinks from {resized[0]} to {resized[1]} tokens (the checkpoint's was "
                      f"grown from the manifest's): {', '.join(sorted(resized[2]))} drop the rows of the "
                      f"{resized[0] - resized[1]} tokens this manifest lacks", file=sys.stderr)
            if fresh:  # (a feature scale named only where the new heads read features)
                shown = [p for p in fresh[0] if p != "feature_" or any(k.startswith(p) for k in fresh[1])]
                print(f"[molds] fine-tuning fork: the property heads ({', '.join(p + '*' for p in shown)}) start "
                      f"afresh, seeded by run.seed, because "
                      + ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in fresh[2].items()), file=sys.stderr)
        return
    carried = saved.get("horizon", {})
    if run.plan.horizon.timed and "elapsed_s" not in carried:
        raise CheckpointError(f"{path} was trained by steps and carries no elapsed time; a run with "
                              f"trainer.max_time continues it only as a fork (--checkpoint.fork true)")
    run.plan.horizon.start(int(saved["step"]), float(carried.get("elapsed_s", 0.0)))  # before the schedule
    step, data_state = restore(path, run.engine, dist, seed=recipe.run.seed)  # the schedule: this recipe's
    run.loader.load_state_dict(data_state)
    run.step = run.start_step = step
    run.resumed_from = run.last_checkpoint = path
    history = list(saved.get("resume_changes", []))
    if changes:
        history.append({"at_step": step, "changes": changes})
    run.lineage["resume_changes"] = history
    run.lineage["resumed_from"] = os.path.abspath(path)
    if "parent" in saved:
        run.lineage["parent"] = saved["parent"]
    if dist.is_main:
        applied = "; ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changes.items()
                            if not k.startswith(("checkpoint.", "run.output_dir")))
        print(f"[molds] resumed from {path} at step {step}" + (f" (applied: {applied})" if applied else ""),
              file=sys.stderr)


# ---------------------------------------------------------------- the loop's parts

def _non_finite(run: Run, result) -> None:
    """The recipe's policy for a step whose loss or gradients are NaN or infinite."""
    policy = run.recipe.trainer.on_nonfinite
    run.counters["nonfinite_steps"] += 1
    n, bound = run.counters["nonfinite_steps"], run.recipe.trainer.max_nonfinite_steps
    what = (f"step {run.step + 1}: loss {result.loss:.4g}, gradient norm {result.grad_norm:.4g} on this rank: not "
            f"finite (on some rank)")
    last = run.last_checkpoint or "none yet"
    if policy == "stop":
        raise NonFiniteError(f"{what}; nothing of it was applied or saved (trainer.on_nonfinite=stop). Last "
                             f"checkpoint: {last}. Lower optim.lr, or set trainer.on_nonfinite to skip or rollback")
    if n > bound:
        raise NonFiniteError(f"{what}; {n} non-finite steps in this run, more than trainer.max_nonfinite_steps="
                             f"{bound}. Last checkpoint: {last}")
    if run.dist.is_main:
        print(f"[molds] {what}: {policy} ({n} of at most {bound})", file=sys.stderr)
    run.log.scalars(run.step, {"train/nonfinite_steps": n})
    if policy == "rollback":
        if run.last_checkpoint is None:
            raise NonFiniteError(f"{what}; trainer.on_nonfinite=rollback but no checkpoint was saved yet")
        step, _ = restore(run.last_checkpoint, run.engine, run.dist, seed=run.recipe.run.seed + n)
        run.counters["rollbacks"] += 1
        run.step = step  # the data cursor stays where it is: past the bad batch
        run.log.rewind(step)
        run.log.scalars(step, {"train/rollbacks": run.counters["rollbacks"], "train/nonfinite_steps": n})


def save(run: Run) -> str:
    from molds.data.loader import merge_states  # here: molds-train --help loads no pyarrow or fsspec
    with collective(f"step {run.step}: saving a checkpoint", run.dist):
        _check_manifest_unchanged(run)
        data_state = merge_states(gather_objects(run.loader.state_dict(), run.dist))
        lineage = dict(run.lineage, counters=dict(run.counters), horizon=run.plan.horizon.state())
        path = save_checkpoint(run.recipe.run.output_dir, run.engine, run.dist, run.step, data_state, lineage,
                               keep_last=run.recipe.checkpoint.keep_last,
                               needed_bytes=12 * run.lineage["parameters"] + (1 << 20))
    run.last_checkpoint = path
    return path


def _check_manifest_unchanged(run: Run) -> None:
    """The manifest the run started from must still be the one on disk when it saves:
    an edited manifest means the data under the run changed."""
    now = None
    if run.dist.is_main:
        try:
            now = Manifest.load(run.manifest.path).hash
        except MoldsError as exc:
            now = f"unreadable ({exc})"
    if not all_have(now in (None, run.manifest.hash), run.dist):
        raise ManifestError(f"{run.manifest.path} changed after the run started (content hash "
                            f"{run.manifest.hash[:12]} -> {str(now)[:40]}): the run stops before saving; its last "
                            f"checkpoint is {run.last_checkpoint or 'none yet'}, and resuming on the changed manifest "
                            f"needs --checkpoint.fork true")


# ---------------------------------------------------------------- small helpers


def _hparams(recipe) -> dict:
    return flatten(recipe.to_dict())


def cli() -> None:
    code = run_cli("molds-train", main)
    _exit_process(code if isinstance(code, int) and 0 <= code <= 255 else 1)


if __name__ == "__main__":
    cli()
