"""How long a run trains, and where it is: ``trainer.max_steps`` optimizer steps, or a
wall-clock budget ``trainer.max_time`` ("2h", "1h45m", "90m", "5400s").

With a budget the run does what "Cramming" (Geiping and Goldstein, 2023) does to train
within a fixed time: the learning-rate schedule (warm-up and decay), the checkpoints
(``checkpoint.interval_fraction``) and the final model (``checkpoint.average_last``) follow
the fraction of the budget spent instead of the step count, and the run stops at the
budget. The elapsed time is the training loop's wall clock (evaluation and checkpoints
included), agreed between the ranks after every step (the largest: every rank then takes
the same learning rate), and carried in the checkpoint, so a killed run resumes where its
budget stood: the total it spends is the budget, to within one step.
"""

from __future__ import annotations

import re
import time

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds in "2h", "1h45m", "90m", "5400s" or "5400"."""
    t = str(text).strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", t)
    if not parts or "".join(n + u for n, u in parts) != t:
        raise ValueError(f"{text!r} is not a duration (examples: 2h, 1h45m, 90m, 5400s)")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Horizon:
    """A run's length and its position within it (``fraction`` in [0, 1])."""

    def __init__(self, max_steps: int | None = None, max_time_s: float | None = None):
        if max_time_s is not None and max_steps is not None:
            raise ValueError("a run has a step count or a time budget, not both")
        self.max_time_s = max_time_s
        self.max_steps = max_steps if max_steps is not None or max_time_s is not None else 1000
        self.step, self.elapsed_s, self._base_s, self._t0 = 0, 0.0, 0.0, None

    @property
    def timed(self) -> bool:
        return self.max_time_s is not None

    def start(self, step: int = 0, elapsed_s: float = 0.0) -> None:
        """Begin counting (a fresh run, or a resumed one at ``step`` with ``elapsed_s`` spent)."""
        self.step, self._base_s, self.elapsed_s = step, float(elapsed_s), float(elapsed_s)
        self._t0 = time.monotonic()

    def advance(self, step: int, agree=None) -> None:
        """After optimizer step ``step``: a budget's elapsed time, the same on every rank
        (``agree``: the largest over the ranks, a collective)."""
        self.step = step
        if self.timed:
            local = self._base_s + (time.monotonic() - (self._t0 if self._t0 is not None else time.monotonic()))
            self.elapsed_s = agree(local) if agree is not None else local

    @property
    def fraction(self) -> float:
        if self.timed:
            return min(1.0, self.elapsed_s / self.max_time_s)
        return min(1.0, self.step / self.max_steps)

    @property
    def done(self) -> bool:
        return self.fraction >= 1.0

    def state(self) -> dict:
        """What a checkpoint records of it."""
        out = {"step": self.step, "fraction": self.fraction}
        if self.timed:
            out.update(elapsed_s=self.elapsed_s, max_time_s=self.max_time_s)
        return out

    def describe(self) -> str:
        if self.timed:
            return f"a time budget of {format_duration(self.max_time_s)}"
        return f"{self.max_steps:,} steps"


def horizon_of(trainer) -> Horizon:
    """The recipe's ``trainer`` section as a Horizon."""
    if trainer.max_time:
        return Horizon(max_time_s=parse_duration(trainer.max_time))
    return Horizon(max_steps=trainer.max_steps)
