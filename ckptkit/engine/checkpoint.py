"""The checkpoint commit protocol: write a temp file, fsync, rename; then move the ``latest``
pointer atomically; then prune to the newest N. Killing the process at any moment leaves the
previous checkpoint complete and findable."""

from __future__ import annotations

import contextlib
import hashlib
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckptkit.errors import CkptkitError, FormatError
from ckptkit.formats.atomic import atomic_output
from ckptkit.formats.tensors import as_bytes, dtype_name

__all__ = [
    "checkpoint_name",
    "commit",
    "find_resume",
    "list_checkpoints",
    "weights_sha256",
    "LATEST",
]

LATEST = "latest"
_NAME = re.compile(r"ckpt-epoch(\d{4,})\.(pt|safetensors)")


def checkpoint_name(epoch: int, suffix: str = "pt") -> str:
    return f"ckpt-epoch{epoch:04d}.{suffix}"


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """A digest of the weights: keys, dtypes, shapes and bytes, in key order."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{dtype_name(tensor.dtype)}|{list(tensor.shape)}|".encode())
        digest.update(as_bytes(tensor))
    return digest.hexdigest()


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first, one per epoch (the ``.pt`` when both
    formats were saved). Temp files are never listed."""
    by_epoch: dict[int, Path] = {}
    for path in folder.glob("ckpt-epoch*"):
        if m := _NAME.fullmatch(path.name):
            epoch = int(m.group(1))
            if epoch not in by_epoch or path.suffix == ".pt":
                by_epoch[epoch] = path
    return [by_epoch[e] for e in sorted(by_epoch)]


def commit(
    folder: Path,
    epoch: int,
    payload: dict[str, Any],
    *,
    keep_last: int,
    formats: tuple[str, ...] = ("pt",),
) -> Path:
    """Write one checkpoint by the commit protocol and return its path (the ``.pt`` if any).

    ``pt`` is the whole training state; ``safetensors`` the weights, with the run's metadata in
    the header. Every file is complete before the ``latest`` pointer moves.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".ckpt-epoch*.tmp"):  # left by a run killed mid-save
        with contextlib.suppress(OSError):
            stale.unlink()
    written = []
    for suffix in formats:
        path = folder / checkpoint_name(epoch, suffix)
        with atomic_output(path, force=True) as tmp:
            if suffix == "pt":
                _torch_save(payload, tmp)
            else:
                _write_weights(tmp, payload)
        written.append(path)
    with atomic_output(folder / LATEST, force=True) as tmp:
        tmp.write_text(written[0].name + "\n")
    _prune(folder, keep_last, keep=written[0])
    return written[0]


class _RecordingFile:
    """A file whose write errors are kept: torch.save turns them into a bare RuntimeError."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def _torch_save(payload: Any, path: Path) -> None:
    with open(path, "wb") as raw:
        target = _RecordingFile(raw)
        try:
            torch.save(payload, target)  # type: ignore[arg-type]  # any object with .write
        except RuntimeError:
            if target.error is not None:
                raise target.error from None  # ENOSPC, EFBIG...: atomic_output names the file
            raise


def _write_weights(path: Path, payload: dict[str, Any]) -> None:
    from ckptkit.formats.safetensors import write_tensors
    from ckptkit.meta import CheckpointMeta

    meta = payload.get("ckptkit", {})
    header = CheckpointMeta(training=meta, removed_prefixes=meta.get("removed_prefixes", []))
    state = {k: v.detach().to("cpu") for k, v in payload["model"].items()}
    write_tensors(path, state, header.to_header())


def _prune(folder: Path, keep_last: int, *, keep: Path) -> None:
    if keep_last <= 0:
        return
    for old in list_checkpoints(folder)[:-keep_last]:
        if old != keep:
            for victim in (old.with_suffix(".pt"), old.with_suffix(".safetensors")):
                with contextlib.suppress(FileNotFoundError):
                    victim.unlink()


def find_resume(resume: str | None, folder: Path) -> Path | None:
    """The checkpoint to resume from: an explicit path, or with ``auto`` the one ``latest``
    names if it loads, else the newest complete checkpoint in ``folder``, else None."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_file():
            raise CkptkitError(f"cannot resume: {path} does not exist", "check --resume")
        return path
    candidates = list_checkpoints(folder)[::-1]
    pointer = folder / LATEST
    if pointer.is_file():
        named = folder / pointer.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    problems = []
    for candidate in candidates:
        if candidate.is_file():
            try:
                load_payload(candidate, mmap=True)  # a check: the data need not be read
                return candidate
            except FormatError as exc:  # torn or foreign: try the next older one
                problems.append(str(exc))
    if problems:
        raise CkptkitError(f"no checkpoint in {folder} can be resumed: {problems[0]}",
                           "resume from a path, or start in an empty --out")  # fmt: skip
    return None


def load_payload(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's contents, read safely (weights_only) onto the CPU. A safetensors file
    gives its weights and the epoch counters its header recorded. ``mmap`` maps a zip file's
    tensors instead of reading them."""
    if path.suffix == ".safetensors":
        return _load_weights(path)
    try:
        mapped = mmap and zipfile.is_zipfile(path)
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as exc:
        raise FormatError(
            f"cannot resume from {path}: {exc}".splitlines()[0],
            "check the file with `ckptkit inspect`",
        ) from None
    if (
        isinstance(payload, Mapping)
        and "model" not in payload
        and all(torch.is_tensor(v) for v in payload.values())
    ):
        payload = {"model": payload}  # a bare state dict resumes the weights only
    if not isinstance(payload, Mapping) or "model" not in payload:
        raise FormatError(f"{path} holds no 'model' state dict to resume from")
    return dict(payload)


def _load_weights(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    from ckptkit.meta import CheckpointMeta

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {key: f.get_tensor(key) for key in f.keys()}
            training = CheckpointMeta.from_header(f.metadata() or {}).training
    except Exception as exc:
        raise FormatError(f"cannot resume from {path}: {exc}") from None
    counters = {
        "epoch": training.get("epoch", 0),
        "step": training.get("step", 0),
        "samples_seen": training.get("samples", 0),
    }
    return {"model": state, **counters}
