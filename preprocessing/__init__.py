"""molds' offline ETL (``molds-preprocess``), installed as ``molds.preprocessing``.

raw SMILES -> canonicalize -> dedupe -> scaffold -> split -> tokenize -> length-bucket
-> DIR/manifest.json + DIR/<split>/*.parquet + DIR/tokenizer/ + DIR/report.md
"""
