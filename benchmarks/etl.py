"""ETL throughput against bare RDKit, and peak memory, in one run.

    python benchmarks/etl.py [--input moses_train.csv.gz] [--n 200000] [--workers 2]
    python benchmarks/etl.py --write-sdf X.sdf.gz [--input moses_train.csv.gz] [--n N] [--coords]
    python benchmarks/etl.py --input X.sdf.gz [--n N]       # SD input: the floor is RDKit's SD supplier

For an SD file (``.sdf``/``.sd``, compressed or not) the floor is a bare RDKit script over
the file: the sampled records through RDKit's forward SD supplier (from a gzip stream when
the input is gzipped: a script reads the file as it is), then the same canonical SMILES and
scaffold. ``--write-sdf`` turns the SMILES of ``--input`` into an SD
file (title = row number, one ``row`` SD tag; 2D coordinates with ``--coords``, else the
zero coordinates RDKit writes for a molecule without a conformer) to benchmark with.

Times bare RDKit (parse + canonical SMILES + Murcko scaffold, plus the standardization
calls when they are switched on) on one core, on a sample spread evenly over the input
(``--floor-sample`` molecules, every k-th), before the ETL, after it, and while it runs:
every ``--floor-every`` seconds the ETL's whole process tree is paused (SIGSTOP), the
floor timed on the otherwise idle machine, and the tree resumed (SIGCONT); the ETL's time
is its wall time less those pauses. A shared VM's speed drifts by 10-15 % over minutes, so
a floor timed only at the two ends can miss what the machine gave the ETL in between; the
floor the ratio uses is the mean of every sample, and the JSON line lists them all.
Runs ``molds-preprocess`` on the first N molecules in a subprocess while sampling the
resident memory of its whole process tree. Prints one JSON line:
molecules_per_s, rdkit_floor_per_core, workers, ratio_to_floor (and ratio_to_floor_ends,
the ratio to the two end samples alone), peak_rss_mb; and, to tell the machine's own
contention apart, the floor per core while ``workers`` processes run it at once (timed at
the same moments: before, at every pause, after), the ratio to that (ratio_to_busy_floor:
the ETL's workers against as many bare RDKit scripts sharing the machine as they do), and
the time of each ETL stage. Where a ratio under 1 goes: etl_cpu_s (the CPU of
every ETL process, from the resource usage of the reaped children; the floor runs in this
process, never a child), cpu_us_per_molecule against floor_us_per_molecule, and cores_busy
(that CPU over the ETL's wall time on ``workers`` cores; with ``--engine local``: Ray's
worker processes are not the ETL's children, so under ``--engine ray`` they are not counted).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared", "data", "moses_train.csv.gz")
SAMPLE = os.path.join(HERE, "..", "molds", "sample_data", "moses_sample.csv.gz")


def rdkit_floor(smiles: list[str], standardize: dict) -> float:
    """Molecules per second on one core for the work the ETL cannot avoid."""
    from rdkit import Chem, RDLogger
    from rdkit.Chem.MolStandardize import rdMolStandardize
    from rdkit.Chem.Scaffolds import MurckoScaffold

    RDLogger.DisableLog("rdApp.*")
    steps = []
    if standardize.get("normalize"):
        steps.append(rdMolStandardize.Normalizer().normalize)
    if standardize.get("largest_fragment"):
        steps.append(rdMolStandardize.LargestFragmentChooser(preferOrganic=True).choose)
    if standardize.get("uncharge"):
        steps.append(rdMolStandardize.Uncharger().uncharge)
    start = time.perf_counter()
    for s in smiles:
        mol = Chem.MolFromSmiles(s)
        if mol is None:
            continue
        for step in steps:
            mol = step(mol)
        Chem.MolToSmiles(mol)
        Chem.MolToSmiles(MurckoScaffold.GetScaffoldForMol(mol), isomericSmiles=False)
    return len(smiles) / (time.perf_counter() - start)


def rdkit_sd_floor(sample: dict, standardize: dict) -> float:
    """Records per second on one core: a bare RDKit script over the file, its forward SD
    supplier reading the sampled records (through gzip when the input is compressed, as a
    script reading the file does), then what ``rdkit_floor`` does after parsing."""
    import io

    from rdkit import Chem, RDLogger
    from rdkit.Chem.Scaffolds import MurckoScaffold

    RDLogger.DisableLog("rdApp.*")
    records = sample["records"]
    data = b"".join(records)
    if sample["gzip"]:
        data = gzip.compress(data, compresslevel=1)
    start = time.perf_counter()
    stream = gzip.GzipFile(fileobj=io.BytesIO(data)) if sample["gzip"] else io.BytesIO(data)
    for mol in Chem.ForwardSDMolSupplier(stream):
        if mol is None:
            continue
        Chem.MolToSmiles(mol)
        Chem.MolToSmiles(MurckoScaffold.GetScaffoldForMol(mol), isomericSmiles=False)
    return len(records) / (time.perf_counter() - start)


def parallel_floor(pool, sample, standardize: dict, workers: int, floor=rdkit_floor) -> float:
    """Per-core floor with ``workers`` processes of ``pool`` running it at once: what bare
    RDKit scripts get from the machine when they keep ``workers`` cores busy together, as the
    ETL's workers do (cores that share caches, or a host's hyperthreads, slow each other)."""
    rates = list(pool.map(floor, [sample] * workers, [standardize] * workers))
    return sum(rates) / workers


def is_sdf(path: str) -> bool:
    stem = path.lower()
    for ext in (".gz", ".bz2", ".xz", ".zst"):
        stem = stem[: -len(ext)] if stem.endswith(ext) else stem
    return stem.endswith((".sdf", ".sd"))


def sd_records(path: str, limit: int = 0):
    """The raw bytes of each record of an SD file, streamed (molds' splitter)."""
    import fsspec

    from molds.data.sdf import read_sd_records

    with fsspec.open(path, "rb", compression="infer") as fh:
        for n, (_, _, text, _) in enumerate(read_sd_records(fh)):
            if limit and n >= limit:
                return
            if text is not None:
                yield text


def write_sdf(source: str, column: str, out: str, n: int, coords: bool) -> int:
    """SMILES of ``source`` (first ``n`` rows; 0: all) as an SD file; returns the records written."""
    from rdkit import Chem, RDLogger
    from rdkit.Chem import AllChem

    RDLogger.DisableLog("rdApp.*")
    opener = gzip.open if source.endswith(".gz") else open
    written = 0
    with opener(source, "rt", newline="") as src, gzip.open(out, "wt", compresslevel=1) as dst:
        rows = csv.reader(src)
        col = next(rows).index(column)
        for i, row in enumerate(rows):
            if n and i >= n:
                break
            mol = Chem.MolFromSmiles(row[col])
            if mol is None:
                continue
            if coords:
                AllChem.Compute2DCoords(mol)
            dst.write(f"{i + 1}\n" + Chem.MolToMolBlock(mol).split("\n", 1)[1] + f">  <row>\n{i + 1}\n\n$$$$\n")
            written += 1
    return written


def process_tree(pid: int) -> list:
    """The process ``pid`` and its descendants (psutil), or [] once it has ended."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def pause_tree(pid: int) -> list:
    """SIGSTOP a process and its descendants (the parent first, so that it starts no new
    worker meanwhile; the tree listed again after, for one started in between)."""
    import psutil

    stopped: dict = {}
    for _ in range(2):
        for p in process_tree(pid):
            if p.pid not in stopped:
                try:
                    p.suspend()
                    stopped[p.pid] = p
                except psutil.NoSuchProcess:
                    pass
    return list(stopped.values())


def tree_rss_mb(pid: int) -> float:
    import psutil

    total = 0
    for p in process_tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default=SHARED if os.path.exists(SHARED) else SAMPLE)
    ap.add_argument("--smiles-column", default="SMILES")
    ap.add_argument("--n", type=int, default=0, help="first N molecules (0: all)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--floor-sample", type=int, default=10000)
    ap.add_argument("--floor-every", type=float, default=30.0,
                    help="seconds of ETL between floor samples taken with the ETL paused (0: only before and after)")
    ap.add_argument("--engine", default="local")
    ap.add_argument("--write-sdf", help="write the SMILES of --input (first --n) as this SD file and exit")
    ap.add_argument("--coords", action="store_true", help="--write-sdf: 2D coordinates (slower to write)")
    for flag in ("largest-fragment", "uncharge", "normalize"):
        ap.add_argument(f"--{flag}", action="store_true")
    args = ap.parse_args()
    standardize = {k: getattr(args, k) for k in ("largest_fragment", "uncharge", "normalize")}

    if args.write_sdf:
        count = write_sdf(args.input, args.smiles_column, args.write_sdf, args.n, args.coords)
        print(json.dumps({"wrote": args.write_sdf, "records": count, "bytes": os.path.getsize(args.write_sdf)}))
        return
    tmp = tempfile.mkdtemp(prefix="molds-bench-etl-")
    data = args.input
    sdf = is_sdf(data)
    if sdf:
        if args.n:
            data = os.path.join(tmp, "input.sdf.gz")
            with gzip.open(data, "wb", compresslevel=1) as dst:
                for record in sd_records(args.input, args.n):
                    dst.write(record)
        # the floor's sample: every k-th record, k from the first records' size and the file's
        head = list(sd_records(data, 1000))
        per_record = max(1, sum(map(len, head)) // max(1, len(head)))
        raw_bytes = os.path.getsize(data) * (4 if data.endswith((".gz", ".bz2", ".xz", ".zst")) else 1)
        step = max(1, raw_bytes // per_record // args.floor_sample)
        sample = {"records": [r for i, r in enumerate(sd_records(data)) if i % step == 0][:args.floor_sample],
                  "gzip": data.endswith(".gz")}
        floor_fn = rdkit_sd_floor
    elif args.n:
        data = os.path.join(tmp, "input.csv.gz")
        with gzip.open(args.input, "rt") as src, gzip.open(data, "wt", compresslevel=1) as dst:
            dst.write(next(src))
            for i, line in enumerate(src):
                if i >= args.n:
                    break
                dst.write(line)
    if not sdf:
        # the floor's sample is spread evenly over the whole input (every k-th molecule), so
        # it costs what the ETL's molecules cost on average wherever the file changes character
        opener = gzip.open if data.endswith(".gz") else open
        with opener(data, "rt", newline="") as fh:
            rows = csv.reader(fh)
            header = next(rows)
            if args.smiles_column not in header:
                sys.exit(f"{data}: no column {args.smiles_column!r} in its header {header}")
            col = header.index(args.smiles_column)
            everything = [row[col].strip() for row in rows if len(row) > col]
        sample = everything[::max(1, len(everything) // args.floor_sample)][:args.floor_sample]
        del everything
        floor_fn = rdkit_floor

    from concurrent.futures import ProcessPoolExecutor

    # the busy floor's processes: children of this process, reaped after the ETL's CPU is read
    busy_pool = ProcessPoolExecutor(args.workers)
    floor_before = floor_fn(sample, standardize)
    busy_before = parallel_floor(busy_pool, sample, standardize, args.workers, floor_fn)
    cmd = [sys.executable, "-m", "molds.preprocessing.cli", "--input", data, "--smiles_column", args.smiles_column,
           "--output", os.path.join(tmp, "out"), "--workers", str(args.workers), "--engine", args.engine,
           "--progress", "false"]
    for k, v in standardize.items():
        if v:
            cmd += [f"--{k}", "true"]
    peak = [0.0]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the floor runs in this process, never a child
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    lock = threading.Lock()  # the memory sampler stays quiet while the floor is timed

    def sample_rss():
        while proc.poll() is None:
            with lock:
                peak[0] = max(peak[0], tree_rss_mb(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    during, busy_during, paused, finished = [], [], [0.0], threading.Event()

    def floor_while_paused():
        """Every --floor-every s: pause the ETL's tree, time the floor (one process, then
        ``workers`` at once), resume it."""
        while not finished.wait(args.floor_every):
            with lock:
                if proc.poll() is not None:
                    return
                t0 = time.perf_counter()
                stopped = pause_tree(proc.pid)
                try:
                    during.append(floor_fn(sample, standardize))
                    busy_during.append(parallel_floor(busy_pool, sample, standardize, args.workers, floor_fn))
                finally:
                    for p in stopped:
                        try:
                            p.resume()
                        except Exception:  # noqa: BLE001 - it ended meanwhile
                            pass
                paused[0] += time.perf_counter() - t0

    pauser = threading.Thread(target=floor_while_paused, daemon=True)
    if args.floor_every > 0:
        pauser.start()
    try:
        out, _ = proc.communicate()
    except BaseException:  # Ctrl-C, perhaps mid-pause: no stopped ETL process is left behind
        finished.set()
        for p in pause_tree(proc.pid):
            p.kill()
        raise
    with lock:  # a pause under way has ended (the tree resumed) before the clock stops
        wall = time.perf_counter() - start - paused[0]
    finished.set()
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)  # the ETL and every process it waited for
    cpu = (reaped.ru_utime - children.ru_utime) + (reaped.ru_stime - children.ru_stime)
    sampler.join()
    if pauser.is_alive():
        pauser.join()
    if proc.returncode:
        sys.exit(f"molds-preprocess failed with exit code {proc.returncode}")
    floor_after = floor_fn(sample, standardize)
    busy_after = parallel_floor(busy_pool, sample, standardize, args.workers, floor_fn)
    busy_pool.shutdown()
    busy = [busy_before, *busy_during, busy_after]
    floor_parallel = sum(busy) / len(busy)
    manifest_path = out.decode().strip().splitlines()[-1]
    manifest = json.load(open(manifest_path))
    report = json.load(open(os.path.join(os.path.dirname(manifest_path), "report.json")))
    timings = report["timings_s"]
    samples = [floor_before, *during, floor_after]
    floor = sum(samples) / len(samples)
    floor_ends = (floor_before + floor_after) / 2
    rows = manifest["stats"]["rows_in"]
    mps = rows / wall
    from molds.runtime.lifecycle import cpu_description
    from molds.data.inflate import backend as inflate_backend

    print(json.dumps({"cpu": cpu_description(),
        "molecules": rows,
        "rows_out": manifest["stats"]["rows_out"],
        "wall_s": round(wall, 2),
        "molecules_per_s": round(mps, 1),
        "rdkit_floor_per_core": round(floor, 1),
        "rdkit_floor_before_after": [round(floor_before, 1), round(floor_after, 1)],
        "rdkit_floor_during": [round(f, 1) for f in during],
        "paused_s": round(paused[0], 2),
        "workers": args.workers,
        "ratio_to_floor": round(mps / (args.workers * floor), 3),
        "ratio_to_floor_ends": round(mps / (args.workers * floor_ends), 3),
        "peak_rss_mb": round(peak[0], 1),
        # where a ratio under 1 goes: CPU the ETL's processes spent per molecule against the
        # floor's time per molecule, and how busy it kept the cores it had
        "etl_cpu_s": round(cpu, 2),
        "cpu_us_per_molecule": round(cpu / rows * 1e6, 1),
        "floor_us_per_molecule": round(1e6 / floor, 1),
        "cores_busy": round(cpu / (wall * min(args.workers, os.cpu_count() or 1)), 3),
        "rdkit_floor_per_core_all_workers_busy": round(floor_parallel, 1),
        "rdkit_busy_floor_before_during_after": [round(f, 1) for f in busy],
        "ratio_to_busy_floor": round(mps / (args.workers * floor_parallel), 3),
        "stage_s": timings,
        "standardize": standardize,
        "engine": args.engine,
        "gzip_inflate": inflate_backend(),  # isal or zlib: what read a .gz input
        # glibc's malloc settings the ETL ran with (molds-preprocess raises tcache_count); the
        # floor runs with this process's own, glibc's defaults unless GLIBC_TUNABLES was set
        "etl_glibc_tunables": report.get("glibc_tunables"),
        "floor_glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "input": args.input,
        "input_format": "sdf" if sdf else "smiles",
        "floor": "RDKit ForwardSDMolSupplier (through gzip for a .gz input) + canonical SMILES + scaffold" if sdf
                 else "RDKit MolFromSmiles + canonical SMILES + scaffold",
    }))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
