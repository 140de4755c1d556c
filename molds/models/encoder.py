"""RoBERTa-style encoder for MLM pre-training and property prediction (ChemBERTa /
MoLFormer's job), built from a config with HuggingFace ``transformers`` modules.

Heads: the MLM head of ``RobertaForMaskedLM`` and, with ``num_tasks > 0``, a
``RobertaClassificationHead`` on the <bos> token. The forward returns the MLM logits
and the head's predictions; ``molds.models.loss.EncoderLoss`` scores them (masked
binary cross-entropy for sparse multi-task classification or masked MSE for
regression, missing labels carrying no loss). A regression head predicts labels
standardized by the training split's mean and standard deviation (``label_mean``,
``label_std``: buffers, so the checkpoint keeps them); its predictions are in the labels'
own units and the loss divides their error by ``label_std``. With ``molecule_features`` the
heads (``FeatureHead``) also read the molecule's features (``molds.chemistry.features``),
standardized by the training split's ``feature_mean`` and ``feature_std`` (buffers too). The module names match ``RobertaForMaskedLM`` / ``RobertaForSequenceClassification``
so ``molds-export`` writes either without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import RobertaConfig, RobertaForMaskedLM
from transformers.models.roberta.modeling_roberta import RobertaClassificationHead


@dataclass
class EncoderConfig:
    vocab_size: int
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    intermediate_size: int = 0
    max_position_embeddings: int = 512
    dropout: float = 0.1
    num_tasks: int = 0
    task_type: str = "classification"
    pooling: str = "bos"
    molecule_features: str = ""  # a feature set of molds.chemistry.features the heads also read ('': none)
    num_features: int = 0  # its width
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_id: int = 3

    def hf_config(self):
        return RobertaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, intermediate_size=self.intermediate_size or 4 * self.hidden_size,
            max_position_embeddings=self.max_position_embeddings + self.pad_token_id + 2, type_vocab_size=1,
            hidden_dropout_prob=self.dropout, attention_probs_dropout_prob=self.dropout,
            classifier_dropout=self.dropout, pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, num_labels=max(1, self.num_tasks),
            problem_type="multi_label_classification" if self.task_type == "classification" else "regression")


class FeatureHead(nn.Module):
    """``RobertaClassificationHead`` that reads the pooled token and the molecule's
    standardized features side by side: dense (hidden + features -> hidden), tanh, dropout,
    out_proj; the same module names."""

    def __init__(self, hidden_size: int, num_features: int, num_labels: int, dropout: float):
        super().__init__()
        self.dense = nn.Linear(hidden_size + num_features, hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, pooled, features):
        x = self.dropout(torch.cat([pooled, features.to(pooled.dtype)], dim=-1))
        return self.out_proj(self.dropout(torch.tanh(self.dense(x))))


class MoleculeEncoder(nn.Module):
    #: what a fine-tuning fork (another ``model.num_tasks``, ``task_type`` or
    #: ``molecule_features``) starts afresh: the property heads, a regression's label scale
    #: and the features' scale, by canonical name prefix
    TASK_HEADS = ("classifier.", "label_", "feature_")
    #: the recipe keys that define the heads
    TASK_KEYS = ("model.num_tasks", "model.task_type", "model.molecule_features")
    #: a feature read as further than this many standard deviations from the training mean
    #: is read at this distance (a molecule unlike any of the training split's)
    FEATURE_CLIP = 10.0

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.config = cfg
        hf = cfg.hf_config()
        self.mlm = RobertaForMaskedLM(hf)
        self.features = bool(cfg.num_tasks) and cfg.num_features > 0
        if self.features:
            self.classifier = FeatureHead(cfg.hidden_size, cfg.num_features, max(1, cfg.num_tasks), cfg.dropout)
            # the training split's mean and standard deviation of each feature
            self.register_buffer("feature_mean", torch.zeros(cfg.num_features))
            self.register_buffer("feature_std", torch.ones(cfg.num_features))
        else:
            self.classifier = RobertaClassificationHead(hf) if cfg.num_tasks else None
        self.regression = bool(cfg.num_tasks) and cfg.task_type == "regression"
        if self.regression:  # the training split's label mean and standard deviation per task
            self.register_buffer("label_mean", torch.zeros(cfg.num_tasks))
            self.register_buffer("label_std", torch.ones(cfg.num_tasks))

    def set_label_scale(self, mean, std) -> None:
        """A regression head predicts standardized labels, ``(y - mean) / std`` per task; its
        predictions come out in the labels' own units (so do the metrics, ``molds-predict`` and
        the exported model's logits)."""
        self.label_mean.copy_(torch.as_tensor(mean, dtype=self.label_mean.dtype))
        self.label_std.copy_(torch.as_tensor(std, dtype=self.label_std.dtype))

    def set_feature_scale(self, mean, std) -> None:
        """The heads read each molecule feature as ``(x - mean) / std`` (the training split's)."""
        self.feature_mean.copy_(torch.as_tensor(mean, dtype=self.feature_mean.dtype))
        self.feature_std.copy_(torch.as_tensor(std, dtype=self.feature_std.dtype))

    def forward(self, input_ids, attention_mask=None, mlm_labels=None, features=None, **_):
        hidden = self.mlm.roberta(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # a model with property heads reads its tokens' logits only where a batch is masked: a
        # fine-tune without masking leaves the MLM head out of the graph on every step alike
        out = {"logits": self.mlm.lm_head(hidden)} if self.classifier is None or mlm_labels is not None else {}
        if self.classifier is not None:
            if self.config.pooling == "mean":  # the head reads its input's first position
                mask = (input_ids != self.config.pad_token_id if attention_mask is None else attention_mask.bool())
                mask = mask.unsqueeze(-1).to(hidden.dtype)
                hidden = ((hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)).unsqueeze(1)
            if self.features:
                if features is None or features.shape[-1] != self.config.num_features:
                    raise ValueError(f"this model's heads read {self.config.num_features} molecule features "
                                     f"({self.config.molecule_features}) beside the tokens; the batch has "
                                     f"{'none' if features is None else features.shape[-1]}")
                z = ((features.float() - self.feature_mean) / self.feature_std).clamp(-self.FEATURE_CLIP,
                                                                                      self.FEATURE_CLIP)
                out["predictions"] = self.classifier(hidden[:, 0, :], z)
            else:
                out["predictions"] = self.classifier(hidden)
            if self.regression:  # the loss divides the error by the same scale: standardized MSE
                out["predictions"] = out["predictions"] * self.label_std + self.label_mean
                out["prediction_scale"] = self.label_std
        return out

    def flops_coefficients(self) -> dict[str, float]:
        """Training FLOPs of a batch = the sum over its statistics of coefficient x statistic
        (the matrix products): ``real_tokens`` x 6 x the body's weight matrices; the MLM head's
        (its dense layer and the decoder tied to the word embeddings) on every token of every
        batch without property heads, with them on the tokens of masked batches only
        (``mlm_tokens``, as ``forward`` runs it); the property heads per molecule
        (``molecules``: they read each row's first token); ``length_sq_sum`` (the sum of
        squared row lengths) x 12 x layers x hidden (attention)."""
        cfg = self.config
        body = sum(p.numel() for n, p in self.mlm.roberta.named_parameters() if p.dim() >= 2 and "embeddings" not in n)
        head = self.mlm.lm_head.dense.weight.numel() + self.mlm.lm_head.decoder.weight.numel()
        out = {"length_sq_sum": 12.0 * cfg.num_layers * cfg.hidden_size}
        if self.classifier is None:
            return out | {"real_tokens": 6.0 * (body + head)}
        heads = sum(p.numel() for p in self.classifier.parameters() if p.dim() >= 2)
        return out | {"real_tokens": 6.0 * body, "mlm_tokens": 6.0 * head, "molecules": 6.0 * heads}
