"""molds' packed decoder against what a user would otherwise run: HuggingFace Trainer.

    python benchmarks/peer_hf_trainer.py [--manifest DIR] [--steps 40] [--batch 32]

Both train the same Llama-style decoder config (hidden 256, 4 layers, 8 heads, 4 KV
heads) on the same manifest's training molecules with AdamW, one process:
  hf     transformers.Trainer, group_by_length=True, dynamic padding (DataCollatorForLanguageModeling),
         ``--batch`` molecules per optimizer step
  molds  the ddp engine on 2 packed rows per step, their length chosen so a step holds
         about ``--batch`` molecules (the figure reports the real mean)
Real (non-padding) tokens per second for both (best of ``--rounds`` alternated runs),
and their ratio. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4)


def hf_trainer(manifest_dir: str, steps: int, batch: int, warmup: int) -> dict:
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import (AutoTokenizer, DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, Trainer,
                              TrainerCallback, TrainingArguments)

    from molds.data.manifest import Manifest

    m = Manifest.load(manifest_dir)
    tok = AutoTokenizer.from_pretrained(m.tokenizer_path)
    rows = []
    for s in m.shards("train"):
        rows.extend(pq.read_table(s.path, columns=["token_ids"]).column(0).to_pylist())
        if len(rows) >= (steps + warmup) * batch * 4:
            break
    ds = Dataset.from_dict({"input_ids": [[tok.bos_token_id] + r + [tok.eos_token_id] for r in rows]})
    ffn = -(-int(MODEL["hidden_size"] * 8 / 3) // 64) * 64
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=MODEL["hidden_size"], intermediate_size=ffn,
                      num_hidden_layers=MODEL["num_layers"], num_attention_heads=MODEL["num_heads"],
                      num_key_value_heads=MODEL["num_kv_heads"], max_position_embeddings=1024,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    seen = {"tokens": 0, "t0": None, "t1": None}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                seen["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == warmup + steps:
                seen["t1"] = time.perf_counter()

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch,
                             train_sampling_strategy="group_by_length",
                             max_steps=warmup + steps, learning_rate=1e-3, weight_decay=0.1, warmup_steps=0,
                             logging_strategy="no", save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                             dataloader_num_workers=0, bf16=torch.cuda.is_available(), seed=0,
                             disable_tqdm=True, remove_unused_columns=False)
    pad_collator = DataCollatorForLanguageModeling(tok, mlm=False)
    per_batch = []  # (real tokens, padded tokens) of every batch, in order (no DataLoader workers)

    def collator(features):
        out = pad_collator(features)
        per_batch.append((int(out["attention_mask"].sum()), int(out["attention_mask"].numel())))
        return out

    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator, callbacks=[Clock()])
    trainer.train()
    timed = np.array(per_batch[warmup:warmup + steps])
    elapsed = seen["t1"] - seen["t0"]
    return {"real_tokens_per_s": float(timed[:, 0].sum()) / elapsed, "molecules_per_step": batch,
            "s_per_step": elapsed / steps, "padding_ratio": 1 - float(timed[:, 0].sum() / timed[:, 1].sum())}


def molds_packed(manifest_dir: str, steps: int, batch: int, warmup: int) -> dict:
    import torch

    from molds.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from molds.data.loader import MoleculeLoader
    from molds.data.manifest import Manifest
    from molds.distributed import init_distributed
    from molds.engines.ddp import DDPEngine
    from molds.models import build_model
    from molds.recipe import Recipe

    m = Manifest.load(manifest_dir)
    st = m.data["stats"]["splits"]["train"]
    mean_len = st["tokens"] / st["rows"] + 2
    rows = 2  # packed rows per step, each long enough for half of ``batch`` mean-length molecules
    seq_len = -(-int(batch * mean_len / rows) // 8) * 8
    recipe = Recipe()
    recipe.data = DataConfig(manifest=manifest_dir, seq_len=seq_len, micro_batch_size=rows)
    recipe.model = ModelConfig(max_position_embeddings=1024, **MODEL)
    recipe.optim = OptimConfig(lr=1e-3, warmup_steps=0)
    recipe.trainer = TrainerConfig(max_steps=warmup + steps, precision="auto")
    dist = init_distributed()
    engine = DDPEngine(recipe, build_model(recipe, len(m.check_tokenizer())), dist)
    keep = ("input_ids", "labels", "position_ids", "document_ids")
    it = iter(MoleculeLoader(recipe.data))
    for _ in range(warmup):
        b = next(it)
        engine.train_step([{k: b[k].to(dist.device) for k in keep}])
    real = mols = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        b = next(it)  # the loader's time counts: it is part of what a user waits for
        real += b["stats"]["real_tokens"]
        mols += b["stats"]["molecules"]
        engine.train_step([{k: b[k].to(dist.device) for k in keep}])
    if dist.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"real_tokens_per_s": real / elapsed, "molecules_per_step": mols / steps, "s_per_step": elapsed / steps,
            "rows_per_step": rows, "seq_len": seq_len}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default=os.path.join(HERE, "..", "runs", "quickstart", "data"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="alternate hf / molds this many times; best of each")
    args = ap.parse_args()
    hfs, ourss = [], []
    for _ in range(args.rounds):  # alternated, so drift of a shared machine hits both
        hfs.append(hf_trainer(args.manifest, args.steps, args.batch, args.warmup))
        ourss.append(molds_packed(args.manifest, args.steps, args.batch, args.warmup))
    hf = max(hfs, key=lambda r: r["real_tokens_per_s"])
    ours = max(ourss, key=lambda r: r["real_tokens_per_s"])
    import torch

    print(json.dumps({"device": "cuda" if torch.cuda.is_available() else "cpu", "hf_trainer": hf, "molds": ours,
                      "rounds_real_tokens_per_s": {"hf": [round(r["real_tokens_per_s"]) for r in hfs],
                                                   "molds": [round(r["real_tokens_per_s"]) for r in ourss]},
                      "hf_real_tokens_per_s": round(hf["real_tokens_per_s"]),
                      "molds_real_tokens_per_s": round(ours["real_tokens_per_s"]),
                      "molds_over_hf": round(ours["real_tokens_per_s"] / hf["real_tokens_per_s"], 3)}))


if __name__ == "__main__":
    main()
