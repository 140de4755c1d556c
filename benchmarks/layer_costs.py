"""Layer-level costs of a model on one device, for ``benchmarks/gpu_check.py``: FP8 against
BF16 on a recipe's real layer shapes, and the per-stage F, B, I, W and F&B times that the
pipeline schedules are simulated with (``molds.engines.schedule.simulate``).

Both run the model's own modules (``molds.models``, the converters of ``molds.kernels``,
the pipeline's stage modules of ``molds.engines.stages``) on a real packed micro-batch of
the recipe's shape; timings are medians after an untimed call (``benchmarks/kernel_ops.py``).
"""

from __future__ import annotations

import statistics
import time


def one_batch(recipe, device) -> tuple[dict, int]:
    """A real packed micro-batch of the recipe's shape from the sample, and its real tokens."""
    import dataclasses

    from molds.data.loader import MoleculeLoader, batch_tensors

    loader = MoleculeLoader(dataclasses.replace(recipe.data, max_steps=None), rank=0, world_size=1)
    batch = next(iter(loader))
    return batch_tensors(batch, device), int(batch["stats"]["real_tokens"])


def real_shapes(recipe, tok, device, rounds: int, save, widths=None, hidden_widths=None) -> dict:
    """Two layers of the MoE recipe's model at full width, forward + backward under bf16
    autocast, with kernels off, triton, fp8 (blockwise; + triton; torchao's rowwise, with and
    without the experts' row-wise grouped GEMM, and tensorwise): tokens/s and the FP8 ratios;
    then every distinct product of the model, and the experts' grouped GEMM (block-wise and
    row-wise) at the recipe's expert width and ``widths``, and a square and an MLP-shaped
    linear at each of ``hidden_widths`` in both gradient formats, FP8 against BF16."""
    import copy
    import dataclasses

    import torch
    import torch.nn.functional as F

    from kernel_ops import compare, fwd_bwd, time_pass
    from molds.kernels import apply_kernels
    from molds.kernels.fp8_linear import fp8_grouped_mm, fp8_linear
    from molds.kernels.fp8_torchao import RowwiseGroupedMM, grouped_fp8_units
    from molds.models import build_model
    from molds.models.loss import build_loss

    batch, tokens = one_batch(recipe, device)
    out = {"model": {k: getattr(recipe.model, k) for k in ("hidden_size", "num_layers", "num_experts", "moe_top_k",
                                                          "moe_expert_size", "moe_shared_expert_size",
                                                          "intermediate_size")},
           "batch": list(batch["input_ids"].shape), "tokens": tokens, "variants": {}}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    variants = {"bf16": {"fp8": False, "triton": False}, "bf16_triton": {"fp8": False, "triton": True},
                "bf16_triton_molds": {"fp8": False, "triton": True, "fused_backend": "molds"},
                "fp8": {"fp8": True, "triton": False}, "fp8_triton": {"fp8": True, "triton": True},
                # every product in FP8 whatever the recipe's kernels.fp8_products: the ratio measured here is
                # what that choice is about
                "fp8_rowwise": {"fp8": True, "triton": False, "fp8_recipe": "rowwise", "fp8_grad_format": "e4m3"},
                "fp8_tensorwise": {"fp8": True, "triton": False, "fp8_recipe": "tensorwise"},
                "fp8_rowwise_experts": {"fp8": True, "triton": False, "fp8_recipe": "rowwise",
                                        "fp8_grad_format": "e4m3", "fp8_experts": True}}
    base = build_model(recipe.model, tok, seed=0, device=device)  # built once: each variant converts a copy
    for name, options in variants.items():
        model = copy.deepcopy(base)
        loss_fn = build_loss(recipe.model)
        apply_kernels(model, dataclasses.replace(recipe.kernels, **options, fp8_products="all"), loss_fn, device)

        def step(model=model, loss_fn=loss_fn):
            with autocast:
                loss = loss_fn(model(**batch), batch)
            loss.backward()

        t = statistics.median(time_pass(step, device, rounds))
        out["variants"][name] = {"s": t, "tokens_per_s": tokens / t}
        save(out)
        model = step = None  # the next variant's model in its place
    base = None
    v = out["variants"]
    out["fp8_over_bf16"] = v["fp8"]["tokens_per_s"] / v["bf16"]["tokens_per_s"]
    for name in variants:
        if name != "bf16":
            out[f"{name}_over_bf16"] = v[name]["tokens_per_s"] / v["bf16"]["tokens_per_s"]
    # every distinct product of the full model, FP8 against BF16 (forward + backward)
    m, rows = recipe.model, batch["input_ids"].numel()
    head_dim = m.hidden_size // m.num_heads
    kv = (m.num_kv_heads or m.num_heads) * head_dim
    shapes = {"q": (m.hidden_size, m.hidden_size), "kv": (m.hidden_size, kv), "o": (m.hidden_size, m.hidden_size),
              "mlp_up": (m.hidden_size, m.intermediate_size), "mlp_down": (m.intermediate_size, m.hidden_size)}
    if m.moe_shared_expert_size:
        shapes["shared_up"] = (m.hidden_size, m.moe_shared_expert_size)
        shapes["shared_down"] = (m.moe_shared_expert_size, m.hidden_size)
    products = {}
    fmt = recipe.kernels.fp8_grad_format
    other = "e5m2" if fmt == "e4m3" else "e4m3"

    def linear_ratio(k: int, n: int, grad_format: str) -> float:
        x = torch.randn(rows, k, device=device).to(torch.bfloat16)
        w = torch.randn(n, k, device=device) * 0.02
        r = {}
        compare("l", fwd_bwd(lambda x, w: fp8_linear(x, w, grad_format=grad_format), [x, w]),
                fwd_bwd(F.linear, [x, w]), device, rounds, r, "bf16")
        return r["l_speedup_over_bf16"]

    with autocast:
        # the recipe's products in its gradient format (e4m3: all three products through cuBLAS on Hopper)
        for name, (k, n) in shapes.items():
            products[f"linear_{name}_{rows}x{k}x{n}"] = linear_ratio(k, n, fmt)
        # the model's width against FP8's gain: a square product and an MLP's at each hidden
        # size, in both gradient formats, at the recipe's tokens
        for h in sorted({m.hidden_size, *(hidden_widths or ())}):
            for k, n in ((h, h), (h, h * 11 // 4 // 128 * 128)):
                for f in (fmt, other):
                    products[f"linear_{f}_{rows}x{k}x{n}"] = linear_ratio(k, n, f)
            save(out | {"fp8_over_bf16_products": products})
        for width in sorted({m.moe_expert_size, *(widths or ())}):
            experts, per = m.num_experts, max(16, rows * m.moe_top_k // m.num_experts // 16 * 16)
            offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * per
            xe = torch.randn(experts * per, m.hidden_size, device=device).to(torch.bfloat16)
            we = torch.randn(experts, m.hidden_size, width, device=device) * 0.02
            r = {}
            compare("e", fwd_bwd(lambda a, b: fp8_grouped_mm(a, b, offs=offs), [xe, we]),
                    fwd_bwd(lambda a, b: F.grouped_mm(a, b.to(torch.bfloat16), offs=offs), [xe, we]), device, rounds,
                    r, "bf16")
            products[f"experts_{experts}x{per}x{m.hidden_size}x{width}"] = r["e_speedup_over_bf16"]
            rowwise = RowwiseGroupedMM(hardware=grouped_fp8_units(device))  # kernels.fp8_experts
            compare("r", fwd_bwd(lambda a, b: rowwise(a, b, offs=offs), [xe, we]),
                    fwd_bwd(lambda a, b: F.grouped_mm(a, b.to(torch.bfloat16), offs=offs), [xe, we]), device, rounds,
                    r, "bf16")
            products[f"experts_rowwise_{experts}x{per}x{m.hidden_size}x{width}"] = r["r_speedup_over_bf16"]
            save(out | {"fp8_over_bf16_products": products})
    out["fp8_over_bf16_products"] = products
    return out


def layer_kinds(m) -> list[str]:
    """``dense`` or ``moe`` for each block of the recipe's model section ``m``."""
    from molds.models.moe import MoEConfig

    if not m.num_experts:
        return ["dense"] * m.num_layers
    cfg = MoEConfig(num_experts=m.num_experts, first_dense_layers=m.moe_first_dense_layers,
                    layer_interval=m.moe_layer_interval)
    return ["moe" if cfg.is_moe_layer(i) else "dense" for i in range(m.num_layers)]


def dualpipev_costs(recipe, tok, device, rounds: int, save, measure_layers: int | None = None) -> dict:
    """The model's per-layer F, B, I, W and F&B times on ``device``, summed per pipeline stage
    and simulated for each schedule at P = 2, 4, 8. ``measure_layers``: build and time only the
    first blocks, at least this many and at least two of each kind, and give each later block
    the median costs of the measured blocks of its kind (the blocks of a kind have the same
    shapes; a model of billions of parameters need not be built whole on one device)."""
    import dataclasses

    import torch

    from kernel_ops import time_pass
    from molds.engines.schedule import build, simulate
    from molds.engines.stages import BlockPipe, EmbedPipe, HeadPipe, NormPipe
    from molds.kernels import apply_kernels
    from molds.kernels.fp8_select import choose_fp8_products
    from molds.models import build_model
    from molds.models.loss import build_loss
    from molds.models.wgrad import WeightGradStore, defer_weight_grads

    batch, _ = one_batch(recipe, device)
    kinds = layer_kinds(recipe.model)
    keep = len(kinds)
    if measure_layers:
        keep = next((k for k in range(min(measure_layers, len(kinds)), len(kinds) + 1)
                     if all(kinds[:k].count(kind) >= min(2, kinds.count(kind)) for kind in set(kinds))), len(kinds))
    model = build_model(dataclasses.replace(recipe.model, num_layers=keep), tok, seed=0, device=device)
    loss_fn = build_loss(recipe.model)
    # the products the recipe runs in FP8 (kernels.fp8_products=faster: those measured faster here)
    choice = choose_fp8_products(model, recipe.kernels, device, torch.bfloat16, batch["input_ids"].numel())
    apply_kernels(model, recipe.kernels, loss_fn, device, choice)
    defer_weight_grads(model)
    body, cfg = model.model, model.config
    in_loss = getattr(model, "head_in_loss", False)
    layers = [EmbedPipe(body.embed_tokens.weight)]
    layers += [BlockPipe(b, cfg.head_dim, cfg.rope_theta, i) for i, b in enumerate(body.layers)]
    layers += [NormPipe(body.norm), HeadPipe(model.lm_head.weight, in_loss, getattr(model.lm_head, "linear",
                                                                                     torch.nn.functional.linear))]
    ids = (batch["position_ids"], batch["document_ids"])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    store = WeightGradStore()
    costs = []
    x = (batch["input_ids"],) + ids
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1

        def fwd(inputs=x, layer=layer, last=last):
            inp = tuple(t.detach().requires_grad_(t.is_floating_point()) if j == 0 else t
                        for j, t in enumerate(inputs))
            with autocast:
                y = layer(inp)
                if last:
                    y = loss_fn(y if isinstance(y, dict) else {"logits": y}, batch)
            return inp, y

        def out_of(y):
            return y if torch.is_tensor(y) else y[0]

        def bwd(y, defer):
            o = out_of(y)
            g = torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o)
            if defer:
                with store.deferring():
                    o.backward(g)
            else:
                o.backward(g)

        c = {"F": statistics.median(time_pass(lambda: fwd(), device, rounds))}
        c["B"] = _timed_after(lambda: fwd()[1], lambda y: bwd(y, False), device, rounds)
        c["I"] = _timed_after(lambda: fwd()[1], lambda y: bwd(y, True), device, rounds, after=store.flush)
        c["W"] = _timed_after(lambda: bwd(fwd()[1], True), lambda _: store.flush(), device, rounds)
        c["FB"] = _timed_after(lambda: fwd()[1], lambda y: (fwd(), bwd(y, False)), device, rounds)
        c["params"] = sum(p.numel() for p in layer.parameters())
        costs.append(c)
        for p in model.parameters():
            p.grad = None
        with torch.no_grad(), autocast:
            x = (x[0],) + ids if last else layer(x)
    measured = costs[1:1 + keep]
    for c in measured:
        c["measured"] = True
    for i in range(keep, len(kinds)):  # the blocks not built: the median of the measured ones of their kind
        same = [c for c, kind in zip(measured, kinds) if kind == kinds[i]]
        costs.insert(1 + i, {k: statistics.median(c[k] for c in same) for k in ("F", "B", "I", "W", "FB", "params")}
                     | {"measured": False})
    names = ["embed"] + [f"layer{i}" for i in range(len(kinds))] + ["norm", "head_loss"]
    out = {"micro_batch": list(batch["input_ids"].shape), "measured_layers": keep,
           "kernels": {"fp8": recipe.kernels.fp8, "triton": recipe.kernels.triton,
                       "fp8_products": choice.describe() if choice else recipe.kernels.fp8_products},
           "all_to_all": "none: one device (ep 1); the costs hold no expert-parallel exchange",
           "layers": dict(zip(names, costs)), "schedules": {}}
    from deepspeed.runtime.utils import partition_balanced

    keys = ("F", "B", "I", "W", "FB")

    def stages_of(count: int) -> list[dict]:
        """The model cut into ``count`` stages as DeepSpeed cuts it (balanced parameters)."""
        parts = partition_balanced([c["params"] for c in costs], count)
        return [{k: sum(c[k] for c in costs[parts[s]:parts[s + 1]]) for k in keys} for s in range(count)]

    for p in (2, 4, 8):
        micro = max(recipe.trainer.grad_accum, 2 * p)
        row = {"micro_batches": micro}
        for name in ("1f1b", "stock_dualpipev", "dualpipev"):
            lists, layout = build(name, p, micro)
            stages = stages_of(layout.stages)
            t = simulate(lists, layout, stage_costs=stages)
            row[name] = {"step_s": t.makespan, "bubble": t.bubble_fraction(), "stage_costs": stages}
        v = row["dualpipev"]["stage_costs"]
        row["v_stage_imbalance"] = max(s["F"] + s["B"] for s in v) / max(1e-12, statistics.mean(s["F"] + s["B"]
                                                                                                 for s in v))
        row["dualpipev_over_stock"] = row["dualpipev"]["step_s"] / row["stock_dualpipev"]["step_s"]
        row["dualpipev_over_1f1b"] = row["dualpipev"]["step_s"] / row["1f1b"]["step_s"]
        out["schedules"][f"p{p}"] = row
        save(out)
    return out


def _timed_after(setup, fn, device, rounds: int, after=None) -> float:
    """Median seconds of ``fn(setup())``, ``setup`` and ``after`` untimed."""
    from kernel_ops import _sync

    times = []
    for _ in range(rounds + 1):
        y = setup()
        _sync(device)
        start = time.perf_counter()
        fn(y)
        _sync(device)
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return statistics.median(times[1:])
