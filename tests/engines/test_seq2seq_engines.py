"""The encoder-decoder (``model.family: seq2seq``) on the engines: two CPU ranks, each with one
micro-batch of a step, end with the weights one plain-torch process gets from both
micro-batches of each step (the single-process reference), on DDP and on DeepSpeed ZeRO-2 and
ZeRO-3 (its parameters partitioned across the ranks, its tied embeddings included, gathered
to compare; the tolerance of ``tests/engines/test_equivalence.py``'s ZeRO-3)."""

from __future__ import annotations

import contextlib

import pytest

from tests.dist.spawn import run_ranks


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from tests.data.conftest import pair_manifest

    return pair_manifest(tmp_path_factory.mktemp("s2s-engines"), 300, "forward")


LR = 3e-3


def _argv(manifest, out, engine, stage=2):
    return ["--data.manifest", manifest, "--data.mode", "bucketed", "--data.max_length", "160",
            "--data.max_tokens_per_batch", "640", "--data.bucket_pool", "50", "--data.too_long", "reject",
            "--model.family", "seq2seq", "--model.hidden_size", "32", "--model.num_layers", "2",
            "--model.decoder_layers", "1", "--model.num_heads", "4", "--model.max_position_embeddings", "160",
            "--model.dropout", "0.0", "--parallel.engine", engine, "--parallel.zero_stage", str(stage),
            "--optim.lr", str(LR), "--optim.warmup_steps", "1", "--trainer.max_steps", "3",
            "--trainer.precision", "fp32", "--logging.progress", "false", "--run.output_dir", out]


def _init(argv):
    """The model's weights before any step (in this process: no engine, no ranks)."""
    from molds.data.loader import MoleculeLoader
    from molds.models import build_model
    from molds.recipe.parse import parse_recipe
    from molds.recipe.sections import DataConfig

    recipe = parse_recipe(argv)
    model = build_model(recipe.model, MoleculeLoader(DataConfig(**{**recipe.data.__dict__})).specials,
                        seed=recipe.run.seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _params(rank, world, argv):
    """Two micro-batches per step: both on one rank, or one per rank."""
    from molds.data.loader import MoleculeLoader, batch_tensors
    from molds.engines import build_engine
    from molds.models import build_model
    from molds.models.loss import build_loss
    from molds.recipe.parse import parse_recipe
    from molds.recipe.sections import DataConfig
    from molds.runtime.distributed import init_distributed

    recipe = parse_recipe(argv + ["--trainer.grad_accum", str(2 // world)])
    dist = init_distributed(need_group=recipe.parallel.engine == "zero")  # DeepSpeed wants a group, even of one
    ld = MoleculeLoader(DataConfig(**{**recipe.data.__dict__}))
    engine = build_engine(recipe, build_model(recipe.model, ld.specials, seed=recipe.run.seed),
                          build_loss(recipe.model), dist)
    batches = []
    for b in ld:
        batches.append(batch_tensors(b, "cpu"))
        if len(batches) == 6:
            break
    losses = []
    for step in range(3):
        pair = batches[2 * step:2 * step + 2]
        losses.append(engine.train_step(pair if world == 1 else [pair[rank]]).loss)
    gather = contextlib.nullcontext()
    if recipe.parallel.engine == "zero" and recipe.parallel.zero_stage == 3:  # whole tensors, not partitions
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(engine.model.parameters()))
    with gather:
        return {n: p.detach().clone() for n, p in engine.model.named_parameters()}, losses


@pytest.mark.parametrize("engine,stage", [("ddp", 2), ("zero", 2), ("zero", 3)], ids=["ddp", "zero2", "zero3"])
def test_two_ranks_match_one_process(pairs, tmp_path, engine, stage):
    ref, ref_losses = run_ranks(_params, 1, _argv(pairs, str(tmp_path / "ref"), "ddp"))[0]
    got = run_ranks(_params, 2, _argv(pairs, str(tmp_path / "x"), engine, stage))
    assert all(v == v for v in ref_losses)
    init = _init(_argv(pairs, str(tmp_path / "init"), "ddp"))
    assert max(float((ref[n] - p).abs().max()) for n, p in init.items()) > 1e-3  # the weights trained
    for params, _ in got:
        assert params.keys() == ref.keys()
        for name, b in ref.items():
            if name.endswith("k_proj.bias"):  # adds q.b to all of a query's scores: softmax cancels it, so
                # its gradient is rounding alone, which differs by rank and Adam scales up to steps of lr
                assert (params[name] - b).abs().max() <= 3 * LR, name
                continue
            assert (params[name] - b).abs().max() <= 1e-5 * b.abs().max() + (1e-5 if stage == 3 else 1e-6), name
    # each rank's loss is its own micro-batch's; their mean is the one process's step loss
    for step in range(3):
        assert (got[0][1][step] + got[1][1][step]) / 2 == pytest.approx(ref_losses[step], rel=1e-5)
