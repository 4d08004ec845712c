"""Megatron-LM's checkpoints (megatron-core's GPT models), read without Megatron: every
tensor-parallel and pipeline-parallel shard of a legacy save merged into the model's tensors
as one rank would hold them, in Megatron's own names, from the files' headers alone.

A run folder holds ``latest_checkpointed_iteration.txt`` (an iteration, or ``release``) and
one folder per saved iteration, ``iter_0000010`` (``release`` for a release). Saved with
``--ckpt-format torch`` (legacy), that folder holds ``mp_rank_TT/model_optim_rng.pt`` per
tensor-parallel rank TT (``mp_rank_TT_PPP`` with pipeline stages; ``model_rng.pt`` without the
optimizer), each a ``torch.save`` of ``{"args": Namespace, "iteration", "checkpoint_version",
"model": state dict, ...}``; with ``--ckpt-format torch_dist`` it is a DCP folder (read by
``dcp.py``). How the ranks' pieces join follows megatron-core's layers (Megatron's own rules,
``docs/formats/megatron.md``):

- column-parallel weights (the fused ``linear_qkv``, ``linear_fc1``, the vocab-parallel
  ``word_embeddings`` and ``output_layer``) are cut along dim 0; a SwiGLU ``linear_fc1``
  holds each rank's ``[gate_r; up_r]``, which join as ``[gate; up]``;
- row-parallel weights (``linear_proj``, ``linear_fc2``) along dim 1;
- the rest (norms, row-parallel biases, learned positions) is the same on every rank, and
  checked so;
- a pipeline stage numbers its layers from 0: each is moved past the layers of the stages
  before it;
- ``_extra_state`` entries (TransformerEngine's FP8 state, None without it) are left out,
  named. With tensor parallelism a key no rule knows is refused by name (with one rank,
  every key is taken as it is).
- the ranks' files are one save's: the same iteration, each rank's own slice (a copied or
  linked rank folder is refused), each stage's tensors where Megatron puts them.

The merged tensors are chunks of their full tensors (``chunks.py``), so a row-parallel
weight is written from views of its ranks' columns and the rest is copied as it lies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptkit.errors import FormatError, SelectError, UnsafeCheckpointError
from ckptkit.formats.files.torchfile import scan_torch_file
from ckptkit.formats.folders.chunks import Chunk, ChunkedSource, ChunkedTensor, check_cover
from ckptkit.formats.folders.dcp import DCPSource
from ckptkit.formats.pickles.machine import Opaque, fields
from ckptkit.formats.pickles.unpickler import TensorStub
from ckptkit.meta import jsonable
from ckptkit.storage.bytecopy import same_bytes
from ckptkit.storage.location import Location, head, is_local, local_path, url_file
from ckptkit.storage.pieces import RangeReader

__all__ = [
    "LATEST",
    "MegatronSave",
    "MegatronSource",
    "MegatronDistSource",
    "find_megatron",
    "megatron_rank_refusal",
]

LATEST = "latest_checkpointed_iteration.txt"
_ITERATION = re.compile(r"iter_(\d{7,12})|release")
# mp_rank_TT, then _PPP with pipeline stages, then _EEE with expert parallelism (so that
# mp_rank_TT_NNN is a stage or an expert rank, as the args say).
_RANK_DIR = re.compile(r"mp_rank_(\d{2,4})(?:_(\d{3}))?(?:_(\d{3}))?")
_RANK_FILES = ("model_optim_rng.pt", "model_rng.pt")
_MOST_RANKS = 4096
_MOST_TRACKER = 64  # bytes of latest_checkpointed_iteration.txt: an iteration number
_MOST_LAYERS = 1_000_000
LAYER = re.compile(r"decoder\.layers\.(\d{1,7})\.(.+)")

# How megatron-core's layers cut a tensor across tensor-parallel ranks, by the key's ending.
COLUMNS = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "linear_fc1.weight",  # a dense MLP's, and each expert's
    "linear_fc1.bias",
)
ROWS = ("self_attention.linear_proj.weight", "linear_fc2.weight")
SAME = (
    "layernorm.weight",
    "layernorm.bias",
    "layer_norm_weight",  # TransformerEngine's norm fused into the next linear
    "layer_norm_bias",
    "self_attention.linear_proj.bias",
    "linear_fc2.bias",
    "embedding.position_embeddings.weight",
    "q_layernorm.weight",
    "k_layernorm.weight",
    "mlp.router.weight",  # a mixture of experts' router: on every rank
    "mlp.router.expert_bias",
)
GLU = ("linear_fc1.weight", "linear_fc1.bias")  # SwiGLU's [gate; up] under tensor parallelism
# An expert parallel rank's experts, numbered from 0 on each: made global when merged.
EXPERT = re.compile(r"(.+\.mlp\.experts\.local_experts\.)(\d{1,6})\.(.+)")
# Grouped-GEMM experts (--moe-grouped-gemm: TEGroupedMLP's weightN, the legacy GroupedMLP's
# weight1/weight2): every expert of a rank in numbered or fused tensors, not merged yet.
GROUPED = re.compile(r".*\.mlp\.experts\.(?:linear_fc[12]\.(?:weight|bias)\d+|weight[12])")
EXTRA_STATE = "._extra_state"


@dataclass(frozen=True)
class MegatronSave:
    """One saved iteration of a Megatron run: its folder, how it was found, and its kind."""

    folder: Location
    reason: str
    kind: str  # "legacy" (mp_rank_* files) or "torch_dist" (a DCP folder)


def find_megatron(path: Location) -> MegatronSave | None:
    """The iteration a Megatron run folder's ``latest_checkpointed_iteration.txt`` names (said
    in the report), or an iteration folder itself; None for any other folder.

    Raises:
        FormatError: a run folder whose tracker names no saved iteration.
    """
    if not path.is_dir():
        return None
    tracker = path / LATEST
    local = local_path(tracker) if is_local(path) else None
    if (local is not None and local.is_symlink()) or tracker.exists():
        if not tracker.is_file():
            raise FormatError(
                f"{tracker} is not a file", "name an iteration folder (iter_NNNNNNN) instead"
            )
        data = head(tracker, _MOST_TRACKER + 1)  # a tracker is a number: never read whole
        text = data.decode("ascii", "replace").strip()
        if text == "release":
            name = "release"
        elif len(data) <= _MOST_TRACKER and text.isascii() and text.isdigit() and len(text) <= 12:
            name = f"iter_{int(text):07d}"
        else:
            shown = "nothing" if not text else f"'{text[:20]}'"
            raise FormatError(
                f"{tracker} says {shown}, not an iteration number",
                "name an iteration folder (iter_NNNNNNN) instead",
            )
        folder = path / name
        if not folder.is_dir():
            raise FormatError(
                f"{path / LATEST} names iteration {text}, but {folder.name} is not there",
                "copy that iteration's folder, or name another iter_NNNNNNN folder",
            )
        found = _kind(folder)
        if found is None:
            raise FormatError(
                f"{folder} holds neither mp_rank_* folders nor a torch_dist save (.metadata "
                "and common.pt)",
                "copy that iteration's folder whole",
            )
        reason = f"{folder.name}, named by {LATEST}"
        return MegatronSave(folder, reason, found)
    found = _kind(path)
    if found is not None:
        return MegatronSave(path, f"{path.name}, the iteration folder given", found)
    saved = sorted(p.name for p in path.iterdir() if _ITERATION.fullmatch(p.name))
    if saved and any(_kind(path / name) for name in saved):
        raise FormatError(
            f"{path} holds Megatron iterations ({', '.join(saved[-3:])}) but no {LATEST} to "
            "say which is the latest",
            f"name an iteration's folder, e.g. {path / saved[-1]}",
        )
    return None


def iteration_of(name: str) -> str | None:
    """What a tracker says for an iteration folder's name (``iter_0000010``: ``10``;
    ``release``), or None for any other name."""
    found = _ITERATION.fullmatch(name)
    if found is None:
        return None
    return "release" if name == "release" else str(int(found[1]))


def megatron_rank_refusal(file: Location) -> FormatError | None:
    """The error for one rank's file of a legacy Megatron save given alone: with any
    parallelism it holds a slice of the model, and its keys need Megatron's rules either way;
    None for any other file."""
    rank = file if _RANK_DIR.fullmatch(file.name) and file.is_dir() else file.parent
    if file is not rank and file.name not in _RANK_FILES or _RANK_DIR.fullmatch(rank.name) is None:
        return None
    ranks = [p.name for p in rank.parent.iterdir() if _RANK_DIR.fullmatch(p.name)]
    what = "file" if file is not rank else "folder"
    folders = f"{len(ranks)} rank folder{'s' if len(ranks) != 1 else ''}"
    return FormatError(
        f"{file} is one rank's {what} of a Megatron save ({folders} in {rank.parent.name}): "
        "Megatron's names and wrapper, and with parallelism a slice of every weight",
        f"give the save's folder, {rank.parent}, which ckptkit reads (its ranks merged)",
    )


# megatron-core's enums (ModelType, AttnBackend), which Megatron-LM keeps in its args: read as
# data (an enum's member looked up by its value), and written back as they are.
MEGATRON_ENUM = re.compile(r"megatron\.core\.(?:[a-z_]+\.)*enums\.[A-Za-z_]\w*")


def megatron_scan(
    file: Location, allowed: tuple[str, ...], raw: Any = None
) -> tuple[Any, Any, Any, Any]:
    """A Megatron file read statically (``raw``: the file at a URL), its args' megatron-core
    enums admitted beside ``allowed`` (--allow-global); any other global outside torch's safe
    set is refused."""
    try:
        return scan_torch_file(file, allowed, raw=raw)
    except UnsafeCheckpointError as exc:
        enums = tuple(g for g in exc.globals if MEGATRON_ENUM.fullmatch(g))
        if not enums:
            raise
    return scan_torch_file(file, (*allowed, *enums), raw=raw)


def _kind(folder: Location) -> str | None:
    if not folder.is_dir():
        return None
    if (folder / ".metadata").is_file() and (folder / "common.pt").is_file():
        return "torch_dist"
    if any(_RANK_DIR.fullmatch(p.name) for p in folder.iterdir() if p.is_dir()):
        return "legacy"
    return None


@dataclass(frozen=True)
class _Rank:
    tp: int
    pp: int
    ep: int
    file: Path


class MegatronSource(ChunkedSource):
    """A legacy Megatron save: its ranks' shards merged into one rank's tensors."""

    def __init__(
        self, save: MegatronSave, *, select: str | None = None, allowed: tuple[str, ...] = ()
    ) -> None:
        super().__init__(save.folder, "megatron")
        self._allowed = allowed
        if select not in (None, "model"):
            raise SelectError(
                f"{save.folder} is a Megatron save; its model is its only state dict",
                "drop --select",
            )
        self._raws: list[Any] = []
        self._zips: dict[Path, Any] = {}  # each rank file's storage layout
        # What a legacy save of it needs again (megatron_ranks.py): the args as the pickle
        # gave them, and the _extra_state entries left out, by their merged names.
        self.args_object: Any = None
        self.extra_states: list[str] = []
        try:
            self._read(save)
        except BaseException:
            self.close()
            raise

    def _read(self, save: MegatronSave) -> None:
        named = _rank_files(save.folder)
        if not named:
            raise FormatError(f"{save.folder} holds no rank folders", "copy the save again")
        scanned = {file: self._scan(file)[0] for file in named.values()}
        first = named[min(named)]
        args = _args(scanned[first], first)
        ranks = _placed(save.folder, named, args)
        tp, pp, ep = (1 + max(getattr(r, n) for r in ranks) for n in ("tp", "pp", "ep"))
        files = {(r.tp, r.pp, r.ep): r.file for r in ranks}
        roots = {at: scanned[file] for at, file in files.items()}
        _check_args(save.folder, args, tp, pp, ep)
        for key in ("iteration", "checkpoint_version"):  # one save's files, not two saves'
            for at, root in roots.items():
                if jsonable(root.get(key)) != jsonable(roots[0, 0, 0].get(key)):
                    raise FormatError(
                        f"{files[at]} is of {key} {jsonable(root.get(key))!r}, rank 0's of "
                        f"{jsonable(roots[0, 0, 0].get(key))!r}",
                        "the folder mixes two saves; copy it again",
                    )
        vp = _virtual_stages(roots[0, 0, 0], files[0, 0, 0], args)
        chunks = [(v, stage) for v in range(vp) for stage in range(pp)]
        pieces, stage_of, offset = self._gather(save, roots, files, (tp, pp, ep, vp))
        said = args.get("num_layers")
        if isinstance(said, int) and not isinstance(said, bool) and said != offset:
            raise FormatError(
                f"{save.folder}'s stages hold {offset} layers, but its args say num_layers {said}",
                "copy every rank's folder of the save",
            )
        swiglu = bool(args.get("swiglu"))
        tied_copy = _tied_copy(args, pp, pieces)
        for name, parts in pieces.items():
            self._tensors[name] = self._merge(name, parts, tp, swiglu)
        if tied_copy:
            self._drop_tied_copy(save.folder)
        _check_mlp(save.folder, self._tensors, args)
        _check_experts(save.folder, self._tensors, args)
        for index in range(len(chunks)):  # each chunk's first split weight: never the same
            split = [n for n, at in stage_of.items() if at == index and n.endswith(_SPLIT_WEIGHTS)]
            if split and tp > 1:
                self._check_not_copies(split[0], pieces[split[0]])
        for raw in self._raws:  # every span is known: the files are opened again to copy
            raw.close()
        self._raws, self._zips = [], {}
        self.selected = "model"
        experts = f" x {ep} expert" if ep > 1 else ""
        self.selected_reason = (
            f"{save.reason}; {tp} tensor x {pp} pipeline{experts}-parallel ranks merged"
        )
        if vp > 1:
            self.selected_reason += f", {vp} virtual pipeline stages on each"
        if tied_copy:
            self.selected_reason += (
                "; the last stage's output_layer.weight, the tied embedding's copy, checked "
                "equal and left out"
            )
        if self.extra_states:
            self.selected_reason += f"; {len(self.extra_states)} _extra_state entries left out"
        root = roots[0, 0, 0]
        self.extras = jsonable({key: root.get(key) for key in _RECORDED if key in root})
        self.extras["args"] = args
        self.args_object = root["args"]

    def _gather(
        self,
        save: MegatronSave,
        roots: dict[tuple[int, int, int], dict[str, Any]],
        files: dict[tuple[int, int, int], Path],
        sizes: tuple[int, int, int, int],
    ) -> tuple[dict[str, list[tuple[int, str, TensorStub, Path]]], dict[str, int], int]:
        """Every rank's tensors under their merged names (layers moved past the chunks before
        them, experts numbered globally), each with its ranks' pieces; the chunk holding each
        name; and the layer count. ``sizes``: TP, PP, EP and virtual stages."""
        tp, pp, ep, vp = sizes
        pieces: dict[str, list[tuple[int, str, TensorStub, Path]]] = {}
        stage_of: dict[str, int] = {}
        offset = 0
        # Layers in the order megatron-core numbers them: each virtual stage's chunk on every
        # pipeline stage in turn (model0 of stages 0..P-1, then model1...), each chunk's
        # numbered from 0 in its files.
        chunks = [(v, stage) for v in range(vp) for stage in range(pp)]
        for index, (v, stage) in enumerate(chunks):
            models = {
                (t, e): _model(roots[t, stage, e], files[t, stage, e], v if vp > 1 else None)
                for e in range(ep)
                for t in range(tp)
            }
            layers = _layers(models[0, 0], files[0, stage, 0])
            local = _local_experts(models[0, 0])
            dense = [k for k in models[0, 0] if EXPERT.fullmatch(k) is None]
            for (t, e), model in models.items():
                if (
                    list(model) != list(models[0, e])
                    or [k for k in model if EXPERT.fullmatch(k) is None] != dense
                ):
                    raise FormatError(
                        f"{save.folder}: ranks {files[0, stage, 0].parent.name} and "
                        f"{files[t, stage, e].parent.name} hold different keys",
                        "the folder mixes two saves; copy it again",
                    )
                file = files[t, stage, e]
                for key, value in model.items():
                    if GROUPED.fullmatch(key):
                        raise FormatError(
                            f"{file}: '{key}' is a grouped-GEMM expert weight "
                            "(--moe-grouped-gemm), which ckptkit does not merge yet",
                            "convert a save made with SequentialMLP experts (no "
                            "--moe-grouped-gemm)",
                        )
                    found = LAYER.fullmatch(key)
                    name = (
                        key
                        if found is None
                        else f"decoder.layers.{int(found[1]) + offset}.{found[2]}"
                    )
                    expert = EXPERT.fullmatch(name)
                    if expert is not None:  # an expert rank's own experts, numbered from 0
                        name = f"{expert[1]}{e * local + int(expert[2])}.{expert[3]}"
                    if key.endswith(EXTRA_STATE):
                        if t == 0 and (e == 0 or expert is not None):
                            self.extra_states.append(name)
                        continue
                    if not isinstance(value, TensorStub):
                        raise FormatError(
                            f"{file}: '{key}' is not a tensor ({type(value).__name__})",
                            "is this a Megatron model's state dict?",
                        )
                    if expert is None and e > 0:  # the expert ranks' copies of the rest
                        self._check_replica(name, value, file, pieces[name][t])
                        continue
                    if not _on_its_stage(name, index, len(chunks)):
                        where = f"pipeline stage {stage} of {pp}"
                        where += f", virtual stage {v} of {vp}" if vp > 1 else ""
                        raise FormatError(
                            f"{file}: '{name}' is on {where}, where Megatron never puts it",
                            "the rank folders are misnamed or mixed: copy the save again",
                        )
                    if stage_of.setdefault(name, index) != index:
                        raise FormatError(
                            f"{save.folder}: two pipeline stages (or virtual stages) both hold "
                            f"'{name}'",
                            "the folder mixes two saves; copy it again",
                        )
                    pieces.setdefault(name, []).append((t, key, value, file))
            offset += layers
        return pieces, stage_of, offset

    def _drop_tied_copy(self, folder: Location) -> None:
        """With tied embeddings and pipeline stages, Megatron's last stage holds the
        embedding's copy as ``output_layer.weight`` (kept equal by the embedding group's
        all-reduce): checked equal to the embedding, then left out, as one stage holds it."""
        copy = self._tensors.pop("output_layer.weight")
        embedding = self._tensors.get("embedding.word_embeddings.weight")
        spans = [[self._layouts[c] for c in t.chunks] for t in (copy, embedding) if t]
        if (
            embedding is None
            or copy.shape != embedding.shape
            or copy.dtype != embedding.dtype
            or len(spans[0]) != len(spans[1])
            or not all(self._same(a, b) for a, b in zip(*spans, strict=True))
        ):
            raise FormatError(
                f"{folder}: the last stage's output_layer.weight differs from the embedding, "
                "though the args tie them (untie_embeddings_and_output_weights is unset)",
                "the folder mixes two saves; copy it again",
            )

    def _scan(self, file: Path) -> tuple[dict[str, Any], Any]:
        scan, layout, raw, _ = megatron_scan(file, self._allowed, url_file(file))
        self._raws.append(raw)
        self._zips[file] = layout
        if not isinstance(scan.root, dict):
            raise FormatError(f"{file} is not a Megatron checkpoint (its top level is no dict)")
        return scan.root, layout

    def _merge(
        self, name: str, parts: list[tuple[int, str, TensorStub, Path]], tp: int, swiglu: bool
    ) -> ChunkedTensor:
        """One tensor from its ranks' pieces, by the rule its key's ending names."""
        first = parts[0][2]
        if len(parts) != tp:
            raise FormatError(f"{self.path}: '{name}' is held by {len(parts)} of {tp} ranks")
        for _, _, stub, file in parts:
            if stub.dtype != first.dtype or len(stub.shape) != len(first.shape):
                raise FormatError(f"{file}: '{name}' differs from rank 0's in dtype or rank")
        spans = [self._span(stub, file, name) for _, _, stub, file in parts]
        shape = list(first.shape)
        chunks: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Path, int, int]]] = []
        if name.endswith(SAME) or tp == 1:
            for (_, _, stub, file), span in zip(parts[1:], spans[1:], strict=True):
                if stub.shape != first.shape or not self._same(spans[0], span):
                    raise FormatError(
                        f"{file}: '{name}' differs from rank 0's, though Megatron keeps it the "
                        "same on every tensor-parallel rank",
                        "the folder mixes two saves; copy it again",
                    )
            chunks.append(((0,) * len(shape), tuple(shape), spans[0]))
        elif name.endswith(COLUMNS) or name.endswith(ROWS):
            dim = 0 if name.endswith(COLUMNS) else 1
            if len(first.shape) <= dim:
                raise FormatError(
                    f"{parts[0][3]}: '{name}' has {len(first.shape)} dims, but Megatron splits it "
                    f"along dim {dim}",
                    "is this a Megatron model's state dict?",
                )
            if any(s.shape[dim] != first.shape[dim] for _, _, s, _ in parts):
                raise FormatError(
                    f"{self.path}: the ranks' pieces of '{name}' differ in size along dim {dim} "
                    f"({[s.shape[dim] for _, _, s, _ in parts]}); Megatron splits it evenly",
                    "the folder mixes two saves; copy it again",
                )
            if any(
                s.shape[:dim] + s.shape[dim + 1 :] != first.shape[:dim] + first.shape[dim + 1 :]
                for _, _, s, _ in parts
            ):
                raise FormatError(
                    f"{self.path}: the ranks' pieces of '{name}' differ beyond dim {dim}"
                )
            glu = swiglu and name.endswith(GLU)
            shape[dim] = sum(s.shape[dim] for _, _, s, _ in parts)
            at = 0
            for (_, _, stub, _), (path, start, length) in zip(parts, spans, strict=True):
                size = stub.shape[dim]
                if glu:  # [gate_r; up_r]: gate rows join the gates, up rows the ups
                    if size % 2:
                        raise FormatError(f"{self.path}: '{name}' has an odd row count for SwiGLU")
                    half, nbytes = size // 2, length // 2
                    rest = tuple(stub.shape[1:])
                    chunks.append(
                        ((at // 2,) + (0,) * len(rest), (half, *rest), (path, start, nbytes))
                    )
                    up_at = shape[0] // 2 + at // 2
                    chunks.append(
                        ((up_at,) + (0,) * len(rest), (half, *rest), (path, start + nbytes, nbytes))
                    )
                else:
                    offsets = [0] * len(shape)
                    offsets[dim] = at
                    chunks.append((tuple(offsets), tuple(stub.shape), (path, start, length)))
                at += size
        else:
            raise FormatError(
                f"{self.path}: '{name}' is not a key ckptkit knows how Megatron splits across "
                "tensor-parallel ranks",
                "convert a save with one tensor-parallel rank, or report the key",
            )
        tensor = ChunkedTensor(name, first.dtype, tuple(shape), [])
        for box, sizes, (path, start, length) in chunks:
            chunk = Chunk(box, sizes, path, start, length)
            tensor.chunks.append(chunk)
            self._layouts[chunk] = (path, start, length)
        check_cover(self.path, tensor)
        return tensor

    def _same(self, a: tuple[Path, int, int], b: tuple[Path, int, int]) -> bool:
        """Two ranks' copies of a tensor hold the same bytes (read through this source's
        connections at a URL)."""
        return _same_bytes(a, b, self._reader)

    def _check_replica(
        self, name: str, stub: TensorStub, file: Path, first: tuple[int, str, TensorStub, Path]
    ) -> None:
        """An expert-parallel rank's copy of a tensor that is not an expert's: the same dtype
        and shape as expert rank 0's, and, for the small ones every rank holds whole (norms,
        the router), the same bytes."""
        ref = first[2]
        if (stub.dtype, tuple(stub.shape)) != (ref.dtype, tuple(ref.shape)) or (
            name.endswith(SAME)
            and not self._same(self._span(stub, file, name), self._span(ref, first[3], name))
        ):
            raise FormatError(
                f"{file}: '{name}' differs from expert rank 0's, though Megatron keeps it the "
                "same on every expert-parallel rank",
                "the folder mixes two saves; copy it again",
            )

    def _check_not_copies(self, name: str, parts: list[tuple[int, str, TensorStub, Path]]) -> None:
        """A split weight (random at initialisation, never equal across ranks) whose slice on
        a rank is rank 0's: that rank's folder is a copy of another's, whose slices would be
        joined twice."""
        first = self._span(parts[0][2], parts[0][3], name)
        for rank, (_, _, stub, file) in enumerate(parts[1:], 1):
            if stub.nbytes and self._same(first, self._span(stub, file, name)):
                raise FormatError(
                    f"{file} holds the slice of '{name}' that tensor-parallel rank 0 holds: a "
                    f"copy of another rank's file, not rank {rank}'s",
                    "copy every rank's folder of the save",
                )

    def _span(self, stub: TensorStub, file: Path, name: str) -> tuple[Path, int, int]:
        """Where a rank's tensor lies in its file."""
        layout = self._zips[file]
        layout.locate_storages()
        base = layout.data_offset(stub.storage)
        start, end = stub.byte_range()
        if base is None or not stub.is_contiguous or end > stub.storage.nbytes:
            raise FormatError(
                f"{file}: '{name}' does not lie whole and in order in its storage",
                "is the file damaged? copy it again",
            )
        return file, base + start, stub.nbytes

    def files(self) -> list[Location]:
        return sorted({c.file for t in self._tensors.values() for c in t.chunks}, key=str)

    def close(self) -> None:
        super().close()
        for raw in self._raws:
            raw.close()
        self._raws = []


def _rank_files(folder: Location) -> dict[tuple[int, ...], Path]:
    """Every rank's file of a legacy save, by the numbers its folder's name holds
    (``mp_rank_TT[_NNN[_NNN]]``): each named once, in one naming, each its own file."""
    ranks: dict[tuple[int, ...], Any] = {}  # local Paths, or RemotePaths at a URL
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if not entry.name.startswith("mp_rank_"):
            continue
        found = _RANK_DIR.fullmatch(entry.name)
        if found is None:
            raise FormatError(
                f"{entry} is not a rank folder's name Megatron writes (mp_rank_TT, "
                "mp_rank_TT_PPP, mp_rank_TT_PPP_EEE)",
                "move it out of the save's folder",
            )
        numbers = tuple(int(n) for n in found.groups() if n is not None)
        if any(n >= _MOST_RANKS for n in numbers):
            raise FormatError(f"{entry}: more than {_MOST_RANKS} ranks")
        if ranks and len(numbers) != len(next(iter(ranks))):
            raise FormatError(
                f"{folder} mixes rank folders named with {len(next(iter(ranks)))} and "
                f"{len(numbers)} numbers (mp_rank_TT, mp_rank_TT_PPP...)",
                "the folder mixes two saves; copy it again",
            )
        if numbers in ranks:
            raise FormatError(
                f"{folder} names one rank twice ({ranks[numbers].parent.name} and {entry.name})",
                "the folder mixes two saves; copy it again",
            )
        file = next((entry / n for n in _RANK_FILES if (entry / n).is_file()), None)
        if file is None:
            raise FormatError(
                f"{entry} holds no {' or '.join(_RANK_FILES)}", "copy that rank's folder again"
            )
        ranks[numbers] = file
    seen: dict[Any, Any] = {}
    for file in ranks.values():  # a rank linked to another's file is not that rank
        real = local_path(file).resolve() if is_local(file) else str(file)
        if real in seen:
            raise FormatError(
                f"{file} is the very file {seen[real]} is: each rank has its own",
                "copy every rank's folder of the save",
            )
        seen[real] = file
    return ranks


def _placed(
    folder: Location, named: dict[tuple[int, ...], Path], args: dict[str, Any]
) -> list[_Rank]:
    """The rank files as (tensor, pipeline, expert) ranks, the full grid of them: a name's
    second number is a pipeline stage, or an expert rank when the args say experts were
    parallel and stages were not (Megatron-LM's get_checkpoint_name)."""
    experts = _size(args, "expert_model_parallel_size")
    stages = _size(args, "pipeline_model_parallel_size")
    ranks: dict[tuple[int, int, int], Path] = {}
    for numbers, file in named.items():
        padded = (*numbers, 0, 0)
        if len(numbers) == 2 and experts > 1 and stages == 1:  # mp_rank_TT_EEE
            padded = (numbers[0], 0, numbers[1])
        ranks[padded[0], padded[1], padded[2]] = file
    sizes = [1 + max(r[i] for r in ranks) for i in range(3)]
    for t in range(sizes[0]):
        for p in range(sizes[1]):
            for e in range(sizes[2]):
                if (t, p, e) not in ranks:
                    shown = f"mp_rank_{t:02d}" + (f"_{p:03d}" if sizes[1] > 1 else "")
                    shown += f"_{e:03d}" if sizes[2] > 1 else ""
                    raise FormatError(
                        f"{folder} lacks {shown}", "copy every rank's folder of the save"
                    )
    return [_Rank(t, p, e, f) for (t, p, e), f in sorted(ranks.items())]


def _size(args: dict[str, Any], key: str) -> int:
    """A parallel size the args give (1 when they give none)."""
    value = args.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _args(root: dict[str, Any], file: Path) -> dict[str, Any]:
    """The run's ``args`` Namespace as plain values (read as data, never imported; bounded
    as a whole, for a hostile file's)."""
    args = root.get("args")
    if not isinstance(args, Opaque) or not args.global_name.endswith("Namespace"):
        raise FormatError(
            f"{file} has no args (Megatron saves its arguments beside the model)",
            "is this a Megatron checkpoint?",
        )
    values = fields(args)
    found = jsonable(
        {k: v for k, v in values.items() if isinstance(k, str) and not k.startswith("__")}
    )
    assert isinstance(found, dict)
    return found


def _check_args(folder: Location, args: dict[str, Any], tp: int, pp: int, ep: int) -> None:
    """The args agree with the rank folders, where they say how many ranks there were."""
    for name, have in (("tensor", tp), ("pipeline", pp), ("expert", ep)):
        key = f"{name}_model_parallel_size"
        if key not in args or args[key] is None:
            continue
        said = args[key]
        if isinstance(said, bool) or not isinstance(said, int) or said != have:
            raise FormatError(
                f"{folder} has {have} {name}-parallel rank folders, but its args say "
                f"{key} {said!r}",
                "copy every rank's folder of the save",
            )
    etp = args.get("expert_tensor_parallel_size")
    if (ep > 1 or args.get("num_experts")) and etp not in (None, tp):
        raise FormatError(
            f"{folder}: its experts are cut over {etp!r} tensor-parallel ranks, its other layers "
            f"over {tp}, which ckptkit does not merge yet",
            "convert a save whose --expert-tensor-parallel-size is its tensor-parallel size",
        )
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    if isinstance(groups, int) and groups % tp:
        raise FormatError(
            f"{folder}: {groups} query groups over {tp} tensor-parallel ranks split a group's "
            "keys and values across ranks, which ckptkit does not merge yet",
            "convert a save whose tensor-parallel size divides num_query_groups",
        )


def _virtual_stages(root: dict[str, Any], file: Path, args: dict[str, Any]) -> int:
    """How many virtual pipeline stages each rank file holds (model0, model1...): 1 for a
    file holding ``model``. The args and the file agree."""
    if "model" in root:
        return 1
    count = 0
    while f"model{count}" in root and count < _MOST_RANKS:
        count += 1
    said = args.get("virtual_pipeline_model_parallel_size")
    if count == 0 or (isinstance(said, int) and said != count):
        raise FormatError(
            f"{file} holds {count} virtual pipeline stages (model0, model1...), but its args "
            f"say virtual_pipeline_model_parallel_size {said!r}"
            if count
            else f"{file} has no model state dict",
            "is this a Megatron checkpoint?",
        )
    return count


def _model(root: dict[str, Any], file: Path, virtual: int | None = None) -> dict[str, Any]:
    name = "model" if virtual is None else f"model{virtual}"
    model = root.get(name)
    if not isinstance(model, dict):
        raise FormatError(f"{file} has no {name} state dict", "is this a Megatron checkpoint?")
    bad = next((k for k in model if not isinstance(k, str)), None)
    if bad is not None:
        raise FormatError(
            f"{file}: the model state dict has a key that is no name ({type(bad).__name__})",
            "is this a Megatron model's state dict?",
        )
    return model


def _layers(model: dict[str, Any], file: Path) -> int:
    """How many layers a stage holds: numbered 0 to n - 1, as megatron-core numbers them."""
    numbers = set()
    for key in model:
        found = LAYER.fullmatch(key)
        if found is not None:
            numbers.add(int(found[1]))
        elif key.startswith("decoder.layers."):
            raise FormatError(
                f"{file}: '{key[:80]}' is not a layer's key Megatron writes",
                "is this a Megatron model's state dict?",
            )
    if numbers != set(range(len(numbers))):
        shown = sorted(numbers)[:8]
        raise FormatError(
            f"{file} numbers its layers {shown}{' ...' if len(numbers) > 8 else ''}, not 0 to "
            f"{len(numbers) - 1}",
            "is this a Megatron model's state dict?",
        )
    return len(numbers)


# A torch_dist save's entries beside the model's: the optimizer's state (Megatron's distributed
# optimizer saves it under these names), left out.
_NOT_MODEL = ("optimizer.", "rerun_state_machine")
# What a rank file records beside the model, kept in the metadata.
_RECORDED = ("iteration", "checkpoint_version", "num_floating_point_operations_so_far")


def _tied_copy(args: dict[str, Any], pp: int, pieces: dict[str, Any]) -> bool:
    """Whether the last stage's ``output_layer.weight`` is the tied embedding's copy."""
    tied = not args.get("untie_embeddings_and_output_weights", False)
    return tied and pp > 1 and "output_layer.weight" in pieces


_SPLIT_WEIGHTS = tuple(k for k in (*COLUMNS, *ROWS) if k.endswith("weight"))
_FIRST_STAGE = ("embedding.",)
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")


def _on_its_stage(name: str, stage: int, stages: int) -> bool:
    """Megatron keeps the embeddings on the first pipeline stage and the final norm and the
    output layer on the last: a stage holding another's is a misnamed or swapped folder."""
    if name.startswith(_FIRST_STAGE):
        return stage == 0
    if name.startswith(_LAST_STAGE):
        return stage == stages - 1
    return True


def _check_mlp(folder: Location, tensors: dict[str, ChunkedTensor], args: dict[str, Any]) -> None:
    """A SwiGLU run's linear_fc1 holds gate and up (twice ffn_hidden_size rows), another's
    ffn_hidden_size rows: the rule that joined them matches the weights."""
    for name, tensor in tensors.items():
        expert = EXPERT.fullmatch(name) is not None
        field = "moe_ffn_hidden_size" if expert else "ffn_hidden_size"
        ffn = args.get(field)
        if isinstance(ffn, bool) or not isinstance(ffn, int):
            continue
        rows = 2 * ffn if args.get("swiglu") else ffn
        fc1 = name.endswith("linear_fc1.weight" if expert else "mlp.linear_fc1.weight")
        if fc1 and tensor.shape[0] != rows:
            raise FormatError(
                f"{folder}: '{name}' has {tensor.shape[0]} rows, but args say "
                f"{field} {ffn} {'with' if args.get('swiglu') else 'without'} SwiGLU "
                f"({rows} rows)",
                "is the first rank's args file that of these weights?",
            )


# A torch_dist save's experts of one layer, stacked on a first dim (megatron-core's
# SequentialMLP names them experts.experts.NAME): one tensor per expert once unstacked.
_DIST_EXPERTS = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.)experts\.(.+)")


def _local_experts(model: dict[str, Any]) -> int:
    """How many experts an expert-parallel rank holds (numbered 0 to n - 1 in its files)."""
    numbers = {int(found[2]) for key in model if (found := EXPERT.fullmatch(key)) is not None}
    return 1 + max(numbers) if numbers else 0


def _check_experts(
    folder: Location, tensors: dict[str, ChunkedTensor], args: dict[str, Any]
) -> None:
    """Each mixture-of-experts layer holds every expert the args say, once: 0 to
    num_experts - 1 once the expert ranks' own numbers are made global."""
    held: dict[str, set[int]] = {}
    for name in tensors:
        found = EXPERT.fullmatch(name)
        if found is not None:
            held.setdefault(found[1], set()).add(int(found[2]))
    said = args.get("num_experts")
    for prefix, numbers in held.items():
        want = said if isinstance(said, int) and not isinstance(said, bool) else len(numbers)
        if numbers != set(range(want)):
            raise FormatError(
                f"{folder}: {prefix.rstrip('.')} holds experts {sorted(numbers)[:8]}, not 0 to "
                f"{want - 1} (num_experts {said!r})",
                "copy every rank's folder of the save",
            )


_COMPARED = 8 << 20  # bytes of two remote copies compared at a time


def _same_bytes(a: tuple[Path, int, int], b: tuple[Path, int, int], reader: RangeReader) -> bool:
    """Two ranks' copies of a tensor hold the same bytes (local files compared in place,
    files at a URL a piece at a time through ``reader``'s connections)."""
    if a[2] != b[2]:
        return False
    if is_local(a[0]) and is_local(b[0]):
        with open(a[0], "rb") as fa, open(b[0], "rb") as fb:
            return same_bytes(fa.fileno(), a[1], fb.fileno(), b[1], a[2])
    for at in range(0, a[2], _COMPARED):
        count = min(_COMPARED, a[2] - at)
        first, second = bytearray(count), bytearray(count)
        reader.read([(a[0], a[1] + at, count)], memoryview(first))
        reader.read([(b[0], b[1] + at, count)], memoryview(second))
        if first != second:
            return False
    return True


class MegatronDistSource(DCPSource):
    """A torch_dist save (Megatron's ``dist_checkpointing``): DCP whose full tensors are the
    TP=1 model's, with a transformer block's layers stacked on a first dim (one chunk per layer
    or more) under ``decoder.layers.NAME``. Read as one tensor per layer,
    ``decoder.layers.I.NAME``, as a legacy save names them; ``common.pt`` gives the args. Its
    ``_extra_state`` values are left out, named."""

    def __init__(
        self,
        save: MegatronSave,
        *,
        select: str | None = None,
        allowed: tuple[str, ...] = (),
        args: dict[str, Any] | None = None,
        prefix: str = "",
    ) -> None:
        """``args``: the run's settings where ``common.pt`` holds none (NeMo's, from its
        config); ``prefix``: what the model's keys start with (NeMo's ``module.``), the other
        entries (an optimizer's) left out."""
        if select not in (None, "model"):
            raise SelectError(
                f"{save.folder} is a Megatron save; its model is its only state dict",
                "drop --select",
            )
        super().__init__(save.folder)
        self.format = "megatron torch_dist"
        self._allowed = allowed
        self.args_object: Any = None  # the args as common.pt's pickle gave them
        self.extra_states: list[str] = []  # DCP saves them stacked: a legacy save's are made
        try:
            self._unstack(save, args, prefix)
        except BaseException:
            self.close()
            raise

    def _unstacked(self, tensor: ChunkedTensor, names: list[str]) -> list[ChunkedTensor]:
        """``tensor`` cut along its first dim, one tensor per index, named ``names``: each
        chunk's rows along it are whole ranges of its file."""
        out = [ChunkedTensor(name, tensor.dtype, tensor.shape[1:], []) for name in names]
        for chunk in tensor.chunks:
            path, start, length = self._piece(tensor, chunk)
            per_row = length // chunk.sizes[0] if chunk.sizes[0] else 0
            for j in range(chunk.sizes[0]):
                piece = (path, start + j * per_row, per_row)
                part = Chunk(chunk.offsets[1:], chunk.sizes[1:], path, piece[1], per_row)
                self._layouts[part] = piece
                out[chunk.offsets[0] + j].chunks.append(part)
        return out

    def _unstack(self, save: MegatronSave, given: dict[str, Any] | None, prefix: str) -> None:
        common = save.folder / "common.pt"
        root: dict[str, Any] = {}
        if given is None:
            at_url = self._files.url_file(common.name)
            scan, _, raw, _ = megatron_scan(common, self._allowed, at_url)
            raw.close()
            root = scan.root if isinstance(scan.root, dict) else {}
        args = _args(root, Path(str(common))) if given is None else given
        layers = args.get("num_layers")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise FormatError(f"{save.folder}: num_layers is {layers!r}, not a layer count")
        tensors: dict[str, ChunkedTensor] = {}
        others = [k for k in self._tensors if not k.startswith(prefix) or k.startswith(_NOT_MODEL)]
        for key in others:  # an optimizer's state beside the model's
            del self._tensors[key]
        self._tensors = {k.removeprefix(prefix): t for k, t in self._tensors.items()}

        def add(name: str, tensor: ChunkedTensor) -> None:
            if name in tensors:
                raise FormatError(
                    f"{save.folder} holds '{name}' both stacked and on its own",
                    "the folder mixes two saves; copy it again",
                )
            tensors[name] = tensor

        for key, tensor in self._tensors.items():
            rest = key.removeprefix("decoder.layers.")
            if rest == key or LAYER.fullmatch(key) is not None:
                add(key, tensor)
                continue
            if not rest:
                raise FormatError(f"{save.folder} holds a tensor named 'decoder.layers.'")
            if not tensor.shape or tensor.shape[0] != layers:
                raise FormatError(
                    f"{save.folder}: '{key}' stacks {tensor.shape[:1]} layers, not num_layers "
                    f"{layers}",
                    "is common.pt that of this save?",
                )
            names = [f"decoder.layers.{layer}.{rest}" for layer in range(layers)]
            for name, layer_tensor in zip(names, self._unstacked(tensor, names), strict=True):
                found = _DIST_EXPERTS.fullmatch(name)
                if found is None:
                    add(name, layer_tensor)
                    continue
                # A layer's experts, stacked too: one tensor per expert, as a legacy save's.
                experts = [
                    f"{found[1]}local_experts.{e}.{found[2]}" for e in range(layer_tensor.shape[0])
                ]
                for expert, one in zip(
                    experts, self._unstacked(layer_tensor, experts), strict=True
                ):
                    add(expert, one)
        for tensor in tensors.values():
            check_cover(self.path, tensor)
        self._tensors = tensors
        extra = [k for k in self.extras if EXTRA_STATE in k]
        for key in extra:
            del self.extras[key]
        self.selected = "model"
        self.selected_reason = f"{save.reason}; its layers unstacked" + (
            f"; {len(extra)} _extra_state entries left out" if extra else ""
        )
        if others:
            where = f"not under {prefix!r}" if prefix else "of the optimizer"
            count = f"{len(others)} tensor" + ("s" if len(others) != 1 else "")
            self.selected_reason += f"; {count} {where} left out"
        self.extras.update(jsonable({key: root.get(key) for key in _RECORDED if key in root}))
        self.extras["args"] = args
        self.args_object = root.get("args")
