"""Write-to-temporary-then-rename, the one way molds and its ETL put files in place.

A reader sees a file or directory either whole or not at all: the content goes to a
temporary sibling (same directory, so the rename is atomic on POSIX filesystems), is
flushed with ``fsync`` when ``durable``, and is renamed over the final name. A
directory that already exists under the final name is moved aside first and removed
only once the new one is in place, so a crash at any point leaves one complete copy.
On any error the temporary is removed and the error propagates; nothing half-written
is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file below ``path`` and the directories themselves."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(root)


def write_bytes(path: str, data: bytes, durable: bool = True) -> None:
    with atomic_file(path, durable=durable) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)


def write_text(path: str, text: str, durable: bool = True) -> None:
    write_bytes(path, text.encode("utf-8"), durable)


def write_json(path: str, obj, durable: bool = True, **dump_kwargs) -> None:
    write_text(path, json.dumps(obj, **dump_kwargs), durable)


@contextlib.contextmanager
def atomic_file(path: str, durable: bool = True):
    """``with atomic_file(p) as tmp_path:`` write ``tmp_path`` yourself (a library that
    wants a file name); it is renamed to ``path`` when the block ends without error."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        yield tmp
        if durable:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def publish_directory(tmp: str, final: str, durable: bool = False) -> None:
    """Rename a finished directory ``tmp`` to ``final``; an existing ``final`` is moved
    aside first and deleted only after the new one is in place."""
    if durable:
        fsync_tree(tmp)
    old = None
    if os.path.lexists(final):
        old = f"{final}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old:  # put the previous one back
            os.rename(old, final)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(final)))
    if old:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(final: str, durable: bool = False, tmp: str | None = None):
    """``with atomic_directory(out) as tmp_dir:`` fill ``tmp_dir``; it becomes ``out``
    when the block ends without error, and is removed when it raises."""
    tmp = tmp or f"{final.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        publish_directory(tmp, final, durable)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
