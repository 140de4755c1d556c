"""The scripts of ``benchmarks/`` as modules, for the tests that call their functions."""

from __future__ import annotations

import importlib
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` imported (with ``benchmarks/`` on the path while it imports, as
    the scripts import each other)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
