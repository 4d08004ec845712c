"""kohya-ss / sd-scripts LoRA files: ``lora_unet_<module path, dots as underscores>`` (and
``lora_te_``, ``lora_te1_``, ``lora_te2_`` for text encoders) with ``.lora_down.weight``,
``.lora_up.weight`` and a 0-dim ``.alpha``; scale ``alpha / rank`` (``networks/lora.py``).

Underscored names cannot be split back into paths, so a module is found from the base's side:
each base weight's path with its dots as underscores, matched against the file's names.
"""

from __future__ import annotations

import math
import re

from ckptkit.adapters.adapter import Adapter, AdapterError, Target, factor_rank
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.storage.location import Location

__all__ = [
    "is_kohya",
    "read_kohya",
    "KohyaAdapter",
    "bind_kohya",
    "COMPONENTS",
    "components",
    "for_component",
]

_KEY = re.compile(
    r"(?P<name>lora_(?:unet|te\d?)_.+)\.(?P<part>lora_down\.weight|lora_up\.weight|alpha)"
)
_GROUP = re.compile(r"^lora_(unet|te\d?)_")
# The diffusers pipeline component each group of an sd-scripts LoRA changes.
COMPONENTS = {
    "unet": "unet",
    "te": "text_encoder",
    "te1": "text_encoder",
    "te2": "text_encoder_2",
}
# LyCORIS and other networks sd-scripts-style files also hold (LoHa, LoKr, DoRA scales...).
_OTHER = re.compile(r"\.(hada_|lokr_|dora_scale|diff|oft_|lora_mid)")


def is_kohya(keys: list[str]) -> bool:
    """Whether a file's keys are a kohya-style LoRA's."""
    return (
        bool(keys)
        and any(k.endswith(".lora_down.weight") for k in keys)
        and all(k.startswith(("lora_unet_", "lora_te")) for k in keys)
    )


class KohyaAdapter(Adapter):
    """A kohya LoRA: its modules named by underscored paths, bound to a base from the base's
    side (:func:`bind_kohya`), one pipeline component's part at a time."""

    def target_modules(self) -> list[str]:
        """The file's groups (``lora_unet``, ``lora_te``) with their module counts: underscored
        names cannot be split back into peft's module names."""
        groups: dict[str, int] = {}
        for t in self.targets:
            group = "_".join(t.module.split("_")[:2])
            groups[group] = groups.get(group, 0) + 1
        return [f"{g} ({n} module{'s' if n != 1 else ''})" for g, n in sorted(groups.items())]

    def components(self) -> dict[str, int]:
        return components(self)

    def bind(self, base_keys: list[str], component: str | None = None) -> None:
        """Keep the part for ``component`` (a pipeline's), then name each module by the base
        weight it changes."""
        if component is not None:
            for_component(self, component)
        bind_kohya(self, base_keys)


def read_kohya(path: Location, source: Source) -> KohyaAdapter:
    """A kohya LoRA file, its modules named as the file names them (``bind_kohya`` maps them
    onto a base's paths)."""
    entries = dict(source.entries())
    groups: dict[str, dict[str, str]] = {}
    for key in entries:
        if _OTHER.search(key):
            raise AdapterError(
                f"'{key}' in {path} belongs to a LyCORIS network (LoHa, LoKr, DoRA...), which "
                "ckptkit does not merge",
                "merge it with the LyCORIS tools",
            )
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterError(f"'{key}' in {path} is not a kohya LoRA key", "check the file")
        groups.setdefault(match["name"], {})[match["part"]] = key
    targets = []
    for name, found in groups.items():
        if "lora_down.weight" not in found or "lora_up.weight" not in found:
            raise AdapterError(f"{path} holds no lora_down/lora_up pair for {name}")
        down, up = found["lora_down.weight"], found["lora_up.weight"]
        rank = factor_rank(down, entries[down].shape, up, entries[up].shape, path)
        alpha = _alpha(path, source, found["alpha"], entries) if "alpha" in found else float(rank)
        targets.append(
            Target(
                module=name,
                layer="conv" if len(entries[down].shape) > 2 else "linear",
                rank=rank,
                alpha=alpha,
                scale=alpha / rank,
                a=down,
                b=up,
            )
        )
    return KohyaAdapter(
        path=path,
        kind="kohya LoRA",
        source=source,
        variant="LoRA",
        targets=targets,
        base_name=source.metadata.get("ss_sd_model_name") or None,
        config={k: v for k, v in source.metadata.items() if k.startswith("ss_")},
    )


def _alpha(path: Location, source: Source, key: str, entries: dict[str, TensorInfo]) -> float:
    """A module's ``alpha``: one finite number (sd-scripts saves a 0-d tensor; a 1-element
    one reads the same). Its shape is checked before it is read, so a huge or empty "alpha" is
    refused without loading it."""
    info = entries[key]
    element = DTYPES.get(info.dtype)
    if info.numel != 1 or info.kind != "dense" or element is None or element.kind == "complex":
        raise AdapterError(
            f"'{key}' in {path} is {info.dtype} {list(info.shape)}: a kohya alpha is one number",
            "the file is damaged",
        )
    alpha = float(source.load(key).reshape(()).item())
    if not math.isfinite(alpha):
        raise AdapterError(
            f"'{key}' in {path} is {alpha}: alpha must be a finite number (it would merge as "
            f"{alpha} weights)",
            "fix the LoRA's alpha",
        )
    return alpha


def _module_index(base_keys: list[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Each base weight's module path with its dots as underscores -> the modules so named,
    and each ``_``-separated tail of those names -> the modules whose names end so: a kohya
    name is found with a lookup or two, as the whole path or as its end (a base with a prefix
    the LoRA's names lack)."""
    whole: dict[str, list[str]] = {}
    tails: dict[str, list[str]] = {}
    for key in base_keys:
        if not key.endswith(".weight"):
            continue
        module = key[: -len(".weight")]
        name = module.replace(".", "_")
        whole.setdefault(name, []).append(module)
        parts = name.split("_")
        for tail in dict.fromkeys("_".join(parts[i:]) for i in range(1, len(parts))):
            tails.setdefault(tail, []).append(module)
    return whole, tails


def _lookup(body: str, whole: dict[str, list[str]], tails: dict[str, list[str]]) -> list[str]:
    """The base modules a kohya name (its group prefix removed) names: the whole path first,
    then the ends of paths; a CLIP text encoder's names also without ``text_model_``."""
    names = [body]
    if body.startswith(_TEXT_MODEL):
        names.append(body[len(_TEXT_MODEL) :])
    for table in (whole, tails):
        for name in names:
            if table.get(name):
                return table[name]
    return []


# sd-scripts names a CLIP text encoder's modules under ``text_model_``; transformers 5's
# CLIPTextModel state dict has no ``text_model.`` prefix.
_TEXT_MODEL = "text_model_"


def bind_kohya(adapter: Adapter, base_keys: list[str]) -> Adapter:
    """The adapter with each module named by the base weight it changes (dict lookups: linear
    in the modules and the base's keys).

    Raises:
        AdapterError: a module matches no base weight, or several.
    """
    whole, tails = _module_index(base_keys)
    bound = []
    for target in adapter.targets:
        found = _lookup(_GROUP.sub("", target.module), whole, tails)
        if len(found) != 1:
            what = (
                "no base weight" if not found else f"several base weights ({', '.join(found[:3])})"
            )
            raise AdapterError(
                f"{target.module} in {adapter.path} matches {what}",
                "is this the base the LoRA was trained on? (its names are the diffusers / "
                "transformers module paths)",
            )
        bound.append(_renamed(target, found[0]))
    adapter.targets = bound
    return adapter


def _component(module: str) -> str:
    match = _GROUP.match(module)
    return COMPONENTS[match[1]] if match and match[1] in COMPONENTS else "?"


def components(adapter: Adapter) -> dict[str, int]:
    """The pipeline components a kohya LoRA changes (``unet``, ``text_encoder``,
    ``text_encoder_2``) -> how many modules in each: a whole pipeline's merge applies the
    adapter to these components only."""
    counts: dict[str, int] = {}
    for target in adapter.targets:
        counts[_component(target.module)] = counts.get(_component(target.module), 0) + 1
    return counts


def for_component(adapter: Adapter, component: str) -> Adapter:
    """The adapter with only the modules of one pipeline component (the base is that
    component's folder); the others are recorded in ``adapter.left_out``.

    Raises:
        AdapterError: it holds nothing for that component.
    """
    kept = [t for t in adapter.targets if _component(t.module) == component]
    if not kept:
        held = ", ".join(sorted(components(adapter))) or "nothing"
        raise AdapterError(
            f"{adapter.path} changes {held}, not the pipeline's '{component}' component",
            f"merge it into {held.split(', ')[0]} (--select)",
        )
    adapter.left_out = {
        name: count for name, count in components(adapter).items() if name != component
    }
    adapter.targets = kept
    return adapter


def _renamed(target: Target, module: str) -> Target:
    from dataclasses import replace

    return replace(target, module=module)
