"""The training engine: one loop for single-device, DataParallel, DDP and FSDP runs.

Imports torch; ``import ckptkit`` reaches it only when ``ckptkit.train`` is first used.
"""

from __future__ import annotations

from ckptkit.engine.distributed import Mode, under_launcher
from ckptkit.engine.trainer import Engine, TrainConfig, TrainResult
from ckptkit.errors import UsageError

__all__ = ["train", "Engine", "TrainConfig", "TrainResult", "Mode"]


def train(config: TrainConfig | None = None, **options: object) -> TrainResult:
    """Train with the built-in (or your) model and data, in any mode.

    Args:
        config: a :class:`TrainConfig`; or give its fields as keyword options.

    Returns:
        Rank 0's result: metrics per epoch and the last checkpoint written.

    Raises:
        CkptkitError: bad options, a failed worker (named by rank), or a failed save.
    """
    config = config or TrainConfig(**options)  # type: ignore[arg-type]
    config.check()
    if Mode(config.mode).distributed and not under_launcher():
        from ckptkit.engine.launch import launch

        if config.batch_size % config.nproc_per_node:
            ranks = config.nproc_per_node
            raise UsageError(
                f"--batch-size {config.batch_size} does not split over {ranks} ranks",
                f"use a multiple of {ranks}",
            )
        return launch(config)
    return Engine(config).run()
