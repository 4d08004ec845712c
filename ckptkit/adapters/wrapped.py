"""A ``PeftModel``'s own ``state_dict()``: the base's tensors under ``base_model.model.`` with
``.base_layer.`` inside each adapted module, beside the adapter's tensors (``lora_A.default``...)
and ``modules_to_save``'s two copies (``original_module``, ``modules_to_save.default``).

It is split into two views of the one file: the plain base (the wrapper's segments removed,
the original modules kept) and the adapter (peft's adapter-file names), so it can be stripped
(``--drop-adapters``) or merged like any adapter. It holds no ``lora_alpha``, so merging needs
the scale from outside.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ckptkit.adapters.adapter import AdapterError
from ckptkit.adapters.peft import PREFIX
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.base.tree import DroppedPart
from ckptkit.storage.location import Location

if TYPE_CHECKING:
    import torch

__all__ = [
    "is_peft_model_state",
    "split_peft_model_state",
    "ViewSource",
    "REFUSAL_HINT",
    "REFUSAL_API_HINT",
]

REFUSAL_HINT = (
    "pass --drop-adapters for the base model alone, or merge with --lora-alpha N or "
    "--adapter-config adapter_config.json"
)
REFUSAL_API_HINT = (  # the same, for ckptkit.convert()'s callers
    "pass drop_adapters=True for the base model alone, or merge with lora_alpha=N or "
    "adapter_config='adapter_config.json'"
)

# A named adapter's tensors (the name is the segment after the part).
_ADAPTER_PART = re.compile(
    r"(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
    r"lora_magnitude_vector|modules_to_save|token_adapter\.trainable_tokens_delta)"
    r"\.(?P<name>[^.]+)(?P<rest>(\..+)?)"
)
# Where peft puts a file's name for each part in its adapter files (peft's
# get_peft_model_state_dict drops the adapter name, and `.weight` after the parameters).
_FILE_PART = {
    "lora_A": "lora_A",
    "lora_B": "lora_B",
    "lora_embedding_A": "lora_embedding_A",
    "lora_embedding_B": "lora_embedding_B",
    "lora_magnitude_vector": "lora_magnitude_vector",
    "token_adapter.trainable_tokens_delta": "token_adapter.trainable_tokens_delta",
}


def is_peft_model_state(keys: list[str]) -> bool:
    """Whether keys are a PeftModel's own state dict (the base wrapped by adapter layers)."""
    return any(_ADAPTER_PART.fullmatch(k) for k in keys) and any(
        ".base_layer." in k or ".original_module." in k for k in keys
    )


class ViewSource(Source):
    """Some of another Source's tensors under other names (the one file, read once)."""

    def __init__(self, inner: Source, names: dict[str, str], *, format: str) -> None:
        super().__init__(path=inner.path, format=format, metadata=dict(inner.metadata))
        self.inner, self.names = inner, names  # new name -> the inner Source's key
        self.selected, self.selected_reason = inner.selected, inner.selected_reason
        self.extras, self.globals = inner.extras, inner.globals
        self.meta = getattr(inner, "meta", None)

    def entries(self) -> list[tuple[str, TensorInfo]]:
        info = dict(self.inner.entries())
        return [(new, info[old]) for new, old in self.names.items()]

    def load(self, key: str) -> torch.Tensor:
        return self.inner.load(self.names[key])

    def byte_pieces(self, key: str) -> list[tuple[Location, int, int]] | None:
        return self.inner.byte_pieces(self.names[key])

    def expected_crc(self, key: str) -> int | None:
        return self.inner.expected_crc(self.names[key])

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        return self.inner.byte_span(self.names[key])

    def aliases(self) -> dict[str, str]:
        back = {old: new for new, old in self.names.items()}
        return {
            back[a]: back[b] for a, b in self.inner.aliases().items() if a in back and b in back
        }

    def files(self) -> list[Location]:
        return self.inner.files()

    def close(self) -> None:
        self.inner.close()


def split_peft_model_state(source: Source) -> tuple[ViewSource, ViewSource, DroppedPart]:
    """The base view (plain names, ``base_model.model.`` gone) and the adapter view (adapter
    file names) of a PeftModel state dict, and what the base view leaves out.

    Raises:
        AdapterError: it holds several adapters (merge one: ckptkit cannot tell which).
    """
    entries = dict(source.entries())
    base: dict[str, str] = {}
    adapter: dict[str, str] = {}
    names: set[str] = set()
    for key in entries:
        match = _ADAPTER_PART.fullmatch(key)
        if match is None:
            plain = key.replace(".base_layer.", ".").replace(".original_module.", ".")
            plain = plain.replace(".token_adapter.", ".")
            plain = plain[len(PREFIX) :] if plain.startswith(PREFIX) else plain
            if plain in base:  # two tensors for one base name: neither may silently win
                raise AdapterError(
                    f"{source.path} holds both '{base[plain]}' and '{key}', which are the same "
                    f"base tensor '{plain}' once peft's wrapper segments are removed",
                    "the state dict is damaged: save it again",
                )
            base[plain] = key
            continue
        names.add(match["name"])
        part, rest = match["part"], match["rest"]
        if part == "modules_to_save":
            new = f"{match['module']}{rest}"
        elif part in ("lora_magnitude_vector",) or part.startswith(("lora_embedding", "token")):
            new = f"{match['module']}.{_FILE_PART[part]}"  # parameters: no `.weight` in files
        else:
            new = f"{match['module']}.{_FILE_PART[part]}{rest}"
        adapter[new if new.startswith(PREFIX) else PREFIX + new] = key
    if len(names) > 1:
        raise AdapterError(
            f"{source.path} holds several adapters ({', '.join(sorted(names))})",
            "save the one to merge with peft's save_pretrained and merge that folder",
        )
    dropped = DroppedPart(
        "adapter tensors (LoRA factors, modules_to_save copies)",
        len(adapter),
        sum(entries[old].nbytes for old in adapter.values()),
    )
    base_view = ViewSource(source, base, format=source.format)
    base_view.selected_reason = (
        "the base model of a PeftModel state dict: base_model.model. and .base_layer. removed, "
        "original modules kept"
    )
    return (
        base_view,
        ViewSource(source, adapter, format="PeftModel adapter tensors"),
        dropped,
    )


def config_from_options(lora_alpha: float | None, config: dict[str, Any] | None) -> dict[str, Any]:
    """The adapter config a merge of a PeftModel state dict uses: the adapter's own
    ``adapter_config.json``, or just ``lora_alpha`` (rank from the factors' shapes)."""
    if config is not None:
        return config if lora_alpha is None else {**config, "lora_alpha": lora_alpha}
    return {"peft_type": "LORA", "lora_alpha": lora_alpha}
