"""molds' MoE layer against DeepSpeed's ``deepspeed.moe.layer.MoE``, same experts, one process.

    python benchmarks/moe_layer.py [--tokens 4096] [--hidden 256] [--rounds 7] [--compile-regions]

Both dropless (DeepSpeed: ``drop_tokens=False``), the same SwiGLU experts (molds' weights
copied into DeepSpeed's expert modules), the same input; timed is forward + backward of
the MoE part alone (router with its load-balancing loss, dispatch, experts, combine;
no attention, no block norm; molds adds the residual, DeepSpeed does not), alternating molds and DeepSpeed every round so machine drift hits both, median
of ``--rounds`` (the ratio: median of the per-round ratios). Two shapes: 8 experts of width 512, top-2 (Mixtral-like) and 64
fine-grained experts of width 128, top-8 (DeepSeek-V3 / Qwen3-like). Prints one JSON
line: seconds per pass for each and ``molds_over_deepspeed_*`` (< 1: molds faster), molds
as ``recipes/moe_pipeline.json`` runs it (eager); ``--compile-regions`` adds ``*_compiled``
keys with the SwiGLU regions compiled, as the dense recipes ship them.

The process keeps freed host memory as ``molds/train.py`` sets it up
(``molds.runtime.allocator.retain_freed_memory``; both layers run under it, ``host_allocator`` in
the JSON line says which policy was in force); ``MOLDS_SYSTEM_ALLOCATOR=1`` times both
with the C library's defaults instead, where every large activation of the sorted batch
is mapped fresh and faulted in again each pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _deepspeed_moe(hidden, width, experts, k, molds_experts):
    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(hidden, width, bias=False)
            self.up = nn.Linear(hidden, width, bias=False)
            self.down = nn.Linear(width, hidden, bias=False)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    layer = MoE(hidden_size=hidden, expert=SwiGLU(), num_experts=experts, ep_size=1, k=k, capacity_factor=1.0,
                min_capacity=0, drop_tokens=False, use_rts=False)
    layer.set_deepspeed_parallelism()
    with torch.no_grad():
        for e, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            expert.gate.weight.copy_(molds_experts.gate[e].t())
            expert.up.weight.copy_(molds_experts.up[e].t())
            expert.down.weight.copy_(molds_experts.down[e].t())
    return layer


def _molds_moe(hidden, width, experts, k):
    import torch

    from molds.models.decoder import DecoderConfig
    from molds.models.moe import MoEConfig, MoEDecoderLayer

    cfg = DecoderConfig(vocab_size=8, hidden_size=hidden, num_layers=1, num_heads=4, num_kv_heads=4,
                        intermediate_size=width, moe=MoEConfig(num_experts=experts, top_k=k, expert_size=width,
                                                               aux_loss_coef=0.01))
    layer = MoEDecoderLayer(cfg, 0)
    from molds.models.decoder import init_part

    init_part(layer, 0.02, 0, "layer", 0)
    layer.post_attention_layernorm = torch.nn.Identity()  # the block's norm is not the MoE layer's
    return layer.train()


def run(tokens: int, hidden: int, experts: int, width: int, k: int, rounds: int, compiled: bool) -> dict:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    ours = _molds_moe(hidden, width, experts, k)
    theirs = _deepspeed_moe(hidden, width, experts, k, ours.mlp.experts).train().to(device)
    if compiled:  # kernels.compile_regions, as the dense recipes ship it: SwiGLU fused by inductor
        from molds.kernels.compile_regions import compile_regions

        compile_regions(ours)
    ours.to(device)
    x = torch.randn(tokens, hidden, device=device)
    g = torch.randn(tokens, hidden, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def molds_pass():
        h = x.clone().requires_grad_(True)
        st = ours.route(h)
        out = ours.aggregate(ours.combine(ours.run_experts(ours.dispatch(st))))
        out.backward(g)

    def deepspeed_pass():
        y = x.clone().requires_grad_(True)
        out, aux, _ = theirs(y[None])
        (out[0] * g).sum().backward(retain_graph=False)

    for fn in (molds_pass, deepspeed_pass):  # warm up (and compile)
        for _ in range(3):
            fn()
    times = {"molds": [], "deepspeed": []}
    for _ in range(rounds):
        for name, fn in (("molds", molds_pass), ("deepspeed", deepspeed_pass)):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(v) for name, v in times.items()}
    # the ratio of each round's pair (taken back to back), then the median: robust to drift
    paired = statistics.median(a / b for a, b in zip(times["molds"], times["deepspeed"]))
    return {"molds_s": med["molds"], "deepspeed_s": med["deepspeed"], "ratio": paired,
            "ratio_range": [min(a / b for a, b in zip(times["molds"], times["deepspeed"])),
                            max(a / b for a, b in zip(times["molds"], times["deepspeed"]))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compile-regions", action="store_true",
                    help="also time molds with kernels.compile_regions (SwiGLU fused by inductor), as *_compiled keys")
    args = ap.parse_args()
    from molds.runtime.allocator import retain_freed_memory

    allocator = retain_freed_memory()  # first, as molds/train.py does
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29621", RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    shapes = {"e8_top2": (8, 512, 2), "e64_top8": (64, 128, 8)}
    out = {"device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
           "host_allocator": allocator,
           "tokens": args.tokens, "hidden": args.hidden, "rounds": args.rounds}
    # as recipes/moe_pipeline.json ships it (kernels.compile_regions off), then compiled if asked
    for suffix, compiled in [("", False)] + ([("_compiled", True)] if args.compile_regions else []):
        for key, (experts, width, k) in shapes.items():
            r = run(args.tokens, args.hidden, experts, width, k, args.rounds, compiled)
            out[key + suffix] = r
            out[f"molds_over_deepspeed_{key}{suffix}"] = round(r["ratio"], 3)
    from molds.runtime.lifecycle import cpu_description

    out["cpu"] = cpu_description()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
