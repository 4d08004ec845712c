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

Every request made at the URL goes through storage (nothing here calls fsspec): the folder's
operations are a :class:`~ckptkit.storage.remote_folder.RemoteFolder`'s, the mirrored files go
up through its :class:`~ckptkit.storage.upload.Uploads` (the staged uploads, committed in
order, of a URL ``Destination``), and whether a place is at a URL is asked of
:mod:`ckptkit.storage.location`: here, and elsewhere in the engine only where ``train`` stages
a URL ``--out``, where ``find_resume`` takes a DCP checkpoint's URL, and where the payload's
reader reads a DCP checkpoint's ``meta.pt`` at one.
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
from ckptkit.storage.location import Location, is_local, is_remote, location
from ckptkit.storage.remote_folder import RemoteFolder
from ckptkit.storage.upload import Uploads

__all__ = [
    "MIRROR_ENV",
    "staged_run",
    "push",
    "shown_path",
    "dcp_url",
    "dcp_complete",
    "complete_dcp_at",
    "dcp_storage",
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
    there = RemoteFolder(config.out)
    there.uploads()  # an HTTP URL is refused here, before anything
    stage = Path(os.environ.get("CKPTKIT_STAGING") or tempfile.gettempdir())
    folder = Path(tempfile.mkdtemp(prefix="ckptkit-run-", dir=stage))
    try:
        _check_fresh(there, config)
        _check_writable(there)
        config = replace(config, resume=_resume(there, config.resume, folder))
        if os.environ.get("RANK", "0") == "0":  # once: under torchrun every rank stages
            _remove_incomplete(there)
        previous = os.environ.get(MIRROR_ENV)
        os.environ[MIRROR_ENV] = there.url
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


def _check_fresh(there: RemoteFolder, config: Any) -> None:
    """As for a local --out: an earlier run's files there need --resume or --overwrite
    (which deletes them first)."""
    names = there.names()
    earlier = [n for n in names if n in (LATEST, BEST, *RUN_LOGS) or n.startswith("ckpt-")]
    if not earlier or config.resume is not None:
        return
    if not config.overwrite:
        raise UsageError(
            f"{there} holds an earlier run ({', '.join(sorted(earlier)[:3])})",
            "resume it with --resume auto, or replace it with --overwrite",
        )
    for name in earlier:
        there.remove(name)


def _check_writable(there: RemoteFolder) -> None:
    """Fail now, not after the first epoch: a small object written there and removed."""
    try:
        there.write_and_remove(f".ckptkit-probe-{os.getpid()}")
    except Exception as exc:  # the back-end's own (no bucket, no credentials): said
        raise UsageError(
            f"cannot write to --out {there}: {exc}", "check the bucket and the credentials"
        ) from None


def _remove_incomplete(there: RemoteFolder) -> None:
    """Remove the DCP saves at the URL that have no ``.metadata``: a killed run's, which no
    pointer names (DCP writes ``.metadata`` last, and ``latest`` moves after it)."""
    for name in there.names():
        match = CHECKPOINT_NAME.fullmatch(name)
        if match and not match.group(3) and not dcp_complete(there.child(name)):
            with contextlib.suppress(FileNotFoundError):
                there.remove(name)


def _resume(there: RemoteFolder, resume: str | None, folder: Path) -> str | None:
    """``--resume`` for the run in ``folder``: ``auto`` with what the URL's ``latest`` names
    pulled (or its URL, for a DCP checkpoint); a checkpoint URL likewise."""
    if resume == "auto":
        return _pull_latest(there, folder)
    if resume is not None and is_remote(resume):
        return _pull(RemoteFolder(resume), folder)
    return resume


def _pull(there: RemoteFolder, folder: Path) -> str:
    """A checkpoint at a URL to resume from: a file downloaded into ``folder`` (its path), or
    a DCP folder, read in place by every rank (its URL, once found complete)."""
    if there.is_folder():
        return str(complete_dcp_at(there.url))
    local = folder / there.location().name
    try:
        there.download(None, local)
    except FileNotFoundError:
        raise UsageError(f"cannot resume: {there} does not exist", "check --resume") from None
    return str(local)


def _pull_latest(there: RemoteFolder, folder: Path) -> str:
    """``--resume auto`` from the URL: its logs pulled, and the checkpoint its ``latest``
    names: a file downloaded with the pointer (``auto`` finds it here), or a DCP folder's URL
    (read in place by every rank)."""
    name = _resumable(there)
    if name is None:
        return "auto"  # nothing to resume: a fresh run, as locally
    for log in RUN_LOGS:  # the logs go on where they stopped (each rewound to the step)
        with contextlib.suppress(FileNotFoundError):
            if there.is_folder(log):  # TensorBoard's event folder
                there.download_folder(log, folder / log)
            else:
                there.download(log, folder / log)
    if "." not in name:  # a DCP checkpoint: a folder, read in place
        return there.child(name)
    for suffix in (".pt", ".safetensors"):
        remote = f"{name.rsplit('.', 1)[0]}{suffix}"
        if there.exists(remote):
            there.download(remote, folder / remote)
    (folder / LATEST).write_text(name + "\n")
    return "auto"


def _resumable(there: RemoteFolder) -> str | None:
    """What ``--resume auto`` takes at the URL, as locally: what ``latest`` names, unless that
    is a DCP save left incomplete (one of the same name cut short), else the newest complete
    checkpoint; None when there is none."""
    try:
        name = there.read(LATEST).decode().strip()
    except FileNotFoundError:
        return _newest_there(there)
    if "." not in name and not dcp_complete(there.child(name)):
        return _newest_there(there) or name  # none complete: the resume says this one is not
    return name


def dcp_url(name: str) -> str | None:
    """Where the DCP checkpoint ``name`` of a run mirrored to a URL is written: at the URL,
    by every rank. None for a local run."""
    url = _mirror_url()
    return f"{url.rstrip('/')}/{name}" if url else None


def dcp_complete(url: str) -> bool:
    """Whether the DCP checkpoint at ``url`` is complete: DCP writes its ``.metadata`` last."""
    return RemoteFolder(url).exists(".metadata", fresh=True)


def complete_dcp_at(url: str) -> Location:
    """The DCP checkpoint at ``url``, once its ``.metadata`` shows it complete.

    Raises:
        CkptkitError: it is missing or incomplete (a killed run's save, or no DCP folder).
    """
    if not dcp_complete(url):
        raise CkptkitError(
            f"cannot resume: {url} holds no complete DCP checkpoint (no .metadata)",
            "check --resume",
        )
    return location(url)


def dcp_storage(where: Location | str, *, writing: bool = False) -> dict[str, Any]:
    """``dcp.save``'s (``writing``) or ``dcp.load``'s arguments for a DCP checkpoint in a folder
    here, or at a URL: torch's ``FsspecWriter`` (which writes ``.metadata`` last, as a temp name
    renamed, once every rank's shards are written) or ``FsspecReader`` (nothing downloaded
    first). No fsync at a URL: an object is whole once uploaded, and DCP would sync the whole
    machine's disks for each (an fsspec file has no descriptor)."""
    if not is_remote(where):
        return {"checkpoint_id": Path(str(where))}
    if writing:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return {"storage_writer": FsspecWriter(str(where), sync_files=False)}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return {"storage_reader": FsspecReader(str(where))}


def _mirror_url() -> str | None:
    """The URL this run is mirrored to (``$CKPTKIT_OUT_URL``), if any."""
    url = os.environ.get(MIRROR_ENV)
    return url if url and is_remote(url) else None


def push(folder: Path, keep_last: int | None = None) -> None:
    """Mirror ``folder`` (a run's staging folder) to the URL in ``$CKPTKIT_OUT_URL``: new
    checkpoint files, then the logs, then the pointers, each visible only when whole; then, with
    ``keep_last``, the URL's older checkpoints pruned. No URL, or not rank 0: nothing. (DCP
    checkpoints are not here: every rank wrote its shards to the URL already.)"""
    url = _mirror_url()
    if not url or os.environ.get("RANK", "0") != "0":
        return  # no URL; or not rank 0 (under torchrun each rank stages: rank 0's is the run)
    target = RemoteFolder(url)
    uploads = target.uploads()
    there = set(target.names())
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
        _prune_there(uploads, target, keep_last)


def _when(match: re.Match[str]) -> tuple[int, int]:
    """A checkpoint name's place in the run: an epoch's end before the steps after it."""
    return int(match.group(1)), int(match.group(2)) if match.group(2) else -1


def _newest_there(there: RemoteFolder) -> str | None:
    """The newest complete checkpoint at the URL (a file, or a DCP folder with its
    ``.metadata``), for a run whose ``latest`` is missing; None when there is none."""
    found = [(m, n) for n in there.names() if (m := CHECKPOINT_NAME.fullmatch(n))]
    for _, name in sorted(found, key=lambda mn: _when(mn[0]), reverse=True):
        if "." in name or dcp_complete(there.child(name)):
            return name
    return None


def _prune_there(uploads: Uploads, there: RemoteFolder, keep_last: int) -> None:
    """``--keep-last`` applied to the URL's own checkpoints (a resumed run's older ones too, as
    a local run prunes its folder), never one that the URL's ``latest`` or ``best`` names."""
    names = there.names()
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


def shown_path(path: Location) -> str:
    """A path of the run folder as the user named it: at the URL, for a mirrored run (a
    checkpoint read at a URL, as it is)."""
    url = _mirror_url()
    return f"{url.rstrip('/')}/{path.name}" if url and is_local(path) else str(path)


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
