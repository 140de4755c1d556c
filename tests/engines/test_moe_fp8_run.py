"""The headline recipe's CPU twin as a user runs it: ``deepspeed --num_gpus 4 molds/train.py
--recipe recipes/smoke/moe_fp8.json`` (MoE decoder with a shared expert, pp = 2, ep = 2,
FP8 linears and experts, the Triton ops on their CPU paths) trains and says which path
each op took; a resume from its checkpoint gives the uninterrupted run's losses; the
checkpoint exports (FP32 or BF16 weights, no FP8 inside) with molds' logits, as
``Dots1ForCausalLM``: its sigmoid routing and shared expert have no Qwen3-MoE twin
(``tests/engines/test_moe_pipeline_run.py`` exports softmax routing as Qwen3-MoE); and
HF's ``generate`` writes valid SMILES as often as ``molds-sample`` does."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.dist.spawn import free_port
from tests.engines.test_resume import copy_checkpoint, losses

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _train(dataset, out, steps, *extra):
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(free_port()),
           "molds/train.py", "--recipe", "recipes/smoke/moe_fp8.json", "--data.manifest", dataset,
           "--run.output_dir", out, "--trainer.max_steps", str(steps), "--checkpoint.interval_steps", "3",
           "--checkpoint.keep_last", "0", "--logging.interval_steps", "1", "--logging.progress", "false",
           "--eval.interval_steps", "0", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def _validity(smiles: list[str]) -> float:
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    return sum(bool(s) and Chem.MolFromSmiles(s) is not None for s in smiles) / len(smiles)


@pytest.mark.slow
def test_smoke_moe_fp8_trains_resumes_exports(dataset, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molds.checkpoint import open_checkpoint
    from molds.cli.sample import main as sample_main
    from molds.export import export

    full = str(tmp_path / "full")
    err = _train(dataset, full, 6)
    assert "[molds] kernels: fp8: 28 linears, 3 expert GEMM sets, 0 routers" in err
    assert "triton: rms_norm x17, swiglu x7, moe_permute x3, linear_cross_entropy x1 -> PyTorch" in err
    lineage = json.load(open(os.path.join(full, "checkpoints", "step-00000003", "lineage.json")))
    assert lineage["recipe"]["kernels"]["fp8"] and lineage["kernels"].startswith("fp8: 28 linears")
    assert lineage["world_topology"]["pp_size"] == 2 and lineage["world_topology"]["ep_size"] == 2
    a = losses(full)
    assert sorted(a) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in a.values())
    assert a[6] < a[1]

    resumed = str(tmp_path / "resumed")
    copy_checkpoint(full, 3, resumed)
    err_b = _train(dataset, resumed, 6, "--resume", "auto")
    b = losses(resumed)
    assert sorted(b) == [4, 5, 6]
    said = [line for line in (err + err_b).splitlines() if "precision" in line]  # what each run computed in
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), (step, said)

    hf_dir = export(full, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(hf).__name__ == "Dots1ForCausalLM" and hf.config.n_shared_experts == 1
    loaded = open_checkpoint(full)
    ours = loaded.model  # the checkpoint's plain weights: no FP8, no kernels
    ids = torch.randint(6, ours.config.vocab_size, (2, 17))
    bf16 = AutoModelForCausalLM.from_pretrained(export(full, str(tmp_path / "hf16"), dtype="bfloat16"),
                                                local_files_only=True).eval()
    assert next(bf16.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        want = ours(ids)["logits"]
        torch.testing.assert_close(hf(ids).logits, want, rtol=1e-4, atol=1e-5)
        assert float((bf16(ids).logits.float() - want).norm() / want.norm()) < 2e-2
    # sampling: molds-sample and HF generate from the exported model, 256 molecules each at
    # temperature 1; validity within four binomial standard deviations of each other
    n = 256
    assert sample_main([full, "--num", str(n), "--seed", "1", "--out", str(tmp_path / "s.smi")]) == 0
    ours_valid = _validity(open(tmp_path / "s.smi").read().splitlines())
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    torch.manual_seed(1)
    out = hf.generate(torch.full((n, 1), loaded.specials.bos), do_sample=True, top_k=0, max_new_tokens=120,
                      pad_token_id=loaded.specials.pad, eos_token_id=loaded.specials.eos)
    texts = []
    for row in out[:, 1:].tolist():
        ended = loaded.specials.eos in row
        row = row[:row.index(loaded.specials.eos)] if ended else row
        texts.append(tok.decode(row, skip_special_tokens=False).replace(" ", "") if ended else "")
    hf_valid = _validity(texts)
    p = (ours_valid + hf_valid) / 2
    assert abs(ours_valid - hf_valid) <= 4 * math.sqrt(max(p * (1 - p), 1 / n) * 2 / n) + 1e-9, (ours_valid, hf_valid)
