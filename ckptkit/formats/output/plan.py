"""Where each tensor of a conversion goes: shard planning, output names and the shard index.

Pure functions over ``(key, nbytes, storage)`` tuples and paths: no tensor, no file is read, so
they are tested on their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from ckptkit.errors import UsageError

__all__ = [
    "parse_size",
    "plan_shards",
    "shard_paths",
    "index_document",
    "stale_shards",
    "stale_names",
]

# Size units, decimal and binary, as Hugging Face's max_shard_size reads them (a table).
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2 * 2**30; an int is bytes.

    Raises:
        UsageError: not a positive size.
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise UsageError(f"cannot read size '{size}'", "write it like 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"size '{size}' must be positive")
    return value


def plan_shards(tensors: Sequence[tuple[str, int, str]], limit: int | None) -> list[list[str]]:
    """Group ``(key, nbytes, storage)`` into shards of at most ``limit`` bytes, in order.

    Tensors of one storage (a tied group) share a shard, placed where its first one is; a unit
    larger than the limit gets a shard of its own; no limit means one shard.
    """
    if limit is None:
        return [[key for key, _, _ in tensors]]
    units: dict[str, list[tuple[str, int]]] = {}
    for key, nbytes, storage in tensors:
        units.setdefault(storage, []).append((key, nbytes))
    shards: list[list[str]] = [[]]
    size = 0
    for unit in units.values():
        unit_size = sum(nbytes for _, nbytes in unit)
        if shards[-1] and size + unit_size > limit:
            shards.append([])
            size = 0
        shards[-1].extend(key for key, _ in unit)
        size += unit_size
    return shards


def shard_paths(dst: Path, count: int) -> list[Path]:
    """One file, or ``stem-0000i-of-0000n.safetensors`` shards plus ``dst.index.json`` last."""
    if count == 1:
        return [dst]
    stem = dst.name.removesuffix(".safetensors")
    shards = [
        dst.with_name(f"{stem}-{i:05d}-of-{count:05d}.safetensors") for i in range(1, count + 1)
    ]
    return shards + [dst.with_name(dst.name + ".index.json")]


def index_document(
    shards: Sequence[Sequence[tuple[str, int]]], names: Sequence[str], header: dict[str, str]
) -> str:
    """The Hugging Face index of ``(key, nbytes)`` shards stored under ``names``: the total size
    and the header in ``metadata``, and the shard of every key."""
    weight_map = {key: name for shard, name in zip(shards, names, strict=True) for key, _ in shard}
    total = sum(nbytes for shard in shards for _, nbytes in shard)
    # A source index's own totals (carried in the header) are not this output's.
    kept = {k: v for k, v in header.items() if k not in ("total_size", "total_parameters")}
    index = {"metadata": {**kept, "total_size": total}, "weight_map": weight_map}
    return json.dumps(index, indent=2) + "\n"


def stale_shards(dst: Path, written: Iterable[Path], present: Iterable[Path]) -> list[Path]:
    """Of the files ``present`` beside ``dst``, the shards and index of an earlier conversion
    into the same place that this one did not write (a model now in 3 shards, not 5; or in one
    file): loaders would otherwise find a stale index or a mix of runs."""
    present = list(present)
    stale = set(stale_names(dst.name, [p.name for p in written], [p.name for p in present]))
    return [p for p in present if p.name in stale]


def stale_names(name: str, written: Iterable[str], present: Iterable[str]) -> list[str]:
    """:func:`stale_shards` by names: of ``present``, the shards and index of an output named
    ``name`` that are not ``written`` (a folder at a URL is listed by names)."""
    stem = name.removesuffix(".safetensors")
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")
    index = name + ".index.json"
    keep = set(written)
    return [n for n in present if (shard.fullmatch(n) or n == index) and n not in keep]
