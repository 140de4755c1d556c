"""The training data plane: reads what ``molds-preprocess`` wrote.

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``.
"""
