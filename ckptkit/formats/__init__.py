"""On-disk formats: detection by content, ``open_source`` for reading, writers for output.

Importing this package does not import torch; readers import it only when a tensor is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ckptkit.errors import FormatError, SelectError, UnsafeCheckpointError, UsageError
from ckptkit.formats.detect import (
    detect_format,
    find_dcp,
    find_deepspeed,
    folder_parts,
    model_file_in,
)
from ckptkit.formats.rank_files import find_rank_files
from ckptkit.formats.source import Source, TensorInfo

__all__ = [
    "Source",
    "TensorInfo",
    "detect_format",
    "open_source",
    "OUTPUT_FORMATS",
    "TO_FORMATS",
    "output_format",
]

# Output format by suffix.
OUTPUT_FORMATS = {
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".ckpt": "torch",
    ".tar": "torch",  # .pth.tar, as torchvision's references name their checkpoints
}


def checkpoint_index(path: Path) -> Path | None:
    """The shard index a path stands for (an ``*.index.json``, or a folder holding one)."""
    from ckptkit.formats.sharded import find_index

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
    dcp = find_dcp(path)
    if dcp is not None:  # torch.distributed.checkpoint (FSDP, Lightning's FSDP strategy)
        from ckptkit.formats.dcp import DCPSource

        return DCPSource(dcp, select=select, ema=ema)
    ranks = None if checkpoint_index(path) else find_rank_files(path)
    if ranks is not None:  # every rank's torch.save of a sharded (DTensor) state dict
        from ckptkit.formats.rank_files import RankFilesSource

        return RankFilesSource(*ranks, select=select, ema=ema)
    index = checkpoint_index(path)
    if index is None and path.is_dir():
        tag = find_deepspeed(path)
        if tag is not None:  # DeepSpeed's engine.save_checkpoint (Lightning's DeepSpeed too)
            from ckptkit.formats.deepspeed import DeepSpeedSource

            return DeepSpeedSource(path, tag, select=select)
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
            return source
    if index is not None:
        from ckptkit.formats.sharded import ShardedSource

        if select not in (None, ""):
            raise FormatError(f"{path} is a sharded state dict", "drop --select")
        return ShardedSource(index, opener=open_source, allow_globals=allow_globals)
    kind = detect_format(path)
    if kind == "safetensors":
        from ckptkit.formats.safetensors import SafetensorsSource

        return SafetensorsSource(path, select=select)
    from ckptkit.formats.torchfile import TorchFileSource, TrustedTorchSource

    if trust:
        return TrustedTorchSource(path, select=select, ema=ema)
    try:
        return TorchFileSource(
            path, select=select, allow_globals=allow_globals, check_safety=check_safety, ema=ema
        )
    except UnsafeCheckpointError:
        from ckptkit.formats.rank_files import one_rank_error

        error = one_rank_error(path)
        if error is not None:
            raise error from None
        raise


# ``--to`` names: what each output format is called on the command line.
TO_FORMATS = {"safetensors": "safetensors", "pt": "torch", "dcp": "dcp"}


def output_format(path: str | Path, to: str | None = None) -> str:
    """``safetensors``, ``torch`` or ``dcp``: ``to`` when given (``safetensors``, ``pt`` or
    ``dcp``, a DCP folder), else from the output file's suffix.

    Raises:
        FormatError: a suffix ckptkit does not write.
        UsageError: ``to`` is unknown, or the suffix names another format.
    """
    suffix = Path(path).suffix.lower()
    if to is not None:
        if to not in TO_FORMATS:
            raise UsageError(f"unknown output format {to!r}", "use " + ", ".join(TO_FORMATS))
        implied = OUTPUT_FORMATS.get(suffix)
        if implied is not None and implied != TO_FORMATS[to]:
            raise UsageError(
                f"{path} ends in {suffix}, which is not a {to} output",
                "drop --to, or give DST another name",
            )
        return TO_FORMATS[to]
    if suffix not in OUTPUT_FORMATS:
        raise FormatError(
            f"cannot tell the output format of {path}",
            "end the name with .safetensors, or .pt (.pth, .bin, .ckpt, .pth.tar), "
            "or pass --to dcp for a DCP folder",
        )
    return OUTPUT_FORMATS[suffix]
