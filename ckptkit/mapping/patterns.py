"""Key patterns: ``layers.{i}.attention.wq.weight`` matched whole (anchored: a pattern never
matches inside a longer key) and written back from its captures.

A ``{name}`` slot captures a whole number written without leading zeros, so what is read is
what is written (``layers.01`` matches nothing rather than coming back as ``layers.1``); the
target side may shift it, ``{i + offset}`` or ``{i - 1}``, by an expression of the mapping's
variables, and the shift is undone when the pattern is read (``--reverse``). ``{name:str}``
captures one dotted part of any text; ``{name:02}`` writes the number at least two digits
wide (file names such as ``consolidated.{rank:02}.pth``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ckptkit.errors import MappingError
from ckptkit.mapping.expr import Expr, Value, parse_expr

__all__ = ["Pattern", "Slot", "parse_pattern"]

_SLOT = re.compile(r"\{([^{}]*)\}")
_NUMBER = r"(?:0|[1-9][0-9]*)"


@dataclass(frozen=True)
class Slot:
    """One ``{...}``: the capture it names, an optional shift (``+ expr`` or ``- expr``) and
    how it is written."""

    name: str
    shift: Expr | None = None
    sign: int = 1
    width: int = 0  # digits, zero-padded
    text: bool = False  # {name:str}: a dotted part, not a number

    def offset(self, names: Mapping[str, Value]) -> int:
        return 0 if self.shift is None else self.sign * self.shift.as_int(names)


@dataclass(frozen=True)
class Pattern:
    """A key pattern: literal text and slots, in order."""

    source: str
    parts: tuple[str | Slot, ...]

    @property
    def captures(self) -> list[str]:
        return [p.name for p in self.parts if isinstance(p, Slot)]

    @property
    def literal(self) -> bool:
        return all(isinstance(p, str) for p in self.parts)

    def regex(self) -> re.Pattern[str]:
        """The anchored expression matching the keys this pattern names (shifts are undone
        after matching, in :meth:`match`)."""
        out, seen = [], set()
        for part in self.parts:
            if isinstance(part, str):
                out.append(re.escape(part))
            elif part.name in seen:  # the same capture twice must read the same
                out.append(f"(?P={part.name})")
            else:
                seen.add(part.name)
                body = "[^.]+" if part.text else (r"[0-9]+" if part.width else _NUMBER)
                out.append(f"(?P<{part.name}>{body})")
        return re.compile("".join(out))

    def match(self, key: str, names: Mapping[str, Value]) -> dict[str, Value] | None:
        """The captures of ``key`` with shifts undone, or None when it is not this pattern's
        (or only in a form :meth:`format` would not write back)."""
        found = self.regex().fullmatch(key)
        if found is None:
            return None
        captures: dict[str, Value] = {}
        for part in self.parts:
            if isinstance(part, Slot) and part.name not in captures:
                raw = found.group(part.name)
                captures[part.name] = raw if part.text else int(raw) - part.offset(names)
        if any(isinstance(v, int) and v < 0 for v in captures.values()):
            return None
        return captures if self.format(captures, names) == key else None

    def format(self, captures: Mapping[str, Value], names: Mapping[str, Value]) -> str:
        """The key these captures name."""
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            if part.name not in captures:
                raise MappingError(f"'{self.source}' writes {{{part.name}}}, which is not captured")
            value = captures[part.name]
            if part.text:
                out.append(str(value))
            else:
                assert isinstance(value, int)
                number = value + part.offset({**names, **captures})
                out.append(f"{number:0{part.width}d}" if part.width else str(number))
        return "".join(out)

    def __str__(self) -> str:
        return self.source


def parse_pattern(text: object, where: str) -> Pattern:
    """A key pattern of a mapping file.

    Raises:
        MappingError: unbalanced braces, a slot that is not ``name``, ``name + expr``,
            ``name - expr``, ``name:str`` or ``name:0N``, or two slots side by side.
    """
    if not isinstance(text, str) or not text:
        raise MappingError(f"{where}: a key pattern is a text, found {text!r}")
    parts: list[str | Slot] = []
    end = 0
    for found in _SLOT.finditer(text):
        literal = text[end : found.start()]
        if "{" in literal or "}" in literal:
            raise MappingError(f"{where}: unbalanced braces in '{text}'")
        if not literal and parts and isinstance(parts[-1], Slot):
            raise MappingError(f"{where}: '{text}' has two slots side by side, which no key splits")
        if literal:
            parts.append(literal)
        parts.append(_slot(found.group(1), text, where))
        end = found.end()
    rest = text[end:]
    if "{" in rest or "}" in rest:
        raise MappingError(f"{where}: unbalanced braces in '{text}'")
    if rest:
        parts.append(rest)
    for i, part in enumerate(parts):
        # A text capture is a whole dotted part: between dots it cannot match in more than one
        # way, so no key makes the match backtrack without end.
        if isinstance(part, Slot) and part.text:
            before = parts[i - 1] if i else "."
            after = parts[i + 1] if i + 1 < len(parts) else "."
            if not (isinstance(before, str) and before.endswith(".")) or not (
                isinstance(after, str) and after.startswith(".")
            ):
                raise MappingError(
                    f"{where}: {{{part.name}:str}} in '{text}' is not a whole dotted part",
                    "write it between dots, e.g. 'layers.{i}.{name:str}.weight'",
                )
    return Pattern(text, tuple(parts))


def _slot(body: str, text: str, where: str) -> Slot:
    body, _, spec = body.partition(":")
    width, is_text = 0, False
    if spec == "str":
        is_text = True
    elif spec:
        if not re.fullmatch(r"0[1-9]", spec):
            raise MappingError(f"{where}: '{{{body}:{spec}}}' in '{text}': write :str or :0N")
        width = int(spec)
    expr = parse_expr(body, f"{where}, slot {{{body}}}")
    node = expr.tree
    if isinstance(node, ast.Name):
        return Slot(node.id, width=width, text=is_text)
    if (
        not is_text
        and isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Add | ast.Sub)
        and isinstance(node.left, ast.Name)
    ):
        shift = Expr(ast.unparse(node.right), node.right)
        if node.left.id in shift.names():
            raise MappingError(f"{where}: '{{{body}}}' shifts {node.left.id} by itself")
        sign = 1 if isinstance(node.op, ast.Add) else -1
        return Slot(node.left.id, shift, sign, width)
    raise MappingError(
        f"{where}: slot '{{{body}}}' in '{text}' is not a capture",
        "write {name}, {name + expr} or {name - expr}, {name:str}",
    )
