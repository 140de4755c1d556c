"""Resume and fork semantics: what a run may change when it continues a checkpoint.

``--checkpoint.resume auto`` continues the run in ``run.output_dir`` from its latest
complete checkpoint; ``--checkpoint.resume REF`` from any checkpoint reference. The
recipe given now is compared with the one the checkpoint recorded:

- keys in ``RESUME_MUTABLE`` may change: the new values are applied (the learning-rate
  schedule is rebuilt from them at the resumed step) and recorded in the lineage's
  ``resume_changes``;
- any other changed key is refused, naming it, unless the run is forked
  (``--checkpoint.fork true``). So is another manifest (content hash) or tokenizer, and
  another global batch (sequences per optimizer step, whatever keys produce it). A fork too
  refuses another tokenizer vocabulary, unless one of the two was grown from the other (the
  same tokens with the same ids, then new ones): the rows of the new tokens are added, or
  the rows of tokens this vocabulary lacks dropped.

A fork starts a new run from a checkpoint's weights (and its optimizer state with
``checkpoint.fork_optimizer``): step 0, a fresh data cursor on the recipe's (possibly
new) manifest, a new schedule, and ``parent`` in its lineage. It writes into its own
``run.output_dir``.
"""

from __future__ import annotations

import fnmatch

import torch

from ..chemistry.tokens import element_token
from ..data.manifest import vocab_hash
from ..errors import CheckpointError, RecipeError
from ..recipe.parse import Recipe
from .state import canonical_state, read_model

RESUME_MUTABLE = (
    # the learning-rate schedule and the length of the run
    "optim.lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.warmup_fraction", "trainer.max_steps",
    "trainer.max_time", "trainer.precision",
    # what is logged, evaluated and saved, and when
    "logging.*", "eval.*", "checkpoint.*", "run.name", "run.output_dir", "run.overwrite", "run.expect",
    # how the same global batch is computed: topology, engine, launch and data-reading details
    "parallel.engine", "parallel.zero_stage", "parallel.ds_config", "parallel.offload_optimizer",
    "parallel.offload_params", "parallel.pp_size", "parallel.ep_size", "parallel.ddp_bucket_mb",
    "parallel.static_graph", "parallel.compile", "parallel.collective_timeout_s", "parallel.partition_method",
    "parallel.activation_checkpoint_interval", "parallel.schedule", "parallel.overlap_moe",
    "trainer.grad_accum", "trainer.global_batch_size", "trainer.on_nonfinite", "trainer.max_nonfinite_steps",
    "data.manifest", "data.verify", "data.on_bad_shard", "data.max_skipped_fraction", "data.num_workers",
    "kernels.compile_regions", "kernels.triton", "kernels.fused_backend",  # the same math (not kernels.fp8*)
    "goal.max_oracle_calls", "goal.top_k",  # the budget of a goal run, and what it writes at the end
)


def is_mutable(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in RESUME_MUTABLE)


def flatten(recipe: dict) -> dict:
    return {f"{section}.{key}": value for section, values in recipe.items() if isinstance(values, dict)
            for key, value in values.items()}


def recipe_changes(saved: dict, current: dict) -> dict:
    """key -> [saved value, current value] for every key that differs. A key the saved
    recipe does not hold (added to molds after it was written) counts as its default."""
    a, b = {**flatten(Recipe().to_dict()), **flatten(saved)}, flatten(current)
    return {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def check_resume(path: str, saved: dict, lineage: dict, fork: bool, resized: bool = False) -> dict:
    """Refuse what a resume may not change, and a fork onto another tokenizer vocabulary (the
    embedding and output rows are its tokens: another vocabulary's ids name other tokens,
    whether or not the shapes fit) unless the two begin alike (``resized``: see
    ``resized_vocabulary``); returns the applied changes (key -> [old, new])."""
    if (fork and not resized and saved.get("vocab_hash") and lineage.get("vocab_hash")
            and saved["vocab_hash"] != lineage["vocab_hash"]):
        parent = saved.get("manifest") or "the parent run's manifest"
        raise CheckpointError(
            f"cannot fork {path} onto {lineage.get('manifest') or 'this manifest'}: its tokenizer vocabulary "
            f"({lineage['vocab_hash'][:12]}) is not the checkpoint's ({saved['vocab_hash'][:12]}), nor one grown "
            f"from it or it from, and the embeddings are rows of the checkpoint's token ids. Make the manifest with the "
            f"checkpoint's tokenizer (tokens it lacks are added after its own): molds-preprocess ... "
            f"--tokenizer {parent}/tokenizer")
    problems = []
    for key, what in (("manifest_hash", "manifest (content hash)"), ("vocab_hash", "tokenizer vocabulary")):
        if saved.get(key) != lineage.get(key):
            problems.append(f"another {what}: {str(saved.get(key))[:12]} -> {str(lineage.get(key))[:12]}")
    old_batch, new_batch = saved.get("global_batch_sequences"), lineage.get("global_batch_sequences")
    if old_batch is not None and old_batch != new_batch:
        problems.append(f"another global batch: {old_batch} -> {new_batch} sequences per step (trainer."
                        f"global_batch_size / trainer.grad_accum x data-parallel size x data.micro_batch_size)")
    changes = recipe_changes(saved.get("recipe", {}), lineage["recipe"])
    refused = {k: v for k, v in changes.items() if not is_mutable(k)}
    problems += [f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in refused.items()]
    if problems and not fork:
        raise CheckpointError(
            f"cannot resume {path} with these changes: " + "; ".join(problems)
            + ". Keys that may change on resume: " + ", ".join(RESUME_MUTABLE[:4]) + ", logging.*, eval.*, "
            "checkpoint.*, the parallel layout and data-reading options; to start a new run from these "
            "weights pass --checkpoint.fork true (and a new --run.output_dir)")
    return {k: v for k, v in changes.items() if is_mutable(k)}


def fine_tune_heads(recipe, saved: dict | None, model, labels: list[str] | None = None) -> tuple | None:
    """A fork whose model differs from its checkpoint's only in the property heads (an
    encoder pretrained without labels, fine-tuned with ``model.num_tasks`` of them; another
    number or kind of tasks; or as many tasks of the same kind under other names, the
    manifest's label columns, ``labels``, against those the checkpoint's lineage records):
    (the heads' name prefixes, this model's freshly initialized head tensors, what changed).
    None for anything else: a resume, a fork onto the same tasks, a model without heads
    (another difference is refused when the weights are loaded, naming the tensors).
    ``saved``: the checkpoint's lineage (None: a fresh start)."""
    heads = getattr(model, "TASK_HEADS", None)
    if saved is None or not recipe.checkpoint.fork or not heads:
        return None
    changes = recipe_changes(saved.get("recipe", {}), recipe.to_dict())
    changed = {k: v for k, v in changes.items() if k in model.TASK_KEYS}
    if getattr(model.config, "num_tasks", 0) and saved.get("labels") and labels and list(saved["labels"]) != list(labels):
        changed["labels"] = [list(saved["labels"]), list(labels)]  # other tasks: a head's weights are another's
    if not changed:
        return None
    if recipe.checkpoint.fork_optimizer:
        raise RecipeError("checkpoint.fork_optimizer: the property heads change ("
                          + ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in changed.items())
                          + "), so their optimizer moments do not exist: fork the weights alone "
                          "(--checkpoint.fork_optimizer false)")
    tensors = {k: v.clone() for k, v in canonical_state(model).items() if k.startswith(heads)}
    return heads, tensors, changed


def resized_vocabulary(recipe, saved: dict | None, checkpoint: str | None, manifest, model) -> tuple | None:
    """A fork onto a manifest whose tokenizer vocabulary and the checkpoint's begin alike, one
    the other's first tokens with the same ids: this one grown from the checkpoint's
    (``molds-preprocess --tokenizer`` with the checkpoint's tokenizer added the tokens it
    lacked, after its own), or the checkpoint's grown from this one (a model pretrained on
    molecules whose vocabulary was grown from the pairs it is forked onto). Returns (the
    checkpoint's vocabulary size, this one's, {canonical name: tensor}) where each tensor with
    one row per token (embeddings, output layer, its bias; along whichever axis has one entry
    per token) holds the checkpoint's rows, cut to this vocabulary or followed by new rows,
    and {new token: the checkpoint's token whose rows it starts from, or None}. A new row is,
    with ``checkpoint.new_token_rows mean`` (the default), the mean of the checkpoint's rows;
    with ``element``, the row of the checkpoint's token that writes the same element, where
    the new token is a bracket atom and the checkpoint has one (``[C@@H]`` and ``[13C]``
    start as ``C``, ``[NH3+]`` as ``N``, ``[n+]`` as ``n``:
    ``molds.chemistry.tokens.element_token``), else the mean. None when the
    vocabulary is the checkpoint's, for a resume or a fresh start, or when the two do not
    begin alike (``check_resume`` refuses that fork)."""
    if saved is None or not recipe.checkpoint.fork or not saved.get("vocab_hash"):
        return None
    block = manifest.data["tokenizer"]
    if saved["vocab_hash"] == block.get("vocab_hash"):
        return None
    vocab = manifest.check_tokenizer()
    old = None
    # grown: the checkpoint's size is its lineage's (written since), else the one the manifest says it grew
    for n in sorted({saved.get("vocab_size"), (block.get("extends") or {}).get("vocab_size")} - {None}):
        if 0 < n < len(vocab) and vocab_hash({t: i for t, i in vocab.items() if i < n}) == saved["vocab_hash"]:
            old = n
    # cut: the checkpoint's vocabulary was grown from this one
    parent = saved.get("vocab_extends") or {}
    if old is None and parent.get("vocab_hash") == block.get("vocab_hash") and saved.get("vocab_size"):
        old = int(saved["vocab_size"])
    if old is None:
        return None
    if recipe.checkpoint.fork_optimizer:
        raise RecipeError(f"checkpoint.fork_optimizer: the vocabulary changes ({old} -> {len(vocab)} tokens), so "
                          f"its rows' optimizer moments do not fit: fork the weights alone "
                          f"(--checkpoint.fork_optimizer false)")
    weights, own = read_model(checkpoint), canonical_state(model)
    tokens = {i: t for t, i in vocab.items()}
    known = {t: i for t, i in vocab.items() if i < old}
    sources = {tokens[i]: (element_token(tokens[i], known) if recipe.checkpoint.new_token_rows == "element" else None)
               for i in range(old, len(vocab))}
    resized = {}
    for name, was in weights.items():
        now = own.get(name)
        if now is None or was.dim() != now.dim():
            continue
        # the axis of one entry per token (dim 0 of an embedding; the last of BART's logits bias)
        axes = [d for d in range(was.dim()) if was.shape[d] == old and now.shape[d] == len(vocab)
                and all(was.shape[e] == now.shape[e] for e in range(was.dim()) if e != d)]
        if len(axes) == 1:
            d = axes[0]
            kept = was.float().narrow(d, 0, min(old, len(vocab)))
            mean = was.float().mean(d, keepdim=True)
            rows = [mean if src is None else was.float().narrow(d, known[src], 1) for src in sources.values()]
            resized[name] = torch.cat([kept, *rows], d).to(was.dtype)
    if not resized:
        raise CheckpointError(f"{checkpoint}: the vocabulary changes from {old} to {len(vocab)} tokens, but no "
                              f"weight of the checkpoint has one row per token")
    return old, len(vocab), resized, sources


def resumed_dtype(recipe, saved: dict | None) -> str | None:
    """What the run a resume continues computed in (``trainer.precision=auto`` keeps it),
    from its lineage ``saved``; None for a fresh start, a fork, or a lineage that does not
    say."""
    if saved is None or recipe.checkpoint.fork:
        return None
    plan = saved.get("plan")
    return plan.get("dtype") if isinstance(plan, dict) else None


def resumed_fp8_products(recipe, saved: dict | None) -> dict | None:
    """Which products the run a resume continues ran in FP8 (``kernels.fp8_products=faster``
    keeps that choice), from its lineage ``saved``; None for a fresh start, a fork, or a
    lineage without one."""
    if saved is None or recipe.checkpoint.fork:
        return None
    chosen = saved.get("fp8_products")
    return chosen if isinstance(chosen, dict) else None
