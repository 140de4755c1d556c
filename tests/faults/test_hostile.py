"""Fault 8: hostile inputs. A checkpoint from someone else never runs code, whichever
file carries the payload and whichever command reads it (resume, export, eval, sample);
shard uris that leave the manifest's directory are refused before any read; recipes
cannot name classes or unknown keys; a truncated compressed ETL input ends cleanly."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil

import pytest

from tests.faults.common import argv


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    from molds.train import main

    out = str(tmp_path_factory.mktemp("hostile") / "run")
    main(argv(dataset, out, "ddp", 2))
    return out


def _poison(src, dst, name, marker, kind):
    """A copy of checkpoint ``src`` whose file ``name`` is a pickle payload (and whose
    COMPLETE marker is forged to match, as an attacker would)."""
    shutil.copytree(src, dst)
    blob = pickle.dumps(_Payload(marker))
    if kind == "torch":
        import io

        import torch

        buf = io.BytesIO()
        torch.save({"state": _Payload(marker)}, buf)
        blob = buf.getvalue()
    path = os.path.join(dst, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(blob)
    files = {n: os.path.getsize(os.path.join(dst, n)) for n in os.listdir(dst) if os.path.isfile(os.path.join(dst, n))
             and n != "COMPLETE"}
    json.dump({"step": 2, "files": files}, open(os.path.join(dst, "COMPLETE"), "w"))
    return dst


FILES = ["model.safetensors", "optimizer.safetensors", "train_state.json", "rng-rank00000.json", "data_state.json",
         "lineage.json", "deepspeed/mp_rank_00_model_states.pt", "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "optimizer.pt", "rng-rank00000.pt"]


@pytest.mark.parametrize("kind", ["pickle", "torch"])
@pytest.mark.parametrize("name", FILES)
def test_pickle_payloads_never_run(trained, tmp_path, dataset, name, kind):
    from molds.cli.evaluate import main as eval_main
    from molds.cli.export import main as export_main
    from molds.cli.sample import main as sample_main
    from molds.errors import MoldsError
    from molds.train import main

    marker = str(tmp_path / "PWNED")
    src = os.path.join(trained, "checkpoints", "step-00000002")
    run = str(tmp_path / "run")
    ckpt = _poison(src, os.path.join(run, "checkpoints", "step-00000002"), name, marker, kind)
    with open(os.path.join(run, "checkpoints", "latest"), "w") as fh:
        fh.write("step-00000002")
    outcomes = []
    try:  # resume
        main(argv(dataset, run, "ddp", 3, "--checkpoint.resume", "auto"))
        outcomes.append("resumed")
    except MoldsError:
        outcomes.append("refused")
    for cli, args in ((export_main, [ckpt, str(tmp_path / "hf")]),
                      (sample_main, [ckpt, "--num", "3", "--out", str(tmp_path / "s.smi")]),
                      (eval_main, [ckpt, "--num", "5", "--max_batches", "1", "--out", str(tmp_path / "ev")])):
        outcomes.append(cli(args))
    assert not os.path.exists(marker), "a checkpoint file ran code"
    if name.endswith(".pt"):  # files molds never reads: everything works
        assert outcomes == ["resumed", 0, 0, 0]
    elif name in ("model.safetensors", "lineage.json"):  # every reader needs it: all refuse, one line, status 2
        assert outcomes == ["refused", 2, 2, 2]
    else:  # training state only: resume refuses, the model readers do not need it
        assert outcomes == ["refused", 0, 0, 0]


def test_a_forged_non_finite_weight_is_refused_by_every_reader_naming_it(trained, tmp_path, dataset, capfd):
    """A model file with a NaN in one weight (same size, so the COMPLETE marker still fits):
    molds never saves one, so every reader refuses it in one line naming the tensor, instead
    of sampling, scoring or exporting NaNs."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from molds.cli.evaluate import main as eval_main
    from molds.cli.export import main as export_main
    from molds.cli.sample import main as sample_main
    from molds.errors import MoldsError
    from molds.train import main

    src = os.path.join(trained, "checkpoints", "step-00000002")
    run = str(tmp_path / "run")
    ckpt = os.path.join(run, "checkpoints", "step-00000002")
    shutil.copytree(src, ckpt)
    with open(os.path.join(run, "checkpoints", "latest"), "w") as fh:
        fh.write("step-00000002")
    path = os.path.join(ckpt, "model.safetensors")
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = sorted(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)[0]
    tensors[name][0, 0] = float("nan")
    size = os.path.getsize(path)
    save_file(tensors, path, metadata=meta)
    assert os.path.getsize(path) == size
    capfd.readouterr()
    with pytest.raises(MoldsError, match=f"{name} holds non-finite values"):
        main(argv(dataset, run, "ddp", 3, "--checkpoint.resume", "auto"))
    for cli, args in ((export_main, [ckpt, str(tmp_path / "hf")]),
                      (sample_main, [ckpt, "--num", "3", "--out", str(tmp_path / "s.smi")]),
                      (eval_main, [ckpt, "--num", "5", "--max_batches", "1", "--out", str(tmp_path / "ev")])):
        assert cli(args) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert any(f"{name} holds non-finite values" in line for line in err), err[-3:]
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "s.smi")


@pytest.mark.parametrize("uri", ["../outside.parquet", "/etc/hostname", "file:///etc/hostname",
                                 "http://example.com/x.parquet", "train/../../outside.parquet", "s3://bucket/x",
                                 "C:/x.parquet", "link/x.parquet"])
def test_escaping_shard_uris_are_refused_before_any_read(dataset, tmp_path, uri):
    from molds.data.manifest import Manifest
    from molds.errors import ManifestError

    data = str(tmp_path / "data")
    shutil.copytree(dataset, data)
    with open(tmp_path / "outside.parquet", "wb") as fh:
        fh.write(b"not yours")
    os.symlink(str(tmp_path), os.path.join(data, "link"))  # a link inside that leads outside
    m = json.load(open(os.path.join(data, "manifest.json")))
    m["splits"]["valid"][0]["uri"] = uri
    json.dump(m, open(os.path.join(data, "manifest.json"), "w"))
    with pytest.raises(ManifestError, match=r"shard splits.valid\[0\] uri .* refused"):
        Manifest.load(data)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.update(stats=[]), "'stats' must be an object"),
    (lambda m: m["stats"].update(splits="train"), "'stats.splits' must map"),
    (lambda m: m["stats"]["splits"]["train"].update(min_token_length="x"), "stats.splits.train lacks or mangles"),
])
def test_mangled_manifest_statistics_are_refused_by_name(dataset, tmp_path, edit, match):
    """Statistics of the wrong type stop at a ManifestError that names the key, not at a
    traceback from whatever reads them first (sampling's length limit)."""
    from molds.data.manifest import Manifest
    from molds.errors import ManifestError

    data = str(tmp_path / "data")
    shutil.copytree(dataset, data)
    m = json.load(open(os.path.join(data, "manifest.json")))
    edit(m)
    json.dump(m, open(os.path.join(data, "manifest.json"), "w"))
    with pytest.raises(ManifestError, match=match):
        Manifest.load(data).length_range("train")


def test_tokenizer_path_may_not_escape(dataset, tmp_path):
    from molds.data.manifest import Manifest
    from molds.errors import ManifestError

    data = str(tmp_path / "data")
    shutil.copytree(dataset, data)
    m = json.load(open(os.path.join(data, "manifest.json")))
    m["tokenizer"]["path"] = "../../elsewhere"
    json.dump(m, open(os.path.join(data, "manifest.json"), "w"))
    with pytest.raises(ManifestError, match="tokenizer.path"):
        Manifest.load(data)


@pytest.mark.parametrize("body,key", [
    ({"model": {"class_path": "os.system", "init_args": {"command": "touch PWNED"}}}, "class_path"),
    ({"optim": {"class_path": "torch.optim.SGD"}}, "class_path"),
    ({"trainer": {"steps": 3}}, "steps"),
    ({"nonsense": {}}, "nonsense"),
])
def test_recipes_cannot_name_classes_or_unknown_keys(tmp_path, body, key):
    from molds.errors import RecipeError
    from molds.recipe.parse import parse_recipe

    path = tmp_path / "r.json"
    path.write_text(json.dumps(body))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(RecipeError, match=key):
            parse_recipe(["--recipe", str(path)])
    finally:
        os.chdir(cwd)
    assert not os.path.exists(tmp_path / "PWNED")


def test_truncated_compressed_input_ends_cleanly(tmp_path):
    """(The ETL's own tests cover more; here the one-line error and the exit status.)"""
    import subprocess
    import sys

    from tests.preprocessing.conftest import sample_smiles

    blob = gzip.compress(("smiles\n" + "\n".join(sample_smiles(3000)) + "\n").encode())
    bad = tmp_path / "in.csv.gz"
    bad.write_bytes(blob[: len(blob) * 2 // 3])
    proc = subprocess.run([sys.executable, "-m", "molds.preprocessing.cli", "--input", str(bad), "--output",
                           str(tmp_path / "out"), "--workers", "2", "--progress", "false"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("molds-preprocess: error:") and "in.csv.gz" in lines[0]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    report = json.load(open(tmp_path / "out.failed-report.json"))
    assert report["rows_in"] == report["canonicalized"] + sum(report["rejected"].values()) > 0
