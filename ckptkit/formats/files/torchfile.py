"""PyTorch checkpoints: the zip format (torch >= 1.6) and the legacy format, read without executing.

Both are read statically (see ``pickle_scan``): the pickle gives each tensor's storage, dtype,
shape, stride and offset, and the storage bytes are located in the file (a stored zip member, or
a record after the legacy pickles), so each tensor is a view of a memory map, read when used.
``--trust`` is the one path that runs torch's full unpickler, and only after a static scan.
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import os
import struct
import sys
import weakref
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, UnsafeCheckpointError
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.base.tensors import dtype_name, from_buffer, torch_dtype
from ckptkit.formats.base.tree import node_at, nodes, select_state_dict
from ckptkit.formats.files.readings import LEGACY_MAGIC, Reading, readings, remote_readings
from ckptkit.formats.files.torchzip import INFLATE_PIECE, ZipDamage, ZipIndex
from ckptkit.formats.pickles.safe_globals import safe_globals
from ckptkit.formats.pickles.unpickler import (
    DATA_GLOBALS,
    PickleScan,
    StorageRef,
    TensorStub,
    UnsupportedTensor,
)
from ckptkit.formats.pickles.verdicts import check_allowed, is_dangerous
from ckptkit.keys import module_prefixes
from ckptkit.storage.location import Location, local_path
from ckptkit.storage.rangefile import RangeFile

if TYPE_CHECKING:
    import torch

__all__ = [
    "TorchFileSource",
    "TrustedTorchSource",
    "scan_torch_file",
    "LEGACY_MAGIC",
    "ZipLayout",
]


class ZipLayout:
    """Where each storage's bytes sit inside a torch zip file (the central directory read with
    ``ZipIndex``: compact, and fast for 100,000 storages)."""

    remote = False  # a file at a URL (read through a RangeFile), not on a local disk

    def __init__(self, path: Location, raw: Any) -> None:
        self.path, self.raw = path, raw
        self.remote = isinstance(raw, RangeFile)
        try:
            self.index = ZipIndex(raw, locate_all=not self.remote)
        except (ZipDamage, OSError, ValueError, EOFError, struct.error) as exc:
            raise FormatError(f"{path} is a damaged zip file ({exc})", "copy it again") from None
        self.size = self.index.size
        names = self.index.other_names()
        pkl = next((n for n in names if n == "data.pkl" or n.endswith("/data.pkl")), None)
        if pkl is None:
            raise FormatError(f"{path} is a zip archive but not a PyTorch checkpoint (no data.pkl)")
        self.pickle_name = pkl
        self.prefix = pkl[: -len("data.pkl")]
        byteorder = self.prefix + "byteorder"
        if byteorder in names and self._read(byteorder).strip() not in (b"little", b""):
            raise FormatError(f"{path} was saved on a big-endian machine", "convert it there")

    def _read(self, name: str) -> bytes:
        """A small member's bytes (the first MiB)."""
        member = self.index.names[name]  # named, not numbered: never a storage
        try:
            if self.index.method[member] == zipfile.ZIP_STORED:
                self.raw.seek(self.index.data_offset(member))
                return bytes(self.raw.read(min(self.index.length[member], 1 << 20)))
            out = bytearray()
            for piece in self.index.inflate(member):
                out += piece[: (1 << 20) - len(out)]
            return bytes(out)
        except Exception as exc:  # zlib, CRC and header errors alike: the archive is damaged
            raise _zip_damage(self.path, name, exc) from None

    def _member(self, ref: StorageRef) -> int:
        member = self.index.find_numbered(self.prefix, ref.key)
        if member is None:
            raise FormatError(f"{self.path} is damaged: storage '{ref.key}' is missing")
        if self.index.length[member] < ref.nbytes:
            raise FormatError(f"{self.path} is damaged: storage '{ref.key}' is short")
        return member

    def compressed(self, ref: StorageRef) -> bool:
        """Whether a storage must be decompressed to be read (torch never compresses; tools
        that re-zip a checkpoint may)."""
        return self.index.method[self._member(ref)] != zipfile.ZIP_STORED

    def data_offset(self, ref: StorageRef) -> int | None:
        """Where the storage's bytes start in the file (None: compressed, so nowhere)."""
        member = self._member(ref)
        if self.index.method[member] != zipfile.ZIP_STORED:
            return None
        try:
            offset = self.index.data_offset(member)
        except ZipDamage as exc:
            if "past the end" in str(exc):
                raise FormatError(
                    f"{self.path} is damaged: storage '{ref.key}' lies past the end"
                ) from None
            raise FormatError(
                f"{self.path} is damaged: bad zip entry for storage '{ref.key}'"
            ) from None
        if offset + ref.nbytes > self.size:
            raise FormatError(f"{self.path} is truncated", "copy or download it again")
        return offset

    def locate_storages(self, workers: int = 32) -> None:
        """A file at a URL: every member's data offset, the local headers fetched ``workers``
        windows at a time (small requests: their time is latency, so many go at once; see
        ``ZipIndex.locate_all_remote``); once, before tensors are copied."""
        if self.remote and not self.index.located:
            from concurrent.futures import ThreadPoolExecutor

            raw, remote = self.raw, self.raw.remote

            def read(window: tuple[int, int]) -> bytes:  # the first and last blocks are cached
                return raw.cached(*window) or remote.read(*window)

            with ThreadPoolExecutor(workers, thread_name_prefix="ckptkit-fetch") as pool:
                self.index.locate_all_remote(lambda windows: list(pool.map(read, windows)))

    def member_crc(self, ref: StorageRef) -> int | None:
        """The CRC-32 the directory records for a stored storage's member; None for none, or
        for 0: what torch writes under ``set_crc32_options(False)``, and ckptkit's writer."""
        member = self._member(ref)
        if (
            self.index.method[member] != zipfile.ZIP_STORED
            or self.index.length[member] != ref.nbytes
        ):
            return None
        return self.index.crc[member] or None

    def check(self, ref: StorageRef) -> None:
        """Raise when a storage cannot lie inside the file: its local header read, or for a
        remote file (a request a header) its directory entry checked alone (its local header
        is read, and checked, when its bytes are)."""
        if not self.remote:
            self.data_offset(ref)
            return
        member = self._member(ref)
        if not self.index.fits(member, f"{self.prefix}data/{ref.key}"):
            raise FormatError(f"{self.path} is truncated", "copy or download it again")

    def storage(self, ref: StorageRef) -> torch.Tensor:
        offset = self.data_offset(ref)
        if offset is None:  # decompressed piece by piece into the one buffer it fills
            data = bytearray(ref.nbytes)
            at = 0
            for piece in self.stream(ref, 0, ref.nbytes, INFLATE_PIECE):
                data[at : at + len(piece)] = piece
                at += len(piece)
            return from_buffer(data, 0, ref.nbytes, ref.dtype)
        return self.map(offset, ref)

    def stream(self, ref: StorageRef, start: int, end: int, piece: int) -> Iterator[bytearray]:
        """The bytes ``[start, end)`` of a compressed storage, ``piece`` bytes at a time (the
        last one shorter; each a fresh buffer), decompressed as they are asked for; the rest of
        the member is decompressed too, so its size and CRC-32 are checked at the end.

        Raises:
            FormatError: damaged compressed data, or a CRC-32 or size that does not match.
        """
        name = f"{self.prefix}data/{ref.key}"
        member = self._member(ref)
        out = bytearray()
        at = 0  # of the member's bytes, where the next decompressed ones go
        try:
            for data in self.index.inflate(member, max(piece, 1 << 16)):
                begin, stop = max(start - at, 0), min(end - at, len(data))
                at += len(data)
                if begin < stop:
                    out += data[begin:stop]
                while len(out) >= piece:
                    chunk = out[:piece]
                    del out[:piece]
                    yield chunk
        except ZipDamage as exc:
            raise FormatError(
                f"{self.path} is damaged: zip member '{name}': {exc}", "copy or download it again"
            ) from None
        if out:
            yield out

    def map(self, offset: int, ref: StorageRef) -> torch.Tensor:
        if self.remote:  # fetched in one ranged read (its length checked by the reader)
            data = bytearray(ref.nbytes)
            self.raw.seek(offset)
            if self.raw.readinto(data) != ref.nbytes:
                raise FormatError(f"{self.path} is truncated", "copy or download it again")
            return from_buffer(data, 0, ref.nbytes, ref.dtype)
        if offset + ref.nbytes > len(self.mm):
            raise FormatError(f"{self.path} is truncated", "copy or download it again")
        return from_buffer(self.mm, offset, ref.nbytes, ref.dtype)

    @property
    def mm(self) -> mmap.mmap:
        if not hasattr(self, "_mm"):
            # Copy-on-write: writable for torch.frombuffer, never written back to the file.
            self._mm = mmap.mmap(self.raw.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._mm


def _zip_damage(path: Location, name: str, exc: Exception) -> FormatError:
    return FormatError(
        f"{path} is damaged: zip member '{name}' cannot be read ({type(exc).__name__}: {exc})",
        "copy or download it again",
    )


class _LegacyLayout(ZipLayout):
    """The legacy format: magic, protocol and system-info pickles, the main pickle, the list of
    storage keys, then each storage as an int64 element count followed by its bytes."""

    def __init__(self, path: Location, raw: Any, reading: Reading) -> None:
        self.path, self.raw = path, raw
        pickles = reading.pickles
        if reading.kind != "torch-legacy" or len(pickles) < 5:
            raise FormatError(
                f"{path} is a plain pickle, not a PyTorch checkpoint",
                "ckptkit reads files written by torch.save or safetensors",
            )
        sys_info = pickles[2].scan.root
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            raise FormatError(f"{path} was saved on a big-endian machine", "convert it there")
        self.main = pickles[3].scan
        keys = pickles[4].scan.root
        if not isinstance(keys, list):
            raise FormatError(f"{path} is damaged: no storage list after the pickle")
        self.offsets: dict[str, int] = {}
        pos = pickles[4].run.end
        size = raw.seek(0, io.SEEK_END)
        for key in keys:
            ref = self.main.storages.get(str(key))
            raw.seek(pos)
            head = raw.read(8)
            if ref is None or len(head) < 8:
                raise FormatError(f"{path} is truncated", "copy or download it again")
            (numel,) = struct.unpack("<q", head)
            if numel != ref.numel:
                raise FormatError(f"{path} is damaged: storage '{key}' has the wrong size")
            self.offsets[ref.key] = pos + 8
            pos += 8 + ref.nbytes
        if pos > size:
            raise FormatError(f"{path} is truncated", "copy or download it again")
        self.size = size

    def compressed(self, ref: StorageRef) -> bool:
        return False

    def data_offset(self, ref: StorageRef) -> int | None:
        return self.offsets[ref.key]

    def storage(self, ref: StorageRef) -> torch.Tensor:
        return self.map(self.offsets[ref.key], ref)


def _is_stub(value: Any) -> bool:
    return isinstance(value, (TensorStub, UnsupportedTensor))


def _stub_nbytes(value: Any) -> int:
    return value.nbytes if isinstance(value, TensorStub) else 0


def checked_reading(
    path: Location, allowed: Iterable[str] = (), *, check_safety: bool = True, raw: Any = None
) -> tuple[Reading, list[Reading]]:
    """The reading ``torch.load`` makes of a torch file, refused unless every reading of the
    file is safe (globals admitted by ``allowed`` aside), unambiguous and whole. Returns it and
    all the readings. ``check_safety=False`` skips the safety refusals (the reading is static
    either way), not the damage check.

    Raises:
        UnsafeCheckpointError: a global outside the safe set, a construct no benign pickler
            writes, or a polyglot.
        FormatError: a damaged file.
    """
    found = readings(local_path(path)) if raw is None else remote_readings(path, raw)
    if not found:
        raise FormatError(f"{path} is not a recognised checkpoint")
    safe = safe_globals() | DATA_GLOBALS | set(allowed)
    unsafe: dict[str, None] = {}
    problems: list[str] = []
    if len(found) > 1:
        problems.append("loaders disagree on what it is (a polyglot)")
    for reading in found:
        for findings in reading.pickles:
            unsafe.update(dict.fromkeys(g for g in findings.globals if g not in safe))
            problems.extend(f"{p} in {findings.label}" for p in findings.problems)
    if unsafe and check_safety:
        raise _unsafe_error(path, list(unsafe))
    if problems and check_safety:
        raise UnsafeCheckpointError(
            f"{path} is unsafe: {problems[0]}",
            "see 'ckptkit scan'; only a file you trust can be loaded, with --trust",
            api_hint="see ckptkit.scan(path); only a file you trust can be loaded, with trust=True",
        )
    reading = found[0]
    damage = reading.damaged or next((p.damaged for p in reading.pickles if p.damaged), None)
    if damage:
        raise FormatError(f"{path} is damaged ({damage})", "copy or download it again")
    return reading, found


def scan_torch_file(
    path: Location, allowed: Iterable[str] = (), *, check_safety: bool = True, raw: Any = None
) -> tuple[PickleScan, ZipLayout, Any, list[Reading]]:
    """Check a torch file and read its pickle statically (``raw``: the file at a URL, a
    RangeFile; None: the local file ``path``).

    Returns:
        The main pickle's scan, the storage layout, the open file, and every reading.
    """
    reading, found = checked_reading(path, allowed, check_safety=check_safety, raw=raw)
    if raw is None:
        raw = open(local_path(path), "rb")  # noqa: SIM115 - owned by the Source, closed in close()
    try:
        layout, scan = _layout_for(path, raw, reading)
    except BaseException:
        raw.close()
        raise
    return scan, layout, raw, found


def _layout_for(path: Location, raw: Any, reading: Reading) -> tuple[ZipLayout, PickleScan]:
    """Where a torch file's storages lie, and its main pickle, from ``torch.load``'s reading."""
    if reading.kind == "torch-zip":
        layout = ZipLayout(path, raw)
        main = next((p for p in reading.pickles if p.label == layout.pickle_name), None)
        if main is None:
            raise FormatError(f"{path} is damaged: no {layout.pickle_name} was read")
        return layout, main.scan
    legacy = _LegacyLayout(path, raw, reading)
    return legacy, legacy.main


def _check_extents(
    path: Location, layout: ZipLayout, stubs: Iterable[tuple[str | None, TensorStub]]
) -> None:
    """Every tensor lies inside its storage, and every storage inside the file, from headers
    alone.

    Raises:
        FormatError: naming the tensor (when its key is given).
    """
    checked: set[str] = set()
    for key, stub in stubs:
        start, end = stub.byte_range()
        storage = stub.storage
        if end > start and end > storage.nbytes:  # empty tensors lie nowhere
            which = f"tensor '{key}'" if key is not None else "a tensor"
            raise FormatError(f"{path} is damaged: {which} runs past its storage")
        if storage.key not in checked:
            checked.add(storage.key)
            if storage.nbytes:
                layout.check(storage)  # raises when it does not fit


def structure_damage(path: Location, found: list[Reading], raw: Any = None) -> str | None:
    """What is damaged in a torch file beyond its pickles (storages that do not fit the file,
    tensors past their storage), from readings already made; None when whole. ``raw``: the
    file at a URL (a RangeFile), None for the local ``path``."""
    reading = found[0]
    if reading.kind not in ("torch-zip", "torch-legacy") or reading.damaged:
        return None
    if any(p.damaged for p in reading.pickles):
        return None  # said already
    whole = _WHOLE.get(id(reading))
    if whole is not None and whole() is reading:  # its Source checked every tensor on opening
        return None
    try:
        with open(local_path(path), "rb") if raw is None else contextlib.nullcontext(raw) as raw:
            layout, main = _layout_for(path, raw, reading)
            stubs = (n for n in nodes(main.root) if isinstance(n, TensorStub))
            _check_extents(path, layout, ((None, stub) for stub in stubs))
    except FormatError as exc:
        return exc.message
    return None


# Readings of files that a TorchFileSource found whole on opening (a flat state dict: every
# tensor in the file checked), so structure_damage need not read the directory again.
_WHOLE: dict[int, weakref.ref[Reading]] = {}


def _found_whole(reading: Reading) -> None:
    key = id(reading)
    _WHOLE[key] = weakref.ref(reading, lambda _: _WHOLE.pop(key, None))


def _unsafe_error(path: Location, unsafe: list[str]) -> UnsafeCheckpointError:
    dangerous = [g for g in unsafe if is_dangerous(g)]
    if dangerous:
        return UnsafeCheckpointError(
            f"{path} names globals that run code when loaded: {', '.join(unsafe)}",
            "only a file you trust can be loaded, with --trust",
            globals_=tuple(unsafe),
        )
    return UnsafeCheckpointError(
        f"{path} names globals outside torch's safe set: {', '.join(unsafe)}",
        "if you trust the file, admit each with --allow-global NAME "
        "(or load it fully with --trust)",
        globals_=tuple(unsafe),
    )


class TorchFileSource(Source):
    """A torch zip or legacy file read statically; tensors are views of a memory map."""

    def __init__(
        self,
        path: Location,
        *,
        select: str | None = None,
        allow_globals: Iterable[str] = (),
        check_safety: bool = True,
        ema: bool = False,
        raw: RangeFile | None = None,
    ) -> None:
        allowed = check_allowed(allow_globals)
        scan, self._layout, self._raw, self.readings = scan_torch_file(
            path, allowed, check_safety=check_safety, raw=raw
        )
        self.remote_file = raw  # the file at a URL; None on a local disk
        fmt = "torch-legacy" if isinstance(self._layout, _LegacyLayout) else "torch-zip"
        super().__init__(path=path, format=fmt, globals=list(scan.globals))
        self.scan = scan
        try:
            sel = select_state_dict(
                scan.root, _is_stub, _stub_nbytes, select=select, ema=ema, source=str(path)
            )
        except BaseException:
            self.close()
            raise
        self._stubs: dict[str, Any] = dict(self.adopt(sel))
        self._bases: dict[str, torch.Tensor] = {}
        self._entries: list[tuple[str, TensorInfo]] | None = None
        self._placeholders = _placeholders(scan.root, self._stubs) if sel.path == "module" else {}
        try:  # a damaged file is refused before anything is read or written
            stubs = ((k, s) for k, s in self._stubs.items() if isinstance(s, TensorStub))
            _check_extents(path, self._layout, stubs)
        except BaseException:
            self.close()
            raise
        root = scan.root
        if sel.path == "" and isinstance(root, dict) and len(root) == len(self._stubs):
            if all(type(value) is TensorStub for value in root.values()):
                _found_whole(self.readings[0])  # a flat state dict: no tensor left unchecked

    def entries(self) -> list[tuple[str, TensorInfo]]:
        if self._entries is None:  # made once: inspect and convert ask several times
            self._entries = self._make_entries()
        return list(self._entries)

    def _make_entries(self) -> list[tuple[str, TensorInfo]]:
        out = []
        for key, stub in self._stubs.items():
            if isinstance(stub, UnsupportedTensor):
                out.append(
                    (key, TensorInfo(stub.dtype, stub.shape, kind=stub.kind, detail=stub.detail))
                )
                continue
            if not isinstance(stub, TensorStub):  # a quantized module's packed values
                out.append((key, _module_value_info(stub)))
                continue
            if key in self._placeholders:
                out.append((key, TensorInfo(stub.dtype, stub.shape, kind="placeholder")))
                continue
            out.append(
                (
                    key,
                    TensorInfo(
                        dtype=stub.dtype,
                        shape=stub.shape,
                        storage=stub.storage.key,
                        byte_range=stub.byte_range(),
                        contiguous=stub.is_contiguous,
                    ),
                )
            )
        return out

    def value(self, key: str) -> Any:
        stub = self._stubs[key]
        return self.load(key) if isinstance(stub, TensorStub) else self.load_value(key)

    def module_versions(self, mapping: Mapping[str, str | None]) -> dict[str, Any] | None:
        if all(isinstance(stub, TensorStub) for stub in self._stubs.values()):
            return None
        versions = getattr(self._whole_state(), "_metadata", None)
        if not isinstance(versions, dict):
            return None
        moved = module_prefixes(versions, mapping)
        return {new: versions[old] for old, new in moved.items() if new is not None}

    def load_value(self, key: str) -> Any:
        """Through ``torch.load(weights_only=True)``: torch's own safe loader rebuilds sparse and
        quantized tensors and packed parameters (the file passed the same checks already)."""
        return self._whole_state()[key]

    def _whole_state(self) -> Any:
        """The selected state dict as torch's safe loader reads it (memory-mapped), once."""
        import warnings

        import torch

        if not hasattr(self, "_whole"):
            with warnings.catch_warnings():  # torch's deprecation notes on quantized storages
                warnings.simplefilter("ignore")
                # memory-mapped: a local file (tensors of a file at a URL are fetched instead)
                whole = torch.load(
                    local_path(self.path), map_location="cpu", weights_only=True, mmap=True
                )
            self._whole = node_at(whole, self.selected)
        return self._whole

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        stub = self._stubs[key]
        if not isinstance(stub, TensorStub) or not stub.is_contiguous:
            return None
        self._layout.locate_storages()  # a file at a URL: every header, in a few requests
        base = self._layout.data_offset(stub.storage)
        if base is None:
            return None
        start, end = stub.byte_range()
        if stub.numel and end > stub.storage.nbytes:
            raise FormatError(f"{self.path} is damaged: tensor '{key}' runs past its storage")
        return self.path, base + start, stub.nbytes

    def expected_crc(self, key: str) -> int | None:
        stub = self._stubs[key]
        if not self._layout.remote or not isinstance(stub, TensorStub):
            return None  # a local file's copied bytes are compared with the file itself
        if stub.byte_range() != (0, stub.storage.nbytes) or not stub.is_contiguous:
            return None  # a view of part of its storage: the member's CRC covers more
        return self._layout.member_crc(stub.storage)

    def load(self, key: str) -> torch.Tensor:
        stub = self._stubs[key]
        if isinstance(stub, UnsupportedTensor):
            raise FormatError(
                f"tensor '{key}' in {self.path} is {stub.kind}, which ckptkit cannot read",
                "convert it to a dense tensor in PyTorch first",
            )
        ref = stub.storage
        if ref.key in self._bases:
            base = self._bases[ref.key]
        elif self._layout.compressed(ref) or self._layout.remote:  # read anew, never kept
            base = self._layout.storage(ref)
        else:  # a view of the memory map
            base = self._bases[ref.key] = self._layout.storage(ref)
        if stub.dtype != ref.dtype:  # an UntypedStorage's bytes seen as the tensor's dtype
            base = base.view(torch_dtype(stub.dtype))
        start, end = stub.byte_range()
        if stub.numel and end > ref.nbytes:
            raise FormatError(f"{self.path} is damaged: tensor '{key}' runs past its storage")
        return base.as_strided(stub.shape, stub.stride, stub.offset)

    def stream(self, key: str, piece: int) -> Iterator[bytearray] | None:
        """A contiguous tensor of a compressed storage, decompressed ``piece`` bytes at a time
        and checked against the member's CRC-32 (see ``ZipLayout.stream``)."""
        stub = self._stubs[key]
        if not isinstance(stub, TensorStub) or not stub.is_contiguous:
            return None
        if not self._layout.compressed(stub.storage):
            return None
        start, end = stub.byte_range()
        if end > start and end > stub.storage.nbytes:
            raise FormatError(f"{self.path} is damaged: tensor '{key}' runs past its storage")
        return self._layout.stream(stub.storage, start, end, piece)

    def close(self) -> None:
        self._bases = {}
        self._raw.close()


def _module_value_info(value: Any) -> TensorInfo:
    """A quantized module's packed (weight, bias), or the dtype they were packed for."""
    if isinstance(value, tuple):
        parts = [v for v in value if isinstance(v, (TensorStub, UnsupportedTensor))]
        what = ", ".join(f"{getattr(v, 'detail', '') or v.dtype} {list(v.shape)}" for v in parts)
        first = parts[0] if parts else None
        return TensorInfo(
            first.dtype if first else "uint8",
            first.shape if first else (),
            kind="packed params",
            detail=what,
        )
    return TensorInfo("uint8", (), kind="value", detail=getattr(value, "name", repr(value)))


def _placeholders(root: Any, stubs: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Empty tensors whose real shape the file records elsewhere: the parameters of a DeepSpeed
    ZeRO-3 model-states file (``param_shapes``), whose weights are in the optimizer states."""
    recorded: dict[str, Any] = {}
    if isinstance(root, dict):
        for group in root.get("param_shapes") or ():
            if isinstance(group, dict):
                recorded.update(group)
        if isinstance(root.get("frozen_param_shapes"), dict):
            recorded.update(root["frozen_param_shapes"])
        if isinstance(root.get("shared_params"), dict):  # tied: alias -> the parameter it is
            recorded.update({a: recorded.get(t) for a, t in root["shared_params"].items()})
    out = {}
    for key, stub in stubs.items():
        shape = recorded.get(key)
        if (
            isinstance(stub, TensorStub)
            and stub.numel == 0
            and isinstance(shape, tuple)
            and all(type(n) is int for n in shape)
            and math.prod(shape)
        ):
            out[key] = shape
    return out


_QUANTIZED_AS = {"qint8": "int8", "quint8": "uint8", "qint32": "int32"}  # integer storage


@contextlib.contextmanager
def _current_folder_importable() -> Iterator[None]:
    """The current folder on ``sys.path`` while a trusted file is unpickled, as it is for
    ``python -c "torch.load(...)"`` run there (a console script's path does not hold it)."""
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def _modules_as_state_dicts(root: Any) -> Any:
    """``root`` with every ``nn.Module`` in it (at the top, or in dicts, lists and tuples) as
    its ``state_dict()``: a pickled whole model, or a trainer's ``{"model": module, "ema":
    module}``, gives its weights as a state dict would."""
    import torch

    def plain(obj: Any, depth: int) -> Any:
        if isinstance(obj, torch.nn.Module):
            return obj.state_dict()
        if depth > 32 or not isinstance(obj, (dict, list, tuple)):
            return obj
        items = list(obj.items() if isinstance(obj, dict) else enumerate(obj))
        new = {k: plain(v, depth + 1) for k, v in items}
        if all(new[k] is v for k, v in items):
            return obj  # nothing changed: kept as it is (a state dict keeps its _metadata)
        return new if isinstance(obj, dict) else list(new.values())

    return plain(root, 0)


class TrustedTorchSource(Source):
    """A torch file loaded with the full unpickler (``weights_only=False``): for trusted files only.

    ckptkit scans the pickle statically first, so the globals it imports are known and reported.
    """

    def __init__(self, path: Location, *, select: str | None = None, ema: bool = False) -> None:
        import torch

        scan, layout, raw, _ = scan_torch_file(path, check_safety=False)
        raw.close()
        is_zip = not isinstance(layout, _LegacyLayout)
        try:
            with _current_folder_importable():
                root = torch.load(
                    local_path(path), map_location="cpu", weights_only=False, mmap=is_zip
                )
        except Exception as exc:  # arbitrary code ran: report whatever it raised
            hint = (
                "run ckptkit from the folder that holds that module (as `python` would import "
                "it), or put it on PYTHONPATH"
                if isinstance(exc, ImportError)
                else None
            )
            raise FormatError(
                f"torch.load failed on {path}: {type(exc).__name__}: {exc}", hint
            ) from exc
        fmt = "torch-zip" if is_zip else "torch-legacy"
        super().__init__(path=path, format=fmt, globals=list(scan.globals))
        sel = select_state_dict(
            _modules_as_state_dicts(root),
            torch.is_tensor,
            lambda t: t.numel() * t.element_size(),
            select=select,
            ema=ema,
            source=str(path),
        )
        self._tensors: dict[str, torch.Tensor] = dict(self.adopt(sel))
        self._versions = getattr(sel.state_dict, "_metadata", None)

    def entries(self) -> list[tuple[str, TensorInfo]]:
        import torch

        out = []
        for key, t in self._tensors.items():
            if not torch.is_tensor(t):  # a quantized module's packed values
                kind = "packed params" if isinstance(t, tuple) else "value"
                out.append((key, TensorInfo("uint8", (), kind=kind, detail=repr(t)[:80])))
                continue
            if type(t) not in (torch.Tensor, torch.nn.Parameter):  # torchao, DTensor...
                cls = f"{type(t).__module__}.{type(t).__qualname__}"
                kind = "DTensor" if type(t).__name__ == "DTensor" else "tensor subclass"
                name = dtype_name(t.dtype)
                info = TensorInfo(name if name in DTYPES else "uint8", tuple(t.shape), kind=kind)
                out.append((key, replace(info, detail=cls)))
                continue
            if t.is_quantized or t.layout != torch.strided or t.is_meta:
                kind = "quantized" if t.is_quantized else "meta" if t.is_meta else "sparse"
                name = dtype_name(t.dtype)
                detail = name if t.is_quantized else str(t.layout).removeprefix("torch.")
                element = _QUANTIZED_AS.get(name, name if name in DTYPES else "uint8")
                info = TensorInfo(element, tuple(t.shape), kind=kind, detail=detail)
                out.append((key, info))
                continue
            start = t.storage_offset() * t.element_size()
            out.append(
                (
                    key,
                    TensorInfo(
                        dtype=dtype_name(t.dtype),
                        shape=tuple(t.shape),
                        storage=str(t.untyped_storage().data_ptr()),
                        byte_range=(int(start), int(start + t.numel() * t.element_size())),
                        contiguous=t.is_contiguous(),
                    ),
                )
            )
        return out

    def load(self, key: str) -> torch.Tensor:
        return self._tensors[key].detach()

    def value(self, key: str) -> Any:
        return self._tensors[key]

    def module_versions(self, mapping: Mapping[str, str | None]) -> dict[str, Any] | None:
        if not isinstance(self._versions, dict):
            return None
        moved = module_prefixes(self._versions, mapping)
        return {new: self._versions[old] for old, new in moved.items() if new is not None}

    def load_value(self, key: str) -> Any:
        return self._tensors[key]
