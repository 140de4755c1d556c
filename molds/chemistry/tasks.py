"""Pair tasks in words, without RDKit: the tasks (``forward``, ``retro``, ``mol2mol``), the
reagent policies, ``PairOptions`` (what makes a pair of a record, recorded in a manifest) and
what a model of each task reads and writes. A checkpoint's lineage keeps the latter
(``lineage_block``), so that ``molds-predict`` and ``molds-eval`` refuse, in one line, a
manifest or an input of another direction. ``molds.chemistry.pairs`` makes the pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

TASKS = ("forward", "retro", "mol2mol")
REAGENT_POLICIES = ("auto", "mix", "separate", "drop")


@dataclass(frozen=True)
class PairOptions:
    """What makes a pair of a record; recorded in the manifest."""

    task: str = "forward"
    reagents: str = "auto"

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.reagents not in REAGENT_POLICIES:
            raise ValueError(f"reagents must be one of {', '.join(REAGENT_POLICIES)}, got {self.reagents!r}")

    @property
    def reagent_policy(self) -> str:
        """The policy ``auto`` stands for with this task."""
        if self.reagents != "auto":
            return self.reagents
        return "mix" if self.task == "forward" else "drop"

    def describe(self) -> dict:
        """The manifest's ``pairs`` block."""
        product = "source" if self.task == "retro" else "target"
        return {"task": self.task, "reagents": self.reagent_policy, "product_side": product,
                "atom_maps": "removed", "side_order": "sorted canonical SMILES"}

    def formats(self) -> tuple[str, str]:
        """What a model of these pairs reads and what it writes, in words (a checkpoint's
        lineage keeps them; ``molds-predict`` names them when it refuses an input)."""
        policy = self.reagent_policy
        if self.task == "forward":
            source = {"separate": "reactants>reagents", "mix": "reactants and reagents, one '.'-joined side",
                      "drop": "reactants, '.'-joined"}[policy]
            return source, "products"
        if self.task == "retro":
            return "a product", ("reactants and reagents, '.'-joined" if policy == "mix" else "reactants")
        return "a molecule", "a molecule"


def direction(block: dict | None) -> str:
    """A manifest's or a checkpoint's ``pairs`` block in words: ``retro (a product ->
    reactants)``; ``molecules`` where there is none."""
    if not block:
        return "molecules"
    if "source_format" not in block:  # a manifest's block: its formats as a lineage keeps them
        block = lineage_block(block)
    return f"{block.get('task')} ({block['source_format']} -> {block['target_format']})"


def same_direction(trained: dict | None, given: dict | None) -> bool:
    """Do a checkpoint's pairs (task, reagent policy) and a manifest's agree? Molecules
    (``None``) agree with molecules only."""
    if not trained or not given:
        return not trained and not given
    return trained.get("task") == given.get("task") and trained.get("reagents") == given.get("reagents")


def lineage_block(pairs: dict | None) -> dict | None:
    """What a checkpoint's lineage keeps of its manifest's ``pairs`` block: the task, the
    reagent policy, where the pairs were read from and what the model reads and writes."""
    if not pairs:
        return None
    if "reagents" in pairs:
        source, target = PairOptions(pairs.get("task", "forward"), pairs["reagents"]).formats()
    else:  # source and target columns: no reagents
        source, target = {"forward": ("reactants", "products"), "retro": ("a product", "reactants")}.get(
            pairs.get("task"), ("a molecule", "a molecule"))
    return {**{k: pairs[k] for k in ("task", "reagents", "read_from") if k in pairs},
            "source_format": source, "target_format": target}
