"""The cost of molds' training step over hand-written loops, side by side in one run.

    python benchmarks/step_overhead.py [--manifest DIR] [--steps 10] [--rounds 5]

Same model (the smoke decoder), same packed batches, same AdamW + schedule + clipping,
fp32 on CPU (bf16 autocast on a GPU). Three loops, interleaved in rounds so machine
drift hits all of them alike:
  plain    model(**batch)["loss"].backward(); clip; opt.step(); sched.step(); zero_grad
  molds    DDPEngine.train_step (the ddp engine, one process)
  ds_bare  deepspeed.initialize(...) then engine(...); engine.backward; engine.step
  molds_zero  ZeroEngine.train_step (stage 2)
Prints one JSON line with seconds per step and the ratios molds/plain and
molds_zero/ds_bare (target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default=os.path.join(HERE, "..", "runs", "quickstart", "data"))
    ap.add_argument("--recipe", default=os.path.join(HERE, "..", "recipes", "smoke", "dense_ddp.json"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")

    import torch

    from molds.data.loader import MoleculeLoader
    from molds.data.manifest import Manifest
    from molds.runtime.distributed import init_distributed
    from molds.engines.ddp import DDPEngine
    from molds.engines.optim import build_optimizer, build_scheduler
    from molds.engines.zero import ZeroEngine
    from molds.models import build_model
    from molds.models.loss import build_loss
    from molds.recipe.plan import plan_for
    from molds.chemistry.tokens import tokenizer_info
    from molds.recipe.parse import deepspeed_config, parse_recipe

    recipe = parse_recipe(["--recipe", args.recipe, "--data.manifest", args.manifest,
                           "--trainer.max_steps", str(10**6)])
    dist = init_distributed()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo" if dist.device.type == "cpu" else "nccl", rank=0, world_size=1)
    tok = tokenizer_info(Manifest.load(args.manifest))
    loss_fn = build_loss(recipe.model)  # the same objective every loop computes
    keep = ("input_ids", "labels", "position_ids", "document_ids")
    batches = []
    for b in MoleculeLoader(recipe.data):
        batches.append({k: b[k].to(dist.device) for k in keep})
        if len(batches) == args.steps:
            break
    plan = plan_for(recipe, dist)  # the precision the molds loop measures and takes; every loop uses it
    dtype = plan.dtype

    def autocast():
        import contextlib

        return torch.autocast(dist.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    # plain PyTorch
    plain_model = build_model(recipe.model, tok).to(dist.device)
    opt = build_optimizer(plain_model, recipe.optim)
    sched = build_scheduler(opt, recipe.optim, plan.horizon)

    def plain_step(batch):
        with autocast():
            loss = loss_fn(plain_model(**batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), recipe.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    molds_engine = DDPEngine(recipe, build_model(recipe.model, tok), loss_fn, dist, plan)

    # bare DeepSpeed
    import deepspeed

    zero_recipe = parse_recipe(["--recipe", args.recipe, "--data.manifest", args.manifest, "--parallel.engine",
                                "zero", "--parallel.zero_stage", "2", "--trainer.max_steps", str(10**6)])
    ds_cfg = deepspeed_config(zero_recipe, 1, dtype is not None)
    ds_model = build_model(zero_recipe.model, tok)
    ds_opt = build_optimizer(ds_model, zero_recipe.optim)
    ds_engine, _, _, _ = deepspeed.initialize(model=ds_model, optimizer=ds_opt,
                                              lr_scheduler=build_scheduler(ds_opt, zero_recipe.optim, 10**6),
                                              config=ds_cfg, dist_init_required=False)

    def ds_step(batch):
        loss = loss_fn(ds_engine(**batch), batch)
        ds_engine.backward(loss)
        ds_engine.step()
        return float(loss)

    molds_zero = ZeroEngine(zero_recipe, build_model(zero_recipe.model, tok), loss_fn, dist,
                            plan_for(zero_recipe, dist))

    loops = {
        "plain": plain_step,
        "molds": lambda b: molds_engine.train_step([b]).loss,
        "ds_bare": ds_step,
        "molds_zero": lambda b: molds_zero.train_step([b]).loss,
    }
    for fn in loops.values():  # warm-up: allocations, first-call paths
        fn(batches[0])
    spent = {k: 0.0 for k in loops}
    for _ in range(args.rounds):
        for name, fn in loops.items():
            t0 = time.perf_counter()
            for b in batches:
                fn(b)
            spent[name] += time.perf_counter() - t0
    n = args.rounds * len(batches)
    per_step = {k: v / n for k, v in spent.items()}
    from molds.runtime.lifecycle import cpu_description

    print(json.dumps({"cpu": cpu_description(),
        "device": str(dist.device),
        "steps_timed_per_loop": n,
        "s_per_step": {k: round(v, 5) for k, v in per_step.items()},
        "molds_over_plain": round(per_step["molds"] / per_step["plain"], 4),
        "molds_zero_over_ds_bare": round(per_step["molds_zero"] / per_step["ds_bare"], 4),
        "tokens_per_step": int(batches[0]["input_ids"].numel()),
    }))


if __name__ == "__main__":
    main()
