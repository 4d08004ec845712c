"""A training checkpoint's ``.pt``, written in torch's zip layout by ckptkit: the storage
records first, the model's hashed as their bytes go out, then ``data.pkl`` with the digest in
the metadata. ``torch.save`` writes the pickle first, so the digest would need a second pass
over the weights before it (a second and more on a large model, while the other ranks wait).

``torch.load`` (and ckptkit's readers) find records by name, so their order is free. The
payload holds what a training checkpoint holds: dicts, lists, tuples, plain values and CPU
tensors (views of a shared storage stay views, so ties survive).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckptkit.formats.base.tensors import as_bytes, dtype_name
from ckptkit.formats.base.tree import map_leaves
from ckptkit.formats.files.torchzip import ArchiveWriter, StorageRecord, tensor_record
from ckptkit.formats.pickles.writer import dumps
from ckptkit.storage.bytecopy import write_all

__all__ = ["write_payload"]

_CHUNK = 4 << 20


class _Storages:
    """The payload's storages, each a record once, keyed by the memory they occupy."""

    def __init__(self) -> None:
        self.records: dict[tuple[int, int], tuple[StorageRecord, torch.Tensor]] = {}

    def record(self, tensor: torch.Tensor) -> tuple[StorageRecord, torch.Tensor]:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise ValueError(f"cannot write a {tensor.device.type} {tensor.layout} tensor")
        storage = tensor.untyped_storage()
        where = (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else (id(tensor), 0)
        if where not in self.records:
            # The whole storage as bytes (a view of it pickles with its offset and strides).
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
            record = StorageRecord(str(len(self.records)), dtype_name(tensor.dtype), raw.numel())
            self.records[where] = (record, raw)
        return self.records[where]


def _tree(value: Any, storages: _Storages) -> Any:
    """The payload with each tensor replaced by its pickle record."""

    def record(tensor: torch.Tensor) -> Any:
        stored, _ = storages.record(tensor)
        return tensor_record(
            stored,
            dtype_name(tensor.dtype),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
        )

    return map_leaves(value, torch.is_tensor, record)


def write_payload(
    path: Path, payload: dict[str, Any], *, weights: str, meta: str, digest_key: str
) -> str:
    """Write ``payload`` to ``path`` as ``torch.save`` would lay it out, hashing
    ``payload[weights]`` while its storages are written (as ``weights_sha256`` hashes:
    keys in order, each with its dtype and shape) and setting ``payload[meta][digest_key]``
    before the pickle goes out. Returns the digest."""
    storages = _Storages()
    state: Mapping[str, torch.Tensor] = payload[weights]
    # The model's storages first, in key order: each one's bytes hashed as they are written.
    for key in sorted(state):
        storages.record(state[key])
    tree = _tree(payload, storages)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        fd = f.fileno()
        archive = ArchiveWriter(fd)
        done: set[str] = set()
        for key in sorted(state):
            tensor = state[key]
            digest.update(f"{key}|{dtype_name(tensor.dtype)}|{list(tensor.shape)}|".encode())
            record, raw = storages.record(tensor)
            first = record.key not in done
            whole = (
                tensor.is_contiguous()
                and tensor.storage_offset() == 0
                and (tensor.numel() * tensor.element_size() == record.nbytes)
            )
            if first:
                _write(archive, fd, record, raw, digest if whole else None)
                done.add(record.key)
            if not (first and whole):  # a view, or a tie: its own bytes, from memory
                digest.update(as_bytes(tensor.contiguous()))
        for record, raw in storages.records.values():
            if record.key not in done:
                _write(archive, fd, record, raw, None)
                done.add(record.key)
        hexdigest = digest.hexdigest()
        payload[meta][digest_key] = hexdigest
        tree[meta][digest_key] = hexdigest
        for name, data in (
            ("data.pkl", dumps(tree)),
            (".format_version", b"1"),
            (".storage_alignment", b"64"),
            ("byteorder", b"little"),
        ):
            archive.add(name, data)
        archive.finish()
        f.flush()
        os.fsync(fd)
    return hexdigest


def _write(
    archive: ArchiveWriter, fd: int, record: StorageRecord, raw: torch.Tensor, digest: Any
) -> None:
    data = as_bytes(raw)

    def write() -> None:
        for start in range(0, len(data), _CHUNK):
            chunk = data[start : start + _CHUNK]
            if digest is not None:
                digest.update(chunk)
            write_all(fd, chunk)

    archive.add_stream(f"data/{record.key}", len(data), write)
