"""How a conversion reads its source and what its output is: the options, grouped."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptkit.adapters import AdapterOptions

__all__ = ["ReadOptions", "OutputOptions"]


@dataclass(frozen=True)
class ReadOptions:
    """How the source is read: where its state dict is, and what its pickle may name."""

    select: str | None = None
    ema: bool = False
    trust: bool = False
    allow_globals: tuple[str, ...] = ()
    adapters: AdapterOptions = field(default_factory=AdapterOptions)
    variant: str | None = None  # a model folder's weights of this variant (diffusers' fp16)
    names_from: str | None = None  # the model a diffusers EMAModel's shadow_params belong to
    workers: int = 8  # ranged requests in flight for a source at a URL (local files: unused)


@dataclass(frozen=True)
class OutputOptions:
    """What the output is: its format, dtype, sharding and how ties are written."""

    to: str | None = None
    dtype: str | None = None
    keep_dtype: tuple[str, ...] = ()
    allow_overflow: bool = False
    max_shard_size: int | str | None = None
    keep_tied_copies: bool = False
