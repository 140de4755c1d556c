"""``--engine ray``: the same stages on Ray Data, for inputs that outgrow one machine.

Reading is a Ray Data ``map_batches`` over the input files (each file streamed in
record batches by the same readers as the local engine, so fsspec URIs work and bad
rows are counted the same way); canonicalization is ``map_batches`` over an actor pool
of CPU workers, each batch spilled by shuffle bucket to ``work_dir``; the reduce,
finalize and Parquet-writing stages run as Ray tasks. ``work_dir`` must be reachable
from every node (a shared filesystem) when the cluster has more than one.

The output is identical in content to the local engine's: every order is derived
from content hashes, not from which worker saw a row first.

Connects to ``RAY_ADDRESS`` when it is set, else starts a local Ray with ``workers`` CPUs.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter

import numpy as np

from .map_stage import MapStage
from .readers import RawChunk, read_chunks
from .stages import Stats

_BATCH_CHUNKS = 2  # raw chunks per canonicalize batch (= per spill file)


_READ_ERROR = "read-error"  # the kind of the one row a reader emits when its file cannot be read to its end


def _read_file_batches(batch):
    """One input file in, its records out as Arrow tables (generator UDF). A file that
    cannot be read to its end (a cut-short archive under ``--on_truncated fail``, a
    malformed file) yields the records read before the fault and then one ``read-error``
    row naming it, so the rows read are still canonicalized and counted, and the driver
    reports them as the local engine does (``PartialReadError``, the failure report)."""
    import pyarrow as pa

    from .readers import Columns, InputError

    def table(file_index, path, rows, smiles, ids, labels, reasons, kind, records, units=None):
        return pa.table({
            "file_index": pa.array([file_index] * len(rows), pa.int64()),
            "path": pa.array([path] * len(rows), pa.string()),
            "row": pa.array(rows, pa.int64()),
            "smiles": pa.array([s.decode("latin-1") if isinstance(s, bytes) else s for s in smiles],
                               pa.string()),  # SD records: their bytes as latin-1 text, lossless
            "id": pa.array(ids, pa.string()),
            "labels": pa.array([None if v is None else json.dumps(v) for v in labels], pa.string()),
            "reason": pa.array(reasons, pa.string()),
            "kind": pa.array([kind] * len(rows), pa.string()),
            "record": pa.array(records, pa.int64()),
            # --unit_template: each record's {key: value} as JSON (the values came from JSON)
            "units": pa.array([json.dumps(u) for u in units] if units else [None] * len(rows), pa.string()),
        })

    rows = zip(*(batch.column(c).to_pylist() for c in ("file_index", "path", "format", "options")))
    for file_index, path, fmt, opts in rows:
        o = json.loads(opts)
        cols = Columns(o["smiles"], o["id"], tuple(o["labels"]), tuple(o.get("units", ())), o.get("rank"),
                       tuple(tuple(r) for r in o.get("roles", ())))
        last = None
        try:
            for chunk in _kept_until_cut(read_chunks(int(file_index), str(path), str(fmt), cols, o["chunk_rows"],
                                                     o["delimiter"], o["smi_header"]), o["on_truncated"]):
                yield table(chunk.file_index, chunk.path, chunk.rows, chunk.smiles, chunk.ids, chunk.labels,
                            [chunk.reasons.get(i) for i in range(len(chunk))], chunk.kind,
                            chunk.records or [None] * len(chunk), chunk.units)
                last = chunk.rows[-1]
        except InputError as exc:
            yield table(int(file_index), str(path), [-1 if last is None else last], [str(exc)], [None], [None],
                        [None], _READ_ERROR, [None])


def _kept_until_cut(chunks, on_truncated: str):
    """``--on_truncated keep``: a cut-short input ends after the chunk holding its cut."""
    from .readers import TruncatedInputError, warn_truncated

    try:
        yield from chunks
    except TruncatedInputError as exc:
        if on_truncated != "keep":
            raise
        warn_truncated(exc)


def _chunks_of(table) -> list[RawChunk]:
    """Arrow records back into RawChunks, one per input file present in the batch."""
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    chunks: dict[tuple, RawChunk] = {}
    for i in range(table.num_rows):
        key = (cols["file_index"][i], cols["path"][i], cols["kind"][i])
        c = chunks.get(key)
        if c is None:
            c = chunks[key] = RawChunk(key[0], key[1], kind=key[2])
        if key[2] == "sdf":
            c.records.append(cols["record"][i])
        if cols["reason"][i] is not None:
            c.reasons[len(c.rows)] = cols["reason"][i]
        c.rows.append(cols["row"][i])
        text = cols["smiles"][i]
        c.smiles.append(text.encode("latin-1") if key[2] == "sdf" and text is not None else text)
        c.ids.append(cols["id"][i])
        c.labels.append(None if cols["labels"][i] is None else json.loads(cols["labels"][i]))
        if cols["units"][i] is not None:
            c.units.append(json.loads(cols["units"][i]))
    return list(chunks.values())


class _Canonicalize:
    """Ray Data actor: canonicalizes a batch, spills it, returns what it wrote."""

    def __init__(self, options, work_dir):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.stage = MapStage(options, work_dir, f"ray-{uuid.uuid4().hex[:12]}", spill_rows=1 << 62)

    def __call__(self, table):
        import pyarrow as pa

        import pyarrow.compute as pc

        stage = self.stage
        stage.stats, stage.tokens, stage.spills = Stats(), type(stage.tokens)(), []
        faulty = pc.equal(table.column("kind"), _READ_ERROR)
        errors = table.filter(faulty)
        for chunk in _chunks_of(table.filter(pc.invert(faulty))):
            stage.process(chunk)
        stage.flush()
        # plain JSON between the actors and the driver: nothing the driver reads can run code
        return pa.table({
            "spills": [json.dumps([[path, offsets.tolist()] for path, offsets in stage.spills])],
            "stats": [json.dumps({"rows_in": stage.stats.rows_in, "rejected": dict(stage.stats.rejected),
                                  "examples": stage.stats.examples, "truncated": stage.stats.truncated,
                                  "notes": dict(stage.stats.notes), "sd_repaired": stage.stats.sd_repaired,
                                  "cxsmiles": stage.stats.cxsmiles})],
            "tokens": [json.dumps(dict(stage.tokens))],
            "errors": [json.dumps(list(zip(*(errors.column(c).to_pylist()
                                             for c in ("file_index", "path", "row", "smiles")))))],
        })


def _call(fn, args):
    return fn(*args)


class RayEngine:
    def __init__(self, workers: int):
        import ray

        self.workers = max(1, workers or os.cpu_count() or 1)
        self._started = False
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            kwargs = {"address": address} if address else {"num_cpus": self.workers}
            ray.init(include_dashboard=False, log_to_driver=False, logging_level="warning", **kwargs)
            self._started = True
        self._remote = ray.remote(_call)

    def map_inputs(self, inputs, cols, cfg, options, work_dir, progress):
        import ray
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = bool(cfg.progress)
        # Small blocks out of the reader, so one big file feeds every actor, not one.
        ctx.target_max_block_size = 1 << 20
        opts = json.dumps({"smiles": cols.smiles, "id": cols.id, "labels": list(cols.labels), "units": list(cols.units),
                           "rank": cols.rank, "roles": [list(r) for r in cols.roles], "chunk_rows": cfg.chunk_rows,
                           "delimiter": cfg.delimiter, "smi_header": cfg.smi_header,
                           "on_truncated": cfg.on_truncated})
        files = ray.data.from_items([{"file_index": i, "path": p, "format": f, "options": opts}
                                     for i, p, f in inputs], override_num_blocks=max(1, len(inputs)))
        # num_cpus=0 keeps the (light) reader a separate operator from the actor pool:
        # fused, one actor would read and canonicalize a whole file by itself.
        ds = files.map_batches(_read_file_batches, batch_size=1, batch_format="pyarrow", num_cpus=0)
        ds = ds.map_batches(_Canonicalize, fn_constructor_args=(options, work_dir),
                            batch_size=_BATCH_CHUNKS * cfg.chunk_rows,
                            batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=self.workers))
        spills, stats, tokens, errors = [], Stats(), None, []
        for row in ds.iter_rows():
            errors.extend(json.loads(row["errors"]))
            spills.extend((path, np.asarray(offsets, np.int64)) for path, offsets in json.loads(row["spills"]))
            body = json.loads(row["stats"])
            part = Stats(body["rows_in"], Counter(body["rejected"]),
                         {k: [tuple(e) for e in v] for k, v in body["examples"].items()}, body["truncated"],
                         Counter(body["notes"]), body["sd_repaired"], body["cxsmiles"])
            stats.merge(part)
            progress.advance(part.rows_in, sum(part.rejected.values()))
            t = Counter(json.loads(row["tokens"]))
            tokens = t if tokens is None else tokens + t
        spills.sort(key=lambda spill: spill[0])
        if errors:  # the first file (in input order) that could not be read to its end
            from .local_engine import PartialReadError

            _, path, row, message = min(errors, key=lambda e: e[0])
            where = f"{path} line/row {row}" if row >= 0 else f"{path}: its first record"
            raise PartialReadError(f"{message}; {stats.rows_in:,} rows were read (up to {where}) and are "
                                   f"accounted in the failure report", stats, where)
        return spills, stats, tokens

    def run_tasks(self, fn, arg_tuples):
        import ray

        return ray.get([self._remote.remote(fn, args) for args in arg_tuples])

    def close(self):
        if self._started:
            import ray

            ray.shutdown()
