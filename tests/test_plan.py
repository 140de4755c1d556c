"""The recipe is resolved once per start (molds.recipe.plan): train.main checks it and fixes the
batching before any process group, completes it for the device (precision, DeepSpeed
config) and hands it to the engine, which reads it instead of calling back into
molds.recipe."""

from __future__ import annotations

import pytest

from tests.dist.spawn import run_ranks

RESOLVERS = ("validate", "resolve_batching", "deepspeed_config", "data_parallel_size", "check_kernels")


def _count_resolutions(rank, world, argv):
    import molds.recipe.parse as recipe_module
    from molds.train import main
    from tests.faults.common import patch_everywhere

    counts = {name: 0 for name in RESOLVERS}
    for name in RESOLVERS:
        original = getattr(recipe_module, name)

        def counted(*args, _f=original, _n=name, **kwargs):
            counts[_n] += 1
            return _f(*args, **kwargs)

        patch_everywhere(original, counted)

    result = main(argv)
    return counts, result["step"]


@pytest.mark.parametrize("world,extra", [
    (1, ["--parallel.engine", "zero", "--parallel.zero_stage", "1"]),
    (2, ["--parallel.engine", "pipeline", "--parallel.zero_stage", "1", "--parallel.pp_size", "2",
         "--parallel.schedule", "dualpipev", "--trainer.grad_accum", "4", "--parallel.partition_method", "uniform"]),
], ids=["zero", "dualpipev"])
def test_each_resolver_runs_once_per_start(dataset, tmp_path, world, extra):
    from tests.faults.common import argv

    args = argv(dataset, str(tmp_path / "run"), "ddp", 2, *extra, interval=0)
    results = run_ranks(_count_resolutions, world, args)
    for counts, step in results:
        assert step == 2
        assert counts == {"validate": 1, "resolve_batching": 1, "deepspeed_config": 1, "data_parallel_size": 1,
                          "check_kernels": 1}, counts
