"""FP8 training through torchao: ``kernels.fp8_recipe`` rowwise or tensorwise (``Float8Linear``),
and ``kernels.fp8_experts`` (its row-wise FP8 grouped GEMM for the MoE experts).

Why it exists beside ``fp8_linear`` (molds' block-scaled recipe, DeepSeek-V3's): torchao's
recipes are the ones torchtitan trains with and measures. Tensor-wise keeps one scale per
tensor (torchao's roofline bound at 4096^3 is 1.28x BF16 on an H100); row-wise keeps one
per row of each operand (1.15x there, more accurate), with scales rounded to powers of two.
On a GPU with FP8 matrix units (compute capability 8.9 and later) every product is
``torch._scaled_mm`` (cuBLAS); elsewhere torchao's emulation runs the same quantization
with the products in the input's precision (``emulate``: for tests and CPU runs of a
recipe). For the linears nothing here is written by hand: this module only chooses what
torchao converts.

What is converted: the decoder's ``nn.Linear`` modules whose both dimensions are multiples
of 16 (cuBLAS's FP8 products need them; torchtitan filters the same way). What stays in
the run's precision: the LM head, the MoE router, any linear of another width (counted on
the start line) and, unless ``kernels.fp8_experts`` asks, the experts' grouped GEMMs (BF16
``grouped_mm``).

The experts (``kernels.fp8_experts``, row-wise only): torchao's row-wise FP8 grouped GEMM
(``torchao.prototype.moe_training``: its Triton quantizations, then
``torch._scaled_grouped_mm``) on a GPU of compute capability 9.0 or later, the one torchtitan
trains its MoE models with. Its scales are per token along the contraction dimension for
activations and gradients, per expert and output column for weights, per expert and
column within the group for the weight gradient's operands, all e4m3 and rounded to powers
of two (torchao's grouped path always rounds). cuBLAS needs every expert's token group to
be a multiple of 16 rows, and torchao 0.18 does not pad them itself, so each group is padded
here with zero rows (``fp8_gemm.pad_groups``) and the padding taken off the output; the
zero rows change neither the scales nor the products. torchao has no emulation of the
grouped path, so elsewhere ``_EmulatedRowwiseGroupedMM`` runs the same quantization
(torchao's own ``tensor_to_scale`` and saturating cast) with dequantized float32 products:
the CPU path, and what the tests check against FP8 written out by hand. Written here
rather than taken: torchao's grouped function asserts a CUDA layout and calls kernels
that exist only on a GPU.

Gradient formats: tensor-wise casts the gradient to e5m2 (``kernels.fp8_grad_format``
e4m3 makes it e4m3); row-wise casts every operand to e4m3, gradients included, so it
takes ``fp8_grad_format: "e4m3"`` only. ``kernels.fp8_pow2_scales`` rounds the scales to
powers of two in both. Weight gradients are computed in torchao's backward, not deferred:
under ``parallel.schedule: "dualpipev"`` these linears' W runs with their I.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging

import torch
from torch import nn

from ..errors import RecipeError
from ..models.moe import Experts
from .fp8_gemm import _grouped_mm_fp32, pad_groups, scatter_rows

#: the recipes torchao runs for ``kernels.fp8_recipe``
RECIPES = ("rowwise", "tensorwise")


def fp8_units(device) -> bool:
    """Whether ``device`` runs FP8 products in hardware (else torchao emulates them)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and \
        torch.cuda.get_device_capability(device) >= (8, 9)


def _torchao_float8():
    """``torchao.float8``, imported without its known-harmless noise on a machine without a
    GPU (its CUDA extensions cannot load there; a GPU machine still hears about them)."""
    quiet = [] if torch.cuda.is_available() else [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8  # optional: torchao
    except ImportError as exc:
        raise RecipeError(f"kernels.fp8_recipe rowwise / tensorwise run torchao, which does not import here ({exc}): "
                          f"pip install torchao, or use kernels.fp8_recipe blockwise") from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return float8


def float8_config(recipe: str, *, pow2: bool, grad_format: str, emulate: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe`` with molds' options applied."""
    Float8LinearConfig = _torchao_float8().Float8LinearConfig
    if recipe not in RECIPES:
        raise ValueError(f"kernels.fp8_recipe {recipe!r}: torchao runs {', '.join(RECIPES)}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    changes = {"emulate": emulate, "round_scales_to_power_of_2": pow2}
    if recipe == "tensorwise" and grad_format == "e4m3":
        e4m3 = dataclasses.replace(config.cast_config_grad_output, target_dtype=torch.float8_e4m3fn)
        changes.update(cast_config_grad_output=e4m3, cast_config_grad_output_for_grad_weight=e4m3)
    return dataclasses.replace(config, **changes)


def convertible(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8_torchao(model: nn.Module, *, recipe: str, pow2: bool = False, grad_format: str = "e5m2",
                              device="cpu", experts: bool = False, only=None) -> dict:
    """Swap ``model``'s linears (not the LM head) for torchao's ``Float8Linear`` in place, and
    with ``experts`` (row-wise only) the experts' grouped GEMMs for row-wise FP8 ones; returns
    how many were swapped and how many kept their precision. ``only(module)``: whether to
    swap that linear or expert set (``kernels.fp8_products=faster``: ``Fp8Choice.takes``)."""
    convert_to_float8_training = _torchao_float8().convert_to_float8_training
    emulate = not fp8_units(device)
    head = getattr(model, "lm_head", None)
    linears = [m for m in model.modules() if type(m) is nn.Linear and m is not head]
    chosen = {id(m) for m in linears if convertible(m)}
    if only is not None:  # what measured faster in FP8 (none may have)
        chosen = {id(m) for m in linears if id(m) in chosen and only(m)}
    elif not chosen:
        raise RecipeError(f"kernels.fp8_recipe={recipe}: none of the model's {len(linears)} linears has both widths a "
                          f"multiple of 16, which torchao's FP8 products need (model.hidden_size, intermediate_size "
                          f"and the head widths); nothing would run in FP8")
    if chosen:
        convert_to_float8_training(model, config=float8_config(recipe, pow2=pow2, grad_format=grad_format,
                                                               emulate=emulate),
                                   module_filter_fn=lambda module, fqn: id(module) in chosen)
    counts = {"linear": len(chosen), "kept": len(linears) - len(chosen), "emulated": emulate}
    model.torchao_fp8_experts = experts  # what the start line says of experts left as they were
    if experts:
        if recipe != "rowwise":
            raise RecipeError(f"kernels.fp8_experts applies to kernels.fp8_recipe=rowwise (torchao's FP8 grouped GEMM "
                              f"is row-wise; fp8_recipe={recipe})")
        sets = [m for m in model.modules() if isinstance(m, Experts)]
        if not sets:
            raise RecipeError("kernels.fp8_experts: the model has no experts (model.num_experts is 0)")
        odd = [m for m in sets if m.hidden % 16 or m.width % 16]
        if odd:
            raise RecipeError(f"kernels.fp8_experts: torchao's FP8 grouped GEMM needs model.hidden_size and "
                              f"model.moe_expert_size to be multiples of 16 (they are {odd[0].hidden} and "
                              f"{odd[0].width})")
        sets = [m for m in sets if only is None or only(m)]
        grouped = RowwiseGroupedMM(hardware=grouped_fp8_units(device))  # refuses a torchao without the path
        for module in sets:
            module.grouped_mm = grouped
        counts["experts"] = len(sets)
    return counts


def grouped_fp8_units(device) -> bool:
    """Whether ``device`` runs torchao's row-wise FP8 grouped GEMM (``torch._scaled_grouped_mm``
    is built for compute capability 9.0 and later); elsewhere it is emulated."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _torchao_grouped():
    """torchao's differentiable row-wise FP8 grouped GEMM (torchao 0.18's name and signature)."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import (  # optional: torchao
            _to_fp8_rowwise_then_scaled_grouped_mm,
        )
    except Exception as exc:  # missing (another torchao), or its Triton kernels refused by this triton at import
        raise RecipeError(f"kernels.fp8_experts on this GPU runs torchao's row-wise FP8 grouped GEMM "
                          f"(torchao.prototype.moe_training.fp8_grouped_mm, as in torchao 0.18), which this torchao "
                          f"{_version('torchao')} lacks or cannot load here ({type(exc).__name__}: "
                          f"{exc}): pip install 'torchao>=0.18' (one whose kernels this triton "
                          f"{_version('triton')} takes), or set kernels.fp8_experts false") from None
    return _to_fp8_rowwise_then_scaled_grouped_mm


#: rows each expert's token group is padded to a multiple of (cuBLAS's FP8 grouped GEMM)
GROUP_ALIGN = 16


class RowwiseGroupedMM:
    """``Experts.grouped_mm`` (``F.grouped_mm``'s signature: x [M, K] sorted by expert, w
    [E, K, N], ``offs`` the groups' int32 ends) in row-wise FP8: torchao's on a GPU that runs
    it (``hardware``), the emulation elsewhere. The output has x's dtype."""

    any_shape = False  # a float64 run keeps the per-expert loop in its own precision
    torchao_rowwise = True  # what the start line counts

    def __init__(self, hardware: bool = False):
        self.hardware = hardware
        self._torchao = _torchao_grouped() if hardware else None  # one import, refused here if it fails

    def __call__(self, x: torch.Tensor, w: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
        counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
        index, padded_offs, rows = pad_groups(counts, GROUP_ALIGN)
        xp = scatter_rows(x, index, rows)  # zero rows between the groups (differentiable: index_copy)
        if self.hardware:
            w_t = w.transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major per expert, as cuBLAS reads it
            y = self._torchao(xp, w_t, padded_offs, out_dtype=torch.bfloat16, float8_dtype=torch.float8_e4m3fn,
                              pad_token_groups_for_grouped_mm=False).to(x.dtype)
        else:
            y = _EmulatedRowwiseGroupedMM.apply(xp, w, padded_offs)
        return y.index_select(0, index)


def _rowwise(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` through e4m3 with one power-of-two scale per slice along ``dim`` (torchao's
    ``tensor_to_scale`` and saturating cast), back in float32."""
    from torchao.float8.config import ScalingGranularity  # optional: torchao
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated  # optional: torchao

    scale = tensor_to_scale(t, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=dim, round_scales_to_power_of_2=True)
    return to_fp8_saturated(t.float() * scale, torch.float8_e4m3fn).float() / scale


def _per_group_columns(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``t`` [M, C] through e4m3 with a scale per column within each group of rows (the
    weight gradient's operands), back in float32; an empty group has nothing to scale."""
    out, start = torch.zeros(t.shape, dtype=torch.float32, device=t.device), 0
    for end in offs.tolist():
        if end > start:
            out[start:end] = _rowwise(t[start:end], 0)
        start = end
    return out


class _EmulatedRowwiseGroupedMM(torch.autograd.Function):
    """torchao's row-wise FP8 grouped GEMM, forward and backward, with the products
    dequantized to float32: x [M, K] (groups already padded), w [E, K, N], offs [E]."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        with torch.autocast(x.device.type, enabled=False):  # the products in float32, as the docstring says
            xq = _rowwise(x, -1)  # a scale per token, along K
            wq = _rowwise(w, -2)  # a scale per expert and output column, along K
            return _grouped_mm_fp32(xq, wq, offs).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(grad.device.type, enabled=False):
            return _EmulatedRowwiseGroupedMM._backward(ctx, grad.contiguous())

    @staticmethod
    def _backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:  # grad [M, N] @ w^T: scales along N
            dx = _grouped_mm_fp32(_rowwise(grad, -1), _rowwise(w, -1).transpose(-2, -1), offs).to(x.dtype)
        if ctx.needs_input_grad[1]:  # per expert x_g^T grad_g: scales along the group's tokens
            xs, gs = _per_group_columns(x, offs), _per_group_columns(grad, offs)
            dw, start = torch.zeros(w.shape, dtype=torch.float32, device=w.device), 0
            for e, end in enumerate(offs.tolist()):
                if end > start:
                    dw[e] = xs[start:end].t() @ gs[start:end]
                start = end
            dw = dw.to(w.dtype)
        return dx, dw, None


def torchao_summary(model: nn.Module) -> str | None:
    """The start line's words for the torchao linears and expert sets of ``model`` (None:
    there are none)."""
    found = [m for m in model.modules() if type(m).__name__ == "Float8Linear"
             and type(m).__module__.startswith("torchao.")]
    grouped = [m.grouped_mm for m in model.modules() if getattr(getattr(m, "grouped_mm", None), "torchao_rowwise",
                                                                 False)]
    if not found and not grouped:
        return None
    head = getattr(model, "lm_head", None)
    plain = [m for m in model.modules() if type(m) is nn.Linear and m is not head]
    narrow = sum(not convertible(m) for m in plain)
    if found:
        config = found[0].config
        recipe = "rowwise" if "axiswise" in str(config.cast_config_input.scaling_granularity).lower() else "tensorwise"
        how = ("torchao's emulation (no FP8 matrix units here: dequantized products)" if config.emulate
               else "torch._scaled_mm (cuBLAS)")
        line = f"fp8 ({recipe}, torchao Float8Linear): {len(found)} linears -> {how}"
    else:
        line = "fp8 (rowwise, torchao): 0 linears"
    if narrow:
        line += f"; {narrow} linears kept their precision (a width not a multiple of 16)"
    if len(plain) > narrow:
        line += f"; {len(plain) - narrow} linears kept their precision (kernels.fp8_products=faster)"
    if grouped:
        where = ("torchao's row-wise grouped GEMM (torch._scaled_grouped_mm)" if grouped[0].hardware
                 else "the row-wise grouped GEMM emulated (no FP8 grouped GEMM here: dequantized float32 products)")
        line += f"; {len(grouped)} expert GEMM sets (fp8_experts) -> {where}"
    rest = sum(type(m).__name__ == "Experts" and not getattr(m.grouped_mm, "torchao_rowwise", False)
               for m in model.modules())
    if rest:
        asked = getattr(model, "torchao_fp8_experts", False)
        line += (f"; {rest} expert GEMM sets kept their precision (kernels.fp8_products=faster)" if asked
                 else "; the experts' grouped GEMMs in the run's precision (kernels.fp8_experts is off)")
    return line
