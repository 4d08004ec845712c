"""``torch.distributed.checkpoint`` (DCP) folders, read without loading them.

``dcp.save`` writes ``.metadata`` (a pickle of DCP's dataclasses: every flattened key with its
dtype, full shape and chunks, and where each chunk lies: file, offset, length) and one
``__<rank>_<n>.distcp`` file per writer, in which each tensor chunk is a small ``torch.save``
archive and each other value a ``torch.save``'d object. Everything here is read statically: the
metadata classes are admitted by name and never imported; each chunk's own archive is read like
any torch file, which gives where its bytes lie.

DCP's ``HuggingFaceStorageWriter`` (``save_distributed=True``) writes no ``.metadata``: each
rank's chunks go to a ``.safetensors`` file whose header records each chunk's offset in the
full tensor (``DCP_SHARDING_INFO``); there the chunks lie as the safetensors header says.

A chunk that is one contiguous byte range of the full tensor (a row shard: FSDP's, nearly always)
is copied as it lies; chunks of any other layout are assembled through torch, one tensor at a
time. Chunks that leave a gap or overlap are refused, naming the file and the key.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptkit.errors import FormatError, UnsafeCheckpointError
from ckptkit.formats.base.dtypes import DTYPES, from_safetensors
from ckptkit.formats.base.tree import nodes
from ckptkit.formats.files.safetensors import HF_SHARDING
from ckptkit.formats.folders.chunks import Chunk, ChunkedSource, ChunkedTensor, Piece, check_cover
from ckptkit.formats.pickles.machine import Global, Opaque, fields
from ckptkit.formats.pickles.safe_globals import safe_globals
from ckptkit.formats.pickles.unpickler import DATA_GLOBALS, TensorStub
from ckptkit.formats.pickles.verdicts import scan_pickle
from ckptkit.formats.pickles.writer import Call, New, Ref, dumps
from ckptkit.meta import jsonable
from ckptkit.storage.folder import FolderFiles
from ckptkit.storage.location import Location, by_name
from ckptkit.storage.rangefile import RangeFile

__all__ = ["DCPSource", "METADATA", "DISTCP", "SIDECAR", "dcp_metadata"]

METADATA = ".metadata"
DISTCP = "__0_0.distcp"  # the one data file ckptkit writes: rank 0's first, as dcp.save names it
SIDECAR = "ckptkit.json"  # the conversion's metadata beside a DCP folder ckptkit wrote
LIGHTNING_META = "meta.pt"  # Lightning's FSDP strategy saves the trainer's state beside DCP
_DCP = "torch.distributed.checkpoint."
_JOIN_GAP = 1024 * 1024  # values further apart than this in one file are fetched apart
# DCP's own classes in .metadata: dataclasses of plain values, read as data, never imported.


class _Slice(io.RawIOBase):
    """A byte range of an open file, as a file of its own (a chunk's archive, for zipfile):
    ``fd`` a local file's descriptor, or a RangeFile (a file at a URL)."""

    def __init__(self, fd: int | RangeFile, start: int, length: int) -> None:
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
        if isinstance(self.fd, RangeFile):
            data = self.fd.pread(self.start + self.pos, count)
        else:
            data = os.pread(self.fd, count, self.start + self.pos)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def read_metadata(path: Location, data: bytes | None = None) -> dict[str, Any]:
    """``.metadata``'s fields (``data``: its bytes, when they were read already), read
    statically.

    Raises:
        UnsafeCheckpointError: it names globals beyond torch's safe set and DCP's classes.
        FormatError: it is damaged or not DCP metadata.
    """
    findings = scan_pickle(path.read_bytes() if data is None else data, METADATA)
    allowed = safe_globals() | DATA_GLOBALS  # DCP's own classes are data (DATA_GLOBALS)
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
    return fields(root)


class DCPSource(ChunkedSource):
    """A DCP checkpoint folder: the flattened state unflattened into a training checkpoint's
    tree, its state dict found in it as in a ``.pt`` file (``model`` by default)."""

    def __init__(self, folder: Location, *, select: str | None = None, ema: bool = False) -> None:
        super().__init__(folder, "dcp")
        try:
            self._read(folder, select, ema)
        except BaseException:
            self.close()
            raise

    def _read(self, folder: Location, select: str | None, ema: bool) -> None:
        self._files = FolderFiles(folder, self._reader, join_gap=_JOIN_GAP)
        if self._files.has(METADATA):
            meta = read_metadata(folder / METADATA, self._files.read(METADATA))
            self._adopt_tree(lambda: self._tree(folder, meta), select=select, ema=ema)
        else:
            self._adopt_tree(lambda: self._hf_tree(folder), select=select, ema=ema)
            if not select:
                self.selected_reason = "DCP's Hugging Face writer saves a flat state dict"
        if self._files.has(LIGHTNING_META):
            self.extras.update(_trainer_state(folder / LIGHTNING_META, self._files))
        if self._files.has(SIDECAR):
            self.metadata = _sidecar(folder / SIDECAR, self._files.read(SIDECAR))

    def _tree(self, folder: Location, meta: dict[str, Any]) -> dict[str, Any]:
        items = meta.get("state_dict_metadata")
        storage = meta.get("storage_data")
        paths = meta.get("planner_data") or {}
        if not isinstance(items, dict) or not isinstance(storage, dict):
            raise FormatError(f"{folder / METADATA} lists no items", "copy the folder again")
        where: dict[tuple[str, Any], Piece] = {}
        for index, info in storage.items():
            key, place = fields(index), fields(info)
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
        self._files.prefetch(where[(str(fqn), None)] for fqn in items if (str(fqn), None) in where)
        tree: dict[str, Any] = {}
        for fqn, item in items.items():
            value = self._item(folder, str(fqn), item, where)
            path = paths.get(fqn) or (fqn,)
            node = tree
            for part in path[:-1]:
                node = node.setdefault(str(part), {})
            node[str(path[-1])] = value
        return tree

    def _hf_tree(self, folder: Location) -> dict[str, Any]:
        """The tensors DCP's Hugging Face writer saved: each rank's ``.safetensors`` file holds
        its chunks, and its header each chunk's offset in the full tensor. The full shape is
        where the chunks end, as torch's ``HuggingFaceStorageReader`` takes it."""
        from ckptkit.formats.files.safetensors import read_header

        found: dict[str, tuple[str, list[Chunk]]] = {}
        for path in by_name(folder.glob("*.safetensors")):
            raw = self._files.url_file(path.name)
            header, data_start = read_header(path, raw=raw)
            offsets = _saved_offsets(path, header.pop("__metadata__", None) or {})
            for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype, sizes = from_safetensors(entry["dtype"]).name, tuple(entry["shape"])
                at = offsets.get(key)
                if at is None or len(at) != len(sizes):
                    raise FormatError(
                        f"{path} records no offsets for '{key}'",
                        "the folder mixes files of two saves; copy it again",
                    )
                begin, end = entry["data_offsets"]
                chunk = Chunk(at, sizes, path, data_start + begin, end - begin)
                self._layouts[chunk] = (path, data_start + begin, end - begin)
                first_dtype, chunks = found.setdefault(key, (dtype, []))
                if dtype != first_dtype:
                    raise FormatError(
                        f"{path} stores '{key}' as {dtype}, another file as {first_dtype}",
                        "the folder mixes files of two saves; copy it again",
                    )
                chunks.append(chunk)
        tree: dict[str, Any] = {}
        for key, (dtype, chunks) in found.items():
            shape = tuple(
                max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].sizes))
            )
            tensor = ChunkedTensor(key, dtype, shape, chunks)
            check_cover(folder, tensor)
            tree[key] = tensor
        return tree

    def _item(self, folder: Location, fqn: str, item: Any, where: dict[Any, Piece]) -> Any:
        record = fields(item)
        if isinstance(item, Opaque) and item.global_name.endswith("BytesStorageMetadata"):
            if (fqn, None) not in where:
                raise FormatError(f"{folder} has no stored value for '{fqn}'", "copy it again")
            return self._object(*where[(fqn, None)], fqn)
        props = record.get("properties")
        state = props.state if isinstance(props, Opaque) else None
        dtype_global = state[0] if isinstance(state, tuple) and state else None
        dtype = dtype_global.name.removeprefix("torch.") if isinstance(dtype_global, Global) else ""
        shape = record.get("size")
        if dtype not in DTYPES or not isinstance(shape, tuple):
            raise FormatError(f"{folder / METADATA} describes '{fqn}' in a way ckptkit cannot read")
        chunks = []
        for chunk in record.get("chunks") or ():
            c = fields(chunk)
            offsets, sizes = tuple(c.get("offsets") or ()), tuple(c.get("sizes") or ())
            if (fqn, offsets) not in where:
                raise FormatError(
                    f"{folder} has no data for '{fqn}' at offset {list(offsets)}",
                    "a rank's .distcp file is missing or the folder mixes two saves",
                )
            chunks.append(Chunk(offsets, sizes, *where[(fqn, offsets)]))
        tensor = ChunkedTensor(fqn, dtype, tuple(shape), chunks)
        check_cover(folder, tensor)
        return tensor

    def _fd(self, path: Location) -> int | RangeFile:
        """A local file's descriptor, or a file at a URL (read through a RangeFile, once)."""
        raw = self._files.url_file(path.name)
        if raw is not None:
            return raw
        if not path.is_file():
            raise FormatError(f"{path} is missing", "copy every rank's .distcp file there")
        return self._reader.fd(path)

    def _size(self, path: Location) -> int:
        return self._files.size(path.name)

    def _archive(self, path: Location, start: int, length: int, what: str) -> tuple[Any, Any]:
        """A chunk's (or value's) torch.save archive: its statically read root and layout."""
        from ckptkit.formats.files.torchfile import ZipLayout

        size = self._size(path)
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
        return findings.scan.root, ZipLayout(path, part)

    def _object(self, path: Location, start: int, length: int, fqn: str) -> Any:
        root, _ = self._archive(path, start, length, fqn)
        if any(isinstance(n, TensorStub) for n in nodes(root)):
            return "<tensors>"  # a value holding tensors (rare): described, not read
        return root

    def _piece(self, tensor: ChunkedTensor, chunk: Chunk) -> Piece:
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
            self._layouts[chunk] = (
                chunk.file,
                chunk.start + base + stub.byte_range()[0],
                stub.nbytes,
            )
        return self._layouts[chunk]

    def files(self) -> list[Location]:
        names = {c.file for t in self._tensors.values() for c in t.chunks}
        around = [self.path / n for n in (METADATA, LIGHTNING_META, SIDECAR)]
        return sorted(names, key=str) + [p for p in around if self._files.has(p.name)]

    def file_size(self, path: Location) -> int:
        """A file's size, from the folder's listing where it was listed (no request)."""
        return self._files.size(path.name)

    def close(self) -> None:
        if hasattr(self, "_files"):
            self._files.close()
        super().close()


def _trainer_state(path: Location, files: FolderFiles) -> dict[str, Any]:
    """The plain values of Lightning's ``meta.pt`` (epoch, global_step, loops...), read
    statically."""
    from ckptkit.formats.files.torchfile import scan_torch_file

    at_url = files.url_file(path.name)
    scan, _, raw, _ = scan_torch_file(path, raw=at_url)
    if at_url is None:
        raw.close()
    root = scan.root if isinstance(scan.root, dict) else {}
    return {
        str(k): jsonable(v)
        for k, v in root.items()
        if not any(isinstance(n, TensorStub) for n in nodes(v))
    }


def _saved_offsets(path: Location, metadata: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each key's chunk offset, from the header DCP's Hugging Face writer gives a shard."""
    import json

    text = metadata.get(HF_SHARDING)
    try:
        info = json.loads(text) if isinstance(text, str) else None
        if not isinstance(info, dict):
            raise TypeError("no mapping of offsets")
        offsets = {str(k): tuple(v["saved_offsets"]) for k, v in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        offsets = None
    if offsets is None or not all(type(o) is int and o >= 0 for at in offsets.values() for o in at):
        raise FormatError(
            f"{path} has no valid {HF_SHARDING} in its header: it is not one rank's shard "
            "of a DCP save",
            "the folder mixes files of two saves; copy it again",
        )
    return offsets


def _sidecar(path: Location, data: bytes) -> dict[str, str]:
    """The metadata ckptkit wrote beside a DCP folder it made (str -> str)."""
    import json

    try:
        found = json.loads(data)
    except ValueError as exc:
        raise FormatError(f"{path} is damaged", "remove it or copy the folder again") from exc
    if not isinstance(found, dict):
        raise FormatError(f"{path} is damaged", "remove it or copy the folder again")
    return {str(k): str(v) for k, v in found.items()}


def dcp_metadata(
    layout: list[tuple[str, str, tuple[int, ...], str, int, int]],
    objects: Sequence[tuple[str, str, int, int]] = (),
) -> bytes:
    """``.metadata`` as ``dcp.save`` pickles it, for tensors each stored whole in one chunk,
    given as (key, dtype, shape, file name, offset, length), and ``objects`` saved as bytes
    (key, file name, offset, length): DCP's own dataclasses, written by name without importing
    torch (``pickle_write``), so ``torch.distributed.checkpoint.load`` reads it as its own."""
    import uuid

    def dataclass(name: str, module: str = "metadata", **fields: Any) -> New:
        return New(Ref(_DCP + module, name), fields)

    def size(dims: tuple[int, ...]) -> Call:
        return Call(Ref("torch", "Size"), (tuple(dims),))

    items, storage = {}, {}
    for key, dtype, shape, name, offset, length in layout:
        origin = (0,) * len(shape)
        # TensorProperties pickles its fields as a tuple (its __getstate__).
        properties = New(
            Ref(_DCP + "metadata", "TensorProperties"),
            (
                Ref("torch", dtype),
                Call(Ref("torch.serialization", "_get_layout"), ("torch.strided",)),
                False,
                Call(Ref(_DCP + "metadata", "_MEM_FORMAT_ENCODING"), (0,)),
                False,
            ),
        )
        items[key] = dataclass(
            "TensorStorageMetadata",
            properties=properties,
            size=size(shape),
            chunks=[dataclass("ChunkStorageMetadata", offsets=size(origin), sizes=size(shape))],
        )
        index = dataclass("MetadataIndex", fqn=key, offset=size(origin), index=0)
        storage[index] = dataclass(
            "_StorageInfo", "filesystem", relative_path=name, offset=offset, length=length
        )
    for key, name, offset, length in objects:
        items[key] = dataclass("BytesStorageMetadata")
        index = dataclass("MetadataIndex", fqn=key, offset=None, index=None)
        storage[index] = dataclass(
            "_StorageInfo", "filesystem", relative_path=name, offset=offset, length=length
        )
    meta = dataclass(
        "Metadata",
        state_dict_metadata=items,
        planner_data={key: (key,) for key in items},
        storage_data=storage,
        storage_meta=dataclass(
            "StorageMeta",
            checkpoint_id=None,
            save_id=str(uuid.uuid4()),
            load_id=None,
            modules=[],
        ),
        version="1.0.0",  # filesystem.CURRENT_DCP_VERSION
    )
    return dumps(meta)
