"""A training run's options: one dataclass, checked before any process starts, read from a TOML
file too (flags override it), and recorded in every checkpoint."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptkit.errors import UsageError

__all__ = ["TrainConfig", "read_config", "OPTIMIZERS", "SCHEDULES", "PRECISIONS", "LOSSES"]

OPTIMIZERS = ("sgd", "adamw", "adam")
SCHEDULES = ("constant", "step", "cosine")
PRECISIONS = ("fp32", "bf16", "fp16")
LOSSES = ("cross_entropy", "mse")  # or MODULE:FN
MODES = ("single", "dp", "ddp", "fsdp")  # distributed.Mode's values, known without torch


# In the environment ckptkit's launcher starts its workers with: the launcher's pid.
LAUNCHER_PID_ENV = "CKPTKIT_LAUNCHER_PID"
# The exit code of a worker that found itself re-running the script's top level: the launcher
# turns it into one UsageError.
RERUN_EXIT_CODE = 86
RERUN_MESSAGE = (
    "train() was called again in a worker process: each worker re-runs your script's top level "
    "before it starts (Python's spawn start method)"
)
RERUN_FIX = 'put the call under `if __name__ == "__main__":`'


def under_launcher() -> bool:
    """True inside a worker started by torchrun or torch's elastic launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


@dataclass
class TrainConfig:
    """Everything a run is made of; saved in every checkpoint."""

    mode: str = "single"
    epochs: int = 4
    batch_size: int = 64  # global, of one optimizer step: split over the ranks, then micro-batches
    grad_accum: int = 1  # micro-batches per optimizer step
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9  # sgd's
    weight_decay: float = 0.0
    lr_schedule: str = "step"  # a factor of lr, per optimizer step
    lr_step_epochs: int = 3  # step: lr times lr_gamma every this many epochs
    lr_gamma: float = 0.5
    warmup_steps: int = 0  # linear from 0 to lr, before the schedule
    precision: str = "fp32"  # bf16 / fp16: autocast; fp16 with a gradient scaler
    clip_grad_norm: float | None = None
    max_steps: int | None = None  # stop after this many optimizer steps (a checkpoint is saved)
    loss: str = "cross_entropy"  # or mse, or MODULE:FN(output, target); unused by a model
    # that returns its own loss (a mapping with "loss", as Hugging Face models do)
    # validation: a dataset factory, or a fraction of the training data held out (seeded)
    val_data: str | Callable[[], Any] | None = None
    val_fraction: float | None = None
    val_every: int = 1  # epochs
    monitor: str | None = None  # a metric (val_loss, val_accuracy, loss...): the `best` pointer
    monitor_mode: str = "min"
    early_stop_patience: int | None = None  # validations without improvement before stopping
    log_every: int = 10  # steps: a line of steps.jsonl (rank 0's loss, accuracy, lr)
    log: tuple[str, ...] = ()  # beside the jsonl files: "tensorboard"
    num_workers: int = 0
    compile: bool = False
    seed: int = 0
    out: str = "runs/ckptkit"
    save_every: int = 1  # epochs
    save_every_steps: int | None = None
    keep_last: int = 3
    async_save: bool = False  # stage to CPU memory, write on a thread
    resume: str | None = None  # a checkpoint path, or "auto"
    overwrite: bool = False  # delete an earlier run's checkpoints and logs in --out first
    device: str = "cpu"
    save_format: str | None = None  # pt, safetensors, both or dcp; None: dcp in fsdp, else pt
    # "module:factory" or a callable (picklable, for DDP); None: the built-in demo model / data.
    model: str | Callable[[], Any] | None = None
    data: str | Callable[[], Any] | None = None
    nproc_per_node: int = 2
    timeout_s: float = 60.0  # process-group timeout: a missing rank fails fast
    quiet: bool = False

    def check(self) -> None:
        """Refuse values that cannot work, before any process starts.

        Raises:
            UsageError: naming the option.
        """
        self._check_choices()
        self._check_numbers()
        self._check_validation_and_logs()
        self._check_specs()
        self._check_batch_split()
        if self.resume not in (None, "auto") and "://" not in str(self.resume):
            path = Path(str(self.resume))
            if not path.is_file() and not (path / ".metadata").is_file():
                raise UsageError(f"cannot resume: {path} does not exist", "check --resume")

    def _check_choices(self) -> None:
        """The options that name one of a few choices (and the save format's default)."""
        if self.resume is not None and self.overwrite:
            raise UsageError("--resume and --overwrite contradict each other", "give one")
        if self.mode not in MODES:
            raise UsageError(f"unknown mode '{self.mode}'", "use single, dp, ddp or fsdp")
        if self.save_format is None:
            self.save_format = "dcp" if self.mode == "fsdp" else "pt"
        choices = {
            "save_format": ("pt", "safetensors", "both", "dcp"),
            "optimizer": OPTIMIZERS,
            "lr_schedule": SCHEDULES,
            "precision": PRECISIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UsageError(
                    f"unknown --{_flag(name)} '{getattr(self, name)}'", f"use {', '.join(allowed)}"
                )
        if self.loss not in LOSSES and ":" not in self.loss:
            raise UsageError(f"unknown --loss '{self.loss}'", "use cross_entropy, mse or MODULE:FN")

    def _check_numbers(self) -> None:
        """Counts at least 1 (or 0), and rates finite and positive."""
        for name in (
            "epochs",
            "batch_size",
            "save_every",
            "nproc_per_node",
            "grad_accum",
            "lr_step_epochs",
            "log_every",
        ):
            if getattr(self, name) < 1:
                raise UsageError(f"--{_flag(name)} must be at least 1")
        for name in ("max_steps", "save_every_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{_flag(name)} must be at least 1")
        for name in ("warmup_steps", "num_workers", "keep_last"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{_flag(name)} must not be negative")
        for name in ("lr", "momentum", "weight_decay", "lr_gamma", "clip_grad_norm", "timeout_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise UsageError(f"--{_flag(name)} {value} is not a finite number of at least 0")
        if self.lr <= 0 or self.timeout_s <= 0:
            raise UsageError(f"--{'lr' if self.lr <= 0 else 'timeout'} must be positive")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise UsageError("--clip-grad-norm must be positive")

    def _check_validation_and_logs(self) -> None:
        """The validation data, the log sinks, and what --monitor and early stopping need."""
        from ckptkit.engine.runlog import check_sinks  # no torch: a usage error is quick

        if self.val_fraction is not None and not 0 < self.val_fraction < 1:
            raise UsageError("--val-fraction must lie between 0 and 1")
        if self.val_fraction is not None and self.val_data is not None:
            raise UsageError(
                "--val-data and --val-fraction both name the validation data", "give one"
            )
        if isinstance(self.log, str):  # one sink, as a TOML file may give it
            self.log = (self.log,)
        self.log = tuple(self.log)
        check_sinks(self.log)
        if self.monitor_mode not in ("min", "max"):
            raise UsageError(f"unknown --monitor-mode '{self.monitor_mode}'", "use min or max")
        if self.early_stop_patience is not None and self.monitor is None:
            raise UsageError("--early-stop-patience needs --monitor", "e.g. --monitor val_loss")
        if self.val_every < 1 or (self.early_stop_patience or 1) < 1:
            raise UsageError("--val-every and --early-stop-patience must be at least 1")
        if self.monitor is not None and self.monitor.startswith("val_") and not self.validates:
            raise UsageError(
                f"--monitor {self.monitor} needs validation data",
                "give --val-data or --val-fraction",
            )

    def _check_specs(self) -> None:
        """``MODULE:FACTORY`` (``MODULE:FN`` for --loss) where an option names code."""
        for name in ("model", "data", "val_data", "loss"):
            spec = getattr(self, name)
            if isinstance(spec, str) and (name != "loss" or spec not in LOSSES):
                module, _, attr = spec.partition(":")
                if not module or not attr:
                    form = "MODULE:FN" if name == "loss" else "MODULE:FACTORY"
                    raise UsageError(
                        f"--{_flag(name)} '{spec}' is not {form}",
                        f"e.g. --{_flag(name)} mypkg.{name}:build",
                    )

    def _check_batch_split(self) -> None:
        """The batch splits evenly over the ranks and micro-batches."""
        # Under a launcher its world size counts the ranks, and build() checks the split.
        ranks = self.nproc_per_node if self.mode in ("ddp", "fsdp") else 1
        if not under_launcher() and self.batch_size % (ranks * self.grad_accum):
            raise UsageError(
                f"--batch-size {self.batch_size} does not split over {ranks} "
                f"ranks x {self.grad_accum} micro-batches",
                f"use a multiple of {ranks * self.grad_accum}",
            )

    @property
    def validates(self) -> bool:
        return self.val_data is not None or self.val_fraction is not None

    def recorded(self) -> dict[str, Any]:
        """The config as a checkpoint records it (a factory becomes its name)."""
        return {k: _plain(v) for k, v in dataclasses.asdict(self).items()}


def _flag(name: str) -> str:
    return {"timeout_s": "timeout"}.get(name, name.replace("_", "-"))


def _plain(value: Any) -> Any:
    if callable(value):
        return f"{value.__module__}:{value.__qualname__}"
    return value


def read_config(path: str | Path) -> dict[str, Any]:
    """The options of a TOML run file (``lr = 0.1``, ``grad-accum = 4``; a ``[train]`` table
    or the top level), as TrainConfig fields.

    Raises:
        UsageError: the file is missing, not TOML, or names an unknown option.
    """
    try:
        import tomllib  # type: ignore[import-not-found,unused-ignore]  # Python 3.11+
    except ImportError:
        raise UsageError("--config needs Python 3.11 or later (tomllib)") from None
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read --config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path} is not TOML: {exc}") from None
    table = data.get("train", data)
    if not isinstance(table, Mapping):
        raise UsageError(f"--config {path}: [train] is not a table")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    options = {}
    for key, value in table.items():
        name = {"timeout": "timeout_s"}.get(key, key.replace("-", "_"))
        if name not in fields:
            raise UsageError(
                f"--config {path} names an unknown option '{key}'", "see `ckptkit train --help`"
            )
        options[name] = value
    return options
