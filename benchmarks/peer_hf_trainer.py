"""molds' packed decoder against what a user would otherwise run: HuggingFace Trainer.

    python benchmarks/peer_hf_trainer.py [--manifest DIR] [--steps 80] [--batch 32]

Both train the same Llama-style decoder config (hidden 256, 4 layers, 8 heads, 4 KV
heads) on the same manifest's training molecules with AdamW, one process:
  hf     transformers.Trainer, group_by_length=True, dynamic padding (DataCollatorForLanguageModeling),
         ``--batch`` molecules per optimizer step
  molds  the ddp engine on 2 packed rows per step, their length chosen so a step holds
         about ``--batch`` molecules (the figure reports the real mean), with
         kernels.compile_regions as the full-size decoder recipes ship (``--eager``: off;
         the compile happens in the untimed warm-up steps)
The two alternate step by step in one process (a callback of the HF Trainer runs one
molds step after each HF step; each side's clock runs only while it works), so drift
of a shared machine hits both alike. Real (non-padding) tokens per second for both and
their ratio. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4)


class MoldsSide:
    """molds' packed decoder recipe on the ddp engine, one optimizer step at a time."""

    def __init__(self, manifest_dir: str, batch: int, total_steps: int, compile_regions: bool):
        from molds.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
        from molds.data.loader import MoleculeLoader
        from molds.data.manifest import Manifest
        from molds.distributed import init_distributed
        from molds.engines.ddp import DDPEngine
        from molds.kernels import apply_kernels
        from molds.models import build_model
        from molds.models.loss import build_loss
        from molds.recipe import Recipe
        from molds.tokens import tokenizer_info

        m = Manifest.load(manifest_dir)
        st = m.data["stats"]["splits"]["train"]
        mean_len = st["tokens"] / st["rows"] + 2
        rows = 2  # packed rows per step, each long enough for half of ``batch`` mean-length molecules
        self.seq_len = -(-int(batch * mean_len / rows) // 8) * 8
        recipe = Recipe()
        recipe.data = DataConfig(manifest=manifest_dir, seq_len=self.seq_len, micro_batch_size=rows)
        recipe.model = ModelConfig(max_position_embeddings=1024, **MODEL)
        recipe.optim = OptimConfig(lr=1e-3, warmup_steps=0)
        recipe.trainer = TrainerConfig(max_steps=total_steps, precision="auto")
        recipe.kernels.compile_regions = compile_regions  # as the full-size decoder recipes ship
        self.dist = init_distributed()
        model = apply_kernels(build_model(recipe.model, tokenizer_info(m)), recipe.kernels)  # as train.py does
        self.engine = DDPEngine(recipe, model, build_loss(recipe.model), self.dist)
        self.it = iter(MoleculeLoader(recipe.data))
        self.rows = rows
        self.time = 0.0
        self.real = self.mols = self.steps = 0

    def step(self, timed: bool) -> None:
        import torch

        keep = ("input_ids", "labels", "position_ids", "document_ids")
        t0 = time.perf_counter()
        b = next(self.it)  # the loader's time counts: it is part of what a user waits for
        self.engine.train_step([{k: b[k].to(self.dist.device) for k in keep}])
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize()
        if timed:
            self.time += time.perf_counter() - t0
            self.real += b["stats"]["real_tokens"]
            self.mols += b["stats"]["molecules"]
            self.steps += 1


def run(manifest_dir: str, steps: int, batch: int, warmup: int, compile_regions: bool) -> dict:
    """HF Trainer trains; after each of its optimizer steps, a callback runs one molds step.

    Each side's clock runs only while it works, so a shared machine's drift hits both."""
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
    ours = MoldsSide(manifest_dir, batch, warmup + steps, compile_regions)
    clock = {"hf": 0.0, "resume": None}

    class Alternate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if clock["resume"] is None:
                clock["resume"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            timed = state.global_step > warmup
            if timed:  # HF's time: from the end of the last molds step to the end of this HF step
                clock["hf"] += time.perf_counter() - clock["resume"]
            ours.step(timed)
            clock["resume"] = time.perf_counter()

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

    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator, callbacks=[Alternate()])
    trainer.train()
    timed = np.array(per_batch[warmup:warmup + steps])
    hf = {"real_tokens_per_s": float(timed[:, 0].sum()) / clock["hf"], "molecules_per_step": batch,
          "s_per_step": clock["hf"] / steps, "padding_ratio": 1 - float(timed[:, 0].sum() / timed[:, 1].sum())}
    mine = {"real_tokens_per_s": ours.real / ours.time, "molecules_per_step": ours.mols / ours.steps,
            "s_per_step": ours.time / ours.steps, "rows_per_step": ours.rows, "seq_len": ours.seq_len}
    return {"hf_trainer": hf, "molds": mine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default=os.path.join(HERE, "..", "runs", "quickstart", "data"))
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eager", action="store_true", help="molds without kernels.compile_regions")
    args = ap.parse_args()
    r = run(args.manifest, args.steps, args.batch, args.warmup, not args.eager)
    import torch

    hf, ours = r["hf_trainer"], r["molds"]
    print(json.dumps({"device": "cuda" if torch.cuda.is_available() else "cpu", "steps": args.steps,
                      "molds_compile_regions": not args.eager, **r,
                      "hf_real_tokens_per_s": round(hf["real_tokens_per_s"]),
                      "molds_real_tokens_per_s": round(ours["real_tokens_per_s"]),
                      "molds_over_hf": round(ours["real_tokens_per_s"] / hf["real_tokens_per_s"], 3)}))


if __name__ == "__main__":
    main()
