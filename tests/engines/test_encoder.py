"""The encoder family: MLM + masked multi-task heads, engine equivalence, HF export."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist.spawn import run_ranks


def _argv(dataset, out, engine, steps, tasks=2, extra=()):
    return ["--data.manifest", dataset, "--data.mode", "bucketed", "--data.max_tokens_per_batch", "1024",
            "--data.bucket_pool", "200", "--data.max_length", "96", "--data.mlm_probability", "0.15",
            "--data.with_labels", "true" if tasks else "false",
            "--model.family", "encoder", "--model.hidden_size", "64", "--model.num_layers", "2",
            "--model.num_heads", "4", "--model.max_position_embeddings", "128", "--model.dropout", "0.0",
            "--model.num_tasks", str(tasks), "--parallel.engine", engine, "--parallel.zero_stage", "2",
            "--optim.lr", "1e-3", "--optim.warmup_steps", "2", "--trainer.max_steps", str(steps),
            "--trainer.precision", "fp32", "--logging.interval_steps", "1", "--logging.progress", "false",
            "--run.output_dir", out, *extra]


def _train(rank, world, argv):
    from molds.train import main

    return main(argv)


def _params(rank, world, argv, dataset):
    """Two micro-batches per step: both on one rank, or one per rank."""
    from molds.data.loader import MoleculeLoader
    from molds.engines import build_engine
    from molds.models import build_model
    from molds.models.loss import build_loss
    from molds.recipe.parse import parse_recipe
    from molds.recipe.sections import DataConfig
    from molds.runtime.distributed import init_distributed

    dist = init_distributed()
    recipe = parse_recipe(argv + ["--trainer.grad_accum", str(2 // world)])
    ld = MoleculeLoader(DataConfig(**{**recipe.data.__dict__}))
    engine = build_engine(recipe, build_model(recipe.model, ld.specials, seed=recipe.run.seed),
                          build_loss(recipe.model), dist)
    keep = ("input_ids", "attention_mask", "mlm_labels", "labels", "label_mask")
    batches = []
    for b in ld:
        batches.append({k: b[k] for k in keep})
        if len(batches) == 6:
            break
    for step in range(3):
        pair = batches[2 * step:2 * step + 2]
        engine.train_step(pair if world == 1 else [pair[rank]])
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_encoder_two_ranks_match_single_process(dataset, tmp_path):
    argv = _argv(dataset, str(tmp_path / "x"), "ddp", 3)
    ref = run_ranks(_params, 1, argv, dataset)[0]
    got = run_ranks(_params, 2, argv, dataset)
    for name, b in ref.items():
        for rank in got:
            assert (rank[name] - b).abs().max() <= 1e-5 * b.abs().max() + 1e-6, name


@pytest.mark.parametrize("tasks", [2, 0])
def test_encoder_trains_and_exports(dataset, tmp_path, tasks):
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

    from molds.checkpoint import open_checkpoint
    from molds.data.loader import MoleculeLoader
    from molds.export import export
    from molds.recipe.parse import parse_recipe
    from molds.recipe.sections import DataConfig
    from molds.train import main

    out = str(tmp_path / "run")
    argv = _argv(dataset, out, "ddp", 12, tasks=tasks)
    result = main(argv)
    hf_dir = export(result["checkpoint"], str(tmp_path / "hf"))
    recipe = parse_recipe(argv)
    ld = MoleculeLoader(DataConfig(**{**recipe.data.__dict__}))
    ours = open_checkpoint(result["checkpoint"]).model  # strict: every weight, nothing else
    batch = next(iter(ld))
    x, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        mine = ours(x, attention_mask=mask)
        if tasks:
            hf = AutoModelForSequenceClassification.from_pretrained(hf_dir, local_files_only=True).eval()
            torch.testing.assert_close(hf(input_ids=x, attention_mask=mask).logits, mine["predictions"],
                                       rtol=1e-4, atol=1e-5)
        else:
            hf = AutoModelForMaskedLM.from_pretrained(hf_dir, local_files_only=True).eval()
            torch.testing.assert_close(hf(input_ids=x, attention_mask=mask).logits, mine["logits"],
                                       rtol=1e-4, atol=1e-5)
    import json

    losses = [json.loads(line)["train/loss"] for line in open(os.path.join(out, "metrics.jsonl"))]
    assert losses[-1] < losses[0]
