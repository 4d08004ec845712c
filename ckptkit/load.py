"""Load a checkpoint's state dict, or load it straight into a model whatever wrappers either has."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.adapters import adapter_options, open_merged
from ckptkit.errors import KeyMatchError
from ckptkit.formats.base.tensors import with_versions
from ckptkit.formats.open import OpenOptions
from ckptkit.keys import (
    KeyMatch,
    build_plan,
    inner_wrappers,
    match_keys,
    mismatch_message,
    strip_inner_wrappers,
)

if TYPE_CHECKING:
    import torch

__all__ = ["load_state_dict", "load_into", "LoadReport"]


def _read_options(
    select: str | None,
    trust: bool,
    allow_globals: Iterable[str],
    variant: str | None,
    names_from: str | Path | None,
) -> OpenOptions:
    """The loaders' keywords as the options the model is opened with (an adapter's base, when
    ``path`` is one: see ``open_merged``)."""
    return OpenOptions(
        select=select,
        trust=trust,
        allow_globals=tuple(allow_globals),
        variant=variant,
        names_from=names_from,
    )


def load_state_dict(
    path: str | Path,
    *,
    select: str | None = None,
    strip_wrappers: bool = False,
    trust: bool = False,
    allow_globals: Iterable[str] = (),
    base: str | Path | None = None,
    adapters: Iterable[str | Path | tuple[str | Path, float]] = (),
    variant: str | None = None,
    names_from: str | Path | None = None,
) -> dict[str, torch.Tensor]:
    """Read the state dict of any checkpoint ckptkit reads, safely.

    Args:
        path: a torch file (zip or legacy, any training checkpoint) or safetensors; a LoRA
            adapter (PEFT folder, kohya file) gives its base with the adapter merged in.
        select: dotted path of the state dict inside a training checkpoint (default: found);
            for an adapter ``path``, in its base (as ``variant`` and ``names_from``).
        strip_wrappers: remove the detected wrapper chain (``module.``, ``_orig_mod.``, ...).
        trust: use torch's full unpickler (only for files you trust); for ``path`` and ``base``.
        allow_globals: pickle globals to admit beside torch's safe set.
        base: the base model an adapter ``path`` is merged into (default: the one it names).
        adapters: LoRA adapters to merge into ``path``, in order (``PATH``, ``"PATH:WEIGHT"``
            or ``(PATH, WEIGHT)``).
        variant: in a model folder, the weights of this variant (diffusers' ``fp16``).
        names_from: the model a diffusers ``EMAModel`` state dict's ``shadow_params`` are named
            after, in order.

    Returns:
        Key -> CPU tensor; tensors of torch files are memory-mapped views (copy-on-write),
        merged tensors are new ones.
    """
    read = _read_options(select, trust, allow_globals, variant, names_from)
    opened = open_merged(path, adapter_options(base, adapters), read)
    with opened as source:
        keys = source.keys()
        plan = build_plan(keys, strip_wrappers=strip_wrappers)
        state = OrderedDict(
            (new, source.value(old)) for old, new in plan.mapping.items() if new is not None
        )
        versions = source.module_versions(plan.mapping)
        if versions is not None:  # quantized modules need torch's per-module version records
            with_versions(state, versions)
        return state


@dataclass
class LoadReport:
    """How a checkpoint was mapped onto a model, and what did not fit."""

    match: KeyMatch
    loaded: int
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @property
    def missing(self) -> list[str]:
        return self.match.missing

    @property
    def unexpected(self) -> list[str]:
        return self.match.unexpected

    def to_dict(self) -> dict[str, Any]:
        return {
            "transform": self.match.describe(),
            "loaded": self.loaded,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "mismatched": [
                {"key": k, "checkpoint": list(a), "model": list(b)} for k, a, b in self.mismatched
            ],
        }


def _model_ties(model: torch.nn.Module) -> dict[str, set[str]]:
    """Each parameter or buffer name -> the other names of the very same tensor."""
    import itertools

    by_tensor: dict[int, set[str]] = {}
    named = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for name, tensor in named:
        by_tensor.setdefault(id(tensor), set()).add(name)
    return {name: names - {name} for names in by_tensor.values() for name in names}


def load_into(
    model: torch.nn.Module,
    path: str | Path,
    *,
    strict: bool = True,
    select: str | None = None,
    trust: bool = False,
    allow_globals: Iterable[str] = (),
    base: str | Path | None = None,
    adapters: Iterable[str | Path | tuple[str | Path, float]] = (),
    variant: str | None = None,
    names_from: str | Path | None = None,
) -> LoadReport:
    """Load a checkpoint into ``model``, mapping wrapper prefixes on either side automatically.

    A DDP checkpoint loads into a plain model, a plain one into a DDP- or compile-wrapped model,
    any wrapper chain into any other: the prefix change that covers the most of the model's keys
    is found from the key names alone.

    Args:
        model: the module to fill (wrapped or not).
        path: the checkpoint.
        strict: refuse (loading nothing) unless keys and shapes match exactly.
        select: dotted path of the state dict inside a training checkpoint; for an adapter
            ``path``, in its base (as ``variant`` and ``names_from``).
        trust: use torch's full unpickler (only for files you trust); for ``path`` and ``base``.
        allow_globals: pickle globals to admit beside torch's safe set.
        base: the base model an adapter ``path`` is merged into (default: the one it names).
        adapters: LoRA adapters to merge into ``path`` first, in order.
        variant: in a model folder, the weights of this variant (diffusers' ``fp16``).
        names_from: the model a diffusers ``EMAModel`` state dict's ``shadow_params`` are named
            after, in order.

    Returns:
        The prefix change used, the number of tensors loaded, and what did not fit.

    Raises:
        KeyMatchError: with ``strict``, listing missing, unexpected and mismatched keys.
    """
    target = model.state_dict()
    read = _read_options(select, trust, allow_globals, variant, names_from)
    opened = open_merged(path, adapter_options(base, adapters), read)
    with opened as source:
        entries, in_file = _without_inner_wrappers(dict(source.entries()), target)
        match = match_keys(entries, target)
        # A tied name the file left out (save_pretrained drops one) is filled by loading its
        # twin: the model holds one tensor under both names.
        loaded = set(match.mapping.values())
        ties = _model_ties(model)
        match.missing = [k for k in match.missing if not (ties.get(k, set()) & loaded)]
        mismatched = [
            (new, entries[old].shape, tuple(target[new].shape))
            for old, new in match.mapping.items()
            if new in target
            and entries[old].kind == "dense"
            and entries[old].shape != tuple(getattr(target[new], "shape", ()))
        ]
        if strict and (not match.exact or mismatched):
            text = [f"{k} {list(a)} vs model {list(b)}" for k, a, b in mismatched]
            raise KeyMatchError(
                mismatch_message(f"{path} does not fit the model", match, text),
                "pass strict=False to load what fits, or check select=",
            )
        bad = {k for k, _, _ in mismatched}
        state = {
            new: source.value(in_file.get(old, old))
            for old, new in match.mapping.items()
            if new in target and new not in bad
        }
        versions = source.module_versions({in_file.get(o, o): n for o, n in match.mapping.items()})
        if versions is not None:
            state = OrderedDict(state)
            with_versions(state, versions)
        model.load_state_dict(state, strict=False)
    return LoadReport(match=match, loaded=len(state), mismatched=mismatched)


def _without_inner_wrappers(
    entries: dict[str, Any], target: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Wrappers inside the checkpoint's keys (blocks compiled one by one) that the model does
    not have: the entries without them, and each new name's name in the file (read under it)."""
    if not inner_wrappers(entries) or inner_wrappers(target):
        return entries, {}
    inner, _ = strip_inner_wrappers(entries)
    in_file = {new: old for old, new in inner.items() if new is not None}
    return {new: entries[old] for new, old in in_file.items()}, in_file
