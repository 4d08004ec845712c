"""Adapters: PEFT LoRA folders, kohya LoRA files and PeftModel state dicts, read from headers,
merged into their base one tensor at a time (``merged.py``) or stripped.

``open_merged`` is what ``convert`` and ``load_into`` open instead of the plain source: the
source itself, the base with adapters merged in, or a PeftModel state dict's base alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptkit.adapters.adapter import Adapter, AdapterError, Target
from ckptkit.adapters.base_model import find_base, how_found
from ckptkit.adapters.kinds import adapter_of
from ckptkit.adapters.peft import CONFIG, WEIGHTS, adapter_from_tensors, read_config
from ckptkit.adapters.wrapped import (
    REFUSAL_API_HINT,
    REFUSAL_HINT,
    config_from_options,
    is_peft_model_state,
    split_peft_model_state,
)
from ckptkit.errors import UsageError
from ckptkit.formats.base.source import Source
from ckptkit.formats.folders.layouts import adapter_file_in
from ckptkit.formats.open import OpenOptions, open_source
from ckptkit.storage.location import Location, is_local, location

__all__ = [
    "Adapter",
    "AdapterError",
    "Target",
    "AdapterOptions",
    "adapter_of",
    "read_adapter",
    "parse_adapter_arg",
    "adapter_options",
    "open_merged",
    "describe",
]


@dataclass(frozen=True)
class AdapterOptions:
    """What to do with adapters: merge these (``(path, weight)``, in order) into the source, take
    an adapter's base from ``base``, or strip / merge a PeftModel state dict's adapter."""

    adapters: tuple[tuple[str, float], ...] = ()
    base: str | None = None
    drop_adapters: bool = False
    lora_alpha: float | None = None
    adapter_config: str | None = None

    @property
    def any(self) -> bool:
        return bool(
            self.adapters
            or self.base
            or self.drop_adapters
            or self.lora_alpha is not None
            or self.adapter_config
        )


def parse_adapter_arg(text: str) -> tuple[str, float]:
    """``PATH`` or ``PATH:WEIGHT`` (``--adapter``)."""
    path, sep, weight = text.rpartition(":")
    if sep and path and not Path(text).exists():
        try:
            return path, float(weight)
        except ValueError:
            pass
    return text, 1.0


def adapter_options(
    base: str | Path | None, adapters: Iterable[str | Path | tuple[str | Path, float]]
) -> AdapterOptions:
    """The library's ``base=`` and ``adapters=`` as the options ``open_merged`` takes."""
    specs = tuple(
        (str(a[0]), float(a[1])) if isinstance(a, tuple) else parse_adapter_arg(str(a))
        for a in adapters
    )
    return AdapterOptions(specs, None if base is None else str(base))


def read_adapter(
    path: str | Path, *, weight: float = 1.0, options: OpenOptions | None = None
) -> Adapter:
    """Open an adapter: a PEFT folder (or its weights file) or a kohya LoRA file. ``options``:
    how its file is read (its safety options; an adapter has no weights to choose among).

    Raises:
        AdapterError: ``path`` holds no adapter ckptkit merges.
    """
    if not math.isfinite(weight):
        raise UsageError(
            f"{path} is to be merged at weight {weight}, which would merge as {weight} weights",
            "give a finite weight (--adapter PATH:WEIGHT)",
            api_hint="give a finite weight ((PATH, WEIGHT))",
        )
    source = open_source(path, options)  # a PEFT folder opens as its adapter_model file (or URL)
    try:
        adapter = adapter_of(source)
        if adapter is None:
            raise AdapterError(
                f"{path} is not a LoRA adapter (a PEFT folder with {CONFIG}, or a kohya LoRA file)",
                "give the adapter's folder",
            )
    except BaseException:
        source.close()
        raise
    adapter.weight = weight
    return adapter


def _read_all(specs: Iterable[tuple[str, float]], options: OpenOptions) -> list[Adapter]:
    adapters: list[Adapter] = []
    try:
        for path, weight in specs:
            adapters.append(read_adapter(path, weight=weight, options=options))
    except BaseException:
        for adapter in adapters:
            adapter.close()
        raise
    return adapters


def open_merged(
    src: str | Path | Location, options: AdapterOptions, read: OpenOptions | None = None
) -> Source:
    """Open ``src`` for conversion with ``options`` applied, ``read`` saying how its model's
    weights are opened.

    ``read`` belongs to the model: ``src`` itself, or, when ``src`` is an adapter, its base
    (``--base``, or the one it names). Its options that choose weights (``select``, ``ema``,
    ``variant``, ``names_from``) have nothing to choose in an adapter, which holds one set; its
    safety options (``trust``, ``allow_globals``) apply to the adapter too. Adapters merged in
    (``options.adapters``) are read with ``allow_globals`` only: they are never trusted.

    Raises:
        AdapterError: an adapter does not fit its base, or a PeftModel state dict would be
            written with its adapter tensors as weights (no option says what to do with them).
        UsageError: an option that does not apply to ``src``.
    """
    from ckptkit.adapters.merged import MergedSource

    read = read or OpenOptions()
    source = open_source(src, read.safety() if _adapter_src(src, options) else read)
    extra: list[Adapter] = []
    try:
        base: Source = source
        first: list[Adapter] = []
        if is_peft_model_state(source.keys()):
            if options.base:
                raise UsageError(
                    f"{src} is a PeftModel state dict: its base model is inside it, so --base "
                    "does not apply",
                    "drop --base",
                    api_hint="drop base=",
                )
            base, first = _peft_model_state(source, options)
        else:
            if options.drop_adapters or options.lora_alpha is not None or options.adapter_config:
                raise UsageError(
                    f"{src} is not a PeftModel state dict (no base_layer / lora_A.default keys)",
                    "drop --drop-adapters, --lora-alpha and --adapter-config",
                    api_hint="drop drop_adapters, lora_alpha and adapter_config",
                )
            adapter = adapter_of(source)
            if adapter is not None:
                first = [adapter]
                base = open_source(_base_of(adapter, options, trust=read.trust), read)
            elif options.base:
                raise UsageError(
                    f"{src} is not an adapter, so --base does not apply",
                    "merge adapters into it with --adapter PATH",
                )
        extra = _read_all(options.adapters, OpenOptions(allow_globals=read.allow_globals))
        adapters = first + extra
        return MergedSource(base, adapters) if adapters else base
    except BaseException:
        for adapter in extra:
            adapter.close()
        source.close()
        raise


def _adapter_src(src: str | Path | Location, options: AdapterOptions) -> bool:
    """Whether ``src`` is known to be an adapter before it is opened, so the options that choose
    weights are kept for its base. A local folder is told by its files (a PEFT folder; a run or
    Trainer folder of adapters is opened with them: ``--select`` picks its checkpoint), a local
    file by its PEFT name with the config beside it; anything else by ``--base``, which says
    SRC is an adapter. An adapter found only once opened (a kohya file without ``--base``) is
    opened with them, and its reader refuses those that do not apply to a file."""
    path = location(src)
    if is_local(path):  # at a URL, the files are not listed to find out
        if path.is_dir():
            return adapter_file_in(path) is not None
        if path.name in WEIGHTS and (path.parent / CONFIG).is_file():
            return True
    return bool(options.base)


def _base_of(adapter: Adapter, options: AdapterOptions, *, trust: bool) -> str:
    """Where the base of an adapter SRC is (``--base``, else the one it names), recorded in
    ``adapter.base_from`` for the report.

    Raises:
        UsageError: under ``--trust``, an adapter naming its own base (the base's pickle would
            be trusted too, though no option named it).
    """
    if options.base:
        adapter.base_from = "given with --base"
        return options.base
    if trust:
        raise UsageError(
            f"{adapter.path} names its base model ({adapter.base_name or 'none'}); under --trust "
            "ckptkit follows no base an adapter names (nothing it follows may run code "
            "unless an option named it)",
            "name the base with --base PATH",
            api_hint="name the base with base=PATH",
        )
    found = find_base(adapter.base_name, adapter.path, adapter.revision)
    adapter.base_from = how_found(str(adapter.base_name), adapter.path, found)
    return str(found)


def _peft_model_state(source: Source, options: AdapterOptions) -> tuple[Source, list[Adapter]]:
    """A PeftModel state dict's base view, and its adapter when it is to be merged."""
    base, tensors, dropped = split_peft_model_state(source)
    if options.drop_adapters:
        if options.lora_alpha is not None or options.adapter_config:
            raise UsageError(
                "--drop-adapters strips the adapter that --lora-alpha / --adapter-config merge",
                "use one or the other",
                api_hint="pass drop_adapters=True, or lora_alpha / adapter_config, not both",
            )
        base.dropped = [*source.dropped, dropped]
        return base, []
    if options.lora_alpha is None and not options.adapter_config:
        raise AdapterError(
            f"{source.path} is a PeftModel state dict: the base's weights with a LoRA adapter's "
            "tensors beside them, and no lora_alpha to say how to merge them",
            REFUSAL_HINT,
            api_hint=REFUSAL_API_HINT,
        )
    if options.lora_alpha is not None and not math.isfinite(options.lora_alpha):
        raise UsageError(
            f"--lora-alpha {options.lora_alpha}: lora_alpha must be a finite number (it would "
            f"merge as {options.lora_alpha} weights)",
            "give the lora_alpha the adapter was trained with",
            api_hint=f"lora_alpha={options.lora_alpha}: give a finite lora_alpha, the one the "
            "adapter was trained with",
        )
    config = read_config(Path(options.adapter_config)) if options.adapter_config else None
    adapter = adapter_from_tensors(
        source.path,
        tensors,
        config_from_options(options.lora_alpha, config),
        kind="PeftModel state dict",
    )
    return base, [adapter]


def describe(source: Source) -> dict[str, Any] | None:
    """What ``inspect`` says of an adapter Source (None for a model's weights): its kind, the
    base it names, rank and alpha (per module where they differ), the variant, targets,
    ``modules_to_save`` and the bytes; for a PeftModel state dict, how to convert it."""
    keys = source.keys()
    if is_peft_model_state(keys):
        _, tensors, dropped = split_peft_model_state(source)
        return {
            "kind": "PeftModel state dict",
            "adapter_tensors": dropped.tensors,
            "adapter_bytes": dropped.nbytes,
            "convert": REFUSAL_HINT,
        }
    adapter = adapter_of(source)
    return None if adapter is None else adapter.to_dict()
