"""The recipe: one typed dataclass per section; the signatures are the schema.

Sections land here as the issues that own them do; ``data`` is the data plane's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class DataConfig:
    """What the training data plane reads and how it batches it."""

    manifest: str = ""
    """Directory of a ``molds-preprocess`` output (or its manifest.json), local or fsspec URI."""

    split: str = "train"
    """Which split to stream."""

    mode: Literal["packed", "bucketed"] = "packed"
    """``packed``: molecules packed into fixed ``seq_len`` rows (causal LMs);
    ``bucketed``: length-grouped batches under a token budget (encoders, property prediction)."""

    seq_len: int = 512
    """Packed row length in tokens (BOS and EOS included)."""

    micro_batch_size: int = 8
    """Rows per packed batch; rows per batch in ``fixed_shape`` bucketed mode."""

    lookahead: int = 512
    """Molecules the packer may choose from when it closes a row."""

    shuffle: bool = True
    """Shuffle units and rows each epoch (seeded by ``seed`` and the epoch)."""

    shuffle_window: int = 16384
    """Molecules permuted together after the unit/row shuffle (0 or 1: off)."""

    seed: int = 0
    """Seed of every data-side random choice (order, windows, masking)."""

    too_long: Literal["truncate", "reject"] = "truncate"
    """A molecule longer than ``seq_len`` (packed) or ``max_length`` (bucketed): truncate or
    drop it; either way it is counted."""

    max_tokens_per_batch: int = 8192
    """Bucketed: padded tokens (rows x longest) per batch at most."""

    bucket_pool: int = 1600
    """Bucketed: molecules sorted together to form length-grouped batches."""

    max_length: int = 256
    """Bucketed: longest molecule in tokens (BOS/EOS included)."""

    fixed_shape: bool = False
    """Bucketed: every batch exactly ``micro_batch_size`` x ``max_length`` (pipeline engines)."""

    mlm_probability: float = 0.0
    """Bucketed: BERT masking rate (0 disables MLM masking)."""

    with_labels: bool = False
    """Bucketed: return the manifest's ``labels`` with a missing-value mask."""

    verify: Literal["eager", "lazy", "off"] = "eager"
    """Check every shard's sha256 and row count before training (eager) or when first opened (lazy)."""

    on_bad_shard: Literal["error", "skip"] = "error"
    """A shard that fails verification: stop with its name, or skip it and report (eager only)."""

    num_workers: int = 0
    """DataLoader worker processes per rank (each owns a disjoint part of the rank's share)."""

    max_steps: Optional[int] = None
    """Stop after this many batches on this rank (None: no limit)."""

    max_epochs: Optional[int] = None
    """Stop after this many epochs (None: iterate forever)."""

    stop_after_epoch: Optional[int] = None
    """Stop when this epoch (0-based) is finished, whatever ``max_epochs`` says."""
