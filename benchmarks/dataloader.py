"""Data plane throughput, padding and resume cost, against naive baselines, in one run.

    python benchmarks/dataloader.py --manifest DIR [--seq-len 512] [--batch 32] [--subset 200000]

Packed figures are taken twice, on the manifest given and on a ``--subset``-row copy of
its first training shards (so a slowdown that grows with the data shows).
Packed (causal LM): real tokens delivered per second as ready torch tensors, one
process, no DataLoader workers (so the figure is per worker core); padding ratio over
the epoch; the time from ``load_state_dict`` to the first batch at several points of
the epoch (``resume_seek_s`` is the worst). Baseline in the same run: molecules in
random order, batches of ``--batch`` padded to their longest ("pad to max").

Bucketed (encoders): padding of molds' token-budget, length-grouped batches against
HuggingFace's ``LengthGroupedSampler`` at ``--batch`` per batch on the same molecules.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "runs", "quickstart", "data")


def lengths_of(manifest_dir: str) -> np.ndarray:
    import pyarrow.parquet as pq

    from molds.data.manifest import Manifest

    m = Manifest.load(manifest_dir)
    return np.concatenate([pq.read_table(s.path, columns=["token_length"]).column(0).to_numpy()
                           for s in m.shards("train")]).astype(np.int64) + 2  # BOS/EOS


def naive_pad_to_max(manifest_dir: str, batch: int, seed: int = 0) -> dict:
    """Read every molecule, shuffle, batch, pad to the longest of each batch, as tensors."""
    import pyarrow.parquet as pq
    import torch

    from molds.data.manifest import Manifest

    m = Manifest.load(manifest_dir)
    start = time.perf_counter()
    rows = []
    for s in m.shards("train"):
        rows.extend(pq.read_table(s.path, columns=["token_ids"]).column(0).to_pylist())
    order = np.random.default_rng(seed).permutation(len(rows))
    real = total = 0
    for i in range(0, len(order), batch):
        mols = [[2] + rows[j] + [3] for j in order[i:i + batch]]
        width = max(len(x) for x in mols)
        ids = np.zeros((len(mols), width), dtype=np.int64)
        for r, x in enumerate(mols):
            ids[r, :len(x)] = x
        tensor = torch.from_numpy(ids)
        real += sum(len(x) for x in mols)
        total += tensor.numel()
    elapsed = time.perf_counter() - start
    return {"tokens_per_s_per_worker": real / elapsed, "padding_ratio": 1 - real / total}


def subset_manifest(manifest_dir: str, rows: int, out: str, seed: int = 0) -> str:
    """A copy of ``manifest_dir`` whose training split is a seeded random ``rows``-row
    sample of its own (every length bucket in proportion; valid and test copied)."""
    import hashlib
    import shutil

    import pyarrow.parquet as pq

    m = json.load(open(os.path.join(manifest_dir, "manifest.json")))
    total = sum(s["num_rows"] for s in m["splits"]["train"])
    rng = np.random.default_rng(seed)
    for name, shards in m["splits"].items():
        for shard in shards:
            src, dst = os.path.join(manifest_dir, shard["uri"]), os.path.join(out, shard["uri"])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if name != "train":
                shutil.copy(src, dst)
                continue
            table = pq.read_table(src)
            table = table.filter(rng.random(table.num_rows) < rows / total)
            pq.write_table(table, dst, row_group_size=2048, compression="zstd")
            shard.update(num_rows=table.num_rows, token_count=int(table.column("token_length").to_numpy().sum()),
                         sha256=hashlib.sha256(open(dst, "rb").read()).hexdigest())
    shutil.copytree(os.path.join(manifest_dir, m["tokenizer"]["path"]), os.path.join(out, m["tokenizer"]["path"]))
    st = m["stats"]["splits"]["train"]
    st["rows"] = sum(s["num_rows"] for s in m["splits"]["train"])
    st["tokens"] = sum(s["token_count"] for s in m["splits"]["train"])
    json.dump(m, open(os.path.join(out, "manifest.json"), "w"))
    return out


def packed(manifest_dir: str, seq_len: int, micro_batch: int) -> dict:
    from molds.data.loader import MoleculeLoader
    from molds.recipe.sections import DataConfig

    cfg = DataConfig(manifest=manifest_dir, seq_len=seq_len, micro_batch_size=micro_batch, max_epochs=1)
    loader = MoleculeLoader(cfg)
    it = iter(loader)
    first = next(it)  # imports and first unit reads are not throughput
    real = total = filler = 0
    batches = 1
    start = time.perf_counter()
    for b in it:
        batches += 1
        st = b["stats"]
        real += st["real_tokens"]
        total += st["tokens"]
        empty = int((b["document_ids"] < 0).all(dim=1).sum())
        filler += empty * seq_len
    elapsed = time.perf_counter() - start
    del first
    # resume at 10 %, 50 % and 90 % of the epoch: state after k batches, then time to the next batch
    seeks = []
    for frac in (0.1, 0.5, 0.9):
        k = max(1, int(batches * frac))
        ld = MoleculeLoader(cfg)
        for i, _ in enumerate(ld):
            if i + 1 == k:
                break
        state = json.loads(json.dumps(ld.state_dict()))
        fresh = MoleculeLoader(cfg)
        t0 = time.perf_counter()
        fresh.load_state_dict(state)
        next(iter(fresh))
        seeks.append(time.perf_counter() - t0)
    return {
        "tokens_per_s_per_worker": real / elapsed,
        "padding_ratio": 1 - real / max(1, total - filler),
        "padding_ratio_incl_epoch_end_filler": 1 - real / max(1, total),
        "resume_seek_s": max(seeks),
        "resume_seek_s_at_10_50_90pct": [round(s, 4) for s in seeks],
        "batches": batches,
    }


def bucketed(manifest_dir: str, batch: int) -> dict:
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from molds.data.loader import MoleculeLoader
    from molds.recipe.sections import DataConfig

    lengths = lengths_of(manifest_dir)
    sampler = LengthGroupedSampler(batch_size=batch, lengths=lengths.tolist(),
                                   generator=__import__("torch").Generator().manual_seed(0))
    order = np.fromiter(iter(sampler), dtype=np.int64)
    real = total = 0
    for i in range(0, len(order), batch):
        ls = lengths[order[i:i + batch]]
        real += int(ls.sum())
        total += int(ls.max()) * len(ls)
    hf = 1 - real / total
    budget = int(batch * lengths.mean())
    cfg = DataConfig(manifest=manifest_dir, mode="bucketed", max_tokens_per_batch=budget, bucket_pool=50 * batch,
                     max_length=int(lengths.max()), max_epochs=1)
    real = total = mols = n = 0
    start = time.perf_counter()
    for b in MoleculeLoader(cfg):
        st = b["stats"]
        real += st["real_tokens"]
        total += st["tokens"]
        mols += st["molecules"]
        n += 1
    elapsed = time.perf_counter() - start
    return {"padding_ratio": 1 - real / total, "hf_length_grouped_padding_ratio": hf,
            "mean_batch_molecules": mols / n, "max_tokens_per_batch": budget,
            "tokens_per_s_per_worker": real / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default=DEFAULT)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--subset", type=int, default=200_000, help="training rows of the subset run (0: none)")
    args = ap.parse_args()
    import tempfile

    result = {"manifest": os.path.abspath(args.manifest), "seq_len": args.seq_len}
    result["packed"] = packed(args.manifest, args.seq_len, args.micro_batch)
    if args.subset:
        with tempfile.TemporaryDirectory() as tmp:
            sub = subset_manifest(args.manifest, args.subset, tmp)
            rows = json.load(open(os.path.join(sub, "manifest.json")))["stats"]["splits"]["train"]["rows"]
            result["packed_subset"] = dict(packed(sub, args.seq_len, args.micro_batch), train_rows=rows)
    result["naive_pad_to_max"] = naive_pad_to_max(args.manifest, args.batch)
    result["bucketed"] = bucketed(args.manifest, args.batch)
    p, nv = result["packed"], result["naive_pad_to_max"]
    result.update(
        tokens_per_s_per_worker=round(p["tokens_per_s_per_worker"]),
        subset_tokens_per_s_per_worker=round(result["packed_subset"]["tokens_per_s_per_worker"])
        if args.subset else None,
        subset_padding_ratio=round(result["packed_subset"]["padding_ratio"], 5) if args.subset else None,
        padding_ratio=round(p["padding_ratio"], 5),
        resume_seek_s=round(p["resume_seek_s"], 4),
        # the naive loop only pads lists (no shuffle window, packing or resumable state), and
        # ~19 % of what it hands the model is padding: this ratio is of real tokens/s
        ratio_to_naive_real_tokens_per_s=round(p["tokens_per_s_per_worker"] / nv["tokens_per_s_per_worker"], 2),
        naive_padding_ratio=round(nv["padding_ratio"], 4),
        bucketed_padding_ratio=round(result["bucketed"]["padding_ratio"], 5),
        hf_length_grouped_padding_ratio=round(result["bucketed"]["hf_length_grouped_padding_ratio"], 5),
    )
    from molds.runtime.lifecycle import cpu_description

    result["cpu"] = cpu_description()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
