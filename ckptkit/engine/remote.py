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
and resumes from it. DCP checkpoints (folders every rank writes into) are mirrored file by file,
``.metadata`` last; on several nodes, where each node stages its own shards, they are refused.
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

from ckptkit.engine.checkpoint import RUN_LOGS
from ckptkit.errors import UsageError
from ckptkit.formats.folders.runs import BEST, CHECKPOINT_NAME, LATEST, list_checkpoints
from ckptkit.formats.io.remote import RemotePath, filesystem, is_url
from ckptkit.formats.io.upload import Uploads

__all__ = ["MIRROR_ENV", "staged_run", "push", "shown_path"]

# Set for the workers: the URL their (local) --out is mirrored to.
MIRROR_ENV = "CKPTKIT_OUT_URL"


@contextlib.contextmanager
def staged_run(config: Any) -> Iterator[Any]:
    """The config with ``out`` a local staging folder mirrored to the URL ``config.out``; the
    URL's run checked (fresh, or resumed from its ``latest``, downloaded here first).

    Raises:
        UsageError: DCP checkpoints on several nodes, or a URL run that is not fresh without
            --resume or --overwrite.
    """
    url = RemotePath(config.out)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if config.save_format == "dcp" and int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:
        raise UsageError(
            f"--save-format dcp on several nodes writes each node's shards to its own staging "
            f"folder, which ckptkit does not gather to {url}",
            "save pt or safetensors checkpoints to a URL, or a dcp run to a shared --out",
        )
    Uploads(url, force=True)  # an HTTP URL is refused here, before anything
    fs, root = filesystem(str(url))
    stage = Path(os.environ.get("CKPTKIT_STAGING") or tempfile.gettempdir())
    folder = Path(tempfile.mkdtemp(prefix="ckptkit-run-", dir=stage))
    try:
        _check_fresh(fs, root, url, config)
        _check_writable(fs, root, url)
        if config.resume == "auto":
            _pull_latest(fs, root, folder)
        elif config.resume is not None and is_url(config.resume):  # a checkpoint at a URL
            config = replace(config, resume=str(_pull(RemotePath(config.resume), folder)))
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


def _check_fresh(fs: Any, root: str, url: RemotePath, config: Any) -> None:
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
        fs.rm(f"{root.rstrip('/')}/{name}", recursive=True)


def _check_writable(fs: Any, root: str, url: RemotePath) -> None:
    """Fail now, not after the first epoch: a small object written there and removed."""
    probe = f"{root.rstrip('/')}/.ckptkit-probe-{os.getpid()}"
    try:
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as exc:  # the back-end's own (no bucket, no credentials): said
        raise UsageError(
            f"cannot write to --out {url}: {exc}", "check the bucket and the credentials"
        ) from None


def _pull(url: RemotePath, folder: Path) -> Path:
    """A checkpoint at a URL (a file, or a DCP folder) downloaded into ``folder``."""
    fs, path = filesystem(str(url))
    local = folder / url.name
    try:
        if fs.isdir(path):
            fs.get(path.rstrip("/") + "/", str(local) + "/", recursive=True)
        else:
            fs.get_file(path, str(local))
    except FileNotFoundError:
        raise UsageError(f"cannot resume: {url} does not exist", "check --resume") from None
    return local


def _pull_latest(fs: Any, root: str, folder: Path) -> None:
    """The checkpoint the URL's ``latest`` names, and the pointer, into ``folder``."""
    base = root.rstrip("/")
    try:
        name = fs.cat_file(f"{base}/{LATEST}").decode().strip()
    except FileNotFoundError:
        return  # nothing to resume: a fresh run, as locally
    if "." not in name:  # a DCP checkpoint: a folder
        fs.get(f"{base}/{name}/", str(folder / name) + "/", recursive=True)
    for suffix in (".pt", ".safetensors") if "." in name else ():
        remote = f"{base}/{name.rsplit('.', 1)[0]}{suffix}"
        if fs.exists(remote):
            fs.get_file(remote, str(folder / Path(remote).name))
    (folder / LATEST).write_text(name + "\n")
    for log in RUN_LOGS:  # the logs go on where they stopped (each rewound to the step)
        with contextlib.suppress(FileNotFoundError):
            if fs.isdir(f"{base}/{log}"):  # TensorBoard's event folder
                fs.get(f"{base}/{log}/", str(folder / log) + "/", recursive=True)
            else:
                fs.get_file(f"{base}/{log}", str(folder / log))


def push(folder: Path, keep_last: int | None = None) -> None:
    """Mirror ``folder`` (a run's staging folder) to the URL in ``$CKPTKIT_OUT_URL``: new
    checkpoint files, then the logs, then the pointers, each visible only when whole; then, with
    ``keep_last``, the URL's older checkpoints pruned. No URL, or not rank 0: nothing."""
    url = os.environ.get(MIRROR_ENV)
    if not url or not is_url(url) or os.environ.get("RANK", "0") != "0":
        return  # no URL; or not rank 0 (under torchrun each rank stages: rank 0's is the run)
    target = RemotePath(url)
    uploads = Uploads(target, force=True)
    there = set(target.names() or [])
    checkpoints = list_checkpoints(folder)
    with uploads:
        for checkpoint in checkpoints:  # checkpoints are written once: only new ones go up
            for path in _files_of(checkpoint):
                top = path.relative_to(folder).parts[0]  # the file, or the DCP folder
                if top not in there:
                    _stage_copy_and_add(uploads, path, path.relative_to(folder).as_posix())
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
        _prune_there(uploads, folder, keep_last)


def _prune_there(uploads: Uploads, folder: Path, keep_last: int) -> None:
    """``--keep-last`` applied to the URL's own checkpoints (a resumed run's older ones too, as
    a local run prunes its folder), never one that the URL's ``latest`` or ``best`` names."""
    there = uploads.folder.names() or []
    kept = set()
    for pointer in (LATEST, BEST):
        with contextlib.suppress(FileNotFoundError):
            kept.add(uploads.fs.cat_file(uploads.url(pointer)).decode().strip())
    found = [(m, n) for n in there if (m := CHECKPOINT_NAME.fullmatch(n))]

    def at(m: re.Match[str]) -> tuple[int, int]:  # an epoch's end before the steps after it
        return int(m.group(1)), int(m.group(2)) if m.group(2) else -1

    old = set(sorted({at(m) for m, _ in found})[:-keep_last])
    for m, name in found:
        stem = name.split(".", 1)[0]
        if at(m) in old and not {stem, stem + ".pt", stem + ".safetensors"} & kept:
            with contextlib.suppress(FileNotFoundError):
                uploads.fs.rm(uploads.url(name), recursive=True)


def shown_path(path: Path) -> str:
    """A path of the run folder as the user named it: at the URL, for a mirrored run."""
    url = os.environ.get(MIRROR_ENV)
    return f"{url.rstrip('/')}/{path.name}" if url and is_url(url) else str(path)


def _files_of(checkpoint: Path) -> list[Path]:
    """A checkpoint's files: its ``.pt`` and ``.safetensors``, or a DCP folder's files with
    ``.metadata`` last (a reader finds the save by it)."""
    if checkpoint.is_dir():
        inside = sorted(p for p in checkpoint.rglob("*") if p.is_file())
        return sorted(inside, key=lambda p: p.name == ".metadata")
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
