"""Find the state dict inside a training checkpoint's object tree, and what else is there.

Works on any tree of dicts, lists and tuples whose leaves are tensors or plain values, given a
predicate that says what a tensor is (a ``TensorStub`` from the static reader, or a real tensor),
so it needs no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ckptkit.errors import SelectError
from ckptkit.meta import jsonable

__all__ = [
    "Selection",
    "Candidate",
    "DroppedPart",
    "candidates",
    "nodes",
    "select_state_dict",
    "is_state_dict",
    "is_module_value",
    "node_at",
    "map_leaves",
    "ema_model_params",
    "EMA_MODEL_PATH",
]

# Where training code keeps the weights, most specific first. Each name is tried at the top
# level and one level further down (`{"model": {"state_dict": ...}}`).
STATE_DICT_NAMES = (
    "state_dict",  # Lightning, many scripts
    "model_state_dict",  # the PyTorch tutorials
    "model",  # timm, torchvision references, most hand-written loops
    "module",
    "net",
    "network",
    "model_state",
    "weights",
    "params",
)
# EMA / SWA copies: used only when no main state dict is found, and reported either way.
EMA_NAMES = ("ema", "model_ema", "ema_model", "ema_state_dict", "state_dict_ema", "shadow")

IsTensor = Callable[[Any], bool]

# diffusers' EMAModel.state_dict() (diffusers/training_utils.py): the averaged weights in
# `shadow_params`, a list in the model's parameters() order without names, beside decay,
# min_decay, optimization_step, update_after_step, use_ema_warmup, inv_gamma and power.
EMA_MODEL_PATH = "shadow_params"
_EMA_MODEL_KEYS = frozenset({EMA_MODEL_PATH, "decay", "optimization_step"})
EMA_MODEL_WHY = "an EMA copy: a diffusers EMAModel's shadow_params, a list without names"


@dataclass
class DroppedPart:
    """A part of the checkpoint holding tensors that is not the selected state dict."""

    path: str
    tensors: int
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "tensors": self.tensors, "bytes": self.nbytes}


@dataclass(frozen=True)
class Candidate:
    """A tensor map that could be the weights: where, why, and how many tensors."""

    path: str
    why: str
    tensors: int

    @property
    def is_ema(self) -> bool:
        return self.why.startswith("an EMA")

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "why": self.why, "tensors": self.tensors}


@dataclass
class Selection:
    """The chosen state dict, where it was and why, and the rest of the checkpoint."""

    state_dict: Mapping[str, Any]
    path: str
    reason: str
    extras: dict[str, Any] = field(default_factory=dict)
    dropped: list[DroppedPart] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    unnamed: bool = False  # a diffusers EMAModel's shadow_params, keyed by position


def ema_model_params(root: Any, is_tensor: IsTensor) -> list[Any] | None:
    """The ``shadow_params`` of a diffusers ``EMAModel.state_dict()``, or None for anything
    else."""
    if not isinstance(root, Mapping) or not all(isinstance(k, str) for k in root):
        return None
    params = root.get(EMA_MODEL_PATH)
    if not _EMA_MODEL_KEYS <= root.keys() or not isinstance(params, (list, tuple)):
        return None
    return list(params) if params and all(is_tensor(p) for p in params) else None


def _ema_model_selection(root: Mapping[str, Any], params: list[Any]) -> Selection:
    """An EMAModel's shadow_params keyed by position, its settings as extras."""
    count = len(params)
    return Selection(
        state_dict={str(i): p for i, p in enumerate(params)},
        path=EMA_MODEL_PATH,
        reason=f"a diffusers EMAModel: {count} shadow parameters, no names; "
        "convert --ema --names-from MODEL_FOLDER maps them",
        extras={k: jsonable(v) for k, v in root.items() if k != EMA_MODEL_PATH},
        candidates=[Candidate(EMA_MODEL_PATH, EMA_MODEL_WHY, count)],
        unnamed=True,
    )


def candidates(root: Any, is_tensor: IsTensor) -> list[Candidate]:
    """Every tensor map found by a known name (main weights first, then EMA copies), at the
    top level or one level down, or the top level itself when it is a flat state dict."""
    if is_state_dict(root, is_tensor):
        return [Candidate("", "the file is a flat state dict", len(root))]
    shadow = ema_model_params(root, is_tensor)
    if shadow is not None:
        return [Candidate(EMA_MODEL_PATH, EMA_MODEL_WHY, len(shadow))]
    if not isinstance(root, Mapping):
        return []
    found: list[Candidate] = []
    for names, why in ((STATE_DICT_NAMES, "main weights, by name"), (EMA_NAMES, "an EMA copy")):
        for name in names:
            child = root.get(name)
            if is_state_dict(child, is_tensor):
                found.append(Candidate(name, why, len(child)))
            elif isinstance(child, Mapping):
                for inner in STATE_DICT_NAMES:
                    grandchild = child.get(inner)
                    if is_state_dict(grandchild, is_tensor):
                        found.append(Candidate(f"{name}.{inner}", why, len(grandchild)))
    return found


# A quantized module (torch.ao.nn.quantized Linear, ...) keeps two entries in its state dict
# that are not tensors: its packed weight and bias, and the dtype they were packed for.
PACKED_PARAMS = "_packed_params._packed_params"
PACKED_DTYPE = "_packed_params.dtype"


def is_module_value(key: str, value: Any, is_tensor: IsTensor) -> bool:
    """An entry of a state dict that is not a tensor but is still the module's state."""
    if key.endswith(PACKED_PARAMS):
        return isinstance(value, tuple) and all(v is None or is_tensor(v) for v in value)
    return key.endswith(PACKED_DTYPE) and not isinstance(value, (Mapping, list, tuple))


def is_state_dict(node: Any, is_tensor: IsTensor) -> TypeGuard[Mapping[str, Any]]:
    """A non-empty mapping of string keys to tensors (a quantized module's packed parameters
    and their dtype allowed beside them)."""
    if not isinstance(node, Mapping) or not node or not all(isinstance(k, str) for k in node):
        return False
    tensors = sum(1 for v in node.values() if is_tensor(v))
    return tensors > 0 and all(
        is_tensor(v) or is_module_value(k, v, is_tensor) for k, v in node.items()
    )


def _children(node: Any) -> list[tuple[str, Any]]:
    if isinstance(node, Mapping):
        return [(str(k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(node)]
    return []


def map_leaves(value: Any, is_leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """``value`` with every leaf (as ``is_leaf`` tells) replaced by ``fn(leaf)``, through dicts
    (an ``OrderedDict`` stays one), lists and tuples; other values as they are."""
    if is_leaf(value):
        return fn(value)
    if isinstance(value, dict):
        pairs = ((k, map_leaves(v, is_leaf, fn)) for k, v in value.items())
        return OrderedDict(pairs) if isinstance(value, OrderedDict) else dict(pairs)
    if isinstance(value, list):
        return [map_leaves(v, is_leaf, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_leaves(v, is_leaf, fn) for v in value)
    return value


def nodes(root: Any) -> Iterator[Any]:
    """Every object of a tree, each once, iteratively: a pickle can make cycles and DAGs whose
    paths are exponential in number (torch loads those too)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        stack.extend(child for _, child in _children(item))


def _tensors_in(node: Any, is_tensor: IsTensor, nbytes: Callable[[Any], int]) -> tuple[int, int]:
    tensors = [item for item in nodes(node) if is_tensor(item)]
    return len(tensors), sum(nbytes(t) for t in tensors)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _find(root: Any, is_tensor: IsTensor) -> tuple[str, str] | None:
    if is_state_dict(root, is_tensor):
        return "", "the file is a flat state dict"
    if not isinstance(root, Mapping):
        return None
    for names, why in (
        (STATE_DICT_NAMES, "found by its name"),
        (EMA_NAMES, "an EMA copy: no main weights found"),
    ):
        for name in names:
            child = root.get(name)
            if is_state_dict(child, is_tensor):
                return name, why
            if isinstance(child, Mapping):
                for inner in STATE_DICT_NAMES:
                    if is_state_dict(child.get(inner), is_tensor):
                        return f"{name}.{inner}", why
    # Last resort: the largest tensor map anywhere.
    best: tuple[int, str] | None = None
    stack = [("", root)]
    seen: set[int] = set()
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if is_state_dict(node, is_tensor):
            if best is None or len(node) > best[0]:
                best = (len(node), path)
            continue
        stack.extend((_join(path, name), child) for name, child in _children(node))
    if best is not None:
        return best[1], "the largest tensor map; --select picks another"
    return None


def _resolve(root: Any, dotted: str) -> tuple[list[tuple[Any, str]], Any]:
    """Walk a dotted path; names may themselves contain dots. Returns the parents and the node."""
    node, rest, parents = root, dotted, []
    while rest:
        names = [name for name, _ in _children(node)]
        # Prefer the longest name that matches, so a key like "model.ema" still resolves.
        match = max(
            (n for n in names if rest == n or rest.startswith(n + ".")), key=len, default=None
        )
        if match is None:
            raise SelectError(
                f"no '{rest.split('.')[0]}' in the checkpoint",
                f"available here: {', '.join(names[:12]) or 'nothing'}",
            )
        parents.append((node, match))
        node = dict(_children(node))[match]
        rest = rest[len(match) + 1 :]
    return parents, node


def node_at(root: Any, dotted: str) -> Any:
    """The node a dotted path names ("" is the root).

    Raises:
        SelectError: no such path.
    """
    return _resolve(root, dotted)[1]


def describe_object(value: Any) -> str:
    """What a value read from a pickle is, in words: an object of a class (named, never
    imported), a mapping or a list of plain values."""
    name = getattr(value, "global_name", None)  # an object of a class the reader records
    if isinstance(name, str):
        return f"a {name.rsplit('.', 1)[-1]} object ({name})"
    if isinstance(value, Mapping):
        return f"a mapping of {len(value)} plain values"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} plain values"
    return f"a {type(value).__name__} value"


def _no_tensors(root: Any) -> Selection:
    """A file without a single tensor (transformers' training_args.bin, a config): an empty
    state dict, what it holds in words, and its fields as extras, so inspect shows them."""
    fields = jsonable(root)
    if isinstance(fields, dict):
        fields.pop("__class__", None)
    else:
        fields = {"value": fields}
    return Selection(
        state_dict={}, path="", reason=f"holds no tensors: {describe_object(root)}", extras=fields
    )


# Training state a checkpoint may keep beside the model's keys at its top level.
_TRAINING_PARTS = frozenset(
    {"optimizer", "optim", "lr_scheduler", "scheduler", "dataloader", "train_state", "scaler"}
)


def _mixed_state_dict(
    root: Any, is_tensor: IsTensor, nbytes: Callable[[Any], int]
) -> Selection | None:
    """A top-level mapping of names to tensors with some plain values beside them
    (``{"enc.weight": t, "epoch": 3, "dtype": torch.float16}``): its tensors are the state
    dict, its other values extras, as a training checkpoint's are. None for anything else (a
    value holding tensors of its own makes it a tree, which ``_find`` searches)."""
    if not isinstance(root, Mapping) or not all(isinstance(k, str) for k in root):
        return None
    tensors = {k: v for k, v in root.items() if is_tensor(v)}
    others = {k: v for k, v in root.items() if k not in tensors}
    holding = {k: _tensors_in(v, is_tensor, nbytes) for k, v in others.items()}
    # Training state beside the model's own keys (torchtitan flattens the model into the top
    # level of its DCP save, beside optimizer, lr_scheduler, dataloader and train_state).
    beside = {k for k, (count, _) in holding.items() if count}
    if not tensors or not beside <= _TRAINING_PARTS:
        return None
    names = ", ".join(sorted(set(others) - beside)[:6])
    dropped = [DroppedPart(k, *holding[k]) for k in sorted(beside)]
    reason = "the top level's tensors"
    if beside:
        reason += f"; beside them {', '.join(sorted(beside))}, left out"
    if names:
        reason += f"; its other values ({names}) kept as extras"
    return Selection(
        state_dict=tensors,
        path="",
        reason=reason,
        candidates=[],
        extras={k: jsonable(v) for k, v in others.items() if k not in beside},
        dropped=dropped,
    )


def select_state_dict(
    root: Any,
    is_tensor: IsTensor,
    nbytes: Callable[[Any], int],
    *,
    select: str | None = None,
    ema: bool = False,
    source: str = "the checkpoint",
) -> Selection:
    """Find the state dict in a checkpoint tree (or take the one ``select`` names).

    Args:
        root: the unpickled object tree.
        is_tensor: tells tensors from other values.
        nbytes: a tensor's size in bytes.
        select: dotted path of the state dict, overriding the search.
        ema: take the EMA copy (timm's ``state_dict_ema``, ``model_ema``, ``ema``...).
        source: the file name, for messages.

    Returns:
        The selection, with the non-tensor values beside it as extras and every other part
        holding tensors (optimizer state, EMA copies) listed as dropped.

    Raises:
        SelectError: nothing that looks like a state dict, or ``select`` names no tensor map.
    """
    shadow = ema_model_params(root, is_tensor)
    if shadow is not None and select in (None, EMA_MODEL_PATH):  # ema or not: its only weights
        return _ema_model_selection(root, shadow)
    if select is None and not _tensors_in(root, is_tensor, nbytes)[0]:
        return _no_tensors(root)
    options = candidates(root, is_tensor)
    emas = [c for c in options if c.is_ema]
    if ema and select is None:
        if not emas:
            names = ", ".join(f"'{c.path}'" if c.path else "the top level" for c in options)
            raise SelectError(
                f"{source} holds no EMA copy of the weights (weights found: {names or 'none'})",
                "drop --ema, or name the part with --select DOTTED.PATH",
            )
        path, reason = emas[0].path, "the EMA copy, chosen with --ema"
    elif select is not None:
        path, reason = select, "chosen with --select"
    else:
        found = _find(root, is_tensor)
        mixed = _mixed_state_dict(root, is_tensor, nbytes) if found is None else None
        if mixed is not None:
            return mixed
        if found is None:
            top = ", ".join(name for name, _ in _children(root)[:12]) or type(root).__name__
            raise SelectError(
                f"{source} holds no state dict (a mapping of names to tensors); top level: {top}",
                "pick one with --select DOTTED.PATH",
            )
        path, reason = found
    parents, node = _resolve(root, path)
    if not is_state_dict(node, is_tensor):
        inside = ", ".join(name for name, _ in _children(node)[:8]) or type(node).__name__
        raise SelectError(
            f"'{path}' in {source} is not a state dict (holds: {inside})",
            "--select must name a mapping of names to tensors",
        )
    if not ema and select is None and emas and emas[0].path != path:
        reason += f"; an EMA copy is at '{emas[0].path}' (--ema takes it)"
    selection = Selection(state_dict=node, path=path, reason=reason, candidates=options)
    # Everything beside the path: plain values become extras, parts with tensors are dropped.
    prefix = ""
    for parent, chosen in parents:
        for name, child in _children(parent):
            if name == chosen:
                continue
            count, size = _tensors_in(child, is_tensor, nbytes)
            if count:
                selection.dropped.append(DroppedPart(_join(prefix, name), count, size))
            else:
                selection.extras[_join(prefix, name)] = jsonable(child)
        prefix = _join(prefix, chosen)
    return selection
