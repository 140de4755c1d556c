"""The recipe: one typed dataclass per section; the signatures are the schema.

Each field's docstring is its ``--help`` text. Each numeric field has a declared range
in its section's ``RANGES`` (inclusive bounds; ``None``: unbounded on that side),
checked when the recipe is parsed (``molds.recipe.parse.check_ranges``): a value outside it
is refused with the key and the range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, Literal, Optional

_BIG = 1 << 30  # an upper bound for counts no run approaches


@dataclass
class DataConfig:
    """What the training data plane reads and how it batches it."""

    RANGES: ClassVar[dict] = {
        "seq_len": (8, 1 << 20), "micro_batch_size": (1, 1 << 16), "lookahead": (1, 1 << 20),
        "shuffle_window": (0, _BIG), "seed": (0, 2**32 - 1), "max_tokens_per_batch": (8, 1 << 26),
        "bucket_pool": (1, 1 << 24), "max_length": (3, 1 << 20), "mlm_probability": (0.0, 0.9),
        "mask_span_mean": (0.0, 64.0),
        "randomized_smiles": (0.0, 1.0),
        "num_workers": (0, 256), "max_steps": (1, None), "max_epochs": (1, None), "stop_after_epoch": (0, None),
        "max_skipped_fraction": (0.0, 1.0),
    }

    manifest: str = ""
    """Directory of a ``molds-preprocess`` output (or its manifest.json), local or fsspec URI."""

    split: str = "train"
    """Which split to stream."""

    mode: Literal["packed", "bucketed"] = "packed"
    """``packed``: molecules packed into fixed ``seq_len`` rows (causal LMs);
    ``bucketed``: length-grouped batches under a token budget (encoders, property prediction)."""

    seq_len: int = 512
    """Packed row length in tokens (BOS and EOS included)."""

    micro_batch_size: int = 8
    """Rows per packed batch; rows per batch in ``fixed_shape`` bucketed mode."""

    lookahead: int = 512
    """Molecules the packer may choose from when it closes a row."""

    shuffle: bool = True
    """Shuffle units and rows each epoch (seeded by ``seed`` and the epoch)."""

    shuffle_window: int = 16384
    """Molecules permuted together after the unit/row shuffle (0 or 1: off)."""

    seed: int = 0
    """Seed of every data-side random choice (order, windows, masking)."""

    too_long: Literal["truncate", "reject"] = "truncate"
    """A molecule longer than ``seq_len`` (packed) or ``max_length`` (bucketed): truncate or
    drop it; either way it is counted."""

    max_tokens_per_batch: int = 8192
    """Bucketed: padded tokens (rows x longest) per batch at most; for pairs, rows x (longest
    source + longest target), both sides padded."""

    bucket_pool: int = 1600
    """Bucketed: molecules sorted together to form length-grouped batches."""

    max_length: int = 256
    """Bucketed: longest molecule in tokens (BOS/EOS included)."""

    fixed_shape: bool = False
    """Bucketed: every batch exactly ``micro_batch_size`` x ``max_length`` (pipeline engines)."""

    mlm_probability: float = 0.0
    """Bucketed: BERT masking rate (0 disables MLM masking); with ``mask_span_mean``, the share
    of each molecule's tokens that span masking hides."""

    mask_span_mean: float = 0.0
    """Bucketed, ``model.family: seq2seq`` on molecules: denoising pretraining (BART's text
    infilling, as Chemformer pretrains). ``mlm_probability`` of each molecule's tokens are
    hidden in spans whose lengths are drawn from a Poisson distribution of this mean (at least
    one token). Each run of hidden tokens becomes one ``<mask>``. The encoder reads the masked
    molecule, and the decoder writes it whole. 0: off."""

    randomized_smiles: float = 0.0
    """Augmentation (Arus-Pous et al. 2019, J. Cheminform. 11:71): the probability that a
    molecule is read, in a given epoch, as a randomized SMILES (its atoms renumbered at random,
    then RDKit's non-canonical writer) instead of the manifest's canonical one. Drawn per (seed,
    epoch, molecule), so every epoch sees other forms and a resume is exact. 0 disables it.
    On a manifest of pairs: the share of pairs read in one of the root-aligned spellings
    ``molds-preprocess --task ... --randomized-variants K`` stored (R-SMILES)."""

    randomized_marker: Literal["sep", "none"] = "sep"
    """With ``randomized_smiles``: ``sep`` starts each randomized molecule with the tokenizer's
    sep token after BOS (unused otherwise by causal LMs), and sampling forbids that token, so a
    decoder samples canonical SMILES while it learns from both forms; ``none``: untagged."""

    randomized_from: Literal["auto", "manifest", "rdkit"] = "auto"
    """With ``randomized_smiles``: where the randomized spellings come from. ``manifest``: the
    variants ``molds-preprocess --randomized-variants K`` stored in the shards (no RDKit work
    in the training process; molecule m reads variant (offset_m + epoch) mod K); ``rdkit``:
    written with RDKit as row groups load; ``auto``: the manifest's when it has them."""

    with_labels: bool = False
    """Bucketed: return the manifest's ``labels`` with a missing-value mask."""

    verify: Literal["eager", "lazy", "off"] = "eager"
    """Check every shard's sha256 and row count before training (eager) or when first opened (lazy)."""

    on_bad_shard: Literal["error", "skip"] = "error"
    """A shard that fails verification: stop with its name, or skip it and report (eager only)."""

    max_skipped_fraction: float = 0.01
    """With ``on_bad_shard: skip``: stop if more than this fraction of the split's rows
    sits in skipped shards (skipped shards and rows are logged and counted as data/skipped_*)."""

    num_workers: int = 0
    """DataLoader worker processes per rank (each owns a disjoint part of the rank's share)."""

    max_steps: Optional[int] = None
    """Stop after this many batches on this rank (None: no limit)."""

    max_epochs: Optional[int] = None
    """Stop after this many epochs (None: iterate forever)."""

    stop_after_epoch: Optional[int] = None
    """Stop when this epoch (0-based) is finished, whatever ``max_epochs`` says."""


@dataclass
class RunConfig:
    """Names and places of a run."""

    RANGES: ClassVar[dict] = {"seed": (0, 2**32 - 1), "min_gpus": (0, 1024)}

    name: str = "molds"
    """Run name (TensorBoard and checkpoint directory names)."""

    output_dir: str = "runs/molds"
    """Where checkpoints, TensorBoard events, metrics.jsonl and the resolved recipe go.
    A directory that already holds checkpoints is refused unless the run resumes
    (``--checkpoint.resume auto``) or ``run.overwrite`` is true."""

    overwrite: bool = False
    """Start over in an output_dir that holds an earlier run: its checkpoints, metrics
    and TensorBoard events are deleted first."""

    seed: int = 0
    """Seed of model initialization and of every training-side random choice."""

    min_gpus: int = 0
    """GPUs per machine the recipe is sized for (0: runs anywhere). With fewer CUDA devices
    visible the run stops at once and names its CPU twin (recipes/smoke/ of the same name)."""

    expect: Dict[Literal["bf16-native", "fp32-only"], str] = field(default_factory=dict)
    """What the recipe reaches on each class of CPU (``bf16-native``: bf16 products measured faster, AMX or AVX-512 BF16;
    ``fp32-only``: AVX2 and the like; see ``molds.recipe.precision``), measured: said on the start line of a CPU run."""


@dataclass
class ModelConfig:
    """The network, built from this config (no weights are downloaded)."""

    RANGES: ClassVar[dict] = {
        "hidden_size": (8, 1 << 16), "num_layers": (1, 1024), "num_heads": (1, 1024), "num_kv_heads": (1, 1024),
        "intermediate_size": (0, 1 << 18), "max_position_embeddings": (8, 1 << 20), "rope_theta": (1.0, 1e9),
        "dropout": (0.0, 0.9), "num_tasks": (0, 1 << 16), "num_experts": (0, 1024), "moe_top_k": (1, 8),
        "moe_expert_size": (0, 1 << 18), "moe_shared_expert_size": (0, 1 << 18), "moe_aux_loss_coef": (0.0, 10.0),
        "moe_z_loss_coef": (0.0, 10.0), "moe_capacity_factor": (0.0, 64.0), "moe_first_dense_layers": (0, 1024),
        "moe_layer_interval": (1, 1024), "decoder_layers": (0, 1024),
    }

    family: Literal["decoder", "encoder", "seq2seq"] = "decoder"
    """``decoder``: causal LM (Llama-style); ``encoder``: RoBERTa-style MLM / property prediction;
    ``seq2seq``: BART-style encoder-decoder for pair tasks (a manifest of ``molds-preprocess --task``
    pairs, ``data.mode: bucketed``)."""

    hidden_size: int = 256
    """Width of the residual stream."""

    num_layers: int = 4
    """Transformer blocks (seq2seq: the encoder's)."""

    decoder_layers: int = 0
    """Seq2seq: the decoder's blocks (0: as many as ``num_layers``)."""

    num_heads: int = 8
    """Attention heads."""

    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention; decoder only)."""

    intermediate_size: int = 0
    """MLP width (0: 8/3 x hidden for the decoder, 4 x hidden for the encoder and seq2seq)."""

    max_position_embeddings: int = 2048
    """Longest position the model supports."""

    rope_theta: float = 10000.0
    """RoPE base (decoder)."""

    dropout: float = 0.0
    """Dropout (encoder, seq2seq)."""

    num_tasks: int = 0
    """Encoder property heads: number of label columns (0: MLM only)."""

    task_type: Literal["classification", "regression"] = "classification"
    """Encoder property heads: masked BCE (classification: labels from 0 to 1, classes or
    probabilities, any other value in the train split refused at the start) or masked MSE (regression, of labels
    standardized by the train split's mean and standard deviation per task; predictions,
    metrics and the exported model in the labels' own units)."""

    pooling: Literal["bos", "mean", "auto"] = "bos"
    """Encoder property heads: what they read, the <bos> token's final state (``bos``, as
    ``RobertaForSequenceClassification``), the mean over the molecule's tokens (``mean``), or
    ``auto``: the mean for regression heads that also read ``molecule_features``, the first
    token otherwise (the choice MoleculeNet's validation splits made; heads on tokens alone
    keep the first token, which ``molds-export`` can write)."""

    molecule_features: Literal["none", "rdkit2d", "morgan", "rdkit2d+morgan"] = "none"
    """Encoder property heads: molecule features read beside the pooled token, as Chemprop's
    ``--molecule-featurizers`` (``rdkit2d``: RDKit's 2D descriptors, standardized by the train
    split; ``morgan``: the Morgan count fingerprint, radius 2, 2,048 bits; ``rdkit2d+morgan``:
    both; ``molds.chemistry.features``)."""

    tie_embeddings: bool = True
    """Decoder: the LM head shares the token embedding matrix."""

    num_experts: int = 0
    """Decoder: experts per mixture-of-experts layer (0: a dense decoder)."""

    moe_top_k: int = 2
    """MoE: experts each token is routed to (1-8)."""

    moe_score: Literal["softmax", "sigmoid"] = "softmax"
    """MoE: router scores (softmax over experts, as Mixtral/Qwen3; or sigmoid, as DeepSeek-V3);
    the top-k weights are renormalized to sum to one."""

    moe_expert_size: int = 0
    """MoE: SwiGLU width of each expert (0: intermediate_size)."""

    moe_shared_expert_size: int = 0
    """MoE: SwiGLU width of a shared expert every token passes through (0: none)."""

    moe_aux_loss_coef: float = 0.01
    """MoE: weight of the load-balancing loss (Switch Transformer: E x sum f_i P_i)."""

    moe_z_loss_coef: float = 0.0
    """MoE: weight of the router z-loss (mean squared log-sum-exp of the router logits)."""

    moe_capacity_factor: float = 0.0
    """MoE: 0 for dropless routing; else each expert takes at most
    capacity_factor x tokens x top_k / experts tokens and the rest are dropped (counted)."""

    moe_first_dense_layers: int = 0
    """MoE: the first N blocks keep a dense MLP."""

    moe_layer_interval: int = 1
    """MoE: after the dense ones, every N-th block is an MoE block (1: all)."""


@dataclass
class ParallelConfig:
    """How the model is driven across ranks."""

    RANGES: ClassVar[dict] = {
        "zero_stage": (0, 3), "pp_size": (1, 1024), "ep_size": (1, 1024), "ddp_bucket_mb": (1, 4096),
        "collective_timeout_s": (1.0, 86400.0), "activation_checkpoint_interval": (0, 1024),
    }

    engine: Literal["ddp", "zero", "pipeline"] = "ddp"
    """``ddp``: torch DistributedDataParallel; ``zero``: DeepSpeed ZeRO; ``pipeline``: DeepSpeed pipeline."""

    zero_stage: int = 2
    """ZeRO stage 0-3 (engine zero)."""

    ds_config: Optional[str] = None
    """DeepSpeed JSON (ds_configs/), relative to the recipe file that names it (or to the
    working directory when given on the command line). Its keys are kept; what the
    recipe decides (batch sizes, ZeRO stage, offload, clipping, precision) is filled in
    where the file is silent and refused where it disagrees; the optimizer and scheduler
    come from the recipe's ``optim`` section, so the file may not set them."""

    offload_optimizer: bool = False
    """ZeRO: keep optimizer state on the CPU."""

    offload_params: bool = False
    """ZeRO-3: keep parameters on the CPU."""

    pp_size: int = 1
    """Pipeline stages (engine pipeline)."""

    ep_size: int = 1
    """Expert-parallel group size (MoE models): the experts of each MoE layer are spread
    over this many data-parallel ranks."""

    schedule: Literal["1f1b", "dualpipev"] = "1f1b"
    """Pipeline schedule (engine pipeline). ``1f1b``: DeepSpeed's, one stage per rank.
    ``dualpipev``: DeepSeek's V-shaped DualPipe, two stages per rank (the model is cut in
    2 x pp_size), zero-bubble weight gradients and overlapped forward & backward pairs;
    needs trainer.grad_accum >= 2 x pp_size (``molds-schedule`` shows both timelines)."""

    overlap_moe: bool = True
    """dualpipev: in a forward & backward pair, interleave the two micro-batches at the MoE
    all-to-alls so one's exchange is in flight while the other computes (off: one after
    the other, for comparison)."""

    partition_method: str = "parameters"
    """Pipeline: how DeepSpeed's PipelineModule cuts the layers into stages
    (``parameters``, ``uniform``, or ``type:DecoderLayer``-style regex)."""

    activation_checkpoint_interval: int = 0
    """Pipeline: recompute activations every N layers in backward (0: off)."""

    collective_timeout_s: float = 600.0
    """Every process group molds or DeepSpeed creates times out after this many seconds:
    a hung or dead peer ends the job with an error naming the rank and the operation."""

    ddp_bucket_mb: int = 25
    """DDP gradient bucket size in MB."""

    static_graph: bool = True
    """DDP static_graph (the graph of these models does not change between steps)."""

    compile: bool = False
    """torch.compile the model (ddp engine). On packed rows the attention layout and its
    grouped attention run eagerly (they follow the batch's molecule lengths); the rest
    compiles once for every token count."""


@dataclass
class KernelsConfig:
    """Custom operators, applied to the built model as converters (molds.kernels). Each op
    runs its Triton kernel on a GPU and its PyTorch path on a CPU; the start line says
    which path each op takes and how many modules each converter swapped."""

    fp8: bool = False
    """FP8 training (DeepSeek-V3's recipe): the decoder's and the experts' linears quantize
    both operands in blocks (1x128 tiles for activations and gradients, 128x128 blocks for
    weights) at every product, forward and backward, and accumulate in float32; master
    weights stay as they are. GEMMs: torch scaled_mm on Hopper, Triton on other FP8 GPUs,
    emulated in float32 on a CPU (same quantization, for testing recipes)."""

    fp8_recipe: Literal["blockwise", "rowwise", "tensorwise"] = "blockwise"
    """kernels.fp8: how tensors are scaled. ``blockwise``: molds' own (the description of
    ``kernels.fp8``; linears, experts and optionally head and router). ``rowwise`` (a scale
    per row) and ``tensorwise`` (one per tensor): torchao's ``Float8Linear`` for the decoder's
    linears, torchtitan's recipes (products through cuBLAS on an FP8 GPU, torchao's emulation
    elsewhere); the LM head, router and experts keep the run's precision. Which one is
    fastest is measured per card (benchmarks/gpu_check.py)."""

    fp8_products: Literal["all", "faster"] = "all"
    """kernels.fp8: which products run in FP8, under every ``fp8_recipe``. ``all``: every
    linear and expert set the other switches name. ``faster``: at start each distinct
    product shape is timed, forward and backward at a micro-batch's tokens, in FP8 and in the run's precision, and
    only those FP8 ran faster are converted; the start line and the lineage give each
    product's ratio, and a resume keeps the choice of the run it continues."""

    fp8_lm_head: bool = False
    """kernels.fp8: the LM head in FP8 too (off: it keeps the run's precision)."""

    fp8_router: bool = False
    """kernels.fp8: the MoE router's product in FP8 too (off: routing decisions keep the
    run's precision)."""

    fp8_pow2_scales: bool = False
    """kernels.fp8: round every block scale down to a power of two (scaling and unscaling
    are then exact; costs up to one bit of the format's range)."""

    fp8_grad_format: Literal["e5m2", "e4m3"] = "e5m2"
    """kernels.fp8: format of the gradients in the backward products (e5m2: more range;
    e4m3: more precision, as DeepSeek-V3 uses with its fine-grained scales). The row-wise
    recipe casts gradients to e4m3 only (torchao's)."""

    fp8_experts: bool = False
    """kernels.fp8_recipe=rowwise: the MoE experts' grouped GEMMs in row-wise FP8 too
    (torchao's grouped GEMM through ``torch._scaled_grouped_mm`` on a GPU of compute
    capability 9.0 or later, each expert's tokens padded to a multiple of 16; emulated
    elsewhere; with ``fp8_products: faster`` only where it measured faster). Off: they stay
    BF16 ``grouped_mm``. Needs model.hidden_size and model.moe_expert_size to be multiples
    of 16. (The block-wise recipe converts the experts with the linears.)"""

    triton: bool = False
    """Fused Triton kernels for RMSNorm, SwiGLU, the MoE token permute / unpermute and the
    LM head with the loss (never the full float32 logits); PyTorch paths on a CPU."""

    fused_backend: Literal["auto", "molds", "liger"] = "auto"
    """kernels.triton: whose kernels run RMSNorm, SwiGLU and the LM head with the loss.
    ``auto``: Liger Kernel's on a CUDA GPU where it is installed (measured faster there),
    molds' own elsewhere; ``molds``: molds' own everywhere; ``liger``: Liger Kernel's
    (CUDA GPUs only). The MoE permute / unpermute are molds' own in every case; the start
    line names which implementation each op runs."""

    compile_regions: bool = False
    """torch.compile the decoder's elementwise regions (RoPE, SwiGLU, RMSNorm) for every
    shape: inductor fuses each into one kernel forward and one backward. Compiled once
    per process (about 10 s on a CPU, then cached on disk); needs a C++ compiler on CPU."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    RANGES: ClassVar[dict] = {
        "lr": (0.0, 10.0), "min_lr_ratio": (0.0, 1.0), "warmup_steps": (0, _BIG), "warmup_fraction": (0.0, 0.9),
        "weight_decay": (0.0, 10.0), "layer_decay": (0.0, 1.0),
        "beta1": (0.0, 0.999999), "beta2": (0.0, 0.999999999), "eps": (1e-30, 1.0), "grad_clip": (0.0, 1e6),
    }

    lr: float = 3e-4
    """Peak learning rate."""

    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""

    warmup_steps: Optional[int] = None
    """Linear warmup length in optimizer steps (unset: 100, unless ``warmup_fraction`` is set)."""

    warmup_fraction: float = 0.0
    """Linear warmup over this fraction of the run (of ``trainer.max_steps``, or of the time
    budget ``trainer.max_time``: what a budgeted recipe uses); not with ``warmup_steps``."""

    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms and biases)."""

    layer_decay: float = 1.0
    """Layer-wise learning rates, for fine-tuning (ELECTRA, BEiT): the heads and final norm
    learn at ``lr``, each block below at ``layer_decay`` times the rate of the one above, the
    embeddings lowest (a seq2seq's decoder blocks above its encoder's). 1: one rate for all;
    0: only the heads learn."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon (above 0: where a parameter's gradients have all been 0, the update is
    0 / (sqrt(0) + eps); with eps 0 it is NaN)."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""


@dataclass
class TrainerConfig:
    """The loop."""

    RANGES: ClassVar[dict] = {"max_steps": (1, _BIG), "global_batch_size": (0, _BIG), "grad_accum": (0, 1 << 16),
                              "max_nonfinite_steps": (0, _BIG)}

    max_steps: Optional[int] = None
    """Optimizer steps to train (unset: 1000, unless ``max_time`` is set)."""

    max_time: Optional[str] = None
    """Train for this much wall-clock time instead ("2h", "1h45m", "90m", "5400s"): the
    learning-rate schedule, ``checkpoint.interval_fraction`` and ``checkpoint.average_last``
    follow the fraction of it spent; a resumed run carries what it spent. Not with ``max_steps``."""

    global_batch_size: int = 0
    """Sequences per optimizer step across all data-parallel ranks, as DeepSpeed's
    ``train_batch_size`` counts them: data.micro_batch_size x grad_accum x data-parallel
    size (0: derived from grad_accum). A packed sequence holds several molecules; the
    start-of-run summary prints sequences, molecules and real tokens per step."""

    grad_accum: int = 0
    """Micro-batches per optimizer step on each rank (0: derived from global_batch_size, else 1)."""

    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    """A step whose loss or gradient norm is NaN or infinite: ``stop`` the run (nothing
    non-finite is saved), ``skip`` the step (no update; counted), or ``rollback`` to the
    last checkpoint and go on with the data after the bad batch (counted)."""

    max_nonfinite_steps: int = 10
    """``skip`` / ``rollback``: stop once this many steps were non-finite in the run."""

    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """``auto``: bf16 where a bf16 matrix product of the model's shape measures faster than
    fp32 on this device (timed at start, said on the start line), fp32 otherwise; a resume
    keeps what the checkpoint's run computed in, so it continues with the same numbers.
    ``bf16`` / ``fp32``: as asked (the start line says when the other measured faster)."""


@dataclass
class EvalConfig:
    """Evaluation during training (``eval/*`` in TensorBoard); see also ``molds-eval``."""

    RANGES: ClassVar[dict] = {
        "interval_steps": (0, _BIG), "full_interval_steps": (0, _BIG), "max_batches": (0, _BIG),
        "samples": (1, 1 << 24), "full_samples": (1, 1 << 24), "temperature": (1e-3, 100.0), "top_k": (0, 1 << 20),
        "grid": (0, 256), "beams": (1, 64),
    }

    interval_steps: int = 0
    """Smoke evaluation every N steps (0: off): loss and perplexity on ``split`` and, for
    decoders, validity and uniqueness of ``samples`` sampled molecules."""

    full_interval_steps: int = 0
    """Full evaluation every N steps (0: only at the end, when either interval is set):
    adds novelty, diversity, scaffold novelty and filters of ``full_samples`` molecules,
    a grid image of them, their SMILES as text, their length histogram beside the
    training data's, and at the end hparams with the final metrics."""

    split: str = "valid"
    """Split evaluated."""

    max_batches: int = 50
    """Loss batches per rank per evaluation (0: the whole split)."""

    samples: int = 256
    """Molecules sampled by a smoke evaluation (all ranks together)."""

    full_samples: int = 2000
    """Molecules sampled by a full evaluation (all ranks together)."""

    temperature: float = 1.0
    """Sampling temperature."""

    top_k: int = 0
    """Sample from the k most likely tokens (0: the full distribution)."""

    fcd: bool = False
    """Also compute the Fréchet ChemNet Distance to ``split`` in full evaluations (fcd_torch)."""

    grid: int = 16
    """Molecules drawn in the TensorBoard image."""

    beams: int = 5
    """Pair models (a manifest of ``molds-preprocess --task``): a full evaluation scores
    ``full_samples`` pairs of ``split`` by beam search of this width (``eval/top{k}`` for k up
    to it, ``eval/invalid_beams``); a smoke evaluation scores ``samples`` pairs greedily
    (``eval/top1``). Needs the whole model on every rank: ddp, zero stages 0-2, or the
    pipeline (its stages gathered), not ZeRO-3."""


@dataclass
class CheckpointConfig:
    """Saving and resuming (see docs/guides/training.md: run directories, resume and fork)."""

    RANGES: ClassVar[dict] = {"interval_steps": (0, _BIG), "keep_last": (0, 1 << 20), "interval_fraction": (0.0, 1.0),
                              "average_last": (0, 1 << 10)}

    interval_steps: int = 0
    """Save every N steps (0: only at the end)."""

    interval_fraction: float = 0.0
    """Save each time the run passes another multiple of this fraction of its length (of
    its steps, or of ``trainer.max_time``); 0: off. With ``interval_steps`` both apply."""

    average_last: int = 0
    """At the end, write the mean of the last N checkpoints (the final one included) as
    ``RUN/averaged``, the model to sample and export: ``molds-sample RUN``, ``molds-eval`` and
    ``molds-export`` take it from the run directory (``molds-average``'s average; 0: off)."""

    keep_last: int = 3
    """Keep this many checkpoints (0: all)."""

    resume: Optional[str] = None
    """``auto``: continue the run in output_dir from its latest complete checkpoint (a
    fresh start when it has none); or a checkpoint reference (a checkpoint directory, a
    run directory, a ``latest`` file). Short form: ``--resume auto``. Only the keys listed
    in docs/reference/recipe.md may change on resume; others need ``--checkpoint.fork true``."""

    fork: bool = False
    """Start a new run from the checkpoint's weights: step 0, a fresh data cursor on
    this recipe's manifest (which may differ), any recipe change allowed; the parent is
    recorded in the lineage. Short form: ``--fork true``. An encoder forked with another
    ``model.num_tasks`` or ``task_type`` (fine-tuning a pretrained encoder on labels), or
    onto a manifest whose label columns are not the checkpoint's (by name and order),
    keeps every other weight and starts its property heads afresh, seeded by ``run.seed``."""

    fork_optimizer: bool = False
    """With ``fork``: also keep the optimizer's moments (not the schedule's position)."""

    new_token_rows: Literal["mean", "element"] = "mean"
    """A fork onto a manifest whose tokenizer grew the checkpoint's vocabulary (tokens the
    pretraining never saw: stereocentres, charges, salts): where each new token's embedding
    (and output) rows start. ``mean``: every new token from the mean of the checkpoint's
    rows. ``element``: a bracket atom starts from the row of the checkpoint's token that
    writes its element (``[C@@H]`` as ``C``, ``[NH3+]`` as ``N``, ``[n+]`` as ``n``), any
    other new token from the mean (measured on three MoleculeNet validation splits and not
    the default: docs/benchmarks/moleculenet.md). The start line and the lineage say which
    token started from which."""


@dataclass
class LoggingConfig:
    """TensorBoard, JSONL and the progress bar."""

    RANGES: ClassVar[dict] = {"interval_steps": (1, _BIG), "peak_tflops": (1e-6, 1e6), "profile_steps": (0, 1000)}

    interval_steps: int = 10
    """Log every N optimizer steps."""

    tensorboard: bool = True
    """Write TensorBoard events under output_dir/tensorboard."""

    progress: bool = True
    """Progress bar on rank 0."""

    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device for MFU (None: known GPUs are looked up; CPU: no MFU)."""

    profile_steps: int = 0
    """Profile this many steps with torch.profiler, starting after the first logging window
    (which holds start-up and compilation): rank 0 prints where a step's time went (matrix
    products, attention, loss, optimizer, other operators, time outside operators) and its
    slowest operators, logs ``profile/*_ms``, and writes a Chrome trace to
    ``output_dir/profile/``. 0: off."""
