"""TensorBoard writer with a JSONL mirror, throughput and MFU.

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``, ``data``, ``models``, ``kernels``, ``checkpoint``, ``engines``, ``scoring``.
"""
