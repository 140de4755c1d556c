"""``kernels.fp8_products: faster``: FP8 only for the products where it measured faster.

Under every FP8 recipe: molds' block-wise one, and torchao's row-wise / tensor-wise ones
(``kernels.fp8_recipe``; their linears through ``Float8Linear``, the experts with
``kernels.fp8_experts`` through the row-wise grouped GEMM), each product timed as the
recipe converts it.

Why it exists: whether FP8 pays depends on the product's shape and on the card, not on a
flag. Quantizing both operands costs a pass over each of them at every product, so a
narrow product loses more to the quantization than its FP8 GEMM gains; on the first H200
measured (``benchmarks/results/2026-11-27-h200-*``) every product of the model
``recipes/moe_fp8.json`` then held (hidden 1024) ran at 0.13-0.24x its BF16 speed in FP8.
So at start each distinct product of the model (a linear's ``in -> out``, an expert set's
``experts x hidden -> width``) is timed, forward and backward, at a micro-batch's tokens,
as the converted module and as the plain one in the run's precision; the ranks average
their times, and only the products that FP8 ran faster are converted
(``convert_to_fp8(only=...)``). The start line and the lineage give every product's ratio
and choice. A resume keeps the choice of the run it continues (a flipped product would
change the losses it reproduces), as ``trainer.precision=auto`` keeps its dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..models.moe import Experts
from ..recipe.precision import micro_batch_tokens
from ..runtime.distributed import all_reduce_sum
from .fp8_linear import Fp8GroupedMM, Fp8Linear
from .fp8_torchao import RowwiseGroupedMM, convert_to_float8_torchao, convertible, grouped_fp8_units


def product_key(module: nn.Module) -> tuple | None:
    """What a product is measured by: ``("linear", in, out)`` or ``("experts", local experts,
    hidden, width)``; None for a module that is no product ``convert_to_fp8`` swaps."""
    if type(module) is nn.Linear:
        return ("linear", module.in_features, module.out_features)
    if isinstance(module, Experts):
        return ("experts", module.num_local, module.hidden, module.width)
    return None


def model_products(model: nn.Module, lm_head: bool = False, recipe: str = "blockwise",
                   experts: bool = True) -> list[tuple]:
    """The distinct products of ``model`` that ``kernels.fp8`` would convert, in order: under
    torchao's recipes (``recipe`` rowwise / tensorwise) the linears whose widths torchao
    takes, and the expert sets only with ``experts`` (``kernels.fp8_experts``)."""
    head = getattr(model, "lm_head", None)
    keys = []
    for module in model.modules():
        key = product_key(module)
        if key is None or (module is head and not lm_head) or key in keys:
            continue
        if recipe != "blockwise" and (module is head or (key[0] == "linear" and not convertible(module))
                                      or (key[0] == "experts" and not experts)):
            continue
        keys.append(key)
    return keys


def _pass(module: nn.Module, inputs: tuple) -> Callable[[], None]:
    """One forward and backward of ``module`` on ``inputs`` (a fixed gradient of ones)."""

    def run():
        module.zero_grad(set_to_none=True)
        out = module(*inputs)
        out.backward(torch.ones_like(out))

    return run


def time_product(key: tuple, tokens: int, device: torch.device, dtype: torch.dtype | None, fp8: bool,
                 options: dict, seconds: float = 0.02) -> float:
    """Seconds of one forward + backward of the product ``key`` at ``tokens`` rows (an
    expert set: ``tokens`` token-expert pairs spread evenly over its experts), FP8 or plain, in ``dtype``
    (None: float32); the best of three rounds, each at least two calls after two warm-up
    calls (a busy machine only ever slows a round down)."""
    recipe = options.get("recipe", "blockwise")  # torchao's rowwise / tensorwise, or molds' own
    options = {k: v for k, v in options.items() if k != "recipe"}
    gen = torch.Generator(device="cpu").manual_seed(0)
    dt = dtype or torch.float32
    if key[0] == "linear":
        _, n_in, n_out = key
        module = nn.Linear(n_in, n_out, bias=False)
        if fp8 and recipe == "blockwise":
            module.__class__ = Fp8Linear
            module.fp8_options = options
        x = torch.randn(tokens, n_in, generator=gen)
        inputs = (x.to(device=device, dtype=dt).requires_grad_(),)
    else:
        _, local, hidden, width = key
        module = Experts(hidden, width, local)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        if fp8 and recipe == "blockwise":
            module.grouped_mm = Fp8GroupedMM(**options)
        elif fp8:
            module.grouped_mm = RowwiseGroupedMM(hardware=grouped_fp8_units(device))
        per = max(1, tokens // local)
        x = torch.randn(per * local, hidden, generator=gen)
        counts = torch.full((local,), per, dtype=torch.int64)
        inputs = (x.to(device=device, dtype=dt).requires_grad_(), counts.to(device))
    module.to(device=device, dtype=dt)
    if fp8 and recipe != "blockwise" and key[0] == "linear":  # torchao's Float8Linear in its place
        module = nn.Sequential(module)
        convert_to_float8_torchao(module, recipe=recipe, device=device, **options)
    run = _pass(module, inputs)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(3):
        for _ in range(2):
            run()
        sync()
        calls, start = 0, time.perf_counter()
        while calls < 2 or (time.perf_counter() - start < seconds and calls < 200):
            run()
            calls += 1
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


@dataclass(frozen=True)
class Fp8Choice:
    """Which products run in FP8, and the times they were chosen by."""

    products: list = field(default_factory=list)  # [{"key": [...], "fp8_s": .., "base_s": .., "fp8": bool}]
    tokens: int = 0
    precision: str = "float32"
    kept: bool = False  # a resume: the choice of the run it continues, not a new measurement

    def chosen(self) -> set[tuple]:
        return {tuple(p["key"]) for p in self.products if p["fp8"]}

    def takes(self, module: nn.Module) -> bool:
        """Whether ``convert_to_fp8`` converts ``module``."""
        return product_key(module) in self.chosen()

    def as_dict(self) -> dict:
        """What the lineage records (``Fp8Choice(**d)`` reads it back)."""
        return {"products": self.products, "tokens": self.tokens, "precision": self.precision, "kept": self.kept}

    def describe(self) -> str:
        def name(key):
            return f"linear {key[1]}->{key[2]}" if key[0] == "linear" else f"experts {key[1]}x{key[2]}->{key[3]}"

        parts = []
        for p in self.products:
            ratio = p["base_s"] / p["fp8_s"] if p["fp8_s"] else float("nan")
            parts.append(f"{name(p['key'])} {ratio:.2f}x ({'fp8' if p['fp8'] else self.precision_name})")
        n = sum(p["fp8"] for p in self.products)
        line = (f"fp8 products (kernels.fp8_products=faster): {n} of {len(self.products)} in FP8, each product's "
                f"FP8 speed over {self.precision_name} at {self.tokens:,} tokens: " + ", ".join(parts))
        if self.kept:
            line += "; the choice of the checkpoint's run, which a resume keeps (fork to measure anew)"
        return line

    @property
    def precision_name(self) -> str:
        return "bf16" if self.precision == "bfloat16" else "fp32"


def choose_fp8_products(model: nn.Module, kernels, device, dtype: torch.dtype | None, tokens: int,
                        agree: Callable[[list[float]], list[float]] | None = None, resumed: dict | None = None,
                        measure: Callable = time_product) -> Fp8Choice | None:
    """The products of ``model`` that ``kernels.fp8`` converts under ``fp8_products=faster``
    (None under ``all``, or with FP8 off): measured here (``measure`` is the tests' stub),
    the times averaged over the ranks by ``agree`` (a sum over ranks divided by their
    number), unless ``resumed`` (the lineage's ``fp8_products`` of the run a resume
    continues) holds a choice, which is kept."""
    if not kernels.fp8 or kernels.fp8_products != "faster":
        return None
    precision = str(dtype or torch.float32).removeprefix("torch.")
    if isinstance(resumed, dict) and isinstance(resumed.get("products"), list):
        return Fp8Choice(products=resumed["products"], tokens=int(resumed.get("tokens", tokens)),
                         precision=resumed.get("precision", precision), kept=True)
    device = torch.device(device)
    options = {"pow2": kernels.fp8_pow2_scales, "grad_format": kernels.fp8_grad_format}
    if kernels.fp8_recipe != "blockwise":
        options["recipe"] = kernels.fp8_recipe
    keys = model_products(model, kernels.fp8_lm_head, kernels.fp8_recipe, kernels.fp8_experts)
    moe = getattr(getattr(model, "config", None), "moe", None)
    top_k = moe.top_k if moe is not None else 1  # an expert set multiplies each token top_k times
    times = []
    for key in keys:  # alternating, so that a slow spell does not fall on one side only
        rows = tokens * top_k if key[0] == "experts" else tokens
        times += [measure(key, rows, device, dtype, True, options), measure(key, rows, device, dtype, False, options)]
    if agree is not None:
        times = agree(times)
    products = [{"key": list(key), "fp8_s": times[2 * i], "base_s": times[2 * i + 1],
                 "fp8": times[2 * i] < times[2 * i + 1]} for i, key in enumerate(keys)]
    return Fp8Choice(products=products, tokens=tokens, precision=precision)


def choose_for_run(recipe, model: nn.Module, dist, dtype: torch.dtype | None, resumed: dict | None) -> Fp8Choice | None:
    """``choose_fp8_products`` for a run's ranks (``dist``: molds.runtime.distributed's): a
    micro-batch's tokens, the times averaged over the ranks so that every rank converts the
    same products."""
    def mean_over_ranks(values):
        return [v / dist.world_size for v in all_reduce_sum(values, dist)]

    return choose_fp8_products(model, recipe.kernels, dist.device, dtype, micro_batch_tokens(recipe), mean_over_ranks,
                               resumed)
