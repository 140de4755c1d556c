"""Suite-wide settings: markers, and quiet, offline third-party libraries."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from tests.data.conftest import dataset  # noqa: E402,F401  (the small preprocessed dataset, for every test)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs, still part of the default suite unless deselected")
