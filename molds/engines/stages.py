"""The pipeline's stage modules: the single-device decoder (``molds.models``) as a list of
layers DeepSpeed's ``PipelineModule`` (and ``DualPipeVModule``) can cut anywhere.

Every layer takes and returns the fixed-shape tuple (hidden [B*S, H], position_ids [B, S],
document_ids [B, S]) and rebuilds its packed attention layout from the ids, so any block can
sit on any stage and only hidden states cross stages. hidden holds the real tokens first
(in the layout's order) and zeros after, so its shape never changes. Each layer carries its
key in the single-device model's initialization (``part``), so that a pipeline rank that
built its stages on the meta device draws the same weights for them as the model built
whole (``materialize_stages``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.decoder import CausalDecoder, PackedLayout, materialize_part, materialize_weight, rope_cos_sin
from ..models.moe import MoEDecoderLayer
from .chunks import Exchange


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` [T, H] followed by zero rows up to ``rows``: the fixed stage shape."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if rows > x.shape[0] else x


def _layout(position_ids, document_ids):
    return PackedLayout.of(document_ids, position_ids)


class EmbedPipe(nn.Module):
    """Stage entry: token ids -> hidden [B*S, H] (real tokens first, zeros after)."""

    part = ("embed",)  # its key in the single-device model's initialization

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, inputs):
        input_ids, position_ids, document_ids = inputs
        layout = _layout(position_ids, document_ids)
        x = F.embedding(layout.to_flat(input_ids), self.weight)
        return _pad_rows(x, input_ids.numel()), position_ids, document_ids


class BlockPipe(nn.Module):
    """One decoder block (dense or MoE) on the stage tuple."""

    def __init__(self, block: nn.Module, head_dim: int, rope_theta: float, index: int = 0):
        super().__init__()
        self.block, self.head_dim, self.rope_theta = block, head_dim, rope_theta
        self.part = ("layer", index)  # block ``index`` of the single-device model

    def _open(self, inputs):
        """The real tokens' rows (and filler rows up to a multiple of 64 for a dense block on
        a CPU in bf16, as the single-device decoder rounds them: oneDNN's GEMM shapes then
        repeat) and what attention needs for them."""
        hidden, position_ids, document_ids = inputs
        multiple = 1
        if hidden.device.type == "cpu" and hidden.dtype in (torch.bfloat16, torch.float16) \
                and not isinstance(self.block, MoEDecoderLayer):  # MoE routing must see real tokens only
            multiple = CausalDecoder.CPU_BF16_ROW_MULTIPLE
        layout = PackedLayout.of(document_ids, position_ids, multiple)
        rows = min(layout.rows, hidden.shape[0])
        if rows != layout.rows:  # the stage tuple has fewer rows than the rounding wants: exact rows
            layout = PackedLayout.of(document_ids, position_ids, 1)
            rows = layout.rows
        cos, sin = rope_cos_sin(layout.positions, self.head_dim, self.rope_theta, hidden.dtype)
        return hidden[:rows], cos, sin, layout

    def forward(self, inputs):
        hidden, position_ids, document_ids = inputs
        y = self.block(*self._open(inputs))
        return _pad_rows(y, hidden.shape[0]), position_ids, document_ids

    def pipeline_parts(self):
        """An MoE block with expert parallelism cut at its two all-to-alls, for a schedule
        that interleaves two micro-batches (``molds.engines.chunks``); None: run it whole."""
        block = self.block
        if not isinstance(block, MoEDecoderLayer) or block.ep_size == 1 or block.reference:
            return None

        def route(inputs):
            st = block.attention_and_route(*self._open(inputs))
            return MoECarry(inputs[0].shape[0], inputs[1], inputs[2], st)

        def experts(c):
            block.arrange_for_return(block.run_experts(block.arrange_received(c.st)))
            return c

        def aggregate(c):
            return _pad_rows(block.aggregate(c.st), c.rows), c.position_ids, c.document_ids

        def put(c, x):
            c.st.x = x
            return c

        return [route,
                Exchange("dispatch", lambda c: c.st.x, put, lambda c: block.dispatch_splits(c.st), block.ep_group,
                         prepare=lambda c: block.exchange_counts(c.st)),
                experts,
                Exchange("combine", lambda c: c.st.x, put, lambda c: block.combine_splits(c.st), block.ep_group),
                aggregate]


@dataclass
class MoECarry:
    """What passes between the parts of an MoE block inside a chunk."""

    rows: int  # the stage tuple's fixed row count
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    st: object  # molds.models.moe.RoutingState


class NormPipe(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs):
        hidden, position_ids, document_ids = inputs
        return self.norm(hidden), position_ids, document_ids


class HeadPipe(nn.Module):
    """Last stage: hidden -> logits [B, S, vocab] in packed rows (what the loss takes), or
    with ``in_loss`` what a loss with the head fused into it takes."""

    part = ("head",)

    def __init__(self, weight: nn.Parameter, in_loss: bool = False, linear=F.linear):
        super().__init__()
        self.weight, self.in_loss, self.linear = weight, in_loss, linear

    def forward(self, inputs):
        return head_in_loss_forward(self, inputs) if self.in_loss else head_forward(self, inputs, self.linear)


def head_forward(module, inputs, linear=F.linear):
    """The LM head through a (possibly tied) weight: logits of the real tokens, back in rows.
    ``linear``: the single-device head's product (an FP8 one under ``kernels.fp8_lm_head``)."""
    hidden, position_ids, document_ids = inputs
    layout = _layout(position_ids, document_ids)
    return layout.to_packed(linear(hidden[:layout.positions.numel()], module.weight))


def head_in_loss_forward(module, inputs):
    """The last stage of a decoder whose LM head runs in the loss (``kernels.triton``):
    the real tokens' hidden states, where they sit in the packed rows, the head's weight."""
    hidden, position_ids, document_ids = inputs
    layout = _layout(position_ids, document_ids)
    t = layout.positions.numel()
    return {"hidden": hidden[:t], "token_index": layout.packed_source[:t], "lm_head_weight": module.weight}


def materialize_stages(module: nn.Module, std: float, base: int, device="cpu") -> int:
    """Storage and initial weights for the stage modules a pipeline rank built from a model
    constructed on the meta device: each part drawn as the single-device model draws it
    (``molds.models.decoder``: seeded by the run's seed and the part's key), so the
    stages start from the same weights as a model built whole, and no rank ever holds more
    than its own stages. Returns how many parameters were materialized."""
    before = {id(p) for p in module.parameters() if not p.is_meta}
    for m in module.modules():
        if isinstance(m, BlockPipe):
            materialize_part(m.block, std, base, *m.part, device=device)
        elif isinstance(m, NormPipe):
            materialize_part(m.norm, std, base, device=device)  # a norm: ones
        elif isinstance(m, (EmbedPipe, HeadPipe)):
            materialize_weight(m, std, base, *m.part, device=device)
    left = [n for n, p in module.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"pipeline stage parameters without storage after materializing: {left[:5]}")
    return sum(p.numel() for p in module.parameters() if id(p) not in before)


def materializing(base_class, std: float, seed: int):
    """``base_class`` (DeepSpeed's ``PipelineModule`` or ``DualPipeVModule``) whose build
    materializes the local stages of a meta-device model right after DeepSpeed builds them,
    before it moves them to the device and broadcasts tied weights."""

    class Stages(base_class):
        def _build(self):
            super()._build()
            self.molds_materialized = materialize_stages(self, std, seed)

    Stages.__name__ = Stages.__qualname__ = base_class.__name__
    return Stages
