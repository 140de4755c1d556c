"""Deferred weight gradients (molds.models.wgrad): the input gradient at once, the weight
gradients on flush, and the same gradients as autograd's in the end."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from molds.models.loss import CausalLMLoss
from molds.models.moe import Experts, Router, moe_layers
from molds.models.wgrad import DeferrableLinear, WeightGradStore, defer_weight_grads, deferrable_grouped_mm
from tests.test_decoder import _packed_batch
from tests.test_moe import moe_model


def _batch(docs=([5, 9, 3], [12, 1, 6])):
    ids, pos, doc, _ = _packed_batch([list(d) for d in docs], 24, 40)
    return {"input_ids": ids, "position_ids": pos, "document_ids": doc, "labels": ids.masked_fill(doc < 0, -100)}


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _deferred(model):
    """Names (as ``named_parameters`` gives them) of the parameters whose gradient the
    converted model defers, wholly or in part (a tied embedding takes the LM head's)."""
    ids = set()
    for m in model.modules():
        if isinstance(m, (DeferrableLinear, Router)):
            ids.add(id(m.weight))
        elif isinstance(m, Experts):
            ids.update(id(w) for w in (m.gate, m.up, m.down))
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("over", [{}, {"shared_expert_size": 16, "top_k": 1}])
def test_deferred_weight_grads_equal_autograd_after_flush(over):
    reference = moe_model(**over)
    model = defer_weight_grads(copy.deepcopy(reference))
    deferred = _deferred(model)
    assert any(".experts." in n for n in deferred) and any(".mlp.gate." in n for n in deferred)
    assert any("q_proj" in n for n in deferred)
    head = model.lm_head.weight
    assert any(p is head for n, p in model.named_parameters() if n in deferred)
    batches = [_batch(), _batch(([7, 2], [3, 3, 8, 1]))]
    for b in batches:  # two micro-batches: the gradients accumulate
        CausalLMLoss()(reference(**b), b).backward()
    want = _grads(reference)

    x_grads = []
    store = WeightGradStore()
    with store.deferring():
        for b in batches:
            CausalLMLoss()(model(**b), b).backward()
            x_grads.append(store.pending())
        before = _grads(model)
    assert x_grads[0] > 0 and x_grads[1] == 2 * x_grads[0]
    for name, g in before.items():  # nothing deferred is there yet; everything else is, and final
        if name in deferred:  # none of it, or (a tied embedding) its own part only
            assert g is None or name == "model.embed_tokens.weight", name
        else:
            torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert store.flush() == x_grads[1] and store.pending() == 0
    got = _grads(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_outside_the_context_nothing_is_deferred():
    reference = moe_model()
    model = defer_weight_grads(copy.deepcopy(reference))
    assert model.state_dict().keys() == reference.state_dict().keys()
    b = _batch()
    a = CausalLMLoss()(reference(**b), b)
    c = CausalLMLoss()(model(**b), b)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    a.backward()
    c.backward()
    assert not WeightGradStore.active()
    want, got = _grads(reference), _grads(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert len(moe_layers(model)) == 3


def test_the_input_gradient_comes_first_and_is_final():
    """What the previous pipeline stage needs (the input's gradient) is complete before flush."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8, bias=True)
    ref = copy.deepcopy(lin)
    defer_weight_grads(lin)
    x, x_ref = torch.randn(3, 5, 16, requires_grad=True), None
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).square().sum().backward()
    store = WeightGradStore()
    with store.deferring():
        lin(x).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert lin.weight.grad is None and lin.bias.grad is None
    store.flush()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_grouped_weight_grad_with_empty_experts():
    torch.manual_seed(1)
    counts = torch.tensor([3, 0, 6, 0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(9, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 16, 24))
    store = WeightGradStore()
    with store.deferring():
        deferrable_grouped_mm(x, w, offs=offs).sin().sum().backward()
    assert w.grad is None
    store.flush()
    # per expert, by hand
    want_w, want_x, start = torch.zeros_like(w), [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x.detach()[start:start + n].requires_grad_()
        we = w.detach()[e].clone().requires_grad_()
        (xe @ we).sin().sum().backward()
        want_w[e] = we.grad
        want_x.append(xe.grad)
        start += n
    torch.testing.assert_close(w.grad, want_w, rtol=1e-5, atol=1e-6)
    assert w.grad[1].abs().max() == 0 and w.grad[3].abs().max() == 0
    torch.testing.assert_close(x.grad, torch.cat(want_x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(F.grouped_mm(x.detach(), w.detach(), offs=offs),
                               deferrable_grouped_mm(x.detach(), w.detach(), offs=offs))


def test_the_context_does_not_nest_and_clear_drops_the_queue():
    lin = defer_weight_grads(torch.nn.Linear(4, 4))
    store = WeightGradStore()
    with store.deferring():
        with pytest.raises(RuntimeError, match="already deferring"):
            with store.deferring():
                pass
        lin(torch.randn(2, 4)).sum().backward()
    assert store.pending() == 1
    store.clear()
    assert store.pending() == 0 and store.flush() == 0 and lin.weight.grad is None


def test_under_bf16_autocast_the_gradients_match_nn_linear():
    torch.manual_seed(2)
    ref = torch.nn.Linear(16, 8)
    lin = defer_weight_grads(copy.deepcopy(ref))
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = ref(x)
        b = lin(x)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a, b)
    a.float().square().sum().backward()
    store = WeightGradStore()
    with store.deferring():
        b.float().square().sum().backward()
    store.flush()
    assert lin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=2e-2, atol=2e-2)


def test_groups_are_keyed_and_run_by_key():
    """A schedule's W(chunk, mb) runs exactly what I(chunk, mb) queued, whatever the order."""
    torch.manual_seed(3)
    a, b = defer_weight_grads(torch.nn.Linear(6, 5)), defer_weight_grads(torch.nn.Linear(6, 5))
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    x = torch.randn(4, 6)
    ref_a(x).square().sum().backward()
    ref_b(x).cos().sum().backward()
    store = WeightGradStore()
    with store.deferring((0, 1)):
        a(x).square().sum().backward()
    with store.deferring((1, 0)):
        b(x).cos().sum().backward()
    assert store.pending((0, 1)) == 1 and store.pending((1, 0)) == 1 and store.pending() == 2
    assert store.run((1, 0)) == 1 and a.weight.grad is None  # b's group only
    torch.testing.assert_close(b.weight.grad, ref_b.weight.grad)
    assert store.run((1, 0)) == 0 and store.run((0, 1)) == 1 and store.pending() == 0
    torch.testing.assert_close(a.weight.grad, ref_a.weight.grad)
    with pytest.raises(RuntimeError, match="outside deferring"):
        WeightGradStore.put(lambda: None)
