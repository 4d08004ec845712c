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

Reading (``ZipIndex``): an archive's central directory parsed compactly (``zipfile`` makes a
``ZipInfo`` a member: 50 MB and 0.5 s for 100,000 storages), local headers read in windows, and
a compressed member streamed through its decompressor in bounded pieces, checked against its
CRC-32 and size at the end, never whole in memory.
"""

from __future__ import annotations

import bz2
import os
import re
import struct
import uuid
import zipfile
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ckptkit.formats.base.dtypes import DTYPES, STORAGE_DTYPES, TensorSpec
from ckptkit.formats.pickles.writer import Call, PersistentId, Ref, _Writer
from ckptkit.storage.bytecopy import write_all

__all__ = [
    "ZipIndex",
    "ZipDamage",
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

    __slots__ = ("key", "dtype", "nbytes")

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
    importing torch (``pickle_write``), an entry at a time: the bytes of ``dumps`` of the whole
    ``OrderedDict``, without holding a record of every tensor (100,000 of them took 60 MB)."""
    aliases = aliases or {}
    storages: dict[str, StorageRecord] = {}
    writer = _Writer()
    if not bare:
        writer.save(Call(Ref("collections", "OrderedDict")))  # as dumps saves an OrderedDict
        writer.out += b"(" if specs else b""  # MARK, each key and tensor, SETITEMS
    for spec in specs:
        target = aliases.get(spec.key)
        if target in storages:
            storages[spec.key] = storages[target]
        else:
            storages[spec.key] = StorageRecord(str(len(storages)), spec.dtype, spec.nbytes)
        if not bare:
            writer.save(spec.key)
        if not bare or spec is specs[0]:
            writer.save(tensor_record(storages[spec.key], spec.dtype, tuple(spec.shape)))
    writer.out += b"u." if specs and not bare else b"."
    return bytes(writer.out), storages


def wrapped_pickle(
    root: dict[str, Any], states: dict[str, list[tuple[str, Any]]]
) -> tuple[bytes, dict[str, StorageRecord]]:
    """The pickle of ``root`` (a dict of plain values and the pickle writer's, in order) with
    a state dict at each of its keys that ``states`` names: its (key, value) entries in order,
    a value a tensor (its spec: its own storage, recorded under the spec's key) or another
    value (a Megatron module's ``_extra_state`` None), as ``torch.save`` writes a training
    checkpoint; and each tensor's storage record."""
    storages: dict[str, StorageRecord] = {}
    writer = _Writer()
    writer.out += b"}("  # EMPTY_DICT, MARK: each entry, then SETITEMS
    for name, value in root.items():
        writer.save(name)
        entries = states.get(name)
        if entries is None:
            writer.save(value)
            continue
        writer.save(Call(Ref("collections", "OrderedDict")))
        writer.out += b"(" if entries else b""
        for key, entry in entries:
            writer.save(key)
            if isinstance(entry, TensorSpec):
                storages[entry.key] = StorageRecord(str(len(storages)), entry.dtype, entry.nbytes)
                writer.save(tensor_record(storages[entry.key], entry.dtype, tuple(entry.shape)))
            else:
                writer.save(entry)
        writer.out += b"u" if entries else b""
    writer.out += b"u."
    return bytes(writer.out), storages


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


# -- reading -------------------------------------------------------------------------------

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory, up to its comment's length
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL_READ = struct.Struct("<4s4B4HL2L5H2L")  # as zipfile unpacks a central header
_LOCAL_READ = struct.Struct("<4s22sHH")  # signature, fixed fields, name length, extra length
_MAX_EXTRACT_VERSION = 63  # zipfile refuses members that need a later version
_WINDOW = 64 * 1024  # local headers are read in windows of this many bytes
# ...of a file at a URL: headers closer than this share a request; a far one costs _LOCAL_MAX.
_REMOTE_WINDOW = 64 * 1024
_LOCAL_MAX = 1024  # a local header with its name and extra field (torch pads to 64 bytes)
INFLATE_PIECE = 1024 * 1024  # compressed bytes fed to a decompressor at a time
_NOT_READ, _PAST_END, _BAD_HEADER = -1, -2, -3  # data offsets not known (yet), and why


class ZipDamage(Exception):
    """What is wrong with an archive's directory, a local header or a member's data."""


def _end_record(raw: Any) -> tuple[int, int, int]:
    """(central directory size, its offset as recorded, the bytes the archive is preceded
    by), from the end-of-central-directory record, as ``zipfile`` finds it (a comment after
    it, zip64 records before it)."""
    size = raw.seek(0, 2)
    location = -1
    if size >= _EOCD.size:
        raw.seek(size - _EOCD.size)
        tail = raw.read(_EOCD.size)
        if tail[:4] == b"PK\x05\x06" and tail[-2:] == b"\0\0":
            record, location = tail, size - _EOCD.size
        else:  # an archive comment: the record is in the last 64 kB
            start = max(size - (1 << 16) - _EOCD.size, 0)
            raw.seek(start)
            data = raw.read()
            found = data.rfind(b"PK\x05\x06")
            record = data[found : found + _EOCD.size]
            if found >= 0 and len(record) == _EOCD.size:
                location = start + found
    if location < 0:
        raise ZipDamage("no end of central directory record")
    fields = _EOCD.unpack(record)
    cd_size, cd_offset, zip64 = fields[5], fields[6], False
    if location >= _EOCD64_LOCATOR.size:
        raw.seek(location - _EOCD64_LOCATOR.size)
        sig, disk, _, disks = _EOCD64_LOCATOR.unpack(raw.read(_EOCD64_LOCATOR.size))
        if sig == b"PK\x06\x07":
            if disk != 0 or disks > 1:
                raise ZipDamage("an archive that spans several disks")
            at = location - _EOCD64_LOCATOR.size - _EOCD64.size
            if at >= 0:
                raw.seek(at)
                data = raw.read(_EOCD64.size)
                if len(data) == _EOCD64.size:
                    record64 = _EOCD64.unpack(data)
                    if record64[0] == b"PK\x06\x06":
                        cd_size, cd_offset, zip64 = record64[8], record64[9], True
    concat = location - cd_size - cd_offset
    if zip64:
        concat -= _EOCD64.size + _EOCD64_LOCATOR.size
    return cd_size, cd_offset, concat


class ZipIndex:
    """A zip archive's members as ``zipfile`` reads its central directory (names decoded the
    same way; of two members of one name the last wins), kept in arrays: where each local
    header is, the compression, the sizes and the CRC-32.

    Args:
        raw: the archive, a binary file object (seek, read) it starts at.

    Raises:
        ZipDamage: a central directory ``zipfile`` would not read either.
    """

    def __init__(self, raw: Any, *, locate_all: bool = True) -> None:
        self.raw = raw
        # Local: every local header read in one pass the first time one is needed. Remote
        # (a RangeFile): each when its member is read, as one request costs what a pass does.
        self.locate_all = locate_all
        self.size = raw.seek(0, 2)
        cd_size, cd_offset, concat = _end_record(raw)
        if cd_offset + concat < 0:
            raise ZipDamage("bad offset for the central directory")
        raw.seek(cd_offset + concat)
        directory = raw.read(cd_size)
        # Member numbers by name, in the directory's order; torch's storages ("<folder>/data/7")
        # by folder and number in arrays instead (100,000 names took 14 MB as a dict).
        self.names: dict[str, int] = {}
        self.numbered: dict[str, array[int]] = {}
        self.header = array("q")  # local header offset
        self.method = array("H")
        self.flags = array("H")
        self.packed = array("q")  # compressed size
        self.length = array("q")  # uncompressed size
        self.crc = array("I")
        self.data = array("q")  # where each member's data starts (see data_offset)
        pos, unpack = 0, _CENTRAL_READ.unpack_from
        while pos < cd_size:
            if pos + _CENTRAL_READ.size > len(directory):
                raise ZipDamage("truncated central directory")
            fields = unpack(directory, pos)
            if fields[0] != b"PK\x01\x02":
                raise ZipDamage("bad magic number for the central directory")
            if fields[3] > _MAX_EXTRACT_VERSION:
                raise ZipDamage(f"zip file version {fields[3] / 10:.1f}")
            flags, method, (crc, packed, length) = fields[5], fields[6], fields[9:12]
            name_len, extra_len, comment_len = fields[12:15]
            offset = fields[18]
            start = pos + _CENTRAL_READ.size
            raw_name = directory[start : start + name_len]
            if 0xFFFFFFFF in (packed, length, offset):
                extra = directory[start + name_len : start + name_len + extra_len]
                length, packed, offset = _zip64_sizes(extra, length, packed, offset)
            name = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
            name = name.split("\0", 1)[0]  # as ZipInfo cuts a name at NUL
            self._name(name, len(self.header))
            self.header.append(offset + concat)
            self.method.append(method)
            self.flags.append(flags)
            self.packed.append(packed)
            self.length.append(length)
            self.crc.append(crc)
            self.data.append(_NOT_READ)
            pos = start + name_len + extra_len + comment_len
        self.located = False

    def _name(self, name: str, member: int) -> None:
        folder, number = _numbered(name)
        if number < 0 or number > 4 * (len(self.header) + 1024):
            self.names[name] = member
            return
        column = self.numbered.setdefault(folder, array("q"))
        if len(column) <= number:
            column.extend([-1] * (number + 1 - len(column)))
        column[number] = member  # of two members of one name, the last (as zipfile)
        self.names.pop(name, None)

    def find(self, name: str) -> int | None:
        """A member's number, or None when the archive has none by that name."""
        member = self.names.get(name)
        if member is not None:
            return member
        folder, number = _numbered(name)
        column = self.numbered.get(folder) if number >= 0 else None
        if column is None or number >= len(column) or column[number] < 0:
            return None
        return column[number]

    def find_numbered(self, folder: str, number: str) -> int | None:
        """``find(folder + "data/" + number)``, for a storage's key as a pickle gives it."""
        column = self.numbered.get(folder)
        if column is None or not number.isdigit() or not number.isascii():
            return self.find(f"{folder}data/{number}")
        at = int(number)
        if at >= len(column) or column[at] < 0 or (number[0] == "0" and number != "0"):
            return self.find(f"{folder}data/{number}")
        return column[at]

    def other_names(self) -> list[str]:
        """The names of the members that are not numbered storages, in the directory's order."""
        return list(self.names)

    def data_offset(self, member: int) -> int:
        """Where a member's data starts (its local header read; all of them the first time, in
        windows, in file order).

        Raises:
            ZipDamage: its local header lies past the end, or is not one.
        """
        if not self.located:
            if self.locate_all:
                self._locate()
            elif self.data[member] == _NOT_READ:
                self.data[member] = self._local_data(self.header[member])
        offset = self.data[member]
        if offset == _PAST_END:
            raise ZipDamage("lies past the end")
        if offset < 0:
            raise ZipDamage("bad zip entry")
        return offset

    def _local_data(self, start: int) -> int:
        """Where the data after one local header starts (or why there is none)."""
        if not 0 <= start <= self.size - _LOCAL_READ.size:
            return _PAST_END
        self.raw.seek(start)
        head = self.raw.read(_LOCAL_READ.size)
        if len(head) < _LOCAL_READ.size:
            return _BAD_HEADER
        sig, _, name_len, extra_len = _LOCAL_READ.unpack(head)
        return (
            start + _LOCAL_READ.size + name_len + extra_len if sig == b"PK\x03\x04" else _BAD_HEADER
        )

    def locate_all_remote(self, read_many: Callable[[list[tuple[int, int]]], list[bytes]]) -> None:
        """Every member's data offset, for a file at a URL: the local headers read in windows
        of ``_REMOTE_WINDOW`` bytes (a window holds every header that starts in it), the
        windows fetched by ``read_many`` (several at once)."""
        order = sorted(range(len(self.header)), key=self.header.__getitem__)
        windows: list[tuple[int, int]] = []
        for member in order:
            start = self.header[member]
            if not 0 <= start <= self.size - _LOCAL_READ.size:
                continue
            end = min(start + _LOCAL_MAX, self.size)
            if windows and end - windows[-1][0] <= _REMOTE_WINDOW:  # close by: one request
                windows[-1] = (windows[-1][0], max(windows[-1][1], end))
            else:
                windows.append((start, end))
        found = dict(zip((w[0] for w in windows), read_many(windows), strict=True))
        at, window = -1, b""
        for member in order:
            start = self.header[member]
            if not 0 <= start <= self.size - _LOCAL_READ.size:
                self.data[member] = _PAST_END
                continue
            if start in found:
                at, window = start, found[start]
            head = window[start - at : start - at + _LOCAL_READ.size] if at >= 0 else b""
            if len(head) < _LOCAL_READ.size:
                self.data[member] = _BAD_HEADER
                continue
            sig, _, name_len, extra_len = _LOCAL_READ.unpack(head)
            self.data[member] = (
                start + _LOCAL_READ.size + name_len + extra_len
                if sig == b"PK\x03\x04"
                else _BAD_HEADER
            )
        self.located = True

    def fits(self, member: int, name: str) -> bool:
        """Whether a member can lie inside the file, by its directory entry alone (its local
        header, which a remote file would need a request each to read, assumed as long as
        the directory's name with no extra field)."""
        least = self.header[member] + _LOCAL_READ.size + len(name.encode()) + self.packed[member]
        return 0 <= self.header[member] and least <= self.size

    def _locate(self) -> None:
        """Every member's data offset from its local header, reading the file in windows of
        ``_WINDOW`` bytes in header order (a header a read, when members are large)."""
        order = sorted(range(len(self.header)), key=self.header.__getitem__)
        window, at = b"", 0
        for member in order:
            start = self.header[member]
            if not 0 <= start <= self.size - _LOCAL_READ.size:
                self.data[member] = _PAST_END
                continue
            if not at <= start <= at + len(window) - _LOCAL_READ.size:
                self.raw.seek(start)
                window, at = self.raw.read(_WINDOW), start
                if len(window) < _LOCAL_READ.size:  # a short read: the file changed
                    self.data[member] = _BAD_HEADER
                    continue
            sig, _, name_len, extra_len = _LOCAL_READ.unpack_from(window, start - at)
            ok = sig == b"PK\x03\x04"
            self.data[member] = (
                start + _LOCAL_READ.size + name_len + extra_len if ok else _BAD_HEADER
            )
        self.located = True

    def inflate(self, member: int, piece: int = INFLATE_PIECE) -> Iterator[bytes]:
        """A compressed member's bytes, decompressed a piece at a time (at most ``piece``
        bytes each), checked at the end against the size and CRC-32 the directory records.

        Raises:
            ZipDamage: an unknown method, an encrypted member, damaged compressed data, a
                wrong size or CRC-32.
        """
        if self.flags[member] & 0x1:
            raise ZipDamage("it is encrypted")
        decompressor = _decompressor(self.method[member])
        start, left = self.data_offset(member), self.packed[member]
        if start + left > self.size:
            raise ZipDamage("it is truncated")
        crc, made, length = 0, 0, self.length[member]
        pending = b""  # compressed bytes the decompressor has not taken yet
        while True:
            if not pending and left:
                self.raw.seek(start)
                pending = self.raw.read(min(left, INFLATE_PIECE))
                if not pending:
                    raise ZipDamage("it is truncated")
                start, left = start + len(pending), left - len(pending)
            try:
                out, pending = _feed(decompressor, pending, piece)
            except (zlib.error, OSError, EOFError, ValueError) as exc:
                raise ZipDamage(f"its compressed data is damaged ({exc})") from None
            if out:
                made += len(out)
                if made > length:
                    raise ZipDamage(f"it holds more than the {length} bytes it declares")
                crc = zlib.crc32(out, crc)
                yield out
            elif not pending and not left:
                break
        if made != length:
            raise ZipDamage(f"it holds {made} bytes, not the {length} it declares")
        if crc != self.crc[member]:
            raise ZipDamage("its CRC-32 does not match its data")


def _numbered(name: str) -> tuple[str, int]:
    """``("archive/", 7)`` for ``archive/data/7`` (a storage torch names by its number), else
    ``("", -1)``."""
    match = _NUMBERED.match(name)
    return (match[1], int(match[2])) if match else ("", -1)


_NUMBERED = re.compile(r"(|.*/)data/(0|[1-9][0-9]*)\Z", re.DOTALL)


def _zip64_sizes(extra: bytes, length: int, packed: int, offset: int) -> tuple[int, int, int]:
    """The sizes and offset a zip64 extra field gives for the fields that overflowed."""
    while len(extra) >= 4:
        kind, size = struct.unpack("<HH", extra[:4])
        if size + 4 > len(extra):
            raise ZipDamage(f"corrupt extra field {kind:04x} (size={size})")
        if kind == 0x0001:
            data = extra[4 : size + 4]
            try:
                if length in (0xFFFFFFFFFFFFFFFF, 0xFFFFFFFF):
                    (length,), data = struct.unpack("<Q", data[:8]), data[8:]
                if packed == 0xFFFFFFFF:
                    (packed,), data = struct.unpack("<Q", data[:8]), data[8:]
                if offset == 0xFFFFFFFF:
                    (offset,) = struct.unpack("<Q", data[:8])
            except struct.error:
                raise ZipDamage("corrupt zip64 extra field") from None
        extra = extra[size + 4 :]
    return length, packed, offset


def _decompressor(method: int) -> Any:
    if method == zipfile.ZIP_DEFLATED:
        return zlib.decompressobj(-15)
    if method == zipfile.ZIP_BZIP2:
        return bz2.BZ2Decompressor()
    if method == zipfile.ZIP_LZMA:
        return zipfile.LZMADecompressor()  # type: ignore[attr-defined]  # zip's LZMA header
    raise ZipDamage(f"it is compressed with method {method}, which zip readers do not know")


def _feed(decompressor: Any, data: bytes, piece: int) -> tuple[bytes, bytes]:
    """Up to ``piece`` bytes out of ``data``, and what of ``data`` is left to feed."""
    if hasattr(decompressor, "unconsumed_tail"):  # zlib's (deflate)
        out = decompressor.decompress(data, piece)
        return out, decompressor.unconsumed_tail
    if getattr(decompressor, "eof", False):  # past the end: what follows is not its data
        return b"", b""
    if isinstance(decompressor, bz2.BZ2Decompressor):
        out = decompressor.decompress(data, piece)
        return out, b""  # it keeps what it did not take; an empty feed drains it
    # zip's LZMA (never torch's): no output limit, so it is fed 1 kB at a time (a piece is at
    # most what LZMA makes of 1 kB, a few MB)
    return decompressor.decompress(data[:1024]), data[1024:]
