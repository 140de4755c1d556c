"""Suite-wide settings: markers, and quiet, offline third-party libraries."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton decides at import whether its kernels (its own tl.max too) are compiled or
    # interpreted, and torch.compile imports it; without a GPU only the interpreter runs, so
    # the kernel tests (tests/kernels) need it from the start (molds.kernels.launch does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.data.conftest import dataset  # noqa: E402,F401  (the small preprocessed dataset, for every test)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs, still part of the default suite unless deselected")
