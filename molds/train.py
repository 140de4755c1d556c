"""Train a chemical language model from one JSON recipe.

    deepspeed molds/train.py --recipe recipes/smoke/dense_zero2.json
    torchrun --nproc_per_node 2 molds/train.py --recipe recipes/smoke/dense_ddp.json
    python molds/train.py --recipe recipes/smoke/dense_ddp.json --optim.lr 1e-3
    molds-train --recipe ... --print_config

The loop reads top to bottom: parse and check the recipe, set up ranks, build data,
model and engine, resume if asked, then step, log and checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> dict:
    from molds.recipe import parse_recipe, resolve_batching, validate

    if argv is None:
        argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    # short forms: --resume auto / --fork true stand for --checkpoint.resume / --checkpoint.fork
    argv = ["--checkpoint." + a[2:] if a.split("=")[0] in ("--resume", "--fork") else a for a in argv]
    recipe = parse_recipe(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(recipe, world)  # before any process group starts

    import dataclasses

    import torch

    from molds.checkpoint import check_lineage, find_checkpoint, load_checkpoint, save_checkpoint
    from molds.data.loader import MoleculeLoader, merge_states, model_inputs
    from molds.data.manifest import Manifest
    from molds.distributed import all_have, all_reduce_mean, all_reduce_sum, gather_objects, init_distributed
    from molds.engines import build_engine
    from molds.eval.training import TrainingEvaluator
    from molds.metrics.logger import MetricsLogger, device_peak_tflops
    from molds.models import build_model

    dist = init_distributed()
    torch.manual_seed(recipe.run.seed)
    manifest = Manifest.load(recipe.data.manifest)
    vocab = manifest.check_tokenizer()
    out = recipe.run.output_dir
    if dist.is_main:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "recipe.json"), "w") as fh:
            json.dump(recipe.to_dict(), fh, indent=2)

    global_batch, accum = resolve_batching(recipe, dist.world_size)
    data_cfg = dataclasses.replace(recipe.data, max_steps=None)  # the trainer counts steps itself
    loader = MoleculeLoader(data_cfg, rank=dist.rank, world_size=dist.world_size)
    model = build_model(recipe, len(vocab), loader.specials)
    engine = build_engine(recipe, model, dist)
    lineage = {
        "recipe": recipe.to_dict(),
        "manifest_hash": manifest.hash,
        "vocab_hash": manifest.data["tokenizer"]["vocab_hash"],
        "canonicalization_hash": manifest.data["canonicalization"]["hash"],
        "world_topology": {"world_size": dist.world_size, "data_parallel": dist.world_size,
                           "pp_size": recipe.parallel.pp_size, "ep_size": recipe.parallel.ep_size},
        "global_batch_micro_batches": global_batch,
        "grad_accum": accum,
    }

    step = start_step = 0
    resume_from = find_checkpoint(recipe)
    if resume_from:
        check_lineage(resume_from, lineage, recipe.checkpoint.fork)
        step, data_state = load_checkpoint(resume_from, engine, dist)
        start_step = step
        loader.load_state_dict(data_state)
        if dist.is_main:
            print(f"[molds] resumed from {resume_from} at step {step}", file=sys.stderr)

    log = MetricsLogger(out, dist.is_main, recipe.logging.tensorboard)
    peak, peak_note = device_peak_tflops(dist.device, recipe.logging.peak_tflops)
    log.text("run/recipe", "```\n" + json.dumps(recipe.to_dict(), indent=2) + "\n```")
    log.text("run/mfu_peak", peak_note)
    evaluator = TrainingEvaluator(recipe, engine, dist, manifest, loader.specials, log)
    span = recipe.data.seq_len if recipe.data.mode == "packed" else recipe.data.max_length
    flops_per_token = model.flops_per_token(span) if hasattr(model, "flops_per_token") else None
    bar = None
    if dist.is_main and recipe.logging.progress:
        from tqdm import tqdm

        bar = tqdm(total=recipe.trainer.max_steps, initial=step, desc="train", file=sys.stderr, dynamic_ncols=True)

    batches = iter(loader)
    window = {"real": 0.0, "tokens": 0.0, "wait": 0.0, "time": time.perf_counter(), "steps": 0}
    last = {}
    while step < recipe.trainer.max_steps:
        micro = []
        for _ in range(accum):
            try:
                micro.append(next(batches))
            except StopIteration:
                break
        if not all_have(len(micro) == accum, dist):  # every rank stops together: no collective left waiting
            break
        for b in micro:
            st = b["stats"]
            window["real"] += st["real_tokens"]
            window["tokens"] += st["tokens"]
            window["wait"] += st["wait_s"]
        last = engine.train_step([model_inputs(b, dist.device) for b in micro])
        step += 1
        window["steps"] += 1
        if bar is not None:
            bar.update(1)
        if step % recipe.logging.interval_steps == 0 or step == recipe.trainer.max_steps:
            real, tokens, wait = all_reduce_sum([window["real"], window["tokens"], window["wait"]], dist)
            elapsed = time.perf_counter() - window["time"]
            loss = all_reduce_mean(last["loss"], dist)
            tps = real / elapsed
            mfu = tps * flops_per_token / (peak * 1e12 * dist.world_size) if peak and flops_per_token else None
            values = {"train/loss": loss, "train/lr": last["lr"], "train/grad_norm": last["grad_norm"],
                      "train/tokens_per_sec": tps, "train/padding_ratio": 1 - real / max(1.0, tokens),
                      "data/wait_s_per_step": wait / dist.world_size / window["steps"], "train/mfu": mfu}
            if dist.device.type == "cuda":
                values["train/peak_memory_mb"] = torch.cuda.max_memory_allocated(dist.device) / 2**20
            else:  # the peak resident memory of this process (rank 0)
                import resource

                values["train/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            log.scalars(step, values)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
            window = {"real": 0.0, "tokens": 0.0, "wait": 0.0, "time": time.perf_counter(), "steps": 0}
        kind = evaluator.due(step) if step < recipe.trainer.max_steps else None
        if kind:
            evaluator.run(step, kind)
        interval = recipe.checkpoint.interval_steps
        if interval and step % interval == 0 and step < recipe.trainer.max_steps:
            save_checkpoint(recipe, engine, dist, step, merge_states(gather_objects(loader.state_dict(), dist)),
                            lineage)
    if evaluator.enabled and step > start_step:  # the final evaluation, and hparams beside it
        evaluator.run(step, "full")
        log.hparams(_hparams(recipe), evaluator.final)
    if resume_from and step == start_step:
        final = resume_from  # nothing trained since: the checkpoint we started from is the last one
    else:
        final = save_checkpoint(recipe, engine, dist, step, merge_states(gather_objects(loader.state_dict(), dist)),
                                lineage)
    if bar is not None:
        bar.close()
    log.close()
    if dist.is_main:
        print(f"[molds] {step} steps; checkpoint {final}", file=sys.stderr)
    return {"step": step, "checkpoint": final, "last": last}


def _hparams(recipe) -> dict:
    """The recipe flattened (``optim.lr``, ``model.hidden_size``, ...); the logger keeps the scalars."""
    return {f"{section}.{key}": value for section, values in recipe.to_dict().items() if isinstance(values, dict)
            for key, value in values.items()}


def cli() -> None:
    main()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
