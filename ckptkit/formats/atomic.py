"""Atomic output: write to a temp file in the target folder, fsync, then ``os.replace``.

A failure at any point leaves no partial file, and an existing file is replaced only with
``force``. The result gets the permissions a plain ``open()`` would give (umask), not
mkstemp's 0600.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from ckptkit.errors import OutputError

__all__ = ["check_output", "atomic_output", "syncing"]


def check_output(dst: Path, *, force: bool, inputs: Iterable[Path] = ()) -> None:
    """Refuse an output that is an input, a folder, in a missing folder, or exists without force.

    Raises:
        OutputError: with the fix in its hint.
    """
    for src in inputs:
        if dst.exists() and src.exists() and os.path.samefile(dst, src):
            raise OutputError(f"output {dst} is the input file", "write to a new path")
    if dst.is_dir():
        raise OutputError(f"output {dst} is a folder", "give a file name")
    if not dst.parent.is_dir():
        raise OutputError(f"folder {dst.parent} does not exist", "create it first")
    if dst.exists() and not force:
        raise OutputError(f"{dst} exists", "pass --force to overwrite it")


@contextlib.contextmanager
def syncing(path: Path) -> Iterator[None]:
    """fsync ``path`` in a background thread while the body runs (say, verification, which reads
    the page cache while fsync writes to disk); the body's end waits for the sync."""
    import threading

    errors: list[OSError] = []

    def sync() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=sync, name="ckptkit-fsync", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if errors:
        raise errors[0]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be fsynced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _os_error(dst: Path, exc: OSError) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(
            f"no space left on the device writing {dst}", "free space or write elsewhere"
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"cannot write {dst}: {exc.strerror}", "choose a writable location")
    return OutputError(f"cannot write {dst}: {exc.strerror or exc}")


@contextlib.contextmanager
def atomic_output(dst: Path, *, force: bool = False, inputs: Iterable[Path] = ()) -> Iterator[Path]:
    """Yield a temp path next to ``dst``; on success it becomes ``dst`` atomically.

    Raises:
        OutputError: the output is refused (see :func:`check_output`) or cannot be written.
    """
    dst = Path(dst)
    check_output(dst, force=force, inputs=inputs)
    try:
        fd, name = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    except OSError as exc:
        raise _os_error(dst, exc) from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except OSError as exc:
        raise _os_error(dst, exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
