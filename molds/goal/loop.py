"""The goal run: an agent, initialised from a prior decoder, steered toward a scoring
function by REINVENT's augmented-likelihood loss (``molds.models.loss.AugmentedLikelihoodLoss``).

    deepspeed --num_gpus 2 molds/train.py --recipe recipes/goal_qed_lead.json
    python molds/train.py --recipe recipes/goal_pmo.json --goal.scoring '{"oracle": "qed"}'

One step, on every rank at once (``GoalRun.step``):

1. each rank samples its share of ``goal.batch_size`` molecules from the agent, seeded by
   (run.seed, step, rank), so a resumed run samples what the uninterrupted one did;
2. the ranks gather the canonical SMILES; the ledger (``molds.goal.ledger``, the same on
   every rank) says which are new, which repeat and which no longer fit the budget;
3. the new molecules are scored by the ranks in turn and the scores gathered; the ledger
   counts the calls, applies the diversity filter and updates the memory;
4. each rank trains on its own samples (invalid ones with score 0, repeated ones with the
   score they got when first seen) plus its share of molecules replayed from the memory,
   each spelled as a new random SMILES: the prior's log-likelihood of each row is taken
   here, the agent's inside the engine's step (ddp or ZeRO, as a training run).

Rank 0 appends every scored molecule to ``RUN/scored.csv`` once (call, step, stage,
SMILES, score, the filtered score, scaffold, each component); at the end it writes the best
``goal.top_k`` to ``RUN/topk.csv``. A checkpoint holds the agent, its optimizer, the
generators and the ledger; a resume cuts ``scored.csv`` back to the checkpoint's calls and
goes on, so the molecules logged are those of an uninterrupted run.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import sys
import time

import numpy as np
import torch
from rdkit import Chem

from ..checkpoint import open_checkpoint, read_lineage, restore, save_checkpoint
from ..checkpoint.resume import check_resume, resumed_dtype, resumed_fp8_products
from ..checkpoint.rundir import plan_resume, prepare_output_dir
from ..checkpoint.state import load_canonical, read_model
from ..chemistry.representation import of_manifest
from ..chemistry.tasks import lineage_block
from ..chemistry.tokens import IGNORE_INDEX
from ..engines import build_engine
from ..errors import CheckpointError, MoldsError, RecipeError
from ..eval.sampling import default_max_tokens, forbidden_tokens, ids_to_texts, sample_ids, texts_to_smiles
from ..kernels import apply_kernels, kernel_summary
from ..kernels.fp8_select import choose_for_run
from ..metrics.generation import parse_samples
from ..metrics.logger import MetricsLogger
from ..models import build_model, count_parameters
from ..models.loss import AugmentedLikelihoodLoss, sequence_log_likelihood
from ..recipe.plan import resolve_plan
from ..runtime.atomic import write_json, write_text
from ..runtime.distributed import all_have, all_reduce_sum, collective, gather_objects, init_distributed
from ..runtime.lifecycle import code_version, leave_process_group, machine, quiet_third_party, seed_rank
from .ledger import INVALID, NEW, OVER_BUDGET, Ledger, murcko_scaffold, pmo_auc
from .plan import build_scorers, check_goal, goal_recipe, stages_of

SCORED_CSV = "scored.csv"
TOPK_CSV = "topk.csv"
GOAL_STATE = "goal"  # the ledger's key in the checkpoint's data_state.json
#: goal.patience as PMO's REINVENT counts it: steps that leave the best 100 scores as they
#: were, once more than 1,000 calls are spent
PATIENCE_TOP, PATIENCE_AFTER_CALLS = 100, 1000


# ---------------------------------------------------------------- the run

@dataclasses.dataclass
class GoalRun:
    recipe: object
    dist: object
    prior: object  # molds.checkpoint.Loaded: the frozen prior (model, tokenizer, manifest)
    engine: object
    scorers: list
    stages: list
    ledger: Ledger
    plan: object
    lineage: dict
    log: object = None
    representation: object = None
    max_tokens: int = 0
    forbid: tuple = ()
    step: int = 0
    start_step: int = 0
    ended: str | None = None


def run_goal(recipe, plan_world: int | None = None) -> dict:
    """Set up, run and finish a goal run (``molds/train.py`` with ``goal.prior``)."""
    world = plan_world or int(os.environ.get("WORLD_SIZE", "1"))
    check_goal(recipe, world)
    scorers = build_scorers(recipe.goal)  # refused before any process group
    try:
        run = setup_goal(recipe, scorers)
    except BaseException:
        leave_process_group()
        raise
    try:
        loop(run)
        return finish_goal(run)
    finally:
        if run.log is not None:
            run.log.close()
        run.engine = None
        leave_process_group(run.dist)


def setup_goal(recipe, scorers) -> GoalRun:
    quiet_third_party()
    dist = init_distributed(recipe.parallel.collective_timeout_s, need_group=recipe.parallel.engine == "zero")
    try:
        prior = open_checkpoint(recipe.goal.prior, device=str(dist.device))
    except MoldsError:
        raise
    except Exception as exc:  # a path that is no checkpoint at all
        raise CheckpointError(f"goal.prior={recipe.goal.prior}: not a molds checkpoint ({exc})") from None
    if prior.manifest.pairs is not None:
        raise RecipeError(f"goal.prior={recipe.goal.prior}: {prior.checkpoint} is a {prior.manifest.pairs.get('task')} "
                          f"pair model, which completes a source; the agent samples molecules from nothing, so its "
                          f"prior must be trained on a manifest of molecules")
    if prior.family != "decoder":
        raise RecipeError(f"goal.prior={recipe.goal.prior}: {prior.checkpoint} holds an encoder; the agent samples, so "
                          f"its prior must be a decoder")
    for p in prior.model.parameters():
        p.requires_grad_(False)
    recipe, notes = goal_recipe(recipe, prior, dist.world_size)
    resume_from = plan_resume(recipe)
    saved = read_lineage(resume_from) if resume_from is not None else None
    prepare_output_dir(recipe, dist, resuming=resume_from is not None)
    plan = resolve_plan(recipe, dist.world_size).on_device(recipe, dist, resumed_dtype(recipe, saved))
    model = build_model(recipe.model, prior.specials, seed=recipe.run.seed)
    load_canonical(model, read_model(prior.checkpoint), prior.checkpoint)  # the agent starts as the prior
    parameters = count_parameters(model)
    loss = AugmentedLikelihoodLoss(recipe.goal.sigma, recipe.goal.likelihood_penalty)
    fp8_choice = choose_for_run(recipe, model, dist, plan.dtype, resumed_fp8_products(recipe, saved))
    apply_kernels(model, recipe.kernels, loss, dist.device, fp8_choice)
    kernels = kernel_summary(model, dist.device)
    engine = build_engine(recipe, model, loss, dist, plan)
    seed_rank(recipe.run.seed, dist.rank)
    lineage = {
        "recipe": recipe.to_dict(), "manifest_hash": prior.manifest.hash, "manifest": prior.manifest.path,
        "vocab_hash": prior.specials.vocab_hash,
        "canonicalization_hash": prior.manifest.data["canonicalization"].get("hash"),
        "pairs": lineage_block(prior.manifest.pairs),
        "code_version": code_version(), "engine": engine.name, "world_topology": engine.topology.as_dict(),
        "world_size": dist.world_size, "global_batch_sequences": recipe.goal.batch_size, "grad_accum": 1,
        "parameters": parameters, "kernels": kernels, "plan": plan.summary(), "precision": plan.precision.describe(),
        "machine": machine(dist.device),
        "goal": {"prior": os.path.abspath(prior.checkpoint), "prior_step": prior.lineage.get("step")},
    }
    if fp8_choice is not None:
        lineage["fp8_products"] = fp8_choice.as_dict()
    stages = stages_of(recipe.goal)
    run = GoalRun(recipe, dist, prior, engine, scorers, stages, Ledger(recipe.goal), plan, lineage)
    run.representation = of_manifest(prior.manifest)
    run.max_tokens = recipe.goal.max_tokens or default_max_tokens(prior.manifest,
                                                                  recipe.model.max_position_embeddings)
    run.forbid = forbidden_tokens(prior.recipe, prior.specials)
    if resume_from is not None:
        _resume(run, resume_from, saved)
    elif dist.is_main:
        _write_scored_header(run)
    if dist.is_main:
        write_json(os.path.join(recipe.run.output_dir, "recipe.json"), recipe.to_dict(), indent=2)
    run.log = MetricsLogger(recipe.run.output_dir, dist.is_main, recipe.logging.tensorboard,
                            start_step=run.step if run.start_step else None)
    if dist.is_main:
        for note in notes:
            print(f"[molds] note: {note}", file=sys.stderr)
        g = recipe.goal
        budget = f"{g.max_oracle_calls:,} oracle calls" if g.max_oracle_calls else "no call budget"
        print(f"[molds] goal run: agent of {parameters:,} parameters from {prior.checkpoint} on {engine.name} "
              f"(world {dist.world_size}); {len(stages)} stage(s); {g.batch_size} samples per step"
              f" + {g.replay_samples if g.replay_size else 0} replayed; sigma {g.sigma:g}; {budget}; "
              f"at most {plan.horizon.describe()}; {plan.precision.describe()}", file=sys.stderr)
        run.log.text("run/recipe", "```\n" + json.dumps(recipe.to_dict(), indent=2) + "\n```")
    return run


def _resume(run: GoalRun, path: str, saved: dict) -> None:
    """Continue the goal run ``path``, whose lineage is ``saved``."""
    if "goal" not in saved:
        raise CheckpointError(f"{path} is a training checkpoint, not a goal run's: to steer it, name it as goal.prior "
                              f"in a new run.output_dir")
    check_resume(path, saved, run.lineage, False)
    run.plan.horizon.start(int(saved["step"]), 0.0)
    step, data_state = restore(path, run.engine, run.dist, seed=run.recipe.run.seed)
    if GOAL_STATE not in data_state:
        raise CheckpointError(f"{path}: data_state.json holds no goal ledger")
    run.ledger.load_state_dict(data_state[GOAL_STATE], path)
    run.step = run.start_step = step
    run.lineage["resumed_from"] = os.path.abspath(path)
    if run.dist.is_main:
        kept = _cut_scored(run, run.ledger.calls)
        print(f"[molds] resumed the goal run from {path} at step {step}: {run.ledger.calls:,} calls spent, "
              f"stage {run.ledger.stage + 1}; {SCORED_CSV} kept its first {kept:,} rows", file=sys.stderr)


def loop(run: GoalRun) -> None:
    recipe, horizon = run.recipe, run.plan.horizon
    horizon.start(run.step, horizon.elapsed_s)
    while run.ended is None:
        if horizon.done:
            run.ended = "trainer.max_steps"
            break
        if run.ledger.spent:
            run.ended = "goal.max_oracle_calls"
            break
        if recipe.goal.patience and run.ledger.stall >= recipe.goal.patience:
            run.ended = "goal.patience"
            break
        with collective(f"goal step {run.step + 1}", run.dist):
            values = step(run)
        run.step += 1
        run.ledger.stage_steps += 1
        horizon.advance(run.step)
        stage = run.stages[run.ledger.stage]
        ends_stage = (stage["max_steps"] and run.ledger.stage_steps >= stage["max_steps"]) or (
            stage["threshold"] is not None and run.ledger.stage_steps >= stage["min_steps"]
            and values["goal/score_mean"] >= stage["threshold"])
        if run.step % recipe.logging.interval_steps == 0 or ends_stage or run.ledger.spent or horizon.done:
            run.log.scalars(run.step, values)
            # PMO's curve: the top-10 mean against the oracle calls spent
            run.log.series("goal/top10_mean_by_calls", values["goal/top10_mean"], run.ledger.calls)
            if run.dist.is_main and recipe.logging.progress:
                print(f"[molds] goal step {run.step}: stage {run.ledger.stage + 1}, calls {run.ledger.calls:,}, "
                      f"score mean {values['goal/score_mean']:.3f}, top-10 {values['goal/top10_mean']:.3f}, "
                      f"valid {values['goal/validity']:.2f}, loss {values['train/loss']:.3f}", file=sys.stderr)
        if ends_stage:
            if run.ledger.stage + 1 < len(run.stages):
                if run.dist.is_main:
                    print(f"[molds] stage {run.ledger.stage + 1} ends at step {run.step} "
                          f"({run.ledger.stage_steps} steps); stage {run.ledger.stage + 2} begins", file=sys.stderr)
                run.ledger.next_stage()
            else:
                run.ended = "the last stage's " + ("threshold" if stage["threshold"] is not None and
                                                   values["goal/score_mean"] >= stage["threshold"] else "max_steps")
        cp = recipe.checkpoint
        if run.ended is None and cp.interval_steps and run.step % cp.interval_steps == 0:
            save_goal(run)


def step(run: GoalRun) -> dict:
    """One step (a collective: every rank calls it)."""
    recipe, dist, g, ledger = run.recipe, run.dist, run.recipe.goal, run.ledger
    world, rank = dist.world_size, dist.rank
    per_rank = g.batch_size // world
    t0 = time.perf_counter()
    agent = run.engine.model
    agent.eval()
    seed = (recipe.run.seed * 1_000_003 + (run.step + 1) * 7_919 + rank * 104_729) % 2**63
    with run.engine.autocast():
        ids = sample_ids(agent, per_rank, bos=run.prior.specials.bos, eos=run.prior.specials.eos,
                         max_tokens=run.max_tokens, temperature=g.temperature, batch_size=per_rank, seed=seed,
                         device=dist.device, stop_together=_agreement(run), forbid=run.forbid)
    agent.train()
    texts = ids_to_texts(run.prior.tokenizer, ids)
    # canonical as the prior's manifest canonicalizes (the ETL's options), with its scaffold
    parsed = parse_samples(texts_to_smiles(texts, run.representation), run.prior.manifest)
    mols = [None if p is None else (p["canonical"], p["scaffold"]) for p in parsed]
    gathered_mols = [m for part in gather_objects(mols, dist) for m in part]  # rank order
    gathered = [None if m is None else m[0] for m in gathered_mols]
    scaffold_of = {m[0]: m[1] for m in gathered_mols if m is not None}
    status = ledger.classify(gathered)
    new = [c for c, st in zip(gathered, status) if st == NEW]
    scorer = run.scorers[ledger.stage]
    mine = new[rank::world]
    scored = scorer(mine) if mine else None
    names = [name for name, *_ in scorer.parts]
    part = [(float(scored.total[i]), {n: [float(scored.raw[n][i]), float(scored.components[n][i])] for n in names},
             scaffold_of[s] if scaffold_of[s] is not None else murcko_scaffold(s))
            for i, s in enumerate(mine)] if scored is not None else []
    parts = gather_objects(part, dist)
    results = [parts[i % world][i // world] for i in range(len(new))]  # back in the order of ``new``
    call0 = ledger.calls
    before = ledger.top_scores(PATIENCE_TOP) if g.patience else None
    filtered = ledger.record(new, [r[0] for r in results], [r[2] for r in results], run.step + 1)
    if g.patience and ledger.calls > PATIENCE_AFTER_CALLS:  # PMO's REINVENT: the best 100 unchanged
        ledger.stall = ledger.stall + 1 if ledger.top_scores(PATIENCE_TOP) == before else 0
    if dist.is_main and new:
        _append_scored(run, call0, new, results, filtered, names)
    # this rank's rows: its samples, then its share of the replayed memory
    start = rank * per_rank
    repeated = _repeated_in_batch(gathered) if g.unique_batch else None
    rows, scores, weights = [], [], []
    for i, sample in enumerate(ids):
        if sample is None:  # never ended: not a molecule, nothing to train on
            continue
        if repeated is not None and repeated[start + i]:  # goal.unique_batch: its first sample trains
            continue
        st, c = status[start + i], gathered[start + i]
        score = 0.0 if st == INVALID else (ledger.cache[c][1] if st != OVER_BUDGET else 0.0)
        rows.append(sample)
        scores.append(score)
        weights.append(0.0 if st == OVER_BUDGET else 1.0)
    replayed = ledger.replay(recipe.run.seed, run.step + 1)
    for j, (smi, score) in enumerate(replayed[rank::world]):
        spelled = _replay_ids(run, smi, seed=(recipe.run.seed * 7_919 + (run.step + 1) * 131 + rank * 17 + j))
        if spelled is not None:
            rows.append(spelled)
            scores.append(score)
            weights.append(1.0)
    n_rows = sum(weights)
    total_rows = all_reduce_sum([n_rows], dist)[0]
    unfinished = sum(s is None for s in ids)
    ledger.unfinished += int(all_reduce_sum([unfinished], dist)[0])
    if not rows:  # nothing at all on this rank: one empty molecule of weight 0 keeps the ranks in step
        rows, scores, weights = [[]], [0.0], [0.0]
    batch = _batch(run, rows, scores, weights, max(total_rows, 1.0) / world)
    with torch.no_grad():
        batch["prior_logp"] = sequence_log_likelihood(run.prior.model(**_inputs(batch)), batch).float()
    if total_rows == 0:
        result = None
    else:
        result = run.engine.train_step([batch])
    finite = result is None or (not result.skipped and math.isfinite(result.loss))
    if not all_have(finite, dist):  # the ranks agree, so none is left waiting in a collective
        what = (f"loss {result.loss:.4g}, gradient norm {result.grad_norm:.4g} on this rank" if result is not None
                else "no step")
        raise MoldsError(f"goal step {run.step + 1}: not finite on some rank ({what}); nothing of it was applied "
                         f"or saved; lower optim.lr or goal.sigma")
    # figures of the step (the same on every rank: from gathered values)
    sampled_scores = [0.0 if st == INVALID else ledger.cache[c][1] for c, st in zip(gathered, status)
                      if st != OVER_BUDGET]
    valid = [c for c in gathered if c is not None]
    values = {
        "goal/score_mean": float(np.mean(sampled_scores)) if sampled_scores else 0.0,
        "goal/score_max": float(np.max(sampled_scores)) if sampled_scores else 0.0,
        "goal/top10_mean": ledger.top_mean(10), "goal/oracle_calls": ledger.calls,
        "goal/validity": len(valid) / max(1, len(gathered)),
        "goal/uniqueness": len(set(valid)) / max(1, len(valid)),
        "goal/new_molecules": len(new), "goal/scaffolds": ledger.scaffolds_found(),
        "goal/stage": ledger.stage + 1, "goal/memory": len(ledger.memory), "goal/unfinished": ledger.unfinished,
        "goal/replayed": len(replayed), "goal/trained_rows": total_rows,
        "train/loss": 0.0 if result is None else all_reduce_sum([result.loss], dist)[0] / world,
        "train/lr": None if result is None else result.lr,
        "train/grad_norm": None if result is None else result.grad_norm,
        "goal/step_s": time.perf_counter() - t0,
    }
    if g.max_oracle_calls:
        values["goal/auc_top10"] = pmo_auc(ledger.history, g.max_oracle_calls)
    for n in names:
        vals = [r[1][n][1] for r in results]
        if vals:
            values[f"goal/component/{n}"] = float(np.mean(vals))
    return values


def _repeated_in_batch(gathered: list) -> list[bool]:
    """For each gathered sample (rank order): whether a sample before it in this step is the
    same molecule (invalid samples are never repeats of each other)."""
    seen, out = set(), []
    for c in gathered:
        out.append(c is not None and c in seen)
        if c is not None:
            seen.add(c)
    return out


def _agreement(run: GoalRun):
    """ZeRO-3 gathers parameters in every forward: its ranks finish a batch together."""
    if run.recipe.parallel.engine == "zero" and run.recipe.parallel.zero_stage == 3 and run.dist.distributed:
        return lambda finished: all_have(finished, run.dist)
    return None


def _replay_ids(run: GoalRun, smiles: str, seed: int) -> list[int] | None:
    """The tokens of a remembered molecule, spelled anew as a random SMILES (or its
    canonical one), in the prior's representation, behind the marker a prior trained with
    ``data.randomized_marker: sep`` read random spellings behind; None when the tokenizer
    cannot spell it or it does not fit."""
    text, randomized = smiles, False
    if run.recipe.goal.replay_randomized:
        mol = Chem.MolFromSmiles(smiles)
        if mol is not None:
            text = Chem.MolToRandomSmilesVect(mol, 1, randomSeed=seed % (2**31 - 1))[0]
            randomized = text != smiles
    if run.representation is not None and run.representation.name != "smiles":
        text, _ = run.representation.encode(text)
        if text is None:
            return None
    ids = run.prior.tokenizer(text, add_special_tokens=False)["input_ids"]
    unk = run.prior.tokenizer.unk_token_id
    if randomized and run.forbid:  # a prior that learned random spellings behind its marker: the same here
        ids = [*run.forbid, *ids]
    if (unk is not None and unk in ids) or len(ids) + 2 > run.recipe.model.max_position_embeddings:
        return None
    return ids


def _batch(run: GoalRun, rows: list, scores: list, weights: list, norm: float) -> dict:
    """Rows bos + tokens + eos, padded; document ids 0 on the molecule, -1 on padding."""
    sp = run.prior.specials
    seqs = [[sp.bos, *r, sp.eos] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), sp.pad, dtype=torch.long)
    doc = torch.full((len(seqs), width), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        doc[i, :len(s)] = 0
    pos = torch.arange(width).expand(len(seqs), width).contiguous()
    labels = ids.masked_fill(doc < 0, IGNORE_INDEX)
    dev = run.dist.device
    return {"input_ids": ids.to(dev), "position_ids": pos.to(dev), "document_ids": doc.to(dev),
            "labels": labels.to(dev), "score": torch.tensor(scores, dtype=torch.float32, device=dev) *
            torch.tensor(weights, dtype=torch.float32, device=dev),
            "weight": torch.tensor(weights, dtype=torch.float32, device=dev),
            "norm": torch.tensor(norm, dtype=torch.float32, device=dev)}


def _inputs(batch: dict) -> dict:
    return {k: batch[k] for k in ("input_ids", "position_ids", "document_ids")}


# ---------------------------------------------------------------- files

def _scored_path(run: GoalRun) -> str:
    return os.path.join(run.recipe.run.output_dir, SCORED_CSV)


def _columns(run: GoalRun) -> list[str]:
    names = []
    for scorer in run.scorers:
        for name, *_ in scorer.parts:
            if name not in names:
                names.append(name)
    return ["call", "step", "stage", "smiles", "score", "filtered_score", "scaffold"] + \
        [c for n in names for c in (f"{n}_raw", n)]


def _write_scored_header(run: GoalRun) -> None:
    buf = io.StringIO()
    csv.writer(buf).writerow(_columns(run))
    write_text(_scored_path(run), buf.getvalue())


def _append_scored(run: GoalRun, call0: int, new: list, results: list, filtered: list, names: list) -> None:
    cols = _columns(run)
    with open(_scored_path(run), "a", newline="") as fh:
        w = csv.writer(fh)
        for i, (smi, (total, comps, scaffold), f) in enumerate(zip(new, results, filtered)):
            row = {"call": call0 + i + 1, "step": run.step + 1, "stage": run.ledger.stage + 1, "smiles": smi,
                   "score": repr(total), "filtered_score": repr(f), "scaffold": scaffold}
            for n in names:
                row[f"{n}_raw"], row[n] = repr(comps[n][0]), repr(comps[n][1])
            w.writerow([row.get(c, "") for c in cols])
        fh.flush()


def _cut_scored(run: GoalRun, calls: int) -> int:
    """Keep the header and the first ``calls`` rows of scored.csv (what the checkpoint
    counted); rows a killed run wrote after its checkpoint go, and are scored again."""
    path = _scored_path(run)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the goal run's log of scored molecules cannot continue (its "
                              f"checkpoint counts {calls:,} calls)")
    with open(path, newline="") as fh:
        lines = fh.read().splitlines(keepends=True)
    if len(lines) - 1 < calls:
        raise CheckpointError(f"{path} holds {len(lines) - 1:,} scored molecules, fewer than the {calls:,} calls its "
                              f"checkpoint counts")
    write_text(path, "".join(lines[:calls + 1]))
    return calls


def save_goal(run: GoalRun) -> str:
    with collective(f"goal step {run.step}: saving a checkpoint", run.dist):
        lineage = dict(run.lineage, horizon=run.plan.horizon.state(),
                       goal=dict(run.lineage["goal"], calls=run.ledger.calls, stage=run.ledger.stage + 1))
        return save_checkpoint(run.recipe.run.output_dir, run.engine, run.dist, run.step,
                               {GOAL_STATE: run.ledger.state_dict()}, lineage,
                               keep_last=run.recipe.checkpoint.keep_last,
                               needed_bytes=12 * run.lineage["parameters"] + (1 << 20))


def finish_goal(run: GoalRun) -> dict:
    ledger, g = run.ledger, run.recipe.goal
    final = save_goal(run) if run.step > run.start_step else run.lineage.get("resumed_from")
    summary = {"steps": run.step, "oracle_calls": ledger.calls, "ended_by": run.ended, "checkpoint": final,
               "top10_mean": ledger.top_mean(10), "top1": ledger.best[0][1] if ledger.best else 0.0,
               "unfinished_samples": ledger.unfinished}
    if g.max_oracle_calls:
        summary["auc_top10"] = pmo_auc(ledger.history, g.max_oracle_calls)
    if run.dist.is_main:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["rank", "smiles", "score", "step", "stage"])
        for i, (smi, score, st, stage) in enumerate(ledger.best, 1):
            w.writerow([i, smi, repr(score), st, stage + 1])
        write_text(os.path.join(run.recipe.run.output_dir, TOPK_CSV), buf.getvalue())
        _grid(run)
        print(f"[molds] goal run ended by {run.ended} at step {run.step}: {ledger.calls:,} oracle calls, top-10 mean "
              f"{summary['top10_mean']:.4f}" + (f", AUC top-10 {summary['auc_top10']:.4f}" if "auc_top10" in summary
                                                else "") + f"; checkpoint {final}; {TOPK_CSV} and {SCORED_CSV} in "
              f"{run.recipe.run.output_dir}", file=sys.stderr)
    return {"step": run.step, "checkpoint": final, "summary": summary}


def _grid(run: GoalRun) -> None:
    """The best molecules as a TensorBoard image, each with its score."""
    best = run.ledger.best
    run.log.molecules("goal/best_molecules", [s for s, *_ in best], run.step, run.recipe.eval.grid,
                      legends=[f"{v:.3f}" for _, v, *_ in best])
