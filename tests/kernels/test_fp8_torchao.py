"""``kernels.fp8_recipe`` rowwise / tensorwise: torchao's Float8Linear under molds' converter
seam, run in torchao's emulation (the same quantization, dequantized float32 products) on a
CPU. The reference is FP8 written out by hand with torch's casts: each operand scaled by
the format's largest value over its amax (per tensor, or per row along the contraction
dimension), cast, and divided back; the product of the two must equal torchao's exactly,
forward and both backward products. Then the whole MoE decoder, the recipe rules, and a
training run under the deepspeed launcher's engines."""

from __future__ import annotations

import copy

import pytest
import torch

from molds.config import KernelsConfig
from molds.errors import RecipeError
from molds.kernels import apply_kernels, kernel_summary
from molds.models.loss import CausalLMLoss
from tests.kernels.test_converters import _batch, _loss_and_grads
from tests.test_moe import moe_model

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _through_fp8(t: torch.Tensor, dtype, dim=None, pow2: bool = False) -> torch.Tensor:
    """``t`` cast to FP8 with one scale per tensor (``dim`` None) or per slice along ``dim``, back in float32."""
    top = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (top / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t * scale).clamp(-top, top).to(dtype).float() / scale


def _reference(recipe, x, w, g, grad_dtype, pow2):
    """(y, dx, dw) of ``x @ w^T`` with every product's operands through FP8 as the recipe says."""
    if recipe == "tensorwise":
        dims = {"x": None, "w": None, "g": None, "w_for_dx": None, "g_for_dw": None, "x_for_dw": None}
    else:  # a scale per row of each operand along the contraction dimension of its product
        dims = {"x": -1, "w": -1, "g": -1, "w_for_dx": 0, "g_for_dw": 0, "x_for_dw": 0}
    y = _through_fp8(x, E4M3, dims["x"], pow2) @ _through_fp8(w, E4M3, dims["w"], pow2).T
    dx = _through_fp8(g, grad_dtype, dims["g"], pow2) @ _through_fp8(w, E4M3, dims["w_for_dx"], pow2)
    dw = _through_fp8(g, grad_dtype, dims["g_for_dw"], pow2).T @ _through_fp8(x, E4M3, dims["x_for_dw"], pow2)
    return y, dx, dw


@pytest.mark.parametrize("recipe,grad_format,pow2", [("tensorwise", "e5m2", False), ("tensorwise", "e4m3", True),
                                                     ("rowwise", "e4m3", True), ("rowwise", "e4m3", False)])
@pytest.mark.parametrize("rows", [48, 37])
def test_a_converted_linear_is_fp8_written_out_by_hand(recipe, grad_format, pow2, rows):
    from molds.kernels.fp8_torchao import convert_to_float8_torchao

    torch.manual_seed(rows)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64, bias=False))
    w = model[0].weight.detach().clone()
    counts = convert_to_float8_torchao(model, recipe=recipe, pow2=pow2, grad_format=grad_format)
    assert counts == {"linear": 1, "kept": 0, "emulated": True}
    x = (torch.randn(rows, 96) * torch.logspace(-2, 2, 96)).requires_grad_(True)  # columns of other magnitudes
    y = model(x)
    g = torch.randn_like(y) * 3
    y.backward(g)
    want = _reference(recipe, x.detach(), w, g, E5M2 if grad_format == "e5m2" else E4M3, pow2)
    for got, ref, name in zip((y.detach(), x.grad, model[0].weight.grad), want, ("y", "dx", "dw")):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # and it is FP8: the plain product differs
    assert not torch.allclose(y.detach(), x.detach() @ w.T, rtol=1e-3, atol=1e-3)


def test_the_converter_takes_the_decoders_linears_and_keeps_the_rest():
    reference = moe_model(shared_expert_size=16)
    model, loss = copy.deepcopy(reference), CausalLMLoss()
    apply_kernels(model, KernelsConfig(fp8=True, fp8_recipe="rowwise", fp8_grad_format="e4m3"), loss)
    assert model.state_dict().keys() == reference.state_dict().keys()  # checkpoints, export: the same
    names = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    plain = {n for n, m in reference.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"}
    assert names == plain and "lm_head" not in names
    assert type(model.lm_head) is torch.nn.Linear  # the head, the router and the experts keep their precision
    line = kernel_summary(model, "cpu")
    assert line == f"fp8 (rowwise, torchao Float8Linear): {len(plain)} linears -> torchao's emulation (no FP8 " \
                   "matrix units here: dequantized products)"
    # a linear whose width is no multiple of 16 stays (cuBLAS's FP8 products need one) and is counted
    from molds.models.decoder import CausalDecoder, DecoderConfig

    def odd(hidden, intermediate):  # heads of 12: the key / value projections are 24 wide
        return CausalDecoder(DecoderConfig(vocab_size=40, hidden_size=hidden, num_layers=2, num_heads=4,
                                           num_kv_heads=2, intermediate_size=intermediate))

    model = odd(48, 40)
    apply_kernels(model, KernelsConfig(fp8=True, fp8_recipe="tensorwise"), CausalLMLoss())
    fp8 = {n.split(".")[-1] for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert fp8 == {"q_proj", "o_proj"}, fp8
    assert "fp8 (tensorwise, torchao Float8Linear): 4 linears" in kernel_summary(model, "cpu")
    assert "10 linears kept their precision (a width not a multiple of 16)" in kernel_summary(model, "cpu")
    with pytest.raises(RecipeError, match="none of the model's 14 linears"):  # FP8 asked for, none possible
        apply_kernels(odd(40, 40), KernelsConfig(fp8=True, fp8_recipe="tensorwise"), CausalLMLoss())


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_whole_moe_decoder_stays_close_to_its_plain_numbers(recipe):
    reference = moe_model(shared_expert_size=16)
    batch = _batch()
    want, want_g = _loss_and_grads(reference, CausalLMLoss(), batch)
    model, loss = copy.deepcopy(reference), CausalLMLoss()
    apply_kernels(model, KernelsConfig(fp8=True, fp8_recipe=recipe, fp8_grad_format="e4m3"), loss)
    got, got_g = _loss_and_grads(model, loss, batch)
    assert abs(float(got - want)) < 0.01 * float(want)
    assert got_g.keys() == want_g.keys()
    for name in want_g:
        a, b = got_g[name].flatten().double(), want_g[name].flatten().double()
        assert float(a @ b / (a.norm() * b.norm())) > 0.9, name


def test_recipe_rules_for_the_torchao_recipes(tmp_path):
    from molds.recipe import parse_recipe, validate

    base = ["--recipe", "recipes/smoke/moe_fp8.json", "--data.manifest", str(tmp_path), "--kernels.triton", "false"]
    validate(parse_recipe(base + ["--kernels.fp8_recipe", "rowwise", "--kernels.fp8_grad_format", "e4m3"]), 4)
    validate(parse_recipe(base + ["--kernels.fp8_recipe", "tensorwise"]), 4)
    for extra, words in [(["--kernels.fp8", "false", "--kernels.fp8_recipe", "rowwise"],
                          "kernels.fp8_recipe applies with kernels.fp8=true"),
                         (["--kernels.fp8_recipe", "rowwise"], "casts gradients to e4m3"),
                         (["--kernels.fp8_recipe", "tensorwise", "--kernels.fp8_router", "true"],
                          "kernels.fp8_router applies to kernels.fp8_recipe=blockwise"),
                         (["--kernels.fp8_recipe", "tensorwise", "--kernels.fp8_lm_head", "true"],
                          "kernels.fp8_lm_head applies to kernels.fp8_recipe=blockwise")]:
        with pytest.raises(RecipeError, match=words):
            validate(parse_recipe(base + extra), 4)
    with pytest.raises(RecipeError, match="fp8_recipe"):
        parse_recipe(base + ["--kernels.fp8_recipe", "columnwise"])
