"""molds: configuration-driven training of chemical language models on DeepSpeed."""

__version__ = "0.1.0"
