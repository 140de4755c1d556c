"""The ``kernels`` converters on whole models: what they swap and say, the Triton path of a
whole MoE decoder equal to its PyTorch path, FP8 training close to the plain model,
torch.compile through every op without a graph break, and the recipe rules."""

from __future__ import annotations

import copy

import pytest
import torch

from molds.errors import RecipeError
from molds.kernels import apply_kernels, kernel_summary
from molds.models.loss import CausalLMLoss
from molds.recipe.sections import KernelsConfig
from tests.test_decoder import _packed_batch
from tests.test_moe import moe_model


def _batch():
    ids, pos, doc, _ = _packed_batch([[5, 9, 3], [12, 1, 6]], 24, 40)
    return {"input_ids": ids, "position_ids": pos, "document_ids": doc, "labels": ids.masked_fill(doc < 0, -100)}


def _loss_and_grads(model, loss, batch):
    model.zero_grad()
    value = loss(model(**batch), batch)
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _converted(reference, kernels):
    model, loss = copy.deepcopy(reference), CausalLMLoss()
    apply_kernels(model, kernels, loss)
    return model, loss


def test_converters_swap_count_and_keep_the_state_dict():
    reference = moe_model(shared_expert_size=16)
    model, loss = _converted(reference, KernelsConfig(fp8=True, fp8_router=True, triton=True))
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert model.head_in_loss and loss.linear_cross_entropy.__module__ == "molds.kernels.cross_entropy"
    line = kernel_summary(model, "cpu")
    # 3 blocks x 4 attention projections + the shared experts' 3 x 3 (the head stays: fp8_lm_head off)
    assert "fp8: 21 linears, 3 expert GEMM sets, 3 routers" in line
    assert "rms_norm x13" in line and "swiglu x6" in line and "moe_permute x3" in line
    assert "linear_cross_entropy x1" in line and "PyTorch (a CPU" in line
    head, _ = _converted(reference, KernelsConfig(fp8=True, fp8_lm_head=True))
    assert "22 linears (LM head included)" in kernel_summary(head, "cpu")
    assert kernel_summary(moe_model(), "cpu") == ""


def test_triton_path_of_a_whole_model_equals_its_pytorch_path(request):
    reference = moe_model(shared_expert_size=16)
    batch = _batch()
    kernels = KernelsConfig(fp8=True, triton=True)
    plain = _loss_and_grads(*_converted(reference, kernels), batch)  # the PyTorch paths, on the CPU
    device = request.getfixturevalue("device")  # from here on: the GPU, or the interpreter on the CPU
    model, loss = _converted(reference, kernels)
    model.to(device)
    assert ("Triton interpreter" if device.type == "cpu" else "-> Triton") in kernel_summary(model, device)
    # every op through its Triton kernel (on a Hopper GPU the forward FP8 products through cuBLAS)
    fused = _loss_and_grads(model, loss, {k: v.to(device) for k, v in batch.items()})
    assert fused[1].keys() == plain[1].keys()
    if device.type == "cpu":  # the same products in float32: equal up to summation order
        _equal_up_to_summation_order(fused, plain)
        return
    # A GPU: its FP8 tensor cores add each 128-wide block of products with about 14 bits
    # (tests/kernels/test_fp8_linear.py, ``_close``), and a difference that small flips the
    # rounding of some elements when the next product quantizes them again (e5m2: 12 % a
    # step), more of them the deeper a gradient comes from (seen on an H200: the embedding's
    # 3.4 % of its norm, the others under 2 %). So with FP8 the loss and each gradient's
    # direction are held, and without FP8 the fused ops must equal the PyTorch paths as on a CPU
    torch.testing.assert_close(fused[0].cpu(), plain[0], rtol=1e-4, atol=1e-6)
    for name, g in fused[1].items():
        a, b = g.cpu().double().flatten(), plain[1][name].double().flatten()
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        cos = float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))
        assert err < 0.1 and cos > 0.995, f"{name}: gradient off by {err:.4f} of its norm (cosine {cos:.5f})"
    plain = _loss_and_grads(*_converted(reference, KernelsConfig(triton=True)), batch)
    model, loss = _converted(reference, KernelsConfig(triton=True))
    fused = _loss_and_grads(model.to(device), loss, {k: v.to(device) for k, v in batch.items()})
    _equal_up_to_summation_order(fused, plain)


def _equal_up_to_summation_order(fused, plain):
    """(loss, gradients) of a model through its Triton kernels against its PyTorch paths."""
    torch.testing.assert_close(fused[0].cpu(), plain[0], rtol=1e-5, atol=1e-6)
    for name, g in fused[1].items():
        torch.testing.assert_close(g.cpu(), plain[1][name], rtol=1e-4, atol=1e-5 * float(plain[1][name].abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_triton_ops_keep_the_models_numbers_and_fp8_stays_close():
    reference = moe_model(shared_expert_size=16)
    batch = _batch()
    want, want_g = _loss_and_grads(reference, CausalLMLoss(), batch)
    got, got_g = _loss_and_grads(*_converted(reference, KernelsConfig(triton=True)), batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-5, atol=1e-6, msg=name)
    # FP8 (every product of this 32-wide model in e4m3 / e5m2 1x128 tiles, i.e. a scale per
    # row): the loss moves by a fraction of a percent, each gradient by FP8's tens of percent at
    # most, and points the same way (cosine > 0.9)
    fp8, fp8_g = _loss_and_grads(*_converted(reference, KernelsConfig(fp8=True)), batch)
    assert abs(float(fp8 - want)) < 0.01 * float(want)
    for name in want_g:
        a, b = fp8_g[name].flatten().double(), want_g[name].flatten().double()
        assert float(a @ b / (a.norm() * b.norm())) > 0.9, name


def test_compile_traces_a_decoder_through_every_op_without_graph_breaks():
    from molds.models.decoder import CausalDecoder, DecoderConfig

    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2))
    loss = CausalLMLoss()
    apply_kernels(model, KernelsConfig(fp8=True, fp8_lm_head=False, triton=True), loss)
    ids = torch.randint(6, 40, (3, 17))
    batch = {"input_ids": ids, "labels": ids}

    def forward(batch):
        return loss(model(batch["input_ids"]), batch)

    eager = forward(batch)
    eager.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")  # a graph break raises
    out = compiled(batch)
    out.backward()  # the backward graph AOTAutograd traced through the custom ops' autograd
    torch.testing.assert_close(out, eager)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)


def test_deferral_leaves_the_fp8_products_alone():
    import torch.nn.functional as F

    from molds.models.moe import Experts, Router
    from molds.models.wgrad import defer_weight_grads

    model, _ = _converted(moe_model(), KernelsConfig(fp8=True))
    defer_weight_grads(model)
    assert all(getattr(m.grouped_mm, "any_shape", False) for m in model.modules() if isinstance(m, Experts))
    assert all(m.linear is not F.linear for m in model.modules() if isinstance(m, Router))  # the router: deferrable
    assert type(model.lm_head).__name__ == "DeferrableLinear"  # not FP8 here: the BF16 deferral takes it


def test_recipe_rules_for_the_kernels_section(tmp_path):
    from molds.recipe.parse import check_machine, parse_recipe, validate

    base = ["--recipe", "recipes/smoke/moe_fp8.json", "--data.manifest", str(tmp_path)]
    validate(parse_recipe(base), 4)
    for extra, words in [(["--kernels.fp8", "false", "--kernels.fp8_pow2_scales", "true"],
                          "kernels.fp8_pow2_scales applies with kernels.fp8=true"),
                         (["--kernels.fp8_lm_head", "true"], "kernels.fp8_lm_head cannot combine with kernels.triton"),
                         (["--model.num_experts", "0", "--kernels.fp8_router", "true", "--parallel.ep_size", "1"],
                          "kernels.fp8_router needs a mixture-of-experts model")]:
        with pytest.raises(RecipeError, match=words):
            validate(parse_recipe(base + extra), 4)
    with pytest.raises(RecipeError, match="kernels.triton applies to model.family=decoder"):
        validate(parse_recipe(["--recipe", "recipes/smoke/mlm_multitask_zero2.json", "--kernels.triton", "true"]), 2)
    full = ["--recipe", "recipes/moe_fp8.json"]
    if not torch.cuda.is_available():
        with pytest.raises(RecipeError, match=r"sized for 8 GPUs.*smoke twin: deepspeed --num_gpus 4 molds/train.py "
                                              r"--recipe recipes/smoke/moe_fp8.json"):
            check_machine(parse_recipe(full), full)
    check_machine(parse_recipe(base), base)  # the twin runs anywhere


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="a machine the full recipe is sized for")
def test_the_headline_command_stops_at_once_on_a_small_machine_naming_its_twin():
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    proc = subprocess.run([sys.executable, "molds/train.py", "--recipe", "recipes/moe_fp8.json"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "recipes/smoke/moe_fp8.json" in lines[0] and "run.min_gpus" in lines[0], lines
