"""The data plane: ownership, packing, bucketing, exact resume, topology change, errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from molds.chemistry.tokens import IGNORE_INDEX
from molds.data.loader import merge_states
from molds.data.manifest import Manifest, ManifestError
from molds.data.packing import block_causal_mask

from .conftest import make_loader, train_rows


def epoch_gids(loaders) -> list[np.ndarray]:
    return [np.concatenate([b["gids"].numpy() for b in ld]) for ld in loaders]


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 0), (3, 0), (4, 0), (2, 2)])
def test_every_row_once_per_epoch_across_ranks(dataset, world, workers):
    n = train_rows(dataset)
    per_rank = epoch_gids([make_loader(dataset, r, world, num_workers=workers) for r in range(world)])
    everything = np.concatenate(per_rank)
    assert len(everything) == n == len(np.unique(everything))
    assert set(everything.tolist()) == set(range(n))
    sizes = [len(g) for g in per_rank]
    assert max(sizes) - min(sizes) <= max(1, workers)  # balanced to a row per virtual rank


def test_gids_are_the_manifest_rows(dataset):
    ld = make_loader(dataset)
    batch = next(iter(ld))
    table = pq.read_table([s.path for s in ld.manifest.shards("train")][0])
    first_shard_rows = table.num_rows
    ids = [int(g) for g in batch["gids"] if g < first_shard_rows][:5]
    want = [table.column("compound_id")[i].as_py() for i in ids]
    assert ld.source.compound_ids(ids) == want


def test_epochs_reshuffle_and_seed_is_deterministic(dataset):
    a = epoch_gids([make_loader(dataset, max_epochs=2)])[0]
    b = epoch_gids([make_loader(dataset, max_epochs=2)])[0]
    n = train_rows(dataset)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[:n], a[n:])
    assert sorted(a[:n].tolist()) == sorted(a[n:].tolist()) == list(range(n))
    c = epoch_gids([make_loader(dataset, seed=5)])[0]
    assert not np.array_equal(a[:n], c)


def test_packed_rows_hold_whole_molecules(dataset):
    ld = make_loader(dataset, seq_len=256)
    table = {}
    for shard in ld.manifest.shards("train"):
        table.update({shard.path: pq.read_table(shard.path, columns=["token_ids"]).column(0).to_pylist()})
    flat_rows = [r for shard in ld.manifest.shards("train") for r in table[shard.path]]
    bos, eos = ld.specials.bos, ld.specials.eos
    total_pad = total = 0
    for batch in ld:
        ids, pos, doc, lab = (batch[k].numpy() for k in ("input_ids", "position_ids", "document_ids", "labels"))
        gids = batch["gids"].numpy().tolist()
        k = 0
        for r in range(ids.shape[0]):
            for d in range(doc[r].max() + 1):
                where = np.flatnonzero(doc[r] == d)
                assert np.all(np.diff(where) == 1)  # contiguous: never split
                toks = ids[r, where].tolist()
                assert toks == [bos] + flat_rows[gids[k]] + [eos]
                assert pos[r, where].tolist() == list(range(len(where)))
                assert lab[r, where[0]] == IGNORE_INDEX and lab[r, where[1:]].tolist() == toks[1:]
                k += 1
            pad = doc[r] < 0
            assert np.all(lab[r, pad] == IGNORE_INDEX) and np.all(ids[r, pad] == ld.specials.pad)
            if not pad.all():  # the epoch's last batch is topped up with empty rows
                total_pad += pad.sum()
                total += len(pad)
        cu = batch["cu_seqlens"].numpy()
        assert cu[-1] == ids.size
    assert k == len(gids)
    assert total_pad / total < 0.03  # tiny epoch, narrow lookahead; benchmarks/dataloader.py measures MOSES at 512


def test_packed_attention_equals_each_molecule_alone(dataset):
    torch.manual_seed(0)
    batch = next(iter(make_loader(dataset, seq_len=128)))
    doc = batch["document_ids"][:1]
    mask = block_causal_mask(doc)
    s, h, d = doc.shape[1], 2, 8
    q, k, v = (torch.randn(1, h, s, d, dtype=torch.float64) for _ in range(3))
    packed = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    for m in range(int(doc.max()) + 1):
        idx = torch.nonzero(doc[0] == m).flatten()
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx],
                                                                 is_causal=True)
        torch.testing.assert_close(packed[:, :, idx], alone, rtol=0, atol=1e-12)


def collect(ld, n=None):
    out = []
    for i, b in enumerate(ld):
        out.append({k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)})
        if n is not None and i + 1 == n:
            break
    return out


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(num_workers=2),
    dict(mode="bucketed", mlm_probability=0.15, with_labels=True, max_tokens_per_batch=600, bucket_pool=120,
         max_length=80),
    dict(mode="bucketed", fixed_shape=True, micro_batch_size=8, max_length=64, bucket_pool=64),
])
def test_resume_gives_the_uninterrupted_stream(dataset, overrides):
    full = collect(make_loader(dataset, max_epochs=2, **overrides))
    for stop in (1, 7, len(full) // 2 + 3):
        first = make_loader(dataset, max_epochs=2, **overrides)
        head = collect(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # a checkpoint stores plain JSON
        resumed = make_loader(dataset, max_epochs=2, **overrides)
        loads = []
        original = resumed.source.load
        resumed.source.load = lambda u: loads.append(u) or original(u)
        resumed.load_state_dict(state)
        it = iter(resumed)
        tail = [next(it)] if overrides.get("num_workers") else []
        if not overrides.get("num_workers"):
            tail = collect(resumed, 1)
            assert len(set(loads)) <= 8, "restoring read more than the units it needs"  # seek, never replay
            tail += collect(resumed)
        else:
            tail = [{k: v.clone() for k, v in tail[0].items() if isinstance(v, torch.Tensor)}] + collect(resumed)
        assert_same_batches(head + tail, full)


def test_world_size_change_keeps_exactly_once(dataset):
    n = train_rows(dataset)
    old = [make_loader(dataset, r, 4) for r in range(4)]
    seen = []
    for ld, steps in zip(old, (3, 5, 2, 4)):
        for b in collect(ld, steps):
            seen.append(b["gids"].numpy())
    state = merge_states([ld.state_dict() for ld in old])
    state = json.loads(json.dumps(state))
    new = [make_loader(dataset, r, 2) for r in range(2)]
    for ld in new:
        ld.load_state_dict(state)
        seen.extend(b["gids"].numpy() for b in ld)
    everything = np.concatenate(seen)
    assert len(everything) == n == len(np.unique(everything))
    with pytest.raises(ValueError, match="every old rank"):
        make_loader(dataset, 0, 2).load_state_dict(old[0].state_dict())


def test_bucketed_batches_respect_budget_labels_and_masking(dataset):
    ld = make_loader(dataset, mode="bucketed", max_tokens_per_batch=512, bucket_pool=200, max_length=80,
                     with_labels=True, mlm_probability=0.15)
    specials = set(ld.specials.ids)
    chosen = candidates = 0
    for b in ld:
        ids, att = b["input_ids"], b["attention_mask"]
        assert ids.numel() <= 512
        mlm = b["mlm_labels"]
        picked = mlm != IGNORE_INDEX
        assert not any(int(t) in specials for t in mlm[picked])
        chosen += int(picked.sum())
        candidates += int(att.sum()) - 2 * ids.shape[0]
        assert b["labels"].shape == b["label_mask"].shape == (ids.shape[0], 2)
        assert not b["label_mask"][:, 1].logical_not().any()  # y2 is never missing
    assert 0.12 < chosen / candidates < 0.18
    missing = sum(int((~b["label_mask"][:, 0]).sum()) for b in make_loader(dataset, mode="bucketed",
                                                                           with_labels=True, max_length=80))
    assert missing > 0


def _copy(dataset, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(dataset, dst)
    return str(dst)


def test_bad_shards_and_bad_configs_fail_early_with_names(dataset, tmp_path):
    data = _copy(dataset, tmp_path)
    manifest = json.load(open(os.path.join(data, "manifest.json")))
    victim = manifest["splits"]["train"][1]["uri"]
    rows, total = manifest["splits"]["train"][1]["num_rows"], manifest["stats"]["splits"]["train"]["rows"]
    with open(os.path.join(data, victim), "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x00\x01")
    with pytest.raises(ManifestError, match=victim):
        make_loader(data)
    with pytest.raises(ManifestError, match=rf"1 bad shard\(s\) skipped, {rows} of {total} rows .*max_skipped"):
        make_loader(data, on_bad_shard="skip")  # the default bound: 1 %
    ld = make_loader(data, on_bad_shard="skip", max_skipped_fraction=0.2)
    assert ld.source.skipped and ld.source.skipped[0][0] == victim
    assert ld.skipped["shards"] == 1 and ld.skipped["rows"] == rows and victim in ld.skipped_note
    assert len(np.concatenate([b["gids"].numpy() for b in ld])) == ld.source.num_rows == total - rows
    os.remove(os.path.join(data, victim))
    with pytest.raises(ManifestError, match="missing"):
        make_loader(data)
    with pytest.raises(ValueError, match="data.seq_len"):
        make_loader(dataset, seq_len=8)
    bad = _copy(dataset, tmp_path / "v")
    tok = os.path.join(bad, "tokenizer", "tokenizer.json")
    spec = json.load(open(tok))
    spec["model"]["vocab"]["Xx"] = len(spec["model"]["vocab"]) + 10
    json.dump(spec, open(tok, "w"))
    with pytest.raises(ManifestError, match="vocabulary hash"):
        make_loader(bad)
    m = json.load(open(os.path.join(bad, "manifest.json")))
    m["format_version"] = 99
    json.dump(m, open(os.path.join(bad, "manifest.json"), "w"))
    with pytest.raises(ManifestError, match="format_version"):
        make_loader(bad)


def _with_token_id(dataset, dst, token_id, statistics=True):
    """A copy of ``dataset`` whose second training shard's row 5 holds ``token_id``, re-hashed
    in the manifest (a shard written by another tokenizer, not a corrupted file)."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = _copy(dataset, dst)
    manifest = json.load(open(os.path.join(data, "manifest.json")))
    entry = manifest["splits"]["train"][1]
    path = os.path.join(data, entry["uri"])
    table = pq.read_table(path)
    rows = table.column("token_ids").to_pylist()
    rows[5] = rows[5][:2] + [token_id] + rows[5][3:]
    i = table.column_names.index("token_ids")
    table = table.set_column(i, "token_ids", pa.array(rows, pa.list_(pa.uint16())))
    pq.write_table(table, path, row_group_size=pq.ParquetFile(path).metadata.row_group(0).num_rows,
                   write_statistics=statistics)
    entry["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    json.dump(manifest, open(os.path.join(data, "manifest.json"), "w"))
    return data, entry["uri"], entry["num_rows"]


def test_token_ids_outside_the_vocabulary_are_refused_naming_shard_and_row(dataset, tmp_path):
    from molds.chemistry.tokens import tokenizer_info

    vocab = tokenizer_info(Manifest.load(dataset)).vocab_size
    collect = lambda ld: np.concatenate([b["gids"].numpy() for b in ld])  # noqa: E731
    last_id, _, _ = _with_token_id(dataset, tmp_path / "ok", vocab - 1)  # the largest id is in the vocabulary
    assert len(collect(make_loader(last_id)))
    for statistics in (True, False):  # Parquet's row-group statistics, or the column read when a writer left none
        data, uri, rows = _with_token_id(dataset, tmp_path / f"bad{statistics}", vocab, statistics)
        words = rf"shard {uri} of .*: row 5 \(row group 0\) holds token id {vocab}, outside the tokenizer's {vocab} ids"
        with pytest.raises(ManifestError, match=words):
            make_loader(data)  # data.verify eager: at start, before any step
        ld = make_loader(data, on_bad_shard="skip", max_skipped_fraction=0.2)
        assert ld.skipped["shards"] == 1 and ld.skipped["rows"] == rows and uri in ld.skipped_note
        assert len(collect(ld)) == ld.source.num_rows
        for verify in ("lazy", "off"):  # read as a row group loads, whatever data.verify says
            with pytest.raises(ManifestError, match=words):
                collect(make_loader(data, verify=verify))


def test_empty_split_is_refused(dataset, tmp_path):
    data = _copy(dataset, tmp_path)
    m = json.load(open(os.path.join(data, "manifest.json")))
    m["splits"]["test"] = []
    json.dump(m, open(os.path.join(data, "manifest.json"), "w"))
    with pytest.raises(ManifestError, match="empty"):
        make_loader(data, split="test")


def test_stop_conditions(dataset):
    assert len(collect(make_loader(dataset, max_steps=5, max_epochs=None))) == 5
    one = len(collect(make_loader(dataset)))
    assert len(collect(make_loader(dataset, max_epochs=3, stop_after_epoch=1))) == 2 * one
    forever = iter(make_loader(dataset, max_epochs=None))
    epochs = set()
    for _ in range(3 * one):
        epochs.add(next(forever)["stats"]["epoch"])
    assert epochs == {0, 1, 2}


def test_manifest_and_shards_through_fsspec(dataset):
    import fsspec

    fs = fsspec.filesystem("memory")
    for root, _, files in os.walk(dataset):
        for name in files:
            local = os.path.join(root, name)
            with open(local, "rb") as src, fs.open("/dp/" + os.path.relpath(local, dataset), "wb") as dst:
                dst.write(src.read())
    remote = epoch_gids([make_loader("memory://dp")])[0]
    local = epoch_gids([make_loader(dataset)])[0]
    np.testing.assert_array_equal(remote, local)
