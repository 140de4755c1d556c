"""``kernels.fp8_recipe`` rowwise / tensorwise: torchao's Float8Linear under molds' converter
seam, run in torchao's emulation (the same quantization, dequantized float32 products) on a
CPU. The reference is FP8 written out by hand with torch's casts: each operand scaled by
the format's largest value over its amax (per tensor, or per row along the contraction
dimension), cast, and divided back; the product of the two must equal torchao's exactly,
forward and both backward products. The experts' row-wise grouped GEMM
(``kernels.fp8_experts``) is held to the same reference, one expert's tokens at a time.
Then the whole MoE decoder, the recipe rules, and a training run under the deepspeed
launcher's engines."""

from __future__ import annotations

import copy

import pytest
import torch

from molds.errors import RecipeError
from molds.kernels import apply_kernels, kernel_summary
from molds.models.loss import CausalLMLoss
from molds.recipe.sections import KernelsConfig
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


@pytest.mark.parametrize("counts", [[5, 0, 23, 16, 1], [16, 32, 16], [0, 0, 7]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_rowwise_grouped_gemm_is_fp8_written_out_by_hand(counts, dtype):
    """Each expert's tokens through ``_reference`` (row-wise, power-of-two scales: torchao's
    grouped path always rounds them): groups that are no multiple of 16 rows (padded inside
    and unpadded), empty groups (no rows, a zero weight gradient), bf16 inputs."""
    from molds.kernels.fp8_torchao import RowwiseGroupedMM

    torch.manual_seed(sum(counts))
    experts, k, n = len(counts), 64, 48
    rows = sum(counts)
    # columns of other magnitudes, and each expert's tokens 2^-8 times the last's: a scale
    # shared across the groups would push the later groups into e4m3's subnormals
    group = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    magnitude = torch.exp2(-8.0 * group)[:, None]
    x = (torch.randn(rows, k) * torch.logspace(-2, 2, k) * magnitude).to(dtype).requires_grad_(True)
    w = (torch.randn(experts, k, n) * torch.logspace(-3, 0, n)).requires_grad_(True)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    y = RowwiseGroupedMM()(x, w, offs=offs)
    assert y.dtype == dtype and y.shape == (rows, n)
    g = torch.randn(rows, n) * 3 * magnitude
    y.backward(g.to(dtype))
    assert x.grad.dtype == dtype and w.grad.dtype == torch.float32
    start = 0
    for e, count in enumerate(counts):
        rows_e = slice(start, start + count)
        start += count
        if not count:
            assert not w.grad[e].any(), "an expert without tokens has no weight gradient"
            continue
        ry, rdx, rdw = _reference("rowwise", x.detach()[rows_e].float(), w.detach()[e].T,
                                  g.to(dtype)[rows_e].float(), E4M3, True)
        def close(got, want, name, exact=dtype == torch.float32):  # bf16 outputs: bf16's rounding of them
            tol = 1e-6 if exact else 8e-3  # of the expert's largest (its tokens are 2^-8e as large)
            torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol * float(want.abs().max()),
                                       msg=lambda m: f"{name}, expert {e}: {m}")

        close(y.detach()[rows_e], ry, "y")
        close(x.grad[rows_e], rdx, "dx")
        close(w.grad[e], rdw.T, "dw", exact=True)
    if rows:  # and it is FP8: the plain grouped product differs
        plain = torch.nn.functional.grouped_mm(x.detach().float(), w.detach(), offs=offs)
        assert float((y.detach().float() - plain).norm() / plain.norm()) > 1e-3


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
                   "matrix units here: dequantized products); the experts' grouped GEMMs in the run's precision " \
                   "(kernels.fp8_experts is off)"
    assert all(m.grouped_mm is torch.nn.functional.grouped_mm for m in model.modules() if type(m).__name__ == "Experts")
    # kernels.fp8_experts: every expert set through the row-wise grouped GEMM, the rest as before
    from molds.kernels.fp8_torchao import RowwiseGroupedMM

    rowwise_experts = KernelsConfig(fp8=True, fp8_recipe="rowwise", fp8_grad_format="e4m3", fp8_experts=True)
    with pytest.raises(RecipeError, match="multiples of 16 \\(they are 32 and 24\\)"):  # the experts are 24 wide
        apply_kernels(copy.deepcopy(reference), rowwise_experts, CausalLMLoss())
    model = moe_model(shared_expert_size=16, expert_size=32)
    apply_kernels(model, rowwise_experts, CausalLMLoss())
    sets = [m for m in model.modules() if type(m).__name__ == "Experts"]
    assert sets and all(isinstance(m.grouped_mm, RowwiseGroupedMM) and not m.grouped_mm.hardware for m in sets)
    assert {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"} == plain
    assert kernel_summary(model, "cpu").endswith(
        f"; {len(sets)} expert GEMM sets (fp8_experts) -> the row-wise grouped GEMM emulated (no FP8 grouped GEMM "
        "here: dequantized float32 products)")
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


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise-experts"])
def test_a_whole_moe_decoder_stays_close_to_its_plain_numbers(recipe):
    experts = recipe.endswith("-experts")
    reference = moe_model(shared_expert_size=16, expert_size=32 if experts else 24)
    batch = _batch()
    want, want_g = _loss_and_grads(reference, CausalLMLoss(), batch)
    model, loss = copy.deepcopy(reference), CausalLMLoss()
    apply_kernels(model, KernelsConfig(fp8=True, fp8_recipe=recipe.removesuffix("-experts"), fp8_grad_format="e4m3",
                                       fp8_experts=experts), loss)
    got, got_g = _loss_and_grads(model, loss, batch)
    assert abs(float(got - want)) < 0.01 * float(want)
    assert got_g.keys() == want_g.keys()
    for name in want_g:
        a, b = got_g[name].flatten().double(), want_g[name].flatten().double()
        assert float(a @ b / (a.norm() * b.norm())) > 0.9, name


def test_recipe_rules_for_the_torchao_recipes(tmp_path):
    from molds.recipe.parse import parse_recipe, validate

    base = ["--recipe", "recipes/smoke/moe_fp8.json", "--data.manifest", str(tmp_path), "--kernels.triton", "false"]
    validate(parse_recipe(base + ["--kernels.fp8_recipe", "rowwise", "--kernels.fp8_grad_format", "e4m3"]), 4)
    validate(parse_recipe(base + ["--kernels.fp8_recipe", "tensorwise"]), 4)
    validate(parse_recipe(base + ["--kernels.fp8_recipe", "rowwise", "--kernels.fp8_grad_format", "e4m3",
                                  "--kernels.fp8_experts", "true"]), 4)
    with pytest.raises(RecipeError, match=r"multiples of 16 \(they are 128 and 24\)"):  # before any rank starts
        validate(parse_recipe(base + ["--kernels.fp8_recipe", "rowwise", "--kernels.fp8_grad_format", "e4m3",
                                      "--kernels.fp8_experts", "true", "--model.moe_expert_size", "24"]), 4)
    with pytest.raises(RecipeError, match="kernels.fp8_experts applies to MoE models"):
        validate(parse_recipe(base + ["--kernels.fp8_recipe", "rowwise", "--kernels.fp8_grad_format", "e4m3",
                                      "--kernels.fp8_experts", "true", "--model.num_experts", "0"]), 4)
    for extra, words in [(["--kernels.fp8", "false", "--kernels.fp8_recipe", "rowwise"],
                          "kernels.fp8_recipe applies with kernels.fp8=true"),
                         (["--kernels.fp8_recipe", "rowwise"], "casts gradients to e4m3"),
                         (["--kernels.fp8_recipe", "tensorwise", "--kernels.fp8_router", "true"],
                          "kernels.fp8_router applies to kernels.fp8_recipe=blockwise"),
                         (["--kernels.fp8_recipe", "tensorwise", "--kernels.fp8_lm_head", "true"],
                          "kernels.fp8_lm_head applies to kernels.fp8_recipe=blockwise"),
                         (["--kernels.fp8_recipe", "tensorwise", "--kernels.fp8_experts", "true"],
                          "kernels.fp8_experts applies to kernels.fp8_recipe=rowwise"),
                         (["--kernels.fp8_experts", "true"], "kernels.fp8_experts applies to kernels.fp8_recipe="
                                                             "rowwise: the block-wise recipe converts the experts"),
                         (["--kernels.fp8", "false", "--kernels.fp8_experts", "true"],
                          "kernels.fp8_experts applies with kernels.fp8=true")]:
        with pytest.raises(RecipeError, match=words):
            validate(parse_recipe(base + extra), 4)
    with pytest.raises(RecipeError, match="fp8_recipe"):
        parse_recipe(base + ["--kernels.fp8_recipe", "columnwise"])


def _scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs, out_dtype=torch.bfloat16, use_fast_accum=False):
    """``torch._scaled_grouped_mm`` (CUDA only) as its documented row-wise semantics read,
    with what cuBLAS demands of its operands checked: int32 group ends that are multiples of
    16, a row-major left and a column-major right operand, FP8 codes."""
    assert offs.dtype == torch.int32 and a.dtype == b.dtype == E4M3
    ends = offs.tolist()
    sizes = [e - s for s, e in zip([0] + ends[:-1], ends)]
    assert all(n % 16 == 0 for n in sizes), f"token groups {sizes}: cuBLAS needs multiples of 16"
    assert a.stride(-1) == 1 and b.stride(-2) == 1, "cuBLAS: a row-major, b column-major"
    start, out = 0, []
    if b.dim() == 3:  # tokens [M, K] x experts [E, K, N]: a scale per token, per expert and column
        for g, end in enumerate(ends):
            out.append((a[start:end].float() * scale_a[start:end, None]) @ (b[g].float() * scale_b[g][None, :]))
            start = end
        return torch.cat(out).to(out_dtype)
    experts, (n, k) = len(ends), (a.shape[0], b.shape[1])  # [N, M] x [M, K] grouped along M: [E, N, K]
    sa, sb = scale_a.view(experts, n), scale_b.view(experts, k)
    for g, end in enumerate(ends):
        out.append((a[:, start:end].float() * sa[g][:, None]) @ (b[start:end].float() * sb[g][None, :]))
        start = end
    return torch.stack(out).to(out_dtype)


def test_the_gpu_path_is_torchaos_function_as_called_on_a_hopper_gpu(monkeypatch):
    """The ``hardware`` path runs torchao's own autograd function, with its four Triton
    quantizations replaced by torchao's PyTorch references of them and
    ``torch._scaled_grouped_mm`` by ``_scaled_grouped_mm_reference``: the layouts and the
    16-row groups it is handed pass torchao's and cuBLAS's checks, a float32 master weight
    takes its bf16 weight gradient, and the result is the emulation's to bf16 rounding."""
    import torchao.prototype.moe_training.fp8_grouped_mm as grouped
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training.utils import (
        torch_to_3d_rowwise_float8_transpose_rhs,
        torch_to_float8_per_group_colwise,
    )

    from molds.kernels.fp8_torchao import RowwiseGroupedMM

    def cast(t, dim):
        s = tensor_to_scale(t, E4M3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                            round_scales_to_power_of_2=True)
        return to_fp8_saturated(t.float() * s, E4M3), s

    def column_major(t):
        return t.t().contiguous().t()

    def per_group_dual(g, a, offs, dtype, round_scales_to_power_of_2):
        qg, sg = torch_to_float8_per_group_colwise(g, offs, dtype, round_scales_to_power_of_2)
        qa, sa = torch_to_float8_per_group_colwise(a, offs, dtype, round_scales_to_power_of_2)
        return column_major(qg), sg, column_major(qa), sa

    monkeypatch.setattr(grouped, "triton_fp8_rowwise_2d_scale_and_cast", lambda t, **kw: cast(t, -1))
    monkeypatch.setattr(grouped, "triton_fp8_colwise_3d_scale_and_cast", lambda t, **kw: cast(t, -2))
    monkeypatch.setattr(grouped, "triton_fp8_rowwise_3d_transpose_rhs",
                        lambda t, output_dtype, round_scales_to_power_of_2: torch_to_3d_rowwise_float8_transpose_rhs(
                            t, output_dtype, round_scales_to_power_of_2))
    monkeypatch.setattr(grouped, "triton_fp8_per_group_colwise_scales_dual", per_group_dual)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_reference)

    torch.manual_seed(3)
    counts = [5, 16, 23, 1]  # none but one a multiple of 16: the padding is what cuBLAS is handed
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    x0 = torch.randn(sum(counts), 64).to(torch.bfloat16)
    w0 = torch.randn(len(counts), 64, 48) * 0.02  # a float32 master weight, as under bf16 autocast
    g = torch.randn(sum(counts), 48).to(torch.bfloat16)
    results = []
    for hardware in (True, False):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        y = RowwiseGroupedMM(hardware=hardware)(x, w, offs=offs)
        y.backward(g)
        assert y.dtype == x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
        results.append((y.detach().float(), x.grad.float(), w.grad))
    for got, want, name in zip(*results, ("y", "dx", "dw")):  # bf16 outputs on the GPU path
        torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3 * float(want.abs().max()), msg=name)


def test_a_missing_or_older_torchao_is_one_line_naming_the_fix(monkeypatch):
    import sys

    import molds.kernels.fp8_torchao as ours

    rowwise_experts = KernelsConfig(fp8=True, fp8_recipe="rowwise", fp8_grad_format="e4m3", fp8_experts=True)
    # a torchao without the grouped path, on a GPU that would run it: refused at conversion
    monkeypatch.setattr(ours, "grouped_fp8_units", lambda device: True)
    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training.fp8_grouped_mm", None)
    with pytest.raises(RecipeError, match=r"kernels.fp8_experts on this GPU .* lacks .*pip install 'torchao>=0.18'"):
        apply_kernels(moe_model(shared_expert_size=16, expert_size=32), rowwise_experts, CausalLMLoss())
    # no torchao at all (a machine where it is not a requirement)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(RecipeError, match="run torchao, which does not import here .*pip install torchao"):
        apply_kernels(moe_model(), KernelsConfig(fp8=True, fp8_recipe="tensorwise"), CausalLMLoss())
