"""Arrays computed from a list of SMILES, kept on disk between processes.

The references an evaluation scores against (a manifest's split drawn with a fixed seed,
MOSES's Test, the training split's property ranges) are the same molecules at every
evaluation, in every run and resume on that data, and in ``molds-eval`` after training:
ChemNet over MOSES's Test takes tens of minutes of a CPU core, the property table of
20,000 training molecules (QED, SA, Crippen) about two minutes. Each is computed once and
read back afterwards.

Entries live under ``$MOLDS_CACHE_DIR`` (default ``~/.cache/molds``; set and empty: no
cache), one ``.npz`` per entry named by the SHA-256 of what it was computed with and
from (a version line naming the computation and its libraries, then every SMILES), read
with ``allow_pickle=False``. A file that does not load, or whose arrays fail the caller's
check, is said on stderr and computed again; a cache that cannot be written (a read-only
home) costs only the cache.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np

from ..runtime.atomic import write_bytes


def cache_root() -> str:
    """The cache's directory ('' when caching is off)."""
    return os.environ.get("MOLDS_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "molds"))


def cached_arrays(kind: str, version: str, smiles: Sequence[str], compute: Callable[[], dict],
                  check: Callable[[dict], bool]) -> dict:
    """``compute()`` (a dict of NumPy arrays) for these ``smiles``, from ``<root>/<kind>/`` when
    an entry made with the same ``version`` line and the same SMILES in the same order
    passes ``check``; otherwise computed and stored (an empty result is not stored)."""
    root = cache_root()
    if not root:
        return compute()
    digest = hashlib.sha256(f"{version}\n".encode())
    for text in smiles:
        digest.update(text.encode("utf-8", "surrogatepass") + b"\n")
    path = os.path.join(root, kind, f"{digest.hexdigest()}.npz")
    if os.path.isfile(path):
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: np.asarray(z[name]) for name in z.files}
            if check(arrays):
                return arrays
        except Exception:  # noqa: BLE001 - unreadable: computed again below
            pass
        print(f"[molds] {path}: not a valid {kind} cache entry; computing it again", file=sys.stderr)
    arrays = compute()
    if arrays:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_bytes(path, buf.getvalue(), durable=False)
        except OSError as exc:  # a read-only home: the figures stand, only the cache is lost
            print(f"[molds] {kind} not cached ({exc})", file=sys.stderr)
    return arrays
