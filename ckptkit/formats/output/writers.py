"""One writer per output format, behind one small protocol, picked from a table.

A writer puts a shard's items into a temporary path (a file, or a folder for DCP) through the
copy engine (``copier.py``), then reads what it wrote back the way any reader of that format
would and compares it with the plan: keys, dtypes, shapes, ties, metadata, every tensor's bytes.
``convert`` commits the temporary path only after that check.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ckptkit.errors import VerificationError
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.tensors import with_versions
from ckptkit.formats.files.safetensors import read_header, write_safetensors
from ckptkit.formats.folders.dcp import DISTCP, METADATA, SIDECAR
from ckptkit.formats.folders.megatron_dist import COMMON, METADATA_JSON
from ckptkit.formats.output.copier import (
    Copier,
    Item,
    check_keys,
    check_layout,
    differs,
    metadata_differ,
)
from ckptkit.storage.atomic import syncing
from ckptkit.storage.bytecopy import preallocate

__all__ = [
    "Writer",
    "writer_for",
    "writer_class",
    "able",
    "WRITERS",
    "TO_FORMATS",
    "OUTPUT_FORMATS",
]


class Writer(Protocol):
    """What ``convert`` asks of an output format. What the format can do is declared on its
    class (see :class:`_Writer`), and every choice convert makes about a format reads it there:
    a new output format is one class, added to :data:`WRITERS`."""

    folder: ClassVar[bool]  # the output is a folder (committed whole), not one file per shard
    files: ClassVar[tuple[str, ...]]  # a folder output's files, in commit order, entry last

    def write(self, tmp: Path, items: list[Item]) -> None:
        """Write ``items`` (one shard) into ``tmp``, made empty by the atomic commit."""

    def verify(self, tmp: Path, items: list[Item], shown: Path) -> None:
        """Read ``tmp`` back and compare it with the plan; ``shown`` names it in errors.

        Raises:
            VerificationError: naming the key, dtype, shape or tie that differs.
        """


@dataclass
class _Writer:
    """What every writer is given: the copy engine, the plan's ties and metadata."""

    copier: Copier
    aliases: dict[str, str]
    header: dict[str, str]
    verify_while_writing: bool = True  # compare copied bytes as they are written
    special: frozenset[str] = field(default_factory=frozenset)  # kept as torch values
    reserve: bool = True  # room reserved on disk first (not for a file uploaded as written)

    # What the format can do (read by convert, the CLI's --to and its refusals).
    format: ClassVar[str] = ""  # its name in reports ("safetensors", "torch", "dcp")
    to: ClassVar[str | None] = None  # its --to name (None: chosen by convert, never named)
    suffixes: ClassVar[tuple[str, ...]] = ()  # the file names that imply it, lower case
    folder: ClassVar[bool] = False  # a folder (committed whole), not one file per shard
    files: ClassVar[tuple[str, ...]] = ()  # a folder output's files: commit order, entry last
    shardable: ClassVar[bool] = False  # --max-shard-size: shards beside an index
    spreadable: ClassVar[bool] = False  # --part: processes write shares of the shards
    # ...and the shards are files of one folder (a legacy Megatron save's rank files), each
    # committed on its own, the folder's entry written once every part is done.
    spreads_in_folder: ClassVar[bool] = False
    model_folder: ClassVar[bool] = False  # a model folder's weights (config files beside)
    # How tied tensors are written: None lets --keep-tied-copies choose ("once": one tensor,
    # the others named in the metadata, or "copies"); "shared" (one storage), "chunk" (one
    # chunk named by every key).
    ties: ClassVar[str | None] = None
    keeps_special: ClassVar[bool] = False  # sparse, quantized, packed values kept as they are
    text_keys: ClassVar[bool] = True  # keys go into a JSON header: UTF-8 text only
    widest_first: ClassVar[bool] = False  # widest dtypes first (aligned for memory mapping)

    @classmethod
    def owns(cls, name: str) -> bool:
        """Whether ``name``, in an existing folder output, is one of this format's files
        (``--force`` replaces those, and keeps the rest)."""
        return name in cls.files

    def write(self, tmp: Path, items: list[Item]) -> None:
        raise NotImplementedError

    def verify(self, tmp: Path, items: list[Item], shown: Path) -> None:
        raise NotImplementedError


class SafetensorsWriter(_Writer):
    """A safetensors file: the header, then each tensor in the items' order."""

    format, to, suffixes = "safetensors", "safetensors", (".safetensors",)
    shardable = spreadable = model_folder = widest_first = True

    def write(self, tmp: Path, items: list[Item]) -> None:
        write = self.copier.tensor_writer(
            {i.spec.key: i for i in items}, tmp, self.verify_while_writing
        )
        write_safetensors(tmp, [i.spec for i in items], self.header, write, reserve=self.reserve)

    def verify(self, tmp: Path, items: list[Item], shown: Path) -> None:
        """Re-read the header and compare every tensor's bytes with its source: copied ones as
        they were written, the rest with their output bytes made again from the source."""
        with syncing(tmp):  # the disk write-back overlaps the read-back
            header, data_start = read_header(tmp)
            metadata = header.pop("__metadata__", {})
            if metadata != self.header:
                raise metadata_differ(shown, self.header, metadata)
            check_keys(shown, [i.spec.key for i in items], header)
            for item in items:
                entry = header[item.spec.key]
                begin, end = entry["data_offsets"]
                same_code = entry["dtype"] == DTYPES[item.spec.dtype].safetensors
                dtype = item.spec.dtype if same_code else entry["dtype"]
                check_layout(shown, item.spec, dtype, entry["shape"])
                if end - begin != item.spec.nbytes:
                    raise VerificationError(
                        f"tensor '{item.spec.key}' in {shown} holds {end - begin} bytes, "
                        f"planned {item.spec.nbytes}; nothing was written"
                    )
                self.copier.check_bytes(item, tmp, data_start + begin, shown)
                self.copier.progress(item.spec.nbytes)


class TorchWriter(_Writer):
    """A plain ``.pt`` state dict, laid out as ``torch.save`` lays it out (see ``torchzip``);
    ties kept: an alias shares its target's storage."""

    format, to = "torch", "pt"
    # .pth.tar: torchvision's references
    suffixes: ClassVar[tuple[str, ...]] = (".pt", ".pth", ".bin", ".ckpt", ".tar")
    ties, keeps_special, text_keys = "shared", True, False

    def write(self, tmp: Path, items: list[Item]) -> None:
        """Each storage's bytes copied from the source where they lie as they must, else made
        by torch a piece at a time."""
        from ckptkit.formats.files.torchzip import begin_archive

        by_key = {item.spec.key: item for item in items}
        pickled, storages = self._pickled(items)
        write = self.copier.tensor_writer(by_key, tmp, self.verify_while_writing)
        unique: dict[str, Item] = {}  # each storage record, written from its first key
        for item in items:
            unique.setdefault(storages[item.spec.key].key, item)
        estimate = len(pickled) + sum(i.spec.nbytes for i in unique.values()) + 256 * len(unique)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o666)  # atomic_outputs' empty temp file
        try:
            if self.reserve:
                preallocate(fd, estimate + 4096)
            archive = begin_archive(fd, pickled)
            for record, item in unique.items():
                stream = functools.partial(write, fd, item.spec)
                archive.add_stream(f"data/{record}", item.spec.nbytes, stream)
            for alias in set(self.aliases) & set(by_key):  # written once, with its target
                self.copier.progress(by_key[alias].spec.nbytes)
            archive.finish()
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))  # drop what preallocation added
        finally:
            os.close(fd)

    def _pickled(self, items: list[Item]) -> tuple[bytes, dict[str, Any]]:
        """The file's pickle, and each key's storage record."""
        from ckptkit.formats.files.torchzip import state_pickle

        return state_pickle([item.spec for item in items], self.aliases)

    def verify(self, tmp: Path, items: list[Item], shown: Path) -> None:
        """Read the written ``.pt`` back statically and compare it with the plan."""
        from ckptkit.formats.files.torchfile import TorchFileSource

        with syncing(tmp), TorchFileSource(tmp) as written:
            self.copier.compare(written, items, self.aliases, shown)


class MegatronWriter(TorchWriter):
    """One rank file of a legacy Megatron save (``model_optim_rng.pt``): the rank's model
    beside the args, ``checkpoint_version`` and the iteration, as Megatron-LM's
    ``generate_state_dict`` writes them; its source is a
    :class:`~ckptkit.formats.folders.megatron_ranks.MegatronRanks`, which says what each rank
    file holds. The plan's shards are the rank files."""

    format, to = "megatron", "megatron"
    suffixes: ClassVar[tuple[str, ...]] = ()  # only --to megatron names it
    spreadable = spreads_in_folder = True  # each part its rank files; the tracker last

    def _pickled(self, items: list[Item]) -> tuple[bytes, dict[str, Any]]:
        from ckptkit.formats.files.torchzip import wrapped_pickle

        source = self._source()
        rank, _ = source.placed(items[0].old)
        specs = {item.old: item.spec for item in items}
        states = {
            state: [(key, None if name is None else specs[name]) for key, name in entries]
            for state, entries in source.rank_models[rank].items()
        }
        return wrapped_pickle(source.rank_root(), states)

    def _source(self) -> Any:
        from ckptkit.formats.folders.megatron_ranks import MegatronRanks

        source = self.copier.source
        assert isinstance(source, MegatronRanks)
        return source

    def verify(self, tmp: Path, items: list[Item], shown: Path) -> None:
        """Read the rank file back statically: its pickle gives what was planned (the args
        and the rest beside the model, each state dict's keys, None where megatron-core keeps
        an extra state), and every tensor's bytes are its slice of the source."""
        from ckptkit.formats.folders.megatron import megatron_scan
        from ckptkit.formats.pickles.unpickler import TensorStub, read_pickle
        from ckptkit.meta import jsonable

        source = self._source()
        rank, _ = source.placed(items[0].old)
        models = source.rank_models[rank]
        planned = read_pickle(self._pickled(items)[0]).root
        by_name = {item.old: item for item in items}
        with syncing(tmp):
            scan, layout, raw, _ = megatron_scan(tmp, ())
            try:
                root = scan.root
                if not isinstance(root, dict) or list(root) != list(planned):
                    raise VerificationError(f"{shown} is not the planned rank file")
                found = jsonable({k: v for k, v in root.items() if k not in models})
                wanted = jsonable({k: v for k, v in planned.items() if k not in models})
                if found != wanted:
                    raise metadata_differ(shown, wanted, found)
                layout.locate_storages()
                for state, entries in models.items():
                    model = root[state]
                    if not isinstance(model, dict) or list(model) != [k for k, _ in entries]:
                        keys = model if isinstance(model, dict) else {}
                        check_keys(shown, [k for k, _ in entries], keys)
                        raise VerificationError(f"{shown} holds {state}'s keys in another order")
                    for key, name in entries:
                        value = model[key]
                        if name is None:
                            if value is not None:
                                raise VerificationError(f"'{key}' in {shown} is not None")
                            continue
                        item = by_name[name]
                        if not isinstance(value, TensorStub):
                            raise differs(item.spec.key, shown)
                        check_layout(shown, item.spec, value.dtype, value.shape)
                        base = layout.data_offset(value.storage)
                        if base is None or not value.is_contiguous:
                            raise differs(item.spec.key, shown)
                        self.copier.check_bytes(item, tmp, base + value.byte_range()[0], shown)
                        self.copier.progress(item.spec.nbytes)
            finally:
                raw.close()


class TorchValuesWriter(_Writer):
    """A ``.pt`` written by ``torch.save``, which keeps what ``TorchWriter`` does not lay out
    itself: sparse and quantized tensors and packed parameters (the ``special`` source keys),
    as torch's safe loader read them. Such state dicts are small (quantized models, sparse
    buffers), so all of it is in memory at once."""

    # No --to name or suffix of its own: writer_for picks it for a .pt output that needs it.
    format, ties, keeps_special, text_keys = "torch", "shared", True, False

    def write(self, tmp: Path, items: list[Item]) -> None:
        import torch

        source = self.copier.source
        values: OrderedDict[str, Any] = OrderedDict()
        for item in items:
            target = self.aliases.get(item.spec.key, "")
            if target in values:
                values[item.spec.key] = values[target]
            elif item.old in self.special:
                values[item.spec.key] = source.load_value(item.old)
            else:
                values[item.spec.key] = self.copier.tensor(item)
            self.copier.through_torch += 1
            self.copier.progress(item.spec.nbytes)
        versions = source.module_versions({i.old: i.spec.key for i in items})
        if versions is not None:  # as state_dict() leaves them: quantized modules read them
            with_versions(values, versions)
        # The temp file atomic_outputs made (not truncated: see write_safetensors), or a new
        # one in an upload's staging folder.
        with open(tmp, "r+b" if tmp.exists() else "xb") as f:
            torch.save(values, f)

    def verify(self, tmp: Path, items: list[Item], shown: Path) -> None:
        """Reload with torch's safe loader and compare every value with the source."""
        import torch

        from ckptkit.formats.base.tensors import bit_equal, same_value

        with syncing(tmp):
            state = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
            check_keys(shown, [i.spec.key for i in items], state)
            for item in items:
                written = state[item.spec.key]
                if item.old in self.special:
                    same = same_value(written, self.copier.source.load_value(item.old))
                else:
                    same = bit_equal(written, self.copier.tensor(item))
                if not same:
                    raise differs(item.spec.key, shown)
                self.copier.progress(item.spec.nbytes)


# What --force replaces in a DCP folder: a save's files (any rank's data files), never the rest.
_DCP_NAMES = re.compile(r"\.metadata|ckptkit\.json|__\d+_\d+\.distcp")


class DCPWriter(_Writer):
    """A DCP folder, as one writer of ``dcp.save`` lays it out: each tensor one whole chunk, a
    ``torch.save`` archive in ``__0_0.distcp``, then ``.metadata``; an alias names its target's
    chunk, so ties survive. The header goes beside them in ``ckptkit.json``."""

    format, to, folder, ties = "dcp", "dcp", True, "chunk"
    # .metadata last: a reader finds the save by it
    files: ClassVar[tuple[str, ...]] = (DISTCP, SIDECAR, METADATA)

    @classmethod
    def owns(cls, name: str) -> bool:
        """A save's files, any rank's data files among them: never the rest of the folder."""
        return _DCP_NAMES.fullmatch(name) is not None

    def write(self, tmp: Path, items: list[Item]) -> None:
        from ckptkit.formats.folders.dcp import dcp_metadata

        where = self._write_chunks(tmp / DISTCP, items)
        layout = [
            (
                i.spec.key,
                i.spec.dtype,
                tuple(i.spec.shape),
                DISTCP,
                *where[self.aliases.get(i.spec.key, i.spec.key)],
            )
            for i in items
        ]
        sidecar = json.dumps(self.header, indent=1).encode()
        for name, content in ((SIDECAR, sidecar), (METADATA, dcp_metadata(layout))):
            with open(tmp / name, "xb") as f:  # .metadata last, as dcp.save writes it
                f.write(content)
                os.fsync(f.fileno())

    def _write_chunks(self, data: Path, items: list[Item]) -> dict[str, tuple[int, int]]:
        """Each tensor's chunk, one small torch archive after another; where each one lies."""
        from ckptkit.formats.files.torchzip import begin_archive, state_pickle

        write = self.copier.tensor_writer(
            {i.spec.key: i for i in items}, data, self.verify_while_writing
        )
        where: dict[str, tuple[int, int]] = {}
        fd = os.open(data, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            if self.reserve:
                preallocate(fd, sum(i.spec.nbytes + 2048 for i in items))
            for item in items:
                if item.spec.key in self.aliases:
                    self.copier.progress(item.spec.nbytes)  # written once, with its target
                    continue
                start = os.lseek(fd, 0, os.SEEK_CUR)
                archive = begin_archive(fd, state_pickle([item.spec], bare=True)[0])
                stream = functools.partial(write, fd, item.spec)
                archive.add_stream("data/0", item.spec.nbytes, stream)
                where[item.spec.key] = (start, archive.finish())
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))
            os.fsync(fd)
        finally:
            os.close(fd)
        return where

    def verify(self, tmp: Path, items: list[Item], shown: Path) -> None:
        """Read the folder back statically, as any DCP folder is read, and compare it with the
        plan: keys, dtypes, shapes, ties, metadata, then every tensor's bytes."""
        from ckptkit.formats.folders.dcp import DCPSource

        with DCPSource(tmp) as written:
            if written.metadata != self.header:
                raise metadata_differ(shown, self.header, dict(written.metadata))
            self.copier.compare(written, items, self.aliases, shown)


class MegatronDistWriter(DCPWriter):
    """A Megatron ``torch_dist`` save's iteration folder, as megatron-core's
    ``dist_checkpointing.save`` lays it out: the tensors in ``__0_0.distcp`` (one whole chunk
    each), the modules' ``_extra_state`` objects in ``__0_1.distcp``, ``common.pt`` (the args),
    ``metadata.json`` and ``.metadata`` last; its source is a
    :class:`~ckptkit.formats.folders.megatron_dist.MegatronDist`."""

    format, to = "megatron-dist", "megatron-dist"
    suffixes: ClassVar[tuple[str, ...]] = ()
    files: ClassVar[tuple[str, ...]] = (DISTCP, "__0_1.distcp", COMMON, METADATA_JSON, METADATA)

    @classmethod
    def owns(cls, name: str) -> bool:
        return name in cls.files

    def write(self, tmp: Path, items: list[Item]) -> None:
        from ckptkit.formats.files.torchzip import begin_archive, wrapped_pickle
        from ckptkit.formats.folders.dcp import dcp_metadata
        from ckptkit.formats.pickles.writer import dumps

        source = self._source()
        where = self._write_chunks(tmp / DISTCP, items)
        layout = [
            (i.spec.key, i.spec.dtype, tuple(i.spec.shape), DISTCP, *where[i.spec.key])
            for i in items
        ]
        objects = []
        fd = os.open(tmp / self.files[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            for key in source.extra_objects:  # torch.save([None]), as megatron-core saves it
                start = os.lseek(fd, 0, os.SEEK_CUR)
                length = begin_archive(fd, dumps([None])).finish()
                objects.append((key, self.files[1], start, length))
            os.fsync(fd)
        finally:
            os.close(fd)
        common = os.open(tmp / COMMON, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            begin_archive(common, wrapped_pickle(source.common(), {})[0]).finish()
            os.fsync(common)
        finally:
            os.close(common)
        for name, content in (
            (METADATA_JSON, source.backend().encode()),
            (METADATA, dcp_metadata(layout, objects)),  # last, as dist_checkpointing writes it
        ):
            with open(tmp / name, "xb") as f:
                f.write(content)
                os.fsync(f.fileno())

    def _source(self) -> Any:
        from ckptkit.formats.folders.megatron_dist import MegatronDist

        source = self.copier.source
        assert isinstance(source, MegatronDist)
        return source

    def verify(self, tmp: Path, items: list[Item], shown: Path) -> None:
        """Read the folder back as DCP (every tensor's bytes, and each extra state object
        where the metadata says) and common.pt statically (its values as planned)."""
        from ckptkit.formats.files.torchzip import wrapped_pickle
        from ckptkit.formats.folders.dcp import DCPSource
        from ckptkit.formats.folders.megatron import megatron_scan
        from ckptkit.formats.pickles.unpickler import read_pickle
        from ckptkit.meta import jsonable

        source = self._source()
        with DCPSource(tmp) as written:
            missing = set(source.extra_objects) - set(written.extras)
            if missing:
                raise VerificationError(f"{shown} lacks {sorted(missing)[:3]}; nothing was written")
            self.copier.compare(written, items, self.aliases, shown)
        scan, _, raw, _ = megatron_scan(tmp / COMMON, ())
        raw.close()
        planned = read_pickle(wrapped_pickle(source.common(), {})[0]).root
        if jsonable(scan.root) != jsonable(planned):
            raise VerificationError(
                f"{shown}/common.pt is not the planned one; nothing was written"
            )


# Output format -> its writer (a dispatch table). ``.pt`` output holding sparse or quantized
# tensors or packed parameters goes through torch.save instead ("torch-values").
WRITERS: dict[str, type[_Writer]] = {
    "safetensors": SafetensorsWriter,
    "torch": TorchWriter,
    "torch-values": TorchValuesWriter,
    "dcp": DCPWriter,
    "megatron": MegatronWriter,
    "megatron-dist": MegatronDistWriter,
}

# What the command line and file names call each format, from the writers' own declarations.
TO_FORMATS = {cls.to: cls.format for cls in WRITERS.values() if cls.to is not None}
OUTPUT_FORMATS = {
    suffix: cls.format for cls in WRITERS.values() if cls.to is not None for suffix in cls.suffixes
}


def writer_class(fmt: str) -> type[_Writer]:
    """What output format ``fmt`` (``safetensors``, ``torch``, ``dcp``) can do."""
    return WRITERS[fmt]


def able(capability: str) -> list[type[_Writer]]:
    """The named formats that can do ``capability`` (a class attribute: ``shardable``...),
    for the refusals that say which can."""
    return [cls for cls in WRITERS.values() if cls.to is not None and getattr(cls, capability)]


def writer_for(
    fmt: str,
    copier: Copier,
    *,
    aliases: dict[str, str],
    header: dict[str, str],
    special: frozenset[str] = frozenset(),
    verify: bool = True,
    reserve: bool = True,
) -> Writer:
    """The writer of output format ``fmt`` (``safetensors``, ``torch`` or ``dcp``)."""
    kind = "torch-values" if WRITERS[fmt].keeps_special and special else fmt
    return WRITERS[kind](copier, aliases, header, verify, special, reserve)
