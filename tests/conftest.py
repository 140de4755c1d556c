"""Suite-wide settings: markers, and quiet, offline third-party libraries."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# reference statistics the metrics cache (molds.metrics.generation.reference_chemnet_stats):
# the suite's own, never a user's ~/.cache
os.environ.setdefault("MOLDS_CACHE_DIR", __import__("tempfile").mkdtemp(prefix="molds-test-cache-"))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton decides at import whether its kernels (its own tl.max too) are compiled or
    # interpreted, and torch.compile imports it; without a GPU only the interpreter runs, so
    # the kernel tests (tests/kernels) need it from the start (molds.kernels.launch does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.data.conftest import dataset  # noqa: E402,F401  (the small preprocessed dataset, for every test)


import pytest  # noqa: E402

#: what a launcher sets for each rank; molds.distributed sets them for a one-process run in
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


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long end-to-end run; CI (bash .ci/run) runs these too, and "
                                       "pytest -m 'not slow' leaves them out for a quick local loop")
