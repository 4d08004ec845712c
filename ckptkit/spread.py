"""Conversion spread over processes: each writes a disjoint share of a sharded output.

The plan (which tensor goes to which shard) depends on the source and the options only, never
on how many processes write it, so the output is byte-identical for any number of them. Shard
``i`` (counted from 0) belongs to part ``i % N``.

Two ways to run the parts:

* ``torchrun --nproc-per-node N -m ckptkit convert SRC DST --max-shard-size S`` (or
  ``--nnodes``): each rank writes its shards, then the ranks agree over torch's gloo process
  group (CPU only, the rendezvous torchrun made) that every shard was written and verified;
  only then does rank 0 write the index. A rank that fails makes every rank fail, and no index
  is written.
* ``ckptkit convert SRC DST --max-shard-size S --part I/N`` in N jobs of a scheduler (I from 1),
  then ``ckptkit convert --finish DST``, which checks that every shard is there and whole and
  writes the index from the shards' own headers.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptkit.errors import FormatError, UsageError
from ckptkit.formats.files.safetensors import read_header
from ckptkit.formats.output.plan import index_document
from ckptkit.storage.destination import Destination, destination
from ckptkit.storage.location import Location, location, url_file

__all__ = ["Part", "parse_part", "launched_part", "all_succeeded", "finish", "FinishReport"]

AGREE_TIMEOUT_S = float(os.environ.get("CKPTKIT_SPREAD_TIMEOUT", "1800"))


@dataclass(frozen=True)
class Part:
    """Which share of the shards this process writes: ``index`` of ``count`` (from 0);
    ``launched``: under torch's launcher, so the ranks agree before the index is written."""

    index: int
    count: int
    launched: bool = False

    def shards(self, total: int) -> list[int]:
        """The shards (counted from 0) this part writes."""
        return list(range(self.index, total, self.count))

    def __str__(self) -> str:
        return f"{self.index + 1}/{self.count}"


def parse_part(text: str) -> Part:
    """``"I/N"`` (I from 1 to N) as a Part.

    Raises:
        UsageError: not of that form.
    """
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise UsageError(f"--part {text}: give I/N with 1 <= I <= N", "e.g. --part 2/8")
    return Part(int(match[1]) - 1, int(match[2]))


def launched_part() -> Part | None:
    """This process's part when torch's launcher (torchrun, which sets
    ``TORCHELASTIC_RUN_ID``) started several, else None. A convert run from inside a torchrun
    worker inherits those variables too: ``CKPTKIT_NO_SPREAD=1`` makes it a whole conversion."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or "RANK" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    if os.environ.get("CKPTKIT_NO_SPREAD") == "1":
        return None
    return Part(int(os.environ["RANK"]), world, launched=True)


def all_succeeded(ok: bool) -> bool:
    """Under torchrun: whether every rank's shards were written and verified (each rank says
    so); the gloo process group is made here, on the launcher's rendezvous, and torn down."""
    import torch
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=AGREE_TIMEOUT_S))
    try:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
    finally:
        if made:
            dist.destroy_process_group()


@dataclass
class FinishReport:
    """What ``convert --finish`` found and wrote."""

    index: str
    shards: list[str]
    tensors: int
    total_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "shards": self.shards,
            "tensors": self.tensors,
            "total_size": self.total_size,
        }


def finish(dst: str | Path, *, force: bool = False) -> FinishReport:
    """Write the index of a sharded safetensors output whose parts were written apart
    (``convert --part I/N``): every shard ``stem-0000i-of-0000n.safetensors`` beside ``dst``
    must be there and whole (its header read and checked); the index is made from their
    headers, in shard order, as a one-process conversion writes it. ``dst`` may be a URL (the
    shards listed and their headers read there, the index uploaded).

    Raises:
        FormatError: a shard is missing or damaged, or the shards disagree.
        OutputError: the index exists (without ``force``).
    """
    if location(dst).is_dir():  # a legacy Megatron save's parts: its tracker
        return _finish_megatron(dst, force)
    target = destination(dst, force=force)
    present = set(target.names())
    where = location(dst)
    folder = where.parent
    stem = where.name.removesuffix(".safetensors")
    pattern = re.compile(re.escape(stem) + r"-(\d{5})-of-(\d{5})\.safetensors")
    counts = {m[2] for n in present if (m := pattern.fullmatch(n))}
    if not counts:
        raise FormatError(
            f"no shards of {dst} ({stem}-00001-of-N.safetensors...) in {folder}",
            "run the parts first: ckptkit convert SRC DST --max-shard-size S --part I/N",
        )
    if len(counts) != 1:
        raise FormatError(
            f"{folder} holds shards of several conversions (of {', '.join(sorted(counts))})",
            "remove the stale ones",
        )
    count = int(counts.pop())
    names = [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    missing = [n for n in names if n not in present]
    if missing:
        raise FormatError(
            f"{len(missing)} of {count} shards of {dst} are missing ({', '.join(missing[:3])}"
            + (" ..." if len(missing) > 3 else "")
            + ")",
            "run the parts that wrote them (--part I/N) again",
        )
    sizes, header = [], None
    for name in names:
        entries = _header(folder / name)  # checked as strictly as safetensors does
        metadata = entries.pop("__metadata__", None) or {}
        if header is None:
            header = dict(metadata)
        elif dict(metadata) != header:
            raise FormatError(
                f"{folder / name} was written by another conversion than {names[0]} (their "
                "metadata differ)",
                "run every part with the same source and options",
            )
        spans = ((key, entry["data_offsets"]) for key, entry in entries.items())
        sizes.append([(key, end - begin) for key, (begin, end) in spans])
    text = index_document(sizes, names, header or {})
    index = folder / (where.name + ".index.json")
    _write_index(target, index.name, text)
    return FinishReport(
        str(index),
        [str(folder / n) for n in names],
        sum(len(s) for s in sizes),
        sum(n for s in sizes for _, n in s),
    )


def _finish_megatron(dst: str | Path, force: bool) -> FinishReport:
    """The tracker of a legacy Megatron save whose rank files were written apart (``convert
    --to megatron --part I/N``): its one iteration folder read as any save is (every rank
    there, of one save: the reader refuses anything else), then the tracker written.

    Raises:
        FormatError: no iteration folder, several, or rank files missing or mixed.
    """
    from ckptkit.formats.folders.megatron import LATEST, MegatronSave, MegatronSource, iteration_of

    folder = location(dst)
    saved = sorted(p.name for p in folder.iterdir() if iteration_of(p.name) is not None)
    if len(saved) != 1:
        raise FormatError(
            f"{dst} holds {len(saved)} iteration folders ({', '.join(saved[:3])}), not one",
            "run the parts first: ckptkit convert SRC DST --to megatron --part I/N",
        )
    iteration = folder / saved[0]
    with MegatronSource(
        MegatronSave(iteration, f"{saved[0]}, its parts written", "legacy")
    ) as save:
        tensors = len(save.keys())
        total = sum(info.nbytes for _, info in save.entries())
        files = [str(f) for f in save.files()]
    tracker = iteration_of(saved[0])
    assert tracker is not None
    _write_index(destination(str(folder / LATEST), force=force), LATEST, tracker)
    return FinishReport(str(folder / LATEST), files, tensors, total)


def _header(path: Location) -> dict[str, Any]:
    """A shard's safetensors header, from a local file or through ranged reads of a URL."""
    raw = url_file(path)
    with raw if raw is not None else contextlib.nullcontext():
        return read_header(path, raw)[0]


def _write_index(target: Destination, name: str, text: str) -> None:
    """The index beside the shards, as any output is committed there."""
    with target.planned() as planned:
        index = planned.with_name(name)
        target.check([index])
        with target.files([index]) as files:
            files.path(index).write_text(text)
            files.done(index)
