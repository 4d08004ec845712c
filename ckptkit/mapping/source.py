"""A checkpoint read through a mapping: :func:`open_mapped` opens the source (one file, a model
folder, or one file per rank), plans the mapping on its headers, and gives a
:class:`MappedSource` whose keys are the target's, which the conversion writes like any source.

A tensor a rule only renames keeps its source's byte range, so the copy engine copies it file
to file; any other is made with its group (one layer's q, k and v, one weight's rank slices)
when first asked, and the group's other outputs are kept until they are asked for too: memory
holds one group, never the model.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, MappingError, UsageError
from ckptkit.formats.base.laid import Laid, Span, SpanViews
from ckptkit.formats.base.layout import Layout
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.open import OpenOptions, open_source
from ckptkit.mapping.expr import Value, parse_expr
from ckptkit.mapping.layout import Check, lay
from ckptkit.mapping.plan import (
    MapPlan,
    SourceKeys,
    config_getter,
    plan_mapping,
    shape_getter,
    variables,
)
from ckptkit.mapping.spec import Mapping, Side, load_mapping
from ckptkit.storage.location import Location, holds_file, listing, location
from ckptkit.storage.small import read_json

if TYPE_CHECKING:
    import torch

__all__ = [
    "MapOptions",
    "MappedSource",
    "open_mapped",
    "map_plan",
    "render_document",
    "parse_sets",
]

_MOST_RANKS = 4096  # rank files in one folder: more is a folder of something else


@dataclass(frozen=True, kw_only=True)
class MapOptions:
    """What ``--map``, ``--reverse`` and ``--set`` ask."""

    mapping: str | Path
    reverse: bool = False
    sets: MappingType[str, Value] = field(default_factory=dict)
    check_roundtrip: bool = False  # each group mapped back in the stream, compared bit for bit
    # A model folder whose config document the target takes as it is (its variables read from
    # it, so the weights are checked against it), and whose tokenizer files go beside it.
    config_from: Path | None = None

    def load(self) -> Mapping:
        mapping = load_mapping(self.mapping)
        return mapping.reversed() if self.reverse else mapping


def parse_sets(items: list[str] | tuple[str, ...]) -> dict[str, Value]:
    """``--set NAME=VALUE`` as variables: VALUE is an expression of numbers (``tp=2``).

    Raises:
        UsageError: not NAME=VALUE.
    """
    sets: dict[str, Value] = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
            raise UsageError(f"--set '{item}' is not NAME=VALUE", "write it like --set tp=2")
        try:
            value = parse_expr(text, f"--set {name}").evaluate(sets)
        except MappingError as exc:
            raise UsageError(exc.message, "write it like --set tp=2") from None
        sets[name.strip()] = value
    return sets


# A group moved as bytes: each output's layout, over its inputs' file ranges.
_Moved = tuple[dict[tuple[int | None, str], Layout], list[Span]]


class MappedSource(Source):
    """The target's tensors, each made from its group of source tensors."""

    made_once = True  # each group is read and made once; what was written is checked by CRC

    def __init__(
        self, plan: MapPlan, sources: list[Source], path: Location, rank: int | None = None
    ) -> None:
        super().__init__(path=path, format=sources[0].format)
        self.plan = plan
        self._sources = sources
        self._rank = rank
        # A target saved per rank names each of its tensors "rank R:KEY" until the plan puts
        # them in rank R's file under KEY (conversion.plan.per_rank).
        self._targets = {_name(t.key, t.rank): t for t in plan.targets}
        self._made: tuple[int, dict[tuple[int | None, str], torch.Tensor]] | None = None
        # The group being moved as bytes (made_pieces): its outputs' layouts and the mapped
        # ranges of its inputs.
        self._moved: tuple[int, _Moved | None] | None = None
        self._views = SpanViews()
        self.check_roundtrip = False
        self.roundtrips: set[int] = set()  # groups mapped back and found bit-equal

    def entries(self) -> list[tuple[str, TensorInfo]]:
        return [(key, target.info) for key, target in self._targets.items()]

    @property
    def rank_files(self) -> list[str] | None:
        """The target's file names when its side names them: one per rank (Meta's
        consolidated.NN.pth), or its one file (Mistral's consolidated.safetensors)."""
        side = self.plan.mapping.target
        if side.file is not None:
            return [side.file]
        if side.files is None:
            return None
        return [side.files.format({"rank": r}, {}) for r in range(self.plan.target_ranks or 1)]

    def placed(self, name: str) -> tuple[int, str]:
        """A target tensor's rank and key, from its name here."""
        target = self._targets[name]
        return target.rank or 0, target.key

    def _input(self, rank: int | None, key: str) -> Source:
        return self._sources[rank or 0]

    def byte_pieces(self, key: str) -> list[tuple[Location, int, int]] | None:
        """A tensor that goes out as its source's bytes: renamed, or its ranks' row slices
        joined (``gather(dim=0)``), each rank's bytes in rank order. None for any other."""
        target = self._targets[key]
        group = self.plan.groups[target.group]
        refs = _bytes_of(group, group.outputs.index((target.rank, target.key)), self.plan)
        if refs is None:
            return None
        pieces = []
        for rank, old in refs:
            span = self._input(rank, old).byte_span(old)
            if span is None:
                return None
            pieces.append(span)
        return pieces

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        pieces = self.byte_pieces(key)
        return pieces[0] if pieces is not None and len(pieces) == 1 else None

    def made_pieces(self, key: str) -> list[memoryview] | None:
        """A tensor whose group only moves bytes (rank slices joined along any dim, q/k rows
        permuted, fused tensors cut, padding), as views of the mapped source files (and of
        zeros) whose concatenation is its bytes; None when an op computes (``cast``,
        ``transpose``), a source tensor does not lie in local files as it is, or
        ``--check-roundtrip`` maps the group back through torch."""
        laid = self.laid_out(key)
        return None if laid is None else self._views.views(laid.layout)

    def laid_out(self, key: str) -> Laid | None:
        """A tensor whose group only moves bytes, as its group's input ranges and a layout
        over them (what a legacy Megatron save's ranks are cut from); None as for
        :meth:`made_pieces`."""
        if self.check_roundtrip:
            return None
        target = self._targets[key]
        if self._moved is None or self._moved[0] != target.group:
            self._moved = None
            self._views.release()  # the previous group's mappings go first
            self._moved = (target.group, self._move(target.group))
        moved = self._moved[1]
        if moved is None:
            return None
        layouts, spans = moved
        return Laid(spans, layouts[(target.rank, target.key)])

    def _move(self, index: int) -> _Moved | None:
        """One group's outputs as layouts of its inputs' file ranges, those ranges mapped;
        ``same``'s rank copies compared."""
        group = self.plan.groups[index]
        spans: list[Span] = []
        values: list[Any] = []
        for slot in group.inputs:
            layouts = []
            for rank, key in slot:
                laid = self._input(rank, key).laid_out(key)
                if laid is None:
                    return None
                layouts.append(laid.layout.moved(len(spans)))  # its slots after the others'
                spans += laid.spans
            values.append(layouts if slot[0][0] is not None else layouts[0])
        checks: list[Check] = []
        for step in group.steps:
            laid_values = lay(step, values, checks)
            if laid_values is None:
                return None
            values = laid_values
        self._views.map(spans)
        for first, other, error in checks:  # same(): every rank's copy as rank 0's
            if self._views.bytes(first) != self._views.bytes(other):
                raise error
        flat: list[Layout] = []
        for value in values:
            flat += value if isinstance(value, list) else [value]
        return dict(zip(group.outputs, flat, strict=True)), spans

    def load(self, key: str) -> torch.Tensor:
        target = self._targets[key]
        if self._made is None or self._made[0] != target.group:
            self._made = (target.group, self._run(target.group))
        return self._made[1][(target.rank, target.key)]

    def _run(self, index: int) -> dict[tuple[int | None, str], torch.Tensor]:
        """One group's outputs (the previous group's are let go: memory holds one)."""
        self._made = None
        group = self.plan.groups[index]
        values: list[Any] = []
        for slot in group.inputs:
            tensors = [self._input(rank, key).load(key) for rank, key in slot]
            values.append(tensors if slot[0][0] is not None else tensors[0])
        inputs = values
        for step in group.steps:
            values = step.run(values)
        if self.check_roundtrip and index not in self.roundtrips:
            self._map_back(index, values, inputs)
        flat: list[torch.Tensor] = []
        for value in values:
            flat += value if isinstance(value, list) else [value]
        return {ref: t.contiguous() for ref, t in zip(group.outputs, flat, strict=True)}

    def _map_back(self, index: int, values: list[Any], inputs: list[Any]) -> None:
        """``--check-roundtrip``: the group's outputs mapped back by the inverse ops must be
        its inputs, bit for bit (a group that drops its tensors has nothing to give back).

        Raises:
            VerificationError: naming the rule and the key that came back different.
        """
        from ckptkit.errors import VerificationError
        from ckptkit.formats.base.tensors import bit_equal

        group = self.plan.groups[index]
        steps = group.inverse_steps()
        if steps is None:
            return
        back = values
        for step in steps:
            back = step.run(back)
        for slot, want, got in zip(group.inputs, inputs, back, strict=True):
            pairs = zip(want, got, strict=True) if isinstance(want, list) else [(want, got)]
            for (rank, key), (a, b) in zip(slot, pairs, strict=True):
                if not bit_equal(a, b):
                    shown = key if rank is None else f"{key} (rank {rank})"
                    raise VerificationError(
                        f"{group.where}: mapped and mapped back, '{shown}' is not what it was; "
                        "nothing was written",
                        "the mapping loses information there: check the rule's ops",
                    )
        self.roundtrips.add(index)

    def files(self) -> list[Location]:
        return [f for source in self._sources for f in source.files()]

    def close(self) -> None:
        self._made = self._moved = None
        self._views.close()
        for source in self._sources:
            source.close()


def _name(key: str, rank: int | None) -> str:
    return key if rank is None else f"rank {rank}:{key}"


def _bytes_of(group: Any, index: int, plan: MapPlan) -> list[tuple[int | None, str]] | None:
    """The source tensors whose bytes, end to end, are a group's output ``index`` as they lie:
    a renamed one (a rule may rename several keys together), the only rank's, or every rank's
    row slice (``gather`` along the first dim). None when the output is computed. Copies of
    one tensor on every rank (``same``) are read, so that they are checked equal."""
    if all(s.call.name in ("rename", "require") for s in group.steps):
        if len(group.inputs) == len(group.outputs) and len(group.inputs[index]) == 1:
            return list(group.inputs[index])
        return None
    if len(group.inputs) != 1 or len(group.outputs) != 1:
        return None
    ranks = len(group.inputs[0])
    one_rank = ranks == 1 and (plan.target_ranks or 1) == 1
    for step in group.steps:
        name = step.call.name
        if name in ("rename", "require"):
            continue
        if name == "gather" and (ranks == 1 or step.values["dim"] in (0, -_ndim(group))):
            continue
        if name in ("same", "scatter", "replicate") and one_rank:
            continue
        return None
    return list(group.inputs[0])


def _ndim(group: Any) -> int:
    return len(group.metas[0][0])


@contextlib.contextmanager
def open_mapped(
    src: str | Path | Location, options: MapOptions, read: OpenOptions | None = None
) -> Iterator[MappedSource]:
    """The checkpoint at ``src`` read through the mapping; closed on exit.

    Raises:
        MappingError: a mapping that does not fit the checkpoint (naming the rule and key).
        FormatError: a source that cannot be read as the mapping's source side says.
    """
    mapping = options.load()
    where = location(src)
    read = read or OpenOptions()
    side = mapping.source
    sources = _open_side(where, side, read)
    try:
        config = _config(where, side) if side.settings is None else _settings(sources[0], side)
        ranked = side.files is not None
        keys = SourceKeys([dict(s.entries()) for s in sources], ranked)

        sets = dict(options.sets)
        if options.config_from is not None:
            sets = {**_target_settings(mapping, options.config_from), **sets}  # --set wins
        names, taken = variables(
            mapping, sets, config, keys.ranks[0], len(sources) if ranked else None
        )
        target_ranks = None
        if mapping.target.ranks is not None:
            target_ranks = _rank_count(names, mapping.target)
        plan = plan_mapping(mapping, keys, names, target_ranks)
        reads = mapping.reads()
        mapped = MappedSource(plan, sources, where)
        mapped.check_roundtrip = options.check_roundtrip
        if ranked:
            mapped.format = f"{len(sources)} rank files, {sources[0].format}"
        first = sources[0]  # where the state dict was, and what was left out beside it
        mapped.selected, mapped.selected_reason = first.selected, first.selected_reason
        mapped.extras, mapped.dropped = first.extras, first.dropped
        if options.config_from is not None:  # its config and tokenizer files, copied
            mapped.config_folder = options.config_from
            plan.config_from = str(options.config_from)
        elif mapping.target.write is not None:
            targets = {t.key: t.info for t in plan.targets}
            recorded = _Recording(names)  # a default its document reads only when written
            document = render_document(mapping.target.write, recorded, config, side, targets)
            settings = mapping.target.settings
            if settings is not None:  # recorded in the checkpoint itself (Megatron's args)
                mapped.extras = {**mapped.extras, settings: json.loads(document)}
            else:
                mapped.documents[str(mapping.target.write["file"])] = document
            reads |= recorded.read
        plan.followed = [name for name in taken if name in reads]  # said in the report
        yield mapped
    finally:
        for source in sources:
            source.close()


class _Recording(dict[str, Value]):
    """Variables that note which of them an expression read."""

    def __init__(self, names: MappingType[str, Value]) -> None:
        super().__init__(names)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Value:
        self.read.add(name)
        return super().__getitem__(name)


def map_plan(
    src: str | Path | Location, options: MapOptions, read: OpenOptions | None = None
) -> dict[str, Any]:
    """What a mapped conversion of ``src`` would do, from headers alone (``inspect --map``):
    the plan's account (:meth:`MapPlan.describe`) and every target tensor with where it
    comes from."""
    with open_mapped(src, options, read) as source:
        plan = source.plan
        described = plan.describe()
        described["source"] = str(src)
        described["targets"] = [
            {
                "key": target.key,
                "rank": target.rank,
                "dtype": target.info.dtype,
                "shape": list(target.info.shape),
                "rule": plan.groups[target.group].rule.number,
                "from": [key for slot in plan.groups[target.group].inputs for _, key in slot[:1]],
                "ranks_read": len(plan.groups[target.group].inputs[0]),
            }
            for target in plan.targets
        ]
        described["documents"] = sorted(source.documents)
        return described


def _rank_count(names: MappingType[str, Value], side: Side) -> int:
    assert side.ranks is not None
    value = names.get(side.ranks)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MOST_RANKS:
        raise MappingError(
            f"the target is saved in {side.ranks} files per rank; {side.ranks} is {value!r}",
            f"give it with --set {side.ranks}=N (N from 1 to {_MOST_RANKS})",
        )
    return value


def _open_side(where: Location, side: Side, read: OpenOptions) -> list[Source]:
    """One source, or one per rank file (``side.files``), in rank order."""
    if side.file is not None and not holds_file(where):  # the side's one file, in its folder
        where = where / side.file
    if side.files is None:
        return [open_source(where, read)]
    if holds_file(where):
        raise FormatError(
            f"{where} is one file, but {side.name} checkpoints are a folder of "
            f"{side.files.source} files (one per rank)",
            "name the folder that holds them all",
        )
    ranks: dict[int, str] = {}
    for name in listing(where):
        # Only the names the pattern writes back (consolidated.01.pth, never .1.pth or .001.pth:
        # two files for one rank would be a guess), and rank numbers a folder can hold.
        found = side.files.match(name, {})
        if found is None:
            continue
        rank = found["rank"]
        assert isinstance(rank, int)
        if rank >= _MOST_RANKS:
            raise FormatError(
                f"{where / name} is rank {rank}'s file: more than {_MOST_RANKS} ranks",
                "give the folder of one save's rank files",
            )
        ranks[rank] = name
    if not ranks:
        raise FormatError(
            f"{where} holds no {side.files.source} file",
            f"is this a {side.name} checkpoint folder?",
        )
    missing = [r for r in range(max(ranks) + 1) if r not in ranks]
    if missing:
        raise FormatError(
            f"{where} lacks rank {missing[0]}'s file "
            f"({side.files.format({'rank': missing[0]}, {})})",
            "copy every rank's file",
        )
    sources: list[Source] = []
    try:
        for rank in range(len(ranks)):
            sources.append(open_source(where / ranks[rank], read))
    except BaseException:
        for source in sources:
            source.close()
        raise
    return sources


def _config(where: Location, side: Side) -> dict[str, Any] | None:
    """The side's config document beside the weights (or in the folder), if there is one."""
    if side.config is None:
        return None
    folder = where.parent if holds_file(where) else where
    path = folder / side.config
    if not holds_file(path):
        return None
    document = read_json(path, f"{side.name} config")
    if not isinstance(document, dict):
        raise FormatError(f"{path} is not a JSON object")
    return document


def _target_settings(mapping: Mapping, folder: Path) -> dict[str, Value]:
    """``--config-from``: the target side's variables read from the folder's config document
    (those that read only it: the rest come from the source as usual).

    Raises:
        UsageError: the mapping writes no config document, or the folder has none.
    """
    write = mapping.target.write
    if write is None:
        raise UsageError(
            f"--config-from takes the target's config, and {mapping.origin} writes none",
            "drop --config-from",
        )
    path = folder / str(write["file"])
    if not path.is_file():
        raise UsageError(f"--config-from {folder} has no {write['file']}", "name a model folder")
    document = read_json(path, "config")
    if not isinstance(document, dict):
        raise FormatError(f"{path} is not a JSON object")
    getter = config_getter(document, str(path))
    found: dict[str, Value] = {}
    read: list[bool] = []  # each get() of the variable: whether the document held the field

    def get(field: Any, *default: Value) -> Value:
        read.append(_holds(document, str(field)))
        return getter(field, *default)

    for name, expr in mapping.target.vars.items():
        read.clear()
        try:
            value = expr.evaluate(found, {"get": get})
        except MappingError:  # reads a tensor's shape, or what the document lacks
            continue  # the source's then
        if read and all(read):  # read from the document: never a constant or a default
            found[name] = value
    return found


def _holds(document: MappingType[str, Any], path: str) -> bool:
    """Whether a config document has a value at a dotted path."""
    node: Any = document
    for part in path.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return False
        node = node[part]
    return True


def _settings(source: Source, side: Side) -> dict[str, Any]:
    """What the checkpoint records of its own settings (``side.settings``: Megatron's args).

    Raises:
        MappingError: the checkpoint records none.
    """
    assert side.settings is not None
    found = source.extras.get(side.settings)
    if not isinstance(found, dict):
        folder = source.folder
        other = folder is not None and holds_file(folder / "config.json")
        raise MappingError(
            f"{source.path} records no {side.settings}, which the mapping reads as the "
            f"{side.name} side's settings",
            "it is a Hugging Face model folder: to map it the other way, add --reverse"
            if other
            else f"is this a {side.name} checkpoint?",
        )
    return found


def render_document(
    template: MappingType[str, Any],
    names: MappingType[str, Value],
    config: MappingType[str, Any] | None,
    source: Side,
    targets: MappingType[str, TensorInfo],
) -> str:
    """The config document a side writes when it is the target (``[sides.X.write]``): text
    starting with ``=`` is an expression (``"=dim"``); a table with ``when`` is written only
    when it holds (``{when = "=experts > 0", value = "=experts"}`` writes the value alone);
    anything else is written as it is."""

    functions = {
        "get": config_getter(
            config,
            source.config or (f"the checkpoint's {source.settings}" if source.settings else None),
        ),
        "shape": shape_getter(targets, "the target"),
    }

    def render(value: Any, where: str) -> Any:
        if isinstance(value, str) and value.startswith("="):
            return parse_expr(value[1:], where).evaluate(names, functions)
        if isinstance(value, list):
            return [render(v, where) for v in value]
        if isinstance(value, dict):
            return {
                k: render_value(v, f"{where}.{k}")
                for k, v in value.items()
                if k != "when" and _holds(v, f"{where}.{k}")
            }
        return value

    def render_value(value: Any, where: str) -> Any:
        # {when = ..., value = ...}: the value alone, written only when it holds
        if isinstance(value, dict) and "value" in value and set(value) <= {"when", "value"}:
            return render(value["value"], where)
        return render(value, where)

    def _holds(value: Any, where: str) -> bool:
        if not isinstance(value, dict) or "when" not in value:
            return True
        return bool(render(value["when"], f"{where}.when"))

    body = {k: v for k, v in template.items() if k != "file"}
    return json.dumps(render(body, "write"), indent=2) + "\n"
