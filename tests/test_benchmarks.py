"""Every benchmark script still runs against the current library and ends with its JSON
line (tiny sizes: this checks that they work, not what they measure). The figures
themselves are taken by running the scripts, never asserted here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from tests.benchmark_scripts import benchmark_script
from tests.data.conftest import dataset  # noqa: F401  (the shared preprocessed fixture)
from tests.dist.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz")

CASES = {
    "cpu_step": (["--recipe", os.path.join(ROOT, "recipes", "smoke", "gpt_moses.json"), "--steps", "1", "--rounds", "1"],
                 ["fp32_over_bf16", "bf16_system_over_bf16", "bf16_attn16_over_bf16", "bf16_exact_rows_over_bf16"]),
    "step_overhead": (["--steps", "1", "--rounds", "1"], ["molds_over_plain", "molds_zero_over_ds_bare"]),
    "peer_hf_trainer": (["--steps", "2", "--warmup", "1", "--rounds", "2", "--profile-steps", "1", "--eager"],
                        ["molds_over_hf"]),
    "dataloader": (["--seq-len", "128", "--subset", "500"], []),
    "moe_layer": (["--tokens", "256", "--hidden", "64", "--rounds", "1"],
                  ["molds_over_deepspeed_e8_top2", "molds_over_deepspeed_e64_top8"]),
    "etl": (["--input", SAMPLE, "--n", "400", "--workers", "1", "--floor-sample", "100", "--floor-every", "0.3"],
            ["ratio_to_floor", "ratio_to_floor_ends", "ratio_to_busy_floor"]),
    "schedule_bubble": (["--quick"], ["dualpipev_over_stock_p2", "dualpipev_over_1f1b_p2"]),
    "copy_probe": (["--steps", "4", "--length", "6", "--hidden", "16", "--layers", "1", "--batch", "4",
                    "--log_every", "2"], ["uniform_loss"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_and_prints_its_json_line(name, dataset, tmp_path):  # noqa: F811
    args, keys = CASES[name]
    if name in ("step_overhead", "peer_hf_trainer", "dataloader", "cpu_step"):
        args = ["--manifest", dataset, *args]
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in keys:
        assert isinstance(out[key], float) and out[key] > 0, (key, out)
    if name == "etl":  # the floor was also timed with the ETL paused, and those pauses are not its time
        assert out["rdkit_floor_during"] and out["paused_s"] > 0, out
        # the busy floor (as many bare scripts at once as workers) at the same moments
        assert len(out["rdkit_busy_floor_before_during_after"]) == len(out["rdkit_floor_during"]) + 2, out
        # the malloc settings each side ran with are stated (molds-preprocess raises glibc's tcache)
        assert "etl_glibc_tunables" in out and "floor_glibc_tunables" in out, out
        # the ETL's CPU (its reaped process tree): at least one worker's parse of 400 records,
        # at most every core busy through its run
        assert out["cpu_us_per_molecule"] == pytest.approx(out["etl_cpu_s"] / out["molecules"] * 1e6, rel=0.01)
        assert out["cpu_us_per_molecule"] > out["floor_us_per_molecule"] / 2, out
        assert 0 < out["cores_busy"] <= 1.1 * (os.cpu_count() or 1), out


@pytest.mark.slow
def test_the_seq2seq_benchmark_trains_both_families_on_one_split_and_scores_them(tmp_path):
    """A few hundred template reactions, each family for the same short budget on root-aligned
    spellings: both scored on the same test pairs, and again with test-time augmentation;
    the set's count is the CSV's rows."""
    import csv
    import gzip

    out_dir = tmp_path / "bench"
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "seq2seq_templates.py"), "--limit", "600",
                           "--tasks", "retro", "--budget", "15s", "--nproc", "1", "--num", "8", "--beams", "3",
                           "--variants", "2", "--augment", "2", "--output_dir", str(out_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    with gzip.open(out_dir / "reactions.csv.gz", "rt") as fh:
        rows = list(csv.DictReader(fh))
    assert out["reactions"] == len(rows) == sum(out["classes"].values()) > 0
    retro = out["tasks"]["retro"]
    assert retro["pairs"]["train"] > 0 and retro["pairs"]["test"] > 0
    for family in ("decoder", "seq2seq"):
        r = retro[family]
        assert r["steps"] > 0 and r["inputs"] == 8 and 0 <= r["top1"] <= r["top3"] <= 1, r
        # the same 8 pairs with test-time augmentation: each source also searched in a second spelling
        a = r["augmented"]
        assert a["inputs"] == 8 and 1 < a["spellings_per_source"] <= 2 and 0 <= a["top1"] <= a["top3"] <= 1, r
    assert "aligned" in proc.stderr or "root-aligned" in proc.stderr  # the runs read the stored spellings


def _pair_smoke(tmp_path, recipe: str, *args: str):
    """``benchmarks/seq2seq_smoke.py`` on one recipe, one CPU rank: its entry and output folder."""
    out_dir = tmp_path / "smoke"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "seq2seq_smoke.py"), "--recipes", recipe,
                           "--nproc", "1", *args, "--output_dir", str(out_dir)], cwd=tmp_path,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["recipes"][recipe], out_dir


@pytest.mark.slow
def test_the_pair_smoke_benchmark_interrupts_resumes_exports_and_scores(tmp_path):
    """A smoke pair recipe, shortened, under the deepspeed launcher: killed after its first
    checkpoint, resumed to its last step, exported (transformers' beams equal molds'), and
    its test split scored; every stage's figure is in the line."""
    r, out_dir = _pair_smoke(tmp_path, "seq2seq_mol2mol", "--max_steps", "60", "--interval", "10", "--num", "12",
                             "--beams", "3", "--agree", "3")
    assert r["pairs"]["train"] > 0 and r["pairs"]["test"] > 0, r
    assert 10 <= r["interrupted_at_step"] < r["resumed_to_step"] == 60, r
    assert r["export"]["exported_as"] == "LlamaForCausalLM" and r["export"]["same_top_k"] == 3, r
    assert r["inputs"] == 12 and 0 <= r["top1"] <= r["top3"] <= 1 and "similarity_to_source" in r, r
    log = open(out_dir / "seq2seq_mol2mol.log").read()
    assert "resumed from" in log


@pytest.mark.slow
def test_the_encoder_decoder_smoke_forks_its_denoising_pretraining(tmp_path):
    """bart_forward starts from bart_pretrain: the pretraining reads only molecules in no
    bundled reaction (RDKit's canonical forms, checked here against the reaction file), runs
    to its end, and the pair run's first launch forks it, then resumes and is scored."""
    from rdkit import Chem

    r, out_dir = _pair_smoke(tmp_path, "bart_forward", "--max_steps", "20", "--interval", "10", "--num", "8",
                             "--beams", "2", "--agree", "2")
    pre = r["pretraining"]
    assert pre["recipe"] == "recipes/smoke/bart_pretrain.json" and pre["molecules"] > 10000, pre
    assert math.isfinite(pre["test_denoising_loss"]) and pre["test_denoising_loss"] > 0, pre
    log = open(out_dir / "bart_forward.log").read()
    assert f"forked from {out_dir / 'bart_pretrain'}" in log and "resumed from" in log, log[-2000:]
    assert r["resumed_to_step"] == 20 and r["export"]["exported_as"] == "BartForConditionalGeneration", r
    import csv
    import gzip

    in_pairs = set()
    with gzip.open(os.path.join(ROOT, "molds", "sample_data", "moses_sample_reactions.csv.gz"), "rt") as fh:
        for row in csv.DictReader(fh):
            for side in row["reactants>reagents>production"].split(">"):
                in_pairs.update(Chem.CanonSmiles(m) for m in side.split(".") if m)
    with open(out_dir / "data-pretrain-molecules.csv") as fh:
        kept = [line.strip() for line in fh][1:]
    assert 0.7 * len(kept) < pre["molecules"] < len(kept), (len(kept), pre)  # its training split: about 80 %
    assert not {Chem.CanonSmiles(s) for s in kept} & in_pairs


def test_the_etl_benchmark_pauses_a_whole_process_tree_and_resumes_it():
    """The floor timed mid-run is timed with every ETL process stopped: the parent and the
    workers it started."""
    import psutil

    pause_tree = benchmark_script("etl").pause_tree
    code = ("import multiprocessing as mp, time\n"
            "def spin():\n    while True: pass\n"
            "if __name__ == '__main__':\n"
            "    p = mp.get_context('fork').Process(target=spin, daemon=True); p.start()\n"
            "    print(p.pid, flush=True)\n    spin()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(proc.stdout.readline()))
        stopped = pause_tree(proc.pid)
        assert {p.pid for p in stopped} == {proc.pid, child.pid}
        for p in (psutil.Process(proc.pid), child):
            deadline = time.monotonic() + 1
            while p.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
                time.sleep(0.02)
            assert p.status() == psutil.STATUS_STOPPED, p
        before = child.cpu_times().user
        time.sleep(0.3)
        assert child.cpu_times().user == before  # no progress while paused
        for p in stopped:
            p.resume()
        time.sleep(0.3)
        assert child.cpu_times().user > before
    finally:  # the spinning child too: a killed parent leaves its daemon child running
        if child is not None:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_gpt_moses_benchmark_scores_the_average_of_the_last_checkpoints(dataset, tmp_path):  # noqa: F811
    out = str(tmp_path / "run")
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpt_moses.py"),
                           "--recipe", os.path.join(ROOT, "recipes", "smoke", "gpt_moses.json"), "--nproc", "1",
                           "--steps", "4", "--num", "16", "--average_last", "2", "--output_dir", out, "--",
                           "--data.manifest", dataset, "--data.seq_len", "128", "--model.hidden_size", "32",
                           "--checkpoint.interval_steps", "2", "--checkpoint.keep_last", "0",
                           "--eval.interval_steps", "0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["averaged_steps"] == [2, 4] and line["steps"] == 4 and line["samples"] == 16
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    samples = open(os.path.join(out, "samples.smi")).read().split("\n")[:16]  # an empty line: unfinished
    assert len(samples) == 16
    assert line["validity"] == pytest.approx(sum(bool(s) and Chem.MolFromSmiles(s) is not None for s in samples) / 16)
    assert line["test_loss"] > 0
    assert line["representation"] == "smiles" and line["decodable"] == line["finished"]  # SMILES decode as written
    assert os.path.isfile(os.path.join(out, "averaged-last2", "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("task", ["retro", "forward"])
def test_the_uspto50k_benchmark_runs_the_procedure_from_published_layout_files(tmp_path, task):
    """The bundled template reactions written as USPTO-50k's raw_train / raw_val files: the ETL
    keeps the validation file whole as the split scored, a shortened recipe of the direction
    trains, and the line holds the whole split's top-k, the augmented top-k, and one curve
    point per checkpoint (forward: the canonical source as each pair's first spelling). The
    manifest it made refuses the other direction's benchmark and another count of spellings."""
    import csv
    import gzip

    with gzip.open(os.path.join(ROOT, "molds", "sample_data", "moses_sample_reactions.csv.gz"), "rt") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[0], rows[1:]
    files = {"train": body[:400], "val": body[400:460]}
    for split, part in files.items():
        with open(tmp_path / f"raw_{split}.csv", "w", newline="") as fh:
            csv.writer(fh).writerows([header, *part])
    run = tmp_path / "run"
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()))
    script = [sys.executable, os.path.join(ROOT, "benchmarks", "uspto50k.py"), "--task", task,
              "--recipe", os.path.join(ROOT, "recipes", f"cpu_uspto50k_{task}.json")]
    proc = subprocess.run([*script, "--input", str(tmp_path / "raw_*.csv"), "--nproc", "1", "--variants", "2", "--beams", "3",
                           "--augment", "2", "--augment_num", "20", "--curve", "5",
                           *(["--canonical_first"] if task == "forward" else []), "--",
                           "--data.manifest", str(tmp_path / "data"), "--run.output_dir", str(run),
                           "--trainer.max_time", "null", "--trainer.max_steps", "6", "--model.hidden_size", "32",
                           "--model.num_layers", "1", "--model.num_heads", "2", "--model.num_kv_heads", "1",
                           "--checkpoint.interval_fraction", "0", "--checkpoint.interval_steps", "3",
                           "--checkpoint.average_last", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["split"] == "valid" and line["pairs"] == len(files["val"]) and line["steps"] == 6, line
    assert line["variants"] == 2 and line["canonical_first"] == (task == "forward"), line
    form = json.load(open(tmp_path / "data" / "manifest.json"))["randomized"]["form"]
    assert ("writes the source canonically" in form) == (task == "forward"), form
    assert line["model"].endswith("averaged") and line["cpu"], line
    for key in ("accuracy", "accuracy_subset", "accuracy_augmented"):
        a = line[key]
        assert 0 <= a["top1"] <= a["top3"] <= 1 and 0 <= a["invalid_top1"] <= 1, line
    assert 1 < line["accuracy_augmented"]["spellings_per_source"] <= 2 and line["augment_pairs"] == 20, line
    assert 0 <= line["accuracy_subset"]["top1"] <= 1, line  # the same 20 pairs without augmentation
    assert [c["step"] for c in line["curve"]] == [3, 6] and all(0 <= c["top1"] <= 1 for c in line["curve"]), line
    assert line["procedure_s"] == pytest.approx(line["etl_s"] + line["train_s"] + line["eval_s"], abs=0.2)
    report = json.load(open(run / "checkpoints" / "step-00000003" / "curve-valid" / "eval.json"))
    assert line["curve"][0]["top1"] == (report.get("pairs") or report)["top1"]
    assert report["pairs"]["task"] == task == line["task"], report
    if task == "retro":  # what follows takes the task as a value: one direction tries it
        _scores_a_subset_and_refuses_the_other_direction(script, tmp_path, run, env, line, task, len(files["val"]))
    said = _refused(script, tmp_path, env)
    assert "was made with 2 spellings a pair" in said, said
    assert ("(the canonical source first)" in said) == (task == "forward"), said
    assert not (tmp_path / "run2").exists()


def _scores_a_subset_and_refuses_the_other_direction(script, tmp_path, run, env, line, task, pairs):
    # --num scores that many pairs evenly spread (the recipe comparisons): the same 20 as the subset above
    proc = subprocess.run([*script, "--score_only", "--num", "20", "--beams", "3", "--augment", "0", "--curve", "0",
                           "--", "--data.manifest", str(tmp_path / "data"), "--run.output_dir", str(run)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads(proc.stdout.strip().splitlines()[-1])
    assert scored["scored_pairs"] == 20 and scored["pairs"] == pairs, scored
    subset = {k: v for k, v in scored["accuracy"].items() if k != "loss"}
    assert subset == line["accuracy_subset"], (subset, line["accuracy_subset"])
    assert (run / "eval-valid-20-beams3" / "eval.json").is_file()
    other = "forward" if task == "retro" else "retro"
    said = _refused([*script[:3], other], tmp_path, env)
    assert f"holds {task} pairs, not --task {other}" in said, said


def _refused(script, tmp_path, env) -> str:
    """The benchmark run as ``script`` on the test's data into a fresh run directory: it must
    fail; its last line of stderr."""
    proc = subprocess.run([*script, "--", "--data.manifest", str(tmp_path / "data"),
                           "--run.output_dir", str(tmp_path / "run2")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]
