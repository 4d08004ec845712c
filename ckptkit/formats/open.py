"""``open_source``: the one door to every reader, chosen by what the path holds.

Folder layouts are tried first (a diffusers pipeline, a model folder by diffusers' names or a
variant, DCP, every rank's files, DeepSpeed, a model folder, a sharded index), then a single file
by its content. Nothing in the checkpoint runs; torch is imported only
when a tensor is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ckptkit.errors import FormatError, SelectError, UnsafeCheckpointError, UsageError
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
    MODEL_FILES,
    adapter_file_in,
    find_dcp,
    find_deepspeed,
    folder_parts,
    model_file_in,
)
from ckptkit.formats.folders.rank_files import find_rank_files
from ckptkit.formats.folders.runs import LATEST, run_checkpoint
from ckptkit.formats.io.rangefile import RangeFile
from ckptkit.formats.io.remote import RemotePath, is_url, open_remote

__all__ = ["open_source", "checkpoint_index"]


def checkpoint_index(path: Path) -> Path | None:
    """The shard index a path stands for (an ``*.index.json``, or a folder holding one)."""
    from ckptkit.formats.folders.sharded import find_index

    if path.is_dir():
        return find_index(path)
    return path if is_index_name(path.name) and path.is_file() else None


def open_source(
    path: str | Path,
    *,
    select: str | None = None,
    trust: bool = False,
    allow_globals: Iterable[str] = (),
    check_safety: bool = True,
    ema: bool = False,
    variant: str | None = None,
    names_from: str | Path | None = None,
    unnamed: bool = False,
) -> Source:
    """Open a checkpoint for reading, without executing any of its code.

    Args:
        path: a torch zip or legacy file, a safetensors file, a sharded checkpoint (its
            ``*.index.json``, or the folder holding it), a model folder (``save_pretrained``'s,
            transformers' or diffusers', Accelerate's ``save_state``), a diffusers pipeline
            folder (with ``select``), a DeepSpeed checkpoint folder, a DCP folder (or its
            ``.metadata``), or every rank's ``torch.save`` of a sharded model (a folder holding
            them, or a glob such as ``ckpt/model_rank*.pt``).
        select: dotted path of the state dict inside a training checkpoint (default: found);
            in a folder, the model file (``model_1``); in a diffusers pipeline folder, the
            component (``unet``); for DeepSpeed ``fp32`` or ``module``.
        trust: load with torch's full unpickler, which can run code from the file.
        allow_globals: globals (``module.Name``) admitted beside torch's safe set; they are
            still never imported, only recorded. Names that execute or import are refused.
        check_safety: False reads a torch file whatever its safety verdict (for ``inspect``:
            the reading is static, nothing in the file runs).
        ema: take a training checkpoint's EMA copy of the weights (``state_dict_ema``...).
        variant: in a model folder, the weights of this variant
            (``diffusion_pytorch_model.fp16.safetensors`` for ``"fp16"``); by default the file
            without a variant, else the only one.
        names_from: the model (folder or file) a diffusers ``EMAModel`` state dict's
            ``shadow_params`` belong to: they take its parameter names, in order.
        unnamed: open an ``EMAModel`` state dict without ``names_from``, its tensors keyed by
            position (``"0"``, ``"1"``...; ``inspect``) rather than refusing it.

    Raises:
        FormatError: the file is not a readable checkpoint.
        UnsafeCheckpointError: the pickle names globals outside the safe set.
        SelectError: no state dict found, or ``select`` names none; a pipeline folder without
            ``select``; no ``variant`` of that name, or several and none chosen; an
            ``EMAModel`` state dict without ``names_from``.
        UsageError: ``variant`` for a file, ``names_from`` for anything but an ``EMAModel``.
    """
    if is_url(path):
        url = RemotePath(str(path))
        if variant is not None:
            raise UsageError(f"--variant picks the weights of a model folder, and {url} is a file")
        source = _open_url(url, select, trust, allow_globals, check_safety, ema)
        return _named(url, source, names_from, variant, unnamed)  # type: ignore[arg-type]
    path = Path(path)
    if variant is not None and names_from is None and not path.is_dir():
        raise UsageError(
            f"--variant picks the weights of a model folder, and {path} is not a folder",
            "drop --variant",
            api_hint="drop variant=",
        )
    source = _open(path, select, trust, allow_globals, check_safety, ema, variant)
    return _named(path, source, names_from, variant, unnamed)


def _open(
    path: Path,
    select: str | None,
    trust: bool,
    allow_globals: Iterable[str],
    check_safety: bool,
    ema: bool,
    variant: str | None,
) -> Source:
    run = run_checkpoint(path, select)
    if run is not None:  # ckptkit train's --out folder: the checkpoint `latest` names
        checkpoint, why = run
        source = open_source(
            checkpoint,
            trust=trust,
            allow_globals=allow_globals,
            check_safety=check_safety,
            ema=ema,
            unnamed=True,
        )
        source.selected_reason += f"; {checkpoint.name}, {why}"
        return source
    folder = _open_folder(path, select, trust, allow_globals, ema, variant)
    if folder is not None:
        return folder
    return _open_file(path, select, trust, allow_globals, check_safety, ema)


def _named(
    path: Path, source: Source, names_from: str | Path | None, variant: str | None, unnamed: bool
) -> Source:
    """A diffusers EMAModel's shadow_params named after ``names_from``'s parameters; refused
    without it (unless ``unnamed``); ``names_from`` refused for anything else."""
    from ckptkit.formats.folders.diffusers import ShadowNamedSource

    if source.unnamed and names_from is not None:
        try:
            return ShadowNamedSource(source, Path(names_from), opener=open_source, variant=variant)
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


def _open_diffusers(
    path: Path,
    select: str | None,
    trust: bool,
    allow_globals: Iterable[str],
    variant: str | None,
) -> Source | None:
    """A diffusers pipeline's component, or a model folder's weights by their variant."""
    if is_pipeline(path):
        component = pipeline_component(path, select)
        source = open_source(
            component.folder, trust=trust, allow_globals=allow_globals, variant=variant
        )
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
    return _open_weights(path, weights, trust, allow_globals)


def _open_weights(
    path: Path, weights: Weights, trust: bool, allow_globals: Iterable[str]
) -> Source:
    source: Source
    if weights.sharded:
        from ckptkit.formats.folders.sharded import ShardedSource

        source = ShardedSource(weights.path, opener=open_source, allow_globals=allow_globals)
    else:
        source = open_source(weights.path, trust=trust, allow_globals=allow_globals)
    source.selected_reason = describe_weights(weights)
    source.folder = path
    source.weights_name = WEIGHTS_NAME if weights.diffusers else None
    return source


def _open_folder(
    path: Path,
    select: str | None,
    trust: bool,
    allow_globals: Iterable[str],
    ema: bool,
    variant: str | None,
) -> Source | None:
    """The reader of a folder layout ``path`` stands for, or None for a single file."""
    if path.is_dir():
        diffusers = _open_diffusers(path, select, trust, allow_globals, variant)
        if diffusers is not None:
            return diffusers
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
        tag = find_deepspeed(path)
        if tag is not None:  # DeepSpeed's engine.save_checkpoint (Lightning's DeepSpeed too)
            from ckptkit.formats.folders.deepspeed import DeepSpeedSource

            return DeepSpeedSource(path, tag, select=select)
        adapter = adapter_file_in(path)
        if adapter is not None:  # a PEFT adapter folder: ckptkit.adapters reads its config
            source = open_source(adapter, allow_globals=allow_globals)
            source.selected_reason = f"{adapter.name} of the PEFT adapter folder"
            return source
        model_file = model_file_in(path, select)
        if model_file is None and select:
            raise SelectError(
                f"{path} holds no model file '{select}' (.safetensors or .bin)",
                "name one of its model files without the suffix, e.g. --select model_1",
            )
        if model_file is not None:  # a model folder (save_pretrained, Accelerate save_state)
            source = open_source(model_file, trust=trust, allow_globals=allow_globals)
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
        sharded = ShardedSource(index, opener=open_source, allow_globals=allow_globals)
        sharded.folder = index.parent
        return sharded
    return None


def _open_url(
    url: RemotePath,
    select: str | None,
    trust: bool,
    allow_globals: Iterable[str],
    check_safety: bool,
    ema: bool,
) -> Source:
    """The reader of one checkpoint file at a URL: its headers read with ranged requests,
    its tensors fetched when they are loaded."""
    if trust:
        raise UsageError(
            f"--trust runs torch's full unpickler, which reads {url} from a local disk",
            "download it first, or drop --trust",
        )
    if not url.suffix and url.name != ".metadata":
        url = _in_folder(url)  # a folder (a prefix): the file its layout reads
    if url.name == ".metadata":
        from ckptkit.formats.folders.dcp import DCPSource  # a DCP folder: .metadata, then chunks

        return DCPSource(url.parent, select=select, ema=ema)  # type: ignore[arg-type]
    if url.name.endswith(".index.json"):  # a sharded checkpoint: the index, then each shard
        from ckptkit.formats.folders.sharded import ShardedSource

        if select not in (None, ""):
            raise FormatError(f"{url} is a sharded state dict", "drop --select")
        return ShardedSource(url, opener=open_source, allow_globals=allow_globals)  # type: ignore[arg-type]
    raw = RangeFile(open_remote(url))
    try:
        kind = remote_kind(url, raw)
        if kind == "gguf":
            raise FormatError(
                f"{url} is a GGUF file; ckptkit describes local GGUF files",
                "download it and give the local copy",
            )
        if kind == "safetensors":
            from ckptkit.formats.files.safetensors import SafetensorsSource

            return SafetensorsSource(url, select=select, raw=raw)  # type: ignore[arg-type]
        from ckptkit.formats.files.torchfile import TorchFileSource

        return TorchFileSource(
            url,  # type: ignore[arg-type]
            select=select,
            allow_globals=allow_globals,
            check_safety=check_safety,
            ema=ema,
            raw=raw,
        )
    except BaseException:
        raw.close()
        raise


# What a folder at a URL is read by, in the order a local folder's layout is tried: a DCP
# save, a sharded index, then the single weights files of transformers and diffusers folders.
_FOLDER_FILES = (
    ".metadata",
    "model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    *MODEL_FILES,
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.bin",
)


def _in_folder(url: RemotePath) -> RemotePath:
    """The file a URL without a suffix stands for when it is a folder (a model repository, a
    DCP save): found by listing it, as a local folder's layout is found by its names; a URL
    that is no folder is given back as it is (then read as a file)."""
    names = url.names()
    if names is None:  # http(s): no listing; a DCP folder is still found by its .metadata
        if (url / ".metadata").is_file():
            return url / ".metadata"
        if not url.is_file():
            raise FormatError(
                f"{url} is no file, and a folder cannot be listed over HTTP",
                "give the checkpoint file's URL",
            )
        return url
    if not names:
        return url
    if LATEST in names:  # ckptkit train's --out: the checkpoint `latest` names
        pointed = (url / LATEST).read_text().strip()
        if pointed in names:
            return _in_folder(url / pointed) if "." not in pointed else url / pointed
    for name in _FOLDER_FILES:
        if name in names:
            return url / name
    shown = ", ".join(sorted(n for n in names if not n.startswith("."))[:8])
    raise FormatError(
        f"{url} is a folder with no DCP save, sharded index, model.safetensors, "
        "pytorch_model.bin or diffusers weights (it holds: " + (shown or "nothing") + ")",
        "give the checkpoint file's URL",
    )


def _open_file(
    path: Path,
    select: str | None,
    trust: bool,
    allow_globals: Iterable[str],
    check_safety: bool,
    ema: bool,
) -> Source:
    """The reader of one checkpoint file, chosen by its content."""
    kind = detect_format(path)
    if kind == "gguf":
        from ckptkit.formats.files.gguf import GGUFSource

        return GGUFSource(path)
    if kind == "safetensors":
        from ckptkit.formats.files.safetensors import SafetensorsSource

        return SafetensorsSource(path, select=select)
    from ckptkit.formats.files.torchfile import TorchFileSource, TrustedTorchSource

    if trust:
        return TrustedTorchSource(path, select=select, ema=ema)
    try:
        return TorchFileSource(
            path, select=select, allow_globals=allow_globals, check_safety=check_safety, ema=ema
        )
    except UnsafeCheckpointError:
        from ckptkit.formats.folders.rank_files import one_rank_error

        error = one_rank_error(path)
        if error is not None:
            raise error from None
        raise
