"""The training data plane: reads what ``molds-preprocess`` wrote; and the raw input files
as the ETL and ``molds-predict`` both read them (``inputs``: formats, decompression,
decoding, CSV / TSV records and columns).

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``.
"""
