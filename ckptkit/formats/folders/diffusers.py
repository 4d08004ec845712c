"""diffusers' folders: model folders, pipeline folders, and names for an ``EMAModel``'s weights.

- A model folder (``ModelMixin.save_pretrained``) holds ``config.json`` and
  ``diffusion_pytorch_model[.VARIANT].safetensors`` (or ``.bin``), or shards
  ``diffusion_pytorch_model[.VARIANT]-00001-of-0000N.safetensors`` with the index
  ``diffusion_pytorch_model.safetensors.index[.VARIANT].json`` (``diffusers/utils/constants.py``
  names them; ``_add_variant`` in ``utils/hub_utils.py`` puts the variant before the last
  suffix). A pipeline's transformers components use transformers' ``model`` / ``pytorch_model``
  stems with the same variant rule.
- A pipeline folder (``DiffusionPipeline.save_pretrained``) holds ``model_index.json``, which maps
  each component to ``[library, class]``, and a folder per component.
- ``EMAModel.state_dict()`` keeps the averaged weights in ``shadow_params``, a list in the order of
  the model's ``parameters()``, without names: :class:`ShadowNamedSource` names them after a model.

Stdlib only, but for :func:`parameter_order`, which builds a diffusers model's skeleton on torch's
meta device when a file cannot give the order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, SelectError
from ckptkit.formats.base.source import Source, TensorInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "WEIGHTS_NAME",
    "MODEL_INDEX",
    "Weights",
    "weights_in",
    "describe_weights",
    "is_index_name",
    "part_kind",
    "is_pipeline",
    "read_model_index",
    "pipeline_components",
    "pipeline_component",
    "Component",
    "shadow_names",
    "parameter_order",
    "ShadowNamedSource",
]

# diffusers' names (diffusers/utils/constants.py): SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME.
WEIGHTS_STEM = "diffusion_pytorch_model"
WEIGHTS_NAME = f"{WEIGHTS_STEM}.safetensors"
MODEL_INDEX = "model_index.json"
_STEMS = (WEIGHTS_STEM, "model", "pytorch_model")  # diffusers', then transformers'
_STEM = "|".join(_STEMS)
# diffusion_pytorch_model[.VARIANT].safetensors|bin
_SINGLE = re.compile(rf"(?P<stem>{_STEM})(?:\.(?P<variant>[^.]+))?\.(?P<ext>safetensors|bin)")
# diffusion_pytorch_model.safetensors.index[.VARIANT].json
_INDEX = re.compile(
    rf"(?P<stem>{_STEM})\.(?P<ext>safetensors|bin)\.index(?:\.(?P<variant>[^.]+))?\.json"
)
# diffusion_pytorch_model[.VARIANT]-00001-of-00002.safetensors: shards, read through the index
_SHARD = re.compile(
    rf"(?P<stem>{_STEM})(?:\.(?P<variant>[^.]+?))?-\d{{5}}-of-\d{{5}}\.(bin|safetensors)"
)


@dataclass(frozen=True)
class Weights:
    """The weights file (or shard index) of a model folder, and the variants beside it."""

    path: Path
    variant: str | None
    diffusers: bool  # diffusers' names (diffusion_pytorch_model), not transformers'
    variants: tuple[str | None, ...]  # every variant the folder holds (None: without one)

    @property
    def sharded(self) -> bool:
        return self.path.name.endswith(".json")


def is_index_name(name: str) -> bool:
    """A shard index's name, a variant's included (``...safetensors.index.fp16.json``)."""
    return name.endswith(".index.json") or _INDEX.fullmatch(name) is not None


def _by_variant(folder: Path) -> dict[str | None, list[tuple[tuple[int, int, int], Path, str]]]:
    groups: dict[str | None, list[tuple[tuple[int, int, int], Path, str]]] = {}
    for path in folder.iterdir():
        match = _INDEX.fullmatch(path.name) or _SINGLE.fullmatch(path.name)
        if match is None or _SHARD.fullmatch(path.name) or not path.is_file():
            continue
        # diffusers' stem first, safetensors before .bin, the index before a single file (as
        # from_pretrained looks for the index first)
        rank = (
            _STEMS.index(match["stem"]) != 0,
            match["ext"] != "safetensors",
            not path.name.endswith(".json"),
        )
        groups.setdefault(match["variant"], []).append((rank, path, match["stem"]))
    return groups


def _variant_name(variant: str | None) -> str:
    return variant if variant is not None else "none (without a variant)"


def weights_in(folder: Path, variant: str | None = None) -> Weights | None:
    """The weights of a model folder by diffusers' names, or transformers' names with a variant:
    the ``variant`` asked for; by default the file without a variant, else the only variant.
    None when the folder holds neither diffusers' files nor a variant (transformers' plain
    ``model.safetensors`` is read as before) and no variant is asked for.

    Raises:
        SelectError: ``variant`` is not there, or several variants and none without one.
    """
    groups = _by_variant(folder)
    diffusers = any(stem == WEIGHTS_STEM for group in groups.values() for _, _, stem in group)
    if variant is None and not diffusers and set(groups) <= {None}:
        return None
    if not groups:
        if variant is None:
            return None
        raise SelectError(
            f"{folder} holds no model weights of variant '{variant}'",
            "drop --variant",
            api_hint="drop variant=",
        )
    variants = tuple(sorted(groups, key=lambda v: (v is not None, v or "")))
    listed = ", ".join(
        f"{_variant_name(v)} ({min(groups[v], key=lambda g: g[0])[1].name})" for v in variants
    )
    if variant is not None and variant not in groups:
        raise SelectError(
            f"{folder} holds no variant '{variant}'; its weights: {listed}",
            "give one it holds with --variant NAME, or drop --variant",
            api_hint="give one it holds with variant='NAME', or drop variant=",
        )
    if variant is None and None not in groups and len(groups) > 1:
        named = [v for v in variants if v is not None]
        raise SelectError(
            f"{folder} holds weights in {len(named)} variants and none without one: {listed}",
            f"choose one with --variant {named[0]}",
            api_hint=f"choose one with variant='{named[0]}'",
        )
    chosen = variant if variant is not None else (None if None in groups else variants[0])
    _, path, stem = min(groups[chosen], key=lambda g: g[0])
    return Weights(path, chosen, stem == WEIGHTS_STEM, variants)


def describe_weights(weights: Weights) -> str:
    """Why a file was read: its name, its variant and the others (for ``selected_reason``)."""
    what = "the shard index" if weights.sharded else ""
    reason = f"{what + ' ' if what else ''}{weights.path.name} of the model folder"
    if weights.variant is not None:
        reason += f" (variant {weights.variant})"
    others = [v for v in weights.variants if v != weights.variant]
    if others:
        shown = " or ".join(f"--variant {v}" if v else "no --variant" for v in others)
        reason += f"; {shown} for another"
    return reason


# ------------------------------------------------------------------------------- pipelines


def is_pipeline(folder: Path) -> bool:
    """A diffusers pipeline folder: ``model_index.json`` at its top."""
    return folder.is_dir() and (folder / MODEL_INDEX).is_file()


@dataclass(frozen=True)
class Component:
    """One entry of a pipeline's ``model_index.json``: its folder, library and class."""

    name: str
    library: str
    cls: str
    folder: Path

    def holds_weights(self) -> bool:
        return self.folder.is_dir() and bool(_by_variant(self.folder))


def read_model_index(folder: Path) -> dict[str, Any]:
    """A pipeline's ``model_index.json``.

    Raises:
        FormatError: not JSON, or not a mapping.
    """
    try:
        data = json.loads((folder / MODEL_INDEX).read_text())
    except (OSError, ValueError) as exc:
        raise FormatError(f"{folder / MODEL_INDEX} is not a diffusers model index") from exc
    if not isinstance(data, dict):
        raise FormatError(f"{folder / MODEL_INDEX} is not a diffusers model index (no mapping)")
    return data


def pipeline_components(folder: Path) -> list[Component]:
    """The components a pipeline's ``model_index.json`` names (``[null, null]`` ones left out),
    in its order."""
    out = []
    for name, value in read_model_index(folder).items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library, cls = value
        if not isinstance(library, str) or not isinstance(cls, str):
            continue
        if Path(name).name != name or name in (".", ".."):
            continue
        out.append(Component(name, library, cls, folder / name))
    return out


def _listed(components: list[Component]) -> str:
    return ", ".join(f"{c.name} ({c.cls})" for c in components) or "none"


def pipeline_component(folder: Path, select: str | None) -> Component:
    """The component ``select`` names in a pipeline folder.

    Raises:
        SelectError: no ``select`` (the error lists the components), or it names no component
            holding weights.
    """
    components = pipeline_components(folder)
    found = next((c for c in components if select and c.name == select), None)
    if found is not None and found.holds_weights():
        return found  # the others' folders are not looked into (at a URL: not listed)
    weighted = [c for c in components if c.holds_weights()]
    data = read_model_index(folder)
    cls = data.get("_class_name", "pipeline")
    names = [c.name for c in weighted]
    example = "unet" if "unet" in names else names[0] if names else "COMPONENT"
    if not select:
        raise SelectError(
            f"{folder} is a diffusers pipeline ({cls}) whose components hold the weights: "
            f"{_listed(weighted)}",
            f"take one with --select {example}",
            api_hint=f"take one with select='{example}'",
        )
    if found is None:
        raise SelectError(
            f"{folder} is a diffusers pipeline with no component '{select}'; its components "
            f"with weights: {_listed(weighted)}",
            f"take one with --select {example}",
            api_hint=f"take one with select='{example}'",
        )
    raise SelectError(
        f"the '{select}' component ({found.cls}) of {folder} holds no weights; those that "
        f"do: {_listed(weighted)}",
        f"take one with --select {example}",
        api_hint=f"take one with select='{example}'",
    )


# ------------------------------------------------------------------- EMAModel's shadow_params

# Buffers torch's own modules keep in their state dicts (BatchNorm's); diffusers' models keep
# none in their saved weights.
_BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    logger = logging.getLogger("diffusers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def parameter_order(folder: Path) -> list[tuple[str, tuple[int, ...]]] | None:
    """A diffusers model folder's parameters in ``parameters()`` order, with their shapes: the
    model class its ``config.json`` names (diffusers' own, never code from the folder) built
    from that config on torch's meta device, which allocates nothing. None when diffusers is
    not installed or the config names no diffusers model class.
    """
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("_class_name") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name.isidentifier():
        return None
    try:
        import diffusers
        import torch
    except ImportError:
        return None
    cls = getattr(diffusers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, diffusers.ModelMixin):
        return None
    try:
        with _quiet(), torch.device("meta"):
            model = cls.from_config(config)
    except Exception as exc:  # a config its class refuses
        raise FormatError(
            f"{folder / 'config.json'} does not build a {name}: {type(exc).__name__}: {exc}"
        ) from None
    return [(key, tuple(p.shape)) for key, p in model.named_parameters()]


def shadow_names(ema: Source, model: Source, names_from: Path) -> list[str]:
    """The model's parameter names, in the order an ``EMAModel`` keeps its ``shadow_params``,
    each checked against the shadow parameter's shape.

    A torch file keeps its state dict's order, which is ``parameters()``'s with buffers among
    them; safetensors sorts its keys, so a safetensors model's order comes from its class
    (:func:`parameter_order`).

    Raises:
        FormatError: the order cannot be known, or the counts or a shape do not agree.
    """
    shadow = [info.shape for _, info in ema.entries()]
    entries = model.entries()
    shapes = dict(entries)
    if model.format in ("torch-zip", "torch-legacy"):
        names = [key for key, _ in entries]
        if len(names) != len(shadow):  # buffers among them
            names = [k for k in names if k.rsplit(".", 1)[-1] not in _BUFFER_NAMES]
        how = f"in {model.path.name}'s order"
    else:
        folder = names_from if names_from.is_dir() else model.path.parent
        order = parameter_order(folder)
        if order is None:
            raise FormatError(
                f"{model.path.name} ({model.format}) stores its keys sorted, not in the model's "
                f"parameter order, and {folder} names no diffusers model class ckptkit can "
                "rebuild the order from",
                "give --names-from a model folder with config.json (diffusers installed), or "
                "the model saved with torch (save_pretrained(safe_serialization=False))",
                api_hint="give names_from= a model folder with config.json (diffusers "
                "installed), or the model saved with torch (save_pretrained("
                "safe_serialization=False))",
            )
        for key, shape in order:
            if key not in shapes:
                raise FormatError(
                    f"{folder}'s config builds parameter '{key}', which {model.path.name} "
                    "does not hold",
                    "give the model folder the EMAModel was made from",
                )
            if shapes[key].shape != shape:
                raise FormatError(
                    f"{folder}'s config builds '{key}' of shape {list(shape)}, but "
                    f"{model.path.name} holds it as {list(shapes[key].shape)}",
                    "give the model folder the EMAModel was made from",
                )
        names = [key for key, _ in order]
        how = f"as {folder.name}'s class registers them"
    if len(names) != len(shadow):
        raise FormatError(
            f"{ema.path} holds {len(shadow)} shadow parameters and {names_from} "
            f"{len(names)} parameters ({how})",
            "give --names-from the model the EMAModel was made from",
            api_hint="give names_from= the model the EMAModel was made from",
        )
    for i, (name, shape) in enumerate(zip(names, shadow, strict=True)):
        if shapes[name].shape != shape:
            raise FormatError(
                f"shadow parameter {i} of {ema.path} has shape {list(shape)}, but parameter {i} "
                f"of {names_from}, '{name}', has {list(shapes[name].shape)}",
                "give --names-from the model the EMAModel was made from",
                api_hint="give names_from= the model the EMAModel was made from",
            )
    return names


class ShadowNamedSource(Source):
    """An ``EMAModel`` state dict's ``shadow_params`` under the model's parameter names."""

    def __init__(
        self,
        ema: Source,
        names_from: Path,
        *,
        opener: Callable[..., Source],
        variant: str | None = None,
    ) -> None:
        model = opener(names_from, variant=variant)
        try:
            names = shadow_names(ema, model, names_from)
        finally:
            model.close()
        super().__init__(
            path=ema.path,
            format=ema.format,
            metadata=ema.metadata,
            selected=ema.selected,
            selected_reason=f"{len(names)} shadow_params of a diffusers EMAModel, named after "
            f"{names_from}'s parameters in order (shapes checked)",
            extras=ema.extras,
            dropped=ema.dropped,
            candidates=ema.candidates,
            globals=ema.globals,
            folder=model.folder,
            weights_name=model.weights_name,
        )
        self.inner = ema
        self.remote_file = getattr(ema, "remote_file", None)  # at a URL: the file read through
        self._key = dict(zip(names, ema.keys(), strict=True))
        self._name = {key: name for name, key in self._key.items()}

    def entries(self) -> list[tuple[str, TensorInfo]]:
        infos = dict(self.inner.entries())
        return [(name, infos[key]) for name, key in self._key.items()]

    def load(self, key: str) -> torch.Tensor:
        return self.inner.load(self._key[key])

    def value(self, key: str) -> Any:
        return self.inner.value(self._key[key])

    def load_value(self, key: str) -> Any:
        return self.inner.load_value(self._key[key])

    def byte_span(self, key: str) -> tuple[Path, int, int] | None:
        return self.inner.byte_span(self._key[key])

    def byte_pieces(self, key: str) -> list[tuple[Path, int, int]] | None:
        return self.inner.byte_pieces(self._key[key])

    def expected_crc(self, key: str) -> int | None:
        return self.inner.expected_crc(self._key[key])

    def aliases(self) -> dict[str, str]:
        return {self._name[a]: self._name[b] for a, b in self.inner.aliases().items()}

    def files(self) -> list[Path]:
        return self.inner.files()

    def close(self) -> None:
        self.inner.close()


def part_kind(name: str) -> str | None:
    """What a file of a diffusers model folder is, for ``inspect``'s parts; None for a name
    diffusers does not write."""
    for rx, what in ((_INDEX, "the shard index"), (_SHARD, "a shard"), (_SINGLE, "the weights")):
        match = rx.fullmatch(name)
        if match and match["stem"] == WEIGHTS_STEM:
            variant = match["variant"]
            return what + (f", variant {variant} (--variant {variant})" if variant else "")
    return "the model's config (its class and arguments)" if name == "config.json" else None
