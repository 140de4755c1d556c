"""The peak memory of ``molds-predict`` on a property model as its input grows, read in chunks
(``--chunk_size``) against read whole, side by side in one run.

    python benchmarks/predict_memory.py --run RUN --input FILE [--column smiles]
                                        [--sizes 5000 20000] [--chunk_size 2000]

For each size N, the first M sources of FILE (a CSV / TSV with ``--column``, or SMILES one a
line; M the smallest size) repeated to N are written to a file of their own (every size holds
the same molecules, so the longest batch, whose activations set a peak, is the same in
each) and ``molds-predict RUN`` is run on it twice, as its own process: with ``--chunk_size`` (read, predicted and written that many at a time), with
a chunk larger than the file (the whole input at once, as before ``--chunk_size``), and
chunked with the C library's allocator defaults (``MOLDS_SYSTEM_ALLOCATOR=1``: without
``molds.runtime.allocator.bound_peak_memory``, whose fixed mmap threshold keeps freed
activations out of a heap that grows chunk after chunk). Each
process's peak resident memory is read from the kernel when it ends (``os.wait4``), and its
wall seconds beside it. A chunked peak that stays flat while N grows, where the whole-input
peak grows, is what ``--chunk_size`` promises (the target: the chunked peak at the largest N
within 5 % of its peak at the smallest). One final JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _sources(path: str, column: str | None, n: int) -> list[str]:
    from molds.cli.predict import iter_sources

    out = []
    for _, text, note in iter_sources(path, column):
        if note is None and text:
            out.append(text)
            if len(out) == n:
                break
    if len(out) < n:
        raise SystemExit(f"{path}: {len(out)} sources, fewer than --sizes asks ({n})")
    return out


def _run(argv: list[str], system: bool) -> tuple[float, float]:
    """(peak resident MiB, wall seconds) of one process."""
    env = dict(os.environ, MOLDS_SYSTEM_ALLOCATOR="1" if system else "0")
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(key, None)  # the C library's defaults, whatever this shell's environment says
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {err[-2000:]}")
    return usage.ru_maxrss / 1024.0, time.perf_counter() - t0  # Linux: ru_maxrss in KiB


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a property model's run or checkpoint")
    p.add_argument("--input", required=True)
    p.add_argument("--column", default=None)
    p.add_argument("--sizes", type=int, nargs="+", default=[5000, 20000])
    p.add_argument("--chunk_size", type=int, default=2000)
    args = p.parse_args(argv)
    sizes = sorted(set(args.sizes))
    first = _sources(args.input, args.column, sizes[0])
    texts = [first[i % len(first)] for i in range(sizes[-1])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            src = os.path.join(tmp, f"in-{n}.csv")
            with open(src, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["smiles"])
                w.writerows([t] for t in texts[:n])
            for label, chunk, system in (("chunked", args.chunk_size, False), ("whole", n + 1, False),
                                         ("chunked_system_allocator", args.chunk_size, True)):
                mib, secs = _run([sys.executable, "-m", "molds.cli.predict", args.run, "--input", src,
                                  "--chunk_size", str(chunk), "--out", os.path.join(tmp, f"out-{n}-{label}.csv")],
                                 system)
                rows.append({"sources": n, "read": label, "chunk_size": chunk, "peak_rss_mib": round(mib, 1),
                             "wall_s": round(secs, 1)})
                print(f"[predict_memory] {rows[-1]}", file=sys.stderr, flush=True)
    chunked = [r["peak_rss_mib"] for r in rows if r["read"] == "chunked"]
    whole = [r["peak_rss_mib"] for r in rows if r["read"] == "whole"]
    system = [r["peak_rss_mib"] for r in rows if r["read"] == "chunked_system_allocator"]
    from molds.runtime.lifecycle import cpu_description

    result = {"benchmark": "predict_memory", "run": args.run, "input": args.input, "runs": rows,
              "chunked_growth": round(chunked[-1] / chunked[0], 3), "whole_growth": round(whole[-1] / whole[0], 3),
              "system_allocator_growth": round(system[-1] / system[0], 3),
              "target_met": chunked[-1] <= 1.05 * chunked[0], "cpu": cpu_description(), "commit": _commit()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
