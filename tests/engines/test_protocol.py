"""Every engine implements the Engine protocol (molds.engines.base), the same way."""

from __future__ import annotations

import inspect

import pytest

from tests.dist.spawn import run_ranks
from tests.engines.test_equivalence import _recipe, batches, tokenizer

ENGINES = [("ddp", 0), ("zero", 2), ("zero", 3), ("pipeline", 1)]


def _check(rank, world, engine_name, stage, dataset, directory):
    import contextlib

    import torch

    from molds.engines import Engine, StepResult, Topology, build_engine
    from molds.models import build_model
    from molds.models.loss import build_loss
    from molds.runtime.distributed import init_distributed

    recipe = _recipe(engine_name, dataset, 1, stage)
    if engine_name == "pipeline":
        recipe.parallel.pp_size = 2
    dist = init_distributed(need_group=engine_name != "ddp")
    engine = build_engine(recipe, build_model(recipe.model, tokenizer(dataset), seed=0), build_loss(recipe.model), dist)
    assert isinstance(engine, Engine)
    for name, member in inspect.getmembers(Engine, inspect.isfunction):
        if name.startswith("_"):
            continue
        want = [p for p in inspect.signature(member).parameters if p != "self"]
        got = [p for p in inspect.signature(getattr(engine, name)).parameters]
        assert got == want, (engine_name, name, got, want)
    assert isinstance(engine.topology, Topology)
    topo = engine.topology
    assert topo.dp_size * topo.pp_size == world and topo.world_size == world and topo.rank == rank
    data = batches(dataset, 2 * world)
    result = engine.train_step([data[topo.dp_rank]])
    assert isinstance(result, StepResult) and result.loss > 0 and result.grad_norm > 0 and not result.skipped
    assert isinstance(result.extras, dict)
    out = engine.eval_forward(data[world + topo.dp_rank])
    assert float(out["loss"]) > 0
    if engine.model is not None:  # the pipeline engine returns the loss alone: no rank has all the logits
        assert out["logits"].shape[:2] == data[0]["input_ids"].shape
    assert isinstance(engine.extras(), dict)
    assert isinstance(engine.autocast(), contextlib.AbstractContextManager)
    import os

    os.makedirs(directory, exist_ok=True)
    engine.save(directory)
    torch.distributed.barrier()  # rank 0 writes; save_checkpoint agrees on it, here we wait
    engine.load(directory)
    engine.set_lr_schedule(recipe.optim, 10)
    return engine.name


@pytest.mark.parametrize("engine,stage", ENGINES, ids=["ddp", "zero2", "zero3", "pipeline"])
def test_engine_implements_the_protocol(dataset, tmp_path, engine, stage):
    assert run_ranks(_check, 2, engine, stage, dataset, str(tmp_path)) == [engine, engine]
