"""The training engine: one loop for single-device, DataParallel, DDP and FSDP runs.

``TrainConfig`` is plain data; the rest imports torch, when first used.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.engine.config import (
    LAUNCHER_PID_ENV,
    RERUN_EXIT_CODE,
    RERUN_FIX,
    RERUN_MESSAGE,
    TrainConfig,
    under_launcher,
)
from ckptkit.errors import UsageError
from ckptkit.storage.location import is_remote

if TYPE_CHECKING:
    from types import FrameType

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


def train(config: TrainConfig | None = None, **options: Any) -> TrainResult:
    """Train with the built-in (or your) model and data, in any mode.

    Args:
        config: a :class:`TrainConfig`; or give its fields as keyword options.

    Returns:
        Rank 0's result: metrics per epoch and the last checkpoint written.

    Raises:
        CkptkitError: bad options, a failed worker (named by rank), or a failed save.
        UsageError: in DDP and FSDP also a call the workers would repeat (a script without
            ``if __name__ == "__main__":``) or a factory they cannot receive (not picklable).
        KeyboardInterrupt: Ctrl-C, once every worker has stopped.
    """
    _refuse_rerun()  # first: a worker re-running the script leaves before importing torch
    config = config or TrainConfig(**options)
    config.check()  # before torch is imported: a usage error answers at once
    from ckptkit.engine.distributed import Mode

    if is_remote(config.out):  # staged here, mirrored there as it commits (DCP: written there)
        from ckptkit.engine.remote import staged_run

        with staged_run(config) as local:
            result = train(local)
        return _mirrored(result, local.out, config.out)
    if Mode(config.mode).distributed and not under_launcher():
        # Only what launching needs is imported here: the workers wait for this process.
        from ckptkit.engine.checkpoint import check_fresh
        from ckptkit.engine.launch import check_sendable, launch

        check_sendable(config)  # a factory the workers cannot receive, before any process
        # Here, before any worker starts: an earlier run in --out, and a resume with nothing left.
        check_fresh(Path(config.out), resume=config.resume, overwrite=config.overwrite)
        if config.resume is not None:
            _check_resume(config)
        return launch(config)
    from ckptkit.engine.trainer import Engine

    return Engine(config).run()


def _mirrored(result: TrainResult, local: str, url: str) -> TrainResult:
    """A result's paths in the staging folder named at the URL they were mirrored to."""
    result.out = url
    for name in ("checkpoint", "resumed_from"):
        path = getattr(result, name)
        if path and path.startswith(local):
            setattr(result, name, f"{url.rstrip('/')}/{Path(path).name}")
    return result


def _refuse_rerun() -> None:
    """Refuse a call made while a process started with spawn (or forkserver) re-runs the main
    script's top level, as each DDP worker does before it can run: a script that calls train()
    outside ``if __name__ == "__main__":`` would launch workers from every worker.

    Raises:
        UsageError: naming the fix; in a worker of ckptkit's own launcher, a quiet exit with
            ``RERUN_EXIT_CODE`` instead, which the launcher reports once for all workers.
    """
    if not _rerunning_main():
        return
    if os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid()):
        raise SystemExit(RERUN_EXIT_CODE)
    raise UsageError(RERUN_MESSAGE, RERUN_FIX)


def _rerunning_main() -> bool:
    """True while this process, started by multiprocessing, imports the parent's main module
    (as ``__mp_main__``)."""
    from multiprocessing import current_process

    # What multiprocessing itself checks to refuse starting a process at this point.
    if getattr(current_process(), "_inheriting", False):
        return True
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:  # the re-run main module calls train(), maybe through others
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


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
