"""A trained checkpoint exports to a HuggingFace directory whose logits equal molds' own."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist.spawn import run_ranks
from tests.engines.test_resume import _argv, _main


@pytest.mark.parametrize("engine", ["ddp", "zero"])
def test_export_logits_match(dataset, tmp_path, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molds.config import DataConfig
    from molds.data.loader import MoleculeLoader
    from molds.export import export
    from molds.recipe import parse_recipe
    from molds.models import build_model

    out = str(tmp_path / "run")
    argv = _argv(dataset, out, engine, 3)
    if engine == "ddp":
        from molds.train import main

        main(argv)
    else:
        run_ranks(_main, 2, argv)
    ckpt = os.path.join(out, "checkpoints", "step-00000003")
    hf_dir = export(ckpt, str(tmp_path / "hf"))

    recipe = parse_recipe(argv)
    from molds.data.manifest import Manifest

    vocab = Manifest.load(dataset).check_tokenizer()
    ours = build_model(recipe, len(vocab))
    if engine == "ddp":
        from safetensors.torch import load_model

        load_model(ours, os.path.join(ckpt, "model.safetensors"))
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        ours.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="deepspeed"), strict=False)
    ours.eval()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    batch = next(iter(MoleculeLoader(DataConfig(manifest=dataset, seq_len=128, micro_batch_size=2))))
    with torch.no_grad():
        # one molecule per row, as a HF user would run it
        ids = tok(["CCOc1ccccc1C(=O)N", "c1ccncc1"], padding=False)["input_ids"][0]
        x = torch.tensor([ids])
        torch.testing.assert_close(hf(x).logits, ours(x)["logits"], rtol=1e-4, atol=1e-5)
        # the first molecule of a packed training row, cut out
        doc = batch["document_ids"][:1]
        first = batch["input_ids"][:1][doc >= 0][: int((doc == 0).sum())][None]
        torch.testing.assert_close(hf(first).logits, ours(first)["logits"], rtol=1e-4, atol=1e-5)
    changed = any((p != q).any() for p, q in zip(build_model(recipe, len(vocab)).parameters(), ours.parameters()))
    assert changed
