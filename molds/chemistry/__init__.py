"""Chemistry: molecules and the strings a model reads, shared by the ETL and the training side.

- ``canonical``: RDKit parsing, standardization, canonical SMILES and scaffolds, every
  refusal a named reason (``REJECT_REASONS``);
- ``representation``: what a model's tokens spell (SMILES, SELFIES, SAFE, conformer units):
  encode, decode and the tokenizer rule of each;
- ``conformers``: conformer units (a molecule and one 3D conformer as one string), and the
  bond-length check of decoded ones;
- ``pairs``: reactions and molecule pairs made canonical (source, target) for pair tasks;
- ``tokens``: token-level constants and the special-token ids of a tokenizer artifact.

May import: ``molds.errors`` and ``molds.runtime``. RDKit is imported inside the functions that need it, so
importing this package is cheap (the data plane and the losses import ``tokens`` on the
training side).
"""
