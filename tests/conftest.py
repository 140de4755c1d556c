"""Suite-wide settings: markers, and quiet, offline third-party libraries."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# reference statistics the metrics cache (molds.metrics.generation.reference_chemnet_stats):
# the suite's own, never a user's ~/.cache
if "MOLDS_CACHE_DIR" not in os.environ:
    _CACHE = os.environ["MOLDS_CACHE_DIR"] = __import__("tempfile").mkdtemp(prefix="molds-test-cache-")
    # removed when this process ends (xdist workers inherit it from the process that starts them)
    __import__("atexit").register(__import__("shutil").rmtree, _CACHE, True)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # .ci/run's first phase: two workers on two cores, each meant to use one. torch's OpenMP
    # threads (one per core by default, in the worker and in every process it starts) spin
    # while the other worker holds the core: the phase took 1,005 s with them, 743 s without
    # (2-core EPYC, the same commit, one run after the other). The serial phase keeps torch's default.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton decides at import whether its kernels (its own tl.max too) are compiled or
    # interpreted, and torch.compile imports it; without a GPU only the interpreter runs, so
    # the kernel tests (tests/kernels) need it from the start (molds.kernels.launch does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.data.conftest import dataset  # noqa: E402,F401  (the small preprocessed dataset, for every test)
from tests.guarantee_check import GuaranteeWatch  # noqa: E402


import pytest  # noqa: E402

#: what a launcher sets for each rank; molds.runtime.distributed sets them for a one-process run in
#: its own process, so a test that trains in the pytest process would otherwise hand them to
#: every launcher a later test starts
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launch_variables_do_not_leak():
    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


#: test files that keep both cores busy (several ranks, a Ray cluster, an ETL's workers, a
#: training that runs twice as fast on torch's two threads) or hold a time bound (a hung or
#: killed rank ends the job within N s): ``bash .ci/run`` runs them one at a time after the
#: rest, which it runs on two pytest-xdist workers, one file per worker, one torch thread each.
#: Two of these side by side oversubscribe the cores (OpenMP threads spin, gloo peers wait on a
#: descheduled rank) and take 2-3x as long; the rest use about one core each. Measured per file
#: as (CPU time of the test and its children) / wall time on 2 cores with one torch thread, as
#: the first phase runs it: above 1.2 here (the goal runs 1.18, the kernels' files 1.0), or
#: a file that one thread slows by more than half (tests/test_generation.py: 189 s against 106 s).
SERIAL_FILES = {
    "tests/engines/test_dualpipev.py",
    "tests/engines/test_encoder.py",
    "tests/engines/test_equivalence.py",
    "tests/engines/test_eval_distributed.py",
    "tests/engines/test_export.py",
    "tests/engines/test_launchers.py",
    "tests/engines/test_moe_dualpipev_run.py",
    "tests/engines/test_moe_fp8_run.py",
    "tests/engines/test_moe_pipeline_run.py",
    "tests/engines/test_multinode.py",
    "tests/engines/test_pipeline.py",
    "tests/engines/test_protocol.py",
    "tests/engines/test_resume.py",
    "tests/faults/test_hang.py",
    "tests/faults/test_hostile.py",
    "tests/faults/test_kill_rank.py",
    "tests/faults/test_nonfinite.py",
    "tests/faults/test_reshard.py",
    "tests/preprocessing/test_interrupt.py",
    "tests/preprocessing/test_ray_engine.py",
    "tests/preprocessing/test_representations.py",
    "tests/preprocessing/test_truncated.py",
    "tests/test_generation.py",
    "tests/test_plan.py",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long end-to-end run; CI (bash .ci/run) runs these too, and "
                                       "pytest -m 'not slow' leaves them out for a quick local loop")
    config.addinivalue_line("markers", "serial: keeps both cores busy or holds a time bound; bash .ci/run runs "
                                       "these one at a time (tests/conftest.py SERIAL_FILES)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    missing = sorted(f for f in SERIAL_FILES if not os.path.exists(os.path.join(root, f)))
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SERIAL_FILES names files that do not exist: {missing}")
    if not hasattr(config, "workerinput"):  # xdist's controller sees every worker's reports
        # a test that proves a guarantee and skips or xfails ends the session non-zero
        config.pluginmanager.register(GuaranteeWatch(), "molds-guarantees")


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for item in items:
        if os.path.relpath(str(item.path), root).replace(os.sep, "/") in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
