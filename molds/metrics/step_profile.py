"""A training step's time by where it goes: operator self-time by category (GEMMs,
attention, loss, optimizer, other operators) from torch.profiler, and the rest of the
step's wall time (outside operators: Python, the loader). What ``benchmarks/peer_hf_trainer.py``
and ``benchmarks/cpu_step.py`` report as ``profile_ms_per_step``."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _cuda() -> bool:
    return torch.cuda.is_available()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


CATEGORIES = (  # (category, operator-name fragments), first match wins
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "grouped_mm")),
    ("attention", ("scaled_dot_product", "attention", "aten::_softmax", "aten::_softmax_backward_data")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss")),
    ("optimizer", ("adam", "_foreach", "clip_grad", "aten::zero_", "aten::norm", "linalg_vector_norm")),
)


class StepProfile:
    """Operator self-time of one side's profiled steps, by category, and the wall time
    they took (the rest is time outside operators: Python, the loader)."""

    def __init__(self, trace: str | None = None):
        self.wall = 0.0
        self.steps = 0
        self.by_category = {c: 0.0 for c, _ in CATEGORIES} | {"other_ops": 0.0}
        self.by_op: dict[str, float] = {}
        self.trace = trace  # a Chrome trace of the profiled steps is written there (chrome://tracing, Perfetto)
        self._prof = None

    def start(self):
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._steps_in_session = 0
        self._t0 = time.perf_counter()

    def stop(self):
        _sync()
        self.wall += time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        if self.trace:
            os.makedirs(os.path.dirname(os.path.abspath(self.trace)), exist_ok=True)
            self._prof.export_chrome_trace(self.trace)
        cuda = torch.cuda.is_available()
        for ev in self._prof.key_averages():
            us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
            if not us:
                continue
            cat = next((c for c, frags in CATEGORIES if any(f in ev.key for f in frags)), "other_ops")
            self.by_category[cat] += us / 1e6
            self.by_op[ev.key] = self.by_op.get(ev.key, 0.0) + us / 1e6
        self.steps += max(1, self._steps_in_session)
        self._prof = None

    def _sync_step(self) -> None:
        """One more step inside the running session (``ProfileWindow``: several steps, one
        profiler session)."""
        self._steps_in_session += 1

    def top(self, n: int = 8) -> list[tuple[str, float]]:
        """The ``n`` operators with the most self-time, in ms per step."""
        ranked = sorted(self.by_op.items(), key=lambda kv: -kv[1])[:n]
        return [(name, round(1e3 * t / self.steps, 3)) for name, t in ranked]

    def describe(self, first: int, last: int) -> str:
        """One line: where the profiled steps' time went."""
        ms = self.report()
        where = "device" if _cuda() else "CPU"
        cats = ", ".join(f"{k} {v:,.1f}" for k, v in ms.items() if k != "step")
        ops = ", ".join(f"{name} {t:,.2f}" for name, t in self.top())
        return (f"profile of steps {first}-{last}: {ms['step']:,.1f} ms a step; ms a step by operator {where} "
                f"self-time: {cats}; the slowest operators (ms a step): {ops}")

    def report(self) -> dict:
        ms = {c: round(1e3 * t / self.steps, 2) for c, t in self.by_category.items()}
        ms["outside_ops"] = round(1e3 * (self.wall - sum(self.by_category.values())) / self.steps, 2)
        ms["step"] = round(1e3 * self.wall / self.steps, 2)
        return ms


class ProfileWindow:
    """``logging.profile_steps`` in the training loop (rank 0): the steps after the run's
    first logging window (which holds start-up and compilation) are profiled, then one
    line says where their time went."""

    def __init__(self, count: int, start_step: int, interval: int, output_dir: str):
        self.first = start_step + interval + 1
        self.last = self.first + count - 1
        self.profile = StepProfile(trace=os.path.join(output_dir, "profile", f"steps-{self.first}-{self.last}.json"))
        self.active = False
        self.done = False

    @classmethod
    def of(cls, recipe, step: int) -> "ProfileWindow | None":
        """The run's window (``logging.profile_steps``; None when off), from step ``step`` on."""
        lg = recipe.logging
        return cls(lg.profile_steps, step, lg.interval_steps, recipe.run.output_dir) if lg.profile_steps else None

    def before(self, step: int) -> None:
        """Called before step ``step`` runs."""
        if not self.done and not self.active and self.first <= step <= self.last:
            self.profile.start()
            self.active = True

    def after(self, step: int, log, final: bool = False) -> None:
        """Called after step ``step`` counted: at the window's last step (or the run's), its
        line is printed and its figures logged to ``log`` (the run's MetricsLogger)."""
        if not self.active:
            return
        self.profile._sync_step()
        if step >= self.last or final:
            self.close(step, log)

    def close(self, step: int, log) -> None:
        """The window ends at ``step`` (also when the data ran out inside it)."""
        if not self.active:
            return
        self.profile.stop()
        self.active, self.done = False, True
        print(f"[molds] {self.profile.describe(self.first, step)}", file=sys.stderr)
        log.scalars(step, self.scalars())

    def scalars(self) -> dict:
        return {f"profile/{k}_ms": v for k, v in self.profile.report().items()}
