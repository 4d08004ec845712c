"""``torch.distributed.checkpoint`` (DCP) folders, read without loading them.

``dcp.save`` writes ``.metadata`` (a pickle of DCP's dataclasses: every flattened key with its
dtype, full shape and chunks, and where each chunk lies: file, offset, length) and one
``__<rank>_<n>.distcp`` file per writer, in which each tensor chunk is a small ``torch.save``
archive and each other value a ``torch.save``'d object. Everything here is read statically: the
metadata classes are admitted by name and never imported; each chunk's own archive is read like
any torch file, which gives where its bytes lie.

A chunk that is one contiguous byte range of the full tensor (a row shard: FSDP's, nearly always)
is copied as it lies; chunks of any other layout are assembled through torch, one tensor at a
time. Chunks that leave a gap or overlap are refused, naming the file and the key.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, UnsafeCheckpointError
from ckptkit.formats.bytecopy import RangeReader
from ckptkit.formats.dtypes import DTYPES
from ckptkit.formats.pickle_scan import scan_pickle
from ckptkit.formats.pickle_vm import Global, Opaque
from ckptkit.formats.source import Source, TensorInfo
from ckptkit.formats.static_unpickler import DATA_GLOBALS, TensorStub
from ckptkit.formats.torch_safe_globals import safe_globals
from ckptkit.formats.tree import nodes, select_state_dict
from ckptkit.meta import jsonable

if TYPE_CHECKING:
    import torch

__all__ = ["DCPSource", "DCP_GLOBALS", "METADATA", "DISTCP", "SIDECAR", "dcp_metadata"]

METADATA = ".metadata"
DISTCP = "__0_0.distcp"  # the one data file ckptkit writes: rank 0's first, as dcp.save names it
SIDECAR = "ckptkit.json"  # the conversion's metadata beside a DCP folder ckptkit wrote
LIGHTNING_META = "meta.pt"  # Lightning's FSDP strategy saves the trainer's state beside DCP
_DCP = "torch.distributed.checkpoint."
# DCP's own classes in .metadata: dataclasses of plain values, read as data, never imported.
DCP_GLOBALS = frozenset(
    {
        _DCP + "metadata.Metadata",
        _DCP + "metadata.TensorStorageMetadata",
        _DCP + "metadata.BytesStorageMetadata",
        _DCP + "metadata.TensorProperties",
        _DCP + "metadata.ChunkStorageMetadata",
        _DCP + "metadata.MetadataIndex",
        _DCP + "metadata.StorageMeta",
        _DCP + "metadata._MEM_FORMAT_ENCODING",
        _DCP + "filesystem._StorageInfo",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
    }
)

Piece = tuple[Path, int, int]


def _fields(value: Any) -> dict[str, Any]:
    """A dataclass record's fields, as BUILD gave them."""
    return value.to_dict() if isinstance(value, Opaque) else {}


@dataclass(frozen=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    start: int  # where its torch.save archive lies in the file
    length: int


@dataclass
class _Tensor:
    """A tensor of the checkpoint: its full shape and dtype, and the chunks that hold it."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[_Chunk]

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].itemsize * math.prod(self.shape)


class _Slice(io.RawIOBase):
    """A byte range of an open file, as a file of its own (a chunk's archive, for zipfile)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, count, self.start + self.pos)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def read_metadata(path: Path) -> dict[str, Any]:
    """``.metadata``'s fields, read statically.

    Raises:
        UnsafeCheckpointError: it names globals beyond torch's safe set and DCP's classes.
        FormatError: it is damaged or not DCP metadata.
    """
    findings = scan_pickle(path.read_bytes(), METADATA)
    allowed = safe_globals() | DATA_GLOBALS | DCP_GLOBALS
    unsafe = [g for g in findings.globals if g not in allowed]
    if unsafe or findings.problems:
        what = ", ".join(unsafe) or findings.problems[0]
        raise UnsafeCheckpointError(
            f"{path} is not plain DCP metadata: {what}",
            "see 'ckptkit scan'; only a folder you trust can be loaded, with torch itself",
        )
    root = findings.scan.root
    if (
        findings.damaged
        or not isinstance(root, Opaque)
        or not root.global_name.endswith("metadata.Metadata")
    ):
        raise FormatError(f"{path} is damaged or not DCP metadata", "copy the folder again")
    return _fields(root)


class DCPSource(Source):
    """A DCP checkpoint folder: the flattened state unflattened into a training checkpoint's
    tree, its state dict found in it as in a ``.pt`` file (``model`` by default)."""

    def __init__(self, folder: Path, *, select: str | None = None, ema: bool = False) -> None:
        super().__init__(path=folder, format="dcp")
        meta = read_metadata(folder / METADATA)
        self._reader = RangeReader()
        self._layouts: dict[_Chunk, Piece] = {}
        try:
            tree = self._tree(folder, meta)
            sel = select_state_dict(
                tree, lambda v: isinstance(v, _Tensor), lambda v: v.nbytes, select=select,
                ema=ema, source=str(folder),
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        self._tensors: dict[str, _Tensor] = dict(self.adopt(sel))
        self.extras.update(_trainer_state(folder / LIGHTNING_META))
        self.metadata = _sidecar(folder / SIDECAR)

    def _tree(self, folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
        items = meta.get("state_dict_metadata")
        storage = meta.get("storage_data")
        paths = meta.get("planner_data") or {}
        if not isinstance(items, dict) or not isinstance(storage, dict):
            raise FormatError(f"{folder / METADATA} lists no items", "copy the folder again")
        where: dict[tuple[str, Any], Piece] = {}
        for index, info in storage.items():
            key, place = _fields(index), _fields(info)
            if place.get("transform_descriptors"):
                raise FormatError(
                    f"{folder} stores '{key.get('fqn')}' transformed "
                    f"({place['transform_descriptors']}), which ckptkit does not read",
                    "load it with torch.distributed.checkpoint and save it plainly",
                )
            name = place.get("relative_path")
            if not isinstance(name, str) or Path(name).name != name:
                raise FormatError(f"{folder / METADATA} names a file outside the folder: {name!r}")
            offset = key.get("offset")
            where[(str(key.get("fqn")), tuple(offset) if offset is not None else None)] = (
                folder / name,
                int(place.get("offset", 0)),
                int(place.get("length", 0)),
            )
        tree: dict[str, Any] = {}
        for fqn, item in items.items():
            value = self._item(folder, str(fqn), item, where)
            path = paths.get(fqn) or (fqn,)
            node = tree
            for part in path[:-1]:
                node = node.setdefault(str(part), {})
            node[str(path[-1])] = value
        return tree

    def _item(self, folder: Path, fqn: str, item: Any, where: dict[Any, Piece]) -> Any:
        fields = _fields(item)
        if isinstance(item, Opaque) and item.global_name.endswith("BytesStorageMetadata"):
            if (fqn, None) not in where:
                raise FormatError(f"{folder} has no stored value for '{fqn}'", "copy it again")
            return self._object(*where[(fqn, None)], fqn)
        props = fields.get("properties")
        state = props.state if isinstance(props, Opaque) else None
        dtype_global = state[0] if isinstance(state, tuple) and state else None
        dtype = dtype_global.name.removeprefix("torch.") if isinstance(dtype_global, Global) else ""
        shape = fields.get("size")
        if dtype not in DTYPES or not isinstance(shape, tuple):
            raise FormatError(f"{folder / METADATA} describes '{fqn}' in a way ckptkit cannot read")
        chunks = []
        for chunk in fields.get("chunks") or ():
            c = _fields(chunk)
            offsets, sizes = tuple(c.get("offsets") or ()), tuple(c.get("sizes") or ())
            if (fqn, offsets) not in where:
                raise FormatError(
                    f"{folder} has no data for '{fqn}' at offset {list(offsets)}",
                    "a rank's .distcp file is missing or the folder mixes two saves",
                )
            chunks.append(_Chunk(offsets, sizes, *where[(fqn, offsets)]))
        tensor = _Tensor(fqn, dtype, tuple(shape), chunks)
        _check_cover(folder, tensor)
        return tensor

    def _fd(self, path: Path) -> int:
        if not path.is_file():
            raise FormatError(f"{path} is missing", "copy every rank's .distcp file there")
        return self._reader.fd(path)

    def _archive(self, path: Path, start: int, length: int, what: str) -> tuple[Any, Any]:
        """A chunk's (or value's) torch.save archive: its statically read root and layout."""
        from ckptkit.formats.torchfile import _ZipLayout

        size = path.stat().st_size if path.is_file() else -1
        if start < 0 or length <= 0 or start + length > size:
            self._fd(path)  # a missing file says so
            raise FormatError(f"{path} is truncated: '{what}' lies past its end", "copy it again")
        part = _Slice(self._fd(path), start, length)
        try:
            with zipfile.ZipFile(part) as zf:
                name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
                data = zf.read(name)
        except (zipfile.BadZipFile, StopIteration, OSError, EOFError, ValueError) as exc:
            raise FormatError(f"{path} is damaged at '{what}' ({exc})", "copy it again") from None
        findings = scan_pickle(data, f"{path.name}: {what}")
        unsafe = [g for g in findings.globals if g not in safe_globals() | DATA_GLOBALS]
        if findings.damaged:
            raise FormatError(
                f"{path} is damaged at '{what}' ({findings.damaged})", "copy it again"
            )
        if unsafe or findings.problems:
            why = ", ".join(unsafe) or findings.problems[0]
            raise UnsafeCheckpointError(
                f"{path} holds '{what}' that is not plain data: {why}",
                "see 'ckptkit scan'; only a folder you trust can be loaded, with torch itself",
            )
        return findings.scan.root, _ZipLayout(path, part)

    def _object(self, path: Path, start: int, length: int, fqn: str) -> Any:
        root, _ = self._archive(path, start, length, fqn)
        if any(isinstance(n, TensorStub) for n in nodes(root)):
            return "<tensors>"  # a value holding tensors (rare): described, not read
        return root

    def _piece(self, tensor: _Tensor, chunk: _Chunk) -> Piece:
        """Where a chunk's bytes lie in its file."""
        if chunk not in self._layouts:
            what = f"{tensor.fqn} at {list(chunk.offsets)}"
            stub, layout = self._archive(chunk.file, chunk.start, chunk.length, what)
            if (
                not isinstance(stub, TensorStub)
                or stub.shape != chunk.sizes
                or (stub.dtype != tensor.dtype)
            ):
                raise FormatError(f"{chunk.file} holds no {list(chunk.sizes)} chunk of '{what}'")
            if not stub.is_contiguous:
                raise FormatError(f"{chunk.file} holds '{what}' strided, which ckptkit cannot copy")
            base = layout.data_offset(stub.storage)
            if base is None or stub.byte_range()[1] > stub.storage.nbytes:
                raise FormatError(f"{chunk.file} is damaged at '{what}'", "copy it again")
            self._layouts[chunk] = (chunk.file, chunk.start + base + stub.byte_range()[0],
                                    stub.nbytes)  # fmt: skip
        return self._layouts[chunk]

    def entries(self) -> list[tuple[str, TensorInfo]]:
        # Keys whose chunks are the very same records are one tensor (ties ckptkit wrote).
        return [
            (key, TensorInfo(t.dtype, t.shape, _identity(t), (0, t.nbytes)))
            for key, t in self._tensors.items()
        ]

    def files(self) -> list[Path]:
        names = {c.file for t in self._tensors.values() for c in t.chunks}
        extra = [self.path / n for n in (LIGHTNING_META, SIDECAR) if (self.path / n).is_file()]
        return [self.path / METADATA, *sorted(names), *extra]

    def byte_pieces(self, key: str) -> list[Piece] | None:
        tensor = self._tensors[key]
        starts = [_contiguous_start(tensor.shape, c) for c in tensor.chunks]
        if any(s is None for s in starts):
            return None
        order = sorted(zip(starts, tensor.chunks, strict=True), key=lambda sc: sc[0] or 0)
        return [self._piece(tensor, chunk) for _, chunk in order]

    def byte_span(self, key: str) -> Piece | None:
        pieces = self.byte_pieces(key)
        return pieces[0] if pieces is not None and len(pieces) == 1 else None

    def load(self, key: str) -> torch.Tensor:
        import torch

        from ckptkit.formats.tensors import as_bytes, torch_dtype

        tensor = self._tensors[key]
        out = torch.empty(tensor.shape, dtype=torch_dtype(tensor.dtype))
        # Chunks are placed as bytes: a copy in the tensor's dtype may rewrite them (a bool's
        # stored byte becomes 0 or 1).
        itemsize = DTYPES[tensor.dtype].itemsize
        grid = out.reshape(-1).view(torch.uint8).view(*tensor.shape, itemsize)
        for chunk in tensor.chunks:
            path, offset, length = self._piece(tensor, chunk)
            part = torch.empty((*chunk.sizes, itemsize), dtype=torch.uint8)
            self._reader.read([(path, offset, length)], as_bytes(part))
            index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            grid[index] = part
        return out

    def close(self) -> None:
        self._reader.close()


def _trainer_state(path: Path) -> dict[str, Any]:
    """The plain values of Lightning's ``meta.pt`` (epoch, global_step, loops...), read
    statically; empty when there is none."""
    if not path.is_file():
        return {}
    from ckptkit.formats.torchfile import scan_torch_file

    scan, _, raw, _ = scan_torch_file(path)
    raw.close()
    root = scan.root if isinstance(scan.root, dict) else {}
    return {
        str(k): jsonable(v)
        for k, v in root.items()
        if not any(isinstance(n, TensorStub) for n in nodes(v))
    }


def _identity(tensor: _Tensor) -> str:
    return "dcp:" + (";".join(f"{c.file.name}@{c.start}" for c in tensor.chunks) or tensor.fqn)


def _sidecar(path: Path) -> dict[str, str]:
    """The metadata ckptkit wrote beside a DCP folder it made (str -> str), else empty."""
    import json

    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        raise FormatError(f"{path} is damaged", "remove it or copy the folder again") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path} is damaged", "remove it or copy the folder again")
    return {str(k): str(v) for k, v in data.items()}


def dcp_metadata(layout: list[tuple[str, str, tuple[int, ...], str, int, int]]) -> bytes:
    """``.metadata`` as ``dcp.save`` pickles it, for tensors each stored whole in one chunk,
    given as (key, dtype, shape, file name, offset, length). Made with DCP's own classes, so
    ``torch.distributed.checkpoint.load`` reads it as its own."""
    import pickle
    import uuid

    import torch
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckptkit.formats.tensors import torch_dtype

    items, storage = {}, {}
    for key, dtype, shape, name, offset, length in layout:
        size = torch.Size(shape)
        origin = torch.Size([0] * len(shape))
        items[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch_dtype(dtype)),
            size=size,
            chunks=[ChunkStorageMetadata(offsets=origin, sizes=size)],
        )
        storage[MetadataIndex(key, origin, 0)] = _StorageInfo(name, offset, length)
    metadata = Metadata(
        state_dict_metadata=items,  # type: ignore[arg-type]
        planner_data={key: (key,) for key in items},
        storage_data=storage,
        storage_meta=StorageMeta(save_id=str(uuid.uuid4())),
        version=getattr(filesystem, "CURRENT_DCP_VERSION", "1.0.0"),
    )
    return pickle.dumps(metadata)


def _contiguous_start(shape: tuple[int, ...], chunk: _Chunk) -> int | None:
    """The element where a chunk starts in the full tensor when it is one contiguous range of
    it (dims of size 1, then any one dim, then whole dims: a row shard), else None."""
    sizes = chunk.sizes
    first = next((i for i, size in enumerate(sizes) if size != 1), len(sizes))
    if any(sizes[i] != shape[i] for i in range(first + 1, len(shape))):
        return None
    start, stride = 0, 1
    for dim in reversed(range(len(shape))):
        start += chunk.offsets[dim] * stride
        stride *= shape[dim]
    return start


def _check_cover(folder: Path, tensor: _Tensor) -> None:
    """The chunks lie inside the tensor, do not overlap, and cover it."""
    shape, total = tensor.shape, 0
    boxes: list[_Chunk] = []
    for chunk in tensor.chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape) or any(
            o < 0 or s < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape,
                                                           strict=True)
        ):  # fmt: skip
            raise FormatError(f"{folder} has a chunk of '{tensor.fqn}' outside its shape")
        for other in boxes:
            if all(
                o1 < o2 + s2 and o2 < o1 + s1
                for o1, s1, o2, s2 in zip(chunk.offsets, chunk.sizes, other.offsets, other.sizes,
                                          strict=True)
            ):  # fmt: skip
                raise FormatError(
                    f"{folder} has overlapping chunks of '{tensor.fqn}'",
                    "the folder mixes two saves; copy it again",
                )
        boxes.append(chunk)
        total += math.prod(chunk.sizes)
    if total != math.prod(shape):
        raise FormatError(
            f"{folder} does not hold all of '{tensor.fqn}' ({total} of "
            f"{math.prod(shape)} elements)",
            "a rank's .distcp file is missing; copy the whole folder",
        )
