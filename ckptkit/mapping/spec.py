"""Mapping files: how the keys and shapes of one checkpoint family become another's, as data.

A mapping is TOML, read with the standard library (``tomllib``): people write it by hand, it
holds comments, it has no code to run and no indentation to get wrong (YAML) and its tables of
rules read as they are meant (JSON would need quoting everywhere and allows no comment). See
docs/mapping.md for the format; in short::

    name = "llama-meta"
    from = "meta"                 # the two sides, forward from -> to; --reverse swaps them
    to = "hf"

    [sides.meta]
    files = "consolidated.{rank:02}.pth"   # one file per rank...
    ranks = "tp"                           # ...as many as this variable says
    config = "params.json"                 # the document get() reads
    vars = { dim = "get('dim')", n_heads = "get('n_heads')" }

    [[rules]]
    from = "layers.{i}.attention.wq.weight"
    to = "model.layers.{i}.self_attn.q_proj.weight"
    ops = ["gather(dim=0)", "permute_rope(heads=n_heads)"]

Packs shipped with ckptkit live beside this module (``packs/NAME.toml``) and are named by
``NAME``; any other path is read as a file.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptkit.errors import MappingError
from ckptkit.mapping.expr import Expr, parse_expr
from ckptkit.mapping.ops import OpCall, parse_op
from ckptkit.mapping.patterns import Pattern, parse_pattern

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the same parser, before it joined the standard library
    import tomli as tomllib

__all__ = ["Mapping", "Rule", "Side", "load_mapping", "parse_mapping", "packs", "PACKS"]

PACKS = Path(__file__).parent / "packs"
_LARGEST_FILE = 1 << 20  # bytes: a mapping is written by hand
_MOST_RULES = 10_000
_TOP = {"name", "summary", "from", "to", "sides", "rules", "defaults"}
_SIDE = {"file", "files", "ranks", "config", "settings", "vars", "checks", "write"}
_RULE = {"from", "to", "ops", "optional", "one_way", "note"}


@dataclass(frozen=True)
class Side:
    """One end of a mapping: how its checkpoints are laid out and where its variables come from."""

    name: str
    file: str | None = None  # its weights' one file in its folder (consolidated.safetensors)
    files: Pattern | None = None  # one file per rank, named so (Meta's consolidated.NN.pth)
    ranks: str | None = None  # the variable counting them
    config: str | None = None  # the document beside the weights that get() reads
    # ...or the settings the checkpoint records itself, which get() reads instead (Megatron's
    # "args", which the reader keeps among the checkpoint's extras)
    settings: str | None = None
    vars: dict[str, Expr] = field(default_factory=dict)  # read when this side is the source
    # ...then these must hold: its config and its weights agree (a params.json of another model)
    checks: tuple[Expr, ...] = ()
    # ...and what to say when one fails, where the file says (its check's index -> text)
    says: dict[int, str] = field(default_factory=dict)
    write: dict[str, Any] | None = None  # the config document written when it is the target


@dataclass(frozen=True)
class Rule:
    """Source keys (patterns with captures), the ops that make the target keys' tensors."""

    number: int  # 1-based, as people count the file's [[rules]]
    sources: tuple[Pattern, ...]
    targets: tuple[Pattern, ...]
    ops: tuple[OpCall, ...]
    optional: bool = False  # matching no key is fine (a bias some models have)
    note: str = ""
    # Read forward only: another name some sources give what an earlier rule reads (the
    # reversed mapping writes that rule's names)
    one_way: bool = False

    @property
    def name(self) -> str:
        shown = ", ".join(p.source for p in self.sources)
        return f"rule {self.number} ({shown})"

    @property
    def over(self) -> str | None:
        """The capture whose values a stack joins (or an unstack makes), if any."""
        for op in self.ops:
            if op.name in ("stack", "unstack"):
                tree = op.args["over"].tree
                return getattr(tree, "id", None)
        return None


@dataclass(frozen=True)
class Mapping:
    """A mapping file, read and checked; :meth:`reversed` gives the other direction."""

    name: str
    summary: str
    source: Side
    target: Side
    rules: tuple[Rule, ...]
    defaults: dict[str, Expr]
    origin: str  # the pack's name or the file's path, for messages
    is_reversed: bool = False

    def reversed(self) -> Mapping:
        """The mapping the other way: each rule's targets read, its ops undone in reverse order.
        A rule that drops its keys makes nothing back (their bytes are gone), nor does a
        ``one_way`` rule (another rule writes its target's keys back).

        Raises:
            MappingError: an op whose inverse needs an argument the file does not give.
        """
        rules = []
        for rule in self.rules:
            if rule.one_way or any(op.name == "drop" for op in rule.ops):
                continue
            ops = []
            for op in reversed(rule.ops):
                inverse = op.inverse()
                assert inverse is not None
                ops.append(inverse)
            rules.append(replace(rule, sources=rule.targets, targets=rule.sources, ops=tuple(ops)))
        return replace(
            self,
            source=self.target,
            target=self.source,
            rules=tuple(rules),
            is_reversed=not self.is_reversed,
        )

    def reads(self) -> set[str]:
        """The variables this direction's conversion reads: in its rules' ops and key patterns,
        and the target's rank count (its config document reads what it reads as it is
        written, which ``source.open_mapped`` records)."""
        names: set[str] = set()
        for rule in self.rules:
            for op in rule.ops:
                for expr in op.args.values():
                    names |= expr.names()
            for pattern in (*rule.sources, *rule.targets):
                for part in pattern.parts:
                    if not isinstance(part, str) and part.shift is not None:
                        names |= part.shift.names()
        if self.target.ranks is not None:
            names.add(self.target.ranks)
        return names

    @property
    def direction(self) -> str:
        return f"{self.source.name} -> {self.target.name}"


def packs() -> dict[str, Path]:
    """The mapping packs shipped with ckptkit, by name."""
    return {p.stem: p for p in sorted(PACKS.glob("*.toml"))}


def load_mapping(name: str | Path) -> Mapping:
    """A pack by name (``llama-meta``) or a mapping file by path.

    Raises:
        MappingError: no such pack or file, or a file that is not a mapping.
    """
    shipped = packs()
    if isinstance(name, str) and name in shipped:
        path, origin = shipped[name], name
    else:
        path, origin = Path(name), str(name)
        if not path.is_file():
            raise MappingError(
                f"no mapping '{name}': neither a pack nor a file",
                f"name a pack ({', '.join(shipped) or 'none shipped'}) or a .toml file",
            )
    if path.stat().st_size > _LARGEST_FILE:
        raise MappingError(f"{path} is larger than a mapping written by hand ({_LARGEST_FILE} B)")
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise MappingError(f"{path} is not a TOML mapping file: {exc}") from None
    return parse_mapping(document, origin)


def parse_mapping(document: MappingType[str, Any], origin: str) -> Mapping:
    """A mapping from its parsed TOML document.

    Raises:
        MappingError: anything the format does not allow, naming ``origin`` and the rule.
    """
    _known(document, _TOP, origin)
    first, second = document.get("from"), document.get("to")
    sides = document.get("sides", {})
    if not isinstance(first, str) or not isinstance(second, str) or not first or first == second:
        raise MappingError(f"{origin}: 'from' and 'to' name the mapping's two sides")
    names = (first, second)
    if not isinstance(sides, dict):
        raise MappingError(f"{origin}: [sides] is a table of the two sides")
    unknown = set(sides) - set(names)
    if unknown:
        raise MappingError(f"{origin}: sides {sorted(unknown)} are neither 'from' nor 'to'")
    source, target = (_side(n, sides.get(n, {}), origin) for n in names)
    raw_rules = document.get("rules", [])
    if not isinstance(raw_rules, list) or not raw_rules:
        raise MappingError(f"{origin}: no [[rules]]", "a mapping maps keys: add [[rules]]")
    if len(raw_rules) > _MOST_RULES:
        raise MappingError(f"{origin}: more than {_MOST_RULES} rules")
    rules = tuple(_rule(i, raw, origin) for i, raw in enumerate(raw_rules, 1))
    defaults = document.get("defaults", {})
    if not isinstance(defaults, dict):
        raise MappingError(f"{origin}: [defaults] is a table of variables")
    return Mapping(
        name=str(document.get("name", Path(origin).stem)),
        summary=str(document.get("summary", "")),
        source=source,
        target=target,
        rules=rules,
        defaults={k: parse_expr(v, f"{origin}, defaults.{k}") for k, v in defaults.items()},
        origin=origin,
    )


def _known(table: MappingType[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise MappingError(
            f"{where}: unknown field(s) {', '.join(unknown)}",
            f"the fields here are {', '.join(sorted(allowed))}",
        )


def _side(name: str, raw: Any, origin: str) -> Side:
    where = f"{origin}, sides.{name}"
    if not isinstance(raw, dict):
        raise MappingError(f"{where} is a table")
    _known(raw, _SIDE, where)
    files = parse_pattern(raw["files"], f"{where}.files") if "files" in raw else None
    ranks = raw.get("ranks")
    if (files is None) != (ranks is None) or (ranks is not None and not isinstance(ranks, str)):
        raise MappingError(f"{where}: 'files' (a name per rank) and 'ranks' go together")
    file = raw.get("file")
    if file is not None and (files is not None or not _plain_name(file)):
        raise MappingError(f"{where}: 'file' names one file in the folder, without 'files'")
    if files is not None and (
        [(p.name, p.text) for p in files.parts if not isinstance(p, str)] != [("rank", False)]
        or not _plain_name(files.format({"rank": 0}, {}))
        or any(p.shift is not None for p in files.parts if not isinstance(p, str))
    ):
        raise MappingError(
            f"{where}.files names one file per rank in the folder by its number alone, e.g. "
            "'model.{rank:02}.pt'"
        )
    config = raw.get("config")
    if config is not None and not _plain_name(config):
        raise MappingError(f"{where}.config names a file in the checkpoint's folder")
    settings = raw.get("settings")
    if settings is not None and (
        config is not None or not isinstance(settings, str) or not settings.isidentifier()
    ):
        raise MappingError(
            f"{where}.settings names what the checkpoint records of its settings (args), "
            "instead of a config file"
        )
    raw_vars = raw.get("vars", {})
    write = raw.get("write")
    if not isinstance(raw_vars, dict) or (write is not None and not isinstance(write, dict)):
        raise MappingError(f"{where}: 'vars' and 'write' are tables")
    if write is not None and settings is not None and "file" in write:
        raise MappingError(
            f"{where}.write is the {settings} the checkpoint records itself (settings = "
            f"'{settings}'): it names no file"
        )
    if write is not None and settings is None and not _plain_name(write.get("file")):
        raise MappingError(f"{where}.write names its 'file' (config.json, params.json...)")
    if write is not None:
        _check_document(write, f"{where}.write", 0)
    checks = raw.get("checks", [])
    if not isinstance(checks, list):
        raise MappingError(f"{where}.checks is a list of expressions that must hold")
    says: dict[int, str] = {}
    for i, check in enumerate(checks):  # "expr", or {check = "expr", message = "why not"}
        if isinstance(check, dict):
            if set(check) != {"check", "message"} or not isinstance(check["message"], str):
                raise MappingError(f"{where}.checks: a table is {{check = ..., message = ...}}")
            checks[i], says[i] = check["check"], check["message"]
    return Side(
        name=name,
        file=file,
        files=files,
        ranks=ranks,
        config=config,
        settings=settings,
        vars={k: parse_expr(v, f"{where}.vars.{k}") for k, v in raw_vars.items()},
        checks=tuple(parse_expr(c, f"{where}.checks") for c in checks),
        says=says,
        write=write,
    )


def _plain_name(name: object) -> bool:
    """A file name in a folder: no path, no parent, nothing a folder would not hold."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and not any(c in name for c in "/\\\0")
    )


_DEEPEST = 16  # tables in tables in a config document a mapping writes


def _check_document(value: Any, where: str, depth: int) -> None:
    """A config template holds what JSON holds (no TOML dates), a few levels deep."""
    if depth > _DEEPEST:
        raise MappingError(f"{where}: tables nested more than {_DEEPEST} deep")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_document(item, f"{where}.{key}", depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_document(item, where, depth + 1)
    elif not isinstance(value, str | int | float | bool) or (
        isinstance(value, float) and value != value or value in (float("inf"), float("-inf"))
    ):
        raise MappingError(f"{where}: {value!r} is not a JSON value")


def _patterns(raw: Any, where: str) -> tuple[Pattern, ...]:
    items = raw if isinstance(raw, list) else [raw]
    return tuple(parse_pattern(p, where) for p in items)


def _rule(number: int, raw: Any, origin: str) -> Rule:
    where = f"{origin}, rule {number}"
    if not isinstance(raw, dict):
        raise MappingError(f"{where} is a table")
    _known(raw, _RULE, where)
    if "from" not in raw:
        raise MappingError(f"{where} has no 'from' (the source keys it takes)")
    sources = _patterns(raw["from"], f"{where}.from")
    targets = _patterns(raw.get("to", []), f"{where}.to")
    raw_ops = raw.get("ops", [])
    if not isinstance(raw_ops, list):
        raise MappingError(f'{where}.ops is a list, e.g. ["gather(dim=0)"]')
    ops = tuple(parse_op(text, f"{where}.ops") for text in raw_ops)
    drops = any(op.name == "drop" for op in ops)
    if drops and (targets or len(ops) != 1):
        raise MappingError(f"{where}: drop(reason) is the rule's only op, with no 'to'")
    if not drops and not targets:
        raise MappingError(f"{where} has no 'to'", "name the target keys, or drop(reason)")
    optional, note = raw.get("optional", False), raw.get("note", "")
    one_way = raw.get("one_way", False)
    if not isinstance(optional, bool) or not isinstance(one_way, bool) or not isinstance(note, str):
        raise MappingError(f"{where}: 'optional' and 'one_way' are true or false, 'note' a text")
    rule = Rule(number, sources, targets, ops, optional, note, one_way)
    over = rule.over
    captured = set().union(*(p.captures for p in sources))
    written = set().union(*(p.captures for p in targets)) if targets else set()
    unstacks = any(op.name == "unstack" for op in ops)
    missing = written - captured - ({over} if unstacks and over else set())
    if missing:
        raise MappingError(
            f"{where}: 'to' writes {{{sorted(missing)[0]}}}, which 'from' does not capture"
        )
    if over is not None and not unstacks and over not in captured:
        raise MappingError(f"{where}: stack(over={over}) names no capture of 'from'")
    return rule
