"""benchmarks/recipe_size.py, which sized recipes/moe_fp8.json: its model-state bytes
against DeepSpeed's own estimators, its saved-tensor count against modules whose saved
tensors are known, and the whole script on the smoke MoE recipe against the model built
directly and the pipeline cut DeepSpeed makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.benchmark_scripts import benchmark_script
from tests.data.conftest import dataset  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "recipe_size.py")


def _script():
    return benchmark_script("recipe_size")


@pytest.mark.parametrize("params,gpus", [(1_000_003, 1), (185_661_440, 4), (6_433_013_760, 8), (7, 3)])
def test_model_states_are_deepspeeds_own_estimates_for_zero_2_and_3(params, gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    rs = _script()
    _, zero2 = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus, cpu_offload=False)
    assert rs.model_states_bytes(params, 0, 2, dp=gpus) == pytest.approx(zero2, abs=1)
    largest = params // 10
    _, zero3, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=gpus, cpu_offload=False)
    assert rs.model_states_bytes(params, 0, 3, dp=gpus, largest_layer=largest) == pytest.approx(zero3, abs=1)
    # ZeRO-1 keeps the 16-bit gradient whole: 2 bytes a parameter more on each rank than ZeRO-2
    assert rs.model_states_bytes(params, 0, 1, dp=gpus) == pytest.approx(zero2 + 2 * params - 2 * params / gpus,
                                                                         abs=1)


def test_expert_states_are_shared_by_data_parallel_over_expert_parallel_ranks():
    rs = _script()
    # 8 data-parallel ranks, experts over 4: each expert on 2 ranks, its master and moments halved
    assert rs.model_states_bytes(0, 1000, 1, dp=8, ep=4) == 4 * 1000 + 16 * 1000 / 2
    assert rs.model_states_bytes(1000, 0, 1, dp=8, ep=4) == 4 * 1000 + 16 * 1000 / 8


def _bytes(*shape) -> int:
    return int(torch.tensor(shape).prod()) * 4


def test_saved_bytes_count_what_autograd_keeps_and_not_weights_or_inputs():
    """A ReLU keeps its output, which the next linear keeps too (one storage); a GELU keeps
    its input, the first linear's output, beside the output the next linear keeps; the
    weights and the input are the module's and the caller's, not activations."""
    rs = _script()
    torch.manual_seed(0)
    rows, k, h, n = 32, 8, 24, 5
    x = torch.randn(rows, k, requires_grad=True)
    relu = nn.Sequential(nn.Linear(k, h), nn.ReLU(), nn.Linear(h, n))
    got, out = rs.saved_bytes(relu, x, list(relu.parameters()))
    assert got == _bytes(rows, h) and out.shape == (rows, n)
    gelu = nn.Sequential(nn.Linear(k, h), nn.GELU(), nn.Linear(h, n))
    got, _ = rs.saved_bytes(gelu, x, list(gelu.parameters()))
    assert got == 2 * _bytes(rows, h)
    with torch.no_grad():  # nothing is kept for a backward that will not run
        assert rs.saved_bytes(gelu, x, list(gelu.parameters()))[0] == 0


def test_the_smoke_moe_recipe_sized_against_its_model_and_deepspeeds_cut(dataset, tmp_path):  # noqa: F811
    from deepspeed.runtime.utils import partition_balanced

    from molds.chemistry.tokens import tokenizer_info
    from molds.data.manifest import Manifest
    from molds.models import build_model
    from molds.recipe.parse import parse_recipe

    recipe_path = os.path.join(ROOT, "recipes", "smoke", "moe_fp8.json")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, SCRIPT, "--recipe", recipe_path, "--manifest", dataset, "--molecules",
                           "1e6", "--batches", "2", "--mfu", "0.5", "--peak-tflops", "100"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    recipe = parse_recipe(["--recipe", recipe_path, "--data.manifest", dataset])
    model = build_model(recipe.model, tokenizer_info(Manifest.load(dataset)), seed=0)
    assert out["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    coefficients = model.flops_coefficients()
    a, b = coefficients["real_tokens"], coefficients["length_sq_sum"]
    assert out["model"]["flops_per_token"] == a
    # 4 CPU ranks: pp 2 (DualPipeV, 4 stages), dp 2, ep 2
    topo = out["topology"]
    assert (topo["gpus"], topo["pp"], topo["dp"], topo["ep"], topo["stages"]) == (4, 2, 2, 2, 4)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    ranks = out["memory"]["ranks"]
    assert [r["stages"] for r in ranks] == [[0, 3], [1, 2]]
    assert sum(r["dense_parameters"] for r in ranks) == out["model"]["parameters"] - experts
    assert sum(r["expert_parameters"] for r in ranks) * 2 == experts  # each rank keeps half the experts
    # the cut DeepSpeed makes by parameters: embed, 4 blocks, norm, head (tied to the
    # embedding: counted in the cut, held once by rank 0, which has both ends of the V)
    assert model.config.tie_word_embeddings
    layers = [model.model.embed_tokens.weight.numel()]
    layers += [sum(p.numel() for n, p in blk.named_parameters() if ".experts." not in f".{n}")
               + sum(p.numel() for n, p in blk.named_parameters() if ".experts." in f".{n}") // 2
               for blk in model.model.layers]
    layers += [model.model.norm.weight.numel(), model.lm_head.weight.numel()]
    parts = partition_balanced(layers, 4)
    per_stage = [sum(layers[parts[s]:parts[s + 1]]) for s in range(4)]
    assert [r["dense_parameters"] + r["expert_parameters"] for r in ranks] == [
        per_stage[0] + per_stage[3] - layers[0], per_stage[1] + per_stage[2]]
    assert all(r["held_micro_batches"] == 5 for r in ranks)  # DualPipeV: 2P + 1 chunks
    measured = out["activations_measured_bytes"]
    assert measured["dense"] > 0 and measured["moe"] > 0 and measured["head_loss"] > 0
    # one pass: FLOPs with the training loop's count, days at the given rate
    corpus = out["corpus"]
    flops = 1e6 * (a * corpus["tokens_per_molecule"] + b * corpus["length_sq_per_molecule"])
    assert corpus["training_flops"] == pytest.approx(flops)
    assert out["time"]["days_per_pass"] == pytest.approx(flops / (4 * 100e12 * 0.5) / 86400)
    assert out["memory"]["fullest_rank_gb"] == max(r["total_gb"] for r in ranks)


@pytest.mark.parametrize("recipe,extra,words", [
    ("dense_zero3_offload.json", [], "ZeRO stage 3 with CPU offload is not sized here"),
    ("dense_zero2.json", ["--parallel.zero_stage", "0"], "parallel.engine=zero at ZeRO stage 0 is not sized here"),
    ("moe_fp8.json", ["--run.min_gpus", "0", "--gpus", "6"], "6 GPUs cannot hold pp 2"),
    ("bart_retro.json", [], "model.family=seq2seq is not sized here"),
])
def test_what_it_cannot_size_is_one_line(recipe, extra, words, dataset, tmp_path):  # noqa: F811
    proc = subprocess.run([sys.executable, SCRIPT, "--recipe", os.path.join(ROOT, "recipes", recipe), "--manifest",
                           dataset, "--molecules", "1e6", *extra], cwd=tmp_path,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("recipe_size:")]
    assert len(lines) == 1 and words in lines[0], proc.stderr[-2000:]
