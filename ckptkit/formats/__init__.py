"""Checkpoint formats, in rooms that import only downwards (where the bytes live, on disk or
at a URL, is ``ckptkit.storage``'s, below them all).

- ``base``: what every reader and writer shares: dtypes, ``Source`` and ``TensorInfo``, the search
  for the weights in a checkpoint's tree, and torch tensor helpers.
- ``pickles``: the static pickle machine, torch's objects read as data, scan verdicts, the pickle
  writer and torch's safe-globals table.
- ``files``: single files: torch zip and legacy, safetensors; every way a loader reads a file.
- ``folders``: folder layouts: sharded Hugging Face, DCP, DeepSpeed, every rank's files.
- ``open``: ``open_source``, the one door to every reader.
- ``output``: one writer per output format, and shard and tie planning.

Importing this package imports none of them (and never torch): each name below is imported on
first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptkit.formats.base.source import Source, TensorInfo
    from ckptkit.formats.files.readings import detect_format
    from ckptkit.formats.open import open_source
    from ckptkit.formats.output import OUTPUT_FORMATS, TO_FORMATS, output_format

__all__ = [
    "Source",
    "TensorInfo",
    "detect_format",
    "open_source",
    "OUTPUT_FORMATS",
    "TO_FORMATS",
    "output_format",
]

_WHERE = {
    "Source": "ckptkit.formats.base.source",
    "TensorInfo": "ckptkit.formats.base.source",
    "detect_format": "ckptkit.formats.files.readings",
    "open_source": "ckptkit.formats.open",
    "OUTPUT_FORMATS": "ckptkit.formats.output",
    "TO_FORMATS": "ckptkit.formats.output",
    "output_format": "ckptkit.formats.output",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ckptkit.formats' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
