"""Starting DDP workers with torch's own elastic launcher, or running in place under torchrun.

``elastic_launch`` (what ``torchrun --standalone`` runs) starts one process per rank with
multiprocessing's spawn method: a fresh interpreter that re-imports the main module, unpickles
``_worker`` and the config, then runs it. Spawning also starts multiprocessing's resource tracker
(a process); the rendezvous store (torch's TCPStore) and the agent are threads and objects of this
process. Everything started here is waited for before ``launch`` returns or raises.
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import gc
import json
import logging
import math
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ckptkit.engine.config import LAUNCHER_PID_ENV, RERUN_EXIT_CODE, RERUN_FIX, RERUN_MESSAGE
from ckptkit.engine.runlog import logger, show_progress
from ckptkit.errors import CkptkitError, Preempted, UsageError

if TYPE_CHECKING:
    from ckptkit.engine.trainer import TrainConfig, TrainResult

__all__ = ["launch", "check_sendable"]

# What a rank says when another one died under it: the dead rank is the news, not these.
_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
_COLLATERAL_GRACE_S = 2.0
_OWN_ERRORS = {CkptkitError.__name__, *(cls.__name__ for cls in CkptkitError.__subclasses__())}


@record  # a worker's exception reaches the launcher, which names its rank
def _worker(config: TrainConfig) -> TrainResult:
    signal.signal(signal.SIGINT, _interrupted)
    try:
        # A Ctrl-C that came while this process started waited (blocked, see _sigint_handled): it
        # arrives now, with the handler in place.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        from ckptkit.engine.trainer import Engine

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
    finally:
        if signal.getsignal(signal.SIGINT) is _interrupted:  # done, not interrupted (yet)
            signal.signal(signal.SIGINT, _leave)


def _interrupted(signum: int, frame: object) -> None:
    """Ctrl-C: once. The launcher forwards SIGINT to its workers again while they stop, which
    would break into their exit with a second traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _leave(signum: int, frame: object) -> None:
    """Ctrl-C after the run, while torch hands the result over: exit without a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(130)


def check_sendable(config: TrainConfig) -> None:
    """Refuse a factory the workers cannot receive, before any process starts: each worker gets
    the config pickled, a function as its module and name, which it imports.

    Raises:
        UsageError: naming the option and the forms that work.
    """
    for name in ("model", "data", "val_data"):
        value = getattr(config, name)
        if value is None or isinstance(value, str):
            continue
        given = f"{name}={getattr(value, '__qualname__', None) or type(value).__qualname__}"
        fix = (
            f"pass a function defined at the top level of a module, or {name}='module:factory' "
            "(a string the workers import)"
        )
        try:
            pickle.dumps(value)
        except Exception as exc:  # a lambda, a local function, an object holding a lock...
            raise UsageError(
                f"{given} cannot be sent to the {config.mode} worker processes, which receive "
                f"it pickled: {exc}",
                fix,
            ) from None
        module = getattr(getattr(value, "func", value), "__module__", None)  # a partial's too
        if module == "__main__" and not _spawn_imports_main():
            raise UsageError(
                f"{given} is defined in __main__, which the {config.mode} worker processes "
                "cannot import (code run with -c, from stdin, or in a notebook)",
                fix.replace("a module", "a module file"),
            )


def _spawn_imports_main() -> bool:
    """Whether a spawned process re-imports this one's main module (as multiprocessing's
    ``spawn.get_preparation_data`` decides): a script file or ``-m module``, not ``-c``, stdin,
    a notebook, or a package's ``__main__``."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    return getattr(main, "__file__", None) is not None


def launch(config: TrainConfig) -> TrainResult:
    """Run ``config`` on ``nproc_per_node`` local workers through ``elastic_launch`` (what
    ``torchrun --standalone`` does) and return rank 0's result. Every process started for it
    has ended, and been waited for, when this returns or raises.

    Raises:
        CkptkitError: a worker failed; the message names its rank and what it said. The
            launcher stops the other workers at once.
        UsageError: the workers re-ran a script that calls train() outside its main guard.
        Preempted: SIGTERM (or another signal the launcher handles) stopped the run.
        KeyboardInterrupt: Ctrl-C (SIGINT), once the workers have stopped.
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
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # newer torch
        launch_config.signals_to_handle = "SIGTERM,SIGHUP,SIGQUIT"  # SIGINT: _Sigint
    # What this process had before: only what the launch adds is stopped afterwards.
    handlers = _signal_handlers()
    children = set(multiprocessing.active_children())
    tracker_was_running = _resource_tracker_fd() is not None
    sigint = _Sigint(children) if handlers else None  # handlers: in the main thread only
    error: BaseException | None = None
    try:
        with _worker_env(config), _sigint_handled(sigint):
            results = elastic_launch(launch_config, _worker)(config)
    except BaseException as exc:  # every way out goes through the clean-up below
        error = _translate(config, exc)
        # The launcher's objects (its queues' semaphores, registered with the resource
        # tracker) live on in the traceback's frames: they go now, the lines stay.
        traceback.clear_frames(exc.__traceback__)
    _clean_up(children, not tracker_was_running, handlers)
    if error is None and sigint is not None and sigint.late:
        error = KeyboardInterrupt()
    if error is not None:
        raise error
    return results[0]


def _translate(config: TrainConfig, exc: BaseException) -> BaseException:
    """The error ``launch`` raises for what the launcher raised."""
    if isinstance(exc, SignalException):  # this process was signalled; the workers got it too
        if exc.sigval == signal.SIGINT:
            return KeyboardInterrupt()
        return _preempted(config, signal.Signals(exc.sigval).name)
    if not isinstance(exc, ChildFailedError):
        return exc
    if any(getattr(f, "exitcode", None) == RERUN_EXIT_CODE for f in exc.failures.values()):
        return UsageError(RERUN_MESSAGE, RERUN_FIX)  # each worker left at once, quietly
    rank, failure = _first_cause(exc)
    if "Preempted" in _text(failure):  # every rank saved at the same step, then stopped
        return Preempted(_reason(failure))
    what = _reason(failure) if _hung(failure) else f"worker rank {rank} failed: {_reason(failure)}"
    error = CkptkitError(what, "the other workers were stopped")
    error.__cause__ = exc
    return error


def _signal_handlers() -> dict[signal.Signals, Any]:
    """This process's handlers of the signals torch's launcher takes over (and keeps)."""
    if threading.current_thread() is not threading.main_thread():
        return {}  # the launcher leaves them alone too
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    signals = [getattr(signal, name) for name in names if hasattr(signal, name)]
    return {sig: signal.getsignal(sig) for sig in signals}


@contextlib.contextmanager
def _sigint_handled(sigint: _Sigint | None) -> Iterator[None]:
    """Ctrl-C during the launch, in this process and in the workers it starts.

    The workers start with SIGINT blocked (a signal mask outlives fork and exec): a Ctrl-C that
    comes while one starts, seconds of importing torch, waits until ``_worker`` handles it with
    one quiet exit, where it would print a KeyboardInterrupt traceback from each. This process
    keeps hearing it through a thread that does not block it, and Python runs the handler,
    ``sigint``, in the main thread as ever (until ``_clean_up`` gives the caller's back).
    """
    if sigint is None:
        yield
        return
    signal.signal(signal.SIGINT, sigint.handle)
    watcher = threading.Thread(target=sigint.watch, name="ckptkit-sigint", daemon=True)
    previous = None
    try:
        watcher.start()  # before SIGINT is blocked: the thread a Ctrl-C goes to
        if hasattr(signal, "pthread_sigmask"):
            resource_tracker.ensure_running()  # starting, it unblocks SIGINT: before, not after
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        yield
    finally:
        sigint.stop.set()
        if watcher.ident is not None:
            watcher.join()
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Sigint:
    """This process's SIGINT handler while it launches (torch's launcher is told to leave SIGINT
    alone): raises ``SignalException`` as the launcher's own handler does, so that it stops its
    workers, but never in the midst of starting a process (a child cut off before it was sent
    its work says so with a traceback, and is outside the launcher's care): that Ctrl-C is
    raised again from the watcher thread, once the start is over. The workers still running
    ``_INTERRUPT_GRACE_S`` after a Ctrl-C (a rank waiting in C++ for a peer that has left only
    notices at ``--timeout``), or at a second one, are killed. Once the launch is over, a Ctrl-C
    is only noted (``late``): ``launch`` raises it after the clean-up."""

    def __init__(self, children: set[BaseProcess]):
        self.children = children  # the caller's, left alone
        self.stop = threading.Event()
        self.deferred = False
        self.late = False
        self.deadline = math.inf

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stop.is_set() or self.late:
            self.late = True
            return
        if not self.deferred:  # a new Ctrl-C, not one raised again
            now = time.monotonic()
            self.deadline = now + _INTERRUPT_GRACE_S if self.deadline == math.inf else now
        self.deferred = _within(frame, BaseProcess.start.__code__)
        if not self.deferred:
            raise SignalException(f"Process {os.getpid()} got SIGINT", sigval=signal.SIGINT)

    def watch(self) -> None:
        while not self.stop.wait(0.05):
            if self.deferred:
                main = sys._current_frames().get(threading.main_thread().ident or 0)
                if not _within(main, BaseProcess.start.__code__):
                    _thread.interrupt_main(signal.SIGINT)
            if time.monotonic() > self.deadline:
                for proc in _started(self.children):
                    proc.kill()
                self.deadline = math.inf
        self.late = self.late or self.deferred  # the launch ended before it could be raised


def _started(children: set[BaseProcess]) -> list[BaseProcess]:
    """The live processes started since ``children``, the caller's own, were: the launcher's
    (multiprocessing keeps no more of a started process that would tell them apart)."""
    return [proc for proc in multiprocessing.active_children() if proc not in children]


def _within(frame: FrameType | None, code: CodeType) -> bool:
    """Whether ``frame`` or a frame that called it runs ``code``."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


_INTERRUPT_GRACE_S = 5.0


def _clean_up(
    children: set[BaseProcess], stop_tracker: bool, handlers: dict[signal.Signals, Any]
) -> None:
    """Wait for every process the launch started, then give back the signal handlers torch's
    launcher (and ``_Sigint``) took.

    The launcher waits for the workers it stops; a start cut short (a signal between one
    worker's start and the next) leaves the first outside its care: killed here. The resource
    tracker, started for the launch, would outlive this process by a moment, in its process
    group: stopped too.
    """
    try:
        for proc in _started(children):
            proc.kill()
            proc.join(_JOIN_TIMEOUT_S)
        if stop_tracker:
            _stop_resource_tracker()
    finally:
        for sig, handler in handlers.items():
            if handler is not None:  # None: set outside Python, not restorable from here
                signal.signal(sig, handler)


_JOIN_TIMEOUT_S = 5.0


def _resource_tracker_fd() -> int | None:
    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None)


def _stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker, which spawning the workers started, and wait
    for it (it ends when no process holds its pipe any more); the next use starts another."""
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if tracker is None or fd is None or pid is None:
        return
    gc.collect()  # semaphores the launcher left unregister now, not from a later finalizer
    with getattr(tracker, "_lock", contextlib.nullcontext()):
        tracker._fd = tracker._pid = None
    os.close(fd)
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:  # a worker's own child still holds the pipe
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)


@contextlib.contextmanager
def _worker_env(config: TrainConfig) -> Iterator[None]:
    """The workers' environment, restored afterwards, where the user has not set it:

    - ``OMP_NUM_THREADS=1`` for more than one worker, as torchrun sets it: each worker's
      intra-op threads would otherwise take every core, and the workers fight over them (8x
      slower on 2 cores);
    - ``TORCH_CPP_LOG_LEVEL=FATAL`` (unless ``CKPTKIT_DEBUG=1``): gloo's C++ log lines about a
      failure come before ckptkit's one-line report of it;

    and always ``CKPTKIT_LAUNCHER_PID``, this process's: a worker that finds itself re-running
    the script into train() (no main guard) leaves quietly, and this process says why, once.
    """
    wanted = {}
    if config.nproc_per_node > 1:
        wanted["OMP_NUM_THREADS"] = "1"
    if os.environ.get("CKPTKIT_DEBUG") != "1":
        wanted["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    previous = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
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
        if previous is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = previous


def _preempted(config: TrainConfig, name: str) -> Preempted:
    """The workers were stopped by ``name`` (each saving at its next step): where to resume."""
    from pathlib import Path

    from ckptkit.engine.checkpoint import LATEST
    from ckptkit.storage.small import read_pointer

    pointer = Path(config.out) / LATEST
    last = Path(config.out) / read_pointer(pointer) if pointer.is_file() else None
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
