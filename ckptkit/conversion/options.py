"""How a conversion reads its source and what its output is: the options, grouped."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptkit.adapters import AdapterOptions
from ckptkit.formats.open import OpenOptions
from ckptkit.keys import KeyRules
from ckptkit.mapping.source import MapOptions
from ckptkit.spread import Part

__all__ = ["ReadOptions", "OutputOptions", "Job"]


@dataclass(frozen=True, kw_only=True)
class ReadOptions(OpenOptions):
    """How the source is read: how it is opened (``OpenOptions``: which weights, how safely;
    an adapter SRC's base takes them, see ``open_merged``), what is merged into it or stripped
    from it, and how many ranged requests a URL source gets."""

    adapters: AdapterOptions = field(default_factory=AdapterOptions)
    mapping: MapOptions | None = None  # names and shapes mapped to another family's (--map)
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
    # A legacy Megatron save's parallel sizes (--to megatron --tp, --pp, --ep, --vpp): None is 1.
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    expert_parallel: int | None = None
    virtual_stages: int | None = None


@dataclass(frozen=True)
class Job:
    """One conversion's options, besides its source and its output: how the source is read,
    how keys are renamed, what the output is, and how the run goes (``part``: one share of a
    sharded output's shards, see ``ckptkit.spread``)."""

    read: ReadOptions = field(default_factory=ReadOptions)
    keys: KeyRules = field(default_factory=KeyRules)
    output: OutputOptions = field(default_factory=OutputOptions)
    dry_run: bool = False
    force: bool = False
    verify: bool = True
    check_outputs: bool = False
    progress: bool = False
    part: Part | None = None
