from tests.data.conftest import dataset  # noqa: F401  (the same small preprocessed dataset)
