"""``MergedSource``: a base checkpoint with adapters merged in, read one tensor at a time.

Tensors no adapter touches keep the base's byte ranges, so the copy engine copies them file to
file; a touched tensor is merged when it is loaded (``changes.merge_rows``: fp32, rounded once
to the base's dtype) and made again from the files when the output is verified. Every adapter is
bound to the base before anything is written: each tensor it changes must exist in the base with
a shape its factors fit, and a float dtype.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ckptkit.adapters.adapter import Adapter, AdapterError, Target
from ckptkit.adapters.changes import (
    BiasDelta,
    Change,
    LowRank,
    NotFinite,
    Replace,
    Tensors,
    TokenRows,
    merge_rows,
)
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.storage.location import Location

if TYPE_CHECKING:
    import torch

__all__ = ["MergedSource", "bind"]


def _prefix_map(names: list[str], base: dict[str, TensorInfo], adapter: Adapter) -> dict[str, str]:
    """Adapter names -> base keys: the same, or with one prefix added or removed throughout (an
    adapter trained on ``BertForSequenceClassification`` merged into a ``BertModel``)."""
    if all(n in base for n in names):
        return {n: n for n in names}
    first = next(n for n in names if n not in base)
    tries = [("", k[: -len(first)]) for k in base if k.endswith("." + first)]
    tries += [(first[: -len(k)], "") for k in base if first.endswith("." + k)]
    for drop, add in tries:
        mapped = {n: add + n[len(drop) :] for n in names if n.startswith(drop)}
        if len(mapped) == len(names) and all(k in base for k in mapped.values()):
            return mapped
    missing = [n for n in names if n not in base]
    raise AdapterError(
        f"{adapter.path} changes '{missing[0]}', which the base does not hold"
        + (f" ({len(missing)} such tensors)" if len(missing) > 1 else ""),
        "is this the base the adapter was trained on? name it with --base PATH",
    )


def _check_float(key: str, info: TensorInfo, adapter: Adapter) -> None:
    if (
        info.kind != "dense"
        or DTYPES[info.dtype].kind != "float"
        or info.dtype.startswith("float8")
    ):
        raise AdapterError(
            f"base tensor '{key}' is {info.dtype} ({info.kind}): a quantized base cannot take "
            f"{adapter.path}'s adapter exactly",
            "merge into the unquantized base (bf16, fp16 or fp32) and quantize after",
        )


def _low_rank(
    target: Target, info: TensorInfo, adapter: Adapter, entries: dict[str, TensorInfo]
) -> LowRank:
    """The change of one target, its layout found from the base's shape."""
    a, b = entries[target.a].shape, entries[target.b].shape
    shape = info.shape
    where = f"{target.a} {list(a)} and {target.b} {list(b)} of {adapter.path}"
    if target.layer == "embedding":  # A: r x vocab, B: dim x r
        layout, fits = "embedding", shape == (a[1], b[0])
    elif target.layer == "conv":
        kernel_ok = a[2:] == shape[2:] and all(k == 1 for k in b[2:])
        layout, fits = "conv", len(shape) == len(a) and shape[:2] == (b[0], a[1]) and kernel_ok
    elif (
        len(shape) == 2
        and shape == (b[0], a[1])
        and not (target.fan_in_fan_out and shape == (a[1], b[0]))
    ):
        layout, fits = "linear", True
    else:  # GPT-2's Conv1D keeps its weight in x out (peft's fan_in_fan_out)
        layout, fits = "linear_t", shape == (a[1], b[0])
    if not fits:
        raise AdapterError(
            f"{where} do not fit base tensor {target.module}.weight {list(shape)}",
            "is this the base the adapter was trained on? (rank or shape mismatch)",
        )
    if target.magnitude is not None:
        out = shape[1] if layout in ("linear_t", "embedding") else shape[0]
        if entries[target.magnitude].numel != out:
            raise AdapterError(
                f"{target.magnitude} of {adapter.path} has {entries[target.magnitude].numel} "
                f"values for {out} output rows of {target.module}.weight",
                "the adapter does not belong to this base",
            )
        if adapter.weight != 1.0:
            raise AdapterError(
                f"{adapter.path} is DoRA, whose rescaling a weight other than 1 would not "
                "scale (peft's add_weighted_adapter refuses it too)",
                "merge it with weight 1",
            )
    return LowRank(target.a, target.b, target.scale * adapter.weight, layout, target.magnitude)


def bind(
    base: dict[str, TensorInfo], adapters: list[Adapter], component: str | None = None
) -> dict[str, list[tuple[Adapter, Change]]]:
    """Each base key an adapter changes -> its changes, in adapter order; ``component``: the
    base is that diffusers pipeline component (a kohya LoRA brings only its modules).

    Raises:
        AdapterError: a missing base key, a shape or rank that does not fit, a quantized base,
            or a weight on a change that cannot be weighted.
    """
    changes: dict[str, list[tuple[Adapter, Change]]] = {}
    for adapter in adapters:
        adapter.bind(list(base), component)  # each kind names its targets as the base does
        entries = dict(adapter.source.entries())
        names = _prefix_map(adapter.base_keys(), base, adapter)
        for name, adapter_key in adapter.replaced.items():
            key = names[name]
            _unweighted(adapter, "modules_to_save")
            if base[key].shape != entries[adapter_key].shape:
                raise AdapterError(
                    f"{adapter_key} {list(entries[adapter_key].shape)} of {adapter.path} does not "
                    f"fit base tensor {key} {list(base[key].shape)}",
                    "the adapter does not belong to this base",
                )
            changes.setdefault(key, []).append((adapter, Replace(adapter_key)))
        for target in adapter.targets:
            key = names[target.module + ".weight"]
            _check_float(key, base[key], adapter)
            changes.setdefault(key, []).append(
                (adapter, _low_rank(target, base[key], adapter, entries))
            )
            if target.bias:
                bias_key = names[target.module + ".bias"]
                if base[bias_key].shape != entries[target.bias].shape:
                    raise AdapterError(f"{target.bias} does not fit base tensor {bias_key}")
                scale = target.scale * adapter.weight
                changes.setdefault(bias_key, []).append((adapter, BiasDelta(target.bias, scale)))
        for name, (rows_key, indices) in adapter.token_rows.items():
            key = names[name]
            _unweighted(adapter, "trainable tokens")
            vocab, width = base[key].shape[0], math.prod(base[key].shape[1:])
            rows = entries[rows_key].shape
            if rows != (len(indices), width) or any(not 0 <= i < vocab for i in indices):
                raise AdapterError(
                    f"{rows_key} {list(rows)} of {adapter.path} does not fit rows "
                    f"{list(indices)} of {key} {list(base[key].shape)}",
                    "the adapter does not belong to this base",
                )
            changes.setdefault(key, []).append((adapter, TokenRows(rows_key, indices)))
    return changes


def _unweighted(adapter: Adapter, what: str) -> None:
    if adapter.weight != 1.0:
        raise AdapterError(
            f"{adapter.path} has {what}, which replace base tensors and take no weight",
            "merge it with weight 1",
        )


def _component(base: Source) -> str | None:
    """The diffusers pipeline component a base is (its folder's name in a pipeline), or None."""
    folder = getattr(base, "folder", None)
    in_pipeline = folder is not None and (Path(str(folder)).parent / "model_index.json").is_file()
    return Path(str(folder)).name if in_pipeline else None


class MergedSource(Source):
    """``base`` with ``adapters`` merged in, in order (see the module's docstring)."""

    def __init__(self, base: Source, adapters: list[Adapter]) -> None:
        super().__init__(path=base.path, format=base.format, metadata=dict(base.metadata))
        self.base, self.adapters = base, adapters
        for name in ("selected", "selected_reason", "extras", "dropped", "candidates", "globals"):
            setattr(self, name, getattr(base, name))
        self.meta = getattr(base, "meta", None)
        self.folder = getattr(base, "folder", None)
        self._entries = base.entries()
        self.changes = bind(dict(self._entries), adapters, _component(base))
        for alias, target in base.aliases().items():  # tied names are one tensor: merged alike
            if target in self.changes or alias in self.changes:
                self.changes[alias] = self.changes[target] = self.changes.get(
                    target, self.changes.get(alias, [])
                )
        # merged key -> |merged - base| / |base| (None for an all-zero base tensor)
        self.relative: dict[str, float | None] = {}

    def entries(self) -> list[tuple[str, TensorInfo]]:
        return self._entries

    def tensors_of(self, adapter: Adapter) -> Tensors:
        """``key -> fp32 tensor`` of one adapter's tensors."""
        import torch

        return lambda key: adapter.source.load(key).to(torch.float32)

    def load(self, key: str) -> torch.Tensor:
        if key not in self.changes:
            return self.base.load(key)
        import torch

        base = self.base.load(key)
        out = torch.empty(base.shape, dtype=base.dtype)
        loaders = {id(a): self.tensors_of(a) for a, _ in self.changes[key]}
        steps = [(change, loaders[id(adapter)]) for adapter, change in self.changes[key]]
        try:
            change_sq, base_sq = merge_rows(base, steps, out)
        except NotFinite as exc:
            names = ", ".join(str(a.path) for a, _ in self.changes[key])
            raise AdapterError(
                f"merging {names} into '{key}' gives {exc.value} at row {exc.row}, where the "
                "base holds a finite value; nothing was written",
                "check the adapter's lora_alpha / alpha and weight, and its factors",
            ) from None
        self.relative[key] = math.sqrt(change_sq / base_sq) if base_sq else None
        return out

    def byte_pieces(self, key: str) -> list[tuple[Location, int, int]] | None:
        return None if key in self.changes else self.base.byte_pieces(key)

    def expected_crc(self, key: str) -> int | None:
        return None if key in self.changes else self.base.expected_crc(key)

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        return None if key in self.changes else self.base.byte_span(key)

    def aliases(self) -> dict[str, str]:
        return self.base.aliases()

    def files(self) -> list[Location]:
        return self.base.files() + [f for a in self.adapters for f in a.source.files()]

    def close(self) -> None:
        for adapter in self.adapters:
            adapter.close()
        self.base.close()
