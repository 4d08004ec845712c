"""The training loop: one code path for single-device, DataParallel, DDP and FSDP runs.

A run is build (``engine.build``) -> resume -> loop. The loop counts optimizer steps; a
checkpoint saved between epochs or mid-epoch (``--save-every-steps``, ``--max-steps``, SIGTERM)
holds where it stands in the epoch, every rank's RNG and the epoch's running sums, so a run
resumed from it continues as if it had never stopped.

What a checkpoint holds, and how a resume puts it back, is :mod:`ckptkit.engine.payload`'s;
how it is written, :mod:`ckptkit.engine.checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptkit.engine import checkpoint, payload
from ckptkit.engine.build import Run, build, forward, lr_factor
from ckptkit.engine.config import TrainConfig
from ckptkit.engine.distributed import (
    Context,
    Mode,
    StopVote,
    gradient_sync,
    hung_rank,
    setup,
    teardown,
)
from ckptkit.engine.payload import Progress
from ckptkit.engine.remote import push
from ckptkit.engine.runlog import RunLog, logger, show_progress
from ckptkit.engine.saver import BackgroundSaver, Staging
from ckptkit.errors import Preempted, UsageError
from ckptkit.storage.location import Location

__all__ = ["TrainConfig", "TrainResult", "Engine", "check_epochs"]


@dataclass
class TrainResult:
    """What a run did: its metrics per epoch and its last checkpoint."""

    out: str
    epochs_run: int
    resumed_from: str | None
    checkpoint: str | None  # rank 0's last, on every rank
    metrics: list[dict[str, Any]] = field(default_factory=list)
    rank: int = 0
    writer_host: str = ""  # where rank 0 wrote the checkpoint
    steps: int = 0  # optimizer steps taken in all, resumed ones included
    stopped: str | None = None  # "max_steps", "early_stop" or "SIGTERM" when one ended it
    save_stalls: list[float] = field(default_factory=list)  # seconds each save held training

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Engine:
    """Runs the loop in this process (rank 0, or one DDP/FSDP worker). Build with a config;
    call :meth:`run`. ``ckptkit.train`` starts the workers for you."""

    def __init__(self, config: TrainConfig) -> None:
        config.check()
        self.config = config
        self.ctx: Context | None = None
        self._stop_requested = False
        self._watchdog: threading.Timer | None = None
        self._last_step_s = 0.0
        self._vote: StopVote | None = None
        # --async-save: writes on a thread (rank 0's files, or every rank's DCP shards).
        self._saver: BackgroundSaver | None = None
        self._staging: Staging | None = None  # its copies of the state, kept between saves
        self._log: RunLog | None = None  # rank 0's

    def run(self) -> TrainResult:
        cfg = self.config
        ctx = self.ctx = setup(Mode(cfg.mode), cfg.device, timeout_s=cfg.timeout_s)
        show_progress(ctx.is_main, cfg.quiet)
        if ctx.mode.distributed:  # under torchrun: what the launcher really started
            cfg.nproc_per_node = ctx.local_world_size
        try:
            with self._sigterm_requests_a_stop():
                result = self._run(ctx)
            ctx.barrier()  # no rank tears the group down while another still uses it
            return result
        except RuntimeError as exc:
            hung = hung_rank(ctx, exc)
            if hung is None:
                raise
            if ctx.rank != 0:  # rank 0 names the hung rank when it can: let its word land first
                time.sleep(2.0)
            raise hung from exc
        finally:
            teardown(ctx)

    @contextlib.contextmanager
    def _sigterm_requests_a_stop(self) -> Iterator[None]:
        """SIGTERM (what schedulers send before preemption) asks for a checkpoint at the next
        step boundary; the run then stops with :class:`Preempted`."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request(signum: int, frame: Any) -> None:
            if self._stop_requested:  # already on its way (a launcher forwards it again)
                return
            self._stop_requested = True
            self._arm_watchdog()

        previous = signal.signal(signal.SIGTERM, request)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self._watchdog is not None:
                self._watchdog.cancel()

    def _arm_watchdog(self) -> None:
        """After SIGTERM: a rank stuck mid-step (hung, or stopped by the launcher after another
        failed) never reaches the next step boundary, so it leaves after a grace of a few
        steps' time. Armed again at every boundary until the ranks agree to stop."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        grace = _SIGTERM_GRACE_S + 2 * self._last_step_s
        self._watchdog = threading.Timer(grace, _leave, (grace,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _run(self, ctx: Context) -> TrainResult:
        cfg = self.config
        if cfg.async_save:
            self._saver, self._staging = BackgroundSaver(), Staging()
        try:
            return self._train(ctx)
        finally:
            if self._saver is not None:  # the last save completes (its error raised) first
                self._saver.wait()
            if self._log is not None:
                self._log.close()

    def _train(self, ctx: Context) -> TrainResult:
        cfg = self.config
        run = build(cfg, ctx)
        out = Path(cfg.out)
        if ctx.is_main:
            checkpoint.check_fresh(out, resume=cfg.resume, overwrite=cfg.overwrite)
            _check_writable(out)  # fail now, not after the first epoch
            checkpoint.remove_stale(out)  # a killed run's temp files: now, not at the next save
        state = Progress()
        torch.manual_seed(cfg.seed + 1000 * ctx.rank)  # per-rank streams (dropout and the like)
        resumed = checkpoint.find_resume(cfg.resume, out)
        if resumed is not None:
            payload.restore(resumed, run, state, ctx)
            check_epochs(resumed, state.epoch, cfg.epochs, state.step, cfg.max_steps)
        if ctx.is_main:  # rewound: what comes after the checkpoint is trained again
            self._log = RunLog(out, cfg.log, state.step)
        result = TrainResult(str(out), 0, str(resumed) if resumed else None, None, rank=ctx.rank)
        while state.epoch < cfg.epochs:
            stop = self._epoch(run, ctx, state, result)
            if stop is not None:
                result.stopped = stop
                break
        if self._vote is not None:  # its last round, before the gather below
            self._vote.close()
        if self._saver is not None:  # the last checkpoint complete before it is reported
            self._saver.wait()
        result.steps = state.step
        # Every rank (every node's launcher prints) says what rank 0 wrote, and where.
        result.checkpoint, result.writer_host = ctx.gather((result.checkpoint, platform.node()))[0]
        if result.stopped == "SIGTERM":
            raise Preempted(
                f"stopped by SIGTERM at step {state.step}: saved {result.checkpoint}",
                "resume with --resume auto",
            )
        return result

    def _epoch(self, run: Run, ctx: Context, state: Progress, result: TrainResult) -> str | None:
        """Train (the rest of) one epoch. Returns why it stopped early: ``max_steps`` or
        ``SIGTERM`` (a checkpoint saved), or None at the epoch's end."""
        from tqdm import tqdm

        cfg = self.config
        run.wrapped.train()
        loader = run.loader(
            state.epoch,
            state.batch,
            num_workers=cfg.num_workers,
            seed=cfg.seed * 1_000_003 + ctx.rank,
        )
        local = [0.0, 0.0, 0.0]
        window = [0.0, 0.0, 0.0]  # since the last line of steps.jsonl (rank 0's own)
        started, first_step = time.perf_counter(), state.step
        show = ctx.is_main and not cfg.quiet and sys.stderr.isatty()
        bar = tqdm(
            loader,
            desc=f"epoch {state.epoch + 1}",
            leave=False,
            disable=not show,
            initial=state.batch,
            total=run.steps_per_epoch,
        )
        stop = None
        for batch in bar:
            step_started = time.perf_counter()
            for i, value in enumerate(self._step(run, batch, ctx, state.step)):
                local[i] += value
                window[i] += value
            self._last_step_s = time.perf_counter() - step_started
            state.batch += 1
            state.step += 1
            state.samples += cfg.batch_size
            if self._log is not None and state.step % cfg.log_every == 0:
                self._log_steps(window, state, run)
                window = [0.0, 0.0, 0.0]
            stop = self._stop_reason(ctx, state)
            if state.batch == run.steps_per_epoch:
                break  # the epoch's end saves below
            every = cfg.save_every_steps
            if stop is not None or (every and state.step % every == 0):
                partial = state.partial
                state.partial = [a + b for a, b in zip(partial, ctx.sum(local), strict=True)]
                self._save_and_record(run, ctx, state, result, mid_epoch=True, best=False)
                state.partial = partial
            if stop is not None:
                bar.close()
                return stop
        bar.close()
        totals = [a + b for a, b in zip(state.partial, ctx.sum(local), strict=True)]
        elapsed = time.perf_counter() - started
        speed = (state.step - first_step) * cfg.batch_size / elapsed if elapsed else 0.0
        return self._end_epoch(run, ctx, state, result, totals, speed, stop)

    def _end_epoch(
        self,
        run: Run,
        ctx: Context,
        state: Progress,
        result: TrainResult,
        totals: list[float],
        speed: float,
        stop: str | None,
    ) -> str | None:
        """The epoch's end: its metrics (``totals``: the ranks' sums), validation when due,
        the ``--monitor`` verdict, its lines in the logs, and its checkpoint when one is due.
        Returns why the run stops: ``stop``, ``early_stop``, or None to go on."""
        cfg = self.config
        metrics = {
            "epoch": state.epoch + 1,
            "step": state.step,
            "loss": totals[0] / max(totals[2], 1),
            "accuracy": totals[1] / max(totals[2], 1) if totals[1] == totals[1] else None,
            "lr": cfg.lr * lr_factor(cfg, state.step - 1, run.steps_per_epoch),
            "samples_per_s": speed,
            "world_size": ctx.world_size,
        }
        state.epoch += 1
        state.batch = 0
        state.partial = [0.0, 0.0, 0.0]
        if run.val_dataset is not None and (
            state.epoch % cfg.val_every == 0 or state.epoch == cfg.epochs
        ):
            metrics.update(self._validate(run, ctx))
        improved = self._judge(metrics, state)
        if stop is None and cfg.early_stop_patience and state.bad >= cfg.early_stop_patience:
            stop = "early_stop"
        result.epochs_run += 1
        result.metrics.append(metrics)  # summed over the ranks: the same on every one
        if self._log is not None:
            self._log.epoch(metrics)
            self._show(metrics)
        if (
            stop is not None
            or improved  # the best one is always saved
            or state.epoch % cfg.save_every == 0
            or state.epoch == cfg.epochs
        ):
            self._save_and_record(run, ctx, state, result, mid_epoch=False, best=improved)
        return stop

    def _judge(self, metrics: dict[str, Any], state: Progress) -> bool:
        """Whether the ``--monitor`` metric improved this epoch (state keeps the best)."""
        name = self.config.monitor
        value = metrics.get(name) if name else None
        if value is None:
            return False
        better = state.best is None or (
            value < state.best if self.config.monitor_mode == "min" else value > state.best
        )
        if better:
            state.best, state.bad = float(value), 0
        else:
            state.bad += 1
        return better

    def _validate(self, run: Run, ctx: Context) -> dict[str, Any]:
        """Loss and accuracy on the validation data, every rank a share of it."""
        run.wrapped.eval()
        sums = [0.0, 0.0, 0.0]
        with torch.no_grad():
            for batch, counted in run.val_batches(ctx.rank, ctx.world_size):
                with _autocast(ctx, self.config.precision):
                    loss, output, target = forward(run, _head(batch, counted), ctx.device)
                n = float(counted)  # 0: a repeated batch that only keeps the ranks in step
                sums[0] += float(loss) * n
                sums[1] += _correct(output, target) if counted else 0.0
                sums[2] += n
        run.wrapped.train()
        loss_sum, correct, count = ctx.sum(sums)
        return {
            "val_loss": loss_sum / max(count, 1),
            "val_accuracy": correct / max(count, 1) if correct == correct else None,
        }

    def _step(self, run: Run, batch: Any, ctx: Context, step: int) -> list[float]:
        """One optimizer step over ``--grad-accum`` micro-batches. Returns this rank's
        (loss x samples, correct, samples); correct is NaN when the task is no classification."""
        cfg = self.config
        for group in run.optimizer.param_groups:
            group["lr"] = cfg.lr * lr_factor(cfg, step, run.steps_per_epoch)
        run.optimizer.zero_grad(set_to_none=True)
        parts = _split(batch, cfg.grad_accum)
        sums = [0.0, 0.0, 0.0]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            # Gradients sum over the micro-batches locally; only the last one all-reduces.
            with gradient_sync(run.wrapped, ctx, enabled=last), _autocast(ctx, cfg.precision):
                loss, output, target = forward(run, part, ctx.device)
            scaled = loss / len(parts)
            (run.scaler.scale(scaled) if run.scaler else scaled).backward()
            count = float(target.shape[0]) if torch.is_tensor(target) else 1.0
            sums[0] += float(loss.detach()) * count
            sums[1] += _correct(output, target)
            sums[2] += count
        if run.scaler is not None:
            run.scaler.unscale_(run.optimizer)  # clipping sees the true gradients
        if cfg.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(run.wrapped.parameters(), cfg.clip_grad_norm)
        if run.scaler is not None:
            run.scaler.step(run.optimizer)
            run.scaler.update()
        else:
            run.optimizer.step()
        return sums

    def _stop_reason(self, ctx: Context, state: Progress) -> str | None:
        """Why to stop after this step, the same on every rank: a SIGTERM any rank received
        (agreed at the ranks' next vote), or ``--max-steps`` reached."""
        if self._vote is None:
            self._vote = StopVote(ctx)
        if self._vote.cast(self._stop_requested):
            if self._watchdog is not None:  # agreed: the save may take its time
                self._watchdog.cancel()
            return "SIGTERM"
        if self._stop_requested:  # a boundary reached: not stuck, the vote is on its way
            self._arm_watchdog()
        if self.config.max_steps is not None and state.step >= self.config.max_steps:
            return "max_steps"
        return None

    def _log_steps(self, window: list[float], state: Progress, run: Run) -> None:
        """A line of steps.jsonl: the last ``--log-every`` steps' mean loss and accuracy on rank
        0 (no collective: the per-epoch lines are the ranks' sums), and the lr."""
        cfg = self.config
        loss, correct, count = window
        line = {
            "step": state.step,
            "epoch": state.epoch + state.batch / run.steps_per_epoch,
            "loss": loss / max(count, 1),
            "accuracy": correct / max(count, 1) if correct == correct else None,
            "lr": cfg.lr * lr_factor(cfg, state.step - 1, run.steps_per_epoch),
        }
        assert self._log is not None  # rank 0's
        self._log.steps(line)

    def _show(self, metrics: dict[str, Any]) -> None:
        """The epoch's line: loss, accuracy, validation, throughput."""
        shown = [
            ("loss", "loss", ".4f"),
            ("accuracy", "acc", ".3f"),
            ("val_loss", "val loss", ".4f"),
            ("val_accuracy", "val acc", ".3f"),
        ]
        parts = "  ".join(
            f"{label} {metrics[name]:{form}}"
            for name, label, form in shown
            if metrics.get(name) is not None
        )
        logger.info(
            "epoch %d/%d  %s  %.0f samples/s",
            metrics["epoch"],
            self.config.epochs,
            parts,
            metrics["samples_per_s"],
        )

    def _save_and_record(
        self,
        run: Run,
        ctx: Context,
        state: Progress,
        result: TrainResult,
        *,
        mid_epoch: bool,
        best: bool,
    ) -> None:
        """Save (``best``: and point ``best`` at it once complete) and time the stall."""
        started = time.perf_counter()
        rng = ctx.gather(payload.rng_state())
        path = self._save(run, ctx, state, rng, mid_epoch=mid_epoch, best=best)
        if ctx.is_main:
            result.checkpoint = str(path)
        ctx.barrier()  # every rank waits for the commit (or the staging), none runs ahead
        result.save_stalls.append(time.perf_counter() - started)

    def _save(
        self,
        run: Run,
        ctx: Context,
        state: Progress,
        rng: list[Any],
        *,
        mid_epoch: bool,
        best: bool,
    ) -> Path | None:
        """Save a checkpoint; every rank calls it (fsdp gathers, DCP writes on every rank).
        Returns its path (None on the ranks that do not write)."""
        cfg = self.config
        out, epoch, keep = Path(cfg.out), state.epoch, cfg.keep_last  # now: training goes on
        step = state.step if mid_epoch else None
        if cfg.save_format == "dcp":
            shards, train_state = payload.dcp_payload(cfg, run, ctx, state, rng)
            return checkpoint.commit_dcp(
                out,
                epoch,
                shards,
                train_state,
                is_main=ctx.is_main,
                share=lambda value: ctx.gather(value)[0],
                keep_last=keep,
                step=step,
                best=best,
                saver=self._saver,
                staging=self._staging,
                group=ctx.saves,
            )
        saved = payload.file_payload(cfg, run, ctx, state, rng)
        if saved is None:
            return None
        suffixes = _FILE_FORMATS[cfg.save_format or "pt"]

        def commit(contents: dict[str, Any]) -> Path:
            path = checkpoint.commit(
                out, epoch, contents, keep_last=keep, formats=suffixes, step=step, best=best
            )
            push(out, keep_last=keep)  # --out URL: mirrored there (files, then latest)
            return path

        if self._saver is None or self._staging is None:
            return commit(saved)
        # Staged: copies in CPU memory, written on a thread while training goes on. The last
        # save is written first: its copies are the ones staged into.
        self._saver.wait()
        copy = self._staging.stage(saved)
        self._saver.submit(lambda: commit(copy))
        return out / checkpoint.checkpoint_name(epoch, suffixes[0], step=step)


_SIGTERM_GRACE_S = 5.0
# --save-format: the files a checkpoint is written as (dcp is a folder of its own).
_FILE_FORMATS = {"pt": ("pt",), "safetensors": ("safetensors",), "both": ("pt", "safetensors")}


def _leave(grace: float) -> None:
    logger.warning(
        "ckptkit: SIGTERM, and no step boundary within %.0f s: leaving without a checkpoint", grace
    )
    os._exit(143)


def check_epochs(
    path: Location, done: int, epochs: int, step: int = 0, max_steps: int | None = None
) -> None:
    """Refuse a resume that leaves nothing to train.

    Raises:
        UsageError: naming the checkpoint's epoch (step) and ``--epochs`` (``--max-steps``).
    """
    if done >= epochs:
        raise UsageError(
            f"{path} is at epoch {done} and --epochs is {epochs}: nothing left to train",
            f"give --epochs above {done} to train further",
        )
    if max_steps is not None and step >= max_steps:
        raise UsageError(
            f"{path} is at step {step} and --max-steps is {max_steps}: nothing left to train",
            f"give --max-steps above {step}, or leave it out",
        )


@contextlib.contextmanager
def _autocast(ctx: Context, precision: str) -> Iterator[None]:
    if precision == "fp32":
        yield
        return
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    with torch.autocast(device_type=ctx.device.type, dtype=dtype):
        yield


def _head(batch: Any, count: int) -> Any:
    """The first ``count`` items of a batch (all of it when ``count`` is 0: a batch run only
    to keep the ranks in step)."""
    if count == 0:
        return batch
    if isinstance(batch, Mapping):
        return {k: v[:count] if torch.is_tensor(v) else v for k, v in batch.items()}
    return [item[:count] for item in batch]


def _split(batch: Any, parts: int) -> list[Any]:
    """A batch as ``parts`` micro-batches along its first dimension."""
    if parts == 1:
        return [batch]
    if isinstance(batch, Mapping):
        pieces = {k: torch.tensor_split(v, parts) for k, v in batch.items() if torch.is_tensor(v)}
        return [{**batch, **{k: v[i] for k, v in pieces.items()}} for i in range(parts)]
    split = [torch.tensor_split(item, parts) for item in batch]
    return [[item[i] for item in split] for i in range(parts)]


def _correct(output: Any, target: Any) -> float:
    """Correct predictions of a classifier's logits; NaN for any other task."""
    if (
        torch.is_tensor(output)
        and torch.is_tensor(target)
        and output.dim() == 2
        and target.dim() == 1
        and not target.is_floating_point()
    ):
        return float((output.detach().argmax(1) == target).sum())
    return float("nan")


def _check_writable(folder: Path) -> None:
    import tempfile

    from ckptkit.errors import OutputError

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise OutputError(
            f"cannot write to --out {folder}: {exc.strerror}", "choose a writable folder"
        ) from None
