"""DeepSpeed ZeRO checkpoint folders, rebuilt into fp32 weights as DeepSpeed's ``zero_to_fp32``.

``engine.save_checkpoint(folder)`` writes ``folder/latest`` (the tag) and ``folder/<tag>/``:
``mp_rank_00_model_states.pt`` (ZeRO-1/2) or one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
per rank (ZeRO-3), and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank. The
model states hold the module in the training dtype (under ZeRO-3 only empty placeholders), the
names and shapes of the parameters, buffers, frozen parameters and ties; the optimizer states
hold each rank's flat partition of the fp32 master weights:

- ZeRO-1/2: per parameter group, the ranks' partitions laid end to end make one flat vector; the
  group's parameters follow each other in it, with optional alignment padding after each.
- ZeRO-3: every parameter is cut into ``ceil(numel / world)`` elements per rank (the last one
  padded); each rank's groups, end to end, hold its cut of every parameter in order.

So each fp32 tensor is a list of byte ranges of the optimizer files, copied as they are, never
gathered in memory. Everything is read statically; DeepSpeed's own classes in those pickles (the
ZeRO stage enum, the loss scaler) are admitted by name and never imported.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, SelectError
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.base.tree import DroppedPart, nodes, select_state_dict
from ckptkit.formats.pickles.unpickler import TensorStub
from ckptkit.storage.location import Location
from ckptkit.storage.pieces import RangeReader

if TYPE_CHECKING:
    import torch

__all__ = ["DeepSpeedSource", "DEEPSPEED_GLOBALS"]

# DeepSpeed's classes in its optimizer-states pickles: read as data, never imported.
DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)

_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL = "mp_rank_00_model_states.pt"
# The model-states entries that describe the partitioning, not the run.
_BOOKKEEPING = (
    "module",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "buffer_names",
    "lr_scheduler",
    "csr_tensor_module_names",
    "sparse_tensor_module_names",
)
SELECTS = ("fp32", "module")

Piece = tuple[Location, int, int]  # file, offset, length


@dataclass(frozen=True)
class _Part:
    """One output tensor: the byte ranges that hold it, in order, and the dtype stored there
    (``dtype`` is what the tensor becomes: buffers are widened to fp32, as zero_to_fp32 does)."""

    stored: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    storage: str


class _TorchFile:
    """One of the folder's torch files, read statically: a local one, or one at a URL (its
    directory and pickle read with ranged requests through ``reader``'s connection to it, which
    later reads its tensors' bytes)."""

    def __init__(self, path: Location, allowed: frozenset[str], reader: RangeReader) -> None:
        from ckptkit.formats.files.torchfile import scan_torch_file

        raw = reader.file(path)  # at a URL: through the connection that reads its data
        try:
            scan, self.layout, self.raw, self.readings = scan_torch_file(path, allowed, raw=raw)
        except BaseException:
            if raw is not None:
                raw.close()
            raise
        self.path, self.root = path, scan.root

    def piece(self, stub: Any, what: str) -> Piece:
        """Where a tensor's bytes lie in this file."""
        if not isinstance(stub, TensorStub) or not stub.is_contiguous:
            raise FormatError(f"{self.path} is damaged: {what} is not a plain tensor")
        base = self.layout.data_offset(stub.storage) if stub.numel else 0
        start, end = stub.byte_range()
        if base is None or (stub.numel and end > stub.storage.nbytes):
            raise FormatError(f"{self.path} is damaged: {what} does not lie in the file")
        return self.path, base + start, stub.nbytes

    def close(self) -> None:
        self.raw.close()


def _get(tree: Any, key: str, path: Location) -> Any:
    if not isinstance(tree, dict) or key not in tree:
        raise FormatError(f"{path} is not a DeepSpeed checkpoint file (no '{key}')")
    return tree[key]


def _stage_of(value: Any) -> int:
    """The ZeRO stage: an int, or DeepSpeed's ``ZeroStageEnum(n)`` record."""
    args = getattr(value, "args", None)
    if args and type(args[0]) is int:
        return args[0]
    return value if type(value) is int else -1


def _cut(pieces: list[Piece], start: int, count: int) -> list[Piece]:
    """The byte range [start, start + count) of the concatenation of ``pieces``."""
    out = []
    for path, offset, length in pieces:
        if count <= 0:
            break
        if start >= length:
            start -= length
            continue
        take = min(length - start, count)
        out.append((path, offset + start, take))
        count -= take
        start = 0
    return out


class DeepSpeedSource(Source):
    """A DeepSpeed ZeRO checkpoint folder: the fp32 master weights rebuilt as ``zero_to_fp32``
    does (``select="fp32"``, the default), or the module in its training dtype (``"module"``)."""

    def __init__(self, folder: Location, tag: Location, *, select: str | None = None) -> None:
        super().__init__(path=folder, format="deepspeed")
        if select not in (None, "", *SELECTS):
            raise SelectError(
                f"{folder} is a DeepSpeed checkpoint; --select takes {' or '.join(SELECTS)}",
                "drop --select for the fp32 master weights, or --select module",
            )
        self.tag = tag
        self._files: list[_TorchFile] = []
        self._parts: dict[str, _Part] = {}
        self._aliases: dict[str, str] = {}
        self._reader = RangeReader()
        try:
            self._read(select or "fp32")
        except BaseException:
            self.close()
            raise

    def _open(self, path: Location) -> _TorchFile:
        opened = _TorchFile(path, DEEPSPEED_GLOBALS, self._reader)
        self._files.append(opened)
        return opened

    def _read(self, select: str) -> None:
        tag = self.tag
        optim_files, osd, stage, world = self._optimizer_files()
        models = self._model_files(stage, world)
        states = models[0].root
        module = _get(states, "module", models[0].path)
        if not isinstance(module, dict):
            raise FormatError(f"{models[0].path} is not a DeepSpeed model-states file")
        params = [k for g in states.get("param_shapes") or () for k in g]
        module_dtype = next(
            (module[k].dtype for k in params if isinstance(module.get(k), TensorStub)), "float32"
        )
        sel = select_state_dict(
            states,
            lambda v: isinstance(v, TensorStub),
            lambda v: v.nbytes,
            select="module",
            source=str(models[0].path),
        )
        self.extras = {k: v for k, v in sel.extras.items() if k not in _BOOKKEEPING}
        self.extras["deepspeed"] = {
            "zero_stage": stage,
            "world_size": world,
            "tag": tag.name,
            "module_dtype": module_dtype,
            "version": states.get("ds_version"),
        }
        tensors = [n for f in optim_files for n in nodes(f.root) if isinstance(n, TensorStub)]
        self.dropped = (
            [
                DroppedPart(
                    f"optimizer states of {len(optim_files)} ranks",
                    len(tensors),
                    sum(t.nbytes for t in tensors),
                )
            ]
            if optim_files
            else []
        )
        if select == "module" or stage == 0:
            if stage == 3:
                raise SelectError(
                    f"{tag} is ZeRO-3: its module states hold only empty placeholders",
                    "drop --select module for the fp32 weights rebuilt from the partitions",
                )
            self.selected = "module"
            self.selected_reason = f"the module in {module_dtype}, chosen with --select module"
            for key, stub in module.items():
                self._add(key, models[0].piece(stub, f"tensor '{key}'"), stub)
            self._aliases = _ties_by_storage(module)
            return
        self._rebuild(stage, world, optim_files, osd, models, module)
        self.selected = "fp32"
        self.selected_reason = (
            f"the fp32 master weights, rebuilt from the ZeRO-{stage} partitions of {world} ranks "
            f"as zero_to_fp32 does; trained in {module_dtype}"
            + (", --select module for those weights" if stage < 3 else "")
        )

    def _optimizer_files(self) -> tuple[list[_TorchFile], list[dict[str, Any]], int, int]:
        """The ranks' ``*_optim_states.pt``, opened and checked: their files, their optimizer
        state dicts, the ZeRO stage and the world size."""
        tag = self.tag
        optim = sorted(
            (
                (int(m.group(1)), int(m.group(2)), p)
                for p in tag.iterdir()
                if (m := _OPTIM.fullmatch(p.name))
            ),
        )
        if any(mp for _, mp, _ in optim) or (tag / "mp_rank_01_model_states.pt").exists():
            raise FormatError(
                f"{tag} is a tensor-parallel DeepSpeed checkpoint, which ckptkit does not merge",
                "turn it into a universal checkpoint with DeepSpeed's ds_to_universal.py first",
            )
        optim_files = [self._open(p) for _, _, p in optim]
        osd = [_get(f.root, "optimizer_state_dict", f.path) for f in optim_files]
        stage = _stage_of(osd[0].get("zero_stage")) if osd else 0
        if stage not in (0, 1, 2, 3):
            raise FormatError(f"{optim_files[0].path} records no ZeRO stage DeepSpeed writes")
        ranks = [rank for rank, _, _ in optim]
        world = len(optim_files) or 1
        if osd:
            count = osd[0].get("partition_count")
            count = max(count) if isinstance(count, list) and count else count
            if ranks != list(range(len(ranks))) or count != world:
                raise FormatError(
                    f"{tag} holds optimizer states of ranks {ranks} but the run had {count}",
                    "a rank's *_optim_states.pt is missing: copy the whole folder again",
                )
        return optim_files, osd, stage, world

    def _model_files(self, stage: int, world: int) -> list[_TorchFile]:
        """The model-states files, opened: one, or under ZeRO-3 one per rank."""
        tag = self.tag
        model_paths = (
            [tag / _MODEL]
            if stage < 3
            else [tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
        )
        for path in model_paths:
            if not path.is_file():
                raise FormatError(f"{tag} is missing {path.name}", "copy the whole folder again")
        return [self._open(p) for p in model_paths]

    def _add(self, key: str, piece: Piece | list[Piece], stub: Any, dtype: str = "") -> None:
        pieces = tuple(piece) if isinstance(piece, list) else (piece,)
        self._parts[key] = _Part(
            stub.dtype, dtype or stub.dtype, tuple(stub.shape), pieces, f"ds:{key}"
        )

    def _rebuild(
        self,
        stage: int,
        world: int,
        optim_files: list[_TorchFile],
        osd: list[Any],
        models: list[_TorchFile],
        module: dict[str, Any],
    ) -> None:
        states = models[0].root
        group_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        groups = [
            [f.piece(t, f"{group_key}[{i}]") for i, t in enumerate(_get(o, group_key, f.path))]
            for f, o in zip(optim_files, osd, strict=True)
        ]
        master = {"float32"} | {
            t.dtype for o in osd for t in o[group_key] if isinstance(t, TensorStub)
        }
        if len(master) != 1:
            raise FormatError(f"{self.tag} holds master weights in {sorted(master)}, not fp32")
        shapes = states.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise FormatError(f"{models[0].path} is not a DeepSpeed model-states file")
        rebuilt: dict[str, list[Piece]] = {}
        if stage == 3:
            rebuilt = _zero3(groups, shapes, world, self.tag)
        else:
            paddings = osd[0].get("param_alignment_paddings")
            rebuilt = _zero12(groups, shapes, world, paddings, self.tag)
        params = {k: tuple(v) for g in shapes for k, v in g.items()}
        buffers = set(states.get("buffer_names") or ())
        frozen = _frozen(states, models, stage)
        for key, stub in module.items():
            if key in rebuilt:
                self._parts[key] = _Part(
                    "float32", "float32", params[key], tuple(rebuilt[key]), f"ds:{key}"
                )
            elif key in frozen:
                self._parts[key] = frozen[key]
            elif key in buffers and isinstance(stub, TensorStub):
                widen = DTYPES[stub.dtype].kind == "float"  # zero_to_fp32 widens buffers
                self._add(
                    key, models[0].piece(stub, f"buffer '{key}'"), stub, "float32" if widen else ""
                )
        shared = states.get("shared_params") or {}
        for alias, target in shared.items():
            if target in self._parts:
                self._aliases[str(alias)] = str(target)
        # What DeepSpeed kept no copy of (frozen parameters under bf16 ZeRO-1): the module's.
        self.from_module = []
        for key, stub in module.items():
            if key in self._parts or key in self._aliases or not isinstance(stub, TensorStub):
                continue
            if stub.numel == 0 and stage == 3:
                continue  # excluded frozen parameters: a placeholder is no weight
            self._add(key, models[0].piece(stub, f"tensor '{key}'"), stub)
            self.from_module.append(key)
        if self.from_module:
            self.extras["deepspeed"]["from_module"] = self.from_module

    def entries(self) -> list[tuple[str, TensorInfo]]:
        out = []
        for key, part in self._parts.items():
            nbytes = DTYPES[part.dtype].itemsize * math.prod(part.shape)
            out.append((key, TensorInfo(part.dtype, part.shape, part.storage, (0, nbytes))))
        by_key = dict(out)
        out += [(alias, by_key[target]) for alias, target in self._aliases.items()]
        return out

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def files(self) -> list[Location]:
        return [f.path for f in self._files]

    def byte_pieces(self, key: str) -> list[Piece] | None:
        part = self._parts[self._aliases.get(key, key)]
        return list(part.pieces) if part.stored == part.dtype else None

    def byte_span(self, key: str) -> Piece | None:
        pieces = self.byte_pieces(key)
        return pieces[0] if pieces is not None and len(pieces) == 1 else None

    def load(self, key: str) -> torch.Tensor:
        import torch

        from ckptkit.formats.base.tensors import as_bytes, torch_dtype

        part = self._parts[self._aliases.get(key, key)]
        numel = math.prod(part.shape)
        out = torch.empty(numel, dtype=torch_dtype(part.stored))
        if numel:
            self._reader.read(part.pieces, as_bytes(out))  # memory shared with ``out``
        return out.to(torch_dtype(part.dtype)).reshape(part.shape)

    def close(self) -> None:
        self._reader.close()
        for opened in self._files:
            opened.close()


def _ties_by_storage(module: dict[str, Any]) -> dict[str, str]:
    first: dict[tuple[Any, ...], str] = {}
    ties = {}
    for key, stub in module.items():
        if not isinstance(stub, TensorStub) or not stub.numel:
            continue
        ident = (stub.storage.key, stub.byte_range(), stub.shape)
        if ident in first:
            ties[key] = first[ident]
        else:
            first[ident] = key
    return ties


def _zero12(
    groups: list[list[Piece]],
    shapes: list[dict[str, Any]],
    world: int,
    paddings: Any,
    tag: Location,
) -> dict[str, list[Piece]]:
    """ZeRO-1/2: each group's partitions end to end; parameters one after another."""
    out: dict[str, list[Piece]] = {}
    for g, shape_map in enumerate(shapes):
        flat = [rank_groups[g] for rank_groups in groups]  # one piece per rank
        avail = sum(length for _, _, length in flat) // 4
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        if pads is not None and len(pads) != len(shape_map):
            raise FormatError(f"{tag} records {len(pads)} paddings for {len(shape_map)} params")
        offset = 0
        for i, (name, shape) in enumerate(shape_map.items()):
            numel = math.prod(shape)
            out[str(name)] = _cut(flat, offset * 4, numel * 4)
            offset += numel + (pads[i] if pads is not None else 0)
        align = 2 * world  # zero_to_fp32's consistency check
        if _align(offset, align) != _align(avail, align):
            raise FormatError(
                f"{tag} is inconsistent: group {g} holds {avail} elements, its parameters {offset}",
                "the folder mixes files of different runs; copy it again",
            )
    return out


def _zero3(
    groups: list[list[Piece]], shapes: list[dict[str, Any]], world: int, tag: Location
) -> dict[str, list[Piece]]:
    """ZeRO-3: each parameter's cut at the same offset on every rank, the padding dropped."""
    out: dict[str, list[Piece]] = {}
    per_rank = sum(length for _, _, length in groups[0]) // 4
    offset = 0
    for shape_map in shapes:
        for name, shape in shape_map.items():
            numel = math.prod(shape)
            cut = math.ceil(numel / world)
            pieces = [p for rank in groups for p in _cut(rank, offset * 4, cut * 4)]
            out[str(name)] = _cut(pieces, 0, numel * 4)
            offset += cut
    if offset != per_rank or any(sum(p[2] for p in g) // 4 != per_rank for g in groups):
        raise FormatError(
            f"{tag} is inconsistent: the ranks hold {per_rank} elements each, "
            f"the parameters need {offset}",
            "the folder mixes files of different runs; copy it again",
        )
    return out


def _frozen(states: dict[str, Any], models: list[_TorchFile], stage: int) -> dict[str, _Part]:
    """Frozen parameters: whole in the model states (ZeRO-1/2), cut per rank (ZeRO-3)."""
    shapes = states.get("frozen_param_shapes") or {}
    out = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        found = [(m, (m.root.get("frozen_param_fragments") or {}).get(name)) for m in models]
        frags = [(m, f) for m, f in found if isinstance(f, TensorStub)]
        if len(frags) != len(found):
            raise FormatError(f"{models[0].path} records no fragment of frozen '{name}'")
        dtype = frags[0][1].dtype
        pieces = [m.piece(f, f"frozen '{name}'") for m, f in frags]
        size = DTYPES[dtype].itemsize * math.prod(shape)
        out[str(name)] = _Part(dtype, dtype, shape, tuple(_cut(pieces, 0, size)), f"ds:{name}")
    return out


def _align(value: int, to: int) -> int:
    return to * math.ceil(value / to)
