"""PEFT LoRA adapters: a ``save_pretrained`` folder (``adapter_config.json`` beside
``adapter_model.safetensors`` or ``.bin``), read from the config and the tensors' headers.

Key names are peft 0.21's ``get_peft_model_state_dict``: ``base_model.model.<module>.lora_A.weight``
and ``lora_B.weight`` (``lora_B.bias`` with ``lora_bias``), ``lora_embedding_A/B`` for
embeddings, ``lora_magnitude_vector`` for DoRA, ``token_adapter.trainable_tokens_delta`` for
trainable tokens, and a ``modules_to_save`` module's tensors under its plain names.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ckptkit.adapters.adapter import Adapter, AdapterError, Target
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.folders.layouts import ADAPTER_FILES

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


def read_config(path: Path) -> dict[str, Any]:
    """An ``adapter_config.json``, checked for what a LoRA merge needs."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path} is not readable JSON ({exc})", "check the file") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} is not an adapter config (not a JSON object)")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(
            f"{path} is a PEFT {kind} adapter; ckptkit merges LoRA (and DoRA, rsLoRA) only",
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
            f"{path} was initialised with init_lora_weights={init!r}, which changes the base "
            "weights too, so the adapter alone does not say what to merge",
            "save it with peft's path_initial_model_for_weight_conversion for a plain LoRA",
        )
    return config


def _matches(pattern: str, module: str) -> bool:
    """Whether a config's pattern names a module, as peft's ``get_pattern_key`` matches: the
    pattern matches the end of the module path."""
    return re.match(rf"(.*\.)?({pattern})$", module) is not None


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """``rank_pattern`` / ``alpha_pattern``'s value for a module: the first pattern's that
    matches."""
    return next(
        (value for pattern, value in patterns.items() if _matches(pattern, module)), default
    )


def _token_indices(config: dict[str, Any], module: str, path: Path) -> tuple[int, ...]:
    """The token indices ``trainable_token_indices`` gives a module (a list means the input
    embedding, the only one there is)."""
    spec = config.get("trainable_token_indices")
    if isinstance(spec, list):
        return tuple(int(i) for i in spec)
    if isinstance(spec, dict):
        for pattern, indices in spec.items():
            if _matches(pattern, module):
                return tuple(int(i) for i in indices)
    raise AdapterError(
        f"{path} holds trainable tokens for {module}, but its config names no indices for it "
        "(trainable_token_indices)",
        "check the adapter's adapter_config.json",
    )


def adapter_from_tensors(
    path: Path, source: Source, config: dict[str, Any], *, kind: str, prefix: str = PREFIX
) -> Adapter:
    """An Adapter from its tensors (by peft's key names under ``prefix``) and its config."""
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
            tokens[module + ".weight"] = (rows, _token_indices(config, module, path))
        if found:
            targets.append(_target(path, module, found, entries, config))
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
    path: Path,
    module: str,
    found: dict[str, str],
    entries: dict[str, TensorInfo],
    config: dict[str, Any],
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
    rank = a.shape[0]
    if len(a.shape) < 2 or len(b.shape) < 2 or b.shape[1] != rank:
        raise AdapterError(
            f"{found[a_name]} {list(a.shape)} and {found[b_name]} {list(b.shape)} in {path} are "
            "not the two factors of one rank",
            "the adapter is damaged: save it again",
        )
    r = int(_pattern(config.get("rank_pattern") or {}, module, config.get("r", rank)))
    if r != rank:
        raise AdapterError(
            f"{found[a_name]} in {path} has rank {rank}, but the config says r={r}",
            "the adapter's config does not belong to its weights",
        )
    alpha = float(_pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", r)))
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
