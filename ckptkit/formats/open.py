"""``open_source``: the one door to every reader, chosen by what the path holds.

Folder layouts are tried first (DCP, every rank's files, DeepSpeed, a model folder, a sharded
index), then a single file by its content. Nothing in the checkpoint runs; torch is imported only
when a tensor is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ckptkit.errors import FormatError, SelectError, UnsafeCheckpointError
from ckptkit.formats.base.source import Source
from ckptkit.formats.files.readings import detect_format
from ckptkit.formats.folders.layouts import (
    adapter_file_in,
    find_dcp,
    find_deepspeed,
    folder_parts,
    model_file_in,
)
from ckptkit.formats.folders.rank_files import find_rank_files
from ckptkit.formats.folders.runs import run_checkpoint

__all__ = ["open_source", "checkpoint_index"]


def checkpoint_index(path: Path) -> Path | None:
    """The shard index a path stands for (an ``*.index.json``, or a folder holding one)."""
    from ckptkit.formats.folders.sharded import find_index

    if path.is_dir():
        return find_index(path)
    return path if path.name.endswith(".index.json") and path.is_file() else None


def open_source(
    path: str | Path,
    *,
    select: str | None = None,
    trust: bool = False,
    allow_globals: Iterable[str] = (),
    check_safety: bool = True,
    ema: bool = False,
) -> Source:
    """Open a checkpoint for reading, without executing any of its code.

    Args:
        path: a torch zip or legacy file, a safetensors file, a sharded checkpoint (its
            ``*.index.json``, or the folder holding it), a model folder (``save_pretrained``,
            Accelerate's ``save_state``), a DeepSpeed checkpoint folder, a DCP folder (or its
            ``.metadata``), or every rank's ``torch.save`` of a sharded model (a folder holding
            them, or a glob such as ``ckpt/model_rank*.pt``).
        select: dotted path of the state dict inside a training checkpoint (default: found);
            in a folder, the model file (``model_1``); for DeepSpeed ``fp32`` or ``module``.
        trust: load with torch's full unpickler, which can run code from the file.
        allow_globals: globals (``module.Name``) admitted beside torch's safe set; they are
            still never imported, only recorded. Names that execute or import are refused.
        check_safety: False reads a torch file whatever its safety verdict (for ``inspect``:
            the reading is static, nothing in the file runs).
        ema: take a training checkpoint's EMA copy of the weights (``state_dict_ema``...).

    Raises:
        FormatError: the file is not a readable checkpoint.
        UnsafeCheckpointError: the pickle names globals outside the safe set.
        SelectError: no state dict found, or ``select`` names none.
    """
    path = Path(path)
    run = run_checkpoint(path, select)
    if run is not None:  # ckptkit train's --out folder: the checkpoint `latest` names
        checkpoint, why = run
        source = open_source(
            checkpoint,
            trust=trust,
            allow_globals=allow_globals,
            check_safety=check_safety,
            ema=ema,
        )
        source.selected_reason += f"; {checkpoint.name}, {why}"
        return source
    folder = _open_folder(path, select, trust, allow_globals, ema)
    if folder is not None:
        return folder
    return _open_file(path, select, trust, allow_globals, check_safety, ema)


def _open_folder(
    path: Path, select: str | None, trust: bool, allow_globals: Iterable[str], ema: bool
) -> Source | None:
    """The reader of a folder layout ``path`` stands for, or None for a single file."""
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
