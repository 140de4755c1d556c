"""The recipe: what a run is asked to do, checked and resolved before any rank starts.

- ``sections``: one typed dataclass per recipe section (``run``, ``data``, ``model``,
  ``parallel``, ``kernels``, ``optim``, ``trainer``, ``eval``, ``checkpoint``, ``logging``);
  the signatures are the schema, each field's docstring its ``--help``;
- ``goal``: the ``goal`` section (goal-directed fine-tuning), defined here with the others;
- ``parse``: the recipe as a whole, its command line (jsonargparse), and the checks that run
  before any process group starts (ranges, combinations, the machine, the DeepSpeed config);
- ``plan``: the recipe resolved once per start into what the engine reads;
- ``budget``: how long a run trains (steps or a wall-clock budget), and where it stands;
- ``precision``: ``trainer.precision`` resolved by measurement on the device.

May import: ``molds.errors``, ``molds.runtime`` (the plan agrees its measurements between
ranks) and ``molds.chemistry``. Everything that runs a job (data, models, engines, eval,
goal, cli, train) reads the recipe from here; nothing here imports them.

``molds.recipe`` was one module (now ``parse``); its names stay importable from here.
"""

from .parse import (
                    SECTIONS,
                    Batching,
                    Recipe,
                    build_parser,
                    check_horizon,
                    check_kernels,
                    check_machine,
                    check_ranges,
                    check_recipe_file,
                    data_parallel_size,
                    deepspeed_config,
                    expand_short_forms,
                    parse_recipe,
                    recipe_files,
                    resolve_batching,
                    validate,
)

__all__ = ["SECTIONS", "Batching", "Recipe", "build_parser", "check_horizon", "check_kernels", "check_machine",
           "check_ranges", "check_recipe_file", "data_parallel_size", "deepspeed_config", "expand_short_forms",
           "parse_recipe", "recipe_files", "resolve_batching", "validate"]
