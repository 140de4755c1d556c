"""FP8 training through torchao's ``Float8Linear``: ``kernels.fp8_recipe`` rowwise or tensorwise.

Why it exists beside ``fp8_linear`` (molds' block-scaled recipe, DeepSeek-V3's): torchao's
recipes are the ones torchtitan trains with and measures. Tensor-wise keeps one scale per
tensor (torchao's roofline bound at 4096^3 is 1.28x BF16 on an H100); row-wise keeps one
per row of each operand (1.15x there, more accurate), with scales rounded to powers of two.
On a GPU with FP8 matrix units (compute capability 8.9 and later) every product is
``torch._scaled_mm`` (cuBLAS); elsewhere torchao's emulation runs the same quantization
with the products in the input's precision (``emulate``: for tests and CPU runs of a
recipe). Nothing here is written by hand: this module only chooses what torchao converts.

What is converted: the decoder's ``nn.Linear`` modules whose both dimensions are multiples
of 16 (cuBLAS's FP8 products need them; torchtitan filters the same way). What stays in
the run's precision: the LM head, the MoE router and the experts' grouped GEMMs (BF16
``grouped_mm``), and any linear of another width (counted on the start line).

Gradient formats: tensor-wise casts the gradient to e5m2 (``kernels.fp8_grad_format``
e4m3 makes it e4m3); row-wise casts every operand to e4m3, gradients included, so it
takes ``fp8_grad_format: "e4m3"`` only. ``kernels.fp8_pow2_scales`` rounds the scales to
powers of two in both. Weight gradients are computed in torchao's backward, not deferred:
under ``parallel.schedule: "dualpipev"`` these linears' W runs with their I.
"""

from __future__ import annotations

import dataclasses

from torch import nn

#: the recipes torchao runs for ``kernels.fp8_recipe``
RECIPES = ("rowwise", "tensorwise")


def fp8_units(device) -> bool:
    """Whether ``device`` runs FP8 products in hardware (else torchao emulates them)."""
    import torch

    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and \
        torch.cuda.get_device_capability(device) >= (8, 9)


def _torchao_float8():
    """``torchao.float8``, imported without its known-harmless noise on a machine without a
    GPU (its CUDA extensions cannot load there; a GPU machine still hears about them)."""
    import logging

    import torch

    quiet = [] if torch.cuda.is_available() else [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return float8


def float8_config(recipe: str, *, pow2: bool, grad_format: str, emulate: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe`` with molds' options applied."""
    import torch

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
                              device="cpu") -> dict:
    """Swap ``model``'s linears (not the LM head) for torchao's ``Float8Linear`` in place;
    returns how many were swapped and how many linears kept their precision."""
    convert_to_float8_training = _torchao_float8().convert_to_float8_training
    emulate = not fp8_units(device)
    head = getattr(model, "lm_head", None)
    linears = [m for m in model.modules() if type(m) is nn.Linear and m is not head]
    chosen = {id(m) for m in linears if convertible(m)}
    if not chosen:
        from ..errors import RecipeError

        raise RecipeError(f"kernels.fp8_recipe={recipe}: none of the model's {len(linears)} linears has both widths a "
                          f"multiple of 16, which torchao's FP8 products need (model.hidden_size, intermediate_size "
                          f"and the head widths); nothing would run in FP8")
    convert_to_float8_training(model, config=float8_config(recipe, pow2=pow2, grad_format=grad_format,
                                                           emulate=emulate),
                               module_filter_fn=lambda module, fqn: id(module) in chosen)
    return {"linear": len(chosen), "kept": len(linears) - len(chosen), "emulated": emulate}


def torchao_summary(model: nn.Module) -> str | None:
    """The start line's words for the torchao linears of ``model`` (None: there are none)."""
    found = [m for m in model.modules() if type(m).__name__ == "Float8Linear"
             and type(m).__module__.startswith("torchao.")]
    if not found:
        return None
    config = found[0].config
    recipe = "rowwise" if "axiswise" in str(config.cast_config_input.scaling_granularity).lower() else "tensorwise"
    kept = sum(type(m) is nn.Linear and m is not getattr(model, "lm_head", None) for m in model.modules())
    how = ("torchao's emulation (no FP8 matrix units here: dequantized products)" if config.emulate
           else "torch._scaled_mm (cuBLAS)")
    return (f"fp8 ({recipe}, torchao Float8Linear): {len(found)} linears -> {how}"
            + (f"; {kept} linears kept their precision (a width not a multiple of 16)" if kept else ""))
