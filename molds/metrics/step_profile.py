"""A training step's time by where it goes: operator self-time by category (GEMMs,
attention, loss, optimizer, other operators) from torch.profiler, and the rest of the
step's wall time (outside operators: Python, the loader). What ``benchmarks/peer_hf_trainer.py``
and ``benchmarks/cpu_step.py`` report as ``profile_ms_per_step``."""

from __future__ import annotations

import time


def _sync() -> None:
    import torch

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

    def __init__(self):
        self.wall = 0.0
        self.steps = 0
        self.by_category = {c: 0.0 for c, _ in CATEGORIES} | {"other_ops": 0.0}
        self._prof = None

    def start(self):
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def stop(self):
        import torch

        _sync()
        self.wall += time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        cuda = torch.cuda.is_available()
        for ev in self._prof.key_averages():
            us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
            if not us:
                continue
            cat = next((c for c, frags in CATEGORIES if any(f in ev.key for f in frags)), "other_ops")
            self.by_category[cat] += us / 1e6
        self.steps += 1
        self._prof = None

    def report(self) -> dict:
        ms = {c: round(1e3 * t / self.steps, 2) for c, t in self.by_category.items()}
        ms["outside_ops"] = round(1e3 * (self.wall - sum(self.by_category.values())) / self.steps, 2)
        ms["step"] = round(1e3 * self.wall / self.steps, 2)
        return ms
