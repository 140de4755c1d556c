"""``kernels.compile_regions``: the decoder's elementwise regions compiled by inductor.

Why: on a CPU (and for small models on a GPU) RoPE, SwiGLU and RMSNorm are a handful
of memory-bound elementwise ops each; ``torch.compile(dynamic=True)`` fuses each region
into one kernel forward and one backward, for every shape (packed batches change
length every step). Compiled once per process (about 10 s on a CPU, then cached on
disk); needs a C++ compiler on CPU. The math is the eager functions' own
(``tests/test_decoder.py`` checks loss and gradients against eager).
"""

from __future__ import annotations

import functools

import torch

from ..models.decoder import MLP, Attention, RMSNorm
from ..models.moe import Experts, SharedExpert


@functools.cache
def compiled(fn):
    """``fn`` compiled once per process for every shape."""
    return torch.compile(fn, dynamic=True)


def compile_regions(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every decoder region attribute for its compiled version (in place)."""
    if getattr(model, "_molds_compiled_regions", False):
        return model
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.norm = compiled(module.norm)
        elif isinstance(module, Attention):
            module.rope = compiled(module.rope)
        elif isinstance(module, (MLP, Experts, SharedExpert)):
            module.act = compiled(module.act)
    model._molds_compiled_regions = True
    return model
