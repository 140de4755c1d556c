"""Writes moses_sample_labels.csv.gz: the bundled sample with two RDKit-computed
binary properties as stand-in multi-task labels (logP > 3, TPSA > 90), for the
encoder smoke recipe. These are computed descriptors, not assay measurements.

    python molds/sample_data/make_labels.py
"""

import csv
import gzip
import io
import os

from rdkit import Chem
from rdkit.Chem import Crippen, rdMolDescriptors

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    with gzip.open(os.path.join(HERE, "moses_sample.csv.gz"), "rt") as fh:
        next(fh)
        smiles = [line.strip() for line in fh]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["SMILES", "logp_gt_3", "tpsa_gt_90"])
    for s in smiles:
        m = Chem.MolFromSmiles(s)
        w.writerow([s, int(Crippen.MolLogP(m) > 3), int(rdMolDescriptors.CalcTPSA(m) > 90)])
    with gzip.GzipFile(os.path.join(HERE, "moses_sample_labels.csv.gz"), "wb", mtime=0) as out:
        out.write(buf.getvalue().encode())


if __name__ == "__main__":
    main()
