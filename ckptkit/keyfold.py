"""Which keys ``--filter`` keeps, and numbered keys folded into one row (``inspect``'s tree).

Pure functions over key strings: no file is read, and nothing here imports torch.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

__all__ = ["keep", "collapse", "MIN_FOLD"]

MIN_FOLD = 3  # fold repeated layers only from three on: two lines read better than a pattern


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

    One pass, one regular-expression split a key: a group keeps the numbers seen at each of its
    numeric places and where its keys are, never the keys' parts (100,000 keys split into
    parts took 60 MB).
    """
    # (the text between numeric parts, value) -> [positions, one set of numbers per place]
    groups: dict[tuple[tuple[str, ...], int], tuple[list[int], list[set[int]]]] = {}
    # Values are compared once per object (a dataclass hashes in Python), by id after that
    # (``rows`` keeps every value alive, so no id is reused).
    same: dict[Any, Any] = {}
    ids: dict[int, int] = {}
    split = _NUMERIC_PART.split
    for position, (key, value) in enumerate(rows):
        look = ids.get(id(value))
        if look is None:
            look = ids[id(value)] = id(same.setdefault(value, value))
        pieces = split(key)  # text, number, text, number, ..., text
        group = groups.get((tuple(pieces[::2]), look))
        if group is None:
            group = groups[(tuple(pieces[::2]), look)] = ([], [set() for _ in pieces[1::2]])
        group[0].append(position)
        for numbers, number in zip(group[1], pieces[1::2], strict=True):
            numbers.add(int(number))
    out: list[tuple[int, tuple[str, ...], Any, int]] = []
    for positions, places in groups.values():
        value = rows[positions[0]][1]
        combos = 1
        for numbers in places:
            combos *= len(numbers)
        if len(positions) >= MIN_FOLD and combos == len(positions):
            spans = iter([_span(list(numbers)) for numbers in places])
            parts = rows[positions[0]][0].split(".")
            path = tuple(next(spans) if _NUMERIC.fullmatch(p) else p for p in parts)
            out.append((positions[0], path, value, len(positions)))
        else:
            out.extend((at, tuple(rows[at][0].split(".")), value, 1) for at in positions)
    out.sort(key=lambda row: row[0])
    return [(path, value, count) for _, path, value, count in out]


# A dot-separated part that is a number (``layers.12.q``), found without splitting the key.
_NUMERIC = re.compile(r"\d+")

_NUMERIC_PART = re.compile(r"(?<![^.])(\d+)(?![^.])")
