"""Checkpoint metadata: a dataclass that travels as safetensors' str -> str header and as JSON.

safetensors metadata must map strings to strings and always carries ``"format": "pt"``; every
richer value is JSON-encoded under a ``ckptkit.`` key, so nothing of value is lost. Keys that other
tools wrote are kept untouched in ``other``. Stdlib only.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = [
    "DISTRIBUTION",
    "NAMESPACE",
    "TRAINING_KEY",
    "CheckpointMeta",
    "jsonable",
    "training_of",
    "version",
]

# The name this project is installed under: `ckptkit` on the public index is another project.
# The import name and the command stay `ckptkit`.
DISTRIBUTION = "torch-ckptkit"
NAMESPACE = "ckptkit."
# Where ckptkit's training engine keeps a run's metadata inside its checkpoints.
TRAINING_KEY = "ckptkit"


@functools.cache
def version() -> str:
    """The installed version, from the package metadata (pyproject.toml is the one place it is
    written). Read on first use only: importlib.metadata costs a command tens of ms."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


@dataclass
class CheckpointMeta:
    """What ckptkit records about where a checkpoint came from and what was done to it."""

    source: str | None = None
    source_format: str | None = None
    selected: str | None = None
    removed_prefixes: list[str] = field(default_factory=list)
    added_prefixes: list[str] = field(default_factory=list)
    key_steps: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    writer: str = field(default_factory=lambda: f"ckptkit {version()}")
    # Metadata from other tools (a source safetensors header, say), kept as it was.
    other: dict[str, str] = field(default_factory=dict)

    def to_header(self) -> dict[str, str]:
        """Encode as a safetensors header: str -> str, ``format`` first, empty fields left out."""
        header = {"format": "pt", **{k: v for k, v in self.other.items() if k != "format"}}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "other" and value not in (None, [], {}):
                header[NAMESPACE + f.name] = json.dumps(jsonable(value), sort_keys=True)
        return header

    @classmethod
    def from_header(cls, header: Mapping[str, str]) -> CheckpointMeta:
        """Decode a safetensors header; unknown or undecodable keys land in ``other``."""
        known = {f.name for f in fields(cls)} - {"other"}
        values: dict[str, Any] = {}
        other: dict[str, str] = {}
        for key, text in header.items():
            name = key[len(NAMESPACE) :] if key.startswith(NAMESPACE) else None
            if name in known:
                try:
                    values[name] = json.loads(text)
                    continue
                except (TypeError, ValueError):
                    pass
            if key != "format":
                other[key] = text
        values.setdefault("writer", None)
        return cls(**values, other=other)

    def is_empty(self) -> bool:
        """True when the header held no ckptkit metadata at all."""
        return self.writer is None and not any(
            getattr(self, f.name) for f in fields(self) if f.name not in ("writer", "other")
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return jsonable(asdict(self))


_JSON_DEPTH = 32
_JSON_NODES = 10_000


def jsonable(value: Any) -> Any:
    """Turn nested Python values into what ``json.dumps`` accepts, losslessly where it can.

    Tuples and sets become lists, bytes become ``{"bytes": n}``, non-finite floats become strings
    (strict JSON has no NaN), other objects their ``repr``. Bounded, for trees read from hostile
    files: a cycle becomes ``"<cycle>"``, and past 32 levels or 10,000 values the rest is
    ``"..."`` (a DAG can hold exponentially many paths).
    """
    budget = [_JSON_NODES]
    return _jsonable(value, budget, set(), 0)


def _key(key: Any, budget: list[int], active: set[int], depth: int) -> str:
    if isinstance(key, str):
        return key
    return str(_jsonable(key, budget, active, depth + 1))  # never str() of a deep tuple


def _jsonable(value: Any, budget: list[int], active: set[int], depth: int) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):  # past ~4300 digits Python refuses to print an int at all
        return value if value.bit_length() <= 14000 else "<huge int>"
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value)}
    budget[0] -= 1
    if budget[0] < 0 or depth > _JSON_DEPTH:
        return "..."
    if id(value) in active:
        return "<cycle>"
    active.add(id(value))
    try:
        if isinstance(value, Mapping):
            return {
                _key(k, budget, active, depth): _jsonable(v, budget, active, depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [_jsonable(v, budget, active, depth + 1) for v in value]
        if isinstance(value, (set, frozenset)):
            return sorted((_jsonable(v, budget, active, depth + 1) for v in value), key=repr)
        if hasattr(value, "to_dict"):
            return _jsonable(value.to_dict(), budget, active, depth + 1)
        return repr(value)[:200]
    finally:
        active.discard(id(value))


def training_of(extras: Mapping[str, Any], header: Mapping[str, str]) -> dict[str, Any]:
    """A training run's metadata: the engine's checkpoint keeps it under ``TRAINING_KEY``, a
    converted safetensors file in its ``ckptkit.training`` header entry; empty when neither."""
    meta = extras.get(TRAINING_KEY)
    if isinstance(meta, dict):
        return meta
    if not any(key.startswith(NAMESPACE) for key in header):
        return {}
    return CheckpointMeta.from_header(header).training
