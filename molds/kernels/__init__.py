"""Kernel and precision converters, applied to a model after it is built.

A model file never imports Triton or knows about fused kernels: it keeps its
elementwise regions as module attributes (``RMSNorm.norm``, ``MLP.act``,
``Attention.rope``, ``MoEDecoderLayer.permute``) and its products as modules
(``nn.Linear``) or attributes (``Experts.grouped_mm``, ``Router.linear``), and a
converter here swaps them (torchtitan's Float8 converter is the pattern). The recipe's
``kernels`` section chooses the converters; ``apply_kernels`` is the one place they are
applied, in a fixed order:

1. ``kernels.fp8``: linears and experts' grouped GEMMs in block-scaled FP8
   (``fp8_linear``; the LM head and the router with ``fp8_lm_head`` / ``fp8_router``; with
   ``fp8_products=faster`` only the products FP8 measured faster on, ``fp8_select``), or,
   with ``fp8_recipe`` rowwise / tensorwise, the linears through torchao's ``Float8Linear``
   and, with ``fp8_experts``, the experts through torchao's row-wise grouped GEMM
   (``fp8_torchao``);
2. ``kernels.triton``: RMSNorm, SwiGLU, the MoE token permute / unpermute and the
   LM head with the loss (``rmsnorm``, ``swiglu``, ``moe_permute``, ``cross_entropy``), the
   first two and the last as Liger Kernel's on a GPU where ``kernels.fused_backend`` says
   (``liger``);
3. ``kernels.compile_regions``: the elementwise regions compiled by inductor.

Every op is a ``torch.library`` custom op with a fake implementation (torch.compile
traces through it) and a PyTorch path that runs where its kernel cannot
(``launch``); ``kernel_summary`` says, for the start line, which path each op takes on
the run's device and how many modules each converter swapped.

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``, ``data``, ``models``.
"""

from __future__ import annotations

import os

import torch

from ..errors import RecipeError
from ..models.decoder import MLP, CausalDecoder, RMSNorm
from ..models.moe import Experts, MoEDecoderLayer, Router, SharedExpert
from .compile_regions import compile_regions
from .cross_entropy import linear_cross_entropy
from .fp8_linear import convert_to_fp8
from .fp8_torchao import convert_to_float8_torchao, torchao_summary
from .launch import describe, fp8_matrix_units, runs_triton, triton_available
from .liger import liger_available, liger_linear_cross_entropy, liger_rms_norm, liger_swiglu
from .moe_permute import moe_permute, moe_unpermute
from .rmsnorm import fused_rms_norm
from .swiglu import fused_swiglu


def apply_kernels(model, kernels, loss=None, device="cpu", fp8_choice=None) -> object:
    """``model`` with the converters the recipe's ``kernels`` section asks for; ``loss``
    (the objective, ``molds.models.loss``) takes the fused LM head under ``kernels.triton``;
    ``device``: where the run trains (torchao emulates FP8 where it has no FP8 units);
    ``fp8_choice``: under ``kernels.fp8_products=faster``, the products FP8 measured faster
    on (``fp8_select.choose_fp8_products``, which the caller runs with its ranks)."""
    if kernels.fp8 and kernels.fp8_products == "faster" and fp8_choice is None:
        raise ValueError("kernels.fp8_products=faster: measure first (molds.kernels.fp8_select.choose_fp8_products) "
                         "and pass its choice as fp8_choice")
    if kernels.fp8 and kernels.fp8_recipe != "blockwise":
        convert_to_float8_torchao(model, recipe=kernels.fp8_recipe, pow2=kernels.fp8_pow2_scales,
                                  grad_format=kernels.fp8_grad_format, device=device,
                                  experts=kernels.fp8_experts, only=fp8_choice.takes if fp8_choice else None)
    elif kernels.fp8:
        convert_to_fp8(model, lm_head=kernels.fp8_lm_head, router=kernels.fp8_router, pow2=kernels.fp8_pow2_scales,
                       grad_format=kernels.fp8_grad_format, only=fp8_choice.takes if fp8_choice else None)
    if kernels.triton:
        require_triton(device)
        fuse_with_triton(model, loss, fused_backends(kernels.fused_backend, device))
    if kernels.compile_regions:
        compile_regions(model)
    return model


def require_triton(device) -> None:
    """One line naming the extra where ``kernels.triton`` needs Triton and it is not installed:
    on a CUDA GPU (it compiles the kernels there), and on a CPU under
    ``MOLDS_TRITON_INTERPRET=1`` (its interpreter runs them). A CPU run without either takes
    each op's PyTorch path, with or without Triton."""
    if triton_available():
        return
    if torch.device(device).type == "cuda":
        raise RecipeError("kernels.triton: molds' kernels compile with Triton on a GPU, and triton does not import "
                          "here: pip install 'molds[gpu]' (Triton and Liger Kernel), or kernels.triton false")
    if os.environ.get("MOLDS_TRITON_INTERPRET") == "1":
        raise RecipeError("MOLDS_TRITON_INTERPRET=1 runs molds' kernels in Triton's interpreter, and triton does not "
                          "import here: pip install 'molds[gpu]', or unset it (each op's PyTorch path)")


#: the ops of ``kernels.triton`` that Liger Kernel also has (``kernels.fused_backend``)
LIGER_OPS = ("rms_norm", "swiglu", "linear_cross_entropy")
BACKEND_NAMES = {"molds": "molds", "liger": "Liger Kernel"}


def fused_backends(setting: str, device) -> dict:
    """op -> ``molds`` or ``liger`` for ``kernels.fused_backend`` on ``device``: ``auto`` takes
    Liger Kernel's on a CUDA GPU where it imports (measured faster there: ``molds.kernels.liger``)."""
    if setting == "molds":
        return dict.fromkeys(LIGER_OPS, "molds")
    gpu = torch.device(device).type == "cuda"
    if setting == "liger":
        if not gpu:
            raise RecipeError("kernels.fused_backend=liger: Liger Kernel runs on CUDA GPUs and this run is on the "
                              f"{torch.device(device).type}; use auto (molds' kernels here) or molds")
        if not liger_available():
            raise RecipeError("kernels.fused_backend=liger: Liger Kernel does not import here (pip install "
                              "'molds[gpu]'); auto falls back to molds' kernels")
        return dict.fromkeys(LIGER_OPS, "liger")
    if setting != "auto":
        raise ValueError(f"kernels.fused_backend {setting!r}: auto, molds or liger")
    return dict.fromkeys(LIGER_OPS, "liger" if gpu and liger_available() else "molds")


def fuse_with_triton(model, loss=None, backends: dict | None = None) -> None:
    """Swap the regions ``kernels.triton`` covers for the custom ops (in place); ``backends``
    (``fused_backends``) says whose kernel each of ``LIGER_OPS`` is (default: molds')."""
    backends = backends or dict.fromkeys(LIGER_OPS, "molds")
    norm = liger_rms_norm if backends["rms_norm"] == "liger" else fused_rms_norm
    act = liger_swiglu if backends["swiglu"] == "liger" else fused_swiglu
    head_loss = liger_linear_cross_entropy if backends["linear_cross_entropy"] == "liger" else linear_cross_entropy
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.norm = norm
        elif isinstance(module, (MLP, Experts, SharedExpert)):
            module.act = act
        elif isinstance(module, MoEDecoderLayer):
            module.permute, module.unpermute = moe_permute, moe_unpermute
    model.fused_backends = dict(backends)  # what the start line names
    if isinstance(model, CausalDecoder) and loss is not None and hasattr(loss, "linear_cross_entropy"):
        model.head_in_loss = True  # the forward hands the loss its hidden states and the head's weight
        loss.linear_cross_entropy = head_loss


def kernel_summary(model, device) -> str:
    """Which converters swapped how many modules, and where each op runs on ``device``."""
    parts = []
    modules = list(model.modules())
    fp8 = [m for m in modules if type(m).__name__ == "Fp8Linear"]
    fp8_experts = [m for m in modules if isinstance(m, Experts) and getattr(m.grouped_mm, "any_shape", False)]
    fp8_router = [m for m in modules if isinstance(m, Router)
                  and getattr(getattr(m.linear, "func", None), "__name__", "") == "fp8_linear"]
    torchao = torchao_summary(model)
    if torchao:
        parts.append(torchao)
    if fp8 or fp8_experts:
        head = getattr(model, "lm_head", None)
        parts.append(f"fp8: {len(fp8)} linears{' (LM head included)' if any(m is head for m in fp8) else ''}, "
                     f"{len(fp8_experts)} expert GEMM sets, {len(fp8_router)} routers -> {fp8_gemm_path(device)}")
    fused = {"rms_norm": sum(isinstance(m, RMSNorm) and getattr(m.norm, "__name__", "") in ("fused_rms_norm",
                                                                                           "liger_rms_norm")
                             for m in modules),
             "swiglu": sum(isinstance(m, (MLP, Experts, SharedExpert))
                           and getattr(m.act, "__name__", "") in ("fused_swiglu", "liger_swiglu") for m in modules),
             "moe_permute": sum(isinstance(m, MoEDecoderLayer) and getattr(m.permute, "__name__", "") == "moe_permute"
                                for m in modules),
             "linear_cross_entropy": int(bool(getattr(model, "head_in_loss", False)))}
    if any(fused.values()):
        backends = getattr(model, "fused_backends", {})
        ops = ", ".join(f"{name} x{n}" + (f" ({BACKEND_NAMES[backends[name]]})" if backends.get(name, "molds")
                                          != "molds" else "") for name, n in fused.items() if n)
        parts.append(f"triton: {ops} -> {describe(torch.device(device))}")
    return "; ".join(parts)


def fp8_gemm_path(device) -> str:
    """Where the FP8 products run on ``device``, in words."""
    device = torch.device(device)
    if device.type == "cuda":
        if not fp8_matrix_units(device.index or 0):
            return "PyTorch emulation (this GPU has no FP8 matrix units: dequantized float32 products)"
        hopper = torch.cuda.get_device_capability(device) == (9, 0)
        return ("torch scaled_mm (cuBLAS) for the linears' products, Triton block-scaled GEMMs for the experts' and "
                "for any cuBLAS refuses" if hopper
                else "Triton block-scaled GEMMs")
    if runs_triton(torch.empty(0)):
        return "Triton interpreter (MOLDS_TRITON_INTERPRET=1)"
    return "CPU: block-scaled quantization in PyTorch, products emulated in float32"
