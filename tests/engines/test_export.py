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

    from molds.checkpoint import open_checkpoint
    from molds.data.loader import MoleculeLoader
    from molds.export import export
    from molds.models import build_model
    from molds.recipe.parse import parse_recipe
    from molds.recipe.sections import DataConfig

    out = str(tmp_path / "run")
    # the DDP run also reads half its molecules as marked randomized SMILES (the export must
    # keep generate() off the marker, as molds-sample does)
    argv = _argv(dataset, out, engine, 3, extra=("--data.randomized_smiles", "0.5") if engine == "ddp" else ())
    if engine == "ddp":
        from molds.train import main

        main(argv)
    else:
        run_ranks(_main, 2, argv)
    hf_dir = export(out, str(tmp_path / "hf"))  # a run directory: its latest checkpoint

    recipe = parse_recipe(argv)
    loaded = open_checkpoint(os.path.join(out, "checkpoints", "latest"))
    assert loaded.checkpoint.endswith("step-00000003")
    ours = loaded.model
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
    sep = loaded.specials.sep
    gen = hf.generate(torch.tensor([[loaded.specials.bos]] * 4), do_sample=True, top_k=0, max_new_tokens=3,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=loaded.specials.pad)
    sep_scores = gen.scores[0][:, sep]
    if engine == "ddp":
        assert list(hf.generation_config.suppress_tokens) == [sep]
        assert torch.isinf(sep_scores).all() and (sep_scores < 0).all()
    else:
        assert not hf.generation_config.suppress_tokens
        assert torch.isfinite(sep_scores).all()
    fresh = build_model(recipe.model, loaded.specials, seed=recipe.run.seed)
    changed = any((p != q).any() for p, q in zip(fresh.parameters(), ours.parameters()))
    assert changed
