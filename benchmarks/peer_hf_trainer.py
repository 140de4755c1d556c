"""molds' packed decoder against what a user would otherwise run: HuggingFace Trainer.

    python benchmarks/peer_hf_trainer.py [--manifest DIR] [--steps 80] [--rounds 5] [--batch 32]
                                         [--precision fp32|bf16] [--profile-steps 4]

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
of a shared machine hits both alike. The timed steps are cut into ``--rounds`` equal
rounds; the ratio of real (non-padding) tokens per second is taken per round and
reported as median, min and max (``molds_over_hf`` is the median).

``--precision bf16`` trains both in bf16 autocast (HF: ``bf16=True``; molds:
``trainer.precision: bf16``), fp32 master weights on both sides.

After the timed steps, ``--profile-steps`` more alternated steps run under
torch.profiler, one profiler per side and step, and each side's step time is split into
GEMMs, attention, loss, optimizer (AdamW, gradient clipping, zeroing), other operators
(norms, activations, casts, copies) and outside operators (Python, the loader: the wall
time of the step no operator accounts for). One JSON line.
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

    def __init__(self, manifest_dir: str, batch: int, total_steps: int, compile_regions: bool, precision: str):
        from molds.recipe.sections import DataConfig, ModelConfig, OptimConfig, TrainerConfig
        from molds.data.loader import MoleculeLoader
        from molds.data.manifest import Manifest
        from molds.runtime.distributed import init_distributed
        from molds.engines.ddp import DDPEngine
        from molds.recipe.plan import plan_for
        from molds.kernels import apply_kernels
        from molds.models import build_model
        from molds.models.loss import build_loss
        from molds.recipe.parse import Recipe
        from molds.chemistry.tokens import tokenizer_info

        m = Manifest.load(manifest_dir)
        st = m.data["stats"]["splits"]["train"]
        mean_len = st["tokens"] / st["rows"] + 2
        rows = 2  # packed rows per step, each long enough for half of ``batch`` mean-length molecules
        self.seq_len = -(-int(batch * mean_len / rows) // 8) * 8
        recipe = Recipe()
        recipe.data = DataConfig(manifest=manifest_dir, seq_len=self.seq_len, micro_batch_size=rows)
        recipe.model = ModelConfig(max_position_embeddings=1024, **MODEL)
        recipe.optim = OptimConfig(lr=1e-3, warmup_steps=0)
        recipe.trainer = TrainerConfig(max_steps=total_steps, precision=precision)
        recipe.kernels.compile_regions = compile_regions  # as the full-size decoder recipes ship
        self.dist = init_distributed()
        model = apply_kernels(build_model(recipe.model, tokenizer_info(m)), recipe.kernels)  # as train.py does
        self.engine = DDPEngine(recipe, model, build_loss(recipe.model), self.dist, plan_for(recipe, self.dist))
        self.it = iter(MoleculeLoader(recipe.data))
        self.rows = rows
        self.per_step = []  # (seconds, real tokens, molecules) of every timed step

    def step(self, timed: bool) -> None:
        keep = ("input_ids", "labels", "position_ids", "document_ids")
        t0 = time.perf_counter()
        b = next(self.it)  # the loader's time counts: it is part of what a user waits for
        self.engine.train_step([{k: b[k].to(self.dist.device) for k in keep}])
        _sync()
        if timed:
            self.per_step.append((time.perf_counter() - t0, b["stats"]["real_tokens"], b["stats"]["molecules"]))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(manifest_dir: str, steps: int, batch: int, warmup: int, compile_regions: bool, precision: str = "fp32",
        rounds: int = 5, profile_steps: int = 4) -> dict:
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
        if len(rows) >= (steps + warmup + profile_steps) * batch * 4:
            break
    ds = Dataset.from_dict({"input_ids": [[tok.bos_token_id] + r + [tok.eos_token_id] for r in rows]})
    ffn = -(-int(MODEL["hidden_size"] * 8 / 3) // 64) * 64
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=MODEL["hidden_size"], intermediate_size=ffn,
                      num_hidden_layers=MODEL["num_layers"], num_attention_heads=MODEL["num_heads"],
                      num_key_value_heads=MODEL["num_kv_heads"], max_position_embeddings=1024,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    from molds.metrics.step_profile import StepProfile

    total = warmup + steps + profile_steps
    ours = MoldsSide(manifest_dir, batch, total, compile_regions, precision)
    clock = {"hf": [], "resume": None}
    prof = {"hf": StepProfile(), "molds": StepProfile()}

    class Alternate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if clock["resume"] is None:
                clock["resume"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync()
            timed = warmup < state.global_step <= warmup + steps
            profiled = state.global_step > warmup + steps
            if timed:  # HF's time: from the end of the last molds step to the end of this HF step
                clock["hf"].append(time.perf_counter() - clock["resume"])
            if profiled:
                prof["hf"].stop()
                prof["molds"].start()
            ours.step(timed)
            if profiled:
                prof["molds"].stop()
            if state.global_step >= warmup + steps and state.global_step < total:
                prof["hf"].start()  # the next HF step, loader fetch included
            clock["resume"] = time.perf_counter()

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch,
                             train_sampling_strategy="group_by_length",
                             max_steps=total, learning_rate=1e-3, weight_decay=0.1, warmup_steps=0,
                             logging_strategy="no", save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                             dataloader_num_workers=0, bf16=precision == "bf16", seed=0,
                             disable_tqdm=True, remove_unused_columns=False)
    pad_collator = DataCollatorForLanguageModeling(tok, mlm=False)
    per_batch = []  # (real tokens, padded tokens) of every batch, in order (no DataLoader workers)

    def collator(features):
        out = pad_collator(features)
        per_batch.append((int(out["attention_mask"].sum()), int(out["attention_mask"].numel())))
        return out

    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator, callbacks=[Alternate()])
    trainer.train()
    hf_real = np.array(per_batch[warmup:warmup + steps])[:, 0].astype(float)
    hf_pad = np.array(per_batch[warmup:warmup + steps])[:, 1].astype(float)
    hf_s = np.array(clock["hf"])
    mine = np.array(ours.per_step, dtype=float)
    ratios = [float(m[:, 1].sum() / m[:, 0].sum() / (r.sum() / s.sum()))
              for m, r, s in zip(np.array_split(mine, rounds), np.array_split(hf_real, rounds),
                                 np.array_split(hf_s, rounds))]
    hf = {"real_tokens_per_s": float(hf_real.sum() / hf_s.sum()), "molecules_per_step": batch,
          "s_per_step": float(hf_s.mean()), "padding_ratio": 1 - float(hf_real.sum() / hf_pad.sum())}
    if prof["hf"].steps:
        hf["profile_ms_per_step"] = prof["hf"].report()
    out = {"real_tokens_per_s": float(mine[:, 1].sum() / mine[:, 0].sum()),
           "molecules_per_step": float(mine[:, 2].mean()), "s_per_step": float(mine[:, 0].mean()),
           "rows_per_step": ours.rows, "seq_len": ours.seq_len}
    if prof["molds"].steps:
        out["profile_ms_per_step"] = prof["molds"].report()
    return {"hf_trainer": hf, "molds": out, "round_ratios": [round(r, 3) for r in ratios]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default=os.path.join(HERE, "..", "runs", "quickstart", "data"))
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="the timed steps cut into this many rounds")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="both sides")
    ap.add_argument("--profile-steps", type=int, default=4, help="alternated steps profiled after the timed ones")
    ap.add_argument("--eager", action="store_true", help="molds without kernels.compile_regions")
    args = ap.parse_args()
    if not 1 <= args.rounds <= args.steps:
        ap.error("--rounds must be between 1 and --steps")
    r = run(args.manifest, args.steps, args.batch, args.warmup, not args.eager, args.precision, args.rounds,
            args.profile_steps)
    import numpy as np
    import torch

    hf, ours = r["hf_trainer"], r["molds"]
    ratios = r["round_ratios"]
    from molds.runtime.lifecycle import cpu_description

    print(json.dumps({"device": "cuda" if torch.cuda.is_available() else "cpu", "cpu": cpu_description(),
                      "steps": args.steps,
                      "rounds": args.rounds, "precision": args.precision,
                      "molds_compile_regions": not args.eager, **r,
                      "hf_real_tokens_per_s": round(hf["real_tokens_per_s"]),
                      "molds_real_tokens_per_s": round(ours["real_tokens_per_s"]),
                      "molds_over_hf_overall": round(ours["real_tokens_per_s"] / hf["real_tokens_per_s"], 3),
                      "molds_over_hf_min": min(ratios), "molds_over_hf_max": max(ratios),
                      "molds_over_hf": round(float(np.median(ratios)), 3)}))


if __name__ == "__main__":
    main()
