"""kohya-ss / sd-scripts LoRA files: ``lora_unet_<module path, dots as underscores>`` (and
``lora_te_``, ``lora_te1_``, ``lora_te2_`` for text encoders) with ``.lora_down.weight``,
``.lora_up.weight`` and a 0-dim ``.alpha``; scale ``alpha / rank`` (``networks/lora.py``).

Underscored names cannot be split back into paths, so a module is found from the base's side:
each base weight's path with its dots as underscores, matched against the file's names.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckptkit.adapters.adapter import Adapter, AdapterError, Target
from ckptkit.formats.base.source import Source

__all__ = ["is_kohya", "read_kohya", "bind_kohya"]

_KEY = re.compile(
    r"(?P<name>lora_(?:unet|te\d?)_.+)\.(?P<part>lora_down\.weight|lora_up\.weight|alpha)"
)
# LyCORIS and other networks sd-scripts-style files also hold (LoHa, LoKr, DoRA scales...).
_OTHER = re.compile(r"\.(hada_|lokr_|dora_scale|diff|oft_|lora_mid)")


def is_kohya(keys: list[str]) -> bool:
    """Whether a file's keys are a kohya-style LoRA's."""
    return (
        bool(keys)
        and any(k.endswith(".lora_down.weight") for k in keys)
        and all(k.startswith(("lora_unet_", "lora_te")) for k in keys)
    )


def read_kohya(path: Path, source: Source) -> Adapter:
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
        down, up = entries[found["lora_down.weight"]], entries[found["lora_up.weight"]]
        rank = down.shape[0]
        if len(up.shape) < 2 or up.shape[1] != rank:
            raise AdapterError(
                f"{found['lora_up.weight']} {list(up.shape)} in {path} does not fit "
                f"{found['lora_down.weight']} {list(down.shape)} (rank {rank})",
                "the file is damaged",
            )
        alpha_key = found.get("alpha")
        alpha = float(source.load(alpha_key)) if alpha_key else float(rank)
        targets.append(
            Target(
                module=name,
                layer="conv" if len(down.shape) > 2 else "linear",
                rank=rank,
                alpha=alpha,
                scale=alpha / rank,
                a=found["lora_down.weight"],
                b=found["lora_up.weight"],
            )
        )
    return Adapter(
        path=path,
        kind="kohya LoRA",
        source=source,
        variant="LoRA",
        targets=targets,
        base_name=source.metadata.get("ss_sd_model_name") or None,
        config={k: v for k, v in source.metadata.items() if k.startswith("ss_")},
    )


def bind_kohya(adapter: Adapter, base_keys: list[str]) -> Adapter:
    """The adapter with each module named by the base weight it changes.

    Raises:
        AdapterError: a module matches no base weight, or several.
    """
    by_name: dict[str, list[str]] = {}
    for key in base_keys:
        if key.endswith(".weight"):
            module = key[: -len(".weight")]
            by_name.setdefault(module.replace(".", "_"), []).append(module)
    bound = []
    for target in adapter.targets:
        body = re.sub(r"^lora_(unet|te\d?)_", "", target.module)
        found = by_name.get(body) or [
            module
            for name, modules in by_name.items()
            if name.endswith("_" + body)
            for module in modules
        ]
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


def _renamed(target: Target, module: str) -> Target:
    from dataclasses import replace

    return replace(target, module=module)
