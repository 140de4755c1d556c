"""``molds-preprocess``: the command line over ``PreprocessConfig`` (jsonargparse).

Options may be written with dashes or underscores (``--smiles-column`` or
``--smiles_column``); ``--config FILE`` reads the same options from JSON, and
``--print_config`` prints the resolved configuration.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from .config import PreprocessConfig


# List options take several values (``--input a.csv b.csv``, as a shell glob expands)
# or one comma-separated value (``--split-fractions 0.8,0.1,0.1``).
_LIST_OPTIONS = {"input": False, "label_columns": True, "split_fractions": True, "length_buckets": True}


def _normalize_argv(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not (arg.startswith("--") and len(arg) > 2):
            out.append(arg)
            continue
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in _LIST_OPTIONS:
            out.append("--" + name + eq + value)
            continue
        values = [value] if eq else []
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if len(values) == 1 and values[0].lstrip().startswith("["):
            out += ["--" + name, values[0]]
            continue
        if _LIST_OPTIONS[name]:
            values = [v for value in values for v in value.split(",") if v != ""]
        out += ["--" + name, json.dumps(values)]
    return out


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True, import_path_denylist=["*"])
    parser = ArgumentParser(prog="molds-preprocess", description=PreprocessConfig.__doc__,
                            default_env=False, exit_on_error=False, allow_abbrev=False,
                            epilog="--debug shows the traceback of an error (also MOLDS_DEBUG=1).")
    parser.add_argument("--config", action=ActionConfigFile, help="Read options from a JSON/YAML file.")
    parser.add_class_arguments(PreprocessConfig, fail_untyped=True, sub_configs=False)
    return parser


def parse(argv: list[str] | None = None) -> PreprocessConfig:
    import argparse

    from molds.errors import InputError

    parser = build_parser()
    try:
        ns = parser.parse_args(_normalize_argv(sys.argv[1:] if argv is None else argv))
    except argparse.ArgumentError as exc:
        raise InputError(" ".join(str(exc).split())) from None
    values = {f.name: ns[f.name] for f in dataclasses.fields(PreprocessConfig)}
    return PreprocessConfig(**values)


def _run(argv: list[str]) -> int:
    from molds.errors import InputError

    from .pipeline import run

    cfg = parse(argv)
    try:
        manifest = run(cfg)
    except (FileExistsError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(str(exc)) from exc
    print(manifest)
    return 0


def main(argv: list[str] | None = None) -> int:
    from molds.errors import run_cli

    if argv is None:  # the command itself, not a caller in Python: RDKit's allocations
        from molds.runtime.allocator import rerun_with_malloc_cache  # noqa: PLC0415

        rerun_with_malloc_cache()  # returns only when it does not re-run; report.json says what ran
    return run_cli("molds-preprocess", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
