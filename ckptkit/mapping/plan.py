"""A mapping applied to a checkpoint's headers: which rule takes which keys, what each group of
keys becomes, and an account of every source byte, all before a tensor is read.

Nothing is guessed and nothing is left over: a source key no rule takes, a key two rules (or two
patterns of one rule) take, a group missing one of its keys, a target key made twice, a rule
that takes nothing (unless ``optional``), a shape an op cannot take, are each refused by name.
Every source tensor is read by exactly one group; the bytes it does not pass on (a ``drop``, a
``slice`` of padding) are counted with the rule that let them go, so the plan's account adds up
to the source's bytes exactly (:attr:`MapPlan.accounted`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import MappingError
from ckptkit.formats.base.source import TensorInfo
from ckptkit.mapping.expr import Value
from ckptkit.mapping.ops import Meta, Step
from ckptkit.mapping.spec import Mapping, Rule

__all__ = [
    "SourceKeys",
    "Group",
    "Target",
    "RuleCount",
    "MapPlan",
    "plan_mapping",
    "variables",
    "config_getter",
    "shape_getter",
]

_MOST_SHOWN = 5  # keys named in one message


@dataclass(frozen=True)
class SourceKeys:
    """A checkpoint's tensors as a mapping reads them: one table of headers, or one per rank
    for a side saved per rank (rank ``r``'s table at index ``r``)."""

    ranks: list[dict[str, TensorInfo]]
    ranked: bool = False

    @classmethod
    def single(cls, entries: MappingType[str, TensorInfo]) -> SourceKeys:
        return cls([dict(entries)], False)

    @property
    def keys(self) -> list[str]:
        return list(self.ranks[0])

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for table in self.ranks for info in table.values())


Ref = tuple[int | None, str]  # (rank, key): a tensor of the source or the target


@dataclass
class Group:
    """One application of a rule: the source tensors it reads, its ops bound to their captures,
    and the target tensors it makes (in the order the ops give them)."""

    rule: Rule
    captures: dict[str, Value]
    inputs: list[list[Ref]]  # a value per slot: one ref, or one per rank
    steps: list[Step]
    outputs: list[Ref]
    metas: list[Meta]  # each output's shape and dtype
    nbytes: int  # the source bytes it reads
    dropped: int  # ...and of those, the ones it lets go
    names: dict[str, Value] = field(default_factory=dict)  # its ops' variables and captures
    where: str = ""  # the rule and a key, for messages
    source_ranks: int | None = None  # the source side's ranks (mapped back, scatter's count)

    def inverse_steps(self) -> list[Step] | None:
        """Its ops undone, bound as they were (``--check-roundtrip``); None when it drops."""
        steps = []
        for op in reversed(self.rule.ops):
            inverse = op.inverse()
            if inverse is None:
                return None
            steps.append(Step.bind(inverse, self.names, self.source_ranks, self.where))
        return steps


@dataclass(frozen=True)
class Target:
    """One tensor the mapping writes: its key (and rank, for a side saved per rank), shape,
    dtype, and the group that makes it."""

    key: str
    rank: int | None
    info: TensorInfo
    group: int  # index into MapPlan.groups


@dataclass
class RuleCount:
    """What a rule did, for the report."""

    rule: Rule
    groups: int = 0
    keys_in: int = 0
    keys_out: int = 0
    bytes_in: int = 0
    dropped: int = 0


@dataclass
class MapPlan:
    """Everything a mapped conversion will do, from headers alone."""

    mapping: Mapping
    names: dict[str, Value]
    groups: list[Group]
    targets: list[Target]
    counts: list[RuleCount]
    source_bytes: int
    target_ranks: int | None = None
    followed: list[str] = field(default_factory=list)  # variables taken from defaults, said so
    config_from: str | None = None  # the folder the target's config was taken from, said so

    @property
    def accounted(self) -> int:
        """Source bytes read by some rule: the source's own, when the plan holds."""
        return sum(c.bytes_in for c in self.counts)

    @property
    def dropped(self) -> int:
        return sum(c.dropped for c in self.counts)

    def describe(self) -> dict[str, Any]:
        """What the mapping did, for reports (``--json``'s ``mapping``)."""
        mapping = self.mapping
        return {
            "name": mapping.name,
            "from": mapping.origin,
            "direction": mapping.direction,
            "reversed": mapping.is_reversed,
            "rules": [
                {
                    "rule": c.rule.number,
                    "from": [p.source for p in c.rule.sources],
                    "to": [p.source for p in c.rule.targets],
                    "ops": [op.text for op in c.rule.ops],
                    "groups": c.groups,
                    "keys_in": c.keys_in,
                    "keys_out": c.keys_out,
                    "bytes_in": c.bytes_in,
                    "dropped_bytes": c.dropped,
                }
                for c in self.counts
            ],
            "dropped": [
                {"rule": c.rule.number, "bytes": c.dropped, "why": _reason(c.rule)}
                for c in self.counts
                if c.dropped
            ],
            "source_bytes": self.source_bytes,
            "accounted_bytes": self.accounted,
            "variables": {k: v for k, v in self.names.items() if not k.endswith("_count")},
            "defaults_taken": list(self.followed),
            "target_ranks": self.target_ranks,
            "config_from": self.config_from,
        }


def variables(
    mapping: Mapping,
    given: MappingType[str, Value],
    config: MappingType[str, Any] | None,
    tensors: MappingType[str, TensorInfo],
    ranks: int | None,
) -> tuple[dict[str, Value], list[str]]:
    """The mapping's variables: ``given`` (``--set``) first, then the source side's ``vars``
    (reading its config document and tensor shapes), then ``defaults``; the rank count of a
    side saved per rank is set from its files. Returns them and the names taken from defaults
    (the report says those the conversion reads: see ``source.open_mapped``).

    Raises:
        MappingError: a variable that cannot be read, or a ``--set`` that contradicts the files.
    """
    names: dict[str, Value] = dict(given)
    side = mapping.source
    if side.ranks is not None and ranks is not None:
        if side.ranks in names and names[side.ranks] != ranks:
            raise MappingError(
                f"--set {side.ranks}={names[side.ranks]}, but the source has {ranks} rank files"
            )
        names[side.ranks] = ranks
    functions = {
        "get": config_getter(config, side.config or _settings_name(side)),
        "shape": shape_getter(tensors, "the source"),
        "count": lambda text: _count(text, tensors, names),
    }
    for name, expr in side.vars.items():
        if name not in names:
            names[name] = expr.evaluate(names, functions)
    for i, check in enumerate(side.checks):
        if not check.evaluate(names, functions):
            if i in side.says:
                raise MappingError(f"{mapping.origin}: {side.says[i]}")
            values = ", ".join(f"{n} = {names[n]}" for n in sorted(check.names()) if n in names)
            raise MappingError(
                f"{mapping.origin}: this {side.name} checkpoint fails the mapping's check "
                f"'{check}' ({values})",
                f"is {side.config or side.settings or 'its config'} that of these weights? "
                "(--set corrects one)",
            )
    taken = []
    for name, expr in mapping.defaults.items():
        if name not in names:
            names[name] = expr.evaluate(names, functions)
            taken.append(name)
    return names, taken


def _settings_name(side: Any) -> str | None:
    return f"the checkpoint's {side.settings}" if side.settings else None


def shape_getter(tensors: MappingType[str, TensorInfo], what: str) -> Callable[..., Value]:
    """``shape('key', dim)``: a tensor's size along a dim."""

    def shape(key: Any, dim: Any) -> Value:
        info = tensors.get(str(key))
        rank = len(info.shape) if info is not None else 0
        if info is None or not isinstance(dim, int) or not -rank <= dim < rank:
            raise MappingError(f"the mapping reads dim {dim} of '{key}', which {what} lacks")
        return info.shape[dim]

    return shape


def _count(text: Any, tensors: MappingType[str, TensorInfo], names: MappingType[str, Value]) -> int:
    """``count('layers.{i}.attention_norm.weight')``: how many source keys a pattern matches
    (a layer count the checkpoint does not record elsewhere)."""
    from ckptkit.mapping.patterns import parse_pattern

    pattern = parse_pattern(text, "count()")
    return sum(1 for key in tensors if pattern.match(key, names) is not None)


def config_getter(config: MappingType[str, Any] | None, where: str | None) -> Callable[..., Value]:
    def get(path: Any, *default: Value) -> Value:
        if config is None:
            if default:
                return default[0]
            raise MappingError(
                f"the mapping reads '{path}' from {where or 'a config document'}, which the "
                "source does not have",
                f"give it with --set NAME=VALUE, or put {where} beside the weights",
            )
        node: Any = config
        for part in str(path).split("."):
            if not isinstance(node, dict) or part not in node or node[part] is None:
                if default:
                    return default[0]
                raise MappingError(
                    f"{where} has no field '{path}'",
                    "give the variable that reads it with --set NAME=VALUE",
                )
            node = node[part]
        if not isinstance(node, int | float | str | bool | list) or (
            isinstance(node, float) and not math.isfinite(node)
        ):
            raise MappingError(f"{where}'s '{path}' is not a number or text ({node!r})")
        return node

    return get


def plan_mapping(
    mapping: Mapping,
    source: SourceKeys,
    names: MappingType[str, Value],
    target_ranks: int | None = None,
) -> MapPlan:
    """Match every source key to its rule, group them, plan each group's ops on shapes, and
    check the account.

    Raises:
        MappingError: naming the rule and the key, for anything left over, taken twice,
            missing, made twice, or that does not fit.
    """
    _same_keys(source)
    claims = _claims(mapping, source, names)
    plan = MapPlan(
        mapping=mapping,
        names=dict(names),
        groups=[],
        targets=[],
        counts=[RuleCount(rule) for rule in mapping.rules],
        source_bytes=source.nbytes,
        target_ranks=target_ranks,
    )
    made: dict[Ref, str] = {}
    for r, rule in enumerate(mapping.rules):
        groups = claims.get(r, {})
        if not groups and not rule.optional:
            raise MappingError(
                f"{rule.name} of {mapping.origin} takes no key of the source",
                "is this checkpoint of the family the mapping is for? (mark a rule optional = "
                "true when some models lack its keys)",
            )
        for group_key, by_pattern in groups.items():
            group = _group(rule, dict(group_key), by_pattern, source, plan, made)
            count = plan.counts[r]
            count.groups += 1
            count.keys_in += sum(len(slot) for slot in group.inputs)
            count.keys_out += len(group.outputs)
            count.bytes_in += group.nbytes
            count.dropped += group.dropped
            plan.groups.append(group)
    plan.groups.sort(key=_order(mapping))
    for index, group in enumerate(plan.groups):
        for (rank, key), (shape, dtype) in zip(group.outputs, group.metas, strict=True):
            plan.targets.append(Target(key, rank, TensorInfo(dtype, tuple(shape)), index))
    if plan.accounted != plan.source_bytes:  # each key is claimed once: this cannot differ
        raise AssertionError(f"accounted {plan.accounted} of {plan.source_bytes} bytes")
    return plan


Claims = dict[int, dict[tuple[Any, ...], dict[int, list[tuple[Value, str]]]]]


def _claims(mapping: Mapping, source: SourceKeys, names: MappingType[str, Value]) -> Claims:
    """Each source key's rule: rule index -> group (its captures) -> pattern index -> the keys
    (with the value of the capture a stack joins over).

    Raises:
        MappingError: a key no rule takes, or two rules (or two patterns) take.
    """
    compiled = [[p.regex() for p in rule.sources] for rule in mapping.rules]
    claims: Claims = {}
    unclaimed: list[str] = []
    for key in source.keys:
        found = []
        for r, rule in enumerate(mapping.rules):
            for p, regex in enumerate(compiled[r]):
                if regex.fullmatch(key) is None:
                    continue
                captures = rule.sources[p].match(key, names)
                if captures is not None:
                    found.append((r, p, captures))
        if not found:
            unclaimed.append(key)
            continue
        if len(found) > 1:
            (r1, p1, _), (r2, p2, _) = found[:2]
            raise MappingError(
                f"'{key}' is taken by {_pattern_name(mapping.rules[r1], p1)} and by "
                f"{_pattern_name(mapping.rules[r2], p2)}",
                "make the patterns exclusive: each source key belongs to one rule",
            )
        r, p, captures = found[0]
        over = mapping.rules[r].over
        group_key = tuple(sorted((k, v) for k, v in captures.items() if k != over))
        by_pattern = claims.setdefault(r, {}).setdefault(group_key, {})
        by_pattern.setdefault(p, []).append((captures.get(over, 0) if over else 0, key))
    if unclaimed:
        shown = ", ".join(f"'{k}'" for k in unclaimed[:_MOST_SHOWN])
        more = f" and {len(unclaimed) - _MOST_SHOWN} more" if len(unclaimed) > _MOST_SHOWN else ""
        raise MappingError(
            f"no rule of {mapping.origin} ({mapping.direction}) takes {shown}{more}",
            "add a rule for them, or drop(reason) them: every source byte is accounted for",
        )
    return claims


def _order(mapping: Mapping) -> Callable[[Group], tuple[Any, ...]]:
    """The order targets are written in: rules in a row that capture the same names form a
    block, taken layer by layer (Meta's and Hugging Face's own order: the embedding, then each
    layer's tensors in the rules' order, then the final norm and the head)."""
    blocks: dict[int, int] = {}
    block, last = 0, None
    for rule in mapping.rules:
        captures = sorted({c for p in rule.sources for c in p.captures} - {rule.over})
        if last is not None and captures != last:
            block += 1
        blocks[rule.number], last = block, captures
    return lambda g: (
        blocks[g.rule.number],
        tuple(
            (0, v, "") if isinstance(v, int) else (1, 0, str(v))
            for _, v in sorted(g.captures.items())
        ),
        g.rule.number,
    )


def _reason(rule: Rule) -> str:
    """Why a rule lets bytes go: its drop's reason, or the padding a slice cuts."""
    for op in rule.ops:
        if op.name == "drop":
            return str(getattr(op.args["reason"].tree, "value", op.args["reason"].text))
    return "padding cut by " + ", ".join(op.text for op in rule.ops if op.name == "slice")


def _same_keys(source: SourceKeys) -> None:
    first = source.ranks[0]
    for rank, table in enumerate(source.ranks[1:], 1):
        if table.keys() != first.keys():
            missing = [k for k in first if k not in table]
            extra = [k for k in table if k not in first]
            what = f"lacks '{missing[0]}'" if missing else f"has '{extra[0]}', which rank 0 lacks"
            raise MappingError(
                f"rank {rank}'s file {what}", "are these files of one save? copy them again"
            )


def _pattern_name(rule: Rule, index: int) -> str:
    return f"rule {rule.number}'s '{rule.sources[index].source}'"


def _group(
    rule: Rule,
    captures: dict[str, Value],
    by_pattern: dict[int, list[tuple[Value, str]]],
    source: SourceKeys,
    plan: MapPlan,
    made: dict[Ref, str],
) -> Group:
    over = rule.over
    names = {**plan.names, **captures}
    example = next(iter(by_pattern.values()))[0][1]
    where = f"{plan.mapping.origin}, {rule.name} at '{example}'"
    keys: list[str] = []
    for p, pattern in enumerate(rule.sources):
        found = sorted(by_pattern.get(p, []), key=lambda vk: vk[0])
        if not found:
            wanted = pattern.format({**captures, **({over: 0} if over else {})}, plan.names)
            raise MappingError(
                f"{where}: '{wanted}' is missing", "the rule joins keys that come together"
            )
        if over is not None and over in pattern.captures:
            values = [v for v, _ in found]
            if values != list(range(len(values))):
                raise MappingError(f"{where}: {over} runs {values}, not 0 to {len(values) - 1}")
            names[f"{over}_count"] = len(values)
        keys += [k for _, k in found]
    ranks = range(len(source.ranks)) if source.ranks and source.ranked else [None]
    inputs: list[list[Ref]] = [[(r, k) for r in ranks] for k in keys]
    metas: list[Any] = []
    for slot in inputs:
        infos = [source.ranks[r or 0][k] for r, k in slot]
        for (_, key), info in zip(slot, infos, strict=True):
            if info.kind != "dense":
                raise MappingError(f"{where}: '{key}' is {info.kind}, which a mapping cannot read")
        pieces = [(info.shape, info.dtype) for info in infos]
        metas.append(pieces if source.ranked else pieces[0])
    nbytes = sum(source.ranks[r or 0][k].nbytes for slot in inputs for r, k in slot)
    steps = [Step.bind(op, names, plan.target_ranks, where) for op in rule.ops]
    dropped = 0
    for step in steps:
        metas, lost = step.plan(metas)
        dropped += lost
    outputs = _outputs(rule, captures, metas, plan, where)
    flat: list[Meta] = []
    for meta in metas:
        flat += meta if isinstance(meta, list) else [meta]
    if len(outputs) != len(flat):
        raise MappingError(
            f"{where}: the ops make {len(flat)} tensor(s) for {len(outputs)} target key(s)"
        )
    for rank, key in outputs:
        if (rank, key) in made:
            raise MappingError(
                f"{where}: target '{key}'{_rank(rank)} is also made by {made[(rank, key)]}",
                "each target key comes from one rule",
            )
        made[(rank, key)] = rule.name
    ranks_read = len(source.ranks) if source.ranked else None
    return Group(
        rule, captures, inputs, steps, outputs, flat, nbytes, dropped, names, where, ranks_read
    )


def _outputs(
    rule: Rule, captures: dict[str, Value], metas: list[Any], plan: MapPlan, where: str
) -> list[Ref]:
    """The target refs, in the order the ops give values: each target pattern's keys (one per
    value of an unstack's capture), each for every rank of a side saved per rank."""
    over = rule.over
    ranked = plan.mapping.target.ranks is not None
    per_rank = [m for m in metas if isinstance(m, list)]
    if ranked and len(per_rank) != len(metas):
        raise MappingError(
            f"{where}: the target is saved per rank, but the ops end with one tensor",
            "end with scatter(dim) for slices or replicate() for copies",
        )
    if not ranked and per_rank:
        raise MappingError(
            f"{where}: the ops end with one tensor per rank",
            "join them: gather(dim) for slices, same() for copies",
        )
    refs: list[Ref] = []
    count = len(metas) // max(len(rule.targets), 1) if over else 1
    for pattern in rule.targets:
        values = range(count) if over is not None and over in pattern.captures else [None]
        for value in values:
            caught = {**captures, over: value} if value is not None and over else captures
            key = pattern.format(caught, plan.names)
            ranks = range(plan.target_ranks or 1) if ranked else [None]
            refs += [(r, key) for r in ranks]
    return refs


def _rank(rank: int | None) -> str:
    return "" if rank is None else f" (rank {rank})"
