"""Kernel and precision converters, applied to a model after it is built.

A model file never imports Triton or knows about fused kernels: it keeps its
elementwise regions as module attributes (``RMSNorm.norm``, ``MLP.act``,
``Attention.rope``) and a converter here swaps them (torchtitan's Float8 converter is
the pattern). The recipe's ``kernels`` section chooses the converters; ``apply_kernels``
is the one place they are applied, in a fixed order.
"""

from __future__ import annotations


def apply_kernels(model, kernels) -> object:
    """``model`` with the converters the recipe's ``kernels`` section asks for."""
    if kernels.compile_regions:
        from .compile_regions import compile_regions

        compile_regions(model)
    return model
