"""The recipe: one typed dataclass per section; the signatures are the schema.

Sections land here as the issues that own them do; ``data`` is the data plane's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class DataConfig:
    """What the training data plane reads and how it batches it."""

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
    """Bucketed: padded tokens (rows x longest) per batch at most."""

    bucket_pool: int = 1600
    """Bucketed: molecules sorted together to form length-grouped batches."""

    max_length: int = 256
    """Bucketed: longest molecule in tokens (BOS/EOS included)."""

    fixed_shape: bool = False
    """Bucketed: every batch exactly ``micro_batch_size`` x ``max_length`` (pipeline engines)."""

    mlm_probability: float = 0.0
    """Bucketed: BERT masking rate (0 disables MLM masking)."""

    with_labels: bool = False
    """Bucketed: return the manifest's ``labels`` with a missing-value mask."""

    verify: Literal["eager", "lazy", "off"] = "eager"
    """Check every shard's sha256 and row count before training (eager) or when first opened (lazy)."""

    on_bad_shard: Literal["error", "skip"] = "error"
    """A shard that fails verification: stop with its name, or skip it and report (eager only)."""

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

    name: str = "molds"
    """Run name (TensorBoard and checkpoint directory names)."""

    output_dir: str = "runs/molds"
    """Where checkpoints, TensorBoard events, metrics.jsonl and the resolved recipe go."""

    seed: int = 0
    """Seed of model initialization and of every training-side random choice."""


@dataclass
class ModelConfig:
    """The network, built from this config (no weights are downloaded)."""

    family: Literal["decoder", "encoder"] = "decoder"
    """``decoder``: causal LM (Llama-style); ``encoder``: RoBERTa-style MLM / property prediction."""

    hidden_size: int = 256
    """Width of the residual stream."""

    num_layers: int = 4
    """Transformer blocks."""

    num_heads: int = 8
    """Attention heads."""

    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention; decoder only)."""

    intermediate_size: int = 0
    """MLP width (0: 8/3 x hidden for the decoder, 4 x hidden for the encoder)."""

    max_position_embeddings: int = 2048
    """Longest position the model supports."""

    rope_theta: float = 10000.0
    """RoPE base (decoder)."""

    dropout: float = 0.0
    """Dropout (encoder)."""

    num_tasks: int = 0
    """Encoder property heads: number of label columns (0: MLM only)."""

    task_type: Literal["classification", "regression"] = "classification"
    """Encoder property heads: masked BCE (classification) or masked MSE (regression)."""


@dataclass
class ParallelConfig:
    """How the model is driven across ranks."""

    engine: Literal["ddp", "zero", "pipeline"] = "ddp"
    """``ddp``: torch DistributedDataParallel; ``zero``: DeepSpeed ZeRO; ``pipeline``: DeepSpeed pipeline."""

    zero_stage: int = 2
    """ZeRO stage 0-3 (engine zero)."""

    ds_config: Optional[str] = None
    """DeepSpeed JSON from ds_configs/ (batch-size fields are filled from the recipe)."""

    offload_optimizer: bool = False
    """ZeRO: keep optimizer state on the CPU."""

    offload_params: bool = False
    """ZeRO-3: keep parameters on the CPU."""

    pp_size: int = 1
    """Pipeline stages (engine pipeline)."""

    ep_size: int = 1
    """Expert-parallel group size (MoE models)."""

    num_experts: int = 0
    """Experts per MoE layer (0: dense)."""

    schedule: Literal["1f1b", "dualpipev"] = "1f1b"
    """Pipeline schedule (engine pipeline)."""

    ddp_bucket_mb: int = 25
    """DDP gradient bucket size in MB."""

    static_graph: bool = True
    """DDP static_graph (the graph of these models does not change between steps)."""

    compile: bool = False
    """torch.compile the model (ddp engine)."""


@dataclass
class KernelsConfig:
    """Custom operators."""

    fp8: bool = False
    """FP8 matmuls (needs the FP8 kernels; not available yet)."""

    triton: bool = False
    """Triton kernels (not available yet)."""

    compile_regions: bool = False
    """torch.compile the decoder's elementwise regions (RoPE, SwiGLU, RMSNorm) for every
    shape: inductor fuses each into one kernel forward and one backward. Compiled once
    per process (about 10 s on a CPU, then cached on disk); needs a C++ compiler on CPU."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 3e-4
    """Peak learning rate."""

    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""

    warmup_steps: int = 100
    """Linear warmup length in optimizer steps."""

    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms and biases)."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""


@dataclass
class TrainerConfig:
    """The loop."""

    max_steps: int = 1000
    """Optimizer steps to train."""

    global_batch_size: int = 0
    """Micro-batches x data-parallel ranks x accumulation (0: micro_batch_size x data-parallel size)."""

    grad_accum: int = 0
    """Micro-batches per optimizer step on each rank (0: derived from global_batch_size)."""

    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """``auto``: bf16 autocast on a CUDA device that supports it, fp32 otherwise."""


@dataclass
class EvalConfig:
    """Evaluation during training (``eval/*`` in TensorBoard); see also ``molds-eval``."""

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


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    interval_steps: int = 0
    """Save every N steps (0: only at the end)."""

    keep_last: int = 3
    """Keep this many checkpoints (0: all)."""

    resume: Optional[str] = None
    """``auto`` (the latest under output_dir), a checkpoint directory, or None."""

    fork: bool = False
    """Allow resuming on a different manifest or tokenizer."""


@dataclass
class LoggingConfig:
    """TensorBoard, JSONL and the progress bar."""

    interval_steps: int = 10
    """Log every N optimizer steps."""

    tensorboard: bool = True
    """Write TensorBoard events under output_dir/tensorboard."""

    progress: bool = True
    """Progress bar on rank 0."""

    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device for MFU (None: known GPUs are looked up; CPU: no MFU)."""
