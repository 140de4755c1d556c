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
    b, s, h, d = 3, 20, 3, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    from molds.models.decoder import PackedLayout

    layout = PackedLayout(doc, pos)

    def slots(t):  # [B, H, S, D] -> [1, H, slots, D]
        return layout.to_slots(t.transpose(1, 2), 0.0).transpose(0, 1)[None]

    got = layout.to_tokens(layout.attend(slots(q), slots(k), slots(v))[0])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(doc)[:, None])
    real = doc >= 0
    torch.testing.assert_close(got[real], want.transpose(1, 2)[real], rtol=0, atol=1e-12)


def test_packed_loss_equals_token_layout_loss():
    from molds.models.decoder import causal_lm_loss

    torch.manual_seed(2)
    model = CausalDecoder(DecoderConfig(vocab_size=40, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2))
    model = model.double()
    ids, pos, doc, mols = _packed_batch([[5, 9, 3], [12, 1]], 20, 40)
    labels = ids.clone()
    labels[doc < 0] = -100
    for r, p, toks in mols:
        labels[r, p] = -100
    out = model(ids, position_ids=pos, document_ids=doc, labels=labels)
    torch.testing.assert_close(out["loss"], causal_lm_loss(out["logits"], labels), rtol=0, atol=1e-12)
