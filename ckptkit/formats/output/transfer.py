"""Moving tensors from a Source into output files, and checking what was written.

A tensor whose bytes lie in the source file as they must in the output (contiguous, same dtype)
is copied file to file (see ``bytecopy``), never entering Python objects, and torch is not even
imported; any other tensor (strided, cast, compressed) goes through torch a piece at a time.
Verification compares the file's bytes with the source byte ranges for copied tensors, and with
output bytes made again from the source for the rest (``.pt`` output is reloaded).
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import VerificationError
from ckptkit.formats.base.dtypes import DTYPES, TensorSpec
from ckptkit.formats.base.source import Source
from ckptkit.formats.files.safetensors import read_header, write_safetensors
from ckptkit.formats.io.bytecopy import (
    RangeReader,
    copy_range,
    preallocate,
    read_into,
    release_pages,
    same_bytes,
    write_all,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Item", "Transfer", "PIECE"]

PIECE = 4 * 1024 * 1024  # output bytes per step of a tensor that goes through torch
RELEASE_AFTER = 256 * 1024 * 1024  # written bytes before a range leaves the page cache


@dataclass(frozen=True)
class Item:
    """One output tensor: where it comes from and what it becomes."""

    old: str
    spec: TensorSpec
    source_dtype: str

    @property
    def cast(self) -> bool:
        return self.spec.dtype != self.source_dtype


@dataclass
class Transfer:
    """Writes items from ``source``; counts how each went and which casts overflowed."""

    source: Source
    progress: Callable[[int], None] = lambda nbytes: None
    copied: int = 0
    through_torch: int = 0
    overflowed: list[str] = field(default_factory=list)
    _files: RangeReader = field(default_factory=RangeReader)
    _checks: dict[str, list[Future[bool]]] = field(default_factory=dict)
    _checker: ThreadPoolExecutor | None = None
    _flushing: deque[tuple[int, int, int]] = field(default_factory=deque)  # fd, offset, count
    _flushing_bytes: int = 0

    def close(self) -> None:
        if self._checker is not None:
            self._checker.shutdown(wait=True)
        self._files.close()

    def _written(self, key: str, dst: Path, start: int, count: int,
                 source: tuple[int, int] | None) -> None:  # fmt: skip
        """After a tensor's bytes are written, hand them to the worker thread (see
        :meth:`_settle`), which works while the next tensor is written."""
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-verify")
        done = self._checker.submit(self._settle, source, self._fd(dst), start, count)
        if source is not None:
            self._checks.setdefault(key, []).append(done)

    def _settle(self, source: tuple[int, int] | None, fd: int, start: int, count: int) -> bool:
        """In the worker thread: compare a written range with its ``source`` range (fd, offset)
        when given, then start its write-back, so the final fsync finds little left to do.

        Ranges written ``RELEASE_AFTER`` bytes earlier, on disk by now, leave the page cache,
        as with ``dd oflag=nocache``: a conversion does not push a checkpoint's worth of other
        files out of memory, and the pages it frees are the ones it writes into next (on a VM,
        pages the host has taken back are slow to touch again: 0.52 s instead of 1.08 s here).
        """
        same = source is None or same_bytes(*source, fd, start, count)
        release_pages(fd, start, count)  # compared first: released pages may leave the cache
        self._flushing.append((fd, start, count))
        self._flushing_bytes += count
        while self._flushing_bytes - self._flushing[0][2] >= RELEASE_AFTER:  # written since
            fd, start, count = self._flushing.popleft()
            self._flushing_bytes -= count
            release_pages(fd, start, count)
        return same

    def _fd(self, path: Path) -> int:
        return self._files.fd(path)

    def tensor(self, item: Item) -> torch.Tensor:
        """The output tensor as torch sees it: loaded, cast if asked, contiguous."""
        from ckptkit.formats.base.tensors import torch_dtype

        tensor = self.source.load(item.old)
        if item.cast:
            tensor = tensor.to(torch_dtype(item.spec.dtype))
        return tensor.contiguous()

    def _pieces(self, item: Item) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A tensor that goes through torch as (source piece, output piece) pairs of about
        ``PIECE`` output bytes, in output order.

        The source tensor is a view of the mapped file and each piece is cast into one reused
        buffer, so memory holds a piece, not the tensor (only a strided tensor is copied whole
        once, to lay it out flat). Allocating nothing per piece also keeps glibc from hoarding
        freed memory: a fresh cast tensor each time grew the heap by 16 MB per tensor.
        """
        import torch

        from ckptkit.formats.base.tensors import torch_dtype

        flat = self.source.load(item.old).reshape(-1)  # a view, unless the tensor is strided
        step = max(1, PIECE // DTYPES[item.spec.dtype].itemsize)
        cast_into = torch.empty(min(step, flat.numel()), dtype=torch_dtype(item.spec.dtype))
        for begin in range(0, flat.numel(), step):
            piece = flat[begin : begin + step]
            # A 1-D strided tensor stays a strided view through reshape: copy it a piece at a
            # time (a no-op for contiguous pieces).
            yield piece, (cast_into[: len(piece)].copy_(piece) if item.cast else piece.contiguous())

    def _write(
        self, items: dict[str, Item], dst: Path, verify: bool
    ) -> Callable[[int, TensorSpec], None]:
        def write(fd: int, spec: TensorSpec) -> None:
            item = items[spec.key]
            pieces = None if item.cast else self.source.byte_pieces(item.old)
            if pieces is not None:
                for path, offset, length in pieces:  # one range, or a sharded layout's several
                    start = os.lseek(fd, 0, os.SEEK_CUR)
                    copy_range(self._fd(path), offset, length, fd)
                    compare = (self._fd(path), offset) if verify else None
                    self._written(spec.key, dst, start, length, compare)
                self.copied += 1
            else:
                start = os.lseek(fd, 0, os.SEEK_CUR)
                overflowed = False
                for before, after in self._pieces(item):
                    overflowed = overflowed or (item.cast and _overflows(before, after))
                    write_all(fd, _raw(after))
                if overflowed:
                    self.overflowed.append(spec.key)
                self._written(spec.key, dst, start, spec.nbytes, None)  # compared in the end
                self.through_torch += 1
            self.progress(spec.nbytes)

        return write

    def write_safetensors(
        self, path: Path, items: list[Item], metadata: dict[str, str], *, verify: bool = True
    ) -> None:
        """Write items (in order) as one safetensors file; with ``verify``, copied tensors are
        compared with their source while the rest is written (see :meth:`verify_safetensors`)."""
        writer = self._write({i.spec.key: i for i in items}, path, verify)
        write_safetensors(path, [i.spec for i in items], metadata, writer)

    def verify_safetensors(
        self, path: Path, items: list[Item], metadata: dict[str, str], shown: Path
    ) -> None:
        """Re-read the header and compare every tensor's bytes with its source: copied ones as
        they were written, the rest with their output bytes made again from the source."""
        header, data_start = read_header(path)
        if header.pop("__metadata__", {}) != metadata:
            raise VerificationError(
                f"the metadata read back from {shown} differs; nothing was written"
            )
        expected = {i.spec.key: i for i in items}
        if set(header) != set(expected):
            raise VerificationError(f"{shown} would not hold the planned keys; nothing was written")
        via_torch = []
        for key, item in expected.items():
            entry = header[key]
            begin, end = entry["data_offsets"]
            if (
                list(entry["shape"]) != list(item.spec.shape)
                or entry["dtype"] != DTYPES[item.spec.dtype].safetensors
                or end - begin != item.spec.nbytes
            ):
                raise VerificationError(f"tensor '{key}' in {shown} has the wrong shape or dtype")
            checks = self._checks.pop(key, None)
            if checks is None:
                via_torch.append((item, data_start + begin))
                continue
            if not all(check.result() for check in checks):  # compared as it was written
                raise _differs(key, shown)
            self.progress(item.spec.nbytes)
        for item, offset in via_torch:
            if not self._same_as_pieces(self._fd(path), offset, item):
                raise _differs(item.spec.key, shown)
            self.progress(item.spec.nbytes)

    def _same_as_pieces(self, fd: int, offset: int, item: Item) -> bool:
        """True when the file holds, from ``offset``, the output bytes of ``item`` made anew."""
        buf = bytearray()
        for _, after in self._pieces(item):
            piece = _raw(after)
            if len(buf) != len(piece):
                buf = bytearray(len(piece))
            if not read_into(fd, buf, offset) or buf != piece:  # bytearray == view: memcmp
                return False
            offset += len(buf)
        return True

    def write_torch(
        self, path: Path, items: list[Item], aliases: dict[str, str], *, verify: bool = True
    ) -> None:
        """Write items as a plain ``.pt`` state dict (ties kept: an alias shares its target's
        storage), laid out as ``torch.save`` lays it out (see ``torchzip``), each storage's
        bytes copied from the source where they lie as they must, else made by torch a piece
        at a time. With ``verify`` copied bytes are compared as they are written."""
        from ckptkit.formats.files.torchzip import begin_archive, state_pickle

        by_key = {item.spec.key: item for item in items}
        pickled, storages = state_pickle([item.spec for item in items], aliases)
        write = self._write(by_key, path, verify)
        unique: dict[str, Item] = {}  # each storage record, written from its first key
        for item in items:
            unique.setdefault(storages[item.spec.key].key, item)
        estimate = len(pickled) + sum(i.spec.nbytes for i in unique.values()) + 256 * len(unique)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)  # atomic_outputs' empty temp file
        try:
            preallocate(fd, estimate + 4096)
            archive = begin_archive(fd, pickled)
            for record, item in unique.items():
                archive.add_stream(f"data/{record}", item.spec.nbytes,
                                   functools.partial(write, fd, item.spec))  # fmt: skip
            for alias in set(aliases) & set(by_key):  # written once, with its target
                self.progress(by_key[alias].spec.nbytes)
            archive.finish()
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))  # drop what preallocation added
        finally:
            os.close(fd)

    def save_values(
        self, path: Path, items: list[Item], aliases: dict[str, str], special: set[str]
    ) -> None:
        """Write items with ``torch.save``, which keeps what ``write_torch`` does not lay out
        itself: sparse and quantized tensors and packed parameters (``special`` source keys),
        as torch's safe loader read them. Such state dicts are small (quantized models, sparse
        buffers), so all of it is in memory at once."""
        import torch

        values: OrderedDict[str, Any] = OrderedDict()
        for item in items:
            target = aliases.get(item.spec.key, "")
            if target in values:
                values[item.spec.key] = values[target]
            elif item.old in special:
                values[item.spec.key] = self.source.load_value(item.old)
            else:
                values[item.spec.key] = self.tensor(item)
            self.through_torch += 1
            self.progress(item.spec.nbytes)
        versions = self.source.module_versions({i.old: i.spec.key for i in items})
        if versions is not None:  # as state_dict() leaves them: quantized modules read them
            values._metadata = versions  # type: ignore[attr-defined]
        with open(path, "r+b") as f:  # the temp file atomic_outputs made
            torch.save(values, f)

    def verify_torch(
        self,
        path: Path,
        items: list[Item],
        aliases: dict[str, str],
        shown: Path,
    ) -> None:
        """Read the written ``.pt`` back statically and compare it with the plan: the keys,
        dtypes, shapes and ties, then every tensor's bytes (copied ones as they were written,
        the rest with their output bytes made again from the source)."""
        from ckptkit.formats.files.torchfile import TorchFileSource

        with TorchFileSource(path) as written:
            self._compare(written, items, aliases, shown)

    def write_dcp(
        self, folder: Path, items: list[Item], aliases: dict[str, str], header: dict[str, str],
        *, verify: bool = True,
    ) -> None:  # fmt: skip
        """Write items as a DCP folder, as one writer of ``dcp.save`` lays it out: each tensor
        one whole chunk, a ``torch.save`` archive in ``__0_0.distcp`` (made as for
        :meth:`write_torch`), then ``.metadata``; an alias names its target's chunk, so ties
        survive. ``header`` goes beside them in ``ckptkit.json``."""
        import json

        from ckptkit.formats.files.torchzip import begin_archive, state_pickle
        from ckptkit.formats.folders.dcp import DISTCP, METADATA, SIDECAR, dcp_metadata

        by_key = {item.spec.key: item for item in items}
        data = folder / DISTCP
        write = self._write(by_key, data, verify)
        where: dict[str, tuple[int, int]] = {}
        fd = os.open(data, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            preallocate(fd, sum(i.spec.nbytes + 2048 for i in items))
            for item in items:
                if item.spec.key in aliases:
                    self.progress(item.spec.nbytes)  # written once, with its target
                    continue
                start = os.lseek(fd, 0, os.SEEK_CUR)
                archive = begin_archive(fd, state_pickle([item.spec], bare=True)[0])
                archive.add_stream("data/0", item.spec.nbytes,
                                   functools.partial(write, fd, item.spec))  # fmt: skip
                where[item.spec.key] = (start, archive.finish())
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))
            os.fsync(fd)
        finally:
            os.close(fd)
        layout = [
            (i.spec.key, i.spec.dtype, tuple(i.spec.shape), DISTCP,
             *where[aliases.get(i.spec.key, i.spec.key)])
            for i in items
        ]  # fmt: skip
        for name, content in ((SIDECAR, json.dumps(header, indent=1).encode()),
                              (METADATA, dcp_metadata(layout))):  # fmt: skip
            with open(folder / name, "xb") as f:  # .metadata last, as dcp.save writes it
                f.write(content)
                os.fsync(f.fileno())

    def verify_dcp(
        self, folder: Path, items: list[Item], aliases: dict[str, str], header: dict[str, str],
        shown: Path,
    ) -> None:  # fmt: skip
        """Read the written DCP folder back statically, as any DCP folder is read, and compare
        it with the plan: keys, dtypes, shapes, ties, metadata, then every tensor's bytes."""
        from ckptkit.formats.folders.dcp import DCPSource

        with DCPSource(folder) as written:
            if written.metadata != header:
                raise VerificationError(
                    f"the metadata read back from {shown} differs; nothing was written"
                )
            self._compare(written, items, aliases, shown)

    def _compare(
        self, written: Source, items: list[Item], aliases: dict[str, str], shown: Path
    ) -> None:
        """What a reader gives of a written output against the plan: keys, ties, dtypes and
        shapes, then every tensor's bytes (each one range of the output)."""
        entries = dict(written.entries())
        if set(entries) != {i.spec.key for i in items}:
            raise VerificationError(f"{shown} would not hold the planned keys; nothing was written")
        if written.aliases() != aliases:
            raise VerificationError(f"the ties read back from {shown} differ from the plan")
        for item in items:
            info = entries[item.spec.key]
            pieces = written.byte_pieces(item.spec.key)
            if (info.dtype, info.shape) != (item.spec.dtype, tuple(item.spec.shape)) or (
                pieces is None or len(pieces) != 1
            ):  # fmt: skip
                raise VerificationError(
                    f"tensor '{item.spec.key}' in {shown} has the wrong shape or dtype"
                )
            self._check(item, pieces[0][0], pieces[0][1], shown, skip=item.spec.key in aliases)

    def _check(self, item: Item, path: Path, offset: int, shown: Path, *, skip: bool) -> None:
        """One written tensor's bytes: copied ones as compared while written, the rest made
        again from the source; an alias's are its target's, checked there."""
        if not skip:
            checks = self._checks.pop(item.spec.key, None)
            if checks is not None:
                same = all(check.result() for check in checks)
            else:
                same = self._same_as_pieces(self._fd(path), offset, item)
            if not same:
                raise _differs(item.spec.key, shown)
        self.progress(item.spec.nbytes)

    def verify_values(
        self, path: Path, items: list[Item], shown: Path, special: Iterable[str] = ()
    ) -> None:
        """Reload what :meth:`save_values` wrote with torch's safe loader and compare every
        value with the source."""
        import torch

        from ckptkit.formats.base.tensors import bit_equal, same_value

        special = set(special)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if set(state) != {i.spec.key for i in items}:
            raise VerificationError(f"{shown} would not hold the planned keys; nothing was written")
        for item in items:
            written = state[item.spec.key]
            if item.old in special:
                same = same_value(written, self.source.load_value(item.old))
            else:
                same = bit_equal(written, self.tensor(item))
            if not same:
                raise _differs(item.spec.key, shown)
            self.progress(item.spec.nbytes)


def _differs(key: str, shown: Path) -> VerificationError:
    return VerificationError(
        f"tensor '{key}' read back from {shown} differs from the source; nothing was written",
        "report this with CKPTKIT_DEBUG=1 output",
    )


def _raw(tensor: Any) -> memoryview:
    from ckptkit.formats.base.tensors import as_bytes

    return as_bytes(tensor)


def _overflows(before: Any, after: Any) -> bool:
    """Finite values that became infinite in the cast."""
    import torch

    # The smallest and largest values are finite (NaN propagates) exactly when every value is:
    # one pass and no allocation. Only a cast with inf or NaN in it needs the masks below.
    if after.numel() == 0 or all(torch.isfinite(v) for v in torch.aminmax(after)):
        return False
    before, after = before.reshape(-1), after.reshape(-1)
    step = max(1, PIECE // 4)  # the masks a piece at a time, never as large as the tensor
    for begin in range(0, before.numel(), step):
        end = begin + step
        if (torch.isfinite(before[begin:end]) & ~torch.isfinite(after[begin:end])).any():
            return True
    return False
