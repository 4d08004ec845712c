"""The checkpoint commit protocol: write a temp file, fsync, rename; then move the ``latest``
pointer atomically; then prune to the newest N. Killing the process at any moment leaves the
previous checkpoint complete and findable.

A DCP checkpoint (``--save-format dcp``) is a folder: every rank writes its own shards into a
temp folder with ``torch.distributed.checkpoint.save`` (``.metadata`` last), rank 0 adds
``meta.pt`` (the rest of the training state, as Lightning's FSDP strategy keeps it) and renames
the folder into place; then ``latest`` moves, then pruning, as for a file. In a run whose
``--out`` is a URL the shards go straight there (torch's ``FsspecWriter``), under the final name
(object storage renames no folder): ``meta.pt`` first, ``.metadata`` last, then ``latest``; a
save without ``.metadata`` is incomplete, and :mod:`ckptkit.engine.remote` removes it.

With a :class:`~ckptkit.engine.saver.BackgroundSaver` both kinds are written on a thread: the
state is first staged to CPU memory, and the same steps run once the bytes are written (a DCP
save through ``dcp.async_save`` on a process group of its own).

What a checkpoint holds, and how it is read back and put into a run, is
:mod:`ckptkit.engine.payload`'s."""

from __future__ import annotations

import contextlib
import hashlib
import io
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ckptkit.engine.distributed import quiet_single_process_dcp
from ckptkit.engine.payload import DIGEST, META, MODEL, TRAIN_STATE, load_payload
from ckptkit.engine.ptwriter import write_payload
from ckptkit.engine.remote import complete_dcp_at, dcp_storage, dcp_url, push
from ckptkit.engine.runlog import RUN_LOGS
from ckptkit.engine.saver import BackgroundSaver, Staging, dcp_stager, staged
from ckptkit.errors import CkptkitError, FormatError, OutputError, UsageError
from ckptkit.formats.base.tensors import as_bytes, dtype_name
from ckptkit.formats.folders.runs import BEST, CHECKPOINT_NAME, LATEST, list_checkpoints
from ckptkit.storage.atomic import atomic_folder, atomic_output
from ckptkit.storage.location import Location, is_remote
from ckptkit.storage.remote_folder import RemoteFolder
from ckptkit.storage.small import read_pointer

__all__ = [
    "checkpoint_name",
    "commit",
    "commit_dcp",
    "find_resume",
    "list_checkpoints",
    "weights_sha256",
    "LATEST",
]


def checkpoint_name(epoch: int, suffix: str = "pt", *, step: int | None = None) -> str:
    """``ckpt-epoch0003.pt`` after 3 epochs, ``ckpt-epoch0003-step00000070.pt`` at step 70
    during the 4th; a DCP checkpoint (``suffix`` ``dcp``) is a folder of that name."""
    stem = f"ckpt-epoch{epoch:04d}" + (f"-step{step:08d}" if step is not None else "")
    return stem + ("" if suffix == "dcp" else f".{suffix}")


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """A digest of the weights: keys, dtypes, shapes and bytes, in key order."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{dtype_name(tensor.dtype)}|{list(tensor.shape)}|".encode())
        digest.update(as_bytes(tensor))
    return digest.hexdigest()


def earlier_run(folder: Path) -> list[Path]:
    """What an earlier run left in ``folder``: its checkpoints, pointers and logs."""
    if not folder.is_dir():
        return []
    names = (LATEST, BEST, *RUN_LOGS)
    return sorted(
        p for p in folder.iterdir() if CHECKPOINT_NAME.fullmatch(p.name) or p.name in names
    )


def check_fresh(folder: Path, *, resume: str | None, overwrite: bool) -> None:
    """A run never silently restarts over another: without ``--resume`` an ``--out`` holding a
    run is refused, or with ``--overwrite`` its checkpoints and logs are deleted first.

    Raises:
        UsageError: ``folder`` holds a run, and neither option says what to do with it.
    """
    found = earlier_run(folder) if resume is None else []
    if found and not overwrite:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise UsageError(
            f"--out {folder} holds an earlier run ({names})",
            "resume it with --resume auto (or --resume PATH), or pass --overwrite to delete "
            "its checkpoints and logs and start afresh",
        )
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def commit(
    folder: Path,
    epoch: int,
    payload: dict[str, Any],
    *,
    keep_last: int,
    formats: tuple[str, ...] = ("pt",),
    step: int | None = None,
    best: bool = False,
) -> Path:
    """Write one checkpoint by the commit protocol and return its path (the ``.pt`` if any).

    ``pt`` is the whole training state; ``safetensors`` the weights, with the run's metadata in
    the header. Every file is complete before the ``latest`` pointer (and with ``best`` the
    ``best`` one) moves.
    """
    remove_stale(folder)
    written = []
    for suffix in formats:
        path = folder / checkpoint_name(epoch, suffix, step=step)
        with atomic_output(path, force=True) as tmp:
            if suffix == "pt":  # the weights hashed as they are written (ptwriter)
                write_payload(tmp, payload, weights=MODEL, meta=META, digest_key=DIGEST)
            else:
                meta = payload.setdefault(META, {})
                if DIGEST in meta and meta[DIGEST] is None:  # no .pt wrote it: hash here
                    meta[DIGEST] = weights_sha256(payload[MODEL])
                _write_weights(tmp, payload)
        written.append(path)
    _publish(folder, written[0], keep_last=keep_last, best=best)
    return written[0]


def remove_stale(folder: Path) -> None:
    """Remove the temp files and folders a run killed mid-save left in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".ckpt-epoch*.tmp"):  # left by a run killed mid-save
        with contextlib.suppress(OSError):
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()


def _publish(folder: Path, path: Path, *, keep_last: int, best: bool) -> None:
    """A complete checkpoint becomes ``latest`` (and ``best``), then the old ones go."""
    point(folder, LATEST, path)
    if best:
        point(folder, BEST, path)
    _prune(folder, keep_last, keep=path)


def point(folder: Path, pointer: str, path: Path) -> None:
    """Make ``folder/pointer`` (``latest``, ``best``) name ``path``, atomically."""
    with atomic_output(folder / pointer, force=True) as tmp:
        tmp.write_text(path.name + "\n")


def commit_dcp(
    folder: Path,
    epoch: int,
    shards: dict[str, Any],
    train_state: dict[str, Any],
    *,
    is_main: bool,
    share: Callable[[str | None], str],
    keep_last: int,
    step: int | None = None,
    best: bool = False,
    saver: BackgroundSaver | None = None,
    staging: Staging | None = None,
    group: Any = None,
) -> Path:
    """Write one DCP checkpoint by the commit protocol; every rank calls it.

    Args:
        shards: what ``dcp.save`` writes, each rank its own shards (``model``, ``optim``).
        train_state: the rest, written by rank 0 as ``meta.pt`` (plain values and tensors).
        is_main: this is rank 0, which makes the temp folder, renames it and moves ``latest``.
        share: gives every rank rank 0's value (where the shards go).
        saver: write in the background: ``dcp.async_save`` stages the shards to CPU memory and
            writes them on a thread; rank 0's saver commits once every rank's part is written
            (DCP gathers the ranks' results before it writes ``.metadata``).
        staging: where a background save stages the shards (its copies kept between saves).
        group: the process group of background saves (not the one training runs on).
    """
    import torch.distributed.checkpoint as dcp

    quiet_single_process_dcp()
    final = folder / checkpoint_name(epoch, "dcp", step=step)
    url = dcp_url(final.name)  # --out URL: the shards go there, none staged here
    if saver is not None:
        saver.wait()  # one save in flight, on every rank

    def write(target: str) -> Callable[[], Any]:
        """Start this rank's part; returns what waits for it."""
        where = dcp_storage(target, writing=True)
        if saver is None:  # collective; rank 0 writes .metadata last
            dcp.save(shards, **where)
            return lambda: None
        future = dcp.async_save(
            shards, **where, process_group=group, async_stager=dcp_stager(staging or Staging())
        )
        assert isinstance(future, Future)  # the thread executor's (a process one answers else)
        return future.result

    if not is_main:
        written = write(share(None))  # rank 0's temp folder, or the URL once rank 0 cleared it
        if saver is not None:
            saver.submit(written)
        return final
    if url is not None:
        complete = _start_in_place(url, train_state, share, write)
    else:  # written later, from copies, in the background
        state = train_state if saver is None else staged(train_state)
        complete = _start_in_folder(final, state, share, write)

    def finish() -> None:
        complete()
        _publish(folder, final, keep_last=keep_last, best=best)
        push(folder, keep_last=keep_last)  # --out URL: the logs, then latest, then pruning

    if saver is None:
        finish()
    else:
        saver.submit(finish)
    return final


def _start_in_folder(
    final: Path,
    train_state: dict[str, Any],
    share: Callable[[str | None], str],
    write: Callable[[str], Callable[[], Any]],
) -> Callable[[], None]:
    """Rank 0's part of a DCP save here: a temp folder beside the checkpoint, renamed into
    place (replacing the same epoch saved by an earlier, resumed run) once the shards and
    ``meta.pt`` are in it; a killed run's is removed by the next save. Returns what completes
    it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(atomic_folder(final, force=True))
        share(str(tmp))
        written = write(str(tmp))
        pending = stack.pop_all()  # the folder is committed once its shards are written

    def complete() -> None:
        with pending:  # renamed on success, removed on failure
            written()
            with atomic_output(tmp / TRAIN_STATE, force=True) as part:
                _torch_save(train_state, part)

    return complete


def _start_in_place(
    url: str,
    train_state: dict[str, Any],
    share: Callable[[str | None], str],
    write: Callable[[str], Callable[[], Any]],
) -> Callable[[], Any]:
    """Rank 0's part of a DCP save at a URL, under its final name (no folder is renamed on
    object storage): what an earlier run left under that name removed, then ``meta.pt``
    written, then the shards, ``.metadata`` last. Returns what completes it."""
    there = RemoteFolder(url)
    buffer = io.BytesIO()
    torch.save(train_state, buffer)
    try:
        there.clear()
        there.write(TRAIN_STATE, buffer.getvalue())
    except OSError as exc:  # the back-end's own (denied, unreachable): said in one line
        raise OutputError(
            f"cannot write {url}: {exc}", "check the bucket and the credentials"
        ) from None
    share(url)  # the other ranks write once it is cleared
    return write(url)


class _RecordingFile(io.BufferedWriter):
    """A file whose write errors are kept: torch.save turns them into a bare RuntimeError."""

    error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            self.error = exc
            raise


def _torch_save(payload: Any, path: Path) -> None:
    with _RecordingFile(io.FileIO(path, "wb")) as target:
        try:
            torch.save(payload, target)
        except RuntimeError:
            if target.error is not None:
                raise target.error from None  # ENOSPC, EFBIG...: atomic_output names the file
            raise


def _write_weights(path: Path, payload: dict[str, Any]) -> None:
    from ckptkit.formats.files.safetensors import write_tensors
    from ckptkit.meta import CheckpointMeta

    meta = payload.get(META, {})
    header = CheckpointMeta(training=meta, removed_prefixes=meta.get("removed_prefixes", []))
    state = {k: v.detach().to("cpu") for k, v in payload[MODEL].items()}
    write_tensors(path, state, header.to_header())


def _prune(folder: Path, keep_last: int, *, keep: Path) -> None:
    if keep_last <= 0:
        return
    best = folder / BEST
    kept = {keep.name, read_pointer(best) if best.is_file() else ""}
    for old in list_checkpoints(folder)[:-keep_last]:
        if old.name in kept:  # the best one stays, whatever its age
            continue
        if old != keep:
            stem = folder / old.stem  # ckpt-epoch0002: the folder, and the files' stem
            for victim in (stem.with_suffix(".pt"), stem.with_suffix(".safetensors")):
                with contextlib.suppress(FileNotFoundError):
                    victim.unlink()
            if stem.is_dir():
                shutil.rmtree(stem, ignore_errors=True)


def find_resume(resume: str | None, folder: Path) -> Location | None:
    """The checkpoint to resume from: an explicit path (a DCP checkpoint's URL, read in place),
    or with ``auto`` the one ``latest`` names if it loads, else the newest complete checkpoint
    in ``folder``, else None."""
    if resume is None:
        return None
    if is_remote(resume):  # a DCP checkpoint at a URL, read in place
        return complete_dcp_at(resume)
    if resume != "auto":
        path = Path(resume)
        if not path.is_file() and not (path / ".metadata").is_file():
            raise CkptkitError(f"cannot resume: {path} does not exist", "check --resume")
        return path
    candidates = list_checkpoints(folder)[::-1]
    pointer = folder / LATEST
    if pointer.is_file():
        named = folder / read_pointer(pointer)
        candidates = [named] + [c for c in candidates if c != named]
    problems = []
    for candidate in candidates:
        if candidate.exists():
            try:
                load_payload(candidate, mmap=True)  # a check: the data need not be read
                return candidate
            except FormatError as exc:  # torn or foreign: try the next older one
                problems.append(str(exc))
    if problems:
        raise CkptkitError(
            f"no checkpoint in {folder} can be resumed: {problems[0]}",
            "resume from a path, or start in an empty --out",
        )
    return None
