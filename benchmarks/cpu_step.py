"""One rank's training step of a recipe on a CPU: fp32 against bf16, and molds' host
allocator policy against the C library's defaults, side by side in one run.

    python benchmarks/cpu_step.py [--recipe recipes/cpu_moses.json] [--manifest DIR] [--steps 8] [--rounds 2]
                                  [--variants fp32,bf16] [--profile-steps 4]

Each variant runs in its own process (the allocator policy is per process) with one
thread, as each of ``torchrun --nproc_per_node 2``'s ranks does: the recipe's model and
ddp engine on one process, the recipe's micro-batches from its manifest, ``--steps``
timed steps after 4 untimed ones (compilation of ``kernels.compile_regions`` included
there). Variants:
  fp32         trainer.precision fp32
  bf16         trainer.precision bf16 (attention kept in float32, molds' default on CPU)
  bf16_system  bf16 with MOLDS_SYSTEM_ALLOCATOR=1 (the C library's allocator defaults)
  bf16_attn16  bf16 with attention left to CPU autocast (torch's bf16 flash attention)
  bf16_exact_rows  bf16 without the filler rows that make the GEMM shapes repeat
               (``CausalDecoder._row_multiple``): every step a new oneDNN kernel
The variants alternate for ``--rounds`` rounds; the figure per variant is the median of
its rounds, and each reports its resident memory at the end. One JSON line: seconds per
step and the ratios of each variant over bf16 (> 1: molds' choice is faster); per variant
the model FLOPs a step does (as ``train/mfu`` counts them) at the rate it ran, over the
matrix rate measured for its precision at the model's shape (``mfu``: the CPU's MFU); with
``--profile-steps`` where a step's time goes (GEMMs, attention, loss, optimizer, other
operators, outside operators: Python and the loader; ``molds.metrics.step_profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

VARIANTS = {  # name: (environment, recipe overrides, what molds' CPU bf16 path leaves out)
    "fp32": ({}, ["--trainer.precision", "fp32"], None),
    "bf16": ({}, ["--trainer.precision", "bf16"], None),
    "bf16_system": ({"MOLDS_SYSTEM_ALLOCATOR": "1"}, ["--trainer.precision", "bf16"], None),
    "bf16_attn16": ({}, ["--trainer.precision", "bf16"], "attn16"),
    "bf16_exact_rows": ({}, ["--trainer.precision", "bf16"], "exact_rows"),
}


def one(argv: list[str], steps: int, leave_out: str | None, profile_steps: int = 0) -> dict:
    """Seconds per step of one rank (runs inside the variant's process); with
    ``profile_steps``, where those steps' time goes, the model FLOP/s they achieved and
    that over the matrix rate measured for the run's precision (the CPU's MFU)."""
    import time

    import torch

    from molds.runtime.allocator import retain_freed_memory

    torch.set_num_threads(1)
    retain_freed_memory()  # as molds/train.py does first
    from molds.chemistry.tokens import tokenizer_info
    from molds.data.loader import MoleculeLoader
    from molds.data.manifest import Manifest
    from molds.engines.ddp import DDPEngine
    from molds.kernels import apply_kernels
    from molds.models import build_model
    from molds.models.loss import build_loss
    from molds.recipe.parse import parse_recipe
    from molds.recipe.plan import plan_for
    from molds.runtime.distributed import init_distributed

    if leave_out == "exact_rows":
        from molds.models.decoder import CausalDecoder

        CausalDecoder._row_multiple = lambda self, device: 1
    if leave_out == "attn16":  # what CPU autocast does without molds' float32 attention
        import molds.models.decoder as decoder

        def autocast_attention(q, k, v, is_causal=True):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)

        decoder.causal_attention = autocast_attention
    recipe = parse_recipe(argv)
    manifest = Manifest.load(recipe.data.manifest)
    dist = init_distributed()
    model = apply_kernels(build_model(recipe.model, tokenizer_info(manifest)), recipe.kernels)
    engine = DDPEngine(recipe, model, build_loss(recipe.model), dist, plan_for(recipe, dist))
    keep = ("input_ids", "labels", "position_ids", "document_ids")
    it = iter(MoleculeLoader(recipe.data))
    raw = [next(it) for _ in range(4 + steps + profile_steps)]
    batches = [{k: b[k] for k in keep} for b in raw]
    for b in batches[:4]:
        engine.train_step([b])
    start = time.perf_counter()
    for b in batches[4:4 + steps]:
        engine.train_step([b])
    seconds = (time.perf_counter() - start) / steps
    with open("/proc/self/statm") as fh:
        rss_mb = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    out = {"s_per_step": seconds, "rss_mb": rss_mb, "precision": engine.plan.precision.describe()}
    # the model FLOPs the timed steps did (as train/mfu counts them), over the measured matrix rate
    coefficients = model.flops_coefficients()
    flops = sum(c * b["stats"].get(k, 0) for b in raw[4:4 + steps] for k, c in coefficients.items()) / steps
    out["model_gflops_per_step"] = flops / 1e9
    out["achieved_gflops"] = flops / seconds / 1e9
    out["matmul_gflops"] = engine.plan.precision.peak_gflops
    out["mfu"] = out["achieved_gflops"] / out["matmul_gflops"]
    if profile_steps:
        from molds.metrics.step_profile import StepProfile

        prof = StepProfile()
        for b in batches[4 + steps:]:
            prof.start()
            engine.train_step([b])
            prof.stop()
        out["profile_ms_per_step"] = prof.report()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "cpu_moses.json"))
    ap.add_argument("--manifest", default=None, help="instead of the recipe's data.manifest")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timed steps, profile this many more (each variant's last round)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    argv = ["--recipe", args.recipe, *(["--data.manifest", args.manifest] if args.manifest else []), *rest]
    if args.child:
        env, extra, leave_out = VARIANTS[args.child]
        print(json.dumps(one(argv + extra, args.steps, leave_out, args.profile_steps)))
        return
    names = args.variants.split(",")
    times = {n: [] for n in names}
    rss = {n: [] for n in names}
    last = {}
    for round_ in range(args.rounds):
        profile = args.profile_steps if round_ == args.rounds - 1 else 0
        for name in names:
            env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="1")
            env.pop("MOLDS_SYSTEM_ALLOCATOR", None)
            env.update(VARIANTS[name][0])
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--steps",
                                  str(args.steps), "--profile-steps", str(profile), *argv], env=env,
                                 capture_output=True, text=True, cwd=os.getcwd())
            if out.returncode:
                sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            times[name].append(got["s_per_step"])
            rss[name].append(got["rss_mb"])
            last[name] = got
    med = {n: statistics.median(v) for n, v in times.items()}
    result = {"recipe": os.path.relpath(args.recipe, ROOT), "steps": args.steps, "rounds": args.rounds,
              "s_per_step": {n: round(v, 4) for n, v in med.items()},
              "s_per_step_rounds": {n: [round(x, 4) for x in v] for n, v in times.items()},
              "rss_mb_at_end": {n: round(max(v)) for n, v in rss.items()}}
    for name, got in last.items():  # the FLOPs the step does, at what rate, against the measured matrix rate
        result.setdefault("mfu", {})[name] = round(got["mfu"], 3)
        result.setdefault("achieved_gflops", {})[name] = round(got["achieved_gflops"], 1)
        result.setdefault("matmul_gflops", {})[name] = round(got["matmul_gflops"], 1)
        if "profile_ms_per_step" in got:
            result.setdefault("profile_ms_per_step", {})[name] = got["profile_ms_per_step"]
    result["model_gflops_per_step"] = round(next(iter(last.values()))["model_gflops_per_step"], 2)
    for other in (n for n in names if n != "bf16"):
        if other in med and "bf16" in med:
            result[f"{other}_over_bf16"] = round(med[other] / med["bf16"], 3)
    from molds.runtime.lifecycle import cpu_description

    result["cpu"] = cpu_description()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
