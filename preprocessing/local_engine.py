"""``--engine local``: worker processes on this machine.

The map stage uses long-lived workers fed through a bounded queue (so memory does not
grow with the input, and each worker spills few, large files); the later stages are
independent tasks on a process pool. A worker that dies or raises ends the run with
its error; nothing waits forever.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from concurrent.futures import ProcessPoolExecutor

from molds.errors import InputError

from .map_stage import MapStage
from .readers import TruncatedInputError, read_chunks, warn_truncated
from .stages import Stats

_POLL_S = 0.5


def _worker_env() -> None:
    """A worker's environment: one thread each, and Ctrl-C left to the driver (a terminal
    sends SIGINT to the whole process group; the driver winds the run down)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _map_worker(name, options, work_dir, tasks, results, driver: int):
    """Map the chunks ``tasks`` brings until a ``None``. SIGINT and SIGTERM are the driver's
    to act on (a scheduler signals the whole group): it lets the workers finish what was read,
    so every row read is counted, then stops them; a worker whose driver is gone exits."""
    import signal

    _worker_env()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        stage = MapStage(options, work_dir, name)
        while True:
            try:
                chunk = tasks.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != driver:  # the driver was killed: nobody reads the results
                    return
                continue
            if chunk is None:
                break
            results.put(("progress", stage.process(chunk)))
        stage.flush()
        results.put(("done", (stage.spills, stage.stats, stage.tokens)))
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
        results.put(("error", f"map worker {name}:\n{traceback.format_exc()}"))


class WorkerError(RuntimeError):
    pass


class PartialReadError(InputError):
    """An input could not be read to its end; ``stats`` accounts for every row read
    before the error (canonicalized or rejected), ``where`` says how far it got."""

    def __init__(self, message: str, stats: Stats, where: str):
        super().__init__(message)
        self.stats, self.where = stats, where


class InterruptedRead(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while the inputs were read; ``stats`` accounts for every row read
    before it (the workers finished what was queued), ``where`` says how far it got."""

    def __init__(self, message: str, stats: Stats, where: str):
        super().__init__(message)
        self.stats, self.where = stats, where


class LocalEngine:
    def __init__(self, workers: int):
        self.workers = max(1, workers or os.cpu_count() or 1)
        self._ctx = mp.get_context("fork")

    def map_inputs(self, inputs, cols, cfg, options, work_dir, progress):
        """Run the map stage over every input; returns (spills, Stats, token Counter)."""
        inputs = chunk_stream(inputs, cols, cfg.chunk_rows, cfg.delimiter, cfg.smi_header)
        tasks = self._ctx.Queue(maxsize=2 * self.workers)
        results = self._ctx.Queue()
        procs = [self._ctx.Process(target=_map_worker, args=(f"w{i}", options, work_dir, tasks, results, os.getpid()),
                                   daemon=True) for i in range(self.workers)]
        for p in procs:
            p.start()
        done: list = []

        def drain(block: bool):
            while True:
                try:
                    kind, payload = results.get(timeout=_POLL_S if block else 0.0)
                except queue.Empty:
                    if block and not all(p.is_alive() for p in procs) and len(done) < len(procs):
                        dead = [p.name for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                        if dead:
                            raise WorkerError(f"map worker(s) died: {dead}")
                    return
                if kind == "error":
                    raise WorkerError(payload)
                if kind == "progress":
                    progress.advance(*payload)
                else:
                    done.append(payload)
                if block:
                    return

        def put(item):
            while True:
                try:
                    tasks.put(item, timeout=_POLL_S)
                    return
                except queue.Full:
                    drain(block=True)

        read_error, interrupted, last = None, None, None
        try:
            try:
                for path, reader in inputs:
                    try:
                        for chunk in reader:
                            put(chunk)
                            last = (path, chunk.rows[-1])
                            drain(block=False)
                    except TruncatedInputError as exc:
                        if cfg.on_truncated == "keep":  # the records before the cut are kept, the cut counted
                            warn_truncated(exc)
                            continue
                        read_error = exc
                        break
                    except InputError as exc:  # a malformed file: stop reading, but let the
                        read_error = exc  # workers finish what was read, so it is counted
                        break
            except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the same, then the interrupt goes on
                interrupted = exc
            for _ in procs:
                put(None)
            while len(done) < len(procs):
                try:
                    drain(block=True)
                except KeyboardInterrupt as exc:  # the workers are finishing what was read: let them,
                    if interrupted is not None:  # unless this is the second interrupt
                        raise
                    interrupted = exc
        finally:
            for p in procs:
                if p.is_alive() and len(done) < len(procs):
                    p.kill()  # (they ignore SIGTERM: a second interrupt, or an error, ends them here)
                p.join(timeout=5)
            # nothing may wait at exit for a queue no process reads any more
            for q in (tasks, results):
                q.cancel_join_thread()
                q.close()
        spills, stats, tokens = [], Stats(), None
        for worker_spills, worker_stats, worker_tokens in done:
            spills.extend(worker_spills)
            stats.merge(worker_stats)
            tokens = worker_tokens if tokens is None else tokens + worker_tokens
        spills.sort(key=lambda spill: spill[0])
        where = f"{last[0]} line/row {last[1]}" if last else "the first record"
        if interrupted is not None:
            raise InterruptedRead(f"interrupted ({interrupted or 'Ctrl-C'}) while reading the inputs; "
                                  f"{stats.rows_in:,} rows were read (up to {where})", stats, where)
        if read_error is not None:
            raise PartialReadError(f"{read_error}; {stats.rows_in:,} rows were read (up to {where}) and are "
                                   f"accounted in the failure report", stats, where)
        return spills, stats, tokens

    def close(self):
        pass

    def run_tasks(self, fn, arg_tuples):
        """``fn(*args)`` for each tuple, in parallel; results in input order."""
        arg_tuples = list(arg_tuples)
        if not arg_tuples:
            return []
        if self.workers == 1 or len(arg_tuples) == 1:
            return [fn(*a) for a in arg_tuples]
        with ProcessPoolExecutor(max_workers=min(self.workers, len(arg_tuples)), mp_context=self._ctx,
                                 initializer=_worker_env) as pool:
            futures = [pool.submit(fn, *a) for a in arg_tuples]
            return [f.result() for f in futures]


def chunk_stream(inputs, cols, chunk_rows, delimiter, smi_header):
    """(path, iterator of RawChunk) for each (index, path, format)."""
    for index, path, fmt in inputs:
        yield path, read_chunks(index, path, fmt, cols, chunk_rows, delimiter, smi_header)
