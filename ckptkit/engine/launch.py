"""Starting DDP workers with torch's own elastic launcher, or running in place under torchrun."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ckptkit.engine.runlog import logger, show_progress
from ckptkit.errors import CkptkitError, Preempted

if TYPE_CHECKING:
    from ckptkit.engine.trainer import TrainConfig, TrainResult

__all__ = ["launch"]

# What a rank says when another one died under it: the dead rank is the news, not these.
_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
_COLLATERAL_GRACE_S = 2.0
_OWN_ERRORS = {CkptkitError.__name__, *(cls.__name__ for cls in CkptkitError.__subclasses__())}


@record  # a worker's exception reaches the launcher, which names its rank
def _worker(config: TrainConfig) -> TrainResult:
    from ckptkit.engine.trainer import Engine

    signal.signal(signal.SIGINT, _interrupted)
    try:
        return Engine(config).run()
    except KeyboardInterrupt:
        sys.exit(130)  # quietly: the launcher reports the interruption once
    except Exception as exc:
        # A rank that lost its peer often exits before the rank that died has: the launcher
        # would name the wrong one. It waits a moment, so the one that died is seen first.
        if any(text in str(exc) for text in _COLLATERAL):
            # Stopped meanwhile (the launcher saw the other rank): exit cleanly, not killed.
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
            time.sleep(_COLLATERAL_GRACE_S)
        raise


def _interrupted(signum: int, frame: object) -> None:
    """Ctrl-C: once. The launcher forwards SIGINT to its workers again while they stop, which
    would break into their exit with a second traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


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
        prefixes = (
            "torch.distributed.elastic",
            "torch.distributed.launcher",
            "torch.multiprocessing",
        )
        # torch's elastic loggers set their own level when made: each is quieted by name.
        names = [n for n in logging.root.manager.loggerDict if n.startswith(prefixes)]
        for name in {*prefixes, *names}:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        # A worker that died holding a semaphore makes multiprocessing's resource tracker (a
        # process started with this interpreter's -W options) warn of a leak at exit: noise
        # after the one-line error.
        sys.warnoptions.append("ignore::UserWarning:multiprocessing.resource_tracker")
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
        with _worker_env(config):
            results = elastic_launch(launch_config, _worker)(config)
    except SignalException as exc:  # this process was signalled; the workers got it too
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise _preempted(config, signal.Signals(exc.sigval).name) from None
    except ChildFailedError as exc:
        rank, failure = _first_cause(exc)
        if "Preempted" in _text(failure):  # every rank saved at the same step, then stopped
            raise Preempted(_reason(failure)) from None
        what = (
            _reason(failure) if _hung(failure) else f"worker rank {rank} failed: {_reason(failure)}"
        )
        raise CkptkitError(what, "the other workers were stopped") from exc
    return results[0]


@contextlib.contextmanager
def _worker_env(config: TrainConfig) -> Iterator[None]:
    """The workers' environment, restored afterwards, where the user has not set it:

    - ``OMP_NUM_THREADS=1`` for more than one worker, as torchrun sets it: each worker's
      intra-op threads would otherwise take every core, and the workers fight over them (8x
      slower on 2 cores);
    - ``TORCH_CPP_LOG_LEVEL=FATAL`` (unless ``CKPTKIT_DEBUG=1``): gloo's C++ log lines about a
      failure come before ckptkit's one-line report of it.
    """
    wanted = {}
    if config.nproc_per_node > 1:
        wanted["OMP_NUM_THREADS"] = "1"
    if os.environ.get("CKPTKIT_DEBUG") != "1":
        wanted["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    if "OMP_NUM_THREADS" in added:
        show_progress(True, config.quiet)  # the launcher speaks for the job
        logger.info(
            "ckptkit: OMP_NUM_THREADS=1 in each of the %d workers, as torchrun sets it "
            "(set OMP_NUM_THREADS to choose)",
            config.nproc_per_node,
        )
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _preempted(config: TrainConfig, name: str) -> Preempted:
    """The workers were stopped by ``name`` (each saving at its next step): where to resume."""
    from pathlib import Path

    from ckptkit.engine.checkpoint import LATEST

    pointer = Path(config.out) / LATEST
    last = Path(config.out) / pointer.read_text().strip() if pointer.is_file() else None
    return Preempted(
        f"stopped by {name}: the last checkpoint is {last or 'none'}", "resume with --resume auto"
    )


def _first_cause(exc: ChildFailedError) -> tuple[int, object]:
    """The failure that caused the others: the earliest that is not a rank losing its peer
    (whose error can be recorded first when the machine is busy)."""

    def order(item: tuple[int, object]) -> tuple[bool, bool, float]:
        # A rank's word that another hung names the cause; the hung rank was only stopped.
        collateral = any(text in _reason(item[1]) for text in _COLLATERAL)
        return not _hung(item[1]), collateral, getattr(item[1], "timestamp", 0)

    failures = sorted(exc.failures.items(), key=order)
    return failures[0] if failures else exc.get_first_failure()


def _text(failure: object) -> str:
    """What a failed worker recorded (its exception and traceback), or ''."""
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    if text.startswith("{"):
        try:
            text = json.loads(text).get("message", text)
        except ValueError:
            pass
    return str(text)


def _hung(failure: object) -> bool:
    return "HungRankError" in _text(failure)


def _reason(failure: object) -> str:
    text = _text(failure)
    if text.startswith("To enable traceback"):  # torch's boilerplate when a worker said nothing
        text = ""
    last = [line for line in text.splitlines() if line.strip()]
    reason = last[-1].strip() if last else ""
    name = reason.split(": ", 1)[0].removeprefix("ckptkit.errors.")
    if name in _OWN_ERRORS:  # ckptkit's own errors speak for themselves
        reason = reason.split(": ", 1)[-1]
    code = getattr(failure, "exitcode", None)
    if reason:
        return reason
    if isinstance(code, int) and code < 0:  # killed by a signal
        return f"killed by {getattr(failure, 'signal_name', lambda: f'signal {-code}')()}"
    return f"exit code {code}"
