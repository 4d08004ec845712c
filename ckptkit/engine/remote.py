"""``train --out URL``: a run whose checkpoints live on object storage.

The run is trained in a local staging folder, as any run is; each time rank 0 commits a
checkpoint there, the folder is mirrored to the URL by the same protocol: the checkpoint's files
first (each an upload made visible only once complete), then the run's logs (TensorBoard's
event folder too), then the
``latest`` (and ``best``) pointer, then ``--keep-last`` is applied to the URL's own checkpoints
(a resumed run's older ones too, as a local run prunes its folder; never one that the URL's
``latest`` or ``best`` names). A
reader of the URL therefore never finds ``latest`` naming a partial file. ``--resume auto``
downloads the checkpoint the URL's ``latest`` names (on each node, before its workers start)
and resumes from it.

A DCP checkpoint (``--save-format dcp``) is never staged: every rank writes its shards straight
to the URL with torch's ``FsspecWriter`` (so it works on any number of nodes), and every rank
reads them back from there with ``FsspecReader``. A folder cannot be renamed into place on
object storage, so the save is written under its final name, ``meta.pt`` first and DCP's
``.metadata`` last; ``latest`` moves only once ``.metadata`` is there. A save without
``.metadata`` is incomplete (a killed run's): no pointer names it, a resume refuses it, and the
next run at the URL removes it before it trains.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptkit.engine.runlog import RUN_LOGS
from ckptkit.errors import CkptkitError, UsageError
from ckptkit.formats.folders.runs import BEST, CHECKPOINT_NAME, LATEST, list_checkpoints
from ckptkit.storage.backends.fs import filesystem
from ckptkit.storage.remote import RemotePath, as_path, is_url
from ckptkit.storage.upload import Uploads

__all__ = [
    "MIRROR_ENV",
    "staged_run",
    "push",
    "shown_path",
    "dcp_url",
    "dcp_complete",
    "complete_dcp_at",
]

# Set for the workers: the URL their (local) --out is mirrored to.
MIRROR_ENV = "CKPTKIT_OUT_URL"


@contextlib.contextmanager
def staged_run(config: Any) -> Iterator[Any]:
    """The config with ``out`` a local staging folder mirrored to the URL ``config.out``; the
    URL's run checked (fresh, or resumed from its ``latest``: a file downloaded here first, a
    DCP checkpoint named by its URL), and the incomplete DCP saves a killed run left removed.

    Raises:
        UsageError: an HTTP URL, or a URL run that is not fresh without --resume or
            --overwrite.
    """
    url = RemotePath(config.out)
    Uploads(url, force=True)  # an HTTP URL is refused here, before anything
    there = _URLFolder(str(url))
    stage = Path(os.environ.get("CKPTKIT_STAGING") or tempfile.gettempdir())
    folder = Path(tempfile.mkdtemp(prefix="ckptkit-run-", dir=stage))
    try:
        _check_fresh(there, url, config)
        _check_writable(there, url)
        config = replace(config, resume=_resume(there, url, config.resume, folder))
        if os.environ.get("RANK", "0") == "0":  # once: under torchrun every rank stages
            _remove_incomplete(there, url)
        previous = os.environ.get(MIRROR_ENV)
        os.environ[MIRROR_ENV] = str(url)
        try:
            yield replace(config, out=str(folder), overwrite=False)
        finally:
            if previous is None:
                os.environ.pop(MIRROR_ENV, None)
            else:
                os.environ[MIRROR_ENV] = previous
        push(folder)  # the logs' last lines
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _check_fresh(there: _URLFolder, url: RemotePath, config: Any) -> None:
    """As for a local --out: an earlier run's files there need --resume or --overwrite
    (which deletes them first)."""
    names = url.names() or []
    earlier = [n for n in names if n in (LATEST, BEST, *RUN_LOGS) or n.startswith("ckpt-")]
    if not earlier or config.resume is not None:
        return
    if not config.overwrite:
        raise UsageError(
            f"{url} holds an earlier run ({', '.join(sorted(earlier)[:3])})",
            "resume it with --resume auto, or replace it with --overwrite",
        )
    for name in earlier:
        there.remove(name)


def _check_writable(there: _URLFolder, url: RemotePath) -> None:
    """Fail now, not after the first epoch: a small object written there and removed."""
    try:
        there.write_and_remove(f".ckptkit-probe-{os.getpid()}")
    except Exception as exc:  # the back-end's own (no bucket, no credentials): said
        raise UsageError(
            f"cannot write to --out {url}: {exc}", "check the bucket and the credentials"
        ) from None


def _remove_incomplete(there: _URLFolder, url: RemotePath) -> None:
    """Remove the DCP saves at the URL that have no ``.metadata``: a killed run's, which no
    pointer names (DCP writes ``.metadata`` last, and ``latest`` moves after it)."""
    for name in url.names() or []:
        match = CHECKPOINT_NAME.fullmatch(name)
        if match and not match.group(3) and not dcp_complete(str(url / name)):
            with contextlib.suppress(FileNotFoundError):
                there.remove(name)


def _resume(there: _URLFolder, url: RemotePath, resume: str | None, folder: Path) -> str | None:
    """``--resume`` for the run in ``folder``: ``auto`` with what the URL's ``latest`` names
    pulled (or its URL, for a DCP checkpoint); a checkpoint URL likewise."""
    if resume == "auto":
        return _pull_latest(there, url, folder)
    if resume is not None and is_url(resume):
        return _pull(RemotePath(resume), folder)
    return resume


def _pull(url: RemotePath, folder: Path) -> str:
    """A checkpoint at a URL to resume from: a file downloaded into ``folder`` (its path), or
    a DCP folder, read in place by every rank (its URL, once found complete)."""
    there = _URLFolder(str(url))
    if there.is_folder():
        return str(complete_dcp_at(str(url)))
    local = folder / url.name
    try:
        there.download(None, local)
    except FileNotFoundError:
        raise UsageError(f"cannot resume: {url} does not exist", "check --resume") from None
    return str(local)


def _pull_latest(there: _URLFolder, url: RemotePath, folder: Path) -> str:
    """``--resume auto`` from the URL: its logs pulled, and the checkpoint its ``latest``
    names: a file downloaded with the pointer (``auto`` finds it here), or a DCP folder's URL
    (read in place by every rank)."""
    name = _resumable(there, url)
    if name is None:
        return "auto"  # nothing to resume: a fresh run, as locally
    for log in RUN_LOGS:  # the logs go on where they stopped (each rewound to the step)
        with contextlib.suppress(FileNotFoundError):
            if there.is_folder(log):  # TensorBoard's event folder
                there.download_folder(log, folder / log)
            else:
                there.download(log, folder / log)
    if "." not in name:  # a DCP checkpoint: a folder, read in place
        return str(url / name)
    for suffix in (".pt", ".safetensors"):
        remote = f"{name.rsplit('.', 1)[0]}{suffix}"
        if there.exists(remote):
            there.download(remote, folder / remote)
    (folder / LATEST).write_text(name + "\n")
    return "auto"


def _resumable(there: _URLFolder, url: RemotePath) -> str | None:
    """What ``--resume auto`` takes at the URL, as locally: what ``latest`` names, unless that
    is a DCP save left incomplete (one of the same name cut short), else the newest complete
    checkpoint; None when there is none."""
    try:
        name = there.read(LATEST).decode().strip()
    except FileNotFoundError:
        return _newest_there(url)
    if "." not in name and not dcp_complete(str(url / name)):
        return _newest_there(url) or name  # none complete: the resume says this one is not
    return name


def dcp_url(name: str) -> str | None:
    """Where the DCP checkpoint ``name`` of a run mirrored to a URL is written: at the URL,
    by every rank. None for a local run."""
    url = _mirror_url()
    return f"{url.rstrip('/')}/{name}" if url else None


def dcp_complete(url: str) -> bool:
    """Whether the DCP checkpoint at ``url`` is complete: DCP writes its ``.metadata`` last."""
    return _URLFolder(url).exists(".metadata", fresh=True)


def complete_dcp_at(url: str) -> Path:
    """The DCP checkpoint at ``url`` (standing as a Path), once its ``.metadata`` shows it
    complete.

    Raises:
        CkptkitError: it is missing or incomplete (a killed run's save, or no DCP folder).
    """
    if not dcp_complete(url):
        raise CkptkitError(
            f"cannot resume: {url} holds no complete DCP checkpoint (no .metadata)",
            "check --resume",
        )
    return as_path(url)


def _mirror_url() -> str | None:
    """The URL this run is mirrored to (``$CKPTKIT_OUT_URL``), if any."""
    url = os.environ.get(MIRROR_ENV)
    return url if url and is_url(url) else None


def push(folder: Path, keep_last: int | None = None) -> None:
    """Mirror ``folder`` (a run's staging folder) to the URL in ``$CKPTKIT_OUT_URL``: new
    checkpoint files, then the logs, then the pointers, each visible only when whole; then, with
    ``keep_last``, the URL's older checkpoints pruned. No URL, or not rank 0: nothing. (DCP
    checkpoints are not here: every rank wrote its shards to the URL already.)"""
    url = _mirror_url()
    if not url or os.environ.get("RANK", "0") != "0":
        return  # no URL; or not rank 0 (under torchrun each rank stages: rank 0's is the run)
    target = RemotePath(url)
    uploads = Uploads(target, force=True)
    there = set(target.names() or [])
    checkpoints = list_checkpoints(folder)
    with uploads:
        for checkpoint in checkpoints:  # checkpoints are written once: only new ones go up
            for path in _files_of(checkpoint):
                if path.name not in there:
                    _stage_copy_and_add(uploads, path)
        for name in RUN_LOGS:  # the JSONL logs, and the TensorBoard event folder's files
            log = folder / name
            for path in sorted(log.rglob("*")) if log.is_dir() else [log]:
                if path.is_file():
                    _stage_copy_and_add(uploads, path, path.relative_to(folder).as_posix())
        for name in (LATEST, BEST):  # last: they name files already in place
            if (folder / name).is_file():
                _stage_copy_and_add(uploads, folder / name)
        uploads.commit()
    if keep_last:
        _prune_there(uploads, _URLFolder(str(target)), keep_last)


def _when(match: re.Match[str]) -> tuple[int, int]:
    """A checkpoint name's place in the run: an epoch's end before the steps after it."""
    return int(match.group(1)), int(match.group(2)) if match.group(2) else -1


def _newest_there(url: RemotePath) -> str | None:
    """The newest complete checkpoint at the URL (a file, or a DCP folder with its
    ``.metadata``), for a run whose ``latest`` is missing; None when there is none."""
    found = [(m, n) for n in url.names() or [] if (m := CHECKPOINT_NAME.fullmatch(n))]
    for _, name in sorted(found, key=lambda mn: _when(mn[0]), reverse=True):
        if "." in name or dcp_complete(str(url / name)):
            return name
    return None


def _prune_there(uploads: Uploads, there: _URLFolder, keep_last: int) -> None:
    """``--keep-last`` applied to the URL's own checkpoints (a resumed run's older ones too, as
    a local run prunes its folder), never one that the URL's ``latest`` or ``best`` names."""
    names = uploads.folder.names() or []
    kept = set()
    for pointer in (LATEST, BEST):
        with contextlib.suppress(FileNotFoundError):
            kept.add(there.read(pointer).decode().strip())
    found = [(m, n) for n in names if (m := CHECKPOINT_NAME.fullmatch(n))]
    old = set(sorted({_when(m) for m, _ in found})[:-keep_last])
    for m, name in found:
        stem = name.split(".", 1)[0]
        if _when(m) in old and not {stem, stem + ".pt", stem + ".safetensors"} & kept:
            uploads.remove([name])


def shown_path(path: Path) -> str:
    """A path of the run folder as the user named it: at the URL, for a mirrored run (a
    checkpoint read at a URL, as it is)."""
    url = _mirror_url()
    return f"{url.rstrip('/')}/{path.name}" if url and not is_url(path) else str(path)


def _files_of(checkpoint: Path) -> list[Path]:
    """A checkpoint's files: its ``.pt`` and ``.safetensors``."""
    stem = checkpoint.with_suffix("")
    return [p for p in (stem.with_suffix(".pt"), stem.with_suffix(".safetensors")) if p.is_file()]


def _stage_copy_and_add(uploads: Uploads, path: Path, name: str | None = None) -> None:
    """Upload a file of the run folder as ``name`` (default: its own), which stays
    (Uploads.add deletes what it uploads)."""
    with tempfile.TemporaryDirectory(prefix="ckptkit-push-") as tmp:
        copy = Path(tmp) / path.name
        with contextlib.suppress(OSError):  # a hard link where it can: no copy of the bytes
            os.link(path, copy)
        if not copy.exists():
            shutil.copyfile(path, copy)
        uploads.add(copy, name or path.name)


class _URLFolder:
    """A folder at a URL, and every operation this module performs there: the one place here
    that calls fsspec (what a storage ``Destination`` would offer in its stead). ``name`` is a
    name in the folder, a sub-folder's too; None is the URL itself."""

    def __init__(self, url: str) -> None:
        self.fs, self.path = filesystem(url)
        self.root = self.path.rstrip("/")

    def _at(self, name: str | None) -> str:
        return self.path if name is None else f"{self.root}/{name}"

    def exists(self, name: str, *, fresh: bool = False) -> bool:
        """Whether ``name`` is there; ``fresh``: asked anew, not from a listing cached earlier
        (one made before a save ended must not hide it)."""
        if fresh:
            self.fs.invalidate_cache(self.path)
        return bool(self.fs.exists(self._at(name)))

    def is_folder(self, name: str | None = None) -> bool:
        return bool(self.fs.isdir(self._at(name)))

    def read(self, name: str) -> bytes:
        """A small object's bytes (a pointer).

        Raises:
            FileNotFoundError: there is none.
        """
        return bytes(self.fs.cat_file(self._at(name)))

    def download(self, name: str | None, local: Path) -> None:
        """A file downloaded to ``local``.

        Raises:
            FileNotFoundError: there is none.
        """
        self.fs.get_file(self._at(name), str(local))

    def download_folder(self, name: str, local: Path) -> None:
        """A folder's files downloaded into ``local``, sub-folders too."""
        self.fs.get(f"{self._at(name)}/", str(local) + "/", recursive=True)

    def write_and_remove(self, name: str) -> None:
        """An empty object written as ``name``, then removed: can this folder be written?"""
        self.fs.pipe_file(self._at(name), b"")
        self.fs.rm(self._at(name))

    def remove(self, name: str) -> None:
        """``name`` removed, a folder with all it holds.

        Raises:
            FileNotFoundError: it is not there (some back-ends).
        """
        self.fs.rm(self._at(name), recursive=True)
