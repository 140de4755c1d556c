"""``molds-eval``: what a checkpoint knows about chemistry.

    molds-eval runs/gpt-moses/checkpoints/step-2000 --split test --num 10000 --seeds 0,1,2
    molds-eval runs/mlm/checkpoints/step-500 --manifest data/bbbp --split test
    molds-eval --recipe recipes/smoke/mlm_multitask_zero2.json --seeds 0,1,2 --split test --trainer.max_steps=200
    molds-eval --samples other_model.smi --manifest data/moses --fcd

A decoder is scored on the split's next-token loss / perplexity and on sampled
molecules (``molds.metrics.generation``: validity, uniqueness, novelty against the
manifest's training split, diversity, scaffold novelty, filters, FCD to the split with
``--fcd``), one sample set per seed. An encoder with property heads is scored on the
split's labels (``molds.metrics.property``), an MLM-only encoder on its masked-token
loss. With ``--recipe`` the recipe is trained once per seed (``--run.seed``) and every
final checkpoint evaluated; further recipe overrides go as ``--key=value``. ``--samples``
scores a file of SMILES from elsewhere against a manifest the same way. Seeds are
reported as mean and standard deviation. Writes ``eval.json`` and ``eval.md`` to ``--out``
(default: ``CHECKPOINT/eval-SPLIT``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass

import torch


@dataclass
class Loaded:
    model: torch.nn.Module
    family: str
    recipe: dict
    manifest: object
    tokenizer: object
    specials: dict
    lineage: dict
    checkpoint: str  # the checkpoint directory itself (a run directory resolved to its latest)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, or a run / checkpoints directory standing for its latest."""
    from molds.checkpoint import LATEST

    for root in (path, os.path.join(path, "checkpoints")):
        if os.path.exists(os.path.join(root, "lineage.json")):
            return root
        pointer = os.path.join(root, LATEST)
        if os.path.exists(pointer):
            with open(pointer) as fh:
                return os.path.join(root, fh.read().strip())
    raise FileNotFoundError(f"{path} is not a molds checkpoint (no lineage.json) nor a run with a latest checkpoint")


def load_model(checkpoint: str, manifest_dir: str | None = None, device: str = "cpu") -> Loaded:
    """A checkpoint's network in fp32, rebuilt from its lineage (any engine, any world size)."""
    from transformers import AutoTokenizer

    from molds.data.manifest import Manifest
    from molds.export import checkpoint_state_dict, special_ids
    from molds.models import family_config

    checkpoint = resolve_checkpoint(checkpoint)
    path = os.path.join(checkpoint, "lineage.json")
    with open(path) as fh:
        lineage = json.load(fh)
    recipe = lineage["recipe"]
    manifest = Manifest.load(manifest_dir or recipe["data"]["manifest"])
    vocab = manifest.check_tokenizer()
    if manifest.data["tokenizer"]["vocab_hash"] != lineage["vocab_hash"]:
        raise ValueError(f"{manifest.path} has another tokenizer than {checkpoint} was trained with "
                         f"(vocab_hash {manifest.data['tokenizer']['vocab_hash'][:12]} != {lineage['vocab_hash'][:12]})")
    specials = special_ids(vocab, manifest.data["tokenizer"]["special_tokens"])
    cfg = family_config(recipe["model"], len(vocab), specials)
    family = recipe["model"]["family"]
    if family == "decoder":
        from molds.models.decoder import CausalDecoder

        model = CausalDecoder(cfg)
    else:
        from molds.models.encoder import MoleculeEncoder

        model = MoleculeEncoder(cfg)
    state = {k: v.float() for k, v in checkpoint_state_dict(checkpoint, lineage.get("engine", "ddp")).items()}
    own = model.state_dict()
    for name, tensor in own.items():  # tied weights: a checkpoint keeps one name of each tied pair
        if name not in state:
            twin = next((k for k, t in own.items() if k in state and t.data_ptr() == tensor.data_ptr()), None)
            if twin is not None:
                state[name] = state[twin]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint} does not fit its recipe's model: missing {missing}, unexpected {unexpected}")
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(manifest.tokenizer_path)
    return Loaded(model, family, recipe, manifest, tok, specials, lineage, checkpoint)


def split_data_config(recipe_data: dict, manifest_dir: str, split: str, **over):
    """The recipe's data section (a dict) set to read ``split`` once, in order, in-process."""
    from molds.config import DataConfig

    fields = {f.name for f in dataclasses.fields(DataConfig)}
    cfg = DataConfig(**{k: v for k, v in recipe_data.items() if k in fields})
    return dataclasses.replace(cfg, manifest=manifest_dir, split=split, shuffle=False, max_epochs=1, max_steps=None,
                               stop_after_epoch=None, num_workers=0, **over)


def _stand_in(family: str, specials: dict, device) -> dict:
    """A two-token batch for a rank whose share of the split has run out while others
    still have batches: its forward keeps ZeRO-3's parameter gathers in step; its loss
    is not counted."""
    ids = torch.tensor([[specials["bos"], specials["eos"]]], device=device)
    if family == "decoder":
        return {"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1]], device=device),
                "document_ids": torch.zeros_like(ids)}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mlm_labels": torch.full_like(ids, -100)}


def _batches(data_cfg, family: str, *, rank: int, world: int, max_batches: int, device, any_have):
    """(loader batch or None, model inputs) for this rank's share of a split. With
    ``any_have`` (a collective: does any rank still have a batch?) a rank whose share has
    run out goes on with stand-in inputs until every rank is done."""
    from molds.data.loader import MoleculeLoader, model_inputs

    loader = MoleculeLoader(data_cfg, rank=rank, world_size=world)
    it = iter(loader)
    done = 0
    while not max_batches or done < max_batches:
        b = next(it, None)
        if not (any_have(b is not None) if any_have else b is not None):
            return
        yield b, (model_inputs(b, device) if b is not None else _stand_in(family, loader.specials, device))
        done += 1


@torch.no_grad()
def split_loss(model, family: str, data_cfg, *, rank: int = 0, world: int = 1, max_batches: int = 0,
               device=None, autocast=contextlib.nullcontext, any_have=None) -> tuple[float, float]:
    """(summed loss over predicted tokens, number of predicted tokens) of this rank's share
    of a split; the shares of all ranks cover the split once. ``any_have`` keeps ranks in
    step under ZeRO-3 (every forward gathers parameters collectively)."""
    from molds.data.packing import IGNORE_INDEX

    device = device or next(model.parameters()).device
    total = count = 0.0
    for b, batch in _batches(data_cfg, family, rank=rank, world=world, max_batches=max_batches, device=device,
                             any_have=any_have):
        with autocast():
            loss = model(**batch)["loss"]
        if b is None:
            continue
        if family == "decoder":
            n = b["stats"]["real_tokens"] - b["stats"]["molecules"]  # next-token pairs
        else:
            n = int((batch["mlm_labels"] != IGNORE_INDEX).sum())
        if n:
            total += float(loss) * n
            count += n
    return total, count


@torch.no_grad()
def property_predictions(model, data_cfg, *, rank: int = 0, world: int = 1, device=None,
                         autocast=contextlib.nullcontext, any_have=None):
    """(labels [N, T] with NaN, predictions [N, T]) over this rank's share of a labelled split."""
    import numpy as np

    device = device or next(model.parameters()).device
    ys, ps = [], []
    for b, batch in _batches(data_cfg, "encoder", rank=rank, world=world, max_batches=0, device=device,
                             any_have=any_have):
        batch.pop("labels", None)
        batch.pop("mlm_labels", None)
        with autocast():
            pred = model(**batch)["predictions"].float().cpu().numpy()
        if b is None:
            continue
        y = b["labels"].numpy().astype(float)
        y[~b["label_mask"].numpy().astype(bool)] = np.nan
        ys.append(y)
        ps.append(pred)
    if not ys:
        return np.zeros((0, 0)), np.zeros((0, 0))
    return np.concatenate(ys), np.concatenate(ps)


def property_report(labels, preds, model_cfg: dict, manifest) -> dict:
    from molds.metrics.property import classification_metrics, regression_metrics

    names = (manifest.data.get("labels") or {}).get("columns") or None
    if model_cfg["task_type"] == "classification":
        return classification_metrics(labels, preds, names)
    return regression_metrics(labels, preds, names)


def evaluate_checkpoint(checkpoint: str, *, manifest_dir: str | None = None, split: str = "test",
                        num: int = 10000, seeds=(0,), temperature: float = 1.0, top_k: int = 0,
                        max_batches: int = 0, fcd: bool = False, batch_size: int = 512) -> dict:
    from molds.eval.sampling import default_max_tokens, ids_to_smiles, sample_ids
    from molds.metrics.property import mean_std

    loaded = load_model(checkpoint, manifest_dir)
    m = loaded.manifest
    report = {"checkpoint": os.path.abspath(loaded.checkpoint), "manifest": m.path, "split": split,
              "family": loaded.family}
    if not m.shards(split):
        raise ValueError(f"{m.path} has no rows in split {split!r}")
    model_cfg = loaded.recipe["model"]
    if loaded.family == "decoder":
        from molds.metrics.generation import generation_metrics

        cfg = split_data_config(loaded.recipe["data"], m.path, split, mode="packed")
        total, count = split_loss(loaded.model, "decoder", cfg, max_batches=max_batches)
        report["loss"] = total / count
        report["perplexity"] = math.exp(report["loss"])
        max_tokens = default_max_tokens(m, model_cfg["max_position_embeddings"])
        per_seed = []
        for seed in seeds:
            ids = sample_ids(loaded.model, num, bos=loaded.specials["bos"], eos=loaded.specials["eos"],
                             max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed,
                             batch_size=batch_size)
            smiles = ids_to_smiles(loaded.tokenizer, ids)
            metrics = generation_metrics(smiles, m, fcd_reference=split if fcd else None, seed=seed)
            metrics["unfinished_or_special"] = sum(s is None for s in smiles)
            per_seed.append(metrics)
            report.setdefault("examples", [s for s in smiles if s][:20])
        report["sampling"] = {"num": num, "temperature": temperature, "top_k": top_k, "max_tokens": max_tokens,
                              "seeds": list(seeds)}
        report["per_seed"] = per_seed
        report["metrics"] = mean_std(per_seed)
    elif model_cfg["num_tasks"]:
        cfg = split_data_config(loaded.recipe["data"], m.path, split, mode="bucketed", with_labels=True,
                           mlm_probability=0.0)
        y, p = property_predictions(loaded.model, cfg)
        report["property"] = property_report(y, p, model_cfg, m)
        report["metrics"] = {k: v for k, v in report["property"]["macro"].items() if not k.endswith("_tasks")}
    else:
        prob = loaded.recipe["data"].get("mlm_probability") or 0.15
        cfg = split_data_config(loaded.recipe["data"], m.path, split, mode="bucketed", mlm_probability=prob,
                           with_labels=False)
        total, count = split_loss(loaded.model, "encoder", cfg, max_batches=max_batches)
        report["metrics"] = {"mlm_loss": total / count, "mlm_perplexity": math.exp(total / count)}
    return report


def evaluate_samples(path: str, manifest_dir: str, *, split: str = "test", fcd: bool = False) -> dict:
    """Generation metrics of a SMILES file (another tool's samples, say) against a manifest."""
    from molds.data.manifest import Manifest
    from molds.metrics.generation import generation_metrics

    with open(path, encoding="utf-8") as fh:
        smiles = [line.strip() or None for line in fh]
    if not smiles:
        raise ValueError(f"{path}: no samples")
    m = Manifest.load(manifest_dir)
    metrics = generation_metrics(smiles, m, fcd_reference=split if fcd else None)
    return {"checkpoint": None, "samples_file": os.path.abspath(path), "manifest": m.path, "split": split,
            "family": "samples", "metrics": metrics, "examples": [s for s in smiles if s][:20]}


def markdown(report: dict) -> str:
    source = (f"- samples: {report['samples_file']}" if report.get("samples_file")
              else f"- checkpoint(s): {report.get('checkpoint')}\n- model: {report.get('family')}")
    lines = [f"# molds-eval: {report.get('split')} split", "", source, f"- manifest: {report.get('manifest')}"]
    if "loss" in report:
        lines.append(f"- {report['split']} loss {report['loss']:.4f}, perplexity {report['perplexity']:.3f}")
    lines += ["", "| metric | value |", "|---|---|"]
    def fmt(v):
        return "n/a" if v is None else f"{v:.0f}" if float(v).is_integer() and abs(v) > 1 else f"{v:.4f}"

    for key, val in report["metrics"].items():
        if isinstance(val, dict) and len(val["values"]) > 1:
            shown = f"{fmt(val['mean'])} ± {val['std']:.4f} (n={len(val['values'])})"
        else:
            shown = fmt(val["mean"] if isinstance(val, dict) else val)
        lines.append(f"| {key} | {shown} |")
    if report.get("property"):
        lines += ["", "| task | n | " + " | ".join(k for k in next(iter(report["property"]["per_task"].values()))
                                                    if k != "n") + " |"]
        for task, vals in report["property"]["per_task"].items():
            cells = [("n/a" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v))
                     for k, v in vals.items() if k != "n"]
            lines.append(f"| {task} | {vals['n']} | " + " | ".join(cells) + " |")
    if report.get("examples"):
        lines += ["", "First samples (valid or not): " + ", ".join(f"`{s}`" for s in report["examples"][:10])]
    return "\n".join(lines) + "\n"


def _write(out: str, report: dict) -> None:
    os.makedirs(out, exist_ok=True)
    for name, text in (("eval.json", json.dumps(report, indent=2)), ("eval.md", markdown(report))):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, os.path.join(out, name))


def _flat(report: dict) -> dict:
    return {k: (v["mean"] if isinstance(v, dict) else v) for k, v in report["metrics"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="molds-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="a checkpoint directory (or use --recipe)")
    ap.add_argument("--manifest", default=None, help="evaluate on this manifest (default: the training one)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--num", type=int, default=10000, help="samples per seed (decoder)")
    ap.add_argument("--seeds", default="0", help="comma-separated: sampling seeds, or training seeds with --recipe")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top_k", "--top-k", type=int, default=0)
    ap.add_argument("--max_batches", type=int, default=0, help="loss on at most this many batches (0: all)")
    ap.add_argument("--fcd", action="store_true", help="Fréchet ChemNet Distance to the split (fcd_torch)")
    ap.add_argument("--recipe", default=None, help="train this recipe once per seed, then evaluate each")
    ap.add_argument("--samples", default=None,
                    help="score the SMILES in this file (one per line, an empty line counts as invalid) against "
                         "--manifest's training split, instead of a checkpoint's samples")
    ap.add_argument("--out", default=None)
    args, overrides = ap.parse_known_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    common = dict(manifest_dir=args.manifest, split=args.split, num=args.num, temperature=args.temperature,
                  top_k=args.top_k, max_batches=args.max_batches, fcd=args.fcd)
    if args.samples:
        if args.checkpoint or args.recipe or not args.manifest:
            ap.error("--samples takes --manifest and neither a CHECKPOINT nor --recipe")
        report = evaluate_samples(args.samples, args.manifest, split=args.split, fcd=args.fcd)
        out = args.out or os.path.splitext(args.samples)[0] + "-eval"
    elif args.recipe:
        if args.checkpoint:
            ap.error("--recipe trains its own checkpoints: give no CHECKPOINT, and recipe overrides as --key=value")
        from molds.metrics.property import mean_std
        from molds.train import main as train

        out = args.out or os.path.join("runs", "eval-" + os.path.splitext(os.path.basename(args.recipe))[0])
        reports = []
        for seed in seeds:
            result = train(["--recipe", args.recipe, "--run.seed", str(seed), "--data.seed", str(seed),
                            "--run.output_dir", os.path.join(out, f"seed{seed}"), *overrides])
            reports.append(evaluate_checkpoint(result["checkpoint"], seeds=(seed,), **common))
        report = {**{k: reports[0][k] for k in ("manifest", "split", "family")},
                  "checkpoint": [r["checkpoint"] for r in reports], "training_seeds": seeds,
                  "per_seed": reports, "metrics": mean_std([_flat(r) for r in reports])}
    else:
        if not args.checkpoint:
            ap.error("give a CHECKPOINT or --recipe")
        if overrides:
            ap.error(f"unrecognized arguments: {' '.join(overrides)}")
        report = evaluate_checkpoint(args.checkpoint, seeds=seeds, **common)
        out = args.out or os.path.join(args.checkpoint, f"eval-{args.split}")
    _write(out, report)
    print(markdown(report))
    print(f"[molds] report: {os.path.join(out, 'eval.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
