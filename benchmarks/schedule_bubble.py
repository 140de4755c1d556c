"""Pipeline schedules side by side: 1F1B and DeepSpeed's stock DualPipeV (DeepSpeed's own
engines) against molds' dualpipev (molds.engines.dualpipev), simulated and measured.

    python benchmarks/schedule_bubble.py [--ranks 2 4] [--unit-ms 40] [--steps 3] [--quick]

The model is synthetic so that the figure shows the schedule, not the machine: 2P blocks
(P pipeline ranks; 1F1B puts two on each rank, DualPipeV one on each of its 2P stages),
each a forward that takes F, an input-gradient backward that takes I and a weight-gradient
backward that takes W (sleeps: the ranks do not compete for the CPU's cores), cut in two
halves around an all-to-all that completes A after it was launched, in the background.
The DeepSpeed schedules wait for it at once, both ways; molds' dualpipev has each F&B pair
interleave its two micro-batches at the exchange, and defers W where the schedule says.
Defaults: F = I = W = 40 ms, A = 20 ms (DualPipe's accounting, where its published bubble
formula is exact: F = I), N = 4P micro-batches, gloo, one process per rank.

Per schedule and P: the simulated step (``molds.engines.schedule.simulate`` with the
costs the blocks take: F + A for a forward, I + W + A for a full backward, and for an F&B
pair the time of its interleaving) and the measured one (median of ``--steps`` optimizer
steps after one warm-up), the bubble fraction (idle over step time, mean over ranks) of
both and their ratio (``*_bubble_over_simulated``: target within 10 % of 1), and molds'
step time over the other two. The simulation delivers each stage-to-stage message after
the time one takes on this process group (``*_p2p_latency_s``: half the median round trip
of an activation between two ranks, measured in the same processes before the steps); the
published formulas assume none (``*_simulated_bubble_no_latency`` and its ratio) (``dualpipev_over_stock_pP``, ``dualpipev_over_1f1b_pP``:
targets < 1). For molds' executor, where its measured idle time per step went
(``dualpipev_pP_idle_wait_s``: waiting for peers' messages; ``_post_s``: posting sends and
receives; ``_other_s``: its own work between actions). Prints one JSON line (the last line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, HIDDEN, SEQ = 8, 16, 16


def pair_cost(f: float, i: float, w: float, a: float) -> float:
    """An F&B pair of one block each, interleaved at the exchange (as molds.engines.chunks
    runs it): F's first half, launch; B's second half (input and weight), launch; wait F's
    exchange, F's second half; wait B's, B's first half."""
    t = f / 2
    f_done = t + a
    t += (i + w) / 2
    b_done = t + a
    t = max(t, f_done) + f / 2
    return max(t, b_done) + (i + w) / 2


def costs(f, i, w, a) -> dict:
    return {"F": f + a, "I": i + a, "W": w, "B": i + w + a, "FB": pair_cost(f, i, w, a)}


# ---------------------------------------------------------------- the synthetic model

def _model_classes():
    import torch
    from torch import nn

    from molds.engines.chunks import Exchange
    from molds.models.wgrad import WeightGradStore, _accumulate

    class Work(torch.autograd.Function):
        """Identity on x that takes ``f`` forward, ``i`` for the input gradient and ``w``
        for the weight's (queued when the backward defers weight gradients)."""

        @staticmethod
        def forward(ctx, x, weight, f, i, w):
            time.sleep(f)
            ctx.i, ctx.w, ctx.weight = i, w, weight
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.i)
            weight, w = ctx.weight, ctx.w

            def weight_grad():
                time.sleep(w)
                _accumulate(weight, torch.ones_like(weight))

            if WeightGradStore.active():
                WeightGradStore.put(weight_grad)
                return grad, None, None, None, None
            time.sleep(w)
            return grad, torch.ones_like(weight), None, None, None

    class Wait(torch.autograd.Function):
        """An all-to-all waited at once, both ways (what the DeepSpeed schedules do)."""

        @staticmethod
        def forward(ctx, x, a):
            time.sleep(a)
            ctx.a = a
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.a)
            return grad, None

    class Background:
        """The exchange's transport for molds' schedule: done ``a`` after its launch."""

        def __init__(self, a):
            self.a = a

        def launch(self, x, out_splits, in_splits, group):
            done = time.perf_counter() + self.a
            return _Later(x.clone(), done)

    class _Later:
        def __init__(self, out, done):
            self.out, self.done = out, done

        def wait(self):
            time.sleep(max(0.0, self.done - time.perf_counter()))
            return self.out

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)

        def forward(self, inputs):
            ids, pos, doc = inputs
            return torch.nn.functional.embedding(ids.reshape(-1), self.weight), pos, doc

    class Block(nn.Module):
        def __init__(self, f, i, w, a):
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.zeros(HIDDEN)), nn.Parameter(torch.zeros(HIDDEN))
            self.f, self.i, self.w, self.a = f / 2, i / 2, w / 2, a

        def first(self, c):
            return Work.apply(c[0], self.w1, self.f, self.i, self.w), c[1], c[2]

        def second(self, c):
            return Work.apply(c[0], self.w2, self.f, self.i, self.w), c[1], c[2]

        def forward(self, inputs):
            h, pos, doc = self.first(inputs)
            return self.second((Wait.apply(h, self.a), pos, doc))

        def pipeline_parts(self):
            return [self.first,
                    Exchange("all-to-all", lambda c: c[0], lambda c, x: (x, c[1], c[2]),
                             lambda c: ([c[0].shape[0]], [c[0].shape[0]]), transport=Background(self.a)),
                    self.second]

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)

        def forward(self, inputs):
            return inputs[0] @ self.weight.t()

    return Embed, Block, Head


def _loss(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.float(), labels.reshape(-1))


def _rank(rank, world, schedule, n, unit, a, steps, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import logging

    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    from molds.engines.pipeline import time_instructions

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    Embed, Block, Head = _model_classes()
    specs = [LayerSpec(Embed)] + [LayerSpec(Block, unit, unit, unit, a) for _ in range(2 * world)] + [LayerSpec(Head)]
    v = schedule != "1f1b"
    module = (DualPipeVModule if v else PipelineModule)(layers=specs, num_stages=world, loss_fn=_loss,
                                                        partition_method="type:Block")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": n, "train_batch_size": n,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 0}}
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    if schedule == "dualpipev":
        from molds.engines.dualpipev import DualPipeVEngine

        engine = DualPipeVEngine.initialize_deepspeed(model=module, optimizer=optimizer, config=cfg)[0]
        engine.configure_molds(lambda out, tgt: _loss(out["logits"], tgt["labels"]), HIDDEN)
    else:
        engine = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg)[0]
    latency = _p2p_latency(rank, world)
    clock = None if schedule == "dualpipev" else time_instructions(engine)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, 1, SEQ), generator=gen)
    micro = [{"input_ids": ids[m], "position_ids": torch.arange(SEQ)[None], "labels": ids[m],
              "document_ids": torch.zeros(1, SEQ, dtype=torch.long)} for m in range(n)]
    times, windows, parts = [], [], []
    for step in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        if schedule == "dualpipev":
            engine.train_micro_batches(micro)
            window = (engine.last_timeline.busy(0), engine.last_timeline.makespan)  # the executor's own clock
            part = dict(engine.last_idle_parts)
        else:
            clock.update(busy=0.0, start=start, end=None)
            engine.train_batch(iter([((b["input_ids"], b["position_ids"], b["document_ids"]), b["labels"])
                                     for b in micro]))
            window = (clock["busy"], clock["end"] - start)
            part = {}
        if step:
            times.append(time.perf_counter() - start)
            windows.append(window)
            parts.append(part)
    torch.save({"times": times, "windows": windows, "latency": latency, "parts": parts},
               os.path.join(out_dir, f"{schedule}-rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


def _p2p_latency(rank, world, rounds=30):
    """One stage-to-stage message's delivery time on this process group: half the median
    round trip of an activation-sized tensor between ranks 2k and 2k+1 (isend/irecv, waited
    as the executor waits them)."""
    import torch

    if world < 2 or (world % 2 and rank == world - 1):
        torch.distributed.barrier()
        return 0.0
    peer = rank ^ 1
    buf, out = torch.zeros(1, SEQ, HIDDEN), torch.ones(1, SEQ, HIDDEN)
    trips = []
    for _ in range(rounds):
        t = time.perf_counter()
        if rank % 2 == 0:
            torch.distributed.isend(out, peer).wait()
            torch.distributed.irecv(buf, peer).wait()
        else:
            torch.distributed.irecv(buf, peer).wait()
            torch.distributed.isend(out, peer).wait()
        trips.append(time.perf_counter() - t)
    torch.distributed.barrier()
    return statistics.median(trips) / 2


def measure(schedule, ranks, n, unit, a, steps):
    import tempfile

    import torch

    from molds.runtime.distributed import free_port

    out_dir = tempfile.mkdtemp(prefix="molds-bubble-")
    ctx = torch.multiprocessing.start_processes(_rank, args=(ranks, schedule, n, unit, a, steps, free_port(), out_dir),
                                                nprocs=ranks, join=False, start_method="spawn")
    while not ctx.join(timeout=5):
        pass
    per_rank = [torch.load(os.path.join(out_dir, f"{schedule}-rank{r}.pt")) for r in range(ranks)]
    step = statistics.median(max(r["times"][k] for r in per_rank) for k in range(steps))
    from molds.engines.pipeline import bubble_fractions

    per_step = [bubble_fractions([[r["windows"][k]] for r in per_rank]) for k in range(steps)]
    frac = statistics.median(statistics.mean(f) for f in per_step)  # mean over ranks, median over steps
    latency = statistics.mean(r["latency"] for r in per_rank if r["latency"] > 0) if ranks > 1 else 0.0
    # molds' executor says where its idle time went: waiting for peers, posting messages, and
    # the rest (its own work between actions), each a mean over ranks, median over steps
    split = {}
    if all(r["parts"] and r["parts"][0] for r in per_rank):
        for key in ("wait_s", "post_s", "other_s"):
            split[key] = statistics.median(statistics.mean(
                r["parts"][k][key] if key != "other_s" else
                r["windows"][k][1] - r["windows"][k][0] - r["parts"][k]["wait_s"] - r["parts"][k]["post_s"]
                for r in per_rank) for k in range(steps))
    return step, frac, latency, split


def simulated(schedule, ranks, n, unit, a, latency=0.0):
    from molds.engines.schedule import build, simulate

    lists, layout = build(schedule, ranks, n)
    t = simulate(lists, layout, costs(unit, unit, unit, a), scale=2.0 if schedule == "1f1b" else 1.0,
                 latency=latency)
    return t.makespan, t.bubble_fraction()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--unit-ms", type=float, default=40.0, help="F = I = W of one block")
    ap.add_argument("--a2a-ms", type=float, default=20.0, help="the all-to-all's time in the background")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="P = 2, short units, one step (checks that it runs)")
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.unit_ms, args.a2a_ms, args.steps = [2], 10.0, 5.0, 1
    unit, a = args.unit_ms / 1000, args.a2a_ms / 1000
    out = {"unit_ms": args.unit_ms, "a2a_ms": args.a2a_ms, "steps": args.steps, "micro_batches": "4P",
           "cpu": _cpu()}
    for p in args.ranks:
        n = 4 * p
        for name in ("1f1b", "stock_dualpipev", "dualpipev"):
            key = {"1f1b": "1f1b", "stock_dualpipev": "stock", "dualpipev": "dualpipev"}[name]
            step, frac, latency, split = measure(key, p, n, unit, a, args.steps)
            formula_step, formula_frac = simulated(name, p, n, unit, a)
            sim_step, sim_frac = simulated(name, p, n, unit, a, latency)
            out[f"{key}_p{p}_p2p_latency_s"] = latency
            out[f"{key}_p{p}_simulated_step_s"] = sim_step
            out[f"{key}_p{p}_step_s"] = step
            out[f"{key}_p{p}_simulated_bubble"] = sim_frac
            out[f"{key}_p{p}_bubble"] = frac
            out[f"{key}_p{p}_bubble_over_simulated"] = frac / sim_frac
            out[f"{key}_p{p}_simulated_bubble_no_latency"] = formula_frac
            out[f"{key}_p{p}_bubble_over_simulated_no_latency"] = frac / formula_frac
            for part, seconds in split.items():  # the measured idle per step, by where it went
                out[f"{key}_p{p}_idle_{part}"] = seconds
            print(f"P={p} {key}: step {step:.3f} s (simulated {sim_step:.3f}; {formula_step:.3f} without latency), "
                  f"bubble {frac:.3f} (simulated {sim_frac:.3f}; {formula_frac:.3f} without latency; "
                  f"message {latency * 1e3:.2f} ms)", file=sys.stderr)
        out[f"dualpipev_over_stock_p{p}"] = out[f"dualpipev_p{p}_step_s"] / out[f"stock_p{p}_step_s"]
        out[f"dualpipev_over_1f1b_p{p}"] = out[f"dualpipev_p{p}_step_s"] / out[f"1f1b_p{p}_step_s"]
    print(json.dumps(out))


def _cpu() -> str:
    from molds.runtime.lifecycle import cpu_description

    return cpu_description()


if __name__ == "__main__":
    main()
