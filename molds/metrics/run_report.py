"""What a training run says: its summary when it starts (one step in sequences, molecules and
token slots; the precision; the kernels), the warnings a recipe earns (a warm-up as long as
the run, torchrun restarts on a shared store, what the data will lose), the progress bar,
and each logging window's ``train/*`` and ``data/*`` scalars. ``molds/train.py`` calls these;
the run (``molds.train.Run``) is passed in."""

from __future__ import annotations

import json
import numbers
import os
import resource
import sys
import time

import torch
from tqdm import tqdm

from molds.engines.optim import warmup_steps
from molds.kernels.fp8_select import Fp8Choice
from molds.metrics.logger import device_peak_tflops
from molds.runtime.distributed import all_reduce_mean, all_reduce_sum


def new_window() -> dict:
    return {"real": 0.0, "tokens": 0.0, "molecules": 0.0, "wait": 0.0, "stats": {}, "time": time.perf_counter(),
            "steps": 0}


def count(window: dict, micro: list) -> None:
    """Add a step's micro-batches (tokens, molecules, loader wait, and every count the model's
    FLOPs are a sum over: ``flops_coefficients``) to the logging window."""
    sums = window["stats"]
    for b in micro:
        st = b["stats"]
        window["real"] += st["real_tokens"]
        window["tokens"] += st["tokens"]
        window["molecules"] += st["molecules"]
        window["wait"] += st["wait_s"]
        for k, v in st.items():
            if isinstance(v, numbers.Real):  # (numpy's numbers too)
                sums[k] = sums.get(k, 0.0) + float(v)
    window["steps"] += 1


def log_window(run, window: dict, result, bar) -> None:
    dist = run.dist
    totals = run.loader.totals()
    flops = sum(c * window["stats"].get(k, 0.0) for k, c in run.flops.items())
    real, tokens, wait, flops, trunc, trunc_tok = all_reduce_sum(
        [window["real"], window["tokens"], window["wait"], flops, totals["truncated"], totals["truncated_tokens"]],
        dist)
    elapsed = time.perf_counter() - window["time"]
    loss = all_reduce_mean(result.loss, dist)
    pp = run.engine.topology.pp_size
    real, tokens, flops, trunc, trunc_tok = (x / pp for x in (real, tokens, flops, trunc, trunc_tok))  # pipeline stages share batches
    peak, _ = device_peak_tflops(dist.device, run.recipe.logging.peak_tflops, run.plan.precision)
    values = {"train/loss": loss, "train/lr": result.lr, "train/grad_norm": result.grad_norm,
              "train/tokens_per_sec": real / elapsed, "train/padding_ratio": 1 - real / max(1.0, tokens),
              "train/step_s": elapsed / max(1, window["steps"]),
              "train/mfu": flops / elapsed / (peak * 1e12 * dist.world_size) if peak else None,
              "train/nonfinite_steps": run.counters["nonfinite_steps"], "train/rollbacks": run.counters["rollbacks"],
              "data/wait_s_per_step": wait / dist.world_size / max(1, window["steps"]),
              "data/truncated_molecules": trunc, "data/truncated_tokens": trunc_tok}
    if dist.device.type == "cuda":
        values["train/peak_memory_mb"] = torch.cuda.max_memory_allocated(dist.device) / 2**20
    else:  # the peak resident memory of this process (rank 0)
        values["train/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    values.update(result.extras)
    values.update(run.engine.extras())  # moe/*, pipeline/* (a collective)
    run.log.scalars(run.step, values)
    if bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{values['train/tokens_per_sec']:,.0f}", refresh=False)


def progress_bar(run):
    if not (run.dist.is_main and run.recipe.logging.progress):
        return None
    h = run.plan.horizon
    return tqdm(total=None if h.timed else h.max_steps, initial=run.step, desc="train", file=sys.stderr,
                dynamic_ncols=True)


def start_summary(run, parameters: int) -> None:
    """What one step is, in the units people think in; and what the data will lose."""
    recipe, b, topo = run.recipe, run.batching, run.engine.topology
    notes = [run.loader.length_warning(), run.loader.skipped_note]
    skipped = run.loader.skipped
    if skipped["shards"]:
        run.log.scalars(run.step, {"data/skipped_shards": skipped["shards"], "data/skipped_rows": skipped["rows"]})
        run.log.text("data/skipped_shards", "\n".join(skipped["reasons"]))
    run.log.text("run/recipe", "```\n" + json.dumps(recipe.to_dict(), indent=2) + "\n```")
    run.log.text("run/mfu_peak", device_peak_tflops(run.dist.device, recipe.logging.peak_tflops,
                                                    run.plan.precision)[1])
    run.log.text("run/precision", run.plan.precision.describe())
    if run.lineage["kernels"]:
        run.log.text("run/kernels", run.lineage["kernels"])
    if not run.dist.is_main:
        return
    seq = recipe.data.seq_len if recipe.data.mode == "packed" else recipe.data.max_length
    st = run.manifest.data.get("stats", {}).get("splits", {}).get(recipe.data.split, {})
    rows, tokens = (st.get("rows"), st.get("tokens")) if isinstance(st, dict) else (None, None)
    per_mol = (tokens / rows + 2) if isinstance(rows, int) and isinstance(tokens, int) and rows > 0 else None  # BOS, EOS
    mols = f", about {b.global_batch * seq / per_mol:,.0f} molecules and {b.global_batch * seq:,} token slots" \
        if per_mol and recipe.data.mode == "packed" else ""
    print(f"[molds] {recipe.model.family} of {parameters:,} parameters on {run.engine.name} "
          f"(world {topo.world_size}: dp {topo.dp_size}, pp {topo.pp_size}, ep {topo.ep_size}); one step = "
          f"{step_size(recipe, b)}{mols}; host allocator: {run.lineage['host_allocator']}"
          f"{' (MOLDS_SYSTEM_ALLOCATOR=1 to keep the C library defaults)' if run.lineage['host_allocator'] == 'retain' else ''}",
          file=sys.stderr)
    print(f"[molds] {run.plan.precision.describe()}", file=sys.stderr)
    if run.dist.device.type == "cpu":
        cls = run.plan.precision.cpu_class
        expected = recipe.run.expect.get(cls)
        threads = torch.get_num_threads()  # molds.runtime.distributed.share_cores: the rank's share of the cores
        print(f"[molds] CPU class {cls} ({threads} torch thread{'s' if threads > 1 else ''} per rank)"
              + (f": this recipe reaches {expected}" if expected else ""), file=sys.stderr)
    if recipe.optim.layer_decay < 1.0:  # this rank's groups; the first pipeline stage holds the embeddings
        scales = sorted({g.get("lr_scale", 1.0) for g in run.engine.scheduler.optimizer.param_groups}, reverse=True)
        print(f"[molds] layer-wise learning rates (optim.layer_decay {recipe.optim.layer_decay:g}): {len(scales)} "
              f"depths from lr x {scales[0]:.3g} down to lr x {scales[-1]:.3g} (the embeddings)", file=sys.stderr)
    warning = run.plan.precision.warning()
    if warning:
        notes.append(warning)
    notes.append(elastic_store_warning())
    notes.append(warmup_warning(recipe, run.plan.horizon))
    if run.lineage["kernels"]:
        print(f"[molds] kernels: {run.lineage['kernels']}", file=sys.stderr)
    if "fp8_products" in run.lineage:
        print(f"[molds] {Fp8Choice(**run.lineage['fp8_products']).describe()}", file=sys.stderr)
    if run.loader.randomized_note:
        print(f"[molds] {run.loader.randomized_note}", file=sys.stderr)
    for note in notes:
        if note:
            print(f"[molds] warning: {note}", file=sys.stderr)


def step_size(recipe, b) -> str:
    """One optimizer step in the unit the data mode batches by: sequences (packed rows, or
    fixed-shape buckets), or, for length-bucketed batches, padded tokens (a micro-batch holds
    as many sequences as ``data.max_tokens_per_batch`` allows, so its sequence count varies)."""
    accum = f"{b.grad_accum} accumulation x {b.dp_size} data-parallel"
    if recipe.data.mode == "bucketed" and not recipe.data.fixed_shape:
        per = recipe.data.max_tokens_per_batch
        return (f"up to {per * b.grad_accum * b.dp_size:,} padded tokens ({per:,} per micro-batch x {accum}; "
                f"length-grouped sequences, as many as fit)")
    return f"{b.global_batch} sequences ({b.micro_batch} per micro-batch x {accum})"


def warmup_warning(recipe, horizon) -> str | None:
    """A warm-up as long as the run (a step-count run: a budget's warm-up is a fraction): the
    learning rate never reaches ``optim.lr``. Said, not refused: short test runs of a recipe
    (``--trainer.max_steps 5``) do this on purpose."""
    if horizon.timed:
        return None
    warm = warmup_steps(recipe.optim, horizon.max_steps)
    if warm < horizon.max_steps:
        return None
    return (f"the warm-up ({warm} steps: optim.warmup_steps{'' if recipe.optim.warmup_steps is not None else ' unset'})"
            f" is as long as the run (trainer.max_steps={horizon.max_steps}): the learning rate only rises, to "
            f"{recipe.optim.lr * horizon.max_steps / max(warm, 1):.3g} at the last step (optim.lr="
            f"{recipe.optim.lr:g}), and never decays")


def elastic_store_warning() -> str | None:
    """torchrun with restarts and its shared rendezvous store (torch 2.13's default): the
    store keeps the failed attempt's keys and the restarted ranks read them without a new
    namespace, so their process group connects to dead addresses ("connectFullMesh
    failed"). Torch's own per-round store avoids it."""
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") in ("0", "") or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return ("torchrun --max-restarts with its shared rendezvous store: a restarted attempt reads the failed one's "
            "addresses and cannot connect (torch 2.13); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun "
            "so that restarts work")
