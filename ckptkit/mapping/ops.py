"""The tensor ops of mapping rules, each with its inverse, so one file maps both ways.

A rule's ops work on a list of values, in order: its source keys' tensors at first, its target
keys' at the end. A value of a side saved per rank (Meta's ``consolidated.NN.pth``) is a list
with one tensor per rank until ``gather`` or ``same`` makes it one; ``scatter`` and
``replicate`` do the opposite. Every op is planned on shapes and dtypes first
(:meth:`Step.plan`), where it refuses what does not fit, naming the rule and the key, so nothing
is read before the whole mapping is known to fit; then it runs on tensors (:meth:`Step.run`).

| op | does | inverse |
|---|---|---|
| ``rename()`` | nothing (the rule's keys change) | ``rename()`` |
| ``gather(dim)`` | per-rank slices joined along ``dim`` | ``scatter(dim)`` |
| ``same()`` | per-rank copies checked equal, one kept | ``replicate()`` |
| ``concat(dim, sizes, groups)`` | values joined along ``dim`` | ``split`` with the same |
| ``split(dim, sizes, parts, groups)`` | one value cut into ``parts`` or ``sizes`` | ``concat`` |
| ``stack(over)`` | the values of capture ``over`` stacked on a new first dim | ``unstack(over)`` |
| ``permute_rope(heads)`` | rows from interleaved to half-split rotary order | ``unpermute_rope`` |
| ``transpose(a, b)`` | two dims swapped | itself |
| ``slice(dim, size, full)`` | the first ``size`` along ``dim`` kept (padding cut) | ``pad`` |
| ``pad(dim, size, full)`` | zeros added along ``dim`` up to ``full`` | ``slice`` |
| ``cast(dtype, back)`` | another dtype | ``cast(back, dtype)`` |
| ``drop(reason)`` | the values go, for the reason given | none: reversed, nothing comes |
| ``require(cond, message)`` | refuses the checkpoint unless ``cond`` holds | itself |

``groups`` reads a dim laid out as ``groups`` repetitions of ``sizes`` (Megatron's fused q/k/v:
per query group, its queries then one key and one value).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptkit.errors import MappingError
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.mapping.expr import Expr, Value, parse_call

if TYPE_CHECKING:
    import torch

__all__ = ["OpCall", "Step", "Meta", "parse_op", "OPS", "INVERSE"]

Meta = tuple[tuple[int, ...], str]  # a tensor's shape and dtype, planned before any is read

# Each op's parameters in order (positional arguments fill them), and which must be given.
_PARAMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rename": ((), ()),
    "gather": (("dim",), ("dim",)),
    "scatter": (("dim",), ("dim",)),
    "same": ((), ()),
    "replicate": ((), ()),
    "concat": (("dim", "sizes", "groups"), ("dim",)),
    "split": (("dim", "sizes", "parts", "groups"), ("dim",)),
    "stack": (("over",), ("over",)),
    "unstack": (("over",), ("over",)),
    "permute_rope": (("heads",), ("heads",)),
    "unpermute_rope": (("heads",), ("heads",)),
    "transpose": (("a", "b"), ()),
    "slice": (("dim", "size", "full"), ("dim", "size")),
    "pad": (("dim", "size", "full"), ("dim", "size", "full")),
    "cast": (("dtype", "back"), ("dtype",)),
    "drop": (("reason",), ("reason",)),
    "require": (("cond", "message"), ("cond",)),
}
OPS = tuple(_PARAMS)
INVERSE = {
    "rename": "rename",
    "gather": "scatter",
    "scatter": "gather",
    "same": "replicate",
    "replicate": "same",
    "concat": "split",
    "split": "concat",
    "stack": "unstack",
    "unstack": "stack",
    "permute_rope": "unpermute_rope",
    "unpermute_rope": "permute_rope",
    "transpose": "transpose",
    "slice": "pad",
    "pad": "slice",
    "cast": "cast",
    "require": "require",
}
_MOST_PARTS = 65_536  # tensors one op may cut a value into (experts, heads, groups)
_MOST_PADDING = 1 << 20  # a pad adds padding (a vocabulary's), not a new tensor
_NAMES = ("over",)  # parameters that name a capture rather than compute a value
_TEXTS = ("reason", "message", "dtype", "back")  # parameters given as text


@dataclass(frozen=True)
class OpCall:
    """An op as a mapping file writes it: its name and its arguments, not yet evaluated."""

    name: str
    args: Mapping[str, Expr]
    text: str

    def inverse(self) -> OpCall | None:
        """The op that undoes this one (None for ``drop``, whose values are gone).

        Raises:
            MappingError: an op whose inverse needs an argument it was not given.
        """
        if self.name == "drop":
            return None
        name, args = INVERSE[self.name], dict(self.args)
        if self.name == "cast":
            if "back" not in args:
                raise MappingError(
                    f"'{self.text}' cannot be reversed: which dtype to cast back to?",
                    "write cast(dtype, back=...)",
                )
            args = {"dtype": args["back"], "back": args["dtype"]}
        if self.name == "slice" and "full" not in args:
            raise MappingError(
                f"'{self.text}' cannot be reversed: to what size would pad fill?",
                "write slice(dim, size, full=...)",
            )
        written = ", ".join(f"{k}={v}" for k, v in args.items())
        return OpCall(name, args, f"{name}({written})")


def parse_op(text: object, where: str) -> OpCall:
    """An op of a rule, as a mapping file writes it.

    Raises:
        MappingError: an unknown op, an unknown or missing parameter, naming ``where``.
    """
    name, args, kwargs = parse_call(text, where)
    if name not in _PARAMS:
        raise MappingError(f"{where}: unknown op '{name}'", f"use one of {', '.join(OPS)}")
    params, required = _PARAMS[name]
    if len(args) > len(params):
        raise MappingError(f"{where}: {name}() takes at most {len(params)} arguments")
    given = dict(zip(params, args, strict=False))
    for key, value in kwargs.items():
        if key not in params:
            raise MappingError(
                f"{where}: {name}() has no parameter '{key}'",
                f"its parameters: {', '.join(params) or 'none'}",
            )
        if key in given:
            raise MappingError(f"{where}: {name}() is given '{key}' twice")
        given[key] = value
    missing = [p for p in required if p not in given]
    if missing:
        raise MappingError(f"{where}: {name}() needs {', '.join(missing)}")
    for key in _NAMES:
        if key in given and not isinstance(given[key].tree, ast.Name):
            raise MappingError(f"{where}: {name}({key}=...) names a capture of the pattern")
    return OpCall(name, given, str(text))


@dataclass
class Step:
    """An op bound to one group of keys: its arguments evaluated, ready to plan and run."""

    call: OpCall
    values: dict[str, Any] = field(default_factory=dict)
    ranks: int | None = None  # the target side's ranks, for scatter and replicate
    where: str = ""  # the rule and key, for messages

    @classmethod
    def bind(
        cls,
        call: OpCall,
        names: Mapping[str, Value],
        ranks: int | None,
        where: str,
    ) -> Step:
        """The op with its arguments evaluated on ``names`` (the variables and the group's
        captures; ``get``, ``shape`` and ``count`` belong to a side's variables, not here)."""
        values: dict[str, Any] = {}
        for key, expr in call.args.items():
            if key in _NAMES:
                assert isinstance(expr.tree, ast.Name)
                values[key] = expr.tree.id
            elif key in _TEXTS and isinstance(expr.tree, ast.Constant):
                values[key] = expr.tree.value
            else:
                values[key] = expr.evaluate(names)
        return cls(call, values, ranks, where)

    def fail(self, message: str, hint: str | None = None) -> MappingError:
        return MappingError(f"{self.where}: {self.call.text}: {message}", hint)

    # --- planning, on shapes and dtypes --------------------------------------------------------

    def plan(self, metas: list[Any]) -> tuple[list[Any], int]:
        """The values' shapes and dtypes after this op, and the bytes it drops.

        Raises:
            MappingError: values this op cannot take (naming the rule, key and shapes).
        """
        name, v = self.call.name, self.values
        if name in ("rename", "require"):
            if name == "require" and not v["cond"]:
                text = v.get("message") or f"{self.call.args['cond']} does not hold"
                raise self.fail(str(text))
            return metas, 0
        if name in ("gather", "same"):
            return [self._joined(m, name) for m in metas], 0
        if name in ("scatter", "replicate"):
            return [self._spread(m, name) for m in metas], 0
        if name == "drop":
            if not isinstance(v["reason"], str) or not v["reason"].strip():
                raise self.fail("drop needs a reason, in words")
            return [], sum(_nbytes(m) for m in _flat(metas))
        one = [self._single(m) for m in metas]
        if name == "concat":
            return [self._concat(one)], 0
        if name == "split":
            (meta,) = self._arity(one, 1)
            return self._split(meta), 0
        if name == "stack":
            shapes = {m for m in one}
            if len(shapes) != 1:
                raise self.fail(f"stacks values of different shapes: {sorted(shapes)}")
            shape, dtype = one[0]
            return [((len(one), *shape), dtype)], 0
        if name == "unstack":
            ((shape, dtype),) = self._arity(one, 1)
            if not shape:
                raise self.fail("unstacks a scalar")
            if shape[0] > _MOST_PARTS:
                raise self.fail(f"unstacks {shape[0]} tensors, more than {_MOST_PARTS}")
            return [(shape[1:], dtype)] * shape[0], 0
        ((shape, dtype),) = self._arity(one, 1)
        if name in ("permute_rope", "unpermute_rope"):
            heads = self._int("heads", 1)
            if len(shape) not in (1, 2) or shape[0] % (2 * heads):
                raise self.fail(
                    f"shape {list(shape)} is not {heads} heads of pairs of rows",
                    "check heads (n_heads for q, n_kv_heads for k)",
                )
            return [(shape, dtype)], 0
        if name == "transpose":
            a, b = self._dim(v.get("a", 0), shape), self._dim(v.get("b", 1), shape)
            out = list(shape)
            out[a], out[b] = out[b], out[a]
            return [(tuple(out), dtype)], 0
        if name in ("slice", "pad"):
            dim, size = self._dim(v["dim"], shape), self._int("size", 0)
            full = self._int("full", 0) if "full" in v else None
            have = shape[dim]
            want_in, want_out = (full, size) if name == "slice" else (size, full)
            if want_in is not None and have != want_in:
                raise self.fail(f"dim {dim} is {have}, not {want_in}")
            if name == "slice" and size > have:
                raise self.fail(f"keeps {size} of dim {dim}, which is only {have}")
            if name == "pad" and full is not None and full < have:
                raise self.fail(f"pads dim {dim} of {have} to {full}, which is smaller")
            if name == "pad" and full is not None and full > 2 * have + _MOST_PADDING:
                raise self.fail(f"pads dim {dim} of {have} to {full}: padding, not a new tensor")
            out = list(shape)
            out[dim] = want_out
            dropped = _nbytes((shape, dtype)) - _nbytes((tuple(out), dtype))
            return [(tuple(out), dtype)], max(dropped, 0)
        if name == "cast":
            if not isinstance(v["dtype"], str) or v["dtype"] not in DTYPES:
                raise self.fail(f"unknown dtype '{v['dtype']}'")
            if DTYPES[dtype].kind != "float" or DTYPES[v["dtype"]].kind != "float":
                raise self.fail(f"casts {dtype} to {v['dtype']}: only floats are cast")
            return [(shape, v["dtype"])], 0
        raise AssertionError(name)

    def _arity(self, metas: list[Any], n: int) -> list[Any]:
        if len(metas) != n:
            raise self.fail(f"takes {n} value(s), given {len(metas)}")
        return metas

    def _single(self, meta: Any) -> Meta:
        if isinstance(meta, list):
            raise self.fail(
                "is given one tensor per rank",
                "join the ranks first: gather(dim) for slices, same() for copies",
            )
        return meta

    def _int(self, key: str, least: int) -> int:
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise self.fail(f"{key} is {value!r}, not a whole number of at least {least}")
        return value

    def _dim(self, dim: Any, shape: tuple[int, ...]) -> int:
        if isinstance(dim, bool) or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
            raise self.fail(f"dim {dim!r} is not a dim of shape {list(shape)}")
        return dim % len(shape)

    def _joined(self, meta: Any, name: str) -> Meta:
        if not isinstance(meta, list):
            raise self.fail("is given one tensor, not one per rank")
        shapes = {m[1] for m in meta}
        if len(shapes) != 1:
            raise self.fail(f"ranks hold different dtypes: {sorted(shapes)}")
        if name == "same":
            if len({m[0] for m in meta}) != 1:
                raise self.fail(
                    f"ranks hold different shapes {sorted({m[0] for m in meta})}, not copies",
                    "gather(dim) joins slices",
                )
            return meta[0]
        first = meta[0][0]
        dim = self._dim(self.values["dim"], first)
        for shape, _ in meta:
            if len(shape) != len(first) or any(
                a != b for i, (a, b) in enumerate(zip(shape, first, strict=True)) if i != dim
            ):
                raise self.fail(f"rank slices {[list(m[0]) for m in meta]} differ beyond dim {dim}")
        out = list(first)
        out[dim] = sum(m[0][dim] for m in meta)
        return tuple(out), meta[0][1]

    def _spread(self, meta: Any, name: str) -> list[Meta]:
        shape, dtype = self._single(meta)
        if self.ranks is None:
            raise self.fail("the target side is not saved per rank")
        if name == "replicate":
            return [(shape, dtype)] * self.ranks
        dim = self._dim(self.values["dim"], shape)
        if shape[dim] % self.ranks:
            raise self.fail(f"dim {dim} of {list(shape)} does not split into {self.ranks} ranks")
        out = list(shape)
        out[dim] //= self.ranks
        return [(tuple(out), dtype)] * self.ranks

    def _sizes(self, total: int, parts: int | None) -> list[int]:
        """The sizes along dim of one group's parts."""
        groups = self._int("groups", 1) if "groups" in self.values else 1
        sizes = self.values.get("sizes")
        if groups > _MOST_PARTS or (parts or 0) > _MOST_PARTS or len(sizes or ()) > _MOST_PARTS:
            raise self.fail(f"cuts into more than {_MOST_PARTS} parts")
        if total % groups:
            raise self.fail(f"{total} does not split into {groups} groups")
        per_group = total // groups
        if sizes is None:
            if not parts or per_group % parts:
                raise self.fail(f"{per_group} does not split into {parts} equal parts")
            return [per_group // parts] * parts
        if not isinstance(sizes, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
        ):
            raise self.fail(f"sizes {sizes!r} are not whole numbers")
        if sum(sizes) != per_group:
            what = f"each of {groups} groups" if groups > 1 else "the dim"
            raise self.fail(f"sizes {sizes} add up to {sum(sizes)}, but {what} is {per_group}")
        return sizes

    def _split(self, meta: Meta) -> list[Meta]:
        shape, dtype = meta
        dim = self._dim(self.values["dim"], shape)
        parts = self._int("parts", 1) if "parts" in self.values else None
        sizes = self._sizes(shape[dim], parts)
        groups = self.values.get("groups", 1)
        out = []
        for size in sizes:
            piece = list(shape)
            piece[dim] = size * groups
            out.append((tuple(piece), dtype))
        return out

    def _concat(self, metas: list[Meta]) -> Meta:
        if not metas:
            raise self.fail("joins no values")
        first, dtype = metas[0]
        dim = self._dim(self.values["dim"], first)
        for shape, other in metas:
            if other != dtype:
                raise self.fail(f"joins {dtype} with {other}")
            if len(shape) != len(first) or any(
                a != b for i, (a, b) in enumerate(zip(shape, first, strict=True)) if i != dim
            ):
                raise self.fail(f"shapes {[list(m[0]) for m in metas]} differ beyond dim {dim}")
        groups = self.values.get("groups", 1)
        out = list(first)
        out[dim] = sum(m[0][dim] for m in metas)
        if "sizes" in self.values or groups != 1:
            sizes = self._sizes(out[dim], len(metas))
            if [m[0][dim] for m in metas] != [s * groups for s in sizes]:
                raise self.fail(
                    f"joins sizes {[m[0][dim] for m in metas]} along dim {dim}, not "
                    f"{[s * groups for s in sizes]}"
                )
        return tuple(out), dtype

    # --- running, on tensors -------------------------------------------------------------------

    def run(self, values: list[Any]) -> list[Any]:
        """The values after this op (tensors, or lists of them per rank)."""
        import torch

        name, v = self.call.name, self.values
        if name in ("rename", "require"):
            return values
        if name == "drop":
            return []
        if name == "gather":
            return [torch.cat(list(ranks), dim=v["dim"]) for ranks in values]
        if name == "same":
            out = []
            for ranks in values:
                for rank, other in enumerate(ranks[1:], 1):
                    if not _bit_equal(ranks[0], other):
                        raise self.fail(f"rank {rank}'s copy differs from rank 0's")
                out.append(ranks[0])
            return out
        if name == "scatter":
            return [list(t.chunk(self.ranks, dim=v["dim"])) for t in values]
        if name == "replicate":
            return [[t] * (self.ranks or 1) for t in values]
        if name == "concat":
            return [_interleave(values, v["dim"], v.get("groups", 1))]
        if name == "split":
            (t,) = values
            dim = v["dim"] % t.dim()
            parts = v.get("parts")
            sizes = self._sizes(t.shape[dim], parts if isinstance(parts, int) else None)
            return _ungroup(t, dim, sizes, v.get("groups", 1))
        if name == "stack":
            return [torch.stack(values)]
        if name == "unstack":
            (t,) = values
            return list(t.unbind(0))
        (t,) = values
        if name in ("permute_rope", "unpermute_rope"):
            return [_rope(t, v["heads"], forward=name == "permute_rope")]
        if name == "transpose":
            return [t.transpose(v.get("a", 0), v.get("b", 1))]
        if name == "slice":
            return [t.narrow(v["dim"], 0, v["size"])]
        if name == "pad":
            dim = v["dim"] % t.dim()
            shape = list(t.shape)
            shape[dim] = v["full"] - t.shape[dim]
            return [torch.cat([t, t.new_zeros(shape)], dim=dim)]
        if name == "cast":
            from ckptkit.formats.base.tensors import torch_dtype

            return [t.to(torch_dtype(v["dtype"]))]
        raise AssertionError(name)


def _flat(metas: list[Any]) -> list[Meta]:
    return [m for item in metas for m in (item if isinstance(item, list) else [item])]


def _nbytes(meta: Meta) -> int:
    shape, dtype = meta
    return math.prod(shape) * DTYPES[dtype].itemsize


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    from ckptkit.formats.base.tensors import bit_equal

    return bool(bit_equal(a, b))


def _rope(t: torch.Tensor, heads: int, *, forward: bool) -> torch.Tensor:
    """Rows of each head from interleaved pairs (Meta's rotary order: x0 y0 x1 y1 ...) to halves
    (Hugging Face's: x0 x1 ... y0 y1 ...), or back. transformers' ``permute``, exactly."""
    rows = t.shape[0]
    flat = t.reshape(rows, -1)
    cols = flat.shape[1]
    if forward:
        out = flat.view(heads, rows // heads // 2, 2, cols).transpose(1, 2)
    else:
        out = flat.view(heads, 2, rows // heads // 2, cols).transpose(1, 2)
    return out.reshape(t.shape).contiguous()


def _ungroup(t: torch.Tensor, dim: int, sizes: Sequence[int], groups: int) -> list[Any]:
    """Cut ``dim``, laid out as ``groups`` repetitions of ``sizes``, into one tensor per size
    (each joining its pieces of every group)."""
    import torch

    if groups == 1:
        return [p.contiguous() for p in t.split(list(sizes), dim=dim)]
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], groups, sum(sizes), *shape[dim + 1 :])
    pieces = grouped.split(list(sizes), dim=dim + 1)
    out = []
    for piece, size in zip(pieces, sizes, strict=True):
        whole = list(shape)
        whole[dim] = groups * size
        out.append(torch.Tensor.reshape(piece.contiguous(), whole))
    return out


def _interleave(values: list[torch.Tensor], dim: int, groups: int) -> torch.Tensor:
    """:func:`_ungroup` undone: each value's ``groups`` pieces placed in turn."""
    import torch

    dim %= values[0].dim()
    if groups == 1:
        return torch.cat(values, dim=dim)
    split = [
        v.reshape(*v.shape[:dim], groups, v.shape[dim] // groups, *v.shape[dim + 1 :])
        for v in values
    ]
    joined = torch.cat(split, dim=dim + 1)
    shape = list(values[0].shape)
    shape[dim] = sum(v.shape[dim] for v in values)
    return joined.reshape(shape)
