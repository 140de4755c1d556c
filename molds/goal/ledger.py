"""What a goal run knows between steps: the oracle calls, the score cache, the diversity
filter's buckets, the replay memory and the best molecules (``Ledger``).

Every rank holds the same ledger: each step, the ranks gather the molecules they sampled
(in rank order), the ledger decides which are new (a molecule is scored once per stage,
and each new one costs one call), the new ones are scored by the ranks in turn and the
scores gathered, and every rank applies the same update in the same order. So the budget,
the filter and the memory are global and the call count is exact at any world size. The
ledger is JSON (``state_dict``) and rides in the checkpoint: a resumed run continues with
the same calls, cache, buckets and memory.
"""

from __future__ import annotations

import heapq
import random

from rdkit import Chem
from rdkit.Chem.Scaffolds import MurckoScaffold

from ..errors import CheckpointError

INVALID, NEW, REPEAT, OVER_BUDGET = "invalid", "new", "repeat", "over_budget"


def murcko_scaffold(smiles: str) -> str:
    """The Murcko scaffold's canonical SMILES ("" for a molecule without rings)."""
    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return ""
    try:
        return MurckoScaffold.MurckoScaffoldSmiles(mol=mol)
    except Exception:  # RDKit cannot cut this one: its own bucket, named by the molecule
        return smiles


class Ledger:
    def __init__(self, cfg):
        self.cfg = cfg
        self.calls = 0  # oracle calls, over every stage
        self.stage = 0
        self.stage_steps = 0  # steps taken in the current stage
        self.cache: dict[str, list] = {}  # canonical SMILES -> [raw total, filtered score] (this stage)
        self.buckets: dict[str, int] = {}  # scaffold -> molecules in its bucket (this stage)
        self.memory: list[list] = []  # [SMILES, filtered score], best first (this stage)
        self.history: list[float] = []  # every call's raw total, in call order (all stages)
        self.best: list[list] = []  # [SMILES, raw total, step, stage], best first, top_k kept (all stages)
        self.unfinished = 0  # samples that never ended (not molecules, not trained on)
        self.stall = 0  # steps in a row that left the best scores as they were (goal.patience)

    # ------------------------------------------------------------ one step
    def classify(self, canonical: list) -> list[str]:
        """Each gathered sample's status: invalid, new (it will be scored: one call),
        repeat (scored before in this stage, or earlier in this batch), or over_budget
        (new, but the budget is spent before it: not scored, not trained on)."""
        budget = self.cfg.max_oracle_calls
        out, fresh = [], set()
        for c in canonical:
            if c is None:
                out.append(INVALID)
            elif c in self.cache or c in fresh:
                out.append(REPEAT)
            elif budget and self.calls + len(fresh) >= budget:
                out.append(OVER_BUDGET)
            else:
                fresh.add(c)
                out.append(NEW)
        return out

    def record(self, new: list[str], totals: list[float], scaffolds: list[str], step: int) -> list[float]:
        """Count the new molecules' calls (in order), apply the diversity filter and update
        the memory and the best; returns each one's filtered score."""
        cfg = self.cfg
        filtered = []
        for smi, total, scaffold in zip(new, totals, scaffolds):
            score = float(total)
            if cfg.diversity_filter == "identical_murcko" and score >= cfg.min_score:
                if self.buckets.get(scaffold, 0) >= cfg.bucket_size:
                    score *= cfg.penalty
                else:
                    self.buckets[scaffold] = self.buckets.get(scaffold, 0) + 1
            self.cache[smi] = [float(total), score]
            self.history.append(float(total))
            self.calls += 1
            filtered.append(score)
            if cfg.replay_size and score >= cfg.min_score:
                self.memory.append([smi, score])
            self.best.append([smi, float(total), step, self.stage])
        if cfg.replay_size:
            self.memory.sort(key=lambda m: -m[1])  # stable: earlier molecules first among equals
            del self.memory[cfg.replay_size:]
        self.best.sort(key=lambda m: -m[1])
        del self.best[cfg.top_k:]
        return filtered

    def replay(self, seed: int, step: int) -> list[list]:
        """The memory entries this step replays, all ranks together (the same on every rank)."""
        k = min(self.cfg.replay_samples, len(self.memory)) if self.cfg.replay_size else 0
        if not k:
            return []
        rng = random.Random(f"{seed}/{self.stage}/{step}/replay")
        if self.cfg.replay_weighting == "score":
            # weighted sampling without replacement (Efraimidis and Spirakis 2006: the k largest
            # u^(1/w) are a draw of k, one by one, each in proportion to the weights left)
            keys = [rng.random() ** (1.0 / (max(m[1], 0.0) + 1e-10)) for m in self.memory]
            return [self.memory[i] for i in sorted(heapq.nlargest(k, range(len(keys)), key=keys.__getitem__))]
        return [self.memory[i] for i in sorted(rng.sample(range(len(self.memory)), k))]

    def next_stage(self) -> None:
        """A new stage: its own cache, buckets and memory (the calls and the best carry)."""
        self.stage += 1
        self.stage_steps = 0
        self.cache, self.buckets, self.memory = {}, {}, []

    # ------------------------------------------------------------ figures
    @property
    def spent(self) -> bool:
        return bool(self.cfg.max_oracle_calls) and self.calls >= self.cfg.max_oracle_calls

    def top_scores(self, k: int) -> list[float]:
        """The best k raw scores so far, best first."""
        return heapq.nlargest(k, self.history)

    def top_mean(self, k: int = 10) -> float:
        """The mean raw score of the best k molecules scored so far (fewer: their mean)."""
        top = sorted(self.history, reverse=True)[:k]
        return sum(top) / len(top) if top else 0.0

    def scaffolds_found(self) -> int:
        """Scaffolds with at least one molecule at or above ``min_score`` (this stage)."""
        return sum(1 for n in self.buckets.values() if n > 0)

    def state_dict(self) -> dict:
        return {"calls": self.calls, "stage": self.stage, "stage_steps": self.stage_steps, "cache": self.cache,
                "buckets": self.buckets, "memory": self.memory, "history": self.history, "best": self.best,
                "unfinished": self.unfinished, "stall": self.stall}

    def load_state_dict(self, state: dict, where: str) -> None:
        try:
            calls, history = int(state["calls"]), [float(x) for x in state["history"]]
            if calls != len(history):
                raise ValueError(f"{calls} calls but {len(history)} scores")
            self.calls, self.history = calls, history
            self.stage, self.stage_steps = int(state["stage"]), int(state["stage_steps"])
            self.cache = {str(k): [float(v[0]), float(v[1])] for k, v in state["cache"].items()}
            self.buckets = {str(k): int(v) for k, v in state["buckets"].items()}
            self.memory = [[str(s), float(v)] for s, v in state["memory"]]
            self.best = [[str(s), float(v), int(t), int(g)] for s, v, t, g in state["best"]]
            self.unfinished = int(state.get("unfinished", 0))
            self.stall = int(state.get("stall", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: the goal run's ledger is malformed ({exc})") from None


def pmo_auc(history: list[float], budget: int, k: int = 10, freq: int = 100) -> float:
    """PMO's area under the top-``k`` curve (Gao et al. 2022; mol_opt's ``top_auc`` with
    ``finish``): the curve starts at 0, is read every ``freq`` calls (the mean of the best
    ``k`` of the first n calls, or of all of them while fewer) and at the last call, is
    joined by trapezoids, held at its last value to ``budget`` when the run stopped early,
    and the area is divided by ``budget``. One pass with a heap of the best k."""
    n = min(len(history), budget)
    if n == 0:
        return 0.0
    heap: list[float] = []
    total = 0.0  # the sum of the heap
    area, prev, called = 0.0, 0.0, 0
    for i, v in enumerate(history[:n], 1):
        if len(heap) < k:
            heapq.heappush(heap, v)
            total += v
        elif v > heap[0]:
            total += v - heapq.heapreplace(heap, v)
        if i % freq == 0 and i < n:
            now = total / len(heap)
            area += freq * (now + prev) / 2
            prev, called = now, i
    now = total / len(heap)
    area += (n - called) * (now + prev) / 2
    area += (budget - n) * now
    return area / budget
