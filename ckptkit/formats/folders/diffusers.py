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
import math
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, SelectError
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.storage.location import Location
from ckptkit.storage.small import quoted, read_json

if TYPE_CHECKING:
    import torch

__all__ = [
    "WEIGHTS_NAME",
    "MODEL_INDEX",
    "Weights",
    "weights_in",
    "describe_weights",
    "is_index_name",
    "is_weights_name",
    "variants_in",
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

    path: Location
    variant: str | None
    diffusers: bool  # diffusers' names (diffusion_pytorch_model), not transformers'
    variants: tuple[str | None, ...]  # every variant the folder holds (None: without one)

    @property
    def sharded(self) -> bool:
        return self.path.name.endswith(".json")


def is_index_name(name: str) -> bool:
    """A shard index's name, a variant's included (``...safetensors.index.fp16.json``)."""
    return name.endswith(".index.json") or _INDEX.fullmatch(name) is not None


def _by_variant(
    folder: Location,
) -> dict[str | None, list[tuple[tuple[int, int, int], Location, str]]]:
    groups: dict[str | None, list[tuple[tuple[int, int, int], Location, str]]] = {}
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


def variants_in(folder: Location) -> set[str | None]:
    """The variants whose weights a model folder holds (None: the weights without one)."""
    return set(_by_variant(folder)) if folder.is_dir() else set()


def is_weights_name(name: str) -> bool:
    """A model folder's weights, shard or shard index by diffusers' or transformers' names,
    a variant's included: what a converted folder's weights replace."""
    return any(rx.fullmatch(name) for rx in (_SINGLE, _SHARD, _INDEX))


def _variant_name(variant: str | None) -> str:
    return variant if variant is not None else "none (without a variant)"


def weights_in(folder: Location, variant: str | None = None) -> Weights | None:
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


def is_pipeline(folder: Location) -> bool:
    """A diffusers pipeline folder: ``model_index.json`` at its top."""
    return folder.is_dir() and (folder / MODEL_INDEX).is_file()


@dataclass(frozen=True)
class Component:
    """One entry of a pipeline's ``model_index.json``: its folder, library and class."""

    name: str
    library: str
    cls: str
    folder: Location

    def holds_weights(self) -> bool:
        return self.folder.is_dir() and bool(_by_variant(self.folder))


def read_model_index(folder: Location) -> dict[str, Any]:
    """A pipeline's ``model_index.json``: read with its size and nesting bounded, its class and
    version checked to be short strings (they are printed).

    Raises:
        FormatError: not JSON, too large or deep, not a mapping, or an odd ``_class_name``.
    """
    path = folder / MODEL_INDEX
    data = read_json(path, "diffusers model index", limit=CONFIG_LIMIT)
    if not isinstance(data, dict):
        raise FormatError(
            f"{path} is not a diffusers model index (it holds a {type(data).__name__}, not a "
            "mapping)",
            "check that it is the pipeline's model_index.json",
        )
    for field in ("_class_name", "_diffusers_version"):
        value = data.get(field)
        if value is not None and (not isinstance(value, str) or len(value) > _NAME_LIMIT):
            raise _odd_field(path, field, value, "a short string")
    return data


# model_index.json and a model's config.json are a few kB.
CONFIG_LIMIT = 1 << 20
# A class name, a version, a component's name: identifiers, never this long in a real index.
_NAME_LIMIT = 200


def _odd_field(path: Location, field: str, value: Any, wanted: str) -> FormatError:
    return FormatError(
        f"{path}: field '{field}' is {_shown(value)}, not {wanted}",
        f"check that {path.name} is the one diffusers wrote",
    )


def pipeline_components(folder: Location) -> list[Component]:
    """The components a pipeline's ``model_index.json`` names (``[null, null]`` ones left out),
    in its order.

    Raises:
        FormatError: an entry ``[library, class]`` whose parts are not short strings, or whose
            name is not a plain folder name (``../x``).
    """
    out = []
    path = folder / MODEL_INDEX
    for name, value in read_model_index(folder).items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue  # a setting (requires_safety_checker), not a component
        if value == [None, None]:
            continue
        library, cls = value
        if not all(isinstance(v, str) and 0 < len(v) <= _NAME_LIMIT for v in value):
            raise _odd_field(path, name, value, "[library, class] (two short strings)")
        if Path(name).name != name or name in (".", "..") or len(name) > _NAME_LIMIT:
            raise FormatError(
                f"{path} names a component {quoted(name)}, which is not a folder inside the "
                "pipeline",
                f"check that {MODEL_INDEX} is the one diffusers wrote",
            )
        out.append(Component(name, library, cls, folder / name))
    return out


def _listed(components: list[Component]) -> str:
    return ", ".join(f"{c.name} ({c.cls})" for c in components) or "none"


def pipeline_component(folder: Location, select: str | None) -> Component:
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


# The libraries importing diffusers wakes (torchao's "Failed to load ...so", torch's _pytree
# deprecations, diffusers' and transformers' notes): ckptkit's commands print only their own.
_LIBRARY_LOGGERS = ("torch", "torchao", "diffusers", "transformers")
_VERBOSITY = ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Around ckptkit's use of diffusers: the libraries' log lines and warnings silenced, and
    the cache folder torch's inductor makes when it is imported (``$TMPDIR/torchinductor_USER``,
    by ``torch._dynamo.package`` when torchao imports it) made in a temporary folder that is
    removed afterwards, unless the user chose one (``TORCHINDUCTOR_CACHE_DIR``)."""
    import os
    import shutil
    import tempfile

    import torch  # first: its import sets its loggers' levels

    del torch
    # diffusers and transformers set their loggers' levels when first imported, from these.
    settings = {name: "error" for name in _VERBOSITY if name not in os.environ}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        settings["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ckptkit-inductor-")
    os.environ.update(settings)
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        for name in settings:
            os.environ.pop(name, None)
        if "TORCHINDUCTOR_CACHE_DIR" in settings:
            shutil.rmtree(settings["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def _diffusers_class(name: str, config_path: Location) -> Any:
    """diffusers' own model class ``name`` (never code from a folder), or None when diffusers is
    not installed or has no such model class. Call inside :func:`_quiet`.

    Raises:
        FormatError: importing diffusers failed with anything but an ImportError (a broken
            installation raises RuntimeError, AttributeError...).
    """
    try:
        import diffusers

        cls = getattr(diffusers, name, None)
        model_mixin = diffusers.ModelMixin
    except ImportError:
        return None
    except Exception as exc:  # noqa: BLE001 - a broken installation, said in one line
        raise FormatError(
            f"importing diffusers to rebuild the parameter order of {config_path} failed: "
            f"{type(exc).__name__}: {_cut(str(exc), 160)}",
            "repair the diffusers installation (pip install -U diffusers), or give "
            "--names-from the model saved with torch (save_pretrained(safe_serialization=False))",
        ) from None
    if not isinstance(cls, type) or not issubclass(cls, model_mixin):
        return None
    return cls


# The numbers of a model config that ckptkit builds a class from (on the meta device, so sizes
# allocate nothing): counts of repeated layers or blocks are at most _MAX_REPEATS (real models
# have a few dozen), other integers (an EMA's optimization_step among them) at most _MAX_INT in
# size, floats finite.
_MAX_REPEATS = 512
_MAX_INT = 1 << 31
_REPEATS = re.compile(r"(^|_)(layers|blocks)(_|$)")


def _check_model_config(config: dict[str, Any], path: Location) -> None:
    """Every number of a model's ``config.json`` in a sensible range, before diffusers is
    imported or anything is built from it.

    Raises:
        FormatError: naming the file, the field and the value.
    """
    for field, top in config.items():
        repeats = _REPEATS.search(field) is not None
        stack = [top]
        while stack:  # lists of lists (transformer_layers_per_block): depth bounded by read_json
            value = stack.pop()
            if isinstance(value, list):
                stack.extend(value)
            elif (
                repeats
                and value is not None
                and (not isinstance(value, int) or value is True or value is False)
            ):
                # a count is a whole number (true, 1.5, "2" would reach diffusers' own errors)
                raise _odd_value(path, field, top, f"a count from 0 to {_MAX_REPEATS}")
            elif isinstance(value, float) and not math.isfinite(value):
                raise _odd_value(path, field, top, "a finite number")
            elif isinstance(value, int) and not isinstance(value, bool):
                if repeats and not 0 <= value <= _MAX_REPEATS:
                    raise _odd_value(path, field, top, f"a count from 0 to {_MAX_REPEATS}")
                if abs(value) > _MAX_INT:
                    raise _odd_value(path, field, top, f"at most {_MAX_INT:,} in size")


def _odd_value(path: Location, field: str, value: Any, wanted: str) -> FormatError:
    return FormatError(
        f"{path}: field '{field}' is {_shown(value)}, not {wanted}",
        f"check that {path.name} is the config of the model the EMAModel was made from",
    )


def _shown(value: Any, limit: int = 80) -> str:
    """A value read from JSON as JSON writes it (NaN, Infinity), cut short for an error."""
    try:
        text = json.dumps(value)
    except ValueError:  # an int past str()'s digit limit
        return f"an integer of {value.bit_length()} bits"
    return _cut(text, limit)


def _cut(text: str, limit: int) -> str:
    """A message or value cut short for an error line (one line: newlines become spaces)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def _registration_budget(limit: int, path: Location, held: str) -> Iterator[None]:
    """Stop a model's construction once it registers more than ``limit`` parameters (or ten
    times as many modules): a config that would build more than the weights file holds is
    wrong, and building it whole could take minutes and gigabytes of Python objects."""
    from torch.nn.modules import module

    counts = {"parameters": 0, "modules": 0}

    def count(what: str, bound: int) -> None:
        counts[what] += 1
        if counts[what] > bound:
            raise FormatError(
                f"{path} builds more than {bound:,} {what}, but {held}",
                "give --names-from the model folder the EMAModel was made from",
                api_hint="give names_from= the model folder the EMAModel was made from",
            )

    handles = [
        module.register_module_parameter_registration_hook(lambda *_: count("parameters", limit)),
        module.register_module_module_registration_hook(
            lambda *_: count("modules", 10 * limit + 100)
        ),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def parameter_order(
    folder: Location, limit: int, held: str
) -> list[tuple[str, tuple[int, ...]]] | None:
    """A diffusers model folder's parameters in ``parameters()`` order, with their shapes: the
    model class its ``config.json`` names (diffusers' own, never code from the folder) built
    from that config on torch's meta device, which allocates nothing. None when diffusers is
    not installed or the config names no diffusers model class.

    Args:
        limit: the most parameters the model may have (the tensors its weights file holds):
            construction stops past it.
        held: what holds ``limit`` tensors, for the error.

    Raises:
        FormatError: a config that cannot be read, with a number out of range (see
            :func:`_check_model_config`), that builds more than ``limit`` parameters, or that
            its class refuses; importing diffusers failed.
    """
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = read_json(path, "diffusers model config", limit=CONFIG_LIMIT)
    if not isinstance(config, dict):
        raise FormatError(
            f"{path} is not a model config (it holds a {type(config).__name__}, not a mapping)",
            "give --names-from the model folder the EMAModel was made from",
        )
    name = config.get("_class_name")
    if not isinstance(name, str) or not name.isidentifier():
        return None
    _check_model_config(config, path)
    with _quiet():
        cls = _diffusers_class(name, path)
        if cls is None:
            return None
        import torch

        try:
            with _registration_budget(limit, path, held), torch.device("meta"):
                model = cls.from_config(config)
        except FormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a config its class refuses
            raise FormatError(
                f"{path} does not build a {name}: {type(exc).__name__}: {_cut(str(exc), 160)}"
            ) from None
    return [(key, tuple(p.shape)) for key, p in model.named_parameters()]


def shadow_names(ema: Source, model: Source, names_from: Location) -> list[str]:
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
        held = f"{model.path.name} holds {len(entries):,} tensors"
        order = parameter_order(folder, len(entries), held)
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
        names_from: Location,
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
        self.remote_file = ema.remote_file  # at a URL: the file read through
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

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        return self.inner.byte_span(self._key[key])

    def byte_pieces(self, key: str) -> list[tuple[Location, int, int]] | None:
        return self.inner.byte_pieces(self._key[key])

    def expected_crc(self, key: str) -> int | None:
        return self.inner.expected_crc(self._key[key])

    def aliases(self) -> dict[str, str]:
        return {self._name[a]: self._name[b] for a, b in self.inner.aliases().items()}

    def files(self) -> list[Location]:
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
