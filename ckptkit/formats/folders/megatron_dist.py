"""A model in Megatron's names, one rank's (a merged save, or a Hugging Face model mapped back
by a pack), as megatron-core's ``torch_dist`` save holds it: what ``convert --to
megatron-dist`` writes. The save is parallelism-free (DCP: each tensor whole, any run loads
its own slices), so only the names and stacking change:

- a transformer block's layers stacked on a first dim, ``decoder.layers.NAME`` of shape
  ``[layers, ...]``, and a layer's experts on a second, ``decoder.layers.mlp.experts.experts.
  NAME`` of shape ``[layers, experts, ...]``, as megatron-core's ``sharded_state_dict`` names
  them;
- the local layer spec's norms under TransformerEngine's names (its
  ``sharded_state_dict_keys_map``: ``input_layernorm`` as ``linear_qkv.layer_norm_``,
  ``pre_mlp_layernorm`` as ``linear_fc1.layer_norm_``);
- each layer module's ``_extra_state`` as the ``[None]`` object megatron-core saves for it
  (``KEY/shard_L_N``; ``KEY/shard_L.E_N.M`` for an expert's), so that a strict load finds it;
- beside them ``common.pt`` (the args, ``checkpoint_version``, the iteration) and
  ``metadata.json``.

A stacked tensor is the layers' tensors end to end: a layout over the source's files, written
from views of them, without torch.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError
from ckptkit.formats.base.laid import Laid, SpanViews
from ckptkit.formats.base.layout import Layout, stack
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.folders.megatron import EXPERT, EXTRA_STATE, LAYER
from ckptkit.formats.folders.megatron_ranks import (
    iteration_names,
    layer_count,
    save_args,
    saved_iteration,
    saved_root,
    written_args,
)
from ckptkit.storage.location import Location

if TYPE_CHECKING:
    import torch

__all__ = ["MegatronDist", "COMMON", "METADATA_JSON"]

COMMON, METADATA_JSON = "common.pt", "metadata.json"
# metadata.json: how megatron-core's dist_checkpointing finds the save's backend.
_BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# The local spec's norms as its sharded_state_dict names them (TransformerEngine's names).
_DIST_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_EXTRA_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class MegatronDist(Source):
    """``inner``'s tensors under a ``torch_dist`` save's names, the layers (and experts)
    stacked; each of this Source's keys one tensor of the save."""

    def __init__(self, inner: Source) -> None:
        super().__init__(path=inner.path, format=inner.format)
        self.inner = inner
        self.made_once = True  # type: ignore[misc]  # made from views, checked by CRC-32
        self.selected, self.selected_reason = inner.selected, inner.selected_reason
        self.extras, self.dropped, self.followed = inner.extras, inner.dropped, inner.followed
        args = save_args(inner)
        self.iteration = saved_iteration(inner)
        self.folder_name, self.tracker = iteration_names(self.iteration)
        impl = args.get("transformer_impl")
        te_moe = impl == "transformer_engine" and any(EXPERT.fullmatch(k) for k in inner.keys())
        # Each key of the save: the source keys it stacks (one for a tensor not stacked).
        self._members: dict[str, list[str]] = {}
        self._infos: dict[str, TensorInfo] = {}
        layers = layer_count(inner, args)
        stacked: dict[str, dict[int, dict[int | None, str]]] = {}
        for key in inner.keys():
            found = LAYER.fullmatch(key)
            if found is None:
                self._members[key] = [key]
                continue
            rest = _dist_name(found[2], impl, te_moe)
            expert = EXPERT.fullmatch(f"decoder.layers.{found[1]}.{rest}")
            if expert is None:
                name, number = f"decoder.layers.{rest}", None
            else:
                tail = expert[3]
                name, number = f"decoder.layers.mlp.experts.experts.{tail}", int(expert[2])
            stacked.setdefault(name, {}).setdefault(int(found[1]), {})[number] = key
        for name, by_layer in stacked.items():
            if sorted(by_layer) != list(range(layers)):
                raise FormatError(
                    f"{inner.path}: '{name}' is held by layers {sorted(by_layer)[:8]}, not by "
                    f"each of the {layers} layers, as a torch_dist save stacks it",
                    "convert a model whose layers are alike (a legacy save keeps them apart)",
                )
            experts = [sorted(by_layer[layer], key=lambda n: -1 if n is None else n)
                       for layer in range(layers)]  # fmt: skip
            if any(e != experts[0] for e in experts) or (
                None not in experts[0] and experts[0] != list(range(len(experts[0])))
            ):
                raise FormatError(
                    f"{inner.path}: the layers hold different experts of '{name}'",
                    "convert a model whose layers are alike",
                )
            self._members[name] = [
                by_layer[layer][number] for layer in range(layers) for number in experts[0]
            ]
        for name, members in self._members.items():
            infos = [inner.info(m) for m in members]
            first = infos[0]
            if any(
                (i.dtype, i.shape, i.kind) != (first.dtype, first.shape, "dense") for i in infos
            ):
                raise FormatError(
                    f"{inner.path}: the tensors stacked as '{name}' differ in dtype or shape",
                    "convert a model whose layers are alike",
                )
            shape = first.shape
            if name in stacked:
                per_layer = len(members) // layers
                lead = (layers, per_layer) if ".experts.experts." in name else (layers,)
                shape = (*lead, *first.shape)
            self._infos[name] = TensorInfo(first.dtype, tuple(shape))
        self._stacked = set(stacked)
        self.extra_objects = _extra_objects(stacked, layers)
        self.args, _ = written_args(inner, args, {})
        self.documents = {}
        self._views = SpanViews()
        self._laid: tuple[str, Laid | None] | None = None

    def describe(self) -> dict[str, Any]:
        """What the save holds beside its tensors, for the report."""
        return {
            "torch_dist": True,
            "iteration": "release" if self.iteration is None else self.iteration,
            "beside": list(self.common()),
            "objects": len(self.extra_objects),
        }

    def common(self) -> dict[str, Any]:
        """What ``common.pt`` holds, in megatron-core's order."""
        root = saved_root(self.args, self.iteration, self.inner)
        root["content_metadata"] = {
            "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
        }
        return root

    @staticmethod
    def backend() -> str:
        """``metadata.json``'s text."""
        return json.dumps(_BACKEND)

    def entries(self) -> list[tuple[str, TensorInfo]]:
        return list(self._infos.items())

    def byte_pieces(self, key: str) -> list[tuple[Location, int, int]] | None:
        members = self._members[key]
        if key not in self._stacked:
            return self.inner.byte_pieces(members[0])
        pieces: list[tuple[Location, int, int]] = []
        for member in members:
            found = self.inner.byte_pieces(member)
            if found is None or len(found) > 4 or len(pieces) > 64:
                return None  # many small ranges: written from views
            pieces += found
        return pieces

    def laid_out(self, key: str) -> Laid | None:
        if key not in self._stacked:
            return self.inner.laid_out(self._members[key][0])
        if self._laid is not None and self._laid[0] == key:
            return self._laid[1]
        spans: list[Any] = []
        layouts: list[Layout] = []
        laid: Laid | None = None
        for member in self._members[key]:
            one = self.inner.laid_out(member)
            if one is None:
                break
            layouts.append(one.layout.moved(len(spans)))
            spans += one.spans
        else:
            info = self._infos[key]
            flat = stack(layouts)
            laid = Laid(spans, Layout(info.shape, flat.itemsize, flat.pieces))
        self._laid = (key, laid)
        return laid

    def made_pieces(self, key: str) -> list[memoryview] | None:
        if key not in self._stacked:
            return self.inner.made_pieces(self._members[key][0])
        laid = self.laid_out(key)
        return None if laid is None else self._views.of(laid)

    def load(self, key: str) -> torch.Tensor:
        import torch

        members = self._members[key]
        if key not in self._stacked:
            return self.inner.load(members[0])
        tensors = [self.inner.load(m) for m in members]
        return torch.stack(tensors).reshape(self._infos[key].shape)

    def files(self) -> list[Location]:
        return self.inner.files()

    def close(self) -> None:
        self._views.close()


def _dist_name(rest: str, impl: Any, te_moe: bool) -> str:
    """A layer's key as megatron-core's sharded state dict names it (the local spec's norms
    under TransformerEngine's names; TransformerEngine's own spec keeps pre_mlp_layernorm
    apart before experts)."""
    for local, dist in _DIST_NAMES.items():
        if rest.startswith(local) and not (te_moe and local == "pre_mlp_layernorm."):
            return dist + rest.removeprefix(local)
    return rest


def _extra_objects(stacked: dict[str, Any], layers: int) -> list[str]:
    """The ``_extra_state`` objects megatron-core's layer modules save, one per layer (and
    expert), named as its ShardedObjects are: ``KEY/shard_L_N`` (``shard_L.E_N.M``)."""
    names = []
    for name, by_layer in stacked.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("weight",) or not module.endswith(_EXTRA_MODULES):
            continue
        experts = [n for n in by_layer[0] if n is not None]
        for layer in range(layers):
            if not experts:
                names.append(f"{module}{EXTRA_STATE}/shard_{layer}_{layers}")
            for e in experts:
                names.append(f"{module}{EXTRA_STATE}/shard_{layer}.{e}_{layers}.{len(experts)}")
    return names
