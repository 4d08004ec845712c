"""A model in Megatron's names, as one rank holds it (a merged save, or a Hugging Face model
mapped back by a pack), cut into a legacy save's rank files for a chosen tensor- and
pipeline-parallel size: what ``convert --to megatron --tp T --pp P`` writes, so that a run
goes on over another number of GPUs.

The cuts are the merge's rules (``megatron.py``) undone, as megatron-core's layers hold their
slices:

- column-parallel weights along dim 0, a SwiGLU ``linear_fc1`` as each rank's
  ``[gate_r; up_r]``; row-parallel weights along dim 1; the rest copied to every rank;
- the layers dealt to the stages evenly, each stage numbering its own from 0; the embedding on
  the first stage, the final norm and the output layer on the last. With tied embeddings and
  several stages the last one holds the embedding's copy as ``output_layer.weight``, as
  Megatron keeps it;
- the vocabulary padded as Megatron pads it for the new size (a multiple of
  ``make_vocab_size_divisible_by`` x TP): zero rows added, or padding rows cut;
- the norms under the names the run's layer spec uses (``transformer_impl``: the local spec's
  ``input_layernorm``, TransformerEngine's ``linear_qkv.layer_norm_weight``), and the
  ``_extra_state`` entries megatron-core's modules expect (None: no FP8 state);
- beside the model, the args (the parallel sizes and the padded vocabulary set to the new
  ones), ``checkpoint_version`` and the iteration, as Megatron-LM's ``generate_state_dict``
  writes them. No optimizer or RNG state: the run resumes with ``--no-load-optim
  --no-load-rng`` (or ``--finetune``), as from Megatron's own converter.

Each cut is a layout over the source's bytes, so it is written from views of the source files,
without torch; a source that cannot be laid out (a URL, a cast) is cut through torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, UsageError
from ckptkit.formats.base.laid import Laid, SpanViews
from ckptkit.formats.base.layout import MOST_RUNS, ZEROS, Layout, narrow, pad
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.folders.megatron import (
    COLUMNS,
    EXPERT,
    EXTRA_STATE,
    GLU,
    GROUPED,
    LATEST,
    LAYER,
    MEGATRON_ENUM,
    ROWS,
    SAME,
)
from ckptkit.formats.pickles.machine import Global, Opaque, build_state
from ckptkit.formats.pickles.writer import Call, New, Ref
from ckptkit.storage.location import Location

if TYPE_CHECKING:
    import torch

__all__ = [
    "MegatronRanks",
    "RANK_FILE",
    "MOST_PARALLEL",
    "CHECKPOINT_VERSION",
    "parallel_sizes",
    "save_args",
    "saved_iteration",
    "written_args",
    "iteration_names",
    "saved_root",
    "layer_count",
]

RANK_FILE = "model_optim_rng.pt"
MOST_PARALLEL = 4096  # ranks of either kind, as the reader bounds them
CHECKPOINT_VERSION = 3.0  # what Megatron-LM writes (megatron/training/checkpointing.py)
_MOST_DIVISIBLE = 1 << 16  # make_vocab_size_divisible_by: Megatron's default is 128
_MOST_ARG_VALUES = 100_000  # values in the args written back (a hostile pickle shares lists)
# Norms under TransformerEngine's names (fused into the next linear) and the local spec's.
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
}
# The layer modules whose _extra_state megatron-core's state dicts hold (None without FP8).
_LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    ".linear_fc1",  # a dense MLP's, and each expert's
    ".linear_fc2",
)
# Args a new layout makes wrong: the old stages' uneven split, virtual stages, the format.
_RESET = {
    "virtual_pipeline_model_parallel_size": None,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "pipeline_model_parallel_layout": None,
    "num_virtual_stages_per_pipeline_rank": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "ckpt_format": "torch",
    "use_dist_ckpt": False,
}
_DTYPE_GLOBAL = re.compile(
    r"<global torch\.(float|half|double|bfloat16|float16|float32|float64|int8|int16|int32|"
    r"int64|uint8|bool|long|int|float8_e4m3fn|float8_e5m2)>"
)


@dataclass(frozen=True)
class _Cut:
    """One rank's tensor: which source tensor, how it is cut, and for which rank."""

    source: str
    rule: str  # "column", "glu" (SwiGLU's [gate_r; up_r]), "row", "same"
    rank: int  # the tensor-parallel rank
    rows: int | None  # the vocabulary's padded rows (embedding, output layer); else None


class MegatronRanks(Source):
    """``inner``'s tensors (Megatron's names, one rank's) as the rank files of a legacy save
    at ``tp`` x ``pp``; each tensor named ``mp_rank_TT.../KEY`` (its rank folder's) until the
    plan puts it in that rank file under KEY (as a mapping's ranked target,
    ``conversion.plan.per_rank``)."""

    def __init__(self, inner: Source, tp: int, pp: int, ep: int = 1, vp: int = 1) -> None:
        super().__init__(path=inner.path, format=inner.format)
        self.inner, self.tp, self.pp, self.ep, self.vp = inner, tp, pp, ep, vp
        # Each cut is made once, from views of the source, and checked by the CRC-32 of the
        # bytes written (as a mapping's groups are): not made again to compare.
        self.made_once = True  # type: ignore[misc]
        self.selected, self.extras = inner.selected, inner.extras
        self.dropped, self.followed = inner.dropped, inner.followed
        args = save_args(inner)
        self.iteration = saved_iteration(inner)
        folder, tracker = iteration_names(self.iteration)
        self.documents = {LATEST: tracker}
        if vp > 1 and pp == 1:
            raise UsageError("--vpp: virtual stages are of pipeline stages", "add --pp 2 or more")
        chunks, per = _stages(inner, args, pp, vp)
        _check_heads(inner, args, tp)
        local = _experts_per_rank(inner, args, ep)
        rows = self._padded(inner, args)
        swiglu = bool(args.get("swiglu"))
        impl = args.get("transformer_impl")
        recorded = getattr(inner, "extra_states", None)
        self._cuts: dict[str, _Cut] = {}
        self._placed: dict[str, tuple[int, str]] = {}  # each name's rank file and key there
        self._infos_by_name: dict[str, TensorInfo] = {}
        self.rank_files: list[str] = []
        # Each rank file's state dicts (model, or model0, model1... with virtual stages):
        # (key, tensor name here, or None for an extra state) in order.
        self.rank_models: list[dict[str, list[tuple[str, str | None]]]] = []
        for stage in range(pp):
            for e in range(ep):
                for t in range(tp):
                    rank = len(self.rank_files)
                    name = f"mp_rank_{t:02d}" + (f"_{stage:03d}" if pp > 1 else "")
                    name += f"_{e:03d}" if ep > 1 else ""  # Megatron-LM's get_checkpoint_name
                    self.rank_files.append(f"{folder}/{name}/{RANK_FILE}")
                    states: dict[str, list[tuple[str, str | None]]] = {}
                    for v in range(vp):
                        chunk = v * pp + stage
                        state = "model" if vp == 1 else f"model{v}"
                        model: list[tuple[str, str | None]] = []
                        for source, chunk_key in chunks[chunk]:
                            key = _on_expert_rank(chunk_key, e, local)
                            if key is None:  # another expert rank's expert
                                continue
                            cut = _Cut(source, _rule(source, swiglu, tp, inner.path), t, None)
                            if source.startswith(("embedding.word_embeddings.", "output_layer.")):
                                cut = _Cut(source, cut.rule, t, rows)
                            shown = key if vp == 1 else f"{state}.{key}"
                            named = f"{name}/{shown}"  # its rank folder's, in reports
                            self._placed[named] = (rank, shown)
                            self._cuts[named] = cut
                            self._infos_by_name[named] = self._cut_info(named, cut)
                            model.append((key, named))
                        layers = range(chunk * per, (chunk + 1) * per)
                        where = _Place(chunk, len(chunks), layers, e, local)
                        states[state] = _with_extra_states(model, recorded, where, impl)
                    self.rank_models.append(states)
        updates: dict[str, Any] = {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            **({"padded_vocab_size": rows} if rows is not None else {}),
        }
        if vp > 1 or "virtual_pipeline_model_parallel_size" in args:
            updates["virtual_pipeline_model_parallel_size"] = vp if vp > 1 else None
        if vp > 1 or "num_layers_per_virtual_pipeline_stage" in args:
            updates["num_layers_per_virtual_pipeline_stage"] = per if vp > 1 else None
        if ep > 1 or "expert_model_parallel_size" in args:
            updates["expert_model_parallel_size"] = ep
        if "expert_tensor_parallel_size" in args or (local and ep > 1):
            updates["expert_tensor_parallel_size"] = tp  # the experts cut as the rest
        # The least launch that holds the layout (Megatron takes both from its launch).
        for key, size in (("data_parallel_size", ep), ("world_size", tp * pp * ep)):
            if key in args:
                updates[key] = size
        self.args, self.args_shown = written_args(inner, args, updates)
        self.selected_reason = inner.selected_reason
        # What the new layout changed in the args (said in the report).
        self.changed = {k: self.args_shown[k] for k, v in updates.items() if args.get(k) != v}
        self._views = SpanViews()
        self._loaded: tuple[str, torch.Tensor] | None = None
        self._laid: tuple[str, Laid | None] | None = None  # the last tensor's cut

    def describe(self) -> dict[str, Any]:
        """What the cut made, for the report: the sizes, the iteration, the args set."""
        return {
            "tensor_parallel": self.tp,
            "pipeline_parallel": self.pp,
            "expert_parallel": self.ep,
            "virtual_stages": self.vp,
            "iteration": "release" if self.iteration is None else self.iteration,
            "args_set": self.changed,
            "beside": [key for key in self.rank_root() if key not in self.rank_models[0]],
        }

    def rank_root(self) -> dict[str, Any]:
        """What every rank file holds, in Megatron-LM's order, its model at ``model``."""
        return saved_root(self.args, self.iteration, self.inner, list(self.rank_models[0]))

    def _padded(self, inner: Source, args: dict[str, Any]) -> int | None:
        """The embedding's rows at the new size: Megatron's ``padded_vocab_size`` for it."""
        if "embedding.word_embeddings.weight" not in inner.keys():
            return None
        shape = inner.info("embedding.word_embeddings.weight").shape
        if len(shape) != 2:
            raise FormatError(
                f"'embedding.word_embeddings.weight' in {inner.path} has {len(shape)} dims, "
                "not an embedding's 2",
                "is this a Megatron model?",
            )
        have = shape[0]
        divisible = _whole(args.get("make_vocab_size_divisible_by", 128), 1)
        vocab = args.get("vocab_size")
        multiple = divisible * self.tp
        if divisible > _MOST_DIVISIBLE:
            raise FormatError(
                f"{inner.path}: make_vocab_size_divisible_by {divisible} is no padding multiple "
                f"Megatron uses (at most {_MOST_DIVISIBLE})",
                "are the args those of this model?",
            )
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            if have % multiple:
                raise FormatError(
                    f"{inner.path}: the embedding's {have} rows do not divide by "
                    f"make_vocab_size_divisible_by x TP ({multiple}), and the args give no "
                    "vocab_size to pad to",
                    "record vocab_size in the args (convert with --map ... --set vocab=N), or "
                    "choose another --tp",
                )
            return have
        if vocab > have:
            raise FormatError(
                f"{inner.path}: the args' vocab_size {vocab} is more than the embedding's "
                f"{have} rows",
                "are the args those of these weights?",
            )
        return math.ceil(vocab / multiple) * multiple

    def _cut_info(self, name: str, cut: _Cut) -> TensorInfo:
        info = self.inner.info(cut.source)
        shape = list(info.shape)
        if cut.rule != "same" and not shape:
            raise FormatError(
                f"'{cut.source}' in {self.inner.path} has no dims, but Megatron cuts it",
                "is this a Megatron model?",
            )
        if cut.rows is not None:
            shape[0] = cut.rows
        if info.kind != "dense":
            raise FormatError(
                f"'{cut.source}' in {self.inner.path} is not a plain tensor; a Megatron save "
                "holds plain tensors",
                "convert it to a dense tensor in PyTorch first",
            )
        if cut.rule != "same":
            dim = 1 if cut.rule == "row" else 0
            parts = self.tp * (2 if cut.rule == "glu" else 1)
            if len(shape) <= dim or shape[dim] % parts:
                size = shape[dim] if len(shape) > dim else "no"
                raise FormatError(
                    f"'{cut.source}' in {self.inner.path} has {size} elements along dim {dim}, "
                    f"which {self.tp} tensor-parallel ranks cannot share evenly",
                    "choose a --tp that divides it",
                )
            shape[dim] //= self.tp
        return TensorInfo(info.dtype, tuple(shape))

    def entries(self) -> list[tuple[str, TensorInfo]]:
        return list(self._infos_by_name.items())

    def placed(self, name: str) -> tuple[int, str]:
        """A tensor's rank file (its index in :attr:`rank_files`) and key there."""
        return self._placed[name]

    def laid_out(self, key: str) -> Laid | None:
        if self._laid is not None and self._laid[0] == key:  # asked again as it is written
            return self._laid[1]
        cut = self._cuts[key]
        laid = self.inner.laid_out(cut.source)
        if laid is not None:
            layout = _cut_layout(laid.layout, cut, self.tp)
            # Finer than a mapping of views should be: through torch instead.
            laid = Laid(laid.spans, layout) if len(layout.pieces) <= MOST_RUNS else None
        self._laid = (key, laid)
        return laid

    def byte_pieces(self, key: str) -> list[tuple[Location, int, int]] | None:
        """A cut that is a few whole ranges of the source's files (rows of a column-parallel
        weight, a copied norm): copied by the kernel."""
        cut = self._cuts[key]
        if cut.rule == "row" and self._infos_by_name[key].shape[0] > 1:
            return None  # a range per row: written from views (made_pieces)
        laid = self.laid_out(key)
        if laid is None or len(laid.layout.pieces) > 8:
            return None
        if any(slot == ZEROS for slot, _, _ in laid.layout.pieces):
            return None
        return [
            (laid.spans[slot][0], laid.spans[slot][1] + offset, length)
            for slot, offset, length in laid.layout.pieces
        ]

    def made_pieces(self, key: str) -> list[memoryview] | None:
        laid = self.laid_out(key)
        return None if laid is None else self._views.of(laid)

    def load(self, key: str) -> torch.Tensor:
        cut = self._cuts[key]
        if self._loaded is None or self._loaded[0] != cut.source:
            self._loaded = None  # one source tensor held at a time
            self._loaded = (cut.source, self.inner.load(cut.source))
        return _cut_tensor(self._loaded[1], cut, self.tp)

    def files(self) -> list[Location]:
        return self.inner.files()

    def close(self) -> None:
        self._loaded = None
        self._views.close()


def save_args(inner: Source) -> dict[str, Any]:
    """The run's args as plain values: a Megatron source's, or those a mapping made (a pack's
    Megatron side), or those a converted file kept in its metadata."""
    import json

    args = inner.extras.get("args")
    if args is None and "args" in inner.metadata:
        try:
            args = json.loads(inner.metadata["args"])
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise FormatError(
            f"{inner.path} records no Megatron args (Megatron saves its arguments beside the "
            "model, and a legacy save needs them)",
            "convert a Megatron save, or a Hugging Face model with --map megatron-llama "
            "--reverse (or megatron-gpt2), which writes them",
        )
    return args


def saved_iteration(inner: Source) -> int | None:
    """The iteration to save as: the source's, or None (a release) for a model from
    elsewhere."""
    found = inner.extras.get("iteration")
    if isinstance(found, bool) or not isinstance(found, int) or not 0 <= found < 10**12:
        return None
    return found


def iteration_names(iteration: int | None) -> tuple[str, str]:
    """The iteration folder's name and what the tracker says (a release without one)."""
    if iteration is None:
        return "release", "release"
    return f"iter_{iteration:07d}", str(iteration)


def saved_root(
    args: Any,
    iteration: int | None,
    inner: Source,
    states: Sequence[str] = (),
) -> dict[str, Any]:
    """What a save holds beside its tensors, in Megatron-LM's order (``states``: the model's
    keys in a rank file, None placeholders): the args, ``checkpoint_version``, the iteration,
    and the source's FLOP count where it records one."""
    root: dict[str, Any] = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration or 0,
    }
    root.update(dict.fromkeys(states))
    flops = inner.extras.get("num_floating_point_operations_so_far")
    if isinstance(flops, (int, float)) and not isinstance(flops, bool):
        root["num_floating_point_operations_so_far"] = flops
    return root


def layer_count(inner: Source, args: dict[str, Any]) -> int:
    """How many layers ``inner`` holds (``decoder.layers.N``), numbered 0 to N - 1 and as
    many as the args' ``num_layers``."""
    numbers = sorted({int(f[1]) for k in inner.keys() if (f := LAYER.fullmatch(k)) is not None})
    if numbers != list(range(len(numbers))):
        raise FormatError(f"{inner.path} numbers its layers {numbers[:8]}, not 0 to N - 1")
    said = args.get("num_layers")
    if isinstance(said, int) and not isinstance(said, bool) and said != len(numbers):
        raise FormatError(
            f"{inner.path} holds {len(numbers)} layers, but its args say num_layers {said}",
            "are the args those of these weights?",
        )
    return len(numbers)


def _whole(value: Any, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return default
    return value


def _place(key: str) -> tuple[int, int] | None:
    """(section, layer) of a Megatron key: the embedding 0, layers 1, the final norm 2, the
    output layer 3; None for a key of no place Megatron's GPT model has."""
    found = LAYER.fullmatch(key)
    if found is not None:
        return 1, int(found[1])
    if key.startswith("embedding."):
        return 0, 0
    if key.startswith("decoder.final_layernorm."):
        return 2, 0
    if key.startswith("output_layer."):
        return 3, 0
    return None


def _stages(
    inner: Source, args: dict[str, Any], pp: int, vp: int = 1
) -> tuple[list[list[tuple[str, str]]], int]:
    """Each model chunk's (source key, its key there: a norm under the name the run's layer
    spec loads), in the order megatron-core's model holds them, and the layers a chunk holds.
    The chunks are the stages, or with ``vp`` virtual stages each stage's ``vp`` chunks in
    megatron-core's layer order: model0 of stages 0 to P - 1, then model1..."""
    impl = args.get("transformer_impl")
    experts = any(EXPERT.fullmatch(key) for key in inner.keys())
    placed = []
    for index, key in enumerate(inner.keys()):
        where = _place(key)
        if where is None:
            raise FormatError(
                f"'{key}' in {inner.path} is not a key of Megatron's GPT model (embedding, "
                "decoder.layers.N, decoder.final_layernorm, output_layer)",
                "convert a model in Megatron's names (--map megatron-llama --reverse)",
            )
        if GROUPED.fullmatch(key):
            raise FormatError(
                f"'{key}' in {inner.path} is a grouped-GEMM expert weight, which ckptkit does "
                "not cut yet",
                "convert a model with SequentialMLP experts (local_experts.E)",
            )
        placed.append((where, _module_order(_norm_name(key, impl, experts)), index, key))
    placed.sort()
    layers = layer_count(inner, args)
    chunks = pp * vp
    if layers % chunks or layers < chunks:
        what = f"{pp} pipeline stages" + (f" x {vp} virtual stages" if vp > 1 else "")
        raise FormatError(
            f"{inner.path}'s {layers} layers do not share evenly over {what}",
            "choose a --pp (and --vpp) whose product divides the layer count",
        )
    per = layers // chunks
    stages: list[list[tuple[str, str]]] = [[] for _ in range(chunks)]
    for (section, layer), _, _, key in placed:
        local = _norm_name(key, impl, experts)
        if section == 1:
            found = LAYER.fullmatch(local)
            assert found is not None
            stages[layer // per].append((key, f"decoder.layers.{layer % per}.{found[2]}"))
        else:
            stages[0 if section == 0 else chunks - 1].append((key, local))
    tied = not args.get("untie_embeddings_and_output_weights", False)
    embedding = "embedding.word_embeddings.weight"
    keys = inner.keys()
    if tied and chunks > 1 and "output_layer.weight" not in keys and embedding in keys:
        stages[-1].append((embedding, "output_layer.weight"))  # the tied copy
    return stages, per


def _check_heads(inner: Source, args: dict[str, Any], tp: int) -> None:
    """Megatron gives each tensor-parallel rank whole query groups (attention heads)."""
    heads = args.get("num_attention_heads")
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    what = "query groups" if groups is not heads else "attention heads"
    if isinstance(groups, int) and not isinstance(groups, bool) and groups % tp:
        raise FormatError(
            f"{inner.path}'s {groups} {what} do not share evenly over {tp} tensor-parallel "
            "ranks, as Megatron needs",
            f"choose a --tp that divides {groups}",
        )


# Where megatron-core's modules register their parameters: a layer's, and the embedding's.
_MODULES = (
    "embedding.word_embeddings.",
    "embedding.position_embeddings.",
    "input_layernorm.",
    "self_attention.core_attention.",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "pre_mlp_layernorm.",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
    "mlp.router.",
    "mlp.experts.",
)


def _module_order(key: str) -> tuple[int, int, int]:
    """A key's place among its layer's modules (a model from elsewhere, or a torch_dist
    save's experts, put in megatron-core's order: expert by expert, fc1 before fc2; keys of
    one module keep theirs)."""
    found = LAYER.fullmatch(key)
    rest = key if found is None else found[2]
    module = next((i for i, m in enumerate(_MODULES) if rest.startswith(m)), len(_MODULES))
    expert = EXPERT.fullmatch(key)
    if expert is None:
        return module, 0, 0
    return module, int(expert[2]), 0 if expert[3].startswith("linear_fc1.") else 1


def _rule(key: str, swiglu: bool, tp: int, path: Location) -> str:
    """How megatron-core's layers cut ``key`` across tensor-parallel ranks."""
    if key.endswith(SAME) or tp == 1:
        return "same"
    if key.endswith(COLUMNS):
        glu = swiglu and key.endswith(GLU)
        return "glu" if glu else "column"
    if key.endswith(ROWS):
        return "row"
    raise FormatError(
        f"'{key}' in {path} is not a key ckptkit knows how Megatron splits across "
        "tensor-parallel ranks",
        "write it with --tp 1, or report the key",
    )


def _norm_name(key: str, impl: Any, experts: bool = False) -> str:
    """A layer's norm under the names the run's layer spec loads: the local spec's for
    ``transformer_impl`` local, TransformerEngine's for transformer_engine (whose spec keeps
    ``pre_mlp_layernorm`` apart before experts), else as it is."""
    found = LAYER.fullmatch(key)
    if found is None or impl not in ("local", "transformer_engine"):
        return key
    head, rest = key[: len(key) - len(found[2])], found[2]
    for te, local in _TE_NORMS.items():
        if impl == "local" and rest.startswith(te):
            return head + local + rest.removeprefix(te)
        if experts and local == "pre_mlp_layernorm.":
            continue
        if impl == "transformer_engine" and rest.startswith(local):
            return head + te + rest.removeprefix(local)
    return key


@dataclass(frozen=True)
class _Place:
    """Where a model chunk is: its place in the layer order (of ``stages`` chunks: the
    pipeline stages, times the virtual stages) and the layers it holds, its expert rank and
    how many experts each expert rank holds (0: no experts)."""

    stage: int
    stages: int
    layers: range
    expert_rank: int
    local: int


def _experts_per_rank(inner: Source, args: dict[str, Any], ep: int) -> int:
    """How many experts each expert-parallel rank holds (0 for a model without experts)."""
    numbers: dict[str, set[int]] = {}
    for key in inner.keys():
        found = EXPERT.fullmatch(key)
        if found is not None:
            numbers.setdefault(found[1], set()).add(int(found[2]))
    if not numbers:
        if ep > 1:
            raise FormatError(
                f"{inner.path} has no experts to share over {ep} expert-parallel ranks",
                "leave out --ep",
            )
        return 0
    counts = {len(n) for n in numbers.values()}
    said = args.get("num_experts")
    experts = counts.pop()
    gaps = any(n != set(range(len(n))) for n in numbers.values())
    if gaps or counts or (isinstance(said, int) and said != experts):
        raise FormatError(
            f"{inner.path}'s layers do not each hold experts 0 to n - 1, the same n "
            f"(num_experts {said!r})",
            "are the args those of these weights?",
        )
    if experts % ep:
        raise FormatError(
            f"{inner.path}'s {experts} experts do not share evenly over {ep} expert-parallel ranks",
            f"choose an --ep that divides {experts}",
        )
    return experts // ep


def _on_expert_rank(key: str, rank: int, local: int) -> str | None:
    """``key`` on expert rank ``rank`` (an expert numbered among that rank's own), or None
    for another rank's expert."""
    found = EXPERT.fullmatch(key)
    if found is None or local == 0:
        return key
    number = int(found[2])
    if number // local != rank:
        return None
    return f"{found[1]}{number % local}.{found[3]}"


def _with_extra_states(
    model: list[tuple[str, str | None]],
    recorded: list[str] | None,
    where: _Place,
    impl: Any,
) -> list[tuple[str, str | None]]:
    """The rank's model with megatron-core's ``_extra_state`` entries (None), each after its
    module's last tensor: those a legacy source left out (``recorded``, by their merged
    names), or else the local spec's (each layer's linear layers, its experts' too, and the
    output layer's, TransformerEngine's attention too)."""
    wanted: list[str] = []
    last = where.stage == where.stages - 1
    if recorded:
        for name in recorded:
            found = LAYER.fullmatch(name)
            if found is not None:
                if int(found[1]) in where.layers:
                    number = int(found[1]) - where.layers.start
                    key = _on_expert_rank(
                        f"decoder.layers.{number}.{found[2]}", where.expert_rank, where.local
                    )
                    if key is not None:
                        wanted.append(key)
            elif name.startswith("embedding.") and where.stage == 0:
                wanted.append(name)
            elif not name.startswith("embedding.") and last:
                wanted.append(name)
    else:
        for key, _ in model:
            module = key.rsplit(".", 1)[0]
            if LAYER.fullmatch(key) and module.endswith(_LINEARS):
                wanted.append(module + EXTRA_STATE)
                if impl == "transformer_engine" and module.endswith("self_attention.linear_qkv"):
                    attention = module.removesuffix("linear_qkv") + "core_attention"
                    wanted.append(attention + EXTRA_STATE)
        if last:  # even when tied (an output layer without a weight of its own)
            wanted.append("output_layer" + EXTRA_STATE)
    out = list(model)
    for entry in dict.fromkeys(wanted):  # each once, in order
        module = entry.removesuffix(EXTRA_STATE)
        at = max(
            (i for i, (key, _) in enumerate(out) if key.rsplit(".", 1)[0] == module),
            default=len(out) - 1,
        )
        out.insert(at + 1, (entry, None))
    return out


def _cut_layout(layout: Layout, cut: _Cut, tp: int) -> Layout:
    """One rank's slice of a tensor's layout (its vocabulary padded first)."""
    if cut.rows is not None and cut.rows != layout.shape[0]:
        if cut.rows > layout.shape[0]:
            layout = pad(layout, 0, cut.rows)
        else:
            layout = narrow(layout, 0, 0, cut.rows)
    if cut.rule == "same":
        return layout
    if cut.rule == "row":
        size = layout.shape[1] // tp
        return narrow(layout, 1, cut.rank * size, size)
    groups = 2 if cut.rule == "glu" else 1
    size = layout.shape[0] // (tp * groups)
    return narrow(layout, 0, cut.rank * size, size, groups)


def _cut_tensor(tensor: torch.Tensor, cut: _Cut, tp: int) -> torch.Tensor:
    """:func:`_cut_layout` through torch (a source whose bytes are not laid out in files)."""
    import torch

    if cut.rows is not None and cut.rows != tensor.shape[0]:
        have = tensor.shape[0]
        if cut.rows > have:
            zeros = tensor.new_zeros((cut.rows - have, *tensor.shape[1:]))
            tensor = torch.cat([tensor, zeros])
        else:
            tensor = tensor[: cut.rows]
    if cut.rule == "row":
        tensor = tensor.chunk(tp, dim=1)[cut.rank]
    elif cut.rule == "column":
        tensor = tensor.chunk(tp, dim=0)[cut.rank]
    elif cut.rule == "glu":
        gate, up = tensor.chunk(2, dim=0)
        tensor = torch.cat([gate.chunk(tp)[cut.rank], up.chunk(tp)[cut.rank]])
    return tensor.contiguous()


def written_args(
    inner: Source, args: dict[str, Any], updates: dict[str, Any]
) -> tuple[New, dict[str, Any]]:
    """The args Namespace to write (as the pickle writer takes it), and what reading it back
    gives (to verify the files). A Megatron source's are written as its pickle gave them; any
    other's from their plain values, torch dtypes given back as torch's."""
    raw = getattr(inner, "args_object", None)
    state = build_state(raw.state) if isinstance(raw, Opaque) else None
    fields: dict[str, Any] = {}
    if isinstance(state, dict):
        budget = [_MOST_ARG_VALUES]
        for name, value in state.items():
            if isinstance(name, str):
                fields[name] = _as_written(value, name, inner.path, budget)
    else:
        fields = {name: _from_json(value) for name, value in args.items()}
    shown = dict(args)
    for name, value in {**{k: v for k, v in _RESET.items() if k in fields}, **updates}.items():
        fields[name] = value
        shown[name] = value
    return New(Ref("argparse", "Namespace"), fields), shown


def _as_written(value: Any, name: str, path: Location, budget: list[int], depth: int = 0) -> Any:
    """An arg's value as the pickle gave it, for the writer: plain values, torch dtypes and
    megatron-core's enums; anything else is refused (a checkpoint ckptkit writes holds no
    other object, which would run code where it is loaded)."""
    budget[0] -= 1
    if budget[0] < 0:
        raise FormatError(
            f"{path}: the args hold more than {_MOST_ARG_VALUES} values (args.{name})",
            "is this a Megatron checkpoint?",
        )
    if value is None or isinstance(value, (bool, int, float, str)) and depth < 16:
        return value
    if isinstance(value, (list, tuple)) and depth < 16:
        items = [_as_written(v, name, path, budget, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict) and depth < 16 and all(isinstance(k, str) for k in value):
        return {k: _as_written(v, name, path, budget, depth + 1) for k, v in value.items()}
    if isinstance(value, Global) and _DTYPE_GLOBAL.fullmatch(repr(value)):
        return Ref(*value.name.rsplit(".", 1))
    if (
        isinstance(value, Opaque)
        and MEGATRON_ENUM.fullmatch(value.global_name)
        and len(value.args) == 1
        and isinstance(value.args[0], (int, str))
        and value.state is None
    ):
        return Call(Ref(*value.global_name.rsplit(".", 1)), value.args)
    raise FormatError(
        f"{path}: args.{name} holds {repr(value)[:60]}, an object ckptkit does not write into "
        "a checkpoint (plain values, torch dtypes and megatron-core's enums only)",
        "convert a save whose args hold plain values, or report the arg",
    )


def _from_json(value: Any) -> Any:
    """A plain value kept as text (``<global torch.bfloat16>``) given back as torch's dtype."""
    if isinstance(value, str) and _DTYPE_GLOBAL.fullmatch(value):
        return Ref("torch", value[len("<global torch.") : -1])
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    return value


def parallel_sizes(*values: int | None) -> tuple[int, ...]:
    """``--tp``, ``--pp``, ``--ep`` and ``--vpp`` checked: whole numbers from 1 to
    :data:`MOST_PARALLEL` (None: 1)."""
    sizes = []
    for flag, value in zip(("--tp", "--pp", "--ep", "--vpp"), values, strict=False):
        size = 1 if value is None else value
        if not 1 <= size <= MOST_PARALLEL:
            raise UsageError(f"{flag} {size} is not a parallel size", f"give 1 to {MOST_PARALLEL}")
        sizes.append(size)
    return tuple(sizes)
