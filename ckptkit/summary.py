"""``summarize``: what is in a checkpoint, from headers alone (its views are in ``render``).

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

from ckptkit.adapters import describe
from ckptkit.formats.base.source import TensorInfo
from ckptkit.formats.base.tree import Candidate, DroppedPart
from ckptkit.formats.open import open_source
from ckptkit.keys import Wrapper, build_plan, detect_wrappers
from ckptkit.meta import NAMESPACE, CheckpointMeta, training_of
from ckptkit.scan import ScanReport, report_of, scan

__all__ = ["summarize", "Summary", "collapse", "keep"]

MIN_FOLD = 3  # fold repeated layers only from three on: two lines read better than a pattern


@dataclass
class Summary:
    """Everything ``inspect`` shows about one checkpoint."""

    def __str__(self) -> str:
        """What ``ckptkit inspect`` prints of it."""
        from ckptkit.render import inspect_lines

        return "\n".join(inspect_lines(self))

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
    candidates: list[Candidate] = field(default_factory=list)  # every tensor map that could be it
    # A folder's files (an Accelerate save_state folder, a model folder): name, what it is,
    # bytes, and its scan verdict.
    parts: list[dict[str, Any]] = field(default_factory=list)
    shards: dict[str, int] = field(default_factory=dict)
    adapter: dict[str, Any] | None = None  # a LoRA adapter's kind, base, ranks, targets

    @property
    def parameters(self) -> int:
        """Elements in all tensors of the state dict (parameters and buffers)."""
        return sum(info.numel for _, info in self.tensors)

    @property
    def nbytes(self) -> int:
        aliases = self.aliases
        return sum(info.nbytes for key, info in self.tensors if key not in aliases)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for key, info in self.tensors:
            if key not in self.aliases:
                out[info.dtype] += info.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def common_prefix(self) -> str | None:
        """A first name every key shares once wrappers are stripped (Lightning's ``model.``),
        which ``--strip-prefix`` removes; None when the keys do not all share one."""
        keys = list(build_plan([k for k, _ in self.tensors], strip_wrappers=True).mapping.values())
        heads = {k.split(".", 1)[0] for k in keys if k}
        if len(keys) < 2 or len(heads) != 1 or not all(k and "." in k for k in keys):
            return None
        return heads.pop() + "."

    @property
    def non_contiguous(self) -> list[str]:
        return [key for key, info in self.tensors if not info.contiguous]

    @property
    def training(self) -> dict[str, Any]:
        """The training run's metadata, from an engine checkpoint or a converted file's header."""
        return training_of(self.extras, self.metadata)

    @property
    def ckptkit_metadata(self) -> dict[str, Any]:
        """The ``ckptkit.`` metadata, decoded (empty when there is none)."""
        if not any(k.startswith(NAMESPACE) for k in self.metadata):
            return {}
        meta = CheckpointMeta.from_header(self.metadata).to_dict()
        return {k: v for k, v in meta.items() if v not in (None, [], {}) and k != "other"}

    def to_dict(self, key_filter: str | None = None) -> dict[str, Any]:
        """The fields of the ``inspect --json`` document (see ``render.SCHEMAS``)."""
        return {
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
            "weights_candidates": [c.to_dict() for c in self.candidates],
            "parts": self.parts,
            "common_prefix": self.common_prefix,
            "aliases": self.aliases,
            "shared_storage": self.shared,
            "non_contiguous": self.non_contiguous,
            "extras": self.extras,
            "other_parts": [part.to_dict() for part in self.dropped],
            "metadata": {k: v for k, v in self.metadata.items() if not k.startswith(NAMESPACE)},
            "ckptkit_metadata": self.ckptkit_metadata,
            "safety": self.safety.to_dict() if self.safety else None,
            "adapter": self.adapter,
            "tensors": [
                {"key": key, **info.to_dict(), "contiguous": info.contiguous}
                for key, info in self.tensors
                if keep(key, key_filter)
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
        readings = getattr(source, "readings", None)
        if readings:
            safety = report_of(source.path, readings)
        elif source.format == "safetensors":
            safety = scan(source.path)  # the file itself (path may be its model folder)
        entries = source.entries()
        summary = Summary(
            path=str(path),
            format=source.format
            if source.format != "sharded"
            else f"sharded {getattr(source, 'shard_format', '?')}",
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
            candidates=list(source.candidates),
            parts=_folder_parts(path, safety)
            if path.is_dir() and source.format != "sharded"
            else [],
            shards={
                name: shard.path.stat().st_size
                for name, shard in getattr(source, "shards", {}).items()
            },
            adapter=describe(source),
        )
    return summary


def _folder_parts(folder: Path, opened: ScanReport | None) -> list[dict[str, Any]]:
    """Each file of a folder, what it is and its verdict; the file already opened (and
    scanned) as the folder's model is not scanned again."""
    from ckptkit.formats.folders.layouts import folder_parts
    from ckptkit.scan import scan_many

    named = folder_parts(folder)
    done = {Path(opened.path).name: opened} if opened is not None else {}
    rest = iter(scan_many(folder / name for name, _ in named if name not in done))
    reports = [done[name] if name in done else next(rest) for name, _ in named]
    return [
        {
            "name": name,
            "kind": kind,
            "bytes": (folder / name).stat().st_size,
            "verdict": report.verdict if report.error is None else "not a checkpoint",
        }
        for (name, kind), report in zip(named, reports, strict=True)
    ]


def _size_on_disk(source: Any) -> int:
    return sum(os.path.getsize(path) for path in source.files())


def _shared_groups(
    entries: list[tuple[str, TensorInfo]], aliases: dict[str, str]
) -> list[list[str]]:
    """Keys that live in one storage without being the same tensor (views, flat buffers)."""
    by_storage: dict[str, list[str]] = defaultdict(list)
    for key, info in entries:
        if info.storage is not None and key not in aliases:
            by_storage[info.storage].append(key)
    return [keys for keys in by_storage.values() if len(keys) > 1]


def keep(key: str, pattern: str | None) -> bool:
    """Whether a key passes a ``--filter`` glob (None: every key)."""
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
