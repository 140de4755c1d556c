"""The data plane on a manifest of pairs: packed rows of BOS source SEP target EOS, held to
the shard's own sides; the loss only on the completion; the packed loss equal to each pair
run alone; every pair once an epoch; the refusals of what pairs cannot be read with."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from molds.chemistry.tokens import IGNORE_INDEX
from molds.data.loader import MoleculeLoader
from molds.errors import RecipeError
from molds.recipe.sections import DataConfig

from .conftest import pair_manifest


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return pair_manifest(tmp_path_factory.mktemp("pairdata"), 300, "forward")


def shard_sides(out: str) -> dict:
    from molds.data.manifest import Manifest

    m = Manifest.load(out)
    got = {}
    for shard in m.shards("train"):
        for row in pq.read_table(shard.path).to_pylist():
            got[row["compound_id"]] = (row["source_token_ids"], row["target_token_ids"])
    return got


def loader(out: str, **kw) -> MoleculeLoader:
    options = dict(manifest=out, mode="packed", seq_len=256, micro_batch_size=4, too_long="reject", seed=3,
                   max_epochs=1)
    options.update(kw)
    return MoleculeLoader(DataConfig(**options))


def documents(batch):
    """(tokens, labels) of each pair in a batch, in row order."""
    ids, labels, docs = batch["input_ids"].numpy(), batch["labels"].numpy(), batch["document_ids"].numpy()
    for r in range(ids.shape[0]):
        for d in range(docs[r].max() + 1):
            sel = docs[r] == d
            yield ids[r][sel].tolist(), labels[r][sel].tolist()


def test_each_pair_is_its_prompt_and_completion_and_the_loss_is_on_the_completion(pairs):
    ld = loader(pairs)
    sp = ld.specials
    sides = shard_sides(pairs)
    by_tokens = {(tuple(s), tuple(t)): cid for cid, (s, t) in sides.items()}
    seen = []
    for batch in ld:
        cids = ld.source.compound_ids(batch["gids"].tolist())
        for (tokens, labels), cid in zip(documents(batch), cids):
            src, tgt = sides[cid]
            assert tokens == [sp.bos, *src, sp.sep, *tgt, sp.eos]
            prompt = len(src) + 2
            assert labels[:prompt] == [IGNORE_INDEX] * prompt  # no loss on BOS source SEP
            assert labels[prompt:] == [*tgt, sp.eos]
            seen.append(cid)
    assert sorted(seen) == sorted(sides)  # every training pair once in the epoch
    assert by_tokens  # the sides differ from pair to pair


def test_the_packed_loss_equals_each_pair_alone(pairs):
    from molds.models.decoder import CausalDecoder, DecoderConfig

    ld = loader(pairs, max_steps=2)
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(vocab_size=ld.specials.vocab_size, hidden_size=32, num_layers=2,
                                        num_heads=4, num_kv_heads=2, max_position_embeddings=256)).double().eval()
    for batch in ld:
        with torch.no_grad():
            logits = model(batch["input_ids"], position_ids=batch["position_ids"],
                           document_ids=batch["document_ids"])["logits"]
        labels = batch["labels"]
        packed = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                                   labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX,
                                                   reduction="sum")
        alone, count = 0.0, 0
        for tokens, labs in documents(batch):
            with torch.no_grad():
                lg = model(torch.tensor([tokens]))["logits"][0].double()
            target = torch.tensor(labs[1:])
            alone += float(torch.nn.functional.cross_entropy(lg[:-1], target, ignore_index=IGNORE_INDEX,
                                                             reduction="sum"))
            count += int((target != IGNORE_INDEX).sum())
        assert count == int((labels[:, 1:] != IGNORE_INDEX).sum())
        assert float(packed) == pytest.approx(alone, rel=1e-9)


def test_what_pairs_cannot_be_read_with_is_refused(pairs):
    with pytest.raises(RecipeError, match="data.too_long=truncate would cut the targets"):
        loader(pairs, too_long="truncate")
    # bucketed is the encoder-decoder's reading: masking, labels and fixed shapes do not apply to pairs
    for key, value in (("mlm_probability", 0.15), ("with_labels", True), ("fixed_shape", True)):
        with pytest.raises(RecipeError, match=rf"read in data.mode bucketed .*: data.{key} does not apply"):
            loader(pairs, mode="bucketed", max_length=256, max_tokens_per_batch=1024, **{key: value})
    with pytest.raises(RecipeError, match="root-aligned spellings the ETL stores .* stores none for split"):
        loader(pairs, randomized_smiles=0.5)


def test_pairs_longer_than_a_row_are_left_out_and_counted(pairs):
    ld = loader(pairs, seq_len=64)
    lengths = [len(s) + len(t) + 3 for s, t in shard_sides(pairs).values()]
    kept = sum(len(list(documents(b))) for b in ld)
    assert kept == sum(n <= 64 for n in lengths) and ld.totals()["rejected"] == sum(n > 64 for n in lengths) > 0

