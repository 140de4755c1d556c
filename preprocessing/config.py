"""The options of ``molds-preprocess``: this dataclass is the CLI and the JSON schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class PreprocessConfig:
    """Turn raw SMILES dumps into canonical, deduplicated, split, tokenized Parquet shards."""

    input: list[str] = field(default_factory=list)
    """Input files, globs, fsspec URIs, saved HF dataset directories or ``datasets:NAME[:CONFIG]``
    (local HF cache only). CSV/TSV/.smi/SDF (.sdf/.sd/.mol, V2000 and V3000)/Parquet/JSONL,
    optionally .gz/.bz2/.xz/.zst."""

    output: str = ""
    """Output directory: manifest.json, report.md, tokenizer/ and <split>/*.parquet.
    Written to a temporary sibling and renamed, so it is complete or absent."""

    smiles_column: str = "smiles"
    """Column (CSV/TSV/Parquet/HF) or key (JSONL) holding the SMILES; matched exactly,
    else case-insensitively when that is unambiguous. Ignored for .smi and SDF (the
    molblock is the structure)."""

    id_column: Optional[str] = None
    """Optional column with compound ids (SDF: an SD tag, or ``_Name`` for the title line);
    without it, or where a row's value is empty, the id is ``file:row``."""

    label_columns: list[str] = field(default_factory=list)
    """Numeric label columns (SDF: SD tags) stored as the ``labels`` list; missing values
    (and SD records without the tag) become NaN, other non-numbers reject the row."""

    input_format: Literal["auto", "csv", "tsv", "smi", "sdf", "parquet", "jsonl", "hf"] = "auto"
    """Input format; ``auto`` decides from the file name."""

    delimiter: Optional[str] = None
    """Field delimiter for csv/tsv when it is not ``,`` / tab (an Excel ``sep=X`` first line
    sets it too)."""

    decimal: Literal[".", ","] = "."
    """Decimal mark of label values: ``,`` reads ``5,2`` as 5.2 (European exports, often
    ``;``-separated); with it, a value holding a ``.`` too is refused (``bad_label``)."""

    smi_header: bool = False
    """Whether .smi files start with a header line to skip."""

    keep_stereo: bool = True
    """Keep stereochemistry in canonical SMILES (isotopes are always kept)."""

    largest_fragment: bool = False
    """rdMolStandardize: keep the largest organic fragment (strips salts and solvents)."""

    uncharge: bool = False
    """rdMolStandardize: neutralize charges where possible."""

    normalize: bool = False
    """rdMolStandardize: apply the standard functional-group normalizations."""

    max_heavy_atoms: int = 150
    """Reject molecules with more heavy atoms (estimated before parsing, exact right after,
    before standardization and scaffolds). At most 1,000."""

    max_smiles_length: int = 500
    """Reject SMILES strings longer than this, before parsing. At most 20,000."""

    dedupe_key: Literal["canonical", "inchikey"] = "canonical"
    """Deduplicate on canonical SMILES or on the standard InChIKey (slower: InChI per molecule)."""

    scaffold: Literal["murcko", "generic"] = "murcko"
    """Bemis-Murcko scaffold, or its generic (all-carbon, single-bond) framework."""

    split: Literal["scaffold", "random", "scaffold_random", "given"] = "scaffold"
    """``scaffold``: largest scaffold groups to train; ``scaffold_random``: scaffold groups in
    seeded random order, after the groups larger than half the smaller evaluation split's
    share, which go to train first (Chemprop's balanced scaffold split); ``random``: molecules
    in seeded random order (with ``--task``: pairs, grouped by their product side). ``given``: the input's own split, from ``--split_column``
    or, without it, from each input's file name (``raw_train.csv``, ``valid.txt``,
    ``test.smi``: one of train / val / valid / validation / dev / test as a word of the name)."""

    split_column: Optional[str] = None
    """With ``--split given``: the column (or JSONL key, SD tag) naming each row's split:
    ``train``, ``val`` / ``valid`` / ``validation`` / ``dev`` or ``test`` (case aside); a row
    with another value is refused (``bad_split``)."""

    task: Literal["none", "forward", "retro", "mol2mol"] = "none"
    """``none``: molecules. Otherwise the rows are pairs for a sequence-to-sequence task:
    ``forward`` (reactants to products), ``retro`` (products to reactants) or ``mol2mol`` (a
    molecule to another). Each row is a reaction SMILES (``reactants>reagents>products``,
    ``reactants>>products``, with atom maps or without; in ``--smiles_column``, or the first
    field of a .smi / .txt line as USPTO-MIT writes it), or, with ``--target_column``, a source
    in ``--smiles_column`` and a target in ``--target_column``. Each side is canonicalized
    molecule by molecule (the options above), atom maps removed, its molecules put in canonical
    order; pairs are deduplicated as pairs; the split groups are the product side's scaffolds
    (``--split random``: the product side itself), and a target in two splits stays only in
    the first (the others counted as ``target_in_two_splits``). ``--split given`` keeps a
    published split whole: only training pairs are deduplicated, and what the evaluation
    splits share with training is counted (``shared_with_train``), not removed. SMILES only: no
    ``--representation`` or conformers. ``--randomized_variants K`` stores K root-aligned
    spellings of each training pair (R-SMILES)."""

    target_column: Optional[str] = None
    """With ``--task``: the column (or JSONL key) holding each pair's target side; the source
    side is in ``--smiles_column``. Without it, ``--smiles_column`` holds reaction SMILES."""

    reagents: Literal["auto", "mix", "separate", "drop"] = "auto"
    """With ``--task`` on reaction SMILES: ``mix`` puts the reagents among the reactants (the
    Molecular Transformer's mixed USPTO-MIT task), ``separate`` keeps them after a ``>``
    (``reactants>reagents``), ``drop`` leaves them out; ``auto`` is ``mix`` for ``forward``
    and ``drop`` for ``retro``."""

    split_fractions: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])
    """Train, valid (and test) fractions of the kept rows; they must sum to 1."""

    seed: int = 0
    """Seed of every hash-based order (split order, ties, row order in shards)."""

    representation: Literal["smiles", "selfies", "safe"] = "smiles"
    """What the tokens spell: canonical SMILES, SELFIES (one token per bracket symbol; needs the
    ``selfies`` package) or SAFE (BRICS fragments as a SMILES-compatible string; needs
    ``safe-mol``). Each row is decoded back and compared with its canonical SMILES; rows that do
    not round-trip are rejected with the reason. Sampling and evaluation decode through it."""

    conformers: Literal["none", "etkdg", "sd"] = "none"
    """``etkdg``: write each molecule as a conformer unit, its canonical SMILES and one 3D
    conformer as text (``[SMILES]...[/SMILES][CONFORMER]x,y,z;...[/CONFORMER]``, heavy atoms in
    SMILES order): RDKit ETKDGv3, seeded per molecule; molecules it cannot embed in time are
    rejected (``conformer_error``, ``conformer_timeout``). ``sd``: the unit of each SD record's
    own 3D coordinates (docking poses, a vendor's 3D library), checked and written as
    ``--unit_template`` units are (``--conformer_frame``); a record with 2D coordinates is
    refused (``sd_not_3d``), as are bad geometry and stereo (``unit_geometry``,
    ``unit_stereo``). SD input only. Needs ``representation smiles``."""

    conformer_mmff: bool = True
    """Relax each conformer with MMFF94 (a molecule MMFF has no parameters for keeps its ETKDG
    geometry, counted as ``mmff_unparameterized``)."""

    conformer_timeout_s: int = 2
    """Budget per molecule for embedding and relaxing, in whole seconds of CPU time (1 to 3600;
    RDKit's own wall-clock timeout stops an embedding at 4x it)."""

    conformer_decimals: int = 2
    """Digits after the point of each coordinate in Å (0 to 4; 2: within 0.005 Å)."""

    unit_template: Optional[str] = None
    """Conformer units from JSON-lines records that already hold a conformer: the unit with
    ``{key}`` for each record field, e.g. ``[SMILES]{smiles}[/SMILES][CONFORMER]{xyz}[/CONFORMER]``
    (a field holds text ``x,y,z;...`` or a list of [x, y, z]; ``{unit}`` a whole unit). Each
    unit is checked against the row's molecule (its SMILES, any spelling; one x,y,z per heavy
    atom in that SMILES' atom order; bond lengths; the stereo the SMILES specifies) and
    written as ``--conformers etkdg`` writes one (canonical SMILES and atom order,
    ``--conformer_decimals``, ``--conformer_frame``). Refused rows: ``unit_missing_field``,
    ``unit_malformed``, ``unit_smiles_mismatch``, ``unit_atom_count``, ``unit_geometry``,
    ``unit_stereo``. JSONL input only; needs ``representation smiles`` and ``conformers none``."""

    conformers_per_molecule: int = 1
    """With conformers the input holds (``--unit_template``, ``--conformers sd``): how many
    conformers of one molecule to keep, the first ones in input order (0: all of them). Each
    is its own row; identical units count once; the others are counted as duplicates. The
    conformers of a molecule share its split (grouped by scaffold, or by molecule with
    ``--split random``)."""

    conformer_rank_by: Optional[str] = None
    """With conformers the input holds: the JSONL key or SD tag of a number to rank a
    molecule's conformers by (an energy), lowest first: ``--conformers_per_molecule`` K then
    keeps the K lowest (ties in input order) instead of the first K. A record without a
    number there is refused (``bad_conformer_rank``); a key or tag no record of a file has is
    refused naming the file."""

    conformer_frame: Literal["canonical", "as_given"] = "canonical"
    """The input's coordinates (``--unit_template``, ``--conformers sd``): ``canonical`` moves
    them as ETKDG units are (centroid at the origin, principal axes along x, y, z); ``as_given``
    keeps the record's frame (a pose in its pocket)."""

    randomized_variants: int = 0
    """Also write K randomized SMILES of every training molecule (Arus-Pous et al. 2019's
    restricted form: atoms renumbered at random, RDKit's non-canonical writer), tokenized, as
    the shards' ``randomized_token_ids`` column (0 to 64; 0: none). A recipe with
    ``data.randomized_smiles`` then reads them instead of running RDKit in the training
    process. Needs ``representation smiles`` without conformers. Spellings the vocabulary
    cannot cover are stored empty and counted (``randomized_failed``). With ``--task``: K
    root-aligned spellings of each training pair (R-SMILES, Zhong et al. 2022: the product
    side rooted at a random atom, the other side's molecules rooted at the atoms that
    correspond to it by their largest common substructure), each stored as source ``<sep>``
    target."""

    canonical_first: bool = False
    """With ``--task`` and ``--randomized_variants K``: the first of each training pair's K
    spellings writes the source canonically (its molecules in canonical order, each from
    RDKit's canonical start atom) with the target aligned to it, as R-SMILES's first
    augmentation does, so that the model also reads the spelling ``molds-eval`` and
    ``molds-predict`` score from; the other K-1 are drawn as before."""

    tokenizer: str = "regex"
    """``regex`` (atom-level SMILES regex), ``bpe`` (HF BPE), or a local HF tokenizer directory.
    With ``--randomized-variants``, a regex vocabulary of SMILES also holds the tokens another
    spelling of its molecules may need and the canonical forms never wrote (the other bond
    direction, the other tetrahedral tag of a bracket atom, ring numbers up to 9), so the
    stored randomized and root-aligned spellings fit it."""

    grow_vocab: bool = True
    """With ``--tokenizer DIR`` naming a regex tokenizer that molds wrote (a pretraining
    manifest's ``tokenizer/``): the tokens of this input that the vocabulary lacks (a salt, a
    metal, a charge) are added after its own tokens, whose ids stay as they were, so no molecule
    is refused for them; the manifest says what was added, and a model forked from a checkpoint
    of the given vocabulary grows its embedding rows to match (``--checkpoint.fork true``).
    ``false``: the vocabulary as given, a molecule with a token outside it refused
    (``tokenizer_roundtrip``). Any other tokenizer is used as given."""

    vocab_from: Literal["all", "train"] = "all"
    """Build the vocabulary from all kept molecules or from the train split only
    (then rows of valid/test with unknown tokens are kept and counted)."""

    bpe_vocab_size: int = 1024
    """Vocabulary size for ``--tokenizer bpe``."""

    length_buckets: list[int] = field(default_factory=lambda: [16, 32, 48, 64, 96, 128, 192, 256, 512])
    """Upper bounds (inclusive) of token-length buckets; one more open bucket follows."""

    shard_size_mb: float = 256.0
    """Target uncompressed size of a Parquet shard, counted on the rows' molecules, tokens and
    labels (not on the columns naming the input's path: the same file cuts alike from anywhere)."""

    row_group_rows: int = 2048
    """Rows per Parquet row group: the unit the data plane reads, shuffles and assigns to ranks."""

    workers: int = 0
    """Worker processes (0: one per CPU core)."""

    engine: Literal["local", "ray"] = "local"
    """``local`` process pool, or Ray Data (``ray.init(address=...)`` from RAY_ADDRESS if set)."""

    chunk_rows: int = 4096
    """Records per task sent to a worker."""

    partition_rows: int = 250_000
    """Most rows a reduce partition holds in memory (bounds peak memory per worker)."""

    work_dir: Optional[str] = None
    """Where spill files go (default: inside the temporary output directory)."""

    on_truncated: Literal["fail", "keep"] = "fail"
    """A compressed input that ends before its end marker (a cut-short download): ``fail``
    stops the run (nothing written; OUT.failed-report.* accounts for every row read);
    ``keep`` keeps every record read before the cut, counts the cut as one
    ``truncated_input`` rejection per file (the record it cut, for SDF) and names the file
    and line in the manifest, the report and on stderr."""

    overwrite: bool = False
    """Replace an existing output directory (only once the new one is complete)."""

    progress: bool = True
    """Show progress bars on stderr."""
