"""Scalars to TensorBoard (tags from DESIGN.md) and to ``metrics.jsonl``, on rank 0.

A resumed run (``start_step``) continues both from that step: ``metrics.jsonl`` keeps
only the rows up to it (rewritten atomically) and TensorBoard purges the events after
it (``purge_step``), so neither holds duplicated or stale steps. ``rewind`` does the
same in the middle of a run (a rollback).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

from ..chemistry import quiet_rdkit
from ..runtime.atomic import write_text

# Dense bf16 peak TFLOP/s per device (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def device_peak_tflops(device, override: float | None, precision=None) -> tuple[float | None, str]:
    """The peak ``train/mfu`` is taken against, per rank, and where it comes from: the
    recipe's ``logging.peak_tflops``; a known GPU's dense bf16 rate; on a CPU the matrix
    rate measured at start for the chosen precision (``precision``: molds.recipe.precision's)."""
    if override:
        return override, f"logging.peak_tflops={override}"
    if device.type != "cuda":
        if precision is not None and precision.peak_gflops > 0:
            m, k, n = precision.shape
            return precision.peak_gflops / 1000, (f"measured {precision.name} matrix rate per rank at {m}x{k}x{n}: "
                                                  f"{precision.peak_gflops:,.1f} GFLOP/s")
        return None, "no known peak for this device (set logging.peak_tflops for MFU)"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value, f"{name}: {value} dense bf16 TFLOP/s"
    return None, f"{name}: peak unknown (set logging.peak_tflops)"


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (a torn last line, from a killed run, is dropped)."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
    return rows


class MetricsLogger:
    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool, start_step: int | None = None):
        self.enabled, self.output_dir, self.tensorboard = enabled, output_dir, tensorboard
        self.writer = None
        self.jsonl = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._open(start_step)

    def _open(self, start_step: int | None) -> None:
        path = os.path.join(self.output_dir, "metrics.jsonl")
        if start_step is None:
            write_text(path, "")
        else:
            kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= start_step]
            write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self.jsonl = open(path, "a", encoding="utf-8")
        if self.tensorboard:
            purge = None if start_step is None else start_step + 1
            self.writer = SummaryWriter(os.path.join(self.output_dir, "tensorboard"), purge_step=purge)

    def rewind(self, step: int) -> None:
        """Forget everything logged after ``step`` (a rollback to that step's checkpoint)."""
        if not self.enabled:
            return
        self.close()
        self._open(step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def series(self, tag: str, value: float, x: int) -> None:
        """A TensorBoard scalar whose x-axis is not the step (a goal run's oracle calls)."""
        if self.writer is not None:
            self.writer.add_scalar(tag, value, x)

    def image(self, tag: str, hwc, step: int) -> None:
        """An HxWx3 uint8 image (e.g. RDKit's grid of molecules)."""
        if self.writer is not None:
            self.writer.add_image(tag, hwc, step, dataformats="HWC")

    @quiet_rdkit
    def molecules(self, tag: str, smiles: list, step: int, n: int, legends: list | None = None) -> None:
        """The first ``n`` molecules RDKit reads, drawn as a grid (legend: the SMILES, or
        ``legends``)."""
        if self.writer is None or n <= 0:
            return
        from rdkit import Chem  # here: a rank that only trains loads no RDKit
        from rdkit.Chem import Draw  # here: a rank that only trains loads no RDKit

        mols, names = [], []
        for i, s in enumerate(smiles):
            mol = Chem.MolFromSmiles(s) if s else None
            if mol is not None:
                mols.append(mol)
                names.append(legends[i] if legends is not None else (s if len(s) <= 40 else s[:37] + "..."))
            if len(mols) == n:
                break
        if mols:
            img = Draw.MolsToGridImage(mols, molsPerRow=4, subImgSize=(250, 250), legends=names)
            self.image(tag, np.asarray(img.convert("RGB")), step)

    def histogram(self, tag: str, values, step: int) -> None:
        if self.writer is not None and len(values):
            self.writer.add_histogram(tag, np.asarray(values), step)

    def counts(self, tag: str, counts: list, step: int) -> None:
        """A histogram given as counts per integer bucket 0, 1, ... (tokens per expert)."""
        if self.writer is None or not counts or not sum(counts):
            return
        c = np.asarray(counts, dtype=np.float64)
        ids = np.arange(len(c), dtype=np.float64)
        self.writer.add_histogram_raw(tag, min=0.0, max=float(len(c) - 1), num=float(c.sum()),
                                      sum=float((ids * c).sum()), sum_squares=float((ids * ids * c).sum()),
                                      bucket_limits=(ids + 0.5).tolist(), bucket_counts=c.tolist(), global_step=step)

    def binned(self, tag: str, edges: list, shares: list, step: int) -> None:
        """A histogram given as shares per bin between ``edges`` (the property histograms of
        ``molds.metrics.distribution``)."""
        if self.writer is None or not shares or not sum(shares):
            return
        e, c = np.asarray(edges, dtype=np.float64), np.asarray(shares, dtype=np.float64)
        mid = (e[:-1] + e[1:]) / 2
        self.writer.add_histogram_raw(tag, min=float(e[0]), max=float(e[-1]), num=float(c.sum()),
                                      sum=float((mid * c).sum()), sum_squares=float((mid * mid * c).sum()),
                                      bucket_limits=e[1:].tolist(), bucket_counts=c.tolist(), global_step=step)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """The run's settings beside its final metrics (TensorBoard's HPARAMS tab)."""
        if self.writer is not None:
            keep = {k: v for k, v in hparams.items() if isinstance(v, (int, float, str, bool))}
            final = {f"hparam/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None}
            self.writer.add_hparams(keep, final, run_name="hparams")

    def scalars(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            for tag, value in values.items():
                if isinstance(value, list):
                    self.counts(tag, value, step)
                elif value is not None:
                    self.writer.add_scalar(tag, value, step)
        self.jsonl.write(json.dumps({"step": step, **{k: v for k, v in values.items() if not isinstance(v, list)}})
                         + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
