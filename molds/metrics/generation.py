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

Canonical SMILES and scaffolds come from the ETL's own ``Canonicalizer`` with the
manifest's options, so a sample is compared with the training set exactly as the
training set was written. Novelty streams the training split's columns shard by shard
(``pyarrow.compute.is_in`` against the samples), so it never holds the training set in
memory.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

FILTER_ATOMS = frozenset("C N S O F Cl Br H".split())
MAX_RING = 8


def _canonicalizer(manifest):
    import dataclasses

    from molds.chem import Canonicalizer, ChemOptions

    fields = {f.name for f in dataclasses.fields(ChemOptions)}
    opts = manifest.data["canonicalization"]["options"] if manifest is not None else {}
    return Canonicalizer(ChemOptions(**{k: v for k, v in opts.items() if k in fields}))


def parse_samples(smiles: Sequence[str | None], manifest=None) -> list[dict | None]:
    """Each sample -> None (invalid) or {"mol", "canonical", "scaffold"}."""
    from rdkit import Chem, RDLogger

    from molds.chem import Molecule

    RDLogger.DisableLog("rdApp.*")
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
    from rdkit import DataStructs
    from rdkit.Chem import rdFingerprintGenerator

    if not mols:
        return None
    mols = list(mols)
    if len(mols) > max_mols:
        mols = random.Random(seed).sample(mols, max_mols)
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=1024)
    fps = [gen.GetFingerprint(m) for m in mols]
    total = 0.0
    for fp in fps:
        total += sum(DataStructs.BulkTanimotoSimilarity(fp, fps))
    return 1.0 - total / (len(fps) ** 2)


class BasicFilters:
    def __init__(self):
        from rdkit.Chem import FilterCatalog

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
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

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


def reference_smiles(manifest, split: str, limit: int, seed: int = 0) -> list[str]:
    """Up to ``limit`` canonical SMILES of ``split``, a seeded sample of its shards' rows."""
    import pyarrow.parquet as pq

    rows = []
    for shard in manifest.shards(split):
        rows.extend(pq.read_table(shard.path, columns=["canonical_smiles"]).column(0).to_pylist())
        if len(rows) >= 4 * limit:
            break
    if len(rows) > limit:
        rows = random.Random(seed).sample(rows, limit)
    return rows


def fcd_score(generated: Sequence[str], reference: Sequence[str]) -> float | None:
    """FCD, or None (with the reason on stderr) when fcd_torch is missing or fails: a
    metric must not end a training run."""
    import sys

    if len(generated) < 2 or len(reference) < 2:
        return None
    try:
        from fcd_torch import FCD

        return float(FCD(device="cpu", n_jobs=1, batch_size=512)(list(generated), list(reference)))
    except Exception as exc:  # an old fcd_torch against a newer NumPy / SciPy, or no fcd_torch
        print(f"[molds] FCD not computed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def generation_metrics(smiles: Sequence[str | None], manifest=None, *, train_split: str = "train",
                       fcd_reference: str | None = None, fcd_max: int = 10000, diversity_max: int = 5000,
                       seed: int = 0) -> dict:
    """All of the above for one list of samples (None: no SMILES, counted invalid)."""
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
        if fcd_reference:
            ref = reference_smiles(manifest, fcd_reference, fcd_max, seed)
            out["fcd"] = fcd_score(canon[:fcd_max], ref)
            out["fcd_reference"] = f"{fcd_reference} ({len(ref)} molecules)"
    return out
