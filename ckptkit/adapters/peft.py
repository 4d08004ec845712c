"""PEFT LoRA adapters: a ``save_pretrained`` folder (``adapter_config.json`` beside
``adapter_model.safetensors`` or ``.bin``), read from the config and the tensors' headers.

Key names are peft 0.21's ``get_peft_model_state_dict``: ``base_model.model.<module>.lora_A.weight``
and ``lora_B.weight`` (``lora_B.bias`` with ``lora_bias``), ``lora_embedding_A/B`` for
embeddings, ``lora_magnitude_vector`` for DoRA, ``token_adapter.trainable_tokens_delta`` for
trainable tokens, and a ``modules_to_save`` module's tensors under its plain names.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ckptkit.adapters.adapter import Adapter, AdapterError, Target, factor_rank
from ckptkit.adapters.patterns import (
    KeyTable,
    Pattern,
    PatternError,
    full_pattern,
    peft_key_pattern,
)
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.folders.layouts import ADAPTER_FILES
from ckptkit.storage.location import Location
from ckptkit.storage.small import quoted, read_json

__all__ = ["CONFIG", "WEIGHTS", "read_config", "adapter_from_tensors", "PREFIX"]

CONFIG = "adapter_config.json"
WEIGHTS = ADAPTER_FILES  # the folder's weights, as open_source finds them
PREFIX = "base_model.model."  # PeftModel's own wrapper around the base model

# Config fields that make an adapter something other than a plain LoRA merge, and why.
_REFUSED = {
    "use_qalora": "QA-LoRA pools its input; peft merges it only into a quantized base",
    "use_bdlora": "BD-LoRA's block-diagonal factors",
    "arrow_config": "Arrow routes between several LoRA experts at run time",
    "alora_invocation_tokens": "activated LoRA (aLoRA) applies only after its invocation tokens",
    "target_parameters": "LoRA on bare parameters (target_parameters)",
    "layer_replication": "layer_replication duplicates base layers",
    "megatron_config": "Megatron's parallel layers",
}
# init_lora_weights values that change the base weights too: the adapter alone is not the
# whole change (peft converts them with path_initial_model_for_weight_conversion).
_BASE_CHANGING_INIT = ("pissa", "olora", "corda", "loftq", "eva", "orthogonal")

_PARTS = re.compile(
    r"(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_embedding_A|"
    r"lora_embedding_B|lora_magnitude_vector|token_adapter\.trainable_tokens_delta)"
)


def read_config(path: Location) -> dict[str, Any]:
    """An ``adapter_config.json``, checked for what a LoRA merge needs (its size and nesting
    bounded, a FIFO refused, every number and pattern checked: ``check_config``)."""
    config = read_json(path, "adapter config")
    if not isinstance(config, dict):
        raise AdapterError(f"{path} is not an adapter config (not a JSON object)")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(
            f"{path} is a PEFT {quoted(str(kind))} adapter; ckptkit merges LoRA (and DoRA, "
            "rsLoRA) only",
            "merge it with peft's merge_and_unload",
        )
    for name, why in _REFUSED.items():
        if config.get(name):
            raise AdapterError(
                f"{path} sets {name} ({why}), which ckptkit does not merge",
                "merge it with peft's merge_and_unload",
            )
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INIT):
        raise AdapterError(
            f"{path} was initialised with init_lora_weights={quoted(init)}, which changes the "
            "base weights too, so the adapter alone does not say what to merge",
            "save it with peft's path_initial_model_for_weight_conversion for a plain LoRA",
        )
    check_config(config, path)
    return config


# The largest rank and token index read: far beyond any real adapter, small enough that no
# arithmetic on them overflows.
MAX_RANK = 1 << 20
MAX_INDEX = 1 << 31


def _bad(where: Location | str, field: str, value: Any, why: str) -> AdapterError:
    return AdapterError(
        f"{where} sets {field}={_shown(value)}: {why}", f"fix {field} in the adapter's {CONFIG}"
    )


def _shown(value: Any, limit: int = 60) -> str:
    """A config's value as its JSON text, cut short for an error line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # an int too long to print
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rank(value: Any, where: Location | str, field: str) -> int:
    """A rank from a config: a whole number from 1 to ``MAX_RANK``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(where, field, value, "a rank is a whole number")
    if not math.isfinite(value) or value != int(value) or not 1 <= value <= MAX_RANK:
        raise _bad(where, field, value, f"a rank is a whole number from 1 to {MAX_RANK:,}")
    return int(value)


def _alpha(value: Any, where: Location | str, field: str) -> float:
    """A ``lora_alpha`` from a config: a finite number (NaN or inf would merge as NaN/inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(where, field, value, "lora_alpha is a number")
    try:
        alpha = float(value)
    except OverflowError:  # an int too large for a float
        alpha = math.inf
    if not math.isfinite(alpha):
        raise _bad(where, field, value, "lora_alpha must be a finite number")
    return alpha


def _compiled(
    pattern: Any, where: Location | str, field: str, make: Any = peft_key_pattern
) -> Pattern:
    if not isinstance(pattern, str):
        raise _bad(where, field, pattern, "a module pattern is a string")
    try:
        return make(pattern)
    except PatternError as exc:
        raise AdapterError(
            f"{where} has pattern {quoted(pattern)} in {field}, which ckptkit cannot match: {exc}",
            f"write it as a plain regular expression in the adapter's {CONFIG}",
        ) from None


def _indices(value: Any, where: Location | str, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_INDEX for i in value
    ):
        raise _bad(where, field, value, "token indices are a list of whole numbers from 0")
    return tuple(value)


@dataclass(frozen=True)
class Rules:
    """A config's per-module rules, checked and compiled once: ``rank_pattern`` and
    ``alpha_pattern`` (first match wins, as peft's ``get_pattern_key``) and the token indices
    of ``trainable_token_indices``."""

    r: int | None
    lora_alpha: float | None
    rank_keys: KeyTable
    ranks: tuple[int, ...]  # rank_pattern's values, in its keys' order
    alpha_keys: KeyTable
    alphas: tuple[float, ...]
    tokens: tuple[int, ...] | None  # a list: the input embedding's
    token_patterns: tuple[tuple[Pattern, tuple[int, ...]], ...]  # a dict: each module's

    def rank(self, module: str, default: int) -> int:
        found = self.rank_keys.first(module)
        if found is not None:
            return self.ranks[found]
        return self.r if self.r is not None else default

    def alpha(self, module: str, r: int) -> float:
        found = self.alpha_keys.first(module)
        if found is not None:
            return self.alphas[found]
        return self.lora_alpha if self.lora_alpha is not None else float(r)

    def token_indices(self, module: str) -> tuple[int, ...] | None:
        if self.tokens is not None:
            return self.tokens
        return next((i for p, i in self.token_patterns if p.matches(module)), None)


def check_config(config: dict[str, Any], where: Location | str) -> Rules:
    """Every number and pattern of a config that a merge reads, checked (type, finite, range)
    and compiled; one AdapterError naming ``where``, the field and the value."""
    r = None if "r" not in config else _rank(config["r"], where, "r")
    alpha = (
        None if "lora_alpha" not in config else _alpha(config["lora_alpha"], where, "lora_alpha")
    )
    patterns = {}
    for field in ("rank_pattern", "alpha_pattern"):
        value = config.get(field) or {}
        if not isinstance(value, dict):
            raise _bad(where, field, value, "it maps module patterns to numbers")
        patterns[field] = value
    ranks = tuple(
        _rank(v, where, f"rank_pattern[{quoted(k)}]") for k, v in patterns["rank_pattern"].items()
    )
    alphas = tuple(
        _alpha(v, where, f"alpha_pattern[{quoted(k)}]")
        for k, v in patterns["alpha_pattern"].items()
    )
    rank_keys, alpha_keys = (
        KeyTable(
            [k if isinstance(k, str) else "" for k in patterns[field]],
            functools.partial(_compiled, where=where, field=field),
        )
        for field in ("rank_pattern", "alpha_pattern")
    )
    targets = config.get("target_modules")
    if isinstance(targets, str):
        _compiled(targets, where, "target_modules", full_pattern)
    elif targets is not None and not (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    ):
        raise _bad(where, "target_modules", targets, "it is a pattern or a list of module names")
    tokens: tuple[int, ...] | None = None
    token_patterns: tuple[tuple[Pattern, tuple[int, ...]], ...] = ()
    spec = config.get("trainable_token_indices")
    if isinstance(spec, dict):
        token_patterns = tuple(
            (
                _compiled(k, where, "trainable_token_indices"),
                _indices(v, where, f"trainable_token_indices[{quoted(k)}]"),
            )
            for k, v in spec.items()
        )
    elif spec is not None:
        tokens = _indices(spec, where, "trainable_token_indices")
    for field in ("base_model_name_or_path", "revision"):
        if config.get(field) is not None and not isinstance(config[field], str):
            raise _bad(where, field, config[field], "it is a name or a path")
    return Rules(r, alpha, rank_keys, ranks, alpha_keys, alphas, tokens, token_patterns)


def adapter_from_tensors(
    path: Location, source: Source, config: dict[str, Any], *, kind: str, prefix: str = PREFIX
) -> Adapter:
    """An Adapter from its tensors (by peft's key names under ``prefix``) and its config."""
    rules = check_config(config, path)
    entries = dict(source.entries())
    parts: dict[str, dict[str, str]] = {}
    replaced: dict[str, str] = {}
    for key in entries:
        if not key.startswith(prefix):
            raise AdapterError(
                f"'{key}' in {path} is not under peft's '{prefix}'",
                "is this a PEFT adapter? inspect it with ckptkit inspect",
            )
        match = _PARTS.fullmatch(key[len(prefix) :])
        if match is None:  # modules_to_save, a bias trained with bias="all", a saved embedding
            name = key[len(prefix) :]
            if ".original_module." in name or ".modules_to_save." in name:
                continue  # bias="all" saves these copies too; peft ignores them on load
            replaced[name.replace(".base_layer.", ".")] = key
        else:
            parts.setdefault(match["module"], {})[match["part"]] = key
    targets, tokens = [], {}
    for module, found in parts.items():
        if "token_adapter.trainable_tokens_delta" in found:
            rows = found.pop("token_adapter.trainable_tokens_delta")
            tokens[module + ".weight"] = (rows, _token_indices(rules, module, path))
        if found:
            targets.append(_target(path, module, found, entries, config, rules))
    dora = any(t.magnitude for t in targets)
    variant = ("DoRA" if dora else "LoRA") if not config.get("use_rslora") else "rsLoRA"
    if dora and config.get("use_rslora"):
        variant = "rsLoRA + DoRA"
    return Adapter(
        path=path,
        kind=kind,
        source=source,
        variant=variant,
        targets=targets,
        replaced=replaced,
        token_rows=tokens,
        base_name=config.get("base_model_name_or_path") or None,
        revision=config.get("revision") or None,
        config=config,
    )


def _target(
    path: Location,
    module: str,
    found: dict[str, str],
    entries: dict[str, TensorInfo],
    config: dict[str, Any],
    rules: Rules,
) -> Target:
    """One LoRA module: its factors, rank and scale, checked against the config."""
    embedding = "lora_embedding_A" in found or "lora_embedding_B" in found
    a_name, b_name = (
        ("lora_embedding_A", "lora_embedding_B")
        if embedding
        else ("lora_A.weight", "lora_B.weight")
    )
    missing = [name for name in (a_name, b_name) if name not in found]
    if missing:
        raise AdapterError(
            f"{path} holds no {missing[0]} for {module}", "the adapter is incomplete: save it again"
        )
    a, b = entries[found[a_name]], entries[found[b_name]]
    rank = factor_rank(found[a_name], a.shape, found[b_name], b.shape, path)
    r = rules.rank(module, rank)
    if r != rank:
        raise AdapterError(
            f"{found[a_name]} in {path} has rank {rank}, but the config says r={r}",
            "the adapter's config does not belong to its weights",
        )
    alpha = rules.alpha(module, r)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return Target(
        module=module,
        layer="embedding" if embedding else "conv" if len(a.shape) > 2 else "linear",
        rank=rank,
        alpha=alpha,
        scale=scale,
        a=found[a_name],
        b=found[b_name],
        magnitude=found.get("lora_magnitude_vector"),
        bias=found.get("lora_B.bias"),
        fan_in_fan_out=bool(config.get("fan_in_fan_out")),
    )


def _token_indices(rules: Rules, module: str, path: Location) -> tuple[int, ...]:
    """The token indices ``trainable_token_indices`` gives a module (a list means the input
    embedding, the only one there is)."""
    indices = rules.token_indices(module)
    if indices is None:
        raise AdapterError(
            f"{path} holds trainable tokens for {module}, but its config names no indices for "
            "it (trainable_token_indices)",
            "check the adapter's adapter_config.json",
        )
    return indices
