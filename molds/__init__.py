"""molds: configuration-driven training of chemical language models on DeepSpeed.

The packages, from the bottom up: each may import those before it in this list, never one
after it (``tests/test_layers.py`` holds the table and fails on an import that runs back up;
docs/design/layout.md says why):

- ``errors`` (a module): user errors, reported as one line by every console script;
- ``runtime``: ranks and collectives, heartbeat, a process's start and end, allocator, atomic writes;
- ``chemistry``: canonical molecules, representations, conformer units, pairs, special tokens;
- ``recipe``: the recipe's sections, parsing and checks, the plan, budgets, precision;
- ``data``: the manifest and the data plane;
- ``models``: the model families (single-device code), the factory, the losses;
- ``kernels``: converters and custom ops;
- ``checkpoint``: the canonical checkpoint;
- ``engines``: DDP, ZeRO, pipeline, DualPipeV;
- ``scoring``: scoring functions and oracles;
- ``metrics``: what a run logs and measures;
- ``eval``: evaluation, sampling, beam search;
- ``goal``: the goal run;
- ``export`` (a module): a checkpoint as a Hugging Face model;
- ``train`` (a module): the training loop;
- ``cli``: the console scripts.

The ETL (``preprocessing/``, installed as ``molds.preprocessing``) imports ``errors``,
``runtime``, ``chemistry`` and ``data`` only; nothing in molds imports it.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

#: modules that lay at molds' top level before they were grouped into packages: the old path
#: still imports, as the very same module object, with a FutureWarning naming the new one
MOVED = {
    "molds.config": "molds.recipe.sections",
    "molds.goal.config": "molds.recipe.goal",
    "molds.plan": "molds.recipe.plan",
    "molds.budget": "molds.recipe.budget",
    "molds.precision": "molds.recipe.precision",
    "molds.distributed": "molds.runtime.distributed",
    "molds.heartbeat": "molds.runtime.heartbeat",
    "molds.allocator": "molds.runtime.allocator",
    "molds.atomic": "molds.runtime.atomic",
    "molds.chem": "molds.chemistry.canonical",
    "molds.representation": "molds.chemistry.representation",
    "molds.conformers": "molds.chemistry.conformers",
    "molds.pairs": "molds.chemistry.pairs",
    "molds.tokens": "molds.chemistry.tokens",
    # the ETL's decompressors and SD reader, now beside the text layer molds-predict shares (molds.data.inputs)
    "molds.preprocessing.inflate": "molds.data.inflate",
    "molds.preprocessing.unzstd": "molds.data.unzstd",
    "molds.preprocessing.sdf": "molds.data.sdf",
}
# (molds.recipe and molds.runtime are now the packages; their __init__ keeps the old module's names)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path of ``MOVED`` as its new module (one object under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} has moved to {new}: import it from there", FutureWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # the import system has just given the module the old name's spec: it gets its own back
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
