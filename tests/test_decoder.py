"""The decoder on packed rows computes what each molecule alone computes."""

from __future__ import annotations

import torch

from molds.data.packing import block_causal_mask
from molds.models.decoder import CausalDecoder, DecoderConfig


def _packed_batch(lengths_per_row, seq_len, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths_per_row)
    ids = torch.zeros(b, seq_len, dtype=torch.long)
    pos = torch.zeros(b, seq_len, dtype=torch.long)
    doc = torch.full((b, seq_len), -1, dtype=torch.long)
    mols = []
    for r, lengths in enumerate(lengths_per_row):
        p = 0
        for d, n in enumerate(lengths):
            toks = torch.randint(6, vocab, (n,), generator=g)
            ids[r, p:p + n] = toks
            pos[r, p:p + n] = torch.arange(n)
            doc[r, p:p + n] = d
            mols.append((r, p, toks))
            p += n
    return ids, pos, doc, mols


def test_packed_forward_equals_each_molecule_alone():
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2))
    model = model.double().eval()
    ids, pos, doc, mols = _packed_batch([[5, 9, 3], [12, 1], []], 20, 40)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, document_ids=doc)["logits"]
        for r, p, toks in mols:
            alone = model(toks[None])["logits"][0]
            torch.testing.assert_close(packed[r, p:p + len(toks)], alone, rtol=0, atol=1e-10)


def test_layout_equals_block_mask_attention():
    torch.manual_seed(1)
    ids, pos, doc, _ = _packed_batch([[4, 7, 2, 6], [19], [3, 3, 1, 5, 8]], 20, 30)
    b, s, h, kv, d = 3, 20, 6, 2, 8  # grouped-query: 3 query heads per key/value head
    q = torch.randn(b, s, h, d, dtype=torch.float64)
    k, v = (torch.randn(b, s, kv, d, dtype=torch.float64) for _ in range(2))
    from molds.models.decoder import PackedLayout

    layout = PackedLayout(doc, pos)
    assert len(layout.groups) > 1  # several attention groups, each padded to its own longest
    got = layout.to_packed(layout.attend(layout.to_flat(q), layout.to_flat(k), layout.to_flat(v)))

    def heads_first(t):
        return t.repeat_interleave(h // t.shape[2], dim=2).transpose(1, 2)

    want = torch.nn.functional.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                                            attn_mask=block_causal_mask(doc)[:, None])
    real = doc >= 0
    torch.testing.assert_close(got[real], want.transpose(1, 2)[real], rtol=0, atol=1e-12)
    assert torch.all(got[~real] == 0)


def test_packed_loss_never_pairs_two_molecules():
    """The loss lives outside the model (molds.models.loss): even with labels that do not
    mask molecule starts, the packed loss is the mean over each molecule's own
    next-token pairs (what HF computes molecule by molecule)."""
    from molds.models.loss import CausalLMLoss

    torch.manual_seed(3)
    model = CausalDecoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2))
    model = model.double()
    ids, pos, doc, mols = _packed_batch([[5, 9, 3], [12, 1, 4]], 20, 40)
    labels = ids.masked_fill(doc < 0, -100)
    batch = {"input_ids": ids, "position_ids": pos, "document_ids": doc, "labels": labels}
    packed = CausalLMLoss()(model(**batch), batch)
    nll, pairs = 0.0, 0
    for _, _, toks in mols:
        logits = model(toks[None])["logits"][0]
        nll = nll + torch.nn.functional.cross_entropy(logits[:-1], toks[1:], reduction="sum")
        pairs += len(toks) - 1
    torch.testing.assert_close(packed, nll / pairs, rtol=0, atol=1e-12)


def _assert_trains_as_eager(eager, other, lengths, seq_len, loss_rtol, grad_rtol, call=None):
    """``other`` (``call``: how it is called, default itself) gives ``eager``'s loss and
    parameter gradients on packed rows of these molecule lengths."""
    from molds.models.loss import CausalLMLoss

    ids, pos, doc, _ = _packed_batch(lengths, seq_len, 40)
    batch = {"input_ids": ids, "position_ids": pos, "document_ids": doc, "labels": ids.masked_fill(doc < 0, -100)}
    losses = []
    for model, module in ((eager, eager), (other if call is None else call, other)):
        module.zero_grad()
        loss = CausalLMLoss()(model(**batch), batch)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=loss_rtol, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), other.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=grad_rtol, atol=1e-6, msg=name)


def test_compiled_regions_match_eager():
    """kernels.compile_regions: the inductor-fused RoPE / SwiGLU / RMSNorm give the eager
    model's loss and gradients, on packed rows of a shape the compile never saw."""
    from molds.kernels.compile_regions import compile_regions

    torch.manual_seed(4)
    cfg = dict(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    eager = CausalDecoder(DecoderConfig(**cfg))
    fused = compile_regions(CausalDecoder(DecoderConfig(**cfg)))
    fused.load_state_dict(eager.state_dict())
    for lengths, seq_len in (([[5, 9, 3], [12, 1]], 20), ([[7, 7, 2, 11], [4, 13]], 28)):
        _assert_trains_as_eager(eager, fused, lengths, seq_len, loss_rtol=1e-5, grad_rtol=1e-4)


def test_whole_model_compile_on_packed_rows_stops_recompiling_and_matches_eager():
    """parallel.compile: torch.compile of the whole decoder on packed rows, whose molecule
    count, lengths and token count change every batch. The layout's construction and its
    grouped attention are data-dependent and run eagerly (a graph break each); the rest
    compiles for every token count after the second shape. Before, dynamo guarded on each
    batch's attention groups and compiled anew for every batch until its recompile limit."""
    import torch._dynamo

    torch.manual_seed(5)
    cfg = dict(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    eager = CausalDecoder(DecoderConfig(**cfg))
    compiled_model = CausalDecoder(DecoderConfig(**cfg))
    compiled_model.load_state_dict(eager.state_dict())
    graphs = []

    def backend(gm, example_inputs):  # counts the graphs dynamo hands over, runs them as they are
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend=backend)
    batches = [([[5, 9, 3], [12, 1]], 20), ([[7, 7, 2, 11], [4, 13]], 28), ([[3], [2, 2, 2, 9]], 16),
               ([[17, 1], [6, 6, 6]], 24), ([[2, 3, 4, 5], [11]], 20), ([[13, 13], [1, 1, 1, 8]], 30)]
    counts = []
    try:
        for lengths, seq_len in batches:
            _assert_trains_as_eager(eager, compiled_model, lengths, seq_len, loss_rtol=1e-6, grad_rtol=1e-5,
                                    call=compiled)
            counts.append(len(graphs))
    finally:
        torch._dynamo.reset()
    assert counts[1] > counts[0]  # the second shape makes the token count dynamic
    assert counts[2:] == [counts[1]] * (len(batches) - 2), counts  # and then nothing compiles again


def test_cpu_bf16_autocast_runs_attention_in_float32():
    """Under CPU bf16 autocast, attention runs in float32 on the bf16 inputs and comes
    back in bf16: autocast would otherwise send it to torch's bf16 CPU flash-attention
    kernel, whose backward is several times slower than the float32 one."""
    from molds.models.decoder import causal_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 8, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, 9, 8, generator=g).bfloat16().requires_grad_() for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = causal_attention(q, k, v)
    assert got.dtype == torch.bfloat16
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, want.bfloat16(), rtol=0, atol=0)  # one rounding, at the end
    g_out = torch.randn(got.shape, generator=g)
    got.backward(g_out.bfloat16())
    want.backward(g_out.bfloat16().float())
    for mine, ref in ((q, q32), (k, k32), (v, v32)):
        assert mine.grad.dtype == torch.bfloat16
        torch.testing.assert_close(mine.grad, ref.grad.bfloat16(), rtol=0, atol=0)
    # fp32 inputs without autocast: the plain kernel, unchanged
    f = [t.detach().float() for t in (q, k, v)]
    torch.testing.assert_close(causal_attention(*f), torch.nn.functional.scaled_dot_product_attention(
        *f, is_causal=True, enable_gqa=True), rtol=0, atol=0)


def test_filler_rows_change_nothing():
    """Flat rows rounded up to a multiple (as a CPU in bf16 runs them): the same logits
    and the same gradient of every parameter as the exact rows (float64)."""
    from molds.models.decoder import PackedLayout

    torch.manual_seed(2)
    model = CausalDecoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2))
    model = model.double()
    ids, pos, doc, _ = _packed_batch([[5, 9, 3], [12, 1], [], [7, 7, 2]], 20, 40)
    labels = torch.where(doc >= 0, ids, torch.full_like(ids, -100))
    results = []
    for multiple in (1, 64):
        model.zero_grad()
        model._row_multiple = lambda device, m=multiple: m
        out = model(ids, position_ids=pos, document_ids=doc)["logits"]
        layout = PackedLayout.of(doc, pos, multiple)
        assert layout.rows == (layout.tokens if multiple == 1 else 64) and layout.tokens == 46
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, 40), labels.reshape(-1), ignore_index=-100)
        loss.backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=1e-12, msg=name)


def test_cpu_bf16_rounds_flat_rows_and_moe_does_not():
    from molds.models.moe import MoEConfig, make_moe_layer

    dense = CausalDecoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2))
    cpu = torch.device("cpu")
    assert dense._row_multiple(cpu) == 1  # fp32: exact rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dense._row_multiple(cpu) == CausalDecoder.CPU_BF16_ROW_MULTIPLE
    assert dense.to(torch.bfloat16)._row_multiple(cpu) == CausalDecoder.CPU_BF16_ROW_MULTIPLE  # DeepSpeed's bf16
    moe = CausalDecoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                      moe=MoEConfig(num_experts=4, top_k=2, expert_size=16)),
                        make_layer=make_moe_layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe._row_multiple(cpu) == 1
