"""Writes moses_sample_conformers.jsonl.gz: the first 1,000 molecules of the bundled sample,
each with one 3D conformer, as JSON lines in the layout conformer datasets ship (GEOM,
docking exports): the SMILES in a random (seeded) spelling, and ``conformer`` the heavy
atoms' [x, y, z] in Å, in that spelling's atom order and in the frame the embedding left
them, 3 decimals. It is the input of the README's ``--unit_template`` example. The
conformers are RDKit ETKDGv3 + MMFF94 geometries (seeded), not measured ones.

    python molds/sample_data/make_conformers.py
"""

import gzip
import json
import os

from rdkit import Chem, RDLogger
from rdkit.Chem import AllChem

HERE = os.path.dirname(os.path.abspath(__file__))
COUNT = 1000


def main() -> None:
    RDLogger.DisableLog("rdApp.*")
    with gzip.open(os.path.join(HERE, "moses_sample.csv.gz"), "rt") as fh:
        next(fh)
        smiles = [line.strip() for _, line in zip(range(COUNT), fh)]
    lines = []
    for i, s in enumerate(smiles):
        spelled = Chem.MolToRandomSmilesVect(Chem.MolFromSmiles(s), 1, randomSeed=i)[0] if i % 2 else s
        mol = Chem.AddHs(Chem.MolFromSmiles(spelled))
        if AllChem.EmbedMolecule(mol, randomSeed=i) != 0:
            continue
        AllChem.MMFFOptimizeMolecule(mol)
        heavy = Chem.RemoveHs(mol).GetConformer().GetPositions()
        lines.append(json.dumps({"id": f"MOSES-{i * 79}", "smiles": spelled,
                                 "conformer": [[round(float(c), 3) for c in row] for row in heavy]}))
    with gzip.GzipFile(os.path.join(HERE, "moses_sample_conformers.jsonl.gz"), "wb", mtime=0) as out:
        out.write(("\n".join(lines) + "\n").encode())


if __name__ == "__main__":
    main()
