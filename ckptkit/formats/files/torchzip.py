"""Writing torch's zip format ourselves, so tensor bytes go from the source straight to the file.

``torch.save`` needs every tensor in memory and runs each record through its own zip writer.
Here the pickle is made from the specs alone (the same pickle torch writes, without importing
torch), and each storage
record is written by a callback at the file's current position: a byte copy from the source
(see ``bytecopy``) or a tensor's bytes. The archive is laid out as torch lays it out: records
``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/<n>``,
``version``, ``.data/serialization_id``, every record's data 64-byte aligned (a padding extra
field, as torch's writer adds), zip64 where sizes or offsets need it.

One departure: storage records carry a CRC-32 of 0, as ``torch.save`` writes them under
``torch.serialization.set_crc32_options(False)``. ``torch.load`` and DCP never check record
CRCs, and computing them would cost more than the copy itself (2 GB/s against 6 GB/s here);
ckptkit compares every written byte with its source instead. The small records carry real
CRCs, so ``zipfile`` reads the pickle as it would torch's.

An archive may start anywhere in a file: its offsets count from its own start, which is how
DCP stores each tensor chunk inside a ``.distcp`` file.
"""

from __future__ import annotations

import os
import struct
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptkit.formats.base.dtypes import DTYPES, STORAGE_DTYPES, TensorSpec
from ckptkit.formats.io.bytecopy import write_all
from ckptkit.formats.pickles.writer import Call, PersistentId, Ref, dumps

__all__ = [
    "ArchiveWriter",
    "state_pickle",
    "tensor_record",
    "begin_archive",
    "StorageRecord",
    "ALIGNMENT",
]

ALIGNMENT = 64  # torch's writer aligns every record's data to 64 bytes (.storage_alignment)
PREFIX = "archive/"
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, before name and extra field
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_MAX32 = 0xFFFFFFFF
_UTF8 = 0x0800
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01: the output does not depend on the clock
_PAD_ID = 0x4246  # "FB": the id torch's writer gives its padding field


@dataclass
class _Record:
    name: str
    offset: int  # of its local header, from the archive's start
    size: int
    crc: int


class ArchiveWriter:
    """Writes one torch zip archive at ``fd``'s current position, record by record.

    Args:
        fd: an open file, written sequentially from where it stands.
        zip64: write every record with zip64 fields (tests; large archives get them anyway).
    """

    def __init__(self, fd: int, *, zip64: bool = False) -> None:
        self.fd, self.zip64 = fd, zip64
        self.base = os.lseek(fd, 0, os.SEEK_CUR)
        self.records: list[_Record] = []

    @property
    def position(self) -> int:
        """Where the next byte goes, from the archive's start."""
        return os.lseek(self.fd, 0, os.SEEK_CUR) - self.base

    def add(self, name: str, data: bytes) -> None:
        """A small record, written from memory with its CRC."""
        self.add_stream(
            name, len(data), lambda: write_all(self.fd, memoryview(data)), crc=zlib.crc32(data)
        )

    def add_stream(self, name: str, size: int, write: Callable[[], None], *, crc: int = 0) -> int:
        """A record whose ``size`` bytes ``write`` puts at the file's current position (a copy
        from the source). Returns where its data starts, from the archive's start."""
        name = PREFIX + name
        start = self.position
        wide = self.zip64 or size >= _MAX32
        extra = struct.pack("<HHQQ", 1, 16, size, size) if wide else b""
        # The padding field puts the data on the alignment, as torch's writer does.
        used = start + _LOCAL.size + len(name) + len(extra) + 4
        extra += struct.pack("<HH", _PAD_ID, -used % ALIGNMENT) + b"Z" * (-used % ALIGNMENT)
        header = _LOCAL.pack(
            0x04034B50,
            45 if wide else 20,
            _UTF8,
            0,
            0,
            _DOS_DATE,
            crc,
            _MAX32 if wide else size,
            _MAX32 if wide else size,
            len(name),
            len(extra),
        )
        write_all(self.fd, memoryview(header + name.encode() + extra))
        data_start = self.position
        write()
        if self.position - data_start != size:
            raise AssertionError(f"record {name} got {self.position - data_start} of {size} bytes")
        self.records.append(_Record(name, start, size, crc))
        return data_start

    def finish(self) -> int:
        """Add torch's closing records and the central directory. Returns the archive's
        length."""
        self.add("version", b"3\n")
        self.add(".data/serialization_id", f"{uuid.uuid4().int:040d}"[-40:].encode())
        central = bytearray()
        for rec in self.records:
            wide = [v for v in (rec.size, rec.size, rec.offset) if self.zip64 or v >= _MAX32]
            extra = struct.pack(f"<HH{len(wide)}Q", 1, 8 * len(wide), *wide) if wide else b""
            small = [
                v if not (self.zip64 or v >= _MAX32) else _MAX32
                for v in (rec.size, rec.size, rec.offset)
            ]
            central += _CENTRAL.pack(
                0x02014B50,
                45,
                45 if wide else 20,
                _UTF8,
                0,
                0,
                _DOS_DATE,
                rec.crc,
                small[0],
                small[1],
                len(rec.name),
                len(extra),
                0,
                0,
                0,
                0,
                small[2],
            )
            central += rec.name.encode() + extra
        start, count = self.position, len(self.records)
        tail = bytes(central)
        if self.zip64 or start + len(central) >= _MAX32 or count >= 0xFFFF:
            end64 = start + len(central)
            tail += _ZIP64_END.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, len(central), start)
            tail += _ZIP64_LOCATOR.pack(0x07064B50, 0, end64, 1)
            tail += _END.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _MAX32, _MAX32, 0)
        else:
            tail += _END.pack(0x06054B50, 0, 0, count, count, len(central), start, 0)
        write_all(self.fd, memoryview(tail))
        return self.position


class StorageRecord:
    """A storage of the archive: its record name (``data/<key>``), dtype and size."""

    def __init__(self, key: str, dtype: str, nbytes: int) -> None:
        self.key, self.dtype, self.nbytes = key, dtype, nbytes


# dtype -> torch's legacy typed-storage class name (dtypes without one use UntypedStorage).
_TYPED_STORAGES = {dt: cls for cls, dt in STORAGE_DTYPES.items() if cls != "UntypedStorage"}


def tensor_record(
    storage: StorageRecord,
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...] | None = None,
    offset: int = 0,
) -> Call:
    """A CPU tensor whose storage is a record of the archive, as torch pickles it (a view:
    ``stride`` and ``offset``, in elements; contiguous when ``stride`` is None)."""
    if dtype in _TYPED_STORAGES:
        storage_type = Ref("torch", _TYPED_STORAGES[dtype])
        numel = storage.nbytes // DTYPES[dtype].itemsize
    else:
        storage_type, numel = Ref("torch.storage", "UntypedStorage"), storage.nbytes
    if stride is None:
        steps: list[int] = []
        step = 1
        for size in reversed(shape):
            steps.insert(0, step)
            step *= size
        stride = tuple(steps)
    args: tuple[Any, ...] = (
        PersistentId(("storage", storage_type, storage.key, "cpu", numel)),
        offset,
        tuple(shape),
        tuple(stride),
        False,
        OrderedDict(),
    )
    if dtype in _TYPED_STORAGES:
        return Call(Ref("torch._utils", "_rebuild_tensor_v2"), args)
    return Call(Ref("torch._utils", "_rebuild_tensor_v3"), (*args, Ref("torch", dtype)))


def state_pickle(
    specs: list[TensorSpec], aliases: Mapping[str, str] | None = None, *, bare: bool = False
) -> tuple[bytes, dict[str, StorageRecord]]:
    """The pickle of a state dict of ``specs`` as torch writes it (an alias shares its target's
    storage, so ties survive), and each key's storage record. With ``bare`` the single spec's
    tensor is the root, as ``torch.save(tensor)`` writes it (a DCP chunk). Made without
    importing torch (``pickle_write``)."""
    aliases = aliases or {}
    storages: dict[str, StorageRecord] = {}
    state: OrderedDict[str, Call] = OrderedDict()
    for spec in specs:
        target = aliases.get(spec.key)
        if target in storages:
            storages[spec.key] = storages[target]
        else:
            storages[spec.key] = StorageRecord(str(len(storages)), spec.dtype, spec.nbytes)
        state[spec.key] = tensor_record(storages[spec.key], spec.dtype, tuple(spec.shape))
    return dumps(next(iter(state.values())) if bare else state), storages


def begin_archive(fd: int, pickle_bytes: bytes, *, zip64: bool = False) -> ArchiveWriter:
    """An archive with torch's leading records written: the pickle and the format records."""
    archive = ArchiveWriter(fd, zip64=zip64)
    leading = {
        "data.pkl": pickle_bytes,
        ".format_version": b"1",
        ".storage_alignment": str(ALIGNMENT).encode(),
        "byteorder": b"little",
    }
    for name, value in leading.items():
        archive.add(name, value)
    return archive
