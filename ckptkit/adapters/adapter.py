"""An adapter as ckptkit reads it: what it changes in a base model, named by the base's module
paths, and the tensors it reads to do so. Readers (``peft.py``, ``kohya.py``, ``wrapped.py``)
build it from headers alone; ``merged.py`` applies it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import FormatError
from ckptkit.formats.base.source import Source
from ckptkit.storage.location import Location

__all__ = ["Target", "Adapter", "AdapterError", "factor_rank"]


class AdapterError(FormatError):
    """An adapter ckptkit cannot merge, or one that does not fit its base: named, with why."""


@dataclass(frozen=True)
class Target:
    """One module a low-rank adapter changes (what ``inspect`` lists)."""

    module: str  # the module path in the base's names
    layer: str  # linear, embedding, conv (from the adapter's tensor shapes)
    rank: int
    alpha: float
    scale: float
    a: str  # adapter keys
    b: str
    magnitude: str | None = None  # DoRA
    bias: str | None = None  # lora_bias: lora_B's bias
    fan_in_fan_out: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "layer": self.layer,
            "rank": self.rank,
            "alpha": self.alpha,
            "scale": self.scale,
            "dora": self.magnitude is not None,
            "lora_bias": self.bias is not None,
        }


@dataclass
class Adapter:
    """An opened adapter: its targets, the base tensors it replaces, and its own tensors."""

    path: Location
    kind: str  # "PEFT LoRA", "kohya LoRA", "PeftModel state dict"
    source: Source  # the adapter's own tensors
    variant: str  # LoRA, rsLoRA, DoRA
    targets: list[Target] = field(default_factory=list)
    # Base tensor (module path + ".weight"...) -> the adapter key holding its replacement
    # (modules_to_save, and biases trained with bias="all").
    replaced: dict[str, str] = field(default_factory=dict)
    # Embedding weight -> (adapter key of the new rows, their token indices).
    token_rows: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    base_name: str | None = None
    revision: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    # A kohya LoRA merged into one pipeline component: the other components' module counts.
    left_out: dict[str, int] = field(default_factory=dict)
    # How its base was found: "--base", the adapter's base_model_name_or_path, ...
    base_from: str | None = None

    def base_keys(self) -> list[str]:
        """The base tensors this adapter changes, in the names it gives them."""
        keys = [t.module + ".weight" for t in self.targets]
        keys += [t.module + ".bias" for t in self.targets if t.bias]
        return keys + list(self.replaced) + list(self.token_rows)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self.source.entries())

    def target_modules(self) -> list[str]:
        """The names peft's ``target_modules`` would give (``query``, ``value``)."""
        return sorted({t.module.rsplit(".", 1)[-1] for t in self.targets})

    def components(self) -> dict[str, int] | None:
        """The diffusers pipeline components it changes (``unet``, ``text_encoder``) -> how many
        modules in each; None for an adapter of one model, merged into one component at most."""
        return None

    def bind(self, base_keys: list[str], component: str | None = None) -> None:
        """Name each target by the base tensor it changes, given the base's keys (``component``:
        the base is that diffusers pipeline component). A PEFT adapter's names are already the
        base's module paths: nothing to do; a kind whose names are not overrides it
        (``kohya.KohyaAdapter``).

        Raises:
            AdapterError: the adapter does not fit that base.
        """

    def to_dict(self) -> dict[str, Any]:
        """What ``inspect --json`` says of it."""
        ranks = sorted({(t.rank, t.alpha) for t in self.targets})
        return {
            "kind": self.kind,
            "variant": self.variant,
            "base": self.base_name,
            "rank_alpha": [{"rank": r, "alpha": a} for r, a in ranks],
            "targets": [t.to_dict() for t in self.targets],
            "target_modules": self.target_modules(),
            "modules_to_save": sorted({k.rsplit(".", 1)[0] for k in self.replaced}),
            "trainable_tokens": {k: list(v[1]) for k, v in self.token_rows.items()},
            "bytes": self.nbytes,
        }

    def close(self) -> None:
        self.source.close()


def factor_rank(
    a_key: str, a: tuple[int, ...], b_key: str, b: tuple[int, ...], path: Location
) -> int:
    """The rank of a LoRA's two factors, checked to be two factors of one rank: ``A`` (or
    ``lora_down``) ``rank x inputs [x kernel]``, ``B`` (``lora_up``) ``outputs x rank [x 1]``,
    as many dimensions each, none of them zero.

    Raises:
        AdapterError: naming both tensors and their shapes.
    """
    fits = (
        len(a) >= 2
        and len(a) == len(b)
        and all(n >= 1 for n in (*a, *b))
        and b[1] == a[0]
        and all(k == 1 for k in b[2:])
    )
    if not fits:
        raise AdapterError(
            f"{a_key} {list(a)} and {b_key} {list(b)} in {path} are not the two factors of one "
            "rank (A: rank x inputs, B: outputs x rank)",
            "the adapter is damaged: save it again",
        )
    return a[0]
