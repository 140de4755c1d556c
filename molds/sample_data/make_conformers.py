"""Writes moses_sample_conformers.jsonl.gz: the first 1,000 molecules of the bundled sample,
each with one 3D conformer, as JSON lines in the layout conformer datasets ship (GEOM,
docking exports): the SMILES in a random (seeded) spelling, and ``conformer`` the heavy
atoms' [x, y, z] in Å, in that spelling's atom order and in the frame the embedding left
them, 3 decimals. It is the input of the ``--unit-template`` example in docs/tutorials/conformers.md. The
conformers are RDKit ETKDGv3 + MMFF94 geometries (seeded), not measured ones.

Also writes moses_sample_conformers.sdf.gz: the first ``SD_COUNT`` of the same molecules and
geometries as a 3D SD file as a vendor's 3D library or a docking run writes one (V2000, the
hydrogens with their coordinates, atoms in the spelling's order, the id as each record's
title): the input of the ``--conformers sd`` example in docs/tutorials/conformers.md.

    python molds/sample_data/make_conformers.py
"""

import gzip
import json
import os

from rdkit import Chem, RDLogger
from rdkit.Chem import AllChem

HERE = os.path.dirname(os.path.abspath(__file__))
COUNT = 1000
SD_COUNT = 250


def main() -> None:
    RDLogger.DisableLog("rdApp.*")
    with gzip.open(os.path.join(HERE, "moses_sample.csv.gz"), "rt") as fh:
        next(fh)
        smiles = [line.strip() for _, line in zip(range(COUNT), fh)]
    lines, records = [], []
    for i, s in enumerate(smiles):
        spelled = Chem.MolToRandomSmilesVect(Chem.MolFromSmiles(s), 1, randomSeed=i)[0] if i % 2 else s
        mol = Chem.AddHs(Chem.MolFromSmiles(spelled))
        if AllChem.EmbedMolecule(mol, randomSeed=i) != 0:
            continue
        AllChem.MMFFOptimizeMolecule(mol)
        heavy = Chem.RemoveHs(mol).GetConformer().GetPositions()
        lines.append(json.dumps({"id": f"MOSES-{i * 79}", "smiles": spelled,
                                 "conformer": [[round(float(c), 3) for c in row] for row in heavy]}))
        if len(records) < SD_COUNT:
            mol.SetProp("_Name", f"MOSES-{i * 79}")
            records.append(Chem.MolToMolBlock(mol, kekulize=True) + "$$$$\n")
    with gzip.GzipFile(os.path.join(HERE, "moses_sample_conformers.jsonl.gz"), "wb", mtime=0) as out:
        out.write(("\n".join(lines) + "\n").encode())
    with gzip.GzipFile(os.path.join(HERE, "moses_sample_conformers.sdf.gz"), "wb", mtime=0) as out:
        out.write("".join(records).encode())


if __name__ == "__main__":
    main()
