"""The recipe's ``goal`` section: goal-directed fine-tuning, defined with the other sections
(``sections``) so that the recipe depends on no package that runs a job; the goal run
(``molds.goal``) reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from .sections import _BIG


@dataclass
class GoalConfig:
    """Goal-directed fine-tuning (REINVENT's augmented-likelihood RL): with ``prior`` set,
    ``molds/train.py`` steers an agent, initialised from the prior, toward ``scoring``
    (see docs/tutorials/goal.md). The model and manifest are the prior's;
    ``trainer.max_steps`` bounds the steps, ``optim`` trains the agent, ``checkpoint``
    saves and resumes it (the call ledger, memory and filter with it)."""

    RANGES: ClassVar[dict] = {
        "sigma": (0.0, 1e6), "batch_size": (1, 1 << 20), "temperature": (1e-3, 100.0), "max_tokens": (0, 1 << 16),
        "max_oracle_calls": (0, _BIG), "replay_size": (0, 1 << 20), "replay_samples": (0, 1 << 20),
        "bucket_size": (1, _BIG), "min_score": (0.0, 1.0), "penalty": (0.0, 1.0), "top_k": (1, 1 << 20),
        "likelihood_penalty": (0.0, 1e9), "patience": (0, 1 << 20),
    }

    prior: Optional[str] = None
    """The prior: a decoder checkpoint, or a run directory (its averaged model when current,
    else its latest checkpoint). Unset: an ordinary training run."""

    scoring: Optional[dict] = None
    """The objective: a scoring definition (``{"components": [...], "aggregate": ...}``) or
    ``{"oracle": "celecoxib_rediscovery"}`` (molds.scoring; check one with molds-score).
    Or give ``stages`` instead."""

    stages: Optional[list] = None
    """Staged objectives, in order: each ``{"scoring": ..., "min_steps": 0, "max_steps": N,
    "threshold": 1.0}``. A stage ends after ``max_steps`` of its steps, or once its batch's mean
    score reaches ``threshold`` after ``min_steps``; the run ends with the last stage. Each stage
    starts with an empty memory, filter and score cache (its scores are its own); the budget
    is shared."""

    sigma: float = 128.0
    """The augmented likelihood's weight of the score: the agent is pulled toward
    log P_prior + sigma * score (REINVENT's default 128; 0 keeps the agent on the prior)."""

    batch_size: int = 64
    """Molecules sampled per step, all ranks together (a multiple of the world size)."""

    temperature: float = 1.0
    """Sampling temperature of the agent."""

    max_tokens: int = 0
    """Tokens per sample at most (0: 1.5 x the prior's longest training molecule + 8)."""

    max_oracle_calls: int = 0
    """The budget: unique valid molecules scored (invalid and repeated ones cost nothing);
    the run ends when it is spent (0: no budget, ``trainer.max_steps`` ends the run)."""

    unique_batch: bool = False
    """Train each step on each distinct molecule it sampled once (its first sample over all
    ranks), as PMO's REINVENT does; false: on every sample, repeats included (with their
    first score, as REINVENT 3 and 4 do by default)."""

    likelihood_penalty: float = 0.0
    """Adds ``likelihood_penalty`` x mean(-1 / log P_agent) over the step's rows to the loss:
    it grows as a sequence's likelihood nears 1 and so holds the agent off collapsing onto a
    few molecules (the original REINVENT's regularizer, 5e3 in it and in PMO's runs; 0: off)."""

    patience: int = 0
    """End the run when the best 100 scores stay the same for this many steps in a row,
    counted once more than 1,000 calls are spent (PMO's REINVENT stops so, with 5; 0: never).
    PMO's AUC pads the unspent budget with the last top-10 mean."""

    replay_size: int = 100
    """The memory: the best molecules seen (by filtered score), replayed into the loss (0: off)."""

    replay_samples: int = 10
    """Molecules drawn from the memory into each step's loss, all ranks together."""

    replay_weighting: Literal["uniform", "score"] = "uniform"
    """How the replayed molecules are drawn from the memory: ``uniform``, or ``score``: with
    probability in proportion to their scores, without replacement (the original REINVENT's
    experience replay, PMO's)."""

    replay_randomized: bool = True
    """Replay a molecule as a random SMILES spelling of it, new each time (Augmented Memory)."""

    diversity_filter: Literal["none", "identical_murcko"] = "identical_murcko"
    """``identical_murcko``: molecules scoring at least ``min_score`` fill a bucket per Murcko
    scaffold (as the prior's manifest computes scaffolds: its ETL's ``scaffold`` option); once a scaffold's bucket holds ``bucket_size``, its further molecules' scores are
    multiplied by ``penalty``."""

    bucket_size: int = 25
    """Molecules per scaffold before the filter penalizes."""

    min_score: float = 0.4
    """Scores below this neither fill a bucket nor enter the memory."""

    penalty: float = 0.0
    """What the filter multiplies the score of a molecule in a full bucket by."""

    top_k: int = 100
    """The best molecules written to ``topk.csv`` at the end."""
