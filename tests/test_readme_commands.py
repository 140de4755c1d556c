"""Every command the README and the documentation (``docs/**/*.md``) show parses with the
parser that would run it.

Their ``bash`` blocks are read line by line (``\\`` continuations joined, comments
dropped) and each command goes to its own parser without running the job: the launchers'
(DeepSpeed's runner, torchrun's), the recipe parser (recipe file, overrides and their
ranges), each console script's, each benchmark's argparse. A renamed option, a recipe that
moved, a launcher flag that does not exist fails here, naming the file and line. Commands
that are no molds program (``pip``, ``ls``) are listed by name below, so a new kind of
command fails until someone says how to check it.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import runpy
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the documents' shell variables: each becomes a directory of the test's, where the files a
#: command names under it are made (a benchmark checks that its reference files exist);
#: ``$head`` is the Slurm example's first node
SHELL_VARIABLES = ("$D", "$head")
#: commands that are not molds' to check, each with why
OTHERS = {
    "pip": "pip's own command (fetching the MOSES wheel)",
    "ls": "a look at a directory",
    "python -m": "a standard-library module (unzipping the MOSES wheel)",
    "tensorboard": "TensorBoard's viewer, pointed at a run's events",
    "export": "an environment variable for the launcher (the Slurm example)",
    "cp": "a file copied (ChEMBL's tab-separated .txt given its .tsv name)",
}


def documents() -> list[str]:
    """README.md and every page of the documentation, relative to the repository."""
    pages = []
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        pages += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md")]
    return ["README.md", *sorted(pages)]


def readme_commands(document: str = "README.md") -> list[tuple[int, str]]:
    """(line number, command) for every command in one document's bash blocks."""
    text = open(os.path.join(ROOT, document), encoding="utf-8").read()
    out = []
    for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        i = 0
        while i < len(lines):
            line, number = lines[i], first + i
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            line = re.sub(r"\s#.*$", "", line).strip()
            if not line or line.startswith("#"):
                continue
            out.append((number, line))
    return out


def _argv(command: str, where: str | None = None) -> list[str]:
    """The command's argv; with ``where``, its shell variables point there (files made)."""
    for name in SHELL_VARIABLES if where else ():
        for rel in re.findall(re.escape(name) + r"/([\w./-]+)", command):
            os.makedirs(os.path.dirname(os.path.join(where, rel)) or where, exist_ok=True)
            open(os.path.join(where, rel), "a").close()
        command = command.replace(name, where)
    # a synopsis line: [--option value] is an option one may give; check it as given
    command = re.sub(r"\[(--[^\]]+)\]", r"\1", command)
    return shlex.split(command)


def _train(argv: list[str]) -> None:
    from molds.recipe.parse import parse_recipe

    parse_recipe(argv)


def _launcher(argv: list[str]) -> None:
    """deepspeed / torchrun: the launcher's own options, then the script's."""
    if argv[0] == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        args = parse_args(argv[1:])
        script, rest = args.user_script, args.user_args
    else:
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        script, rest = args.training_script, args.training_script_args
    assert script == "molds/train.py", f"launches {script}, not molds/train.py"
    _train(rest)


@functools.cache
def _console_scripts() -> dict[str, str]:
    """setup.py's console scripts, name -> module (what a user's install puts on the PATH)."""
    text = open(os.path.join(ROOT, "setup.py")).read()
    return dict(re.findall(r'"(molds-[a-z-]+)=([\w.]+):\w+"', text))


def _console(argv: list[str]) -> None:
    from molds.cli import parse

    name = argv[0]
    if name == "molds-preprocess":
        from molds.preprocessing.cli import parse as parse_preprocess

        parse_preprocess(argv[1:])
        return
    if name == "molds-train":
        _train(argv[1:])
        return
    scripts = _console_scripts()
    assert name in scripts, f"{name}: setup.py installs no such console script"
    cli = __import__(scripts[name], fromlist=["build_parser"])
    rest = argv[1:]
    if name == "molds-eval":
        rest, overrides = cli._split_overrides(rest)
        recipe = [a for i, a in enumerate(rest) if rest[i - 1] == "--recipe"] if "--recipe" in rest else []
        if overrides:
            _train(["--recipe", recipe[0], *overrides])
    parse(cli.build_parser(), rest)


class _Parsed(Exception):
    pass


def _benchmark(argv: list[str], monkeypatch) -> None:
    """Runs the script until its argparse has parsed the line, then stops it."""
    script = os.path.join(ROOT, argv[0])
    assert os.path.isfile(script), f"{argv[0]}: no such script"
    depth = [0]  # parse_args calls parse_known_args: stop only when the outermost call returns, so
    # that parse_args still refuses an option the script does not know
    for method in ("parse_args", "parse_known_args"):
        original = getattr(argparse.ArgumentParser, method)

        def parse_then_stop(self, args=None, namespace=None, _original=original):
            depth[0] += 1
            try:
                result = _original(self, args, namespace)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed
            return result

        monkeypatch.setattr(argparse.ArgumentParser, method, parse_then_stop)
    monkeypatch.setattr(sys, "argv", argv)
    environ, path = dict(os.environ), list(sys.path)  # a script may set variables or its path first
    try:
        with pytest.raises(_Parsed):
            runpy.run_path(script, run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path


def check(command: str, monkeypatch, where: str) -> None:
    argv = _argv(command, where)
    if "--help" in argv:
        return  # prints the options: nothing of the user's to check
    head = argv[0]
    if "=" in head and not head.startswith("-"):  # a shell variable the next lines use
        assert "$" + head.split("=", 1)[0] in SHELL_VARIABLES, f"{head}: add it to SHELL_VARIABLES"
        return
    if head in OTHERS or " ".join(argv[:2]) in OTHERS:
        return
    if head == "bash":
        assert os.path.isfile(os.path.join(ROOT, argv[1])), f"{argv[1]}: no such script"
        return
    if head == "srun":  # Slurm starts the command on every node; the command is what is checked
        argv = argv[1:]
        head = argv[0]
    if head in ("deepspeed", "torchrun"):
        _launcher(argv)
    elif head == "python" and argv[1] == "molds/train.py":
        _train(argv[2:])
    elif head == "python" and argv[1].startswith(("benchmarks/", "molds/sample_data/")):
        _benchmark(argv[1:], monkeypatch)
    elif head.startswith("molds-"):
        _console(argv)
    else:
        raise AssertionError(f"no check for {head!r}: say how to check it (or add it to OTHERS with why)")


COMMANDS = [(doc, n, c) for doc in documents() for n, c in readme_commands(doc)]


def test_the_documents_have_their_commands():
    heads = {_argv(c)[0] for doc, _, c in COMMANDS if doc == "README.md"}
    assert {"bash", "molds-preprocess", "molds-sample", "molds-eval", "deepspeed", "torchrun"} <= heads
    docs = {doc for doc, _, _ in COMMANDS}
    assert {"docs/getting-started.md", "docs/guides/etl.md", "docs/tutorials/cpu-moses.md",
            "docs/guides/multi-node.md"} <= docs
    assert len(COMMANDS) > 80


@pytest.mark.parametrize("document,line,command", COMMANDS, ids=[f"{d}:{n}" for d, n, _ in COMMANDS])
def test_readme_command_parses(document, line, command, monkeypatch, tmp_path):
    # relative paths in a command are the repository's (recipes/, benchmarks/); a config file
    # the README names but a user writes (preprocess.json) is made here
    monkeypatch.chdir(ROOT)
    if "--config preprocess.json" in command:
        config = tmp_path / "preprocess.json"
        config.write_text('{"input": ["raw/train.csv.gz"], "output": "data/moses"}')
        command = command.replace("preprocess.json", str(config))
    try:
        check(command, monkeypatch, str(tmp_path / "var"))
    except AssertionError:
        raise
    except SystemExit as exc:  # --print_config / --print true: printed, and exits 0
        assert exc.code in (0, None), f"{document}:{line}: {command}\n  -> exit status {exc.code}"
    except BaseException as exc:  # noqa: BLE001  a parser's refusal, named with the README line
        raise AssertionError(f"{document}:{line}: {command}\n  -> {type(exc).__name__}: {exc}") from None
