"""Each engine on 2 gloo ranks against a single-process run of the same global batch.

A tiny decoder, identical micro-batches: rank r of the 2-rank run gets micro-batch r of
every step, the single process accumulates both. fp32 tolerance: every parameter
within max |a - b| <= 1e-5 x max |b| + 1e-6 (fp32 reductions in another order); for
ZeRO-3, whose partitioned reduce-scatter sums in yet another order and whose Adam
normalization magnifies rounding in near-zero gradients, + 1e-5 absolute (a third of
one lr-sized update at lr 3e-3). In float64 (``fp64``) the ddp comparison holds to
1e-12: what remains is summation order. DeepSpeed's ZeRO keeps fp32 master weights and
moments whatever the model's dtype, so its fp64 run is held to the fp32 tolerance.
"""

from __future__ import annotations

import pytest

from tests.dist.spawn import run_ranks

STEPS = 4


def _recipe(engine: str, dataset: str, accum: int, stage: int = 2, offload: bool = False):
    from molds.recipe.parse import Recipe
    from molds.recipe.sections import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainerConfig

    r = Recipe()
    r.data = DataConfig(manifest=dataset, seq_len=128, micro_batch_size=2, lookahead=64, shuffle_window=300)
    r.model = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256)
    r.parallel = ParallelConfig(engine=engine, zero_stage=stage, offload_optimizer=offload, offload_params=offload)
    r.optim = OptimConfig(lr=3e-3, warmup_steps=2, grad_clip=1.0)
    r.trainer = TrainerConfig(max_steps=STEPS, grad_accum=accum, precision="fp32")
    return r


def batches(dataset: str, n: int, seq_len: int = 128, too_long: str = "truncate") -> list[dict]:
    from molds.data.loader import MoleculeLoader
    from molds.recipe.sections import DataConfig

    ld = MoleculeLoader(DataConfig(manifest=dataset, seq_len=seq_len, micro_batch_size=2, lookahead=64,
                                   shuffle_window=300, too_long=too_long))
    keep = ("input_ids", "labels", "position_ids", "document_ids")
    out = []
    for b in ld:
        out.append({k: b[k] for k in keep})
        if len(out) == n:
            return out
    raise AssertionError("dataset too small")


def tokenizer(dataset):
    from molds.chemistry.tokens import tokenizer_info
    from molds.data.manifest import Manifest

    return tokenizer_info(Manifest.load(dataset))


def _train(rank, world, engine_name, dataset, stage=2, offload=False, fp64=False):
    import torch

    from molds.engines import build_engine
    from molds.models import build_model
    from molds.models.loss import build_loss
    from molds.runtime.distributed import init_distributed

    if fp64:
        torch.set_default_dtype(torch.float64)
    dist = init_distributed(need_group=engine_name == "zero")
    accum = 2 // world
    recipe = _recipe(engine_name, dataset, accum, stage, offload)
    model = build_model(recipe.model, tokenizer(dataset), seed=recipe.run.seed)
    engine = build_engine(recipe, model, build_loss(recipe.model), dist)
    data = batches(dataset, 2 * STEPS)
    losses = []
    for step in range(STEPS):
        pair = data[2 * step:2 * step + 2]
        losses.append(engine.train_step(pair if world == 1 else [pair[rank]]).loss)
    if engine_name == "zero" and stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.model.parameters())):
            params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return {"params": params, "losses": losses, "dtype": str(next(iter(params.values())).dtype)}


def _init_params(dataset):
    from molds.models import build_model

    recipe = _recipe("ddp", dataset, 1)
    return [p.detach().clone() for p in build_model(recipe.model, tokenizer(dataset), seed=0).parameters()]


def _compare(ref, got, rel, atol, dataset):
    for rank in got:
        for name, b in ref["params"].items():
            a = rank["params"][name]
            assert (a - b).abs().max() <= rel * b.abs().max() + atol, name
    mean_losses = [(x + y) / 2 for x, y in zip(got[0]["losses"], got[1]["losses"])]
    assert mean_losses == pytest.approx(ref["losses"], rel=max(rel, 1e-12))
    moved = sum(float((b.float() - p.float()).abs().max()) for b, p in zip(ref["params"].values(),
                                                                            _init_params(dataset)))
    assert moved > 0  # the comparison is about trained weights, not the initialization


@pytest.mark.parametrize("engine,stage,offload", [("ddp", 0, False), ("zero", 2, False), ("zero", 3, False),
                                                  pytest.param("zero", 3, True, marks=pytest.mark.slow)],
                         ids=["ddp", "zero2", "zero3", "zero3-offload"])
def test_two_ranks_match_single_process(dataset, engine, stage, offload):
    ref = run_ranks(_train, 1, "ddp", dataset)[0]  # plain torch: one process, AdamW, accumulation
    got = run_ranks(_train, 2, engine, dataset, stage, offload)
    _compare(ref, got, 1e-5, 1e-5 if stage == 3 else 1e-6, dataset)


@pytest.mark.parametrize("engine,stage,rel", [("ddp", 0, 1e-12), ("zero", 2, 1e-5)], ids=["ddp", "zero2"])
def test_two_ranks_match_single_process_fp64(dataset, engine, stage, rel):
    ref = run_ranks(_train, 1, "ddp", dataset, 0, False, True)[0]
    got = run_ranks(_train, 2, engine, dataset, stage, False, True)
    assert ref["dtype"] == got[0]["dtype"] == "torch.float64"
    _compare(ref, got, rel, rel / 10, dataset)
