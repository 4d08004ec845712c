"""Atomic output: write to a temp file in the target folder, fsync, then ``os.replace``.

A failure at any point leaves no partial file, and an existing file is replaced only with
``force``. The result gets the permissions a plain ``open()`` would give (umask), not
mkstemp's 0600.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ckptkit.errors import OutputError

__all__ = [
    "check_output",
    "atomic_output",
    "atomic_outputs",
    "atomic_folder",
    "check_folder_output",
    "remove_stale_temps",
    "syncing",
]


def check_output(dst: Path, *, force: bool, inputs: Iterable[object] = ()) -> None:
    """Refuse an output that is an input, a folder, in a missing folder, or exists without force.

    Raises:
        OutputError: with the fix in its hint.
    """
    for src in inputs:  # paths, or URLs (never the local dst)
        if isinstance(src, Path) and dst.exists() and src.exists() and os.path.samefile(dst, src):
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


# Temp files are named for the output and for ckptkit, so a later run can recognise the ones a
# killed run left: `.model.safetensors.ckptkit-<random>.tmp`.
_TEMP_MARK = ".ckptkit-"
_STALE_AFTER_S = 2.0  # a temp this young may belong to a writer that has not locked it yet
_FOLDER_LOCK = ".ckptkit-lock"  # a temp folder's lock file (see atomic_folder)


def _lock(fd: int) -> bool:
    """Take the writer's lock on a temp file; False when another process holds it."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): stale temps are then never removed
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _holds_others(folder: Path, owns: Callable[[str], bool]) -> bool:
    return any(not owns(p.name) for p in folder.iterdir())


def _replace_owned(tmp: Path, dst: Path, owns: Callable[[str], bool], entry: str | None) -> None:
    """``tmp``'s files put into ``dst``, replacing only the names ``owns`` (see
    :func:`atomic_folder`): a reader never finds an entry file over a mix of old and new.
    What would stop the swap half-way (a folder by one of those names) stops it before the old
    files go."""
    old = sorted((p for p in dst.iterdir() if owns(p.name)), key=lambda p: p.name != entry)
    for path in old:
        if path.is_dir() and not path.is_symlink():
            raise OutputError(
                f"{path} is a folder where {dst} holds its output's files",
                "move it away, or write to a new folder",
            )
    for path in old:
        path.unlink()
    _fsync_dir(dst)
    for new in sorted(tmp.iterdir(), key=lambda p: p.name == entry):
        os.replace(new, dst / new.name)
    _fsync_dir(dst)


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the temp files killed ckptkit runs left in ``folder``: only ckptkit's own, and
    only those whose writer is gone (the writer holds a lock on its temp file while it lives,
    and the kernel drops the lock when the process dies). Returns what was removed."""
    removed: list[Path] = []
    try:
        candidates = [
            p
            for p in folder.iterdir()
            if p.name.startswith(".") and _TEMP_MARK in p.name and p.name.endswith(".tmp")
        ]
    except OSError:
        return removed
    for path in candidates:
        folder_temp = path.is_dir() and not path.is_symlink()
        lock = path / _FOLDER_LOCK if folder_temp else path
        try:
            if time.time() - path.lstat().st_mtime < _STALE_AFTER_S or not lock.is_file():
                continue
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if _lock(fd):
                if folder_temp:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink()
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _commit(tmp: Path, dst: Path, *, force: bool) -> None:
    """Put ``tmp`` in place as ``dst``: a plain rename with ``force``, else one that never
    replaces a file that appeared meanwhile (a hard link, or renameat2's RENAME_NOREPLACE
    where the filesystem has no links)."""
    if force:
        os.replace(tmp, dst)
        return
    try:
        os.link(tmp, dst)
    except FileExistsError:
        raise OutputError(f"{dst} exists", "pass --force to overwrite it") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        _rename_noreplace(tmp, dst)
        return
    tmp.unlink()


def _rename_noreplace(tmp: Path, dst: Path) -> None:
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # no way to refuse atomically: the check before is what remains
        if dst.exists():
            raise OutputError(f"{dst} exists", "pass --force to overwrite it")
        os.rename(tmp, dst)
        return
    at_fdcwd, rename_noreplace = -100, 1
    if renameat2(at_fdcwd, os.fsencode(tmp), at_fdcwd, os.fsencode(dst), rename_noreplace):
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise OutputError(f"{dst} exists", "pass --force to overwrite it")
        raise OSError(code, os.strerror(code), str(dst))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait while a temp file is made and recorded: their handlers raise,
    and raised between the two they would leave a temp file whose name no cleanup knows."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not (
        threading.main_thread()
    ):
        yield  # only the main thread runs Python's signal handlers
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a signal that came is handled now


@contextlib.contextmanager
def atomic_outputs(
    dsts: list[Path], *, force: bool = False, inputs: Iterable[object] = ()
) -> Iterator[list[Path]]:
    """Yield a temp path next to each output; on success they all appear, in order, or none.

    Each temp file is named for its output and locked while this process writes it, so a later
    run removes it if this one is killed. Without ``force`` no file that appeared meanwhile is
    ever replaced: the run that comes second says the output exists, and what this run had
    already put in place is taken back.

    Raises:
        OutputError: an output is refused (see :func:`check_output`), exists, or cannot be
            written.
    """
    dsts = [Path(d) for d in dsts]
    for dst in dsts:
        check_output(dst, force=force, inputs=inputs)
    for folder in {dst.parent for dst in dsts}:
        remove_stale_temps(folder)
    temps: list[Path] = []
    fds: list[int] = []
    placed: list[Path] = []
    try:
        for dst in dsts:
            with _signals_held():
                try:
                    fd, name = tempfile.mkstemp(
                        dir=dst.parent, prefix=f".{dst.name}{_TEMP_MARK}", suffix=".tmp"
                    )
                except OSError as exc:
                    raise _os_error(dst, exc) from None
                fds.append(fd)
                temps.append(Path(name))
            _lock(fd)
        try:
            yield temps
        except OSError as exc:  # ENOSPC, EFBIG, EIO... while writing: name the output
            by_temp = {str(t): d for t, d in zip(temps, dsts, strict=True)}
            raise _os_error(by_temp.get(str(exc.filename), dsts[0]), exc) from None
        mask = _umask()
        for tmp, dst in zip(temps, dsts, strict=True):
            try:
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o666 & ~mask)
                _commit(tmp, dst, force=force)
            except OSError as exc:
                raise _os_error(dst, exc) from None
            placed.append(dst)
        for folder in {dst.parent for dst in dsts}:
            _fsync_dir(folder)
    except BaseException:
        if not force:
            for dst in placed:  # ours: linked from our temp a moment ago
                with contextlib.suppress(OSError):
                    dst.unlink()
        raise
    finally:
        for fd in fds:
            os.close(fd)
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


@contextlib.contextmanager
def atomic_output(
    dst: Path, *, force: bool = False, inputs: Iterable[object] = ()
) -> Iterator[Path]:
    """Yield a temp path next to ``dst``; on success it becomes ``dst`` atomically (see
    :func:`atomic_outputs`)."""
    with atomic_outputs([dst], force=force, inputs=inputs) as (tmp,):
        yield tmp


def check_folder_output(dst: Path, *, force: bool, inputs: Iterable[object] = ()) -> None:
    """Refuse an output folder that is an input or holds one, is a file, is in a missing
    folder, or exists without force.

    Raises:
        OutputError: with the fix in its hint.
    """
    for src in inputs:  # paths, or URLs (never the local dst)
        if (
            isinstance(src, Path)
            and dst.exists()
            and src.exists()
            and (os.path.samefile(dst, src) or dst.resolve() in src.resolve().parents)
        ):
            raise OutputError(f"output {dst} is the input or holds it", "write to a new path")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"output {dst} is a file", "give a folder name")
    if not dst.parent.is_dir():
        raise OutputError(f"folder {dst.parent} does not exist", "create it first")
    if dst.exists() and not force:
        raise OutputError(f"{dst} exists", "pass --force to replace it")


@contextlib.contextmanager
def atomic_folder(
    dst: Path,
    *,
    force: bool = False,
    inputs: Iterable[object] = (),
    owns: Callable[[str], bool] | None = None,
    entry: str | None = None,
) -> Iterator[Path]:
    """Yield a temp folder next to ``dst``; on success it becomes ``dst`` by one rename, or
    with ``force`` replaces it (the old folder is renamed aside, then removed). On failure
    nothing is left. The temp folder holds a lock file while this process writes it, so a
    later run removes it if this one is killed (see :func:`remove_stale_temps`).

    ``owns`` says which names in a folder an output of this kind consists of: ``--force``
    replaces only those. An existing ``dst`` that holds anything else (a user's notes beside a
    DCP save) keeps it: the output's old files are removed (``entry``, the file a reader finds
    the output by, first) and the new ones moved in (``entry`` last).

    Raises:
        OutputError: ``dst`` is an input, a file, in a missing folder, or exists without force.
    """
    dst = Path(dst)
    check_folder_output(dst, force=force, inputs=inputs)
    remove_stale_temps(dst.parent)
    tmp: Path | None = None
    fd = -1
    aside: Path | None = None
    try:
        try:
            with _signals_held():  # the folder is made and recorded, or neither
                tmp = Path(
                    tempfile.mkdtemp(
                        dir=dst.parent, prefix=f".{dst.name}{_TEMP_MARK}", suffix=".tmp"
                    )
                )
            fd = os.open(tmp / _FOLDER_LOCK, os.O_WRONLY | os.O_CREAT, 0o600)
        except OSError as exc:
            raise _os_error(dst, exc) from None
        _lock(fd)
        try:
            yield tmp
            (tmp / _FOLDER_LOCK).unlink()
            os.chmod(tmp, 0o777 & ~_umask())
            _fsync_dir(tmp)
            if dst.exists() and force and owns is not None and _holds_others(dst, owns):
                _replace_owned(tmp, dst, owns, entry)
                return
            if dst.exists() and force:
                aside = Path(
                    tempfile.mkdtemp(
                        dir=dst.parent, prefix=f".{dst.name}{_TEMP_MARK}old-", suffix=".tmp"
                    )
                )
                os.replace(dst, aside)
            try:
                os.rename(tmp, dst)  # onto a path that does not exist: never replaces anything
            except OSError as exc:
                if aside is not None:
                    os.replace(aside, dst)  # put the old one back
                    aside = None
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise OutputError(f"{dst} exists", "pass --force to replace it") from None
                raise
            _fsync_dir(dst.parent)
        except OSError as exc:
            raise _os_error(dst, exc) from None
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
