"""ckptkit's own run folders: what ``ckptkit train --out DIR`` writes.

DIR holds checkpoints named ``ckpt-epochNNNN[-stepNNNNNNNN]`` (``.pt`` or ``.safetensors`` files,
or DCP folders without a suffix), a ``latest`` pointer naming the newest complete one and, with
``--monitor``, a ``best`` pointer; ``metrics.jsonl`` and ``steps.jsonl`` beside them. Readers
follow ``latest`` (or ``best``, or a checkpoint named with ``--select``). Stdlib only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, overload

from ckptkit.errors import FormatError, SelectError
from ckptkit.formats.files.readings import WEIGHT_SUFFIXES
from ckptkit.storage.location import Location
from ckptkit.storage.small import read_pointer

__all__ = [
    "LATEST",
    "BEST",
    "CHECKPOINT_STEM",
    "CHECKPOINT_NAME",
    "list_checkpoints",
    "is_run_folder",
    "run_checkpoint",
    "trainer_checkpoint",
    "step_checkpoint",
]

LATEST = "latest"
BEST = "best"  # names the checkpoint with the best --monitor value
# ckpt-epoch0003.pt after 3 epochs; ckpt-epoch0003-step00000070.pt 70 steps in, during the 4th;
# a DCP checkpoint is a folder of the same stem.
CHECKPOINT_STEM = r"ckpt-epoch(\d{4,})(?:-step(\d{8,}))?"
CHECKPOINT_NAME = re.compile(CHECKPOINT_STEM + r"(?:\.(pt|safetensors))?")
_PREFERENCE = {".pt": 0, "": 1, ".safetensors": 2}  # which one a step saved twice resumes from


@overload
def list_checkpoints(folder: Path) -> list[Path]: ...
@overload
def list_checkpoints(folder: Location) -> list[Location]: ...
def list_checkpoints(folder: Location) -> list[Any]:  # each what its folder is (overloads)
    """Complete checkpoints in ``folder``, oldest first, one per epoch (the ``.pt`` when both
    formats were saved). Temp files and folders are never listed."""
    found: dict[tuple[int, int], Location] = {}
    for path in folder.glob("ckpt-epoch*"):
        if (m := CHECKPOINT_NAME.fullmatch(path.name)) and (m.group(3) or path.is_dir()):
            # An epoch's end sorts before the steps into the next one.
            at = (int(m.group(1)), int(m.group(2)) if m.group(2) else -1)
            if at not in found or _PREFERENCE[path.suffix] < _PREFERENCE[found[at].suffix]:
                found[at] = path
    return [found[at] for at in sorted(found)]


def _pointed(folder: Location, pointer: str) -> str | None:
    """The checkpoint name a pointer file holds, when it holds one (DeepSpeed's ``latest``
    names a tag folder such as ``global_step10`` instead)."""
    path = folder / pointer
    if not path.is_file():
        return None
    name = read_pointer(path, f"'{pointer}' pointer")
    return name if CHECKPOINT_NAME.fullmatch(name) else None


def is_run_folder(folder: Location) -> bool:
    """Whether ``folder`` is a run folder of ``ckptkit train``: its ``latest`` names one of
    its checkpoints by ckptkit's names."""
    return folder.is_dir() and _pointed(folder, LATEST) is not None


def run_checkpoint(folder: Location, select: str | None = None) -> tuple[Location, str] | None:
    """The checkpoint of a run folder to read, and why: the one ``latest`` names, or with
    ``select`` the ``best`` one or one named (``ckpt-epoch0002`` or ``ckpt-epoch0002.pt``).
    None when ``folder`` is no run folder.

    Raises:
        FormatError: the pointer names a checkpoint that is missing.
        SelectError: ``select`` names no checkpoint of the run.
    """
    if not is_run_folder(folder):
        return None
    names = [p.name for p in list_checkpoints(folder)]
    others = "; --select best or a checkpoint's name for another" if len(names) > 1 else ""
    if select in (None, "", LATEST, BEST):
        pointer = BEST if select == BEST else LATEST
        name = _pointed(folder, pointer)
        if name is None:
            raise SelectError(
                f"{folder} has no '{pointer}' checkpoint (the run had no --monitor)",
                f"give one of {', '.join(names)} to --select",
            )
        if not (folder / name).exists():
            raise FormatError(
                f"{folder} is a ckptkit run whose {pointer} checkpoint '{name}' is missing",
                f"give one of its checkpoints to --select: {', '.join(names) or 'none left'}",
            )
        return folder / name, f"the run's {pointer} checkpoint{others}"
    assert select is not None
    named = folder / select
    if CHECKPOINT_NAME.fullmatch(select) and named.exists():
        return named, "chosen with --select"
    match = [n for n in names if Path(n).stem == select or n == select]
    if not match:
        raise SelectError(
            f"{folder} is a ckptkit run with no checkpoint '{select}'",
            f"give best, latest or one of {', '.join(names)}",
        )
    return folder / match[0], "chosen with --select"


# transformers' Trainer saves output_dir/checkpoint-N (N the global step), each a model folder.
TRAINER_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
# What the Trainer saves beside its weights: pickles of its own, never the model.
_TRAINER_STATE = re.compile(
    r"training_args\.bin|optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state.*"
)


def trainer_checkpoint(folder: Location, select: str | None = None) -> tuple[Location, str] | None:
    """The checkpoint of a Trainer's ``output_dir`` to read, and why: the one ``select`` names,
    else the newest ``checkpoint-N`` (by N). None when ``folder`` holds no ``checkpoint-N``
    folder, or, unless ``select`` names one, holds weights of its own (the final model saved
    there: the folder itself is read)."""
    if not folder.is_dir():
        return None
    entries = list(folder.iterdir())
    named = select is not None and TRAINER_CHECKPOINT.fullmatch(select) is not None
    own = any(
        p.suffix in WEIGHT_SUFFIXES and not _TRAINER_STATE.fullmatch(p.name) and p.is_file()
        for p in entries
    )
    if own and not named:
        return None
    found = sorted(
        (int(m.group(1)), p)
        for p in entries
        if (m := TRAINER_CHECKPOINT.fullmatch(p.name)) and p.is_dir()
    )
    if not found:
        return None
    paths, chosen = [p for _, p in found], select if named else None
    return _newest_or_named(folder, paths, chosen, "Trainer", ("the Trainer's", "checkpoints"))


def _newest_or_named(
    folder: Location,
    found: list[Location],
    select: str | None,
    kind: str,
    whose: tuple[str, str],
) -> tuple[Location, str]:
    """Of a run's numbered checkpoints (oldest first), the one ``select`` names, else the
    newest, and why.

    Raises:
        SelectError: ``select`` names none of them.
    """
    if select is not None:
        chosen = [p for p in found if p.name == select]
        if not chosen:
            raise SelectError(
                f"{folder} holds no {kind} checkpoint '{select}'",
                f"give one of {', '.join(p.name for p in found)}",
            )
        return chosen[0], "chosen with --select"
    # "the newest of the Trainer's 2 checkpoints; --select checkpoint-N for another"
    number = re.sub(r"\d+$", "N", found[-1].name)
    others = f"; --select {number} for another" if len(found) > 1 else ""
    owner, noun = whose
    return found[-1], f"the newest of {owner} {len(found)} {noun}{others}"


# torchtitan's CheckpointManager saves DUMP/checkpoint/step-N (N the training step), each a DCP
# folder (its model keys at the top level, beside optimizer, lr_scheduler, dataloader and
# train_state; the last step's model alone, by default).
STEP_CHECKPOINT = re.compile(r"step-(\d+)")


def step_checkpoint(folder: Location, select: str | None = None) -> tuple[Location, str] | None:
    """The checkpoint of a torchtitan run to read, and why: the newest ``step-N`` folder that
    holds DCP metadata (of ``folder``, or of its ``checkpoint`` folder: torchtitan's dump
    folder), or the one ``select`` names. None when there is none."""
    if not folder.is_dir():
        return None
    for where in (folder, folder / "checkpoint"):
        if not where.is_dir():
            continue
        found = sorted(
            (int(m.group(1)), p)
            for p in where.iterdir()
            if (m := STEP_CHECKPOINT.fullmatch(p.name)) and (p / ".metadata").is_file()
        )
        if found:
            named = select if select is not None and STEP_CHECKPOINT.fullmatch(select) else None
            paths = [p for _, p in found]
            whose = ("the run's", "step checkpoints")
            return _newest_or_named(where, paths, named, "torchtitan", whose)
    return None
