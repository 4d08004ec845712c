"""``summarize``: what is in a checkpoint, from headers alone, and its readable views.

Nothing here reads tensor data or executes pickled code, and for torch and safetensors files
nothing imports torch: the answer comes from the zip's pickle, the legacy pickles or the
safetensors header.
"""

from __future__ import annotations

import fnmatch
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.convert import TRAINING_KEY
from ckptkit.formats import TensorInfo, open_source
from ckptkit.formats.dtypes import DTYPES
from ckptkit.formats.tree import DroppedPart
from ckptkit.keys import Wrapper, detect_wrappers
from ckptkit.meta import NAMESPACE, CheckpointMeta
from ckptkit.scan import ScanReport, report_of, scan

__all__ = [
    "summarize",
    "Summary",
    "summary_lines",
    "tree_lines",
    "flat_lines",
    "collapse",
    "human_size",
    "SCHEMA_VERSION",
]

SCHEMA_VERSION = 1
MIN_FOLD = 3  # fold repeated layers only from three on: two lines read better than a pattern


@dataclass
class Summary:
    """Everything ``inspect`` shows about one checkpoint."""

    path: str
    format: str
    file_size: int
    selected: str = ""
    selected_reason: str = ""
    tensors: list[tuple[str, TensorInfo]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    dropped: list[DroppedPart] = field(default_factory=list)
    wrappers: tuple[Wrapper, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    shared: list[list[str]] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    safety: ScanReport | None = None
    shards: dict[str, int] = field(default_factory=dict)

    @property
    def parameters(self) -> int:
        """Elements in all tensors of the state dict (parameters and buffers)."""
        return sum(info.numel for _, info in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self.tensors)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for _, info in self.tensors:
            out[info.dtype] += info.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def non_contiguous(self) -> list[str]:
        return [key for key, info in self.tensors if not info.contiguous]

    @property
    def training(self) -> dict[str, Any]:
        """The training run's metadata, from an engine checkpoint or a converted file's header."""
        meta = self.extras.get(TRAINING_KEY)
        return meta if isinstance(meta, dict) else self.ckptkit_metadata.get("training", {})

    @property
    def ckptkit_metadata(self) -> dict[str, Any]:
        """The ``ckptkit.`` metadata, decoded (empty when there is none)."""
        if not any(k.startswith(NAMESPACE) for k in self.metadata):
            return {}
        meta = CheckpointMeta.from_header(self.metadata).to_dict()
        return {k: v for k, v in meta.items() if v not in (None, [], {}) and k != "other"}

    def to_dict(self, key_filter: str | None = None) -> dict[str, Any]:
        """The ``inspect --json`` document (schema version :data:`SCHEMA_VERSION`)."""
        return {
            "schema": SCHEMA_VERSION,
            "path": self.path,
            "format": self.format,
            "file_size": self.file_size,
            "shards": self.shards,
            "state_dict": {"path": self.selected, "reason": self.selected_reason},
            "tensor_count": len(self.tensors),
            "parameters": self.parameters,
            "bytes": self.nbytes,
            "bytes_by_dtype": self.bytes_by_dtype,
            "wrappers": [{"prefix": w.prefix, "added_by": w.added_by} for w in self.wrappers],
            "convert_strips": "".join(w.prefix for w in self.wrappers),
            "aliases": self.aliases,
            "shared_storage": self.shared,
            "non_contiguous": self.non_contiguous,
            "extras": self.extras,
            "other_parts": [part.to_dict() for part in self.dropped],
            "metadata": {k: v for k, v in self.metadata.items() if not k.startswith(NAMESPACE)},
            "ckptkit_metadata": self.ckptkit_metadata,
            "safety": self.safety.to_dict() if self.safety else None,
            "tensors": [
                {"key": key, **info.to_dict(), "contiguous": info.contiguous}
                for key, info in self.tensors
                if _keep(key, key_filter)
            ],
        }


def summarize(path: str | Path, *, select: str | None = None) -> Summary:
    """Describe a checkpoint without loading tensor data or running its pickle.

    Args:
        path: a torch zip or legacy file, safetensors, or a sharded checkpoint (index or folder).
        select: dotted path of the state dict inside a training checkpoint (default: found).

    Returns:
        The summary: format, sizes, where the state dict is and what else is there, tensors,
        wrapper chain, tied and shared tensors, metadata, and the pickle's safety verdict.

    Raises:
        CkptkitError: the file cannot be read as a checkpoint.
    """
    path = Path(path)
    # Reading is static, so an unsafe file can be shown too; its verdict comes from the same
    # parse the reader made.
    with open_source(path, select=select, check_safety=False) as source:
        safety = None
        if getattr(source, "readings", None):
            safety = report_of(path, source.readings)
        elif source.format == "safetensors":
            safety = scan(path)
        entries = source.entries()
        summary = Summary(
            path=str(path),
            format=source.format
            if source.format != "sharded"
            else f"sharded {source.shard_format}",
            file_size=_size_on_disk(source),
            selected=source.selected,
            selected_reason=source.selected_reason,
            tensors=entries,
            extras=source.extras,
            dropped=source.dropped,
            wrappers=detect_wrappers(key for key, _ in entries),
            aliases=source.aliases(),
            shared=_shared_groups(entries, source.aliases()),
            metadata=dict(source.metadata),
            safety=safety,
            shards={
                name: shard.path.stat().st_size
                for name, shard in getattr(source, "shards", {}).items()
            },
        )
    return summary


def _size_on_disk(source: Any) -> int:
    shards = getattr(source, "shards", None)
    if shards:
        return sum(os.path.getsize(shard.path) for shard in shards.values())
    return os.path.getsize(source.path)


def _shared_groups(
    entries: list[tuple[str, TensorInfo]], aliases: dict[str, str]
) -> list[list[str]]:
    """Keys that live in one storage without being the same tensor (views, flat buffers)."""
    by_storage: dict[str, list[str]] = defaultdict(list)
    for key, info in entries:
        if info.storage is not None and key not in aliases:
            by_storage[info.storage].append(key)
    return [keys for keys in by_storage.values() if len(keys) > 1]


def _keep(key: str, pattern: str | None) -> bool:
    return pattern is None or fnmatch.fnmatchcase(key, pattern)


def _span(values: list[int]) -> str:
    values = sorted(set(values))
    if len(values) == 1:
        return str(values[0])
    if values == list(range(values[0], values[-1] + 1)):
        return f"{{{values[0]}..{values[-1]}}}"
    return "{" + ",".join(map(str, values)) + "}"


def collapse(rows: list[tuple[str, Any]]) -> list[tuple[tuple[str, ...], Any, int]]:
    """Fold keys that differ only in their numeric parts and share a value (shape and dtype).

    ``layers.0.q.weight`` .. ``layers.11.q.weight`` of one shape become one row whose path is
    ``("layers", "{0..11}", "q", "weight")``. Returns (path parts, value, how many keys), in the
    order the keys first appear. Keys are folded only when every combination is present, and
    only :data:`MIN_FOLD` or more of them.
    """
    groups: dict[tuple[tuple[str, ...], Any], list[tuple[int, tuple[str, ...]]]] = {}
    for position, (key, value) in enumerate(rows):
        parts = tuple(key.split("."))
        pattern = tuple("#" if p.isdigit() else p for p in parts)
        groups.setdefault((pattern, value), []).append((position, parts))
    out: list[tuple[int, tuple[str, ...], Any, int]] = []
    for (pattern, value), members in groups.items():
        slots = [i for i, p in enumerate(pattern) if p == "#"]
        spans = {i: sorted({int(parts[i]) for _, parts in members}) for i in slots}
        combos = 1
        for i in slots:
            combos *= len(spans[i])
        if len(members) >= MIN_FOLD and combos == len(members):
            path = tuple(_span(spans[i]) if i in spans else p for i, p in enumerate(pattern))
            out.append((members[0][0], path, value, len(members)))
        else:
            out.extend((position, parts, value, 1) for position, parts in members)
    return [(path, value, count) for _, path, value, count in sorted(out, key=lambda row: row[0])]


def human_size(nbytes: int) -> str:
    """``1234567`` -> ``1.2 MB`` (decimal units, as disks are sold)."""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _describe(info: TensorInfo, count: int = 1) -> str:
    dtype = DTYPES[info.dtype].short if info.dtype in DTYPES else info.dtype
    shape = "[" + ", ".join(map(str, info.shape)) + "]"
    note = "" if info.contiguous else "  non-contiguous"
    times = f"  x{count}" if count > 1 else ""
    return f"{shape} {dtype}{times}  {human_size(info.nbytes * count)}{note}"


def flat_lines(summary: Summary, *, key_filter: str | None = None) -> list[str]:
    """One line per tensor: key, shape, dtype, size."""
    rows = [(k, i) for k, i in summary.tensors if _keep(k, key_filter)]
    width = max((len(k) for k, _ in rows), default=0)
    return [f"{key:<{width}}  {_describe(info)}" for key, info in rows]


def tree_lines(
    summary: Summary, *, depth: int | None = None, key_filter: str | None = None
) -> list[str]:
    """Tensors as a tree by module path, repeated layers folded, subtrees past ``depth`` summed."""
    rows = [(k, i) for k, i in summary.tensors if _keep(k, key_filter)]
    # Fold on what a tensor looks like, not on where its bytes live.
    looks = {k: TensorInfo(i.dtype, i.shape, contiguous=i.contiguous) for k, i in rows}
    folded = collapse([(k, looks[k]) for k, _ in rows])
    root: dict[str, Any] = {}
    for parts, info, count in folded:
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = (info, count)
    lines: list[str] = []
    _render(root, 0, depth, lines)
    return lines


def _totals(node: Any) -> tuple[int, int]:
    if isinstance(node, tuple):
        info, count = node
        return count, info.nbytes * count
    tensors = size = 0
    for child in node.values():
        t, s = _totals(child)
        tensors, size = tensors + t, size + s
    return tensors, size


def _render(node: dict[str, Any], level: int, depth: int | None, lines: list[str]) -> None:
    width = max((len(name) for name in node), default=0)
    for name, child in node.items():
        label = name
        # Merge chains of single children ("encoder.layer" rather than two lines).
        while isinstance(child, dict) and len(child) == 1:
            ((inner, grandchild),) = child.items()
            label, child = f"{label}.{inner}", grandchild
        pad = "  " * level
        if isinstance(child, tuple):
            info, count = child
            lines.append(f"{pad}{label:<{width}}  {_describe(info, count)}")
        else:
            tensors, size = _totals(child)
            lines.append(f"{pad}{label}  ({tensors} tensors, {human_size(size)})")
            if depth is None or level + 1 < depth:
                _render(child, level + 1, depth, lines)


def summary_lines(summary: Summary) -> list[str]:
    """The header of the default view: one fact a line."""
    lines = [f"{summary.path}  ({summary.format}, {human_size(summary.file_size)} on disk)"]
    if summary.shards:
        lines.append(f"shards      {len(summary.shards)}: {', '.join(summary.shards)}")
    where = f"'{summary.selected}'" if summary.selected else "the top level"
    lines.append(f"state dict  {where} ({summary.selected_reason})")
    by_dtype = ", ".join(
        f"{DTYPES[d].short if d in DTYPES else d} {human_size(n)}"
        for d, n in summary.bytes_by_dtype.items()
    )
    count = f"{len(summary.tensors)}, {summary.parameters:,} elements, {human_size(summary.nbytes)}"
    lines.append(f"tensors     {count}" + (f" ({by_dtype})" if by_dtype else ""))
    if summary.wrappers:
        chain = " ".join(f"{w.prefix} ({w.added_by})" for w in summary.wrappers)
        lines.append(f"wrappers    {chain}; `ckptkit convert --strip-wrappers` removes them")
    else:
        lines.append("wrappers    none")
    for alias, target in summary.aliases.items():
        lines.append(f"tied        {alias} = {target}")
    for group in summary.shared:
        lines.append(
            f"shared      {len(group)} tensors in one buffer: {', '.join(group[:4])}"
            + (" ..." if len(group) > 4 else "")
        )
    if summary.non_contiguous:
        lines.append(
            f"strided     {', '.join(summary.non_contiguous[:5])}"
            + (" ..." if len(summary.non_contiguous) > 5 else "")
        )
    for part in summary.dropped:
        lines.append(
            f"also        {part.path}: {part.tensors} tensors, "
            f"{human_size(part.nbytes)} (not weights)"
        )
    run = summary.training
    if run:
        lines.append(
            f"trained     {run.get('mode')} x{run.get('world_size')} on {run.get('nodes')} node(s) "
            f"({run.get('backend') or 'no process group'}, {run.get('device_type')}), epoch "
            f"{run.get('epoch')}, step {run.get('step')}, seed {run.get('seed')}, "
            f"torch {run.get('torch_version')}, {run.get('utc_time')}"
        )
        if run.get("removed_prefixes"):
            removed = "".join(run["removed_prefixes"])
            lines.append(f"unwrapped   saved without its {removed} wrapper: loads in any mode")
        lines.append(f"weights     sha256 {run.get('weights_sha256')}")
    for key, value in summary.extras.items():
        if key != TRAINING_KEY:
            lines.append(f"also        {key} = {_short(value)}")
    for key, value in summary.metadata.items():
        if not key.startswith(NAMESPACE):
            lines.append(f"metadata    {key} = {_short(value)}")
    for key, value in summary.ckptkit_metadata.items():
        if key != "training":
            lines.append(f"ckptkit     {key} = {_short(value)}")
    lines.extend(_safety_lines(summary.safety))
    return lines


def _safety_lines(report: ScanReport | None) -> list[str]:
    if report is None:
        return []
    if not report.pickles:
        return ["safety      safe: no pickle (safetensors holds only data)"]
    names = report.globals()
    odd = {name: cls for name, cls in names.items() if cls != "safe"}
    if not odd:
        return [f"safety      safe: {len(names)} globals, all in torch's weights_only set"]
    listed = ", ".join(f"{name} ({cls})" for name, cls in odd.items())
    return [f"safety      {report.verdict}: {listed}; `ckptkit scan` explains"]


def _short(value: Any, limit: int = 90) -> str:
    import json

    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."
