"""The training objectives, outside the models' forward.

Models return logits (and, for encoders with property heads, predictions); a loss
module turns them and the batch's targets into one scalar. Engines call the loss where
the outputs are: the whole model for ddp and ZeRO, the last pipeline stage for the
pipeline engine (``PipelineModule(loss_fn=...)``). MoE auxiliary losses never pass
through here: each MoE layer attaches its own to the gradient (``molds.models.moe``).

Every loss is a mean over the positions that carry a target, computed in at least
fp32, so that ``sum over micro-batches / number of micro-batches`` is what the engines
average.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..chemistry.tokens import IGNORE_INDEX

#: batch keys that are targets (the loss reads them), not model inputs
TARGET_KEYS = ("labels", "mlm_labels", "label_mask", "prior_logp", "score", "weight", "norm")


def has_targets(batch: dict) -> bool:
    return any(batch.get(k) is not None for k in ("labels", "mlm_labels"))


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 logits are upcast, fp64 kept)."""
    return logits.float() if logits.element_size() < 4 else logits


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None = None):
    """Next-token cross entropy, HF convention: position i predicts ``labels[i + 1]``.
    With ``document_ids`` (packed rows) a position never predicts the first token of
    the next molecule, whatever the labels say."""
    targets = labels[:, 1:]
    if document_ids is not None:
        targets = targets.masked_fill(document_ids[:, 1:] != document_ids[:, :-1], IGNORE_INDEX)
    return F.cross_entropy(upcast(logits[:, :-1]).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def masked_task_loss(pred: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None, task_type: str,
                     scale: torch.Tensor | None = None):
    """Mean over the labels that are present (``mask``): BCE with logits, or MSE (of the error
    divided by ``scale`` per task: the MSE of standardized labels)."""
    if mask is None:
        mask = torch.ones_like(labels, dtype=torch.bool)
    mask = mask.bool()
    if task_type == "classification":
        per = F.binary_cross_entropy_with_logits(pred, labels, reduction="none")
    else:
        error = (pred - labels) if scale is None else (pred - labels) / scale.to(pred.dtype)
        per = torch.where(mask, error, torch.zeros_like(error)) ** 2  # a missing label may be NaN
    per = per * mask
    return per.sum() / mask.sum().clamp(min=1)


def next_token_targets(labels: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S]: the target of each position (``causal_lm_loss``'s), ``IGNORE_INDEX`` where
    there is none (the last position, a molecule's last token, padding)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    if document_ids is not None:
        targets[:, :-1].masked_fill_(document_ids[:, 1:] != document_ids[:, :-1], IGNORE_INDEX)
    return targets


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of the LM head ``hidden @ weight^T`` (the plain composition;
    ``kernels.triton`` swaps in a fused one that never holds the full logits)."""
    return F.cross_entropy(upcast(F.linear(hidden, weight)), targets, ignore_index=IGNORE_INDEX)


class CausalLMLoss:
    """Decoders: next-token cross entropy within each molecule. A decoder whose LM head
    runs in the loss (``CausalDecoder.head_in_loss``) hands over its final hidden states
    (``hidden`` [T, H], the rows of the flattened [B x S] positions in ``token_index``)
    and the head's weight instead of logits."""

    def __init__(self):
        self.linear_cross_entropy = linear_cross_entropy  # molds.kernels may fuse it

    def __call__(self, outputs: dict, batch: dict) -> torch.Tensor:
        if "logits" in outputs:
            return causal_lm_loss(outputs["logits"], batch["labels"], batch.get("document_ids"))
        targets = next_token_targets(batch["labels"], batch.get("document_ids")).reshape(-1)
        return self.linear_cross_entropy(outputs["hidden"], outputs["lm_head_weight"],
                                         targets.index_select(0, outputs["token_index"]))


class Seq2SeqLoss:
    """The encoder-decoder: cross entropy of each decoder position against its label (the
    batch's ``labels`` are already the next tokens, ``target <eos>``, padding ignored)."""

    def __call__(self, outputs: dict, batch: dict) -> torch.Tensor:
        logits = outputs["logits"]
        return F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                               ignore_index=IGNORE_INDEX)


class EncoderLoss:
    """Encoders: masked-token cross entropy (when the batch is masked) plus the masked
    property loss (when the model has heads and the batch has labels)."""

    def __init__(self, task_type: str):
        self.task_type = task_type

    def __call__(self, outputs: dict, batch: dict) -> torch.Tensor:
        losses = []
        if batch.get("mlm_labels") is not None and "logits" in outputs:
            logits = outputs["logits"]
            losses.append(F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]),
                                          batch["mlm_labels"].reshape(-1), ignore_index=IGNORE_INDEX))
        if batch.get("labels") is not None and "predictions" in outputs:
            losses.append(masked_task_loss(upcast(outputs["predictions"]), batch["labels"].to(
                upcast(outputs["predictions"]).dtype), batch.get("label_mask"), self.task_type,
                outputs.get("prediction_scale")))
        if not losses:
            raise ValueError("the batch has no target this model can be trained on")
        return sum(losses)


def sequence_log_likelihood(outputs: dict, batch: dict) -> torch.Tensor:
    """[B]: each row's log-likelihood, the sum over its molecule's tokens of log P(token |
    the tokens before it) (rows as ``molds.goal`` lays them out: bos, the molecule's tokens,
    eos, then padding that ``document_ids`` marks -1), from logits or from the hidden
    states and head weight a fused-head decoder hands over."""
    labels = batch["labels"]
    targets = next_token_targets(labels, batch.get("document_ids"))
    if "logits" in outputs:
        logits = upcast(outputs["logits"])
        flat = logits.reshape(-1, logits.shape[-1])
        picked = targets.reshape(-1)
    else:  # the real tokens' hidden states and where they sit in the [B x S] positions
        flat = upcast(F.linear(outputs["hidden"], outputs["lm_head_weight"]))
        picked = targets.reshape(-1).index_select(0, outputs["token_index"])
    nll = F.cross_entropy(flat, picked, ignore_index=IGNORE_INDEX, reduction="none")
    if "logits" in outputs:
        return -nll.view(labels.shape).sum(dim=1)
    per_row = torch.zeros(labels.numel(), dtype=nll.dtype, device=nll.device)
    per_row.index_add_(0, outputs["token_index"], nll)
    return -per_row.view(labels.shape).sum(dim=1)


class AugmentedLikelihoodLoss:
    """REINVENT's objective for goal-directed fine-tuning: the agent's log-likelihood of
    each sampled (or replayed) molecule is pulled toward the prior's plus ``sigma`` times
    its score, ``(log P_prior + sigma * score - log P_agent)^2``. The batch carries
    ``prior_logp`` and ``score`` per row, and ``norm``: the rows of the whole step over the
    ranks (a rank's loss is its rows' sum over ``norm / world``, so that the data-parallel
    mean of the ranks' gradients is the gradient of the mean over every row, whatever
    each rank holds)."""

    def __init__(self, sigma: float, likelihood_penalty: float = 0.0):
        self.sigma, self.likelihood_penalty = float(sigma), float(likelihood_penalty)

    def __call__(self, outputs: dict, batch: dict) -> torch.Tensor:
        agent = sequence_log_likelihood(outputs, batch)
        target = batch["prior_logp"].to(agent.dtype) + self.sigma * batch["score"].to(agent.dtype)
        per_row = (target - agent) ** 2
        if self.likelihood_penalty:
            # the original REINVENT's regularizer, - 1 / log P_agent per row: it grows as a
            # sequence's likelihood nears 1. log P is capped at -1e-4 so that a sequence the
            # agent is sure of gives a large, finite term (-1/0 would end the run as non-finite)
            per_row = per_row + self.likelihood_penalty * (-1.0 / agent.clamp(max=-1e-4))
        if batch.get("weight") is not None:  # rows that only keep the ranks in step weigh 0
            per_row = per_row * batch["weight"].to(agent.dtype)
        return per_row.sum() / batch["norm"].to(agent.dtype)


def build_loss(model_section) -> object:
    """The objective of a recipe's ``model`` section (a dataclass or its dict)."""
    get = model_section.get if isinstance(model_section, dict) else lambda k: getattr(model_section, k)
    if get("family") == "decoder":
        return CausalLMLoss()
    if get("family") == "seq2seq":
        return Seq2SeqLoss()
    return EncoderLoss(get("task_type"))
