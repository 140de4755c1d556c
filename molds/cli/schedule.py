"""``molds-schedule``: the pipeline schedules' action lists, bubbles and timelines.

    molds-schedule --schedule dualpipev --pp 4 --micro-batches 16 --out timeline.png
    molds-schedule --pp 2 --micro-batches 8 --costs F=1,I=1,W=1,B=2,FB=2.5 --comm

Prints each rank's actions in the chosen schedule and, side by side, the simulated step,
the bubble fraction (idle over step time, mean over ranks) and the most activations a rank
holds (in micro-batches of the whole model) of 1F1B, DeepSpeed's stock DualPipeV and molds'
dualpipev with the same model and costs; ``--out`` draws the three
timelines one above the other. Costs are per V chunk (a model's 1 / 2P); 1F1B's stages
hold two. Default: DualPipe's accounting, F = I = W = 1, B = 2, F&B = F + B.
"""

from __future__ import annotations

import sys

from ..errors import run_cli
from . import UsageError, new_parser, parse

NAMES = {"1f1b": "1F1B (DeepSpeed)", "stock_dualpipev": "DualPipeV (DeepSpeed 0.19.8, stock)",
         "dualpipev": "DualPipeV (molds: zero-bubble W, overlapped F&B)"}


def build_parser():
    p = new_parser("molds-schedule", "Print and draw pipeline schedules (action lists, simulated bubbles).")
    p.add_argument("--schedule", type=str, default="dualpipev", help="whose action lists to print: "
                   "dualpipev, stock_dualpipev or 1f1b")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (P; DualPipeV cuts the model into 2P stages)")
    p.add_argument("--micro-batches", type=int, default=16, help="micro-batches per step (N >= 2P for DualPipeV)")
    p.add_argument("--costs", type=str, default="F=1,I=1,W=1,B=2",
                   help="seconds (or any unit) per V chunk: F, I, W, B (full backward), optional FB (an overlapped "
                        "pair; default F + B)")
    p.add_argument("--comm", type=bool, default=False, help="also print the sends and receives")
    p.add_argument("--out", type=str, default=None, help="write the three timelines to this PNG")
    return p


def parse_costs(text: str) -> dict:
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().upper()
        if key not in ("F", "I", "W", "B", "FB"):
            raise UsageError(f"--costs: unknown cost {key!r} (F, I, W, B, FB)")
        try:
            out[key] = float(value)
        except ValueError:
            raise UsageError(f"--costs: {part!r} is not KEY=number") from None
        if out[key] < 0:
            raise UsageError(f"--costs: {key} must not be negative")
    missing = {"F", "I", "W", "B"} - out.keys()
    if missing:
        raise UsageError(f"--costs: give {', '.join(sorted(missing))} too")
    return out


def run(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    from ..engines.schedule import (  # after the parse: --help loads no torch
        SCHEDULES,
        build,
        held_activations,
        simulate,
    )
    from ..engines.timeline import describe, draw  # after the parse: --help loads no torch

    if args.schedule not in SCHEDULES:
        raise UsageError(f"--schedule {args.schedule}: one of {', '.join(SCHEDULES)}")
    if args.pp < 1 or args.micro_batches < 1:
        raise UsageError("--pp and --micro-batches must be at least 1")
    if args.micro_batches < 2 * args.pp:
        raise UsageError(f"DualPipeV needs --micro-batches >= 2 x --pp = {2 * args.pp}")
    costs = parse_costs(args.costs)
    panels, rows = [], []
    for name in ("1f1b", "stock_dualpipev", "dualpipev"):
        lists, layout = build(name, args.pp, args.micro_batches)
        t = simulate(lists, layout, costs, scale=2.0 if name == "1f1b" else 1.0)
        # the fullest rank's activations, in micro-batches of the whole model (a chunk is 1 / stages of it)
        held = max(held_activations(acts) for acts in lists) / layout.stages
        rows.append((name, t.makespan, t.bubble_fraction(), held))
        panels.append((f"{NAMES[name]}: step {t.makespan:g}, bubble {100 * t.bubble_fraction():.1f} %", t))
        if name == args.schedule:
            shown = lists
    print(f"{args.schedule}, P={args.pp}, N={args.micro_batches}, costs {costs}:")
    for line in describe(shown, comm=args.comm):
        print("  " + line)
    print(f"{'schedule':<20}{'step':>10}{'bubble':>10}{'activations':>13}")
    for name, step, frac, held in rows:
        print(f"{name:<20}{step:>10g}{100 * frac:>9.1f}%{held:>12.3g}x")
    print("activations: the most a rank holds at once, in micro-batches of the whole model's activations")
    if args.out:
        draw(panels, args.out)
        print(f"timelines: {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("molds-schedule", run, argv)


if __name__ == "__main__":
    sys.exit(main())
