"""Starting DDP workers with torch's own elastic launcher, or running in place under torchrun."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from typing import TYPE_CHECKING

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ckptkit.errors import CkptkitError

if TYPE_CHECKING:
    from ckptkit.engine.trainer import TrainConfig, TrainResult

__all__ = ["launch"]

# What a rank says when another one died under it: the dead rank is the news, not these.
_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
_COLLATERAL_GRACE_S = 2.0


@record  # a worker's exception reaches the launcher, which names its rank
def _worker(config: TrainConfig) -> TrainResult:
    from ckptkit.engine.trainer import Engine

    try:
        return Engine(config).run()
    except Exception as exc:
        # A rank that lost its peer often exits before the rank that died has: the launcher
        # would name the wrong one. It waits a moment, so the one that died is seen first.
        if any(text in str(exc) for text in _COLLATERAL):
            # Stopped meanwhile (the launcher saw the other rank): exit cleanly, not killed.
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
            time.sleep(_COLLATERAL_GRACE_S)
        raise


def launch(config: TrainConfig) -> TrainResult:
    """Run ``config`` on ``nproc_per_node`` local workers through ``elastic_launch`` (what
    ``torchrun --standalone`` does) and return rank 0's result.

    Raises:
        CkptkitError: a worker failed; the message names its rank and what it said. The
            launcher stops the other workers at once.
    """
    # The launcher logs its own progress and each failed worker's traceback; ckptkit reports
    # the failure in one line instead (CKPTKIT_DEBUG=1 keeps the launcher's logs).
    if os.environ.get("CKPTKIT_DEBUG") != "1":
        for name in ("torch.distributed.elastic", "torch.distributed.launcher",
                     "torch.multiprocessing"):  # fmt: skip
            logging.getLogger(name).setLevel(logging.CRITICAL)
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.nproc_per_node,
        run_id=f"ckptkit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(launch_config, _worker)(config)
    except ChildFailedError as exc:
        rank, failure = _first_cause(exc)
        raise CkptkitError(f"worker rank {rank} failed: {_reason(failure)}",
                           "the other workers were stopped") from None  # fmt: skip
    return results[0]


def _first_cause(exc: ChildFailedError) -> tuple[int, object]:
    """The failure that caused the others: the earliest that is not a rank losing its peer
    (whose error can be recorded first when the machine is busy)."""

    def order(item: tuple[int, object]) -> tuple[bool, float]:
        collateral = any(text in _reason(item[1]) for text in _COLLATERAL)
        return collateral, getattr(item[1], "timestamp", 0)

    failures = sorted(exc.failures.items(), key=order)
    return failures[0] if failures else exc.get_first_failure()


def _reason(failure: object) -> str:
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    if text.startswith("{"):
        try:
            text = json.loads(text).get("message", text)
        except ValueError:
            pass
    last = [line for line in text.splitlines() if line.strip()]
    reason = last[-1].strip() if last else ""
    if reason.startswith("ckptkit.errors."):  # ckptkit's own errors speak for themselves
        reason = reason.split(": ", 1)[-1]
    code = getattr(failure, "exitcode", None)
    signal_name = getattr(failure, "signal_name", lambda: "")()
    return reason or (f"killed by {signal_name}" if signal_name else f"exit code {code}")
