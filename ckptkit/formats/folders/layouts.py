"""What a checkpoint folder is, by the names of the files inside it.

Hugging Face model folders (``save_pretrained``), Accelerate's ``save_state``, DeepSpeed's tag
folders and ``torch.distributed.checkpoint`` saves each lay out their files by fixed names; these
functions tell them apart without reading a tensor. Stdlib only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, overload

from ckptkit.errors import FormatError
from ckptkit.formats.files.readings import WEIGHT_SUFFIXES
from ckptkit.formats.files.safetensors import dcp_sharding_info
from ckptkit.formats.folders.diffusers import WEIGHTS_STEM, is_index_name, part_kind
from ckptkit.formats.folders.runs import CHECKPOINT_NAME, CHECKPOINT_STEM, is_run_folder
from ckptkit.storage.location import Location, by_name, holds_file
from ckptkit.storage.small import quoted, read_pointer

__all__ = [
    "MODEL_FILES",
    "ADAPTER_FILES",
    "model_file_in",
    "adapter_file_in",
    "folder_files",
    "folder_parts",
    "find_deepspeed",
    "find_dcp",
    "copied_beside_weights",
    "MODEL_PARALLEL",
    "model_parallel_files",
    "model_parallel_refusal",
    "model_parallel_name",
]

# The weights file of a Hugging Face model folder (save_pretrained), in transformers' order.
MODEL_FILES = ("model.safetensors", "pytorch_model.bin")


def model_file_in(folder: Location, select: str | None = None) -> Location | None:
    """The weights file of a model folder (``save_pretrained``'s ``model.safetensors`` or
    ``pytorch_model.bin``, safetensors first, as transformers reads them), or None. In an
    Accelerate ``save_state`` folder ``select`` may name another model (``model_1``)."""
    stems = [select] if select else ["model", "pytorch_model"]
    names = [f"{stem}{ext}" for stem in stems for ext in (".safetensors", ".bin")]
    if not select:
        names = list(MODEL_FILES)
    # Any file by that name, not only a regular one: a FIFO there is refused by its reader,
    # by name, where a "no model.safetensors" would mislead.
    return next((folder / n for n in names if holds_file(folder / n)), None)


# A PEFT adapter folder (peft's save_pretrained): its weights beside adapter_config.json.
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_file_in(folder: Location) -> Location | None:
    """The weights file of a PEFT adapter folder, or None."""
    if not (folder / "adapter_config.json").is_file():
        return None
    return next((folder / n for n in ADAPTER_FILES if holds_file(folder / n)), None)


# Weights (of any format) and indexes: never copied beside converted weights, which replace them.
_WEIGHT_SUFFIXES = (*WEIGHT_SUFFIXES, ".h5", ".msgpack", ".gguf")
# A training checkpoint's state beside the model (transformers' Trainer, Accelerate, DeepSpeed):
# never copied into a converted model folder, which is a release, not a place to resume from.
_TRAINING_STATE = re.compile(r"trainer_state\.json|.*\.pkl|zero_to_fp32\.py|latest")


@overload
def folder_files(folder: Path) -> list[Path]: ...
@overload
def folder_files(folder: Location) -> list[Location]: ...
def folder_files(folder: Location) -> list[Any]:  # each what its folder is (overloads)
    """A model folder's files other than weights and indexes (config.json, tokenizer files,
    generation_config.json, a model card): what a converted copy of the folder keeps. A training
    checkpoint's state (``trainer_state.json``, pickled RNG states) is left behind."""
    return by_name(p for p in folder.iterdir() if p.is_file() and copied_beside_weights(p.name))


def copied_beside_weights(name: str) -> bool:
    """Whether a model folder's file of this name goes along with its converted weights: not
    hidden, not weights of any format (pickles among them), not an index (a variant's too,
    ``...index.fp16.json``), not a training checkpoint's state."""
    return not (
        name.startswith(".")
        or name.endswith(_WEIGHT_SUFFIXES)
        or is_index_name(name)
        or _TRAINING_STATE.fullmatch(name)
    )


# Accelerate's save_state names its parts (accelerate/checkpointing.py); N counts models,
# optimizers and processes.
_PARTS = (
    (re.compile(r"(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin)"), "model weights"),
    (re.compile(r"optimizer(_\d+)?\.bin"), "optimizer state"),
    (re.compile(r"scheduler(_\d+)?\.bin"), "scheduler state"),
    (re.compile(r"sampler(_\d+)?\.bin"), "sampler state"),
    (re.compile(r"dl_state_dict(_\d+)?\.bin"), "dataloader state"),
    (re.compile(r"random_states_\d+\.pkl"), "RNG states of one process"),
    (re.compile(r"custom_checkpoint_\d+\.pkl"), "a registered custom object"),
    (re.compile(r"scaler\.pt"), "gradient scaler state"),
)


# peft's save_pretrained of an adapter.
_ADAPTER_PARTS = (
    (re.compile(r"adapter_config\.json"), "the PEFT adapter's config (r, lora_alpha, targets)"),
    (re.compile(r"adapter_model\.(safetensors|bin)"), "the adapter's weights"),
    (re.compile(r"README\.md"), "peft's model card"),
)


# DeepSpeed's engine.save_checkpoint (deepspeed/runtime/engine.py names them).
_DEEPSPEED_PARTS = (
    (re.compile(r"latest"), "the tag of the latest checkpoint"),
    (re.compile(r"mp_rank_\d+_model_states\.pt"), "model states: the module, shapes, ties"),
    (re.compile(r"zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt"), "model states of one rank"),
    (
        re.compile(r"(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt"),
        "fp32 master weights and optimizer state of one rank",
    ),
)


# torch.distributed.checkpoint's FileSystemWriter; meta.pt is Lightning's FSDP strategy's.
_DCP_PARTS = (
    (re.compile(r"\.metadata"), "DCP metadata: every key's shape, dtype and chunks"),
    (re.compile(r"__\d+_\d+\.distcp"), "one writer's tensor chunks and values"),
    (re.compile(r"meta\.pt"), "the trainer's state (Lightning, ckptkit train)"),
    (re.compile(r"ckptkit\.json"), "the metadata ckptkit wrote with the folder"),
    (re.compile(r".*\.safetensors"), "one writer's tensor chunks (DCP's Hugging Face writer)"),
)


# ckptkit train's --out folder (folders/runs.py); a DCP checkpoint is a folder of DCP parts.
_RUN_PARTS = (
    (re.compile(CHECKPOINT_STEM + r"\.pt"), "a training checkpoint (weights and state)"),
    (re.compile(CHECKPOINT_STEM + r"\.safetensors"), "a checkpoint's weights"),
    (re.compile(r"latest"), "the name of the newest complete checkpoint"),
    (re.compile(r"best"), "the name of the best checkpoint (--monitor)"),
    (re.compile(r"metrics\.jsonl"), "a line of metrics per epoch"),
    (re.compile(r"steps\.jsonl"), "a line of loss, accuracy and lr every --log-every steps"),
)


def _run_parts(folder: Location) -> list[tuple[str, str]]:
    """A run folder's files, and the files of each DCP checkpoint folder in it."""
    out = []
    for path in by_name(folder.iterdir()):
        if path.is_file():
            kind = next((what for rx, what in _RUN_PARTS if rx.fullmatch(path.name)), "other file")
            out.append((path.name, kind))
        elif CHECKPOINT_NAME.fullmatch(path.name) and find_dcp(path) is not None:
            out += [(f"{path.name}/{name}", kind) for name, kind in folder_parts(path)]
    return out


def folder_parts(folder: Location) -> list[tuple[str, str]]:
    """The files of a checkpoint folder and what each is (Accelerate's and DeepSpeed's names,
    the latter's tag folder included as ``tag/name``; a run folder's DCP checkpoints as
    ``ckpt-epochNNNN/name``), sorted."""
    if is_run_folder(folder):
        return _run_parts(folder)
    tag = find_deepspeed(folder)
    known = (
        _DEEPSPEED_PARTS
        if tag is not None
        else _DCP_PARTS
        if find_dcp(folder)
        else _ADAPTER_PARTS
        if adapter_file_in(folder)
        else _PARTS
    )
    files = by_name(p for p in folder.iterdir() if p.is_file())
    if tag is None and any(p.name.startswith(WEIGHTS_STEM) for p in files):  # diffusers' names
        return [(p.name, part_kind(p.name) or "other file") for p in files]
    if tag is not None and tag != folder:
        files += by_name(p for p in tag.iterdir() if p.is_file())
    out = []
    for path in files:
        kind = next((what for rx, what in known if rx.fullmatch(path.name)), "other file")
        inside = path.name if path.parent == folder else f"{path.parent.name}/{path.name}"
        out.append((inside, kind))
    return out


# DeepSpeed's engine.save_checkpoint: `latest` names the tag folder holding the model states.
_DEEPSPEED_MODEL = re.compile(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")


def _holds_model_states(folder: Location) -> bool:
    return folder.is_dir() and any(_DEEPSPEED_MODEL.fullmatch(p.name) for p in folder.iterdir())


def find_deepspeed(folder: Location) -> Location | None:
    """The tag folder of a DeepSpeed checkpoint (``folder`` itself, or the one ``latest``
    names), or None when ``folder`` is not one.

    Raises:
        FormatError: ``latest`` names a folder that is missing or outside ``folder``.
    """
    if not folder.is_dir() or is_run_folder(folder):  # ckptkit's latest names a checkpoint
        return None
    if _holds_model_states(folder):
        return folder
    latest = folder / "latest"
    if latest.is_file():
        tag = read_pointer(latest, "DeepSpeed 'latest' pointer")
        if not tag or Path(tag).name != tag or tag in (".", ".."):
            raise FormatError(f"{latest} names no tag folder ({quoted(tag)})")
        if not _holds_model_states(folder / tag):
            raise FormatError(
                f"{folder} is a DeepSpeed checkpoint whose latest tag '{tag}' is missing",
                "copy the tag folder there, or give another tag folder itself",
            )
        return folder / tag
    tags = [p for p in by_name(folder.iterdir()) if p.is_dir() and _holds_model_states(p)]
    if len(tags) == 1:
        return tags[0]
    if tags:
        raise FormatError(
            f"{folder} holds DeepSpeed checkpoints {', '.join(p.name for p in tags)} "
            "and no 'latest'",
            f"give one of them, e.g. {tags[-1]}",
        )
    return None


def find_dcp(path: Location) -> Location | None:
    """The folder of a ``torch.distributed.checkpoint`` save (it, or its ``.metadata`` file),
    or of DCP's Hugging Face writer (``.safetensors`` files whose headers carry each chunk's
    offsets, and no index)."""
    if path.name == ".metadata" and path.is_file():
        return path.parent
    if not path.is_dir():
        return None
    if (path / ".metadata").is_file():
        return path
    if any(path.glob("*.index.json")):
        return None
    shards = by_name(p for p in path.glob("*.safetensors") if p.is_file())  # no FIFO opened
    return path if any(dcp_sharding_info(p) is not None for p in shards) else None


# Model families' own layouts that only a mapping (ckptkit.mapping's packs) turns into a model
# folder: model-parallel saves whose files hold one rank's slice of every weight, with nothing
# in them saying how the slices join, and Mistral's one file. Name pattern, family, pack.
MODEL_PARALLEL = (
    (re.compile(r"consolidated\.(\d\d+)\.pth"), "Meta Llama", "llama-meta"),
    (re.compile(r"consolidated\.safetensors()"), "Mistral", "mistral"),
)


def model_parallel_name(name: str) -> bool:
    """Whether a file name is one of a model-parallel save's (``consolidated.00.pth``)."""
    return any(pattern.fullmatch(name) for pattern, _, _ in MODEL_PARALLEL)


def model_parallel_files(folder: Location) -> tuple[list[str], str, str] | None:
    """A folder's model-parallel rank files (in rank order), their family and the pack that maps
    them; None when it holds none."""
    if not folder.is_dir():
        return None
    names = [p.name for p in folder.iterdir()]
    for pattern, family, pack in MODEL_PARALLEL:
        ranks = sorted(
            (int(found[1] or 0), name) for name in names if (found := pattern.fullmatch(name))
        )
        if ranks:
            return [name for _, name in ranks], family, pack
    return None


def model_parallel_refusal(where: Location, found: tuple[list[str], str, str]) -> FormatError:
    """The error for a model-parallel save read as if its files were the model."""
    names, family, pack = found
    if where.name in names and len(names) > 1:
        return FormatError(
            f"{where} is one of {len(names)} model-parallel files of a {family} checkpoint: "
            "a slice of every weight, not the model",
            f"convert their folder with --map {pack} (see docs/mapping.md)",
        )
    if len(names) == 1:
        return FormatError(
            f"{where} is a {family} checkpoint ({names[0]}), in its own names and layout",
            f"convert it with --map {pack} (see docs/mapping.md), or give {names[0]} to keep "
            f"{family}'s names",
        )
    return FormatError(
        f"{where} is a {family} checkpoint in {len(names)} model-parallel files "
        f"({names[0]} ...), in its own names and layout",
        f"convert it with --map {pack} (see docs/mapping.md)",
    )
