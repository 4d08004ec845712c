"""safetensors files: the header read with the stdlib, tensors through the safetensors library,
and a streaming writer that needs one tensor in memory at a time.

Layout: an 8-byte little-endian header length, a JSON header (``__metadata__`` plus, per tensor,
dtype, shape and ``data_offsets`` relative to the data section), then the tensor bytes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError
from ckptkit.formats.base.dtypes import DTYPES, DType, TensorSpec, from_safetensors, nbytes
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.base.tensors import as_bytes, dtype_name, from_buffer
from ckptkit.meta import NAMESPACE, CheckpointMeta
from ckptkit.storage.bytecopy import preallocate, write_all
from ckptkit.storage.location import Location, head, local_path, size

if TYPE_CHECKING:
    import torch

__all__ = [
    "SafetensorsSource",
    "TensorSpec",
    "HF_SHARDING",
    "dcp_sharding_info",
    "read_header",
    "tied_names",
    "header_bytes",
    "write_safetensors",
    "write_tensors",
    "MAX_HEADER",
]

MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers

HF_SHARDING = "DCP_SHARDING_INFO"  # DCP's HuggingFaceStorageWriter: each chunk's offsets


def dcp_sharding_info(path: Location) -> str | None:
    """The chunk offsets a safetensors file's header records when DCP's Hugging Face writer
    wrote it as one rank's shard (a JSON text), else None. A local file or one at a URL (its
    header read through the file's probe, which its reader then takes over); a header length
    the format or the file's size rules out is not read at all."""
    try:  # a FIFO named *.safetensors is refused unopened: it must not block a check
        length = _claimed_length(head(path, 8), size(path))
        return sharding_info_in(head(path, 8 + length)[8:]) if length else None
    except (OSError, FormatError):
        return None


def _claimed_length(head: bytes, size: int) -> int:
    """The header length the first 8 bytes give, when the format allows it (at most
    MAX_HEADER, inside a file of ``size`` bytes); else 0."""
    if len(head) < 8:
        return 0
    (length,) = struct.unpack("<Q", head[:8])
    return length if 1 < length <= MAX_HEADER and 8 + length <= size else 0


def sharding_info_in(text: bytes) -> str | None:
    """:func:`dcp_sharding_info` of a header's JSON text (read from a file or a URL)."""
    if HF_SHARDING.encode() not in text:
        return None
    try:
        meta = json.loads(text).get("__metadata__") or {}
    except (ValueError, AttributeError, RecursionError):
        return None
    value = meta.get(HF_SHARDING) if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


def read_header(path: Location, raw: Any = None) -> tuple[dict[str, Any], int]:
    """Read a safetensors header and check it as strictly as the safetensors library does.

    Returns:
        (header, offset of the data section). Each tensor's entry is a :class:`HeaderEntry`, a
        read-only mapping of ``dtype``, ``shape`` and ``data_offsets`` as the JSON gives them,
        kept compact (a 100,000-tensor header would take 60 MB as plain dicts and lists).

    ``raw``: the file at a URL (a RangeFile: the first read brings most headers whole, a
    second the rest); None reads the local file ``path``.

    Raises:
        FormatError: not a safetensors file, or one that is truncated or inconsistent.
    """
    with open(local_path(path), "rb") if raw is None else contextlib.nullcontext(raw) as f:
        f.seek(0)
        head = f.read(8)
        size = f.seek(0, 2)
        if len(head) < 8:
            raise FormatError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise FormatError(f"{path} is truncated or not a safetensors file", "copy it again")
        f.seek(8)
        text = f.read(length)
    header = _parse_header(path, text)
    del text
    _check_layout(path, header, size - 8 - length)
    return header, 8 + length


class HeaderEntry(Mapping[str, Any]):
    """One tensor's header entry, read-only: ``entry["dtype"]`` (the safetensors code),
    ``entry["shape"]`` and ``entry["data_offsets"]`` (lists, as in the JSON); ``dtype`` (the
    torch name), ``shape`` (a tuple), ``begin`` and ``end`` as attributes."""

    __slots__ = ("_dtype", "shape", "begin", "end")
    _FIELDS = ("dtype", "shape", "data_offsets")

    def __init__(self, dtype: DType, shape: tuple[int, ...], begin: int, end: int) -> None:
        self._dtype, self.shape, self.begin, self.end = dtype, shape, begin, end

    @property
    def dtype(self) -> str:
        return self._dtype.name

    def __getitem__(self, name: str) -> Any:
        if name == "dtype":
            return self._dtype.safetensors
        if name == "shape":
            return list(self.shape)
        if name == "data_offsets":
            return [self.begin, self.end]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._FIELDS)

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        return repr(dict(self))


def _compact(obj: dict[str, Any]) -> Any:
    """``json.loads``' object hook: a well-formed tensor entry becomes a :class:`HeaderEntry`
    as soon as it is parsed (the dicts and lists of 100,000 entries never exist together);
    anything else stays a dict, for :func:`_check_layout` to name what is wrong with it."""
    if len(obj) != 3:
        return obj
    try:
        code, shape, offsets = obj["dtype"], obj["shape"], obj["data_offsets"]
    except KeyError:
        return obj
    dtype = _BY_CODE.get(code) if type(code) is str else None
    if dtype is None or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return obj
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end < _COUNT_END:
        return obj  # end < begin too: the slow path says it as it always has
    for n in shape:
        if type(n) is not int or not 0 <= n < _COUNT_END:
            return obj
    return HeaderEntry(dtype, _shape(shape), begin, end)


_COUNT_END = 2**64
_BY_CODE = {d.safetensors: d for d in DTYPES.values() if d.safetensors}
_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}


def _shape(dims: list[int]) -> tuple[int, ...]:
    """A shape tuple, one object per distinct shape (checkpoints repeat a few shapes)."""
    shape = tuple(dims)
    if len(_SHAPES) > 4096:
        _SHAPES.clear()
    return _SHAPES.setdefault(shape, shape)


def _damaged(path: Location, what: str) -> FormatError:
    return FormatError(f"{path} has a damaged safetensors header: {what}", "copy it again")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _parse_header(path: Location, text: bytes) -> dict[str, Any]:
    try:
        header = json.loads(
            text.decode("utf-8"), parse_constant=_reject_constant, object_hook=_compact
        )
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _damaged(path, "not valid JSON") from None
    if isinstance(header, HeaderEntry):  # the top level itself looked like one entry
        header = dict(header)
    if not isinstance(header, dict):
        raise _damaged(path, "not a JSON object")
    metadata = header.get("__metadata__")
    if isinstance(metadata, HeaderEntry):
        raise _damaged(path, "__metadata__ must map strings to strings")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _damaged(path, "__metadata__ must map strings to strings")
    return header


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**64


def _check_layout(path: Location, header: dict[str, Any], data_size: int) -> None:
    """Every tensor's offsets lie back to back from 0 to the end of the data section, each
    exactly dtype size x elements long (safetensors' own ``validate``)."""
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if type(entry) is HeaderEntry:  # well-formed (see _compact): only sizes to check
            begin, end = entry.begin, entry.end
            if end < begin or end - begin != math.prod(entry.shape) * entry._dtype.itemsize:
                raise _damaged(
                    path, f"tensor '{key}' spans {end - begin} bytes, not its dtype x shape"
                )
            spans.append((begin, end, key))
            continue
        try:
            dtype = from_safetensors(entry["dtype"])
            shape, offsets = entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(
                f"{path}: tensor '{key}' has a damaged or unknown header entry"
            ) from exc
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise _damaged(path, f"tensor '{key}' has shape {shape!r}")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
        ):
            raise _damaged(path, f"tensor '{key}' has data_offsets {offsets!r}")
        begin, end = offsets
        if end < begin or end - begin != nbytes(dtype.name, tuple(shape)):
            raise _damaged(path, f"tensor '{key}' spans {end - begin} bytes, not its dtype x shape")
        spans.append((begin, end, key))
    spans.sort()
    position = 0
    for begin, end, key in spans:
        if begin != position:
            raise _damaged(path, f"tensor '{key}' starts at {begin}, not {position}")
        position = end
    if position > data_size:
        raise FormatError(f"{path} is truncated (the tensors end past the file)", "copy it again")
    if position != data_size:
        raise _damaged(path, f"{data_size - position} bytes after the last tensor")


class SafetensorsSource(Source):
    """A single safetensors file; tensors come memory-mapped through ``safe_open``."""

    def __init__(self, path: Location, *, select: str | None = None, raw: Any = None) -> None:
        header, self._data_start = read_header(path, raw)
        self.remote_file = raw  # the file at a URL (a RangeFile); None on a local disk
        metadata = header.pop("__metadata__", None) or {}
        super().__init__(path=path, format="safetensors", metadata=dict(metadata))
        if _is_dcp_shard(path, metadata):
            raise FormatError(
                f"{path} is one rank's shard of a DCP checkpoint (DCP's Hugging Face writer)",
                f"give the folder that holds every rank's file: {path.parent}",
            )
        if select not in (None, ""):
            raise FormatError(
                f"{path} is a safetensors file: it holds one flat state dict", "drop --select"
            )
        self.selected_reason = "a safetensors file is a state dict"
        self.meta = CheckpointMeta.from_header(metadata)
        self.extras = dict(self.meta.extras)
        self._handle: Any = None
        self._ties = tied_names(self.metadata, header.keys())
        # Names the file records as ties but does not store: read as their target.
        self._virtual = {a: t for a, t in self._ties.items() if a not in header}
        # What the header says of each tensor, once, in file order (the entries of 100,000
        # tensors are asked for several times by inspect and convert).
        self._infos: dict[str, TensorInfo] = {}
        for key, entry in sorted(header.items(), key=_begin):
            self._infos[key] = _info(entry)
        del header
        self._entries: list[tuple[str, TensorInfo]] = []
        followers: dict[str, list[str]] = {}
        for alias, target in self._virtual.items():
            followers.setdefault(target, []).append(alias)
        for key, info in self._infos.items():
            self._entries.append((key, info))
            # A recorded tie that is not stored comes right after its target, as one tensor.
            self._entries.extend((alias, info) for alias in followers.get(key, ()))

    def entries(self) -> list[tuple[str, TensorInfo]]:
        return list(self._entries)

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        begin, end = self._infos[self._virtual.get(key, key)].byte_range
        return self.path, self._data_start + begin, end - begin

    def aliases(self) -> dict[str, str]:
        # Each tensor owns its bytes here; ties survive only as recorded metadata.
        return dict(self._ties)

    def load(self, key: str) -> torch.Tensor:
        if self.remote_file is not None:
            return self._fetch(key)
        if self._handle is None:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
        return self._handle.get_tensor(self._virtual.get(key, key))

    def _fetch(self, key: str) -> torch.Tensor:
        """A tensor of a file at a URL, its bytes fetched in one ranged read."""
        info = self._infos[self._virtual.get(key, key)]
        begin, end = info.byte_range
        data = bytearray(end - begin)
        raw = self.remote_file
        assert raw is not None  # load() fetches only a file at a URL
        raw.seek(self._data_start + begin)
        if raw.readinto(data) != len(data):
            raise FormatError(f"{self.path} is truncated", "copy it again")
        return from_buffer(data, 0, len(data), info.dtype).reshape(info.shape)

    def close(self) -> None:
        self._handle = None
        if self.remote_file is not None:
            self.remote_file.close()


def _begin(item: tuple[str, Any]) -> int:
    entry = item[1]
    return entry.begin if type(entry) is HeaderEntry else entry["data_offsets"][0]


def _info(entry: Any) -> TensorInfo:
    """A checked header entry as a TensorInfo (a dict: one with fields beyond the three)."""
    if type(entry) is HeaderEntry:
        return TensorInfo(entry.dtype, entry.shape, byte_range=(entry.begin, entry.end))
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    return TensorInfo(from_safetensors(entry["dtype"]).name, shape, byte_range=(begin, end))


def _is_dcp_shard(path: Location, metadata: Mapping[str, str]) -> bool:
    """DCP's Hugging Face writer saved this file as one rank's part of each tensor (its name is
    ``shard-<rank>-...`` or a chunk starts past 0), not as whole tensors (rank-0 saves)."""
    text = metadata.get(HF_SHARDING)
    if text is None:
        return False
    if path.name.startswith("shard-"):
        return True
    try:
        return any(any(v["saved_offsets"]) for v in json.loads(text).values())
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return True  # damaged offsets: not whole tensors ckptkit can vouch for


def tied_names(metadata: Mapping[str, str], stored: Iterable[str]) -> dict[str, str]:
    """The ties a safetensors header records: alias -> the stored tensor it is.

    Two forms: ckptkit's own (``ckptkit.aliases``, JSON) and ``safetensors.torch.save_model``'s,
    which names each tensor it left out as a metadata entry ``removed name -> kept name``.
    """
    stored = set(stored) - {"__metadata__"}
    ties = {
        key: value
        for key, value in metadata.items()
        if key not in stored
        and value in stored
        and key != "format"
        and not key.startswith(NAMESPACE)
    }
    recorded = CheckpointMeta.from_header(metadata).aliases
    ties.update({a: t for a, t in recorded.items() if t in stored and a != t})
    return ties


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for tensors written back to back in ``specs`` order.

    The text is ``json.dumps`` of the header dict (compact separators), written entry by entry:
    the dicts and lists of 100,000 entries are never built."""
    parts = ['"__metadata__":' + json.dumps(metadata, separators=(",", ":"))] if metadata else []
    offset = 0
    for spec in specs:
        code = DTYPES[spec.dtype].safetensors
        if code is None:
            raise FormatError(
                f"tensor '{spec.key}' has dtype {spec.dtype}, which safetensors cannot store",
                "write a .pt file instead",
            )
        size = spec.nbytes
        shape = ",".join(map(str, spec.shape))
        parts.append(
            f'{json.dumps(spec.key)}:{{"dtype":"{code}","shape":[{shape}],'
            f'"data_offsets":[{offset},{offset + size}]}}'
        )
        offset += size
    text = ("{" + ",".join(parts) + "}").encode()
    del parts
    text += b" " * (-len(text) % 8)  # pad so the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    dst: Path,
    specs: list[TensorSpec],
    metadata: dict[str, str],
    write_tensor: Callable[[int, TensorSpec], None],
    *,
    reserve: bool = True,
) -> int:
    """Write a safetensors file: the header, then each tensor in ``specs`` order.

    ``write_tensor(fd, spec)`` must append exactly ``spec.nbytes`` bytes at ``fd`` (a kernel copy
    from another file, or a tensor's bytes), so one tensor at a time is all that is in memory.
    ``reserve``: the file's room is reserved on disk first (not for a file uploaded as it is
    written, which never holds all its bytes at once).

    Returns:
        The offset of the data section.
    """
    header = header_bytes(specs, metadata)
    # No O_TRUNC on an empty file (atomic_output's temp file): ext4 flushes a truncated file
    # to disk when it is closed (auto_da_alloc), which would cost a second write-back.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if _nonempty(dst) else 0)
    with open(os.open(dst, flags, 0o666), "wb", buffering=0) as f:
        if reserve:
            preallocate(f.fileno(), len(header) + sum(spec.nbytes for spec in specs))
        write_all(f.fileno(), memoryview(header))
        for spec in specs:
            start = f.tell()
            write_tensor(f.fileno(), spec)
            if f.tell() - start != spec.nbytes:
                raise ValueError(
                    f"tensor '{spec.key}' wrote {f.tell() - start} bytes, not {spec.nbytes}"
                )
    return len(header)


def _nonempty(path: Location) -> bool:
    try:
        return size(path) > 0
    except OSError:
        return False


def write_tensors(dst: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write in-memory tensors (any layout) as a safetensors file."""
    specs = [TensorSpec(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items()]
    write_safetensors(
        dst,
        specs,
        metadata,
        lambda fd, spec: write_all(fd, as_bytes(tensors[spec.key].contiguous())),
    )
