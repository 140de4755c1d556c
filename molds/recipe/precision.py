"""``trainer.precision`` resolved by measurement.

Whether bf16 pays depends on the chip, not on a flag list: a CPU with AMX or AVX-512 BF16
runs bf16 matrix products several times faster than fp32, one with only AVX2 emulates
them ~10-40x slower, ARM CPUs and GPUs vary. So at start each rank times an fp32 and a
bf16 matrix product of the model's own GEMM shape (tokens of a micro-batch x hidden ->
MLP width, a fraction of a second), the ranks average their rates, and ``auto`` takes
bf16 only where it measured faster. An explicit ``bf16`` runs as asked; where it
measured slower the start line says by how much. The rate of the chosen precision is also
the peak a CPU run's MFU is taken against (``train/mfu``; a GPU's comes from its data
sheet, ``molds.metrics.logger.device_peak_tflops``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime.lifecycle import cpu_description


def matmul_rate(dtype: torch.dtype, shape: tuple[int, int, int], device: torch.device, seconds: float = 0.05) -> float:
    """GFLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` on ``device`` (after two warm-up products;
    at least two timed, more until ``seconds`` have passed)."""
    m, k, n = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - start < seconds:
        a @ b
        calls += 1
        if calls >= 1000:
            break
    sync()
    return 2.0 * m * k * n * calls / (time.perf_counter() - start) / 1e9


@dataclass(frozen=True)
class Precision:
    """What ``trainer.precision`` came to on this device, and why."""

    asked: str  # auto | fp32 | bf16
    dtype: torch.dtype | None  # torch.bfloat16, or None for float32
    fp32_gflops: float
    bf16_gflops: float
    shape: tuple[int, int, int]
    device: str
    kept: bool = False  # ``auto`` on a resume: the dtype of the run it continues, not this measurement

    @property
    def name(self) -> str:
        return "bf16" if self.dtype is not None else "fp32"

    @property
    def peak_gflops(self) -> float:
        """The measured matrix rate of the chosen precision (a CPU's MFU denominator)."""
        return self.bf16_gflops if self.dtype is not None else self.fp32_gflops

    @property
    def cpu_class(self) -> str:
        """``bf16-native`` where bf16 products measured faster than fp32 (AMX, AVX-512 BF16,
        ARM's BF16), else ``fp32-only`` (AVX2 and the like): what the shipped CPU recipes
        are sized for (``run.expect``). Measured, not read off the flags, so a CPU whose
        oneDNN is held to AVX2 counts as what it runs as."""
        return "bf16-native" if self.bf16_gflops > self.fp32_gflops else "fp32-only"

    def describe(self) -> str:
        m, k, n = self.shape
        where = cpu_description() if self.device == "cpu" else self.device
        ratio = self.bf16_gflops / self.fp32_gflops if self.fp32_gflops else float("nan")
        line = (f"precision {self.asked} -> {self.name}: bf16 {self.bf16_gflops:,.1f} and fp32 "
                f"{self.fp32_gflops:,.1f} GFLOP/s per rank at {m}x{k}x{n} (bf16 {ratio:.2f}x fp32) on {where}")
        if self.kept:
            line += (f"; {self.name} kept from the checkpoint's run, which 'auto' resumes as it was (pass "
                     f"--trainer.precision fp32 or bf16 to change it)")
        return line

    def warning(self) -> str | None:
        """Said at start when an explicit choice measured slower than the other."""
        if self.asked == "bf16" and self.bf16_gflops < self.fp32_gflops:
            return (f"trainer.precision=bf16 runs, but bf16 measured {self.fp32_gflops / self.bf16_gflops:.1f}x "
                    f"slower than fp32 here (no native bf16 units): 'auto' would take fp32")
        if self.asked == "fp32" and self.bf16_gflops > 1.2 * self.fp32_gflops:
            return (f"trainer.precision=fp32 runs, but bf16 measured {self.bf16_gflops / self.fp32_gflops:.1f}x "
                    f"faster here: 'auto' would take bf16")
        return None


def micro_batch_tokens(recipe) -> int:
    """Token rows of one micro-batch: the rows every product of the model multiplies."""
    d = recipe.data
    return d.micro_batch_size * (d.seq_len if d.mode == "packed" else d.max_length)


def gemm_shape(recipe) -> tuple[int, int, int]:
    """The model's typical product: a micro-batch's tokens (at most 1,024 rows, enough for
    the rate) x hidden -> the MLP's width."""
    m, tokens = recipe.model, micro_batch_tokens(recipe)
    width = m.intermediate_size or -(-int(m.hidden_size * 8 / 3) // 64) * 64  # the decoder's default
    return min(1024, max(16, tokens)), m.hidden_size, width


def resolve_precision(asked: str, device: torch.device, shape: tuple[int, int, int],
                      agree: Callable[[list[float]], list[float]] | None = None,
                      measure: Callable = matmul_rate, resumed: str | None = None) -> Precision:
    """Measure both rates (``measure`` is the tests' stub), average them over the ranks
    (``agree``: a sum over ranks divided by their number), and choose. ``resumed``: the
    dtype (``bfloat16`` | ``float32``) of the run a resume continues. ``auto`` keeps it, so
    a resumed run computes as the uninterrupted one did even where the two rates are close
    enough for a busy machine to measure them the other way round."""
    # Three alternating rounds, the best of each: a busy machine (another job, an
    # oversubscribed thread pool) only ever slows a round down, so the fastest round is the
    # one closest to what the CPU does, and alternating keeps a slow spell from hitting one
    # dtype only (timeit's reasoning).
    rounds = [(measure(torch.float32, shape, device, seconds=0.02), measure(torch.bfloat16, shape, device, seconds=0.02))
              for _ in range(3)]
    rates = [max(r[0] for r in rounds), max(r[1] for r in rounds)]
    if agree is not None:
        rates = agree(rates)
    fp32, bf16 = rates
    if asked == "bf16":
        dtype = torch.bfloat16
    elif asked == "fp32":
        dtype = None
    elif resumed in ("bfloat16", "float32"):
        dtype = torch.bfloat16 if resumed == "bfloat16" else None
    else:
        dtype = torch.bfloat16 if bf16 > fp32 else None
    kept = asked == "auto" and resumed in ("bfloat16", "float32")
    return Precision(asked, dtype, fp32, bf16, shape, device.type if device.type != "cuda" else str(device), kept)
