"""``open_source``: the one door to every reader, chosen by what the path holds.

Folder layouts are tried first (a diffusers pipeline, a model folder by diffusers' names or a
variant, DCP, every rank's files, DeepSpeed, a model folder, a sharded index), then a single file
by its content. Nothing in the checkpoint runs; torch is imported only
when a tensor is loaded.

A folder at a URL (a prefix: ``s3://bucket/run``) is told by the same checks, which its
:class:`~ckptkit.storage.location.Location` answers from one listing per folder; its files
are then read with ranged requests. Over HTTP nothing is listed: only a DCP folder (found by its
``.metadata``) or a file can be named there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptkit.errors import (
    CkptkitError,
    FormatError,
    MissingFileError,
    SelectError,
    UnsafeCheckpointError,
    UsageError,
)
from ckptkit.formats.base.source import Source
from ckptkit.formats.files.readings import detect_format, remote_kind
from ckptkit.formats.folders.diffusers import (
    WEIGHTS_NAME,
    Weights,
    describe_weights,
    is_index_name,
    is_pipeline,
    pipeline_component,
    weights_in,
)
from ckptkit.formats.folders.layouts import (
    adapter_file_in,
    find_dcp,
    find_deepspeed,
    folder_files,
    folder_parts,
    model_file_in,
    model_parallel_files,
    model_parallel_refusal,
)
from ckptkit.formats.folders.megatron import find_megatron, megatron_rank_refusal
from ckptkit.formats.folders.nemo import find_nemo2
from ckptkit.formats.folders.rank_files import find_rank_files
from ckptkit.formats.folders.runs import run_checkpoint, step_checkpoint, trainer_checkpoint
from ckptkit.storage.location import (
    Location,
    is_local,
    listable,
    listing,
    local_path,
    location,
    url_file,
)

__all__ = ["open_source", "OpenOptions", "checkpoint_index"]

Opener = Callable[..., Source]  # open_source with the caller's trust and safety options bound


def checkpoint_index(path: Location) -> Location | None:
    """The shard index a path stands for (an ``*.index.json``, or a folder holding one)."""
    from ckptkit.formats.folders.sharded import find_index

    if path.is_dir():
        return find_index(path)
    return path if is_index_name(path.name) and path.is_file() else None


@dataclass(frozen=True, kw_only=True)
class OpenOptions:
    """How a checkpoint is opened: which of its weights are read (``select``, ``ema``,
    ``variant``, ``names_from``, ``unnamed``) and how safely its pickles are read (``trust``,
    ``allow_globals``, ``check_safety``). The one object every reader of a path is given: a
    LoRA adapter's base is opened with the source's options (its weights chosen by them), the
    adapter itself with :meth:`safety` alone (it holds one set of weights: nothing to choose).
    """

    select: str | None = None
    ema: bool = False
    variant: str | None = None
    names_from: str | Path | None = None
    unnamed: bool = False
    trust: bool = False
    allow_globals: tuple[str, ...] = ()
    check_safety: bool = True

    def __post_init__(self) -> None:
        # Any iterable of names is accepted; kept as a tuple, so the options stay hashable.
        object.__setattr__(self, "allow_globals", tuple(self.allow_globals))

    @property
    def chooses_weights(self) -> bool:
        """Whether an option picks among a checkpoint's weights (``--select``, ``--ema``,
        ``--variant``, ``--names-from``)."""
        return (
            self.select is not None
            or self.ema
            or self.variant is not None
            or self.names_from is not None
        )

    def safety(self) -> OpenOptions:
        """The options that apply to any file read (how its pickle is read), without those that
        choose weights inside it."""
        return OpenOptions(
            trust=self.trust, allow_globals=self.allow_globals, check_safety=self.check_safety
        )


def open_source(
    path: str | Path | Location, options: OpenOptions | None = None, **changes: Any
) -> Source:
    """Open a checkpoint for reading, without executing any of its code.

    Args:
        path: a torch zip or legacy file, a safetensors file, a sharded checkpoint (its
            ``*.index.json``, or the folder holding it), a model folder (``save_pretrained``'s,
            transformers' or diffusers', Accelerate's ``save_state``), a diffusers pipeline
            folder (with ``select``), a DeepSpeed checkpoint folder, a DCP folder (or its
            ``.metadata``), or every rank's ``torch.save`` of a sharded model (a folder holding
            them, or a glob such as ``ckpt/model_rank*.pt``).
        options: how it is opened (default: ``OpenOptions()``); its fields:

            - ``select``: dotted path of the state dict inside a training checkpoint (default:
              found); in a folder, the model file (``model_1``); in a diffusers pipeline folder,
              the component (``unet``); for DeepSpeed ``fp32`` or ``module``.
            - ``ema``: take a training checkpoint's EMA copy of the weights
              (``state_dict_ema``...).
            - ``variant``: in a model folder, the weights of this variant
              (``diffusion_pytorch_model.fp16.safetensors`` for ``"fp16"``); by default the file
              without a variant, else the only one.
            - ``names_from``: the model (folder or file) a diffusers ``EMAModel`` state dict's
              ``shadow_params`` belong to: they take its parameter names, in order.
            - ``unnamed``: open an ``EMAModel`` state dict without ``names_from``, its tensors
              keyed by position (``"0"``, ``"1"``...; ``inspect``) rather than refusing it.
            - ``trust``: load with torch's full unpickler, which can run code from the file.
            - ``allow_globals``: globals (``module.Name``) admitted beside torch's safe set;
              they are still never imported, only recorded. Names that execute or import are
              refused.
            - ``check_safety``: False reads a torch file whatever its safety verdict (for
              ``inspect``: the reading is static, nothing in the file runs).
        changes: fields of ``options`` given by name instead (``open_source(p, select="model")``),
            or changed (a folder's reader opening a file with ``variant=`` its own).

    Raises:
        FormatError: the file is not a readable checkpoint.
        UnsafeCheckpointError: the pickle names globals outside the safe set.
        SelectError: no state dict found, or ``select`` names none; a pipeline folder without
            ``select``; no ``variant`` of that name, or several and none chosen; an
            ``EMAModel`` state dict without ``names_from``.
        UsageError: ``variant`` for a file, ``names_from`` for anything but an ``EMAModel``.
    """
    given = options or OpenOptions()
    chosen = replace(given, **changes) if changes else given
    # One given by a reader of a folder keeps what was learnt of it (listings, probes).
    where = location(path)
    if not is_local(where):  # at a URL: read by ranged requests, folders by their listings
        # --variant with --names-from picks the weights of the model named there
        own = chosen if chosen.names_from is None else replace(chosen, variant=None)
        return _named(where, _open_url(where, own), chosen)
    path = local_path(where)
    if chosen.variant is not None and chosen.names_from is None and not path.is_dir():
        raise UsageError(
            f"--variant picks the weights of a model folder, and {path} is not a folder",
            "drop --variant",
            api_hint="drop variant=",
        )
    source = _open(path, chosen)
    if path.is_dir():
        _note_followed(source, path)
    return _named(path, source, chosen)


def _note_followed(source: Source, folder: Location) -> None:
    """Say which of a folder's files are read from outside it (symlinked elsewhere): what was
    followed is reported, never silent. A model folder's config and tokenizer files count:
    a converted copy of the folder carries them."""
    inside = local_path(folder).resolve()
    copied = folder_files(source.folder) if source.folder is not None else []
    for file in [*source.files(), *copied]:
        if isinstance(file, Path) and not file.resolve().is_relative_to(inside):
            shown = f"{file} -> {file.resolve()}"
            if shown not in source.followed:
                source.followed.append(shown)
    if source.followed:
        source.selected_reason += f"; read from outside {folder}: {', '.join(source.followed)}"


def _open(path: Location, options: OpenOptions) -> Source:
    layout = _open_layout(path, options)
    if layout is not None:
        return layout
    return _open_file(path, options)


def _open_layout(path: Location, options: OpenOptions) -> Source | None:
    """The reader of what a folder (or a glob of rank files) holds by its layout, a local one
    or one at a URL (its Location answers the layouts' checks from its listings); None for a
    single file."""
    # What a folder's files are opened with: the caller's trust and safety check (inspect
    # describes a model folder's hostile pickle as it does the file itself).
    opener = functools.partial(open_source, options=options.safety())
    select, ema = options.select, options.ema
    run = run_checkpoint(path, select)
    if run is not None:  # ckptkit train's --out folder: the checkpoint `latest` names
        return _pointed_to(opener(run[0], ema=ema, unnamed=True), *run)
    trainer = trainer_checkpoint(path, select)
    if trainer is not None:  # a Trainer's output_dir: its newest checkpoint-N
        chosen = trainer[1] == "chosen with --select"
        source = opener(
            trainer[0], select=None if chosen else select, ema=ema, variant=options.variant
        )
        return _pointed_to(source, *trainer)
    steps = step_checkpoint(path, select)
    if steps is not None:  # torchtitan's dump folder: its newest checkpoint/step-N
        chosen = steps[1] == "chosen with --select"
        source = opener(steps[0], select=None if chosen else select, ema=ema)
        return _pointed_to(source, *steps)
    return _open_folder(path, options, opener)


def _pointed_to(source: Source, checkpoint: Location, why: str) -> Source:
    """A checkpoint a folder points to (``latest``, the newest ``checkpoint-N``), said so."""
    source.selected_reason += f"; {checkpoint.name}, {why}"
    return source


def _named(path: Location, source: Source, options: OpenOptions) -> Source:
    """A diffusers EMAModel's shadow_params named after ``names_from``'s parameters; refused
    without it (unless ``unnamed``); ``names_from`` refused for anything else."""
    from ckptkit.formats.folders.diffusers import ShadowNamedSource

    names_from, variant, unnamed = options.names_from, options.variant, options.unnamed

    if source.unnamed and names_from is not None:
        try:
            return ShadowNamedSource(
                source, location(names_from), opener=open_source, variant=variant
            )
        except BaseException:
            source.close()
            raise
    if source.unnamed and not unnamed:
        count = len(source.keys())
        source.close()
        raise SelectError(
            f"{source.path} is a diffusers EMAModel state dict: its {count} weights are "
            "'shadow_params', a list without names",
            "name them after the model it averages: --ema --names-from MODEL_FOLDER",
            api_hint="name them after the model it averages: ema=True, names_from=MODEL_FOLDER",
        )
    if names_from is not None and not source.unnamed:
        source.close()
        raise UsageError(
            f"--names-from names a diffusers EMAModel's shadow_params, and {path} holds "
            "no EMAModel state dict",
            "drop --names-from",
            api_hint="drop names_from=",
        )
    return source


def _open_diffusers(path: Location, options: OpenOptions, opener: Opener) -> Source | None:
    """A diffusers pipeline's component, or a model folder's weights by their variant."""
    select, variant = options.select, options.variant
    if is_pipeline(path):
        component = pipeline_component(path, select)
        source = opener(component.folder, variant=variant)
        source.selected_reason = (
            f"the '{component.name}' component ({component.cls}) of the diffusers pipeline: "
            + source.selected_reason
        )
        return source
    weights = weights_in(path, variant)
    if weights is None:
        return None
    if select:
        raise SelectError(
            f"{path} is a model folder of one model ({weights.path.name})",
            "drop --select (--variant picks another variant)",
            api_hint="drop select= (variant= picks another variant)",
        )
    return _open_weights(path, weights, opener)


def _open_weights(path: Location, weights: Weights, opener: Opener) -> Source:
    source: Source
    if weights.sharded:
        from ckptkit.formats.folders.sharded import ShardedSource

        source = ShardedSource(weights.path, opener=opener)
    else:
        source = opener(weights.path)
    source.selected_reason = describe_weights(weights)
    source.folder = path
    source.weights_name = WEIGHTS_NAME if weights.diffusers else None
    return source


def _open_folder(path: Location, options: OpenOptions, opener: Opener) -> Source | None:
    """The reader of a folder layout ``path`` stands for, or None for a single file."""
    select, ema = options.select, options.ema
    refusal = megatron_rank_refusal(path) if path.is_dir() else None
    if refusal is not None:  # one rank's folder of a Megatron save: a slice, not the model
        raise refusal
    if path.is_dir():
        diffusers = _open_diffusers(path, options, opener)
        if diffusers is not None:
            return diffusers
    if is_local(path) and find_nemo2(path):  # NeMo 2: context/ and a torch_dist weights/
        from ckptkit.formats.folders.nemo import NeMo2Source

        return NeMo2Source(path, select=select, allowed=options.allow_globals)
    megatron = find_megatron(path) if not _is_glob(path) else None
    if megatron is not None and megatron.kind == "legacy":  # Megatron-LM's mp_rank_* files
        from ckptkit.formats.folders.megatron import MegatronSource

        return MegatronSource(megatron, select=select, allowed=options.allow_globals)
    if megatron is not None:  # Megatron's torch_dist: DCP, its layers stacked
        from ckptkit.formats.folders.megatron import MegatronDistSource

        return MegatronDistSource(megatron, select=select, allowed=options.allow_globals)
    dcp = find_dcp(path)
    if dcp is not None:  # torch.distributed.checkpoint (FSDP, Lightning's FSDP strategy)
        from ckptkit.formats.folders.dcp import DCPSource

        return DCPSource(dcp, select=select, ema=ema)
    ranks = None if checkpoint_index(path) else find_rank_files(path)
    if ranks is not None:  # every rank's torch.save of a sharded (DTensor) state dict
        from ckptkit.formats.folders.rank_files import RankFilesSource

        return RankFilesSource(*ranks, select=select, ema=ema)
    index = checkpoint_index(path)
    if index is None and path.is_dir():
        parallel = model_parallel_files(path)
        if parallel is not None:  # Meta's consolidated.NN.pth: only a mapping joins them
            raise model_parallel_refusal(path, parallel)
        tag = find_deepspeed(path)
        if tag is not None:  # DeepSpeed's engine.save_checkpoint (Lightning's DeepSpeed too)
            from ckptkit.formats.folders.deepspeed import DeepSpeedSource

            return DeepSpeedSource(path, tag, select=select)
        adapter = adapter_file_in(path)
        if adapter is not None:  # a PEFT adapter folder: ckptkit.adapters reads its config
            source = opener(adapter, trust=False)
            source.selected_reason = f"{adapter.name} of the PEFT adapter folder"
            return source
        model_file = model_file_in(path, select)
        if model_file is None and select:
            raise SelectError(
                f"{path} holds no model file '{select}' (.safetensors or .bin)",
                "name one of its model files without the suffix, e.g. --select model_1",
            )
        if model_file is not None:  # a model folder (save_pretrained, Accelerate save_state)
            source = opener(model_file)
            others = [
                name.split(".")[0]
                for name, kind in folder_parts(path)
                if kind == "model weights" and name != model_file.name
            ]
            source.selected_reason = f"{model_file.name} of the folder" + (
                f"; --select {' or '.join(others)} for another" if others else ""
            )
            source.folder = path
            return source
    if index is not None:
        from ckptkit.formats.folders.sharded import ShardedSource

        if select not in (None, ""):
            raise FormatError(f"{path} is a sharded state dict", "drop --select")
        sharded = ShardedSource(index, opener=opener)
        sharded.folder = index.parent
        return sharded
    return None


def _open_url(url: Location, options: OpenOptions) -> Source:
    """The reader of a checkpoint at a URL: one file, its headers read with ranged requests and
    its tensors fetched when they are loaded; or a folder (a prefix) or a glob of rank files,
    listed and read by its layout as a local folder is."""
    if options.trust:
        raise UsageError(
            f"--trust runs torch's full unpickler, which reads {url} from a local disk",
            "download it first, or drop --trust",
        )
    if _is_glob(url) or (not url.suffix and url.name != ".metadata"):
        folder = _open_url_folder(url, options)
        if folder is not None:
            return folder
        return _open_url_file(url, options)
    try:
        return _open_url_file(url, options)
    except (MissingFileError, UsageError):
        # No object: a folder named like a file (Lightning's DeepSpeed epoch=0-step=3.ckpt/)?
        folder = None
        if _is_folder(url):
            folder = _open_url_folder(url, options)
        if folder is None:
            raise
        return folder


def _is_glob(url: Location) -> bool:
    return any(c in url.name for c in "*?[")


def _is_folder(url: Location) -> bool:
    """Whether a URL that is no object is a folder (a prefix holding some): one listing."""
    try:
        return listable(url) and url.is_dir()
    except CkptkitError:  # the error that came first says it
        return False


def _open_url_file(url: Location, options: OpenOptions) -> Source:
    """The reader of one file at a URL (DCP's ``.metadata`` and a shard index included)."""
    select, ema, variant = options.select, options.ema, options.variant
    if variant is not None:
        raise UsageError(
            f"--variant picks the weights of a model folder, and {url} is a file",
            "drop --variant",
            api_hint="drop variant=",
        )
    if url.name == ".metadata":
        from ckptkit.formats.folders.dcp import DCPSource  # a DCP folder: .metadata, then chunks

        return DCPSource(url.parent, select=select, ema=ema)
    if url.name.endswith(".index.json"):  # a sharded checkpoint: the index, then each shard
        from ckptkit.formats.folders.sharded import ShardedSource

        if select not in (None, ""):
            raise FormatError(f"{url} is a sharded state dict", "drop --select")
        return ShardedSource(url, opener=open_source, allow_globals=options.allow_globals)
    raw = url_file(url)  # what a layout's check fetched of it is not fetched again
    assert raw is not None  # a URL's
    try:
        kind = remote_kind(url, raw)
        if kind == "gguf":
            raise FormatError(
                f"{url} is a GGUF file; ckptkit describes local GGUF files",
                "download it and give the local copy",
            )
        if kind == "safetensors":
            from ckptkit.formats.files.safetensors import SafetensorsSource

            return SafetensorsSource(url, select=select, raw=raw)
        from ckptkit.formats.files.torchfile import TorchFileSource

        return TorchFileSource(
            url,
            select=select,
            allow_globals=options.allow_globals,
            check_safety=options.check_safety,
            ema=ema,
            raw=raw,
        )
    except UnsafeCheckpointError as exc:  # one rank's file of a sharded save: name the set
        from ckptkit.formats.pickles.unpickler import SHARDED_KINDS

        raw.close()
        sharded = [k for k in SHARDED_KINDS for g in exc.globals if g.endswith("." + k)]
        if not sharded:
            raise
        from ckptkit.formats.folders.rank_files import one_rank_refusal

        raise one_rank_refusal(url, sharded[0]) from None
    except BaseException:
        raw.close()
        raise


# Over HTTP, where nothing is listed: how to name a folder instead.
_LISTABLE = "give its s3:// (or other listable) URL, or download it and give the local copy"


def _open_url_folder(url: Location, options: OpenOptions) -> Source | None:
    """The reader of a folder at a URL (a model repository, a DCP save, DeepSpeed's, every
    rank's files, a diffusers pipeline...) or of a glob of rank files, by the layout a local
    folder is read by (:func:`_open_layout`, its checks answered from one listing per folder);
    None when the URL is no folder (then read as a file)."""
    glob = _is_glob(url)
    if not listable(url):  # http(s): no listing; a DCP folder is still found by its .metadata
        if glob:
            raise FormatError(f"{url} is a glob, and files cannot be listed over HTTP", _LISTABLE)
        if (url / ".metadata").is_file():
            from ckptkit.formats.folders.dcp import DCPSource

            return DCPSource(url, select=options.select, ema=options.ema)
        if not url.is_file():
            raise FormatError(
                f"{url} is no file, and a folder cannot be listed over HTTP",
                "give the checkpoint file's URL; for a folder, " + _LISTABLE,
            )
        return None
    names = listing(url.parent if glob else url)
    if not glob and not names:
        return None  # no folder: an object (or nothing) there
    source = _open_layout(url, options)
    if source is None:
        shown = ", ".join(sorted(n for n in names if not n.startswith("."))[:8])
        raise FormatError(
            f"{url} is a folder with no DCP save, sharded index, model.safetensors, "
            "pytorch_model.bin, diffusers, PEFT, DeepSpeed or rank files (it holds: "
            + (shown or "nothing")
            + ")",
            "give the checkpoint file's URL",
        )
    return source


def _open_file(path: Location, options: OpenOptions) -> Source:
    """The reader of one local checkpoint file, chosen by its content."""
    select, ema = options.select, options.ema
    kind = detect_format(local_path(path))
    if kind == "gguf":
        from ckptkit.formats.files.gguf import GGUFSource

        return GGUFSource(path)
    if kind == "safetensors":
        from ckptkit.formats.files.safetensors import SafetensorsSource

        return SafetensorsSource(path, select=select)
    from ckptkit.formats.files.torchfile import TorchFileSource, TrustedTorchSource

    refusal = megatron_rank_refusal(path)
    if refusal is not None:  # one rank's file of a Megatron save: a slice, not the model
        raise refusal
    if options.trust:
        return TrustedTorchSource(path, select=select, ema=ema)
    try:
        return TorchFileSource(
            path,
            select=select,
            allow_globals=options.allow_globals,
            check_safety=options.check_safety,
            ema=ema,
        )
    except UnsafeCheckpointError:
        from ckptkit.formats.folders.rank_files import one_rank_error

        error = one_rank_error(path)
        if error is not None:
            raise error from None
        raise
