"""One ``torch.save`` per rank of a sharded model, merged into full tensors without loading.

Trainers that shard a model often save each rank's ``model.state_dict()`` with ``torch.save``:
``model_rank0.pt``, ``model_world_size_2_rank_1.pt``, ``pytorch_model_fsdp_0_rank1.bin``. Its
values are FSDP2's DTensors, each holding this rank's shard and where that shard lies, which is
read here as data: the classes are admitted by name and never imported, nothing is executed.
FSDP1's ``SHARDED_STATE_DICT`` saves ShardedTensors the same way.

- A DTensor records its placements and this rank's mesh coordinate. ``Shard(d)`` on a mesh
  dimension of ``n`` ranks puts coordinate ``c``'s piece at ``c * ceil(N / n)`` along ``d``
  (``torch.chunk``'s rule, the one ``fully_shard`` and ``distribute_tensor`` use); ``n`` is
  the highest coordinate seen plus one, so a missing last rank leaves a gap that is refused.
  ``Replicate`` repeats the piece (the first rank's copy is read). Partial sums and strided
  shards are refused.
- A ShardedTensor (FSDP1) records each local shard's offsets and sizes outright. Its pickle
  names ``ShardedTensor.ProcessGroupState`` through ``builtins.getattr(ShardedTensor, ...)``,
  which the static reader resolves to that nested class's name (nothing is called); this
  reader admits that one use. ``torch.load`` of these files needs a process group.
- A plain tensor is taken as replicated: every rank holds all of it.

The pieces are chunks of the full tensor (``formats.chunks``): row shards are copied as bytes.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ckptkit.errors import FormatError
from ckptkit.formats.folders.chunks import Chunk, ChunkedSource, ChunkedTensor, check_cover
from ckptkit.formats.pickles.machine import Opaque, build_state, fields
from ckptkit.formats.pickles.unpickler import SHARDED_KINDS, TensorStub, UnsupportedTensor
from ckptkit.storage.location import Location, by_name, local_path

__all__ = [
    "RankFilesSource",
    "find_rank_files",
    "one_rank_error",
    "one_rank_refusal",
    "RANK_GLOBALS",
]

_DT = "torch.distributed.tensor."
# The classes a rank file's DTensors pickle, read as data and never imported.
RANK_GLOBALS = frozenset(
    {
        _DT + "DTensor",
        _DT + "_dtensor_spec.DTensorSpec",
        _DT + "_dtensor_spec.TensorMeta",
        _DT + "_dtensor_spec.ShardOrderEntry",
        _DT + "placement_types.Shard",
        _DT + "placement_types.Replicate",
        _DT + "placement_types.Partial",
        _DT + "placement_types._StridedShard",
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed._mesh_layout._MeshLayout",
        "torch.distributed._mesh_layout._FlatLayout",
    }
)

_ST = "torch.distributed._shard."
# What an FSDP1 ShardedTensor pickles, read as data and never imported.
SHARDED_TENSOR_GLOBALS = frozenset(
    {
        _ST + "sharded_tensor.api.ShardedTensor",
        _ST + "sharded_tensor.api.ShardedTensor.ProcessGroupState",
        _ST + "sharded_tensor.shard.Shard",
        _ST + "sharded_tensor.metadata.ShardedTensorMetadata",
        _ST + "sharded_tensor.metadata.TensorProperties",
        _ST + "sharded_tensor.metadata.MEM_FORMAT_ENCODING",
        _ST + "metadata.ShardMetadata",
        _ST + "sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
        "torch.distributed.remote_device._remote_device",
        # Only ever resolved to ShardedTensor.ProcessGroupState above: getattr on any other
        # global names a global outside this set, which is refused.
        "builtins.getattr",
    }
)

_RANK = re.compile(r"(.*?rank_?)(\d+)(\.(?:pt|pth|bin))")
_WILDCARDS = "*?["


def find_rank_files(path: Location) -> tuple[Location, list[Location]] | None:
    """The rank files a path stands for, in rank order: a glob (``ckpt/model_rank*.pt``) or a
    folder holding one set of them (and nothing else ckptkit reads). None when it is neither.

    Raises:
        FormatError: the glob matches nothing, or the folder holds several sets.
    """
    if any(c in path.name for c in _WILDCARDS) and not path.exists():
        files = by_name(p for p in path.parent.glob(path.name) if p.is_file())
        if not files:
            raise FormatError(f"{path} matches no file", "check the folder and the pattern")
        return path, sorted(files, key=_rank_of)
    if not path.is_dir():
        return None
    groups: dict[str, list[Location]] = {}
    for p in by_name(path.iterdir()):
        match = _RANK.fullmatch(p.name)
        if match and p.is_file():
            groups.setdefault(f"{match[1]}*{match[3]}", []).append(p)
    if len(groups) > 1:
        names = ", ".join(sorted(groups))
        raise FormatError(
            f"{path} holds several sets of rank files ({names})",
            f"give one set as a glob, e.g. '{path / sorted(groups)[0]}'",
        )
    return (path, sorted(*groups.values(), key=_rank_of)) if groups else None


def _rank_of(path: Location) -> tuple[int, str]:
    match = _RANK.fullmatch(path.name)
    return (int(match[2]) if match else -1, path.name)


class _Piece:
    """One file's part of a tensor: its local tensor and where that lies."""

    def __init__(self, file: Location, stub: TensorStub, base: int | None, key: str) -> None:
        if base is None or not stub.is_contiguous:
            raise FormatError(
                f"{file} stores its part of '{key}' compressed or strided, which ckptkit "
                "cannot copy",
                "load the files with torch and save a full state dict",
            )
        start, end = stub.byte_range()
        if stub.numel and end > stub.storage.nbytes:
            raise FormatError(f"{file} is damaged: '{key}' runs past its storage", "copy it again")
        self.file, self.stub, self.at = file, stub, base + start
        self.offsets: tuple[int, ...] = (0,) * len(stub.shape)
        self.coordinate: tuple[int, ...] = ()
        self.shard_dims: list[tuple[int, int]] = []  # (mesh dim, tensor dim)
        self.plain = False  # a plain tensor: every rank's copy of it, to be checked equal
        self.crc: int | None = None  # the zip's CRC-32 of its bytes, when the member is just it


class RankFilesSource(ChunkedSource):
    """Every rank's ``torch.save`` of a sharded state dict, read as one checkpoint.

    Args:
        where: what the user named (the folder or the glob), for messages.
        files: the rank files, in rank order.
    """

    def __init__(
        self,
        where: Location,
        files: list[Location],
        *,
        select: str | None = None,
        ema: bool = False,
    ) -> None:
        super().__init__(where, "rank files")
        self._files = files

        def build() -> Any:
            roots, parts = self._read(files)
            return _rebuild(roots[0], (), self._merge(parts))

        self._adopt_tree(build, select=select, ema=ema)

    def _read(self, files: list[Location]) -> tuple[list[Any], list[dict[tuple[str, ...], Any]]]:
        """Each file's pickle, and its tensors by path: (full shape, dtype, its pieces)."""
        from ckptkit.formats.files.torchfile import scan_torch_file

        roots, parts = [], []
        for file in files:
            at_url = self._reader.file(file)  # at a URL: the connection that reads its data
            try:
                scan, layout, raw, _ = scan_torch_file(
                    file, RANK_GLOBALS | SHARDED_TENSOR_GLOBALS, raw=at_url
                )
            except BaseException:
                if at_url is not None:
                    at_url.close()
                raise
            try:
                found: dict[tuple[str, ...], Any] = {}
                for path, leaf in _leaves(scan.root, ()):
                    found[path] = self._pieces(file, ".".join(path), leaf, layout)
            finally:
                raw.close()
            roots.append(scan.root)
            parts.append(found)
        return roots, parts

    def _pieces(self, file: Location, key: str, leaf: Any, layout: Any) -> Any:
        """(full shape, dtype, pieces) of one value of one rank's file."""

        def piece(stub: Any) -> _Piece:
            if not isinstance(stub, TensorStub):
                raise FormatError(f"{file} holds no local tensor for '{key}'", "copy it again")
            return _Piece(file, stub, layout.data_offset(stub.storage), key)

        if isinstance(leaf, TensorStub):
            plain = piece(leaf)
            plain.plain = True
            if leaf.byte_range() == (0, leaf.storage.nbytes):
                plain.crc = layout.member_crc(leaf.storage)
            return leaf.shape, leaf.dtype, [plain]
        if key.endswith("flat_param"):
            raise FormatError(
                f"{file} holds FSDP's flat parameter '{key}' (LOCAL_STATE_DICT): the shapes of "
                "the parameters inside it are not in the file",
                "save with StateDictType.SHARDED_STATE_DICT or FULL_STATE_DICT, or with DCP",
            )
        if leaf.kind == "ShardedTensor":
            return leaf.shape, leaf.dtype, self._local_shards(file, key, leaf, piece)
        # A DTensor: its local tensor and its spec (placements, this rank's mesh coordinate).
        state = build_state(leaf.state)
        if not isinstance(state, dict):
            raise FormatError(f"{file} is damaged at '{key}' (a DTensor without its state)")
        spec = fields(state.get("_spec"))
        p = piece(state.get("_local_tensor"))
        coordinate = fields(spec.get("mesh")).get("_coordinate_on_dim")
        if not isinstance(coordinate, tuple) or not all(type(c) is int for c in coordinate):
            raise FormatError(
                f"{file} records no mesh coordinate for '{key}' (a rank outside the mesh)",
                "give only the files of the ranks that hold the model",
            )
        p.coordinate = coordinate
        placements = spec.get("placements") or ()
        for mesh_dim, placement in enumerate(placements):
            name = placement.global_name if isinstance(placement, Opaque) else repr(placement)
            if name.endswith(".Replicate"):
                continue
            dim = fields(placement).get("dim")
            if not name.endswith(".Shard") or type(dim) is not int:
                raise FormatError(
                    f"{file} places '{key}' as {name.rsplit('.', 1)[-1]}, which ckptkit cannot "
                    "merge",
                    "save a full state dict (get_state_dict with full_state_dict=True) or DCP",
                )
            if any(d == dim for _, d in p.shard_dims):
                raise FormatError(
                    f"{file} shards '{key}' twice along dimension {dim}, which ckptkit cannot "
                    "merge",
                    "save a full state dict (get_state_dict with full_state_dict=True) or DCP",
                )
            p.shard_dims.append((mesh_dim, dim % max(1, len(leaf.shape))))
        return leaf.shape, leaf.dtype, [p]

    @staticmethod
    def _local_shards(file: Location, key: str, leaf: Any, piece: Any) -> list[_Piece]:
        """A ShardedTensor's local shards, each with the offsets its metadata records."""
        state = leaf.state  # (local shards, metadata, process group state, spec, rrefs)
        if not isinstance(state, tuple) or not state or not isinstance(state[0], list):
            raise FormatError(f"{file} is damaged at '{key}' (a ShardedTensor without shards)")
        pieces = []
        for shard in state[0]:
            shard_fields = fields(shard)
            meta = fields(shard_fields.get("metadata"))
            offsets, sizes = meta.get("shard_offsets"), meta.get("shard_sizes")
            p = piece(shard_fields.get("tensor"))
            if (
                not isinstance(offsets, list)
                or len(offsets) != len(leaf.shape)
                or not all(type(o) is int and o >= 0 for o in offsets)
                or list(p.stub.shape) != sizes
            ):
                raise FormatError(
                    f"{file} is damaged at '{key}' (a shard's metadata does not fit its tensor)",
                    "copy it again",
                )
            p.offsets = tuple(offsets)
            pieces.append(p)
        return pieces

    def _merge(self, parts: list[dict[tuple[str, ...], Any]]) -> dict[tuple[str, ...], Any]:
        """Each path's full tensor, its chunks from every file (replicas read once)."""
        first = parts[0]
        for file, found in zip(self._files[1:], parts[1:], strict=True):
            if found.keys() != first.keys():
                odd = sorted(found.keys() ^ first.keys())[0]
                raise FormatError(
                    f"{file} and {self._files[0]} differ in '{'.'.join(odd)}'",
                    "give only the files of one save",
                )
        # A mesh dimension's size: the highest coordinate on it, plus one.
        mesh: dict[int, int] = {}
        for found in parts:
            for _, _, pieces in found.values():
                for p in pieces:
                    for i, c in enumerate(p.coordinate):
                        mesh[i] = max(mesh.get(i, 1), c + 1)
        tensors: dict[tuple[str, ...], Any] = {}
        for path, (shape, dtype, _) in first.items():
            key = ".".join(path)
            chunks: dict[tuple[int, ...], Chunk] = {}
            firsts: dict[tuple[int, ...], _Piece] = {}
            for found in parts:
                other_shape, other_dtype, pieces = found[path]
                if (other_shape, other_dtype) != (shape, dtype):
                    plain = pieces[0].plain
                    raise FormatError(
                        f"{pieces[0].file} holds '{key}' as {other_dtype} {list(other_shape)}, "
                        f"{self._files[0]} as {dtype} {list(shape)}"
                        + (": slices of a tensor-parallel model, not copies" if plain else ""),
                        _SLICES if plain else "give only the files of one save",
                    )
                for p in pieces:
                    offsets = list(p.offsets)
                    for mesh_dim, dim in p.shard_dims:
                        step = math.ceil(shape[dim] / mesh[mesh_dim])
                        offsets[dim] = min(p.coordinate[mesh_dim] * step, shape[dim])
                    chunk = Chunk(tuple(offsets), p.stub.shape, p.file, p.at, p.stub.nbytes)
                    if p.stub.dtype != dtype:
                        raise FormatError(f"{p.file} is damaged at '{key}' (its dtype differs)")
                    self._layouts[chunk] = (p.file, p.at, p.stub.nbytes)
                    if chunk.offsets not in chunks:
                        chunks[chunk.offsets], firsts[chunk.offsets] = chunk, p
                    elif p.plain:  # a replica, read once: but only if it is one
                        self._check_copy(key, firsts[chunk.offsets], p)
            tensor = ChunkedTensor(key, dtype, tuple(shape), list(chunks.values()))
            check_cover(self.path, tensor)
            tensors[path] = tensor
        return tensors

    def _check_copy(self, key: str, first: _Piece, other: _Piece) -> None:
        """A plain tensor of two ranks' files: copies of one tensor (data parallel), or refused.
        The files' CRC-32s tell, where they record one for just its bytes; else the bytes.

        Raises:
            FormatError: they differ: each rank holds its slice of a tensor-parallel model.
        """
        if first.crc is not None and other.crc is not None:
            same = first.crc == other.crc
        else:
            same = True
            for at in range(0, first.stub.nbytes, _COMPARE_PIECE):
                n = min(_COMPARE_PIECE, first.stub.nbytes - at)
                a, b = bytearray(n), bytearray(n)
                self._reader.read([(first.file, first.at + at, n)], memoryview(a))
                self._reader.read([(other.file, other.at + at, n)], memoryview(b))
                if a != b:
                    same = False
                    break
        if not same:
            raise FormatError(
                f"{other.file} and {first.file} hold different values for '{key}' (plain "
                "tensors of the same shape): slices of a tensor-parallel model, not copies",
                _SLICES,
            )

    def files(self) -> list[Location]:
        return list(self._files)


# Plain tensors that differ between ranks: nothing in the files says how they join.
_SLICES = (
    "ckptkit joins ranks' files when they record how they are split (DTensor, ShardedTensor); "
    "map a tensor-parallel save with --map (see docs/mapping.md)"
)
_COMPARE_PIECE = 8 << 20  # bytes of each copy held at once while two are compared


def _sharded_kind(file: Location) -> str | None:
    """The sharded tensor class a file's pickle names (DTensor, ShardedTensor), if any."""
    from ckptkit.formats.files.readings import readings

    for reading in readings(local_path(file)):  # a local file (one at a URL: its reader)
        for findings in reading.pickles:
            for g in findings.globals:
                kind = next((k for k in SHARDED_KINDS if g.endswith("." + k)), None)
                if kind is not None:
                    return kind
    return None


def one_rank_error(file: Location) -> FormatError | None:
    """The error for one rank's file of a sharded save given alone (None: it is not one)."""
    kind = _sharded_kind(file)
    return one_rank_refusal(file, kind) if kind is not None else None


def one_rank_refusal(file: Location, kind: str = "DTensor") -> FormatError:
    """The error for one rank's file of a sharded save, naming how to give the set."""
    match = _RANK.fullmatch(file.name)
    pattern = file.parent / (f"{match[1]}*{match[3]}" if match else f"*{file.suffix}")
    return FormatError(
        f"{file} is one rank's part of a sharded save ({kind}s)",
        f"give every rank's file: their folder, or a glob such as '{pattern}'",
    )


def _leaves(node: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    """The tensors of a rank file's tree (nested dicts), by path."""
    if isinstance(node, TensorStub) or (
        isinstance(node, UnsupportedTensor) and node.kind in SHARDED_KINDS
    ):
        return [(path, node)]
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, (*path, str(k)))]
    return []


def _rebuild(node: Any, path: tuple[str, ...], tensors: dict[tuple[str, ...], Any]) -> Any:
    """The first rank's tree with its tensors replaced by the merged ones."""
    if path in tensors:
        return tensors[path]
    if isinstance(node, dict):
        return {str(k): _rebuild(v, (*path, str(k)), tensors) for k, v in node.items()}
    return node
