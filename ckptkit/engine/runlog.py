"""What a run writes for people to read, all on rank 0.

- ``metrics.jsonl``: a line per epoch (the ranks' sums, the validation, the lr);
- ``steps.jsonl``: a line per ``--log-every`` optimizer steps (rank 0's own loss and accuracy);
- ``tensorboard/``: the same values as TensorBoard event files, with ``--log tensorboard``
  (tags ``train/<name>`` per step and ``epoch/<name>`` per epoch, at the optimizer step);
- progress lines through the ``ckptkit.train`` logger.

A resumed run rewinds each log to its checkpoint's step, so no line appears twice: the jsonl files
are cut, and TensorBoard is told to purge what an earlier run wrote past that step.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

from ckptkit.errors import UsageError
from ckptkit.storage.location import Location
from ckptkit.storage.small import read_jsonl

__all__ = [
    "METRICS_LOG",
    "STEPS_LOG",
    "TENSORBOARD_DIR",
    "SINKS",
    "logger",
    "show_progress",
    "RunLog",
    "check_sinks",
    "records",
    "rewind",
]

METRICS_LOG = "metrics.jsonl"
STEPS_LOG = "steps.jsonl"
TENSORBOARD_DIR = "tensorboard"
# What a run leaves in --out besides its checkpoints and pointers (and mirrors to a URL).
RUN_LOGS = (METRICS_LOG, STEPS_LOG, TENSORBOARD_DIR)
SINKS = ("tensorboard",)  # what --log adds to the jsonl files, which are always written

logger = logging.getLogger("ckptkit.train")


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """Writes to whatever ``sys.stderr`` is now (a test runner or click swaps it)."""

    @property  # type: ignore[override,unused-ignore]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def show_progress(is_main: bool, quiet: bool) -> None:
    """Progress lines of rank 0 go to stderr as bare lines; other ranks and ``--quiet`` show
    warnings only. An application routes them elsewhere by replacing the logger's handler."""
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # one line each, not a second one through the root logger
    logger.setLevel(logging.INFO if is_main and not quiet else logging.WARNING)


def check_sinks(sinks: tuple[str, ...]) -> None:
    """Refuse an unknown ``--log`` or a missing extra before any process starts.

    Raises:
        UsageError: naming the sink and what to install.
    """
    import importlib.util

    for sink in sinks:
        if sink not in SINKS:
            raise UsageError(f"unknown --log '{sink}'", f"use {', '.join(SINKS)}")
    if "tensorboard" in sinks and importlib.util.find_spec("tensorboard") is None:
        raise UsageError(
            "--log tensorboard needs the tensorboard package", "pip install tensorboard"
        )


# A log read whole (to plot it, to rewind it on resume): a million steps' records are ~200 MB;
# a larger file is refused (naming it) rather than read into memory, at a URL as on disk.
LOG_LIMIT = 512 << 20


def records(path: Location) -> list[dict[str, Any]]:
    """A jsonl log's records; a torn last line of a killed run (or any line that is no JSON
    object, or nests too deep) is skipped."""
    return read_jsonl(path, "training log", limit=LOG_LIMIT)


def rewind(path: Path, step: int) -> None:
    """Keep the records of the first ``step`` steps (a resumed run writes the rest)."""
    if not path.is_file():
        return
    from ckptkit.storage.atomic import atomic_output

    kept = [json.dumps(r) + "\n" for r in records(path) if _step_of(r) <= step]
    with atomic_output(path, force=True) as tmp:
        tmp.write_text("".join(kept))


def _step_of(record: dict[str, Any]) -> float:
    try:
        return int(record.get("step", 0))
    except (TypeError, ValueError):
        return float("inf")  # not a step: dropped with what comes after the checkpoint


class RunLog:
    """The run folder's logs, opened on rank 0 once the step to go on from is known."""

    def __init__(self, out: Path, sinks: tuple[str, ...], step: int) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        for name in (METRICS_LOG, STEPS_LOG):
            rewind(out / name, step)
        self._board: Any = None
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides what an earlier run logged at or past it.
            self._board = SummaryWriter(str(out / TENSORBOARD_DIR), purge_step=step + 1)

    def steps(self, line: dict[str, Any]) -> None:
        """A line of steps.jsonl (and its ``train/`` scalars)."""
        self._write(STEPS_LOG, line, "train")

    def epoch(self, metrics: dict[str, Any]) -> None:
        """A line of metrics.jsonl (and its ``epoch/`` scalars), flushed to disk."""
        self._write(METRICS_LOG, metrics, "epoch")
        if self._board is not None:
            self._board.flush()

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
            self._board = None

    def _write(self, name: str, values: dict[str, Any], group: str) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(values) + "\n")
        if self._board is None:
            return
        step = int(values["step"])
        for key, value in values.items():
            if key not in ("step", "epoch", "world_size") and isinstance(value, (int, float)):
                self._board.add_scalar(f"{group}/{key}", value, step)
