"""The data plane's entry: ``MoleculeLoader`` feeds one rank its share, as batches.

Each rank runs ``num_workers`` (or one) *virtual ranks*; virtual rank v = rank x K + w
owns a disjoint share of every epoch (plan.py). A virtual rank's whole state after a
batch is small: epoch, share, molecules taken from its stream, the gids waiting in the
packer's lookahead (or the bucketer's pending batches), and its step. ``state_dict()``
records it per virtual rank for the last batch the trainer *received*, so prefetched
batches are never lost; ``load_state_dict`` seeks instead of replaying.

Resume on the same topology yields exactly the batches of an uninterrupted run. Resume
on another topology (say 4 ranks -> 2, or another worker count) needs the states of
all old ranks (``merge_states``): everything they had not yet emitted in a batch is
dealt out again, so within the epoch no molecule is trained twice and none is skipped.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ..chemistry.tokens import tokenizer_info
from ..errors import ManifestError, RecipeError
from ..recipe.sections import DataConfig
from .bucketing import Bucketer
from .manifest import Manifest
from .packing import Packer
from .plan import EpochPlan, Share, resplit
from .source import SplitSource
from .stream import MoleculeStream

STATE_FORMAT = 1


class VirtualRank:
    """Batches of one virtual rank, epoch after epoch, resumable from ``state``."""

    def __init__(self, source: SplitSource, cfg: DataConfig, vrank: int, vworld: int, specials: dict,
                 state: dict | None = None):
        self.source, self.cfg, self.vrank, self.vworld, self.specials = source, cfg, vrank, vworld, specials
        st = state or {}
        self.epoch = st.get("epoch", 0)
        self.share_state = st.get("share")
        self.generation = st.get("generation", 0)
        self.taken = st.get("taken", 0)
        self.buffer = st.get("buffer", [])
        self.max_len = st.get("max_len", 1)
        self.pool_index = st.get("pool_index", 0)
        self.step = st.get("step", 0)
        self.truncated = st.get("truncated", 0)
        self.truncated_tokens = st.get("truncated_tokens", 0)
        self.rejected = st.get("rejected", 0)

    def last_epoch(self) -> float:
        cfg = self.cfg
        last = float("inf")
        if cfg.max_epochs is not None:
            last = cfg.max_epochs - 1
        if cfg.stop_after_epoch is not None:
            last = min(last, cfg.stop_after_epoch)
        return last

    def _stream(self, plan: EpochPlan) -> MoleculeStream:
        share = Share.from_state(self.share_state) if self.share_state else plan.fresh_share(self.vrank, self.vworld)
        self.share_state = share.to_state()
        window = self.cfg.shuffle_window if self.cfg.shuffle else 1
        stream = MoleculeStream(self.source, plan, share, window=window,
                                key=(self.vrank, self.vworld, self.generation))
        stream.seek(self.taken)
        return stream

    def state(self, stream: MoleculeStream, buffer) -> dict:
        return {"epoch": self.epoch, "share": self.share_state, "generation": self.generation,
                "taken": stream.taken, "buffer": buffer, "max_len": self.max_len, "pool_index": self.pool_index,
                "step": self.step, "truncated": self.truncated, "truncated_tokens": self.truncated_tokens,
                "rejected": self.rejected}

    def batches(self):
        """Yields (batch of numpy arrays, state after it)."""
        cfg = self.cfg
        while self.epoch <= self.last_epoch():
            plan = EpochPlan(self.source.units, cfg.seed, self.epoch, cfg.shuffle)
            self.source.set_epoch(self.epoch)
            stream = self._stream(plan)
            body = self._packed(stream) if cfg.mode == "packed" else self._bucketed(stream)
            for batch, state in body:
                yield batch, state
            self.epoch += 1
            self.share_state, self.taken, self.buffer, self.pool_index = None, 0, [], 0

    def _packed(self, stream: MoleculeStream):
        cfg = self.cfg
        packer = Packer(self.source, cfg.seq_len, lookahead=cfg.lookahead, too_long=cfg.too_long,
                        pad_id=self.specials.pad)
        packer.truncated, packer.truncated_tokens, packer.rejected = (self.truncated, self.truncated_tokens,
                                                                      self.rejected)
        packer.add(np.asarray(self.buffer, np.int64))
        packer.max_len = max(self.max_len, packer.max_len)

        def refill():  # in half-lookahead steps: fewer, larger reads
            if packer.size < cfg.lookahead // 2 + 1:
                while packer.size < cfg.lookahead and not stream.exhausted:
                    packer.add(stream.take(cfg.lookahead - packer.size))

        while True:
            rows = []
            for _ in range(cfg.micro_batch_size):
                refill()
                row = packer.next_row()
                if not row:
                    break
                rows.append(row)
            if not rows:
                return
            rows += [[] for _ in range(cfg.micro_batch_size - len(rows))]  # a fixed shape, even at the end
            batch = packer.collate(rows)
            self.step += 1
            self.max_len, self.truncated, self.rejected = packer.max_len, packer.truncated, packer.rejected
            self.truncated_tokens = packer.truncated_tokens
            batch["stats"].update(epoch=self.epoch, truncated=self.truncated, truncated_tokens=self.truncated_tokens,
                                  rejected=self.rejected)
            yield batch, self.state(stream, packer.gids())

    def _bucketed(self, stream: MoleculeStream):
        cfg, sp = self.cfg, self.specials
        bucketer = Bucketer(self.source, max_tokens_per_batch=cfg.max_tokens_per_batch, pool_size=cfg.bucket_pool,
                            max_length=cfg.max_length, fixed_shape=cfg.fixed_shape, batch_size=cfg.micro_batch_size,
                            fixed_length=cfg.max_length, too_long=cfg.too_long)
        bucketer.truncated, bucketer.truncated_tokens, bucketer.rejected = (self.truncated, self.truncated_tokens,
                                                                            self.rejected)
        pending = [np.asarray(b, np.int64) for b in self.buffer]
        mlm = None
        if cfg.mlm_probability > 0:
            mlm = {"probability": cfg.mlm_probability, "mask_id": sp.mask, "vocab_size": sp.vocab_size,
                   "first_regular_id": sp.first_regular, "special_ids": sp.special_ids}
            if cfg.mask_span_mean > 0:  # the encoder-decoder's denoising pairs (bucketing.denoising_batch)
                mlm["span_mean"] = cfg.mask_span_mean
        while True:
            if not pending:
                gids = stream.take(cfg.bucket_pool)
                if not len(gids):
                    return
                pending = bucketer.make_batches(gids, (cfg.seed, self.epoch, self.vrank, self.vworld,
                                                       self.generation, self.pool_index))
                self.pool_index += 1
                if not pending:
                    continue
            gids = pending.pop(0)
            batch = bucketer.collate(gids, mlm, (cfg.seed, self.step, self.vrank, self.vworld), cfg.with_labels)
            self.step += 1
            self.truncated, self.rejected = bucketer.truncated, bucketer.rejected
            self.truncated_tokens = bucketer.truncated_tokens
            batch["stats"].update(epoch=self.epoch, truncated=self.truncated, truncated_tokens=self.truncated_tokens,
                                  rejected=self.rejected)
            yield batch, self.state(stream, [b.tolist() for b in pending])

    def leftover(self) -> Share:
        """What this virtual rank has not emitted in a batch, in its current epoch."""
        plan = EpochPlan(self.source.units, self.cfg.seed, self.epoch, self.cfg.shuffle)
        stream = self._stream(plan)
        rest = stream.untaken()
        # the buffer holds gids (packed lookahead) or lists of gids (bucketed pending batches)
        held = self.buffer if self.cfg.mode == "packed" else [g for batch in self.buffer for g in batch]
        held = np.asarray(held, np.int64)
        return Share(np.concatenate([held, rest.explicit]), rest.intervals)


def merge_states(states: list[dict]) -> dict:
    """Union of the ``state_dict()`` of every rank: what a topology change needs."""
    merged = {"format": STATE_FORMAT, "vworld": None, "world_size": None, "vranks": {}, "rotation": {},
              "batches": {}}
    for st in states:
        if merged["vworld"] not in (None, st["vworld"]):
            raise ValueError("data states of different runs cannot be merged")
        merged["vworld"], merged["world_size"] = st["vworld"], st["world_size"]
        for key in ("vranks", "rotation", "batches"):
            merged[key].update(st.get(key, {}))
    return merged


class MoleculeLoader:
    """Iterate batches (dicts of torch tensors plus ``stats``) for one rank."""

    def __init__(self, cfg: DataConfig, rank: int = 0, world_size: int = 1, features: str = ""):
        """``features``: a feature set of ``molds.chemistry.features`` (``model.molecule_features``)
        each batch also holds, as ``features`` [rows, F], for molecules of a bucketed split."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.manifest = Manifest.load(cfg.manifest)
        self.specials = tokenizer_info(self.manifest)
        if self.manifest.pairs is not None:
            self._check_pairs(cfg)
        if cfg.mode == "bucketed" and cfg.mlm_probability > 0 and self.specials.mask is None:
            raise ManifestError(f"{self.manifest.path}: data.mlm_probability > 0 needs a mask token; the tokenizer "
                                f"has none")
        if cfg.mask_span_mean > 0 and (cfg.mode != "bucketed" or cfg.mlm_probability <= 0 or cfg.with_labels):
            raise RecipeError(f"data.mask_span_mean={cfg.mask_span_mean} (denoising pretraining) needs data.mode "
                              f"bucketed, data.mlm_probability > 0 and data.with_labels false")
        self._check(cfg)
        sp = self.specials
        randomizer, self.randomized_note = None, None
        if cfg.randomized_smiles > 0:
            from .randomize import Randomizer  # here: a rank that only trains loads no RDKit

            spelled = (self.manifest.data.get("representation") or {}).get("name", "smiles")
            if spelled != "smiles":
                raise RecipeError(f"data.randomized_smiles={cfg.randomized_smiles}: {self.manifest.path} spells its "
                                  f"molecules in {spelled}, not SMILES; set data.randomized_smiles to 0")
            if cfg.randomized_marker == "sep" and sp.sep is None:
                raise RecipeError(f"data.randomized_marker=sep: the tokenizer of {self.manifest.path} has no sep "
                                  f"token; set data.randomized_marker to none")
            stored = self._stored_variants(cfg)
            # a pair's stored spelling holds its own sep (source <sep> target): no marker for pairs
            marked = cfg.randomized_marker == "sep" and self.manifest.pairs is None
            randomizer = Randomizer(cfg.randomized_smiles, cfg.seed, sp.path, bos_id=sp.bos, eos_id=sp.eos,
                                    unk_id=sp.unk, marker_id=sp.sep if marked else None,
                                    stored=stored, vocab_size=sp.vocab_size)
            self.randomized_note = (
                f"data.randomized_smiles={cfg.randomized_smiles}: spellings read from the {stored} "
                f"{'root-aligned variants per pair' if self.manifest.pairs is not None else 'randomized variants per molecule'} "
                f"that {self.manifest.path} stores{self._old_alignment()}" if stored else
                f"data.randomized_smiles={cfg.randomized_smiles}: spellings written with RDKit as row groups load, in "
                f"the training process (molds-preprocess --randomized-variants K writes them offline)")
        self.source = SplitSource(self.manifest, cfg.split, verify=cfg.verify, on_bad_shard=cfg.on_bad_shard,
                                  bos_id=sp.bos, eos_id=sp.eos, pad_id=sp.pad,
                                  with_labels=cfg.mode == "bucketed" and cfg.with_labels,
                                  max_skipped_fraction=cfg.max_skipped_fraction,
                                  span_molecules=(cfg.shuffle_window if cfg.shuffle else 0)
                                  + (cfg.lookahead if cfg.mode == "packed" else cfg.bucket_pool),
                                  randomizer=randomizer, vocab_size=sp.vocab_size, sep_id=sp.sep,
                                  features=features if cfg.mode == "bucketed" and self.manifest.pairs is None else "")
        self.k = max(1, cfg.num_workers)
        self.vworld = world_size * self.k
        self.vranks = [rank * self.k + w for w in range(self.k)]
        self.states: dict[int, dict] = {}
        self.rotation = 0  # logical worker that yields next
        self.batches = 0

    def _old_alignment(self) -> str:
        """What the start line adds for a forward manifest whose aligned spellings were drawn
        by the rule before 2026-12-05 (the product the anchor: every source starting where the
        product starts, a spelling a canonical test source rarely has)."""
        info, pairs = self.manifest.data.get("randomized") or {}, self.manifest.pairs or {}
        if pairs.get("task") == "forward" and "the anchor side rooted" in str(info.get("form", "")):
            return ("; WARNING: drawn by the rule before 2026-12-05, which starts every source where the product "
                    "starts (a model trained on them reads canonical sources poorly): rebuild the manifest")
        return ""

    def _stored_variants(self, cfg: DataConfig) -> int:
        """How many stored randomized spellings per molecule this run reads (0: none,
        RDKit writes them at load), from the manifest's ``randomized`` entry and
        ``data.randomized_from``."""
        info = self.manifest.data.get("randomized")
        k = 0
        if info is not None:
            k = info.get("variants") if isinstance(info, dict) else None
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
                raise ManifestError(f"{self.manifest.path}: key randomized.variants must be an integer in [1, 64], "
                                    f"got {k!r}")
            splits = info.get("splits")
            if not isinstance(splits, list) or not all(isinstance(x, str) for x in splits):
                raise ManifestError(f"{self.manifest.path}: key randomized.splits must be a list of split names, "
                                    f"got {splits!r}")
            if cfg.split not in splits:
                k = 0
        if cfg.randomized_from == "manifest" and not k:
            raise RecipeError(f"data.randomized_from=manifest: {self.manifest.path} stores no randomized variants "
                              f"for split {cfg.split!r} (molds-preprocess --randomized-variants K writes them); set "
                              f"data.randomized_from to auto or rdkit")
        return 0 if cfg.randomized_from == "rdkit" else k

    def _check_pairs(self, cfg: DataConfig) -> None:
        """A manifest of pairs (``molds-preprocess --task``) is read as prompt and completion
        (``data.mode packed``, the decoder: rows of BOS source SEP target EOS, the loss on the
        target and EOS only) or as source and target (``bucketed``, the encoder-decoder)."""
        task = self.manifest.pairs.get("task")
        if cfg.mode == "bucketed":
            unused = [key for key, on in (("data.mlm_probability", cfg.mlm_probability > 0),
                                          ("data.with_labels", cfg.with_labels),
                                          ("data.fixed_shape", cfg.fixed_shape)) if on]
            if unused:
                raise RecipeError(f"{self.manifest.path} holds {task} pairs, read in data.mode bucketed as the "
                                  f"encoder-decoder's sources and targets (model.family seq2seq): {', '.join(unused)} "
                                  f"does not apply; set it off")
        if self.specials.sep is None:
            raise ManifestError(f"{self.manifest.path} holds pairs but its tokenizer has no sep token to put "
                                f"between source and target")
        if cfg.randomized_smiles > 0 and not self._stored_variants(cfg):
            raise RecipeError(f"data.randomized_smiles={cfg.randomized_smiles}: {task} pairs are read in root-aligned "
                              f"spellings the ETL stores (molds-preprocess --task {task} --randomized-variants K), "
                              f"and {self.manifest.path} stores none for split {cfg.split!r} (or data.randomized_from "
                              f"is rdkit); set data.randomized_smiles to 0 or rebuild the manifest")
        if cfg.too_long != "reject":
            limit = "data.seq_len" if cfg.mode == "packed" else "data.max_length"
            raise RecipeError(f"data.too_long=truncate would cut the targets of {task} pairs; set data.too_long "
                              f"to reject (pairs longer than {limit} are left out and counted)")

    def _check(self, cfg: DataConfig) -> None:
        if cfg.micro_batch_size < 1:
            raise RecipeError("data.micro_batch_size must be >= 1")
        if cfg.mode == "packed" and cfg.lookahead < 1:
            raise RecipeError("data.lookahead must be >= 1")
        span = self.manifest.length_range(cfg.split)
        self.longest = None
        if span is not None:
            extra = 3 if self.manifest.pairs is not None else 2  # BOS, EOS (and SEP between a pair's sides)
            shortest, self.longest = span[0] + extra, span[1] + extra
            limit = cfg.seq_len if cfg.mode == "packed" else cfg.max_length
            key = "data.seq_len" if cfg.mode == "packed" else "data.max_length"
            if limit < shortest:
                raise RecipeError(f"{key}={limit} is shorter than the shortest molecule of split "
                                  f"{cfg.split!r} ({shortest} tokens with BOS/EOS)")
            self.limit, self.limit_key = limit, key

    def length_warning(self) -> str | None:
        """Said at the start of a run: molecules of this split that ``seq_len`` (or
        ``max_length``) will cut, from the manifest's length statistics."""
        if self.longest is None or self.longest <= self.limit:
            return None
        what = "truncated" if self.cfg.too_long == "truncate" else "dropped"
        return (f"{self.limit_key}={self.limit} is shorter than the longest molecule of split {self.cfg.split!r} "
                f"({self.longest} tokens with BOS/EOS): longer molecules will be {what} (data.too_long="
                f"{self.cfg.too_long}), counted as data/truncated_molecules and data/truncated_tokens")

    @property
    def skipped_note(self) -> str | None:
        return self.source.skip_note

    def totals(self) -> dict:
        """This rank's molecules truncated or rejected for length so far (all epochs)."""
        out = {"truncated": 0, "truncated_tokens": 0, "rejected": 0}
        for st in self.states.values():
            for k in out:
                out[k] += int(st.get(k, 0))
        return out

    @property
    def skipped(self) -> dict:
        """Shards skipped by ``on_bad_shard: skip``: how many, their rows, and why."""
        return {"shards": len(self.source.skipped), "rows": self.source.skipped_rows,
                "total_rows": self.source.num_rows + self.source.skipped_rows,
                "reasons": [f"{uri}: {why}" for uri, why in self.source.skipped]}

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "vworld": self.vworld, "world_size": self.world, "vranks": dict(self.states),
                "rotation": {self.rank: self.rotation}, "batches": {self.rank: self.batches},
                "config": asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown data state format {state.get('format')!r}")
        vranks = {int(k): v for k, v in state["vranks"].items()}
        ranks = {int(r) for r in state.get("batches", {})}
        if state["vworld"] == self.vworld and state["world_size"] == self.world:
            if self.rank not in ranks:
                raise ValueError(f"data state holds no entry for rank {self.rank}; pass merge_states() of all ranks")
            # a virtual rank with no entry had not produced a batch yet: it starts fresh
            self.states = {v: vranks[v] for v in self.vranks if v in vranks}
            self.rotation = _of_rank(state.get("rotation", {}), self.rank)
            self.batches = _of_rank(state.get("batches", {}), self.rank)
            return
        if ranks != set(range(state["world_size"])):
            raise ValueError(f"changing topology needs the data state of every old rank (have ranks "
                             f"{sorted(ranks)} of {state['world_size']}); use merge_states()")
        self.states = self._resplit(vranks, state["vworld"])
        self.rotation = 0

    def _resplit(self, old: dict, old_vworld: int) -> dict:
        epochs = {st["epoch"] for st in old.values()}
        if not epochs:
            return {}
        old = {v: old.get(v, {"epoch": min(epochs)}) for v in range(old_vworld)}  # not started: whole share left
        epochs = {st["epoch"] for st in old.values()}
        if len(epochs) != 1:
            raise ValueError(f"cannot change topology while ranks are in different epochs {sorted(epochs)}")
        remaining = [VirtualRank(self.source, self.cfg, v, old_vworld, self.specials, st).leftover()
                     for v, st in sorted(old.items())]
        shares = resplit(remaining, self.vworld)
        gen = max(st.get("generation", 0) for st in old.values()) + 1
        step = max(st.get("step", 0) for st in old.values())
        epoch = epochs.pop()
        return {v: {"epoch": epoch, "share": shares[v].to_state(), "generation": gen, "taken": 0, "buffer": [],
                    "max_len": 1, "pool_index": 0, "step": step} for v in self.vranks}

    # ------------------------------------------------------------ iteration
    def _local_iter(self):
        vr = VirtualRank(self.source, self.cfg, self.vranks[0], self.vworld, self.specials,
                         self.states.get(self.vranks[0]))
        for batch, state in vr.batches():
            yield self.vranks[0], batch, state

    def _worker_iter(self):
        dataset = _WorkerDataset(self.source, self.cfg, self.rank, self.k, self.vworld, self.specials, self.states,
                                 self.rotation)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=self.k, collate_fn=_identity,
                                             prefetch_factor=2, persistent_workers=False)
        yield from loader

    def __iter__(self):
        it = self._local_iter() if self.cfg.num_workers == 0 else self._worker_iter()
        while self.cfg.max_steps is None or self.batches < self.cfg.max_steps:
            t0 = time.perf_counter()
            try:
                vrank, batch, state = next(it)
            except StopIteration:
                return
            wait = time.perf_counter() - t0
            self.states[vrank] = state
            self.rotation = (vrank - self.rank * self.k + 1) % self.k
            self.batches += 1
            stats = batch.pop("stats")
            stats["wait_s"] = wait
            out = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
            out["stats"] = stats
            yield out


def _of_rank(per_rank: dict, rank: int) -> int:
    """A per-rank entry; after a JSON round trip the keys are strings."""
    return int(per_rank.get(rank, per_rank.get(str(rank), 0)))


def _identity(x):
    return x


class _WorkerDataset(IterableDataset):
    """What each DataLoader worker runs: one virtual rank."""

    def __init__(self, source, cfg, rank, k, vworld, specials, states, rotation):
        self.source, self.cfg, self.rank, self.k, self.vworld = source, cfg, rank, k, vworld
        self.specials, self.states, self.rotation = specials, states, rotation

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        slot = info.id if info is not None else 0
        vrank = self.rank * self.k + (slot + self.rotation) % self.k
        vr = VirtualRank(self.source, self.cfg, vrank, self.vworld, self.specials, self.states.get(vrank))
        for batch, state in vr.batches():
            yield vrank, batch, state


__all__ = ["MoleculeLoader", "merge_states", "ManifestError"]


#: what the models (inputs) and the losses (targets) take from a loader batch
BATCH_TENSORS = ("input_ids", "position_ids", "document_ids", "attention_mask", "decoder_input_ids", "labels",
                 "mlm_labels", "label_mask", "features")


def batch_tensors(batch: dict, device) -> dict:
    """The tensors of a loader batch that models and losses take, moved to ``device``."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if k in BATCH_TENSORS}
