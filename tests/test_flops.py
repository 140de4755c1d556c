"""The FLOPs behind ``train/mfu``, the GPU check's MFU target and ``benchmarks/recipe_size.py``:
each family's ``flops_coefficients`` times the statistics its batches carry (as the data plane
writes them) against ``torch.utils.flop_counter.FlopCounterMode`` over a real forward and
backward. Attention runs on PyTorch's math backend (its products are ``bmm``, which the
counter counts; rows without padding, so that the work done is the work counted) and the MoE
model in float64, where its experts run one GEMM each (the counter has no formula for
``grouped_mm``)."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from molds.data.bucketing import encoder_decoder_batch
from molds.models import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = types.SimpleNamespace(vocab_size=61, pad=0, bos=2, eos=3)


def _model(recipe: str, **override):
    section = json.load(open(os.path.join(ROOT, "recipes", "smoke", recipe)))["model"]
    return build_model({**section, "dropout": 0.0, **override}, TOKENIZER, seed=0)


def _counted(step) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step().backward()
    return counter.get_total_flops()


def _claimed(model, stats: dict) -> float:
    return sum(c * stats[k] for k, c in model.flops_coefficients().items())


def _ids(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, TOKENIZER.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("recipe", ["dense_ddp.json", "moe_fp8.json"])
def test_decoder_flops_are_the_counted_products(recipe):
    model = _model(recipe)
    if model.config.moe is not None:
        model = model.double()
        assert model.model.layers[-1].mlp.experts.gate.dtype == torch.float64  # one GEMM per expert
    rows, length = 3, 24
    ids = _ids(rows, length)
    counted = _counted(lambda: model(ids)["logits"].double().square().mean())
    stats = {"real_tokens": rows * length, "length_sq_sum": rows * length ** 2}
    assert _claimed(model, stats) == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("heads,masked", [(0, True), (2, False), (2, True)])
def test_encoder_flops_are_the_counted_products(heads, masked):
    from molds.data.bucketing import mask_tokens

    model = _model("mlm_multitask_zero2.json", num_tasks=heads)
    rows, length = 4, 20
    ids = _ids(rows, length, 1)
    attention = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": attention}
    if masked:
        got = mask_tokens(ids.numpy(), attention.numpy(), (0,), probability=0.3, mask_id=4, vocab_size=61,
                          first_regular_id=5, special_ids=(0, 1, 2, 3))
        batch = {"input_ids": torch.as_tensor(got["input_ids"]), "attention_mask": attention,
                 "mlm_labels": torch.as_tensor(got["mlm_labels"])}

    def step():
        out = model(**batch)
        return sum(v.double().square().mean() for k, v in out.items() if k in ("logits", "predictions"))

    counted = _counted(step)
    stats = {"real_tokens": rows * length, "length_sq_sum": rows * length ** 2, "molecules": rows,
             "mlm_tokens": rows * length if masked else 0}
    assert _claimed(model, stats) == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("decoder_layers", [3, 2])
def test_encoder_decoder_flops_are_the_counted_products(decoder_layers):
    """The statistics as ``encoder_decoder_batch`` writes them for pairs (sources of one length,
    targets of another): encoder and decoder sides apart, cross-attention's keys and values
    on the source tokens."""
    model = _model("bart_forward.json", decoder_layers=decoder_layers)
    rows, s, t = 3, 17, 11
    sources = _ids(rows, s, 2).tolist()
    targets = _ids(rows, t + 1, 3).tolist()  # the decoder reads all but the last, scored on all but the first
    batch = encoder_decoder_batch(sources, targets, np.arange(rows), pad=0)
    assert (batch["attention_mask"] == 1).all() and (batch["labels"] != -100).all()  # no padding

    def step():
        return model(torch.as_tensor(batch["input_ids"]), attention_mask=torch.as_tensor(batch["attention_mask"]),
                     decoder_input_ids=torch.as_tensor(batch["decoder_input_ids"]))["logits"].double().square().mean()

    assert _claimed(model, batch["stats"]) == pytest.approx(_counted(step), rel=1e-9)


def test_the_logging_window_sums_every_statistic_the_flops_read():
    """``train/mfu``'s numerator: the window adds each micro-batch's statistics, numpy's
    integers as well (a statistic left out would count no FLOPs for it)."""
    from molds.metrics.run_report import count, new_window

    window = new_window()
    stats = [{"tokens": 16, "real_tokens": np.int64(11), "molecules": 3, "wait_s": 0.1, "length_sq_sum": 45},
             {"tokens": 16, "real_tokens": 9, "molecules": 2, "wait_s": 0.2, "length_sq_sum": np.int32(41)}]
    count(window, [{"stats": s} for s in stats])
    model = _model("dense_ddp.json")
    coefficients = model.flops_coefficients()
    assert sum(c * window["stats"][k] for k, c in coefficients.items()) == pytest.approx(
        coefficients["real_tokens"] * 20 + coefficients["length_sq_sum"] * 86)
