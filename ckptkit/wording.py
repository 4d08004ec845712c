"""The words every view shares: counts, sizes, a tensor in one line, a value cut short, and
the wrapper that makes a view's lines safe to print (see ``render.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec

from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import KINDS, TensorInfo
from ckptkit.text import escape

__all__ = ["terminal_safe", "plural", "human_size", "describe_tensor", "short"]

_P = ParamSpec("_P")


def terminal_safe(view: Callable[_P, list[str]]) -> Callable[_P, list[str]]:
    """A view whose lines are escaped (``ckptkit.text.escape``) when it returns: whatever a line
    holds, from ckptkit or from the file, no terminal acts on it. Lines of a view it calls are
    escaped already and stay as they are (escaping is done once)."""

    @functools.wraps(view)
    def safe(*args: _P.args, **kwargs: _P.kwargs) -> list[str]:
        return [escape(line) for line in view(*args, **kwargs)]

    return safe


def plural(count: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def human_size(nbytes: int) -> str:
    """``1234567`` -> ``1.2 MB`` (decimal units, as disks are sold)."""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def describe_tensor(info: TensorInfo, count: int = 1) -> str:
    dtype = DTYPES[info.dtype].short if info.dtype in DTYPES else info.dtype
    shape = "[" + ", ".join(map(str, info.shape)) + "]"
    note = "" if info.contiguous else "  non-contiguous"
    if info.kind != "dense":
        note += f"  {KINDS.get(info.kind, info.kind)}" + (
            f" ({info.detail})" if info.detail else ""
        )
    times = f"  x{count}" if count > 1 else ""
    return f"{shape} {dtype}{times}  {human_size(info.nbytes * count)}{note}"


def short(value: Any, limit: int = 90) -> str:
    import json

    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."
