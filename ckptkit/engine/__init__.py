"""The training engine: one loop for single-device, DataParallel, DDP and FSDP runs.

``TrainConfig`` is plain data; the rest imports torch, when first used.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.engine.config import TrainConfig
from ckptkit.errors import UsageError

if TYPE_CHECKING:
    from ckptkit.engine.distributed import Mode
    from ckptkit.engine.trainer import Engine, TrainResult

__all__ = ["train", "Engine", "TrainConfig", "TrainResult", "Mode"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "TrainResult"):
        from ckptkit.engine import trainer

        return getattr(trainer, name)
    if name == "Mode":
        from ckptkit.engine.distributed import Mode

        return Mode
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def train(config: TrainConfig | None = None, **options: object) -> TrainResult:
    """Train with the built-in (or your) model and data, in any mode.

    Args:
        config: a :class:`TrainConfig`; or give its fields as keyword options.

    Returns:
        Rank 0's result: metrics per epoch and the last checkpoint written.

    Raises:
        CkptkitError: bad options, a failed worker (named by rank), or a failed save.
    """
    from ckptkit.engine.distributed import Mode, under_launcher

    config = config or TrainConfig(**options)  # type: ignore[arg-type]
    config.check()
    if Mode(config.mode).distributed and not under_launcher():
        # Only what launching needs is imported here: the workers wait for this process.
        from ckptkit.engine.checkpoint import check_fresh
        from ckptkit.engine.launch import launch

        # Here, before any worker starts: an earlier run in --out, and a resume with nothing left.
        check_fresh(Path(config.out), resume=config.resume, overwrite=config.overwrite)
        if config.resume is not None:
            _check_resume(config)
        ranks = config.nproc_per_node * config.grad_accum
        if config.batch_size % ranks:
            raise UsageError(
                f"--batch-size {config.batch_size} does not split over {config.nproc_per_node} "
                f"ranks x {config.grad_accum} micro-batches",
                f"use a multiple of {ranks}",
            )
        return launch(config)
    from ckptkit.engine.trainer import Engine

    return Engine(config).run()


def _check_resume(config: TrainConfig) -> None:
    """Refuse a resume that leaves nothing to train (its epoch read, its tensors mapped)."""
    from ckptkit.engine.checkpoint import find_resume
    from ckptkit.engine.payload import EPOCH, STEP, load_payload
    from ckptkit.engine.trainer import check_epochs  # only to resume

    path = find_resume(config.resume, Path(config.out))
    if path is not None:
        payload = load_payload(path, mmap=True)
        done, step = int(payload.get(EPOCH, 0)), int(payload.get(STEP, 0))
        check_epochs(path, done, config.epochs, step, config.max_steps)
