"""Small files read with bounds: a config, an index, a ``latest`` pointer.

Every length a file claims is bounded by what reading it needs: a file is opened only when it is
a regular file (a FIFO standing where a config should be would block the open for good), read
only up to a limit, and JSON is refused past a nesting depth before any code walks it (the
decoder's own recursion ends in a RecursionError, and so would ours). Local paths and URLs
alike; stdlib only.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ckptkit.errors import FormatError

__all__ = [
    "JSON_LIMIT",
    "JSON_DEPTH",
    "open_regular",
    "file_kind",
    "read_small",
    "read_json",
    "parse_json",
    "read_jsonl",
    "read_pointer",
    "quoted",
]

# A config, an adapter's config, a sharded index: a 100,000-tensor index is ~10 MiB.
JSON_LIMIT = 64 << 20
# Configs nest a few levels (a diffusers config's lists in a dict); 64 leaves room for any real
# one and stays far below Python's recursion limit.
JSON_DEPTH = 64


def open_regular(path: str | os.PathLike[str]) -> Any:
    """``open(path, "rb")``, for a regular file only: a FIFO, a device or a socket is refused
    without blocking (opened non-blocking, then checked on the open descriptor, so nothing can
    swap the file between the check and the open)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FormatError(
                f"{path} is a {file_kind(mode)}, not a regular file",
                "give the path of a file that holds the data",
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, by its ``st_mode`` ("FIFO", "socket"...)."""
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "folder"),
    ):
        if test(mode):
            return name
    return "special file"


def read_small(path: Any, limit: int, what: str) -> bytes:
    """A whole small file's bytes, refused when it holds more than ``limit`` (local or URL).

    Args:
        what: what the file is, for the error ("adapter config").
    """
    if hasattr(path, "listed_size"):  # a URL: its size asked before its bytes
        size = path.size()
        if size > limit:
            raise _too_big(path, what, size, limit)
        data = path.read_bytes()
    else:
        with open_regular(path) as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise _too_big(path, what, None, limit)
    return bytes(data)


def _too_big(path: Any, what: str, size: int | None, limit: int) -> FormatError:
    held = f"{size:,} bytes" if size is not None else f"more than {limit:,} bytes"
    return FormatError(
        f"{path} is too large for a {what} ({held}; at most {limit:,} are read)",
        f"check that {Path(str(path)).name} is the {what}",
    )


def read_json(path: Any, what: str, *, limit: int = JSON_LIMIT) -> Any:
    """A JSON file's value, its size and nesting bounded; every failure one FormatError naming
    the file."""
    data = read_small(path, limit, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
            f"check that it is the {what}",
        ) from None
    return parse_json(text, f"{path}", what)


def parse_json(text: str, where: str, what: str) -> Any:
    """``json.loads`` with its nesting bounded, so neither the decoder nor a caller walking the
    value recurses without end; errors name ``where``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(where, what, None) from None
    except ValueError as exc:
        raise FormatError(
            f"{where} is not valid JSON ({exc})", f"check that it is the {what}"
        ) from None
    depth = _depth(value)
    if depth > JSON_DEPTH:
        raise _too_deep(where, what, depth)
    return value


def read_jsonl(path: Any, what: str, *, limit: int) -> list[dict[str, Any]]:
    """A JSON-lines log's records (a local file or one at a URL), read up to ``limit`` bytes;
    a torn last line of a killed run (or any line that is no JSON object, or nests too deep)
    is skipped."""
    text = read_small(path, limit, what).decode("utf-8", errors="replace")
    out = []
    for line in text.splitlines():
        try:
            value = parse_json(line, str(path), what)
        except FormatError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def _too_deep(where: str, what: str, depth: int | None) -> FormatError:
    levels = f"{depth} levels" if depth is not None else "too many levels"
    return FormatError(
        f"{where} nests {levels} deep (at most {JSON_DEPTH} are read)",
        f"check that it is the {what}",
    )


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in a parsed JSON value (walked without recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend(
                (child, depth + 1) for child in children if isinstance(child, (dict, list))
            )
    return deepest


POINTER_LIMIT = 4096  # a pointer file names a checkpoint or a tag: a line, never a file's worth


def read_pointer(path: Any, what: str = "pointer file") -> str:
    """The name a pointer file holds (``latest``, ``best``, a Hub cache's ``refs/main``): its
    stripped text, refused past a few kB."""
    return read_small(path, POINTER_LIMIT, what).decode("utf-8", "replace").strip()


def quoted(text: str, limit: int = 80) -> str:
    """``repr`` of a value read from a file, cut to ``limit`` characters for an error line."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
