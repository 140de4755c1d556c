"""The MoE decoder: its five-stage forward against its reference definition, the
auxiliary losses' gradient, routing options, and the canonical per-expert names."""

from __future__ import annotations

import pytest
import torch

from molds.models.decoder import CausalDecoder, DecoderConfig
from molds.models.moe import MoEConfig, make_moe_layer, moe_layers, use_reference_forward
from tests.test_decoder import _packed_batch


def moe_model(seed=0, **over):
    moe = dict(num_experts=4, top_k=2, expert_size=24, aux_loss_coef=0.01, z_loss_coef=0.001)
    moe.update(over)
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=40, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                        intermediate_size=48, moe=MoEConfig(**moe), qk_norm=True)
    return CausalDecoder(cfg, make_layer=make_moe_layer)


def _loss_and_grads(model, batch):
    from molds.models.loss import CausalLMLoss

    model.zero_grad()
    loss = CausalLMLoss()(model(**batch), batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("over", [{}, {"top_k": 1}, {"top_k": 4, "score": "sigmoid"}, {"shared_expert_size": 16},
                                  {"first_dense_layers": 1, "layer_interval": 2}])
def test_staged_forward_equals_the_reference(dtype, tol, over):
    ids, pos, doc, _ = _packed_batch([[5, 9, 3], [12, 1, 6]], 24, 40)
    labels = ids.masked_fill(doc < 0, -100)
    batch = {"input_ids": ids, "position_ids": pos, "document_ids": doc, "labels": labels}
    staged = moe_model(**over).to(dtype)
    reference = use_reference_forward(moe_model(**over).to(dtype))
    assert len(moe_layers(staged)) == (1 if over.get("layer_interval") else 3)
    a, ga = _loss_and_grads(staged, batch)
    b, gb = _loss_and_grads(reference, batch)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=tol * 10, atol=tol * 10, msg=name)
    assert any(".mlp.gate." in n for n in ga)  # the router learns (through the weights and the aux loss)


def test_aux_loss_reaches_the_router_gradient():
    ids, pos, doc, _ = _packed_batch([[7, 9], [12, 4]], 24, 40)
    batch = {"input_ids": ids, "position_ids": pos, "document_ids": doc, "labels": ids.masked_fill(doc < 0, -100)}
    with_aux = _loss_and_grads(moe_model(aux_loss_coef=1.0, z_loss_coef=0.0).double(), batch)[1]
    without = _loss_and_grads(moe_model(aux_loss_coef=0.0, z_loss_coef=0.0).double(), batch)[1]
    router = "model.layers.0.mlp.gate.weight"
    assert (with_aux[router] - without[router]).abs().max() > 1e-6  # the aux loss changes the router's gradient
    expert = "model.layers.2.mlp.experts.gate"  # the last block: no aux loss downstream of it
    torch.testing.assert_close(with_aux[expert], without[expert], rtol=0, atol=1e-12)  # and nothing else's


def test_capacity_drops_and_counts():
    model = moe_model(capacity_factor=0.5).train()
    ids, pos, doc, _ = _packed_batch([[20, 20], [20, 20]], 48, 40)
    model(ids, position_ids=pos, document_ids=doc)
    layer = moe_layers(model)[0]
    assert 0 < layer.stats["dropped"] < layer.stats["pairs"]


def test_canonical_names_are_per_expert_and_round_trip():
    from molds.checkpoint.state import canonical_state, load_canonical

    model = moe_model()
    state = canonical_state(model)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in state
    assert state["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (24, 32)
    assert not any(k.endswith((".experts.gate", ".experts.up")) for k in state)
    other = moe_model(seed=1)
    load_canonical(other, state, "test")
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), n
