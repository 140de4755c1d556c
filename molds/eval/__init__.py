"""Evaluation: sampling (``molds-sample``), checkpoint evaluation (``molds-eval``) and the
evaluation run during training. The metric functions live in ``molds.metrics``.

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``, ``data``, ``models``, ``kernels``, ``checkpoint``, ``engines``, ``scoring``,
``metrics``.
"""
