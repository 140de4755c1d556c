"""Chemistry: molecules and the strings a model reads, shared by the ETL and the training side.

- ``canonical``: RDKit parsing, standardization, canonical SMILES and scaffolds, every
  refusal a named reason (``REJECT_REASONS``);
- ``representation``: what a model's tokens spell (SMILES, SELFIES, SAFE, conformer units):
  encode, decode and the tokenizer rule of each;
- ``conformers``: conformer units (a molecule and one 3D conformer as one string), and the
  bond-length check of decoded ones;
- ``pairs``: reactions and molecule pairs made canonical (source, target) for pair tasks;
- ``overlap``: which molecules of a corpus a set of files holds, compared by their parents
  (as the ETL's standardization makes molecules one);
- ``fingerprints``: RDKit's fingerprint generators, one of each kind per process, for every
  part of molds that fingerprints molecules;
- ``tasks``: the pair tasks and their options in words (what a model of each reads and
  writes), without RDKit: a checkpoint's lineage keeps them;
- ``tokens``: token-level constants and the special-token ids of a tokenizer artifact.

``quiet_rdkit`` (here) wraps each function of molds that reads molecules a user or a model
wrote: RDKit's log is blocked while it runs and left as the caller had it.

May import: ``molds.errors`` and ``molds.runtime``. ``canonical`` and ``representation``
import RDKit inside the functions that need it (``molds-preprocess --help`` and a rank that
only trains import them without it); ``conformers`` and ``pairs``, which nothing on those
paths imports, at their top; ``tasks`` never. Importing the package itself is cheap (the data plane and the
losses import ``tokens`` on the training side).
"""

import functools


def quiet_rdkit(fn):
    """``fn`` runs with RDKit's log blocked (``rdBase.BlockLogs``), and the caller's log as it
    was afterwards: molds reads molecules a user or a model wrote, and RDKit's complaint about
    each one it refuses would bury the one line molds says, but a process that uses molds as
    a library keeps the RDKit log it had switched on. Not for generators (the block would end
    at the first ``yield``)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from rdkit import rdBase  # here: importing molds.chemistry loads no RDKit

        with rdBase.BlockLogs():
            return fn(*args, **kwargs)

    return run
