"""What a recipe needs at full size: parameters, FLOPs, days per pass over a corpus, and
memory per GPU, from the model molds builds and one layer of each kind run on this CPU.
Decoder recipes, dense or MoE, on the ddp engine, ZeRO 1-3 or the pipeline; anything else
is refused with one line.

    python benchmarks/recipe_size.py --recipe recipes/moe_fp8.json --manifest DIR \\
        --molecules 4.2e9 --gpu-memory-gb 80 --peak-tflops 989.4 --mfu 0.35 [--section.key value ...]

Anything after the known options is a recipe override, as on ``molds/train.py``'s command line.
The world size is the recipe's smallest (``run.min_gpus``, else the product of its parallel
sizes); ``--gpus`` changes it (the data-parallel size follows). Prints one JSON line.

- **Parameters**: the model built on the meta device (``molds.models.build_model``): total,
  active per token (what ``flops_coefficients`` counts: an MoE layer's router, shared
  expert and top-k routed experts), and per pipeline rank as DeepSpeed cuts it (``partition_balanced`` over each
  layer's parameters, ``partition_method: parameters``; DualPipeV's 2P stages, rank r holding
  stages r and 2P-1-r), with each rank's experts (1 / ep of them).
- **The corpus**: real tokens and squared molecule lengths per molecule, and how full a
  packed micro-batch is, from real micro-batches of the manifest (``--tokens-per-molecule``
  scales them to a corpus of longer or shorter molecules); one pass's training FLOPs with
  the same count the training loop's MFU uses; optimizer steps per pass; days per pass at
  ``--mfu`` of the GPUs' ``--peak-tflops``.
- **Memory per GPU**, for the fullest rank:
  - model states as DeepSpeed keeps them at the recipe's ZeRO stage with bf16 parameters
    (``STATE_BYTES``: DeepSpeed's own estimates for ZeRO-2 and -3), the partitioned part
    divided over the ranks that share a parameter (the data-parallel size for dense
    parameters, data-parallel / expert-parallel for experts);
  - activations: what each layer keeps for its backward, measured here on one real packed
    micro-batch of the recipe's shape, layer by layer through the pipeline's own stage
    modules (``molds.engines.stages``) with bf16 parameters and attention in bf16 as on a GPU,
    and the recipe's fused and compiled regions as they run on a CPU: the storages autograd
    saves (the block's weights and input left out); times the most micro-batches the
    schedule holds at once on one
    rank (``molds.engines.schedule.held_activations``), plus each held micro-batch's stage
    input and output (the pipeline's buffers). Expert parallelism moves tokens between
    ranks but, with balanced routing, each rank's experts see as many tokens as here. An
    upper bound where a deferred weight gradient (DualPipeV's W) keeps less than the whole
    layer.
  Not counted: the CUDA context and library workspaces (about 1-3 GB), allocator
  fragmentation, FP8 or fused kernels' own buffers, an evaluation's sampling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: bytes a parameter costs in model states: (held whole by each rank that has it, divided
#: over the ranks that share it), with bf16 parameters and Adam in fp32, as DeepSpeed keeps
#: them. ZeRO-2 and -3 are DeepSpeed's own estimates (``estimate_zero2_model_states_mem_needs``,
#: ``estimate_zero3_...``: 18 = a 16-bit gradient, an fp32 gradient, an fp32 master, two
#: moments); ZeRO-1 keeps the 16-bit gradient whole; the pipeline at stage 0 runs DeepSpeed's
#: BF16_Optimizer (a whole fp32 gradient buffer, the master and moments partitioned); the
#: ddp engine keeps fp32 parameters, gradients and both moments on every rank.
STATE_BYTES = {"ddp": (16, 0), "pipeline0": (6, 12), 1: (4, 16), 2: (2, 18), 3: (0, 18)}


def model_states_bytes(dense: float, experts: float, kind, dp: int, ep: int = 1, largest_layer: float = 0) -> float:
    """Bytes of model states on a rank holding ``dense`` shared parameters (replicated over
    ``dp`` ranks) and ``experts`` expert parameters of its own (replicated over dp / ep);
    ``kind``: a key of ``STATE_BYTES``. ZeRO-3 also gathers its largest layer's 16-bit
    parameters and gradients (DeepSpeed's estimate)."""
    whole, shared = STATE_BYTES[kind]
    gathered = 4 * largest_layer if kind == 3 else 0
    return whole * (dense + experts) + shared * dense / dp + shared * experts / max(1, dp // ep) + gathered


def saved_bytes(layer, inputs, params) -> tuple[int, tuple]:
    """Bytes ``layer`` keeps for its backward when run on ``inputs`` (the stage tuple, its
    hidden states requiring grad), and its output: the storages autograd saves (compiled
    regions' too), the inputs' and ``params``' own left out."""
    import torch
    from kernel_ops import saved_tensor_bytes
    from torch.utils._pytree import tree_flatten

    given = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    return saved_tensor_bytes(lambda: layer(inputs), given + list(params))


@contextlib.contextmanager
def gpu_attention():
    """Attention in its input's dtype on a CPU too (molds runs it in fp32 there; a GPU keeps
    bf16), so that what it saves is what a GPU saves."""
    import torch.nn.functional as F

    from molds.models import decoder

    def attention(q, k, v, is_causal=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)

    eager, decoder.causal_attention = decoder.causal_attention, attention
    try:
        yield
    finally:
        decoder.causal_attention = eager


def layer_bytes(recipe, tok, batch) -> dict:
    """Saved bytes per micro-batch of the embedding, a dense block, an MoE block (when the
    model has them) and the norm + head + loss, measured at full width on this CPU."""
    import dataclasses

    import torch
    from layer_costs import layer_kinds

    from molds.engines.stages import BlockPipe, EmbedPipe, HeadPipe, NormPipe
    from molds.kernels import apply_kernels
    from molds.models import build_model
    from molds.models.loss import build_loss

    m = recipe.model
    present = set(layer_kinds(m))
    kinds = [k for k in ("dense", "moe") if k in present]  # one block of each kind, dense first
    small = dataclasses.replace(m, num_layers=len(kinds), moe_layer_interval=1,
                                moe_first_dense_layers=int("dense" in present and "moe" in present))
    model = build_model(small, tok, seed=0).to(torch.bfloat16)
    loss_fn = build_loss(recipe.model)
    # the recipe's fused and compiled regions as they run here (they change what is saved);
    # FP8's own buffers are not counted
    apply_kernels(model, dataclasses.replace(recipe.kernels, fp8=False), loss_fn, "cpu")
    in_loss = getattr(model, "head_in_loss", False)
    body, cfg = model.model, model.config
    ids = (batch["position_ids"], batch["document_ids"])
    out = {}
    with torch.no_grad():
        x = EmbedPipe(body.embed_tokens.weight)((batch["input_ids"],) + ids)
    out["embed"] = 0  # the embedding keeps its ids only
    out["stage_input"] = x[0].numel() * x[0].element_size()
    params = list(model.parameters())

    def measured(layer, x):
        inputs = (x.detach().requires_grad_(True),) + ids
        with gpu_attention():
            layer(inputs)  # once first: compiled regions compile, caches fill
            return saved_bytes(layer, inputs, params)

    for kind, block in zip(kinds, body.layers):
        out[kind], y = measured(BlockPipe(block, cfg.head_dim, cfg.rope_theta, 0), x[0])
        x = tuple(t.detach() for t in y)
        del y

    def head(inputs):
        y = HeadPipe(model.lm_head.weight, in_loss)(NormPipe(body.norm)(inputs))
        return loss_fn(y if isinstance(y, dict) else {"logits": y}, batch).reshape(1)

    out["head_loss"], _ = measured(head, x[0])
    return out


def sample_batches(recipe, count: int) -> tuple[dict, dict]:
    """One real micro-batch of the recipe's shape, and the means over ``count`` of them."""
    import dataclasses

    from molds.data.loader import MoleculeLoader, batch_tensors

    loader = MoleculeLoader(dataclasses.replace(recipe.data, max_steps=None), rank=0, world_size=1)
    first, real, mol, sq, slots, seen = None, 0, 0, 0, 0, 0
    for batch in loader:
        if first is None:
            first = batch_tensors(batch, "cpu")
        s = batch["stats"]
        real, mol, sq, slots, seen = (real + s["real_tokens"], mol + s["molecules"], sq + s["length_sq_sum"],
                                      slots + s["tokens"], seen + 1)
        if seen >= count:
            break
    return first, {"batches": seen, "tokens_per_molecule": real / mol, "length_sq_per_molecule": sq / mol,
                   "fill": real / slots, "molecules_per_micro_batch": mol / seen}


def stage_parameters(model, ep: int) -> list[tuple[str, int, int]]:
    """(name, dense parameters, this rank's expert parameters) of each pipeline layer, in
    the order DeepSpeed's PipelineModule gets them and counts them to cut the stages (a
    tied head counts the embedding it shares)."""
    layers = [("embed", model.model.embed_tokens.weight.numel(), 0)]
    for i, block in enumerate(model.model.layers):
        experts = sum(p.numel() for n, p in block.named_parameters() if ".experts." in f".{n}")
        dense = sum(p.numel() for p in block.parameters()) - experts
        layers.append((f"layer{i}", dense, experts // ep))
    layers.append(("norm", model.model.norm.weight.numel(), 0))
    layers.append(("head", model.lm_head.weight.numel(), 0))
    return layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--manifest", default=None, help="data.manifest (a preprocessed sample of the corpus)")
    ap.add_argument("--molecules", type=float, required=True, help="molecules in the corpus (one pass)")
    ap.add_argument("--tokens-per-molecule", type=float, default=None,
                    help="the corpus's mean real tokens per molecule (default: the manifest's, measured)")
    ap.add_argument("--gpus", type=int, default=None, help="world size (default: the recipe's run.min_gpus)")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU (GB, 1e9 bytes)")
    ap.add_argument("--peak-tflops", type=float, default=989.4,
                    help="one GPU's dense BF16 rate (default: an H100 SXM's data sheet)")
    ap.add_argument("--mfu", type=float, default=0.35, help="model FLOP utilization the days are computed at")
    ap.add_argument("--batches", type=int, default=8, help="real micro-batches the corpus figures are averaged over")
    args, overrides = ap.parse_known_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    started = time.perf_counter()

    import torch
    from deepspeed.runtime.utils import partition_balanced
    from layer_costs import layer_kinds

    from molds.chemistry.tokens import tokenizer_info
    from molds.data.manifest import Manifest
    from molds.engines.schedule import build, held_activations
    from molds.models import build_model
    from molds.recipe.parse import parse_recipe
    from molds.runtime.lifecycle import cpu_description

    recipe = parse_recipe(["--recipe", args.recipe, *(["--data.manifest", args.manifest] if args.manifest else []),
                           *overrides])
    p, m = recipe.parallel, recipe.model
    if m.family != "decoder":
        print(f"recipe_size: model.family={m.family} is not sized here (decoders, dense and MoE, are)", file=sys.stderr)
        return 2
    pipeline = p.engine == "pipeline"
    pp = p.pp_size if pipeline else 1
    ep = p.ep_size if m.num_experts else 1
    world = args.gpus or recipe.run.min_gpus or pp * ep
    if world % pp or (world // pp) % ep:
        print(f"recipe_size: {world} GPUs cannot hold pp {pp} x a data-parallel size divisible by ep {ep}",
              file=sys.stderr)
        return 2
    dp = world // pp
    zero = p.zero_stage if p.engine != "ddp" else 0
    kind = "ddp" if p.engine == "ddp" else "pipeline0" if pipeline and zero == 0 else zero
    if kind not in STATE_BYTES or p.offload_optimizer or p.offload_params:
        offload = " with CPU offload" if p.offload_optimizer or p.offload_params else ""
        print(f"recipe_size: parallel.engine={p.engine} at ZeRO stage {zero}{offload} is not sized here (the ddp "
              f"engine, ZeRO 1-3 on the GPU and the pipeline at stages 0-1 are)", file=sys.stderr)
        return 2
    accum = recipe.trainer.grad_accum or 1
    tok = tokenizer_info(Manifest.load(recipe.data.manifest))
    model = build_model(m, tok, seed=0, device="meta")
    coefficients = model.flops_coefficients()  # a decoder's: per real token, per squared molecule length
    a, b = coefficients["real_tokens"], coefficients["length_sq_sum"]
    total = sum(t.numel() for t in model.parameters())

    # the corpus, from real micro-batches
    batch, corpus = sample_batches(recipe, args.batches)
    scale = (args.tokens_per_molecule / corpus["tokens_per_molecule"]) if args.tokens_per_molecule else 1.0
    per_mol = corpus["tokens_per_molecule"] * scale
    sq_per_mol = corpus["length_sq_per_molecule"] * scale ** 2
    tokens = args.molecules * per_mol
    flops = args.molecules * (a * per_mol + b * sq_per_mol)
    slots_per_step = recipe.data.micro_batch_size * recipe.data.seq_len * accum * dp
    tokens_per_step = slots_per_step * corpus["fill"]
    steps = math.ceil(tokens / tokens_per_step)
    seconds = flops / (world * args.peak_tflops * 1e12 * args.mfu)

    # memory: model states of the fullest rank, activations held by its schedule
    layers = stage_parameters(model, ep)
    v = pipeline and p.schedule == "dualpipev"
    stages = 2 * pp if v else pp
    parts = partition_balanced([d + e for _, d, e in layers], stages)
    stage_layers = [layers[parts[s]:parts[s + 1]] for s in range(stages)]
    measured = layer_bytes(recipe, tok, batch)

    kinds = layer_kinds(m)

    def act(name: str) -> int:
        if name.startswith("layer"):
            return measured[kinds[int(name[5:])]]
        return measured["head_loss"] if name == "head" else 0  # embed keeps ids; norm's in head_loss

    # a pipeline stage also keeps its input and its output (DeepSpeed's buffers) per micro-batch
    boundary = 2 * measured["stage_input"] if pipeline else 0
    stage_act = [sum(act(n) for n, _, _ in sl) + boundary for sl in stage_layers]
    schedule = p.schedule if pipeline else "none"
    # every rank's action list (a whole model's forward, one micro-batch at a time, off the pipeline)
    lists = build("dualpipev" if v else "1f1b", pp, max(accum, 2 * pp if v else 1))[0] if pipeline else None
    largest = max(d + e for _, d, e in layers)
    ranks = []
    for r in range(pp):
        own = [r, 2 * pp - 1 - r] if v else [r]
        names = [n for s in own for n, _, _ in stage_layers[s]]
        dense = sum(d for s in own for _, d, _ in stage_layers[s])
        if model.config.tie_word_embeddings and "embed" in names and "head" in names:
            dense -= layers[0][1]  # DeepSpeed builds a tied weight once per rank
        experts = sum(e for s in own for _, _, e in stage_layers[s])
        held = held_activations(lists[r]) if lists else 1
        states = model_states_bytes(dense, experts, kind, dp, ep, largest_layer=largest)
        activations = held * max(stage_act[s] for s in own)
        ranks.append({"stages": own, "dense_parameters": dense, "expert_parameters": experts,
                      "held_micro_batches": held, "model_states_gb": states / 1e9,
                      "activations_gb": activations / 1e9, "total_gb": (states + activations) / 1e9})
    fullest = max(ranks, key=lambda x: x["total_gb"])
    out = {
        "script": "benchmarks/recipe_size.py", "recipe": os.path.relpath(args.recipe),
        "overrides": overrides, "manifest": recipe.data.manifest,
        "machine": cpu_description(), "torch": torch.__version__,  # where the activations were measured
        "model": {"parameters": total, "active_parameters_per_token": a / 6.0,
                  "flops_per_token": a, "flops_per_squared_length": b,
                  **{k: getattr(m, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                "intermediate_size", "num_experts", "moe_top_k", "moe_expert_size",
                                                "moe_shared_expert_size")}},
        "topology": {"gpus": world, "pp": pp, "dp": dp, "ep": ep, "zero_stage": zero, "model_states": str(kind),
                     "schedule": schedule,
                     "grad_accum": accum, "stages": stages},
        "corpus": {"molecules": args.molecules, **corpus, "tokens_per_molecule_used": per_mol,
                   "tokens": tokens, "training_flops": flops},
        "step": {"token_slots": slots_per_step, "real_tokens": tokens_per_step,
                 "molecules": tokens_per_step / per_mol, "steps_per_pass": steps},
        "time": {"peak_tflops_per_gpu": args.peak_tflops, "mfu": args.mfu, "days_per_pass": seconds / 86400,
                 "seconds_per_step": seconds / steps},
        "activations_measured_bytes": measured,
        "memory": {"gpu_gb": args.gpu_memory_gb, "ranks": ranks, "fullest_rank_gb": fullest["total_gb"],
                   "fits": fullest["total_gb"] <= args.gpu_memory_gb,
                   "headroom_gb": args.gpu_memory_gb - fullest["total_gb"]},
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
