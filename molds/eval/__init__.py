"""Evaluation: sampling (``molds-sample``), checkpoint evaluation (``molds-eval``) and the
evaluation run during training. The metric functions live in ``molds.metrics``."""
