"""Scalars to TensorBoard (tags from DESIGN.md) and to ``metrics.jsonl``, on rank 0."""

from __future__ import annotations

import json
import os

# Dense bf16 peak TFLOP/s per device (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def device_peak_tflops(device, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, f"logging.peak_tflops={override}"
    import torch

    if device.type != "cuda":
        return None, "no known peak for this device (set logging.peak_tflops for MFU)"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value, f"{name}: {value} dense bf16 TFLOP/s"
    return None, f"{name}: peak unknown (set logging.peak_tflops)"


class MetricsLogger:
    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.writer = None
        self.jsonl = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def image(self, tag: str, hwc, step: int) -> None:
        """An HxWx3 uint8 image (e.g. RDKit's grid of molecules)."""
        if self.writer is not None:
            self.writer.add_image(tag, hwc, step, dataformats="HWC")

    def histogram(self, tag: str, values, step: int) -> None:
        if self.writer is not None and len(values):
            import numpy as np

            self.writer.add_histogram(tag, np.asarray(values), step)

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
                if value is not None:
                    self.writer.add_scalar(tag, value, step)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
