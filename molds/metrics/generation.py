"""Metrics of generated SMILES, as the MOSES benchmark defines them (Polykovskiy et al. 2020).

- validity: fraction of samples RDKit parses into a non-empty molecule (None, a sample
  that never produced the end token or that holds a special token, counts as invalid)
- unique@k: distinct canonical SMILES among the first k valid samples, over k
- novelty: fraction of the distinct valid samples absent from the training split
- novelty_all_splits: the same against every split of the manifest (all of the source
  molecules, held-out splits included)
- scaffold_novelty: fraction of the distinct Murcko scaffolds of the valid samples
  absent from the training split's scaffolds
- int_div: internal diversity IntDiv1, 1 - mean pairwise Tanimoto similarity of
  Morgan fingerprints (radius 2, 1024 bits) over the valid samples (a seeded subset
  when there are more than ``diversity_max``)
- filters: fraction of valid samples passing basic medicinal-chemistry filters: only
  C N S O F Cl Br H atoms, no formal charge, no ring larger than 8, and no RDKit PAINS
  (A, B, C) match
- fcd: Fréchet ChemNet Distance to a reference split, computed by the ``fcd_torch``
  package (its ChemNet weights ship inside the wheel, so it works offline)
- snn, frag, scaf (``moses_reference``): MOSES's similarities to a reference set. SNN: the
  mean over valid samples of the largest Tanimoto similarity to a reference molecule
  (Morgan fingerprints, radius 2, 1024 bits); Frag: cosine similarity of the BRICS
  fragment counts (bonds cut by ``FragmentOnBRICSBonds``); Scaf: cosine similarity of the
  Bemis-Murcko scaffold counts (scaffolds of at least two rings). MOSES scores them, and
  FCD, against its whole test set (Test) and its scaffold test set (TestSF, scaffolds absent
  from training); a manifest made with ``--split scaffold`` holds out whole scaffolds, so
  its test split is a TestSF of the same construction

Canonical SMILES and scaffolds come from the ETL's own ``Canonicalizer`` with the
manifest's options, so a sample is compared with the training set exactly as the
training set was written. Novelty streams the training split's columns shard by shard
(``pyarrow.compute.is_in`` against the samples), so it never holds the training set in
memory.
"""

from __future__ import annotations

import random
import sys
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from importlib.metadata import version

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rdkit import Chem, DataStructs, rdBase
from rdkit.Chem import AllChem, FilterCatalog
from rdkit.Chem.Scaffolds import MurckoScaffold

from molds.chemistry import fingerprints, quiet_rdkit
from molds.chemistry.canonical import Canonicalizer, ChemOptions, Molecule

from .disk_cache import cached_arrays

FILTER_ATOMS = frozenset("C N S O F Cl Br H".split())
MAX_RING = 8


def _canonicalizer(manifest):
    return Canonicalizer(ChemOptions.of_manifest(manifest))


@quiet_rdkit
def parse_samples(smiles: Sequence[str | None], manifest=None) -> list[dict | None]:
    """Each sample -> None (invalid) or {"mol", "canonical", "scaffold"}."""
    canon = _canonicalizer(manifest)
    out = []
    for s in smiles:
        # RDKit would read the text after whitespace as a name: such a string is no SMILES
        mol = Chem.MolFromSmiles(s) if s and not any(c.isspace() for c in s) else None
        if mol is None or mol.GetNumAtoms() == 0:
            out.append(None)
            continue
        m = canon(s)
        if isinstance(m, Molecule):
            out.append({"mol": mol, "canonical": m.canonical, "scaffold": m.scaffold})
        else:  # RDKit reads it; the ETL would reject it for another reason (size, standardizer)
            out.append({"mol": mol, "canonical": Chem.MolToSmiles(mol), "scaffold": None})
    return out


def unique_at(canonicals: Sequence[str], k: int) -> float | None:
    """Distinct among the first ``k`` valid samples (all of them when fewer), over their count."""
    head = list(canonicals[:k])
    return len(set(head)) / len(head) if head else None


def internal_diversity(mols: Sequence, max_mols: int = 5000, seed: int = 0) -> float | None:
    """1 - mean Tanimoto over all ordered pairs (self pairs included, as MOSES does)."""
    if not mols:
        return None
    mols = list(mols)
    if len(mols) > max_mols:
        mols = random.Random(seed).sample(mols, max_mols)
    fps = morgan_fingerprints(mols)
    total = 0.0
    for fp in fps:
        total += sum(DataStructs.BulkTanimotoSimilarity(fp, fps))
    return 1.0 - total / (len(fps) ** 2)


class BasicFilters:
    def __init__(self):
        params = FilterCatalog.FilterCatalogParams()
        for cat in (FilterCatalog.FilterCatalogParams.FilterCatalogs.PAINS_A,
                    FilterCatalog.FilterCatalogParams.FilterCatalogs.PAINS_B,
                    FilterCatalog.FilterCatalogParams.FilterCatalogs.PAINS_C):
            params.AddCatalog(cat)
        self.pains = FilterCatalog.FilterCatalog(params)

    def passes(self, mol) -> bool:
        for atom in mol.GetAtoms():
            if atom.GetSymbol() not in FILTER_ATOMS or atom.GetFormalCharge() != 0:
                return False
        if any(len(ring) > MAX_RING for ring in mol.GetRingInfo().AtomRings()):
            return False
        return not self.pains.HasMatch(mol)


def absent_from_split(manifest, split: str, column: str, values: set[str]) -> set[str]:
    """The members of ``values`` that no row of ``split`` holds in ``column`` (streamed)."""
    missing = set(values)
    if not missing:
        return missing
    for shard in manifest.shards(split):
        pf = pq.ParquetFile(shard.path)
        for batch in pf.iter_batches(columns=[column], batch_size=65536):
            col = batch.column(0)
            hit = pc.filter(col, pc.is_in(col, value_set=pa.array(sorted(missing), pa.string())))
            if len(hit):
                missing.difference_update(hit.to_pylist())
                if not missing:
                    return missing
    return missing


def draw_rows(manifest, split: str, column: str, limit: int, seed: int = 0) -> list:
    """``column`` of up to ``limit`` rows of ``split``: every row when the split holds no
    more, else a seeded uniform draw over all of its rows (each shard read once, one at a
    time). Shards are not in random order (the ETL writes them partition by partition, and
    a scaffold split's partitions by group size), so a draw from the first shards alone is
    not the split's distribution."""
    shards = manifest.shards(split)
    total = sum(sh.num_rows for sh in shards)
    wanted = sorted(random.Random(seed).sample(range(total), limit)) if total > limit else range(total)
    rows: list = []
    start = i = 0
    for shard in shards:
        end = start + shard.num_rows
        j = bisect_left(wanted, end, i)  # the drawn rows of this shard: wanted[i:j]
        if j > i:
            values = pq.read_table(shard.path, columns=[column]).column(0)
            rows.extend(values.take([w - start for w in wanted[i:j]]).to_pylist())
        start, i = end, j
    return rows


def reference_smiles(manifest, split: str, limit: int, seed: int = 0) -> list[str]:
    """Up to ``limit`` canonical SMILES of ``split``, a seeded uniform draw (``draw_rows``)."""
    return draw_rows(manifest, split, "canonical_smiles", limit, seed)


def chemnet_stats(smiles: Sequence[str], chunk: int = 20000) -> dict:
    """The mean and covariance of ChemNet's activations over ``smiles``, taken chunk by
    chunk (fcd_torch holds a whole list's activations and encodings at once: 158k
    molecules, a MOSES test split, went past 16 GB)."""
    from fcd_torch import FCD  # here: a broken fcd_torch costs only the FCD

    # fcd_torch parses each SMILES again and raises on one RDKit cannot read, ending the whole
    # FCD: a canonical SMILES RDKit wrote need not read back (an aromatic system it cannot
    # kekulize from its own output). Those are left out, counted on stderr.
    with rdBase.BlockLogs():
        readable = [s for s in smiles if s and Chem.MolFromSmiles(s) is not None]
    if len(readable) < len(smiles):
        print(f"[molds] FCD: {len(smiles) - len(readable)} of {len(smiles)} SMILES left out: RDKit cannot read "
              f"them back (canonical SMILES that do not round-trip)", file=sys.stderr)
    smiles = readable
    fcd = FCD(device="cpu", n_jobs=1, batch_size=512)
    n, first, second = 0, None, None
    for start in range(0, len(smiles), chunk):
        act = np.asarray(fcd.get_predictions(list(smiles[start:start + chunk])), dtype=np.float64)
        if not len(act):
            continue
        first = act.sum(0) if first is None else first + act.sum(0)
        second = act.T @ act if second is None else second + act.T @ act
        n += len(act)
    if n < 2:
        return {}
    mu = first / n
    return {"mu": mu, "sigma": (second - n * np.outer(mu, mu)) / (n - 1)}


_CHEMNET_DIM = 512  # ChemNet's penultimate layer, whose statistics FCD compares


def reference_chemnet_stats(smiles: Sequence[str]) -> dict:
    """``chemnet_stats`` of a reference set, cached on disk (``molds.metrics.disk_cache``): the
    same reference (MOSES's Test, a manifest's split) is scored against again and again, and
    ChemNet over 176,000 molecules takes tens of minutes of one CPU core. The entry is keyed
    by the SMILES and fcd_torch's version; one that is not the expected shapes of finite
    numbers is recomputed."""
    try:
        fcd_version = version("fcd_torch")
    except Exception:  # noqa: BLE001 - not installed: chemnet_stats raises and says so
        fcd_version = "?"

    def valid(z: dict) -> bool:
        mu, sigma = z.get("mu"), z.get("sigma")
        return (mu is not None and sigma is not None and mu.shape == (_CHEMNET_DIM,)
                and sigma.shape == (_CHEMNET_DIM,) * 2 and bool(np.isfinite(mu).all() and np.isfinite(sigma).all()))

    stats = cached_arrays("chemnet", f"fcd_torch {fcd_version}", smiles, lambda: chemnet_stats(smiles), valid)
    return {k: np.asarray(v, np.float64) for k, v in stats.items()}


def fcd_score(generated: Sequence[str], reference) -> float | None:
    """FCD of ``generated`` to ``reference`` (SMILES, or ``chemnet_stats`` of them), or
    None (with the reason on stderr) when fcd_torch is missing or fails: a metric must not
    end a training run."""
    if len(generated) < 2 or (not isinstance(reference, dict) and len(reference) < 2):
        return None
    try:
        from fcd_torch.utils import calculate_frechet_distance  # here: a broken fcd_torch costs only the FCD

        ref = reference if isinstance(reference, dict) else chemnet_stats(reference)
        gen = chemnet_stats(generated)
        if not ref or not gen:
            return None
        return float(calculate_frechet_distance(ref["mu"], ref["sigma"], gen["mu"], gen["sigma"]))
    except Exception as exc:  # an old fcd_torch against a newer NumPy / SciPy, or no fcd_torch
        print(f"[molds] FCD not computed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def morgan_fingerprints(mols) -> list:
    gen = fingerprints.morgan(2, 1024)
    return [gen.GetFingerprint(m) for m in mols]


def snn_score(gen_fps: list, ref_fps: list) -> float | None:
    """Mean over the samples of the largest Tanimoto similarity to a reference molecule."""
    if not gen_fps or not ref_fps:
        return None
    return sum(max(DataStructs.BulkTanimotoSimilarity(fp, ref_fps)) for fp in gen_fps) / len(gen_fps)


def fragment_counts(mols):
    """BRICS fragments (as MOSES cuts them), counted over the molecules."""
    counts = Counter()
    for m in mols:
        counts.update(Chem.MolToSmiles(AllChem.FragmentOnBRICSBonds(m)).split("."))
    return counts


def scaffold_counts(mols, min_rings: int = 2):
    """Bemis-Murcko scaffolds of at least ``min_rings`` rings, counted over the molecules."""
    counts = Counter()
    for m in mols:
        try:
            scaffold = MurckoScaffold.GetScaffoldForMol(m)
        except (ValueError, RuntimeError):
            continue
        text = Chem.MolToSmiles(scaffold)
        if text and scaffold.GetRingInfo().NumRings() >= min_rings:
            counts[text] += 1
    return counts


def cosine_similarity(a, b) -> float | None:
    if not a or not b:
        return None
    dot = sum(v * b.get(k, 0) for k, v in a.items())
    norm = (sum(v * v for v in a.values()) ** 0.5) * (sum(v * v for v in b.values()) ** 0.5)
    return dot / norm


class ReferenceSet:
    """A reference split's molecules, fingerprints, fragment and scaffold counts (computed
    once; several seeds' samples are scored against it)."""

    def __init__(self, smiles: Sequence[str]):
        self.smiles = list(smiles)
        mols = [m for m in (Chem.MolFromSmiles(s) for s in self.smiles) if m is not None]
        self.fps = morgan_fingerprints(mols)
        self.fragments = fragment_counts(mols)
        self.scaffolds = scaffold_counts(mols)
        try:
            self.chemnet = reference_chemnet_stats(self.smiles)
        except Exception:  # fcd_torch missing or failing: fcd_score says why, the rest stands
            self.chemnet = self.smiles

    def scores(self, valid_mols, valid_canonical) -> dict:
        return {"fcd": fcd_score(valid_canonical, self.chemnet),
                "snn": snn_score(morgan_fingerprints(valid_mols), self.fps),
                "frag": cosine_similarity(fragment_counts(valid_mols), self.fragments),
                "scaf": cosine_similarity(scaffold_counts(valid_mols), self.scaffolds)}


def generation_metrics(smiles: Sequence[str | None], manifest=None, *, train_split: str = "train",
                       fcd_reference: str | None = None, fcd_max: int = 10000, diversity_max: int = 5000,
                       seed: int = 0, moses_reference: "ReferenceSet | None" = None, properties=None,
                       fcd_seed: int = 0) -> dict:
    """All of the above for one list of samples (None: no SMILES, counted invalid).
    ``properties``: a ``molds.metrics.distribution.PropertyReference``, which adds the
    property distances, the shares outside the training ranges and (under ``histograms``)
    the histograms. ``fcd_seed`` draws the FCD reference molecules: fixed, so that FCDs
    of one run's evaluations are taken against the same molecules."""
    parsed = parse_samples(smiles, manifest)
    valid = [p for p in parsed if p is not None]
    canon = [p["canonical"] for p in valid]
    distinct = set(canon)
    n = len(smiles)
    out = {
        "samples": n,
        "valid": len(valid),
        "validity": len(valid) / n if n else None,
        "unique@1k": unique_at(canon, 1000),
        "unique@10k": unique_at(canon, 10000),
        "unique": len(distinct) / len(valid) if valid else None,
        "int_div": internal_diversity([p["mol"] for p in valid], diversity_max, seed),
    }
    filters = BasicFilters()
    out["filters"] = sum(filters.passes(p["mol"]) for p in valid) / len(valid) if valid else None
    if manifest is not None:
        novel = absent_from_split(manifest, train_split, "canonical_smiles", distinct)
        out["novelty"] = len(novel) / len(distinct) if distinct else None
        # the manifest's other splits are molecules of the same source that the model never
        # saw; a sample equal to one of them is novel to the model but not to the source set
        # (for a MOSES manifest: novelty against the whole MOSES training file, as the MOSES
        # benchmark counts it)
        for other in sorted(set(manifest.data["splits"]) - {train_split}):
            novel = absent_from_split(manifest, other, "canonical_smiles", novel)
        out["novelty_all_splits"] = len(novel) / len(distinct) if distinct else None
        scaffolds = {p["scaffold"] for p in valid if p["scaffold"]}
        new_scaffolds = absent_from_split(manifest, train_split, "scaffold", scaffolds)
        out["scaffold_novelty"] = len(new_scaffolds) / len(scaffolds) if scaffolds else None
        if fcd_reference and moses_reference is None:
            ref = reference_smiles(manifest, fcd_reference, fcd_max, fcd_seed)
            try:
                stats = reference_chemnet_stats(ref)
            except Exception:  # noqa: BLE001 - fcd_score says why
                stats = ref
            out["fcd"] = fcd_score(canon[:fcd_max], stats or ref)
            out["fcd_reference"] = f"{fcd_reference} ({len(ref)} molecules)"
    if moses_reference is not None:  # FCD, SNN, Frag, Scaf of every valid sample against the whole reference
        out.update(moses_reference.scores([p["mol"] for p in valid], canon))
        out["moses_reference_molecules"] = len(moses_reference.smiles)
    if properties is not None and valid:
        scalars, out["histograms"] = properties.scores([p["mol"] for p in valid])
        out.update(scalars)
        out["property_reference"] = properties.description
    return out
