"""The training loop: one code path for single-device, DataParallel, DDP and FSDP runs."""

from __future__ import annotations

import dataclasses
import importlib
import json
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ckptkit.engine import checkpoint
from ckptkit.engine.demo import demo_data, demo_model
from ckptkit.engine.distributed import (
    Context,
    Mode,
    load_training_state,
    setup,
    teardown,
    training_state,
    unwrap,
    wrap,
)
from ckptkit.errors import UsageError
from ckptkit.keys import match_keys, mismatch_message
from ckptkit.meta import VERSION

__all__ = ["TrainConfig", "TrainResult", "Engine"]


@dataclass
class TrainConfig:
    """Everything a run is made of; saved in every checkpoint."""

    mode: str = "single"
    epochs: int = 4
    batch_size: int = 64  # global: split evenly over the ranks
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    out: str = "runs/ckptkit"
    save_every: int = 1
    keep_last: int = 3
    resume: str | None = None  # a checkpoint path, or "auto"
    device: str = "cpu"
    save_format: str | None = None  # pt, safetensors, both or dcp; None: dcp in fsdp, else pt
    # "module:factory" or a callable (picklable, for DDP); None: the built-in demo model / data.
    model: str | Callable[[], nn.Module] | None = None
    data: str | Callable[[], Dataset] | None = None
    nproc_per_node: int = 2
    timeout_s: float = 60.0  # process-group timeout: a missing rank fails fast
    quiet: bool = False

    def check(self) -> None:
        """Refuse values that cannot work, before any process starts."""
        if self.mode not in {m.value for m in Mode}:
            raise UsageError(f"unknown mode '{self.mode}'", "use single, dp, ddp or fsdp")
        if self.save_format is None:
            self.save_format = "dcp" if self.mode == Mode.FSDP.value else "pt"
        if self.save_format not in ("pt", "safetensors", "both", "dcp"):
            raise UsageError(
                f"unknown --save-format '{self.save_format}'", "use pt, safetensors, both or dcp"
            )
        for name in ("epochs", "batch_size", "save_every", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")


@dataclass
class TrainResult:
    """What a run did: its metrics per epoch and its last checkpoint."""

    out: str
    epochs_run: int
    resumed_from: str | None
    checkpoint: str | None
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _factory(spec: str | Callable[[], Any] | None, default: Callable[[], Any], what: str) -> Any:
    if spec is None:
        return default()
    if callable(spec):
        return spec()
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(
            f"--{what} '{spec}' is not MODULE:FACTORY", f"e.g. --{what} mypkg.models:build"
        )
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the current folder's modules are importable
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot load --{what} '{spec}': {exc}") from None
    return factory()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


class Engine:
    """Runs the loop in this process (rank 0, or one DDP worker). Build with a config; call
    :meth:`run`. ``ckptkit.train`` starts the DDP workers for you."""

    def __init__(self, config: TrainConfig) -> None:
        config.check()
        self.config = config
        self.ctx: Context | None = None

    def run(self) -> TrainResult:
        cfg = self.config
        ctx = self.ctx = setup(Mode(cfg.mode), cfg.device, timeout_s=cfg.timeout_s)
        try:
            return self._run(ctx)
        finally:
            teardown(ctx)

    def _run(self, ctx: Context) -> TrainResult:
        cfg = self.config
        if cfg.batch_size % ctx.world_size:
            raise UsageError(
                f"--batch-size {cfg.batch_size} does not split over {ctx.world_size} ranks",
                f"use a multiple of {ctx.world_size}",
            )
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = _factory(cfg.model, demo_model, "model")
        dataset: Dataset = _factory(cfg.data, demo_data, "data")
        wrapped = wrap(model, ctx)
        if ctx.mode is Mode.DP and ctx.device.type != "cuda" and not cfg.quiet:
            print("dp: no GPU visible, so DataParallel runs the module on the CPU", file=sys.stderr)
        inner, chain = unwrap(wrapped)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        # One shuffling rule for every mode: DistributedSampler over the world (of 1 outside
        # DDP), so a global batch holds the same samples whatever the world size.
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=ctx.world_size,
            rank=ctx.rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        loader = DataLoader(
            dataset, batch_size=cfg.batch_size // ctx.world_size, sampler=sampler, drop_last=True
        )
        out = Path(cfg.out)
        if ctx.is_main:
            _check_writable(out)  # fail now, not after the first epoch
        state = {"epoch": 0, "step": 0, "samples": 0}
        torch.manual_seed(cfg.seed + 1000 * ctx.rank)  # per-rank streams (dropout and the like)
        resumed = checkpoint.find_resume(cfg.resume, out)
        if resumed is not None:
            self._restore(resumed, inner, optimizer, scheduler, state, ctx)
        result = TrainResult(str(out), 0, str(resumed) if resumed else None, None)
        for epoch in range(state["epoch"], cfg.epochs):
            sampler.set_epoch(epoch)
            metrics = self._epoch(wrapped, loader, optimizer, ctx, epoch)
            scheduler.step()
            state["epoch"] = epoch + 1
            state["step"] += len(loader)
            state["samples"] += len(loader) * cfg.batch_size
            result.epochs_run += 1
            if ctx.is_main:
                result.metrics.append(metrics)
                out.mkdir(parents=True, exist_ok=True)
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                if not cfg.quiet:
                    print(
                        f"epoch {metrics['epoch']}/{cfg.epochs}  loss {metrics['loss']:.4f}  "
                        f"acc {metrics['accuracy']:.3f}  {metrics['samples_per_s']:.0f} samples/s",
                        file=sys.stderr,
                        flush=True,
                    )
            if state["epoch"] % cfg.save_every == 0 or state["epoch"] == cfg.epochs:
                rng = ctx.gather(_rng_state())
                path = self._save(inner, chain, optimizer, scheduler, state, rng, ctx)
                if ctx.is_main:
                    result.checkpoint = str(path)
                ctx.barrier()  # every rank waits for the commit, so none runs ahead of it
        return result

    def _epoch(
        self,
        wrapped: nn.Module,
        loader: DataLoader,
        optimizer: torch.optim.Optimizer,
        ctx: Context,
        epoch: int,
    ) -> dict[str, Any]:
        from tqdm import tqdm

        wrapped.train()
        loss_sum = correct = count = 0.0
        started = time.perf_counter()
        show = ctx.is_main and not self.config.quiet and sys.stderr.isatty()
        for inputs, labels in tqdm(
            loader, desc=f"epoch {epoch + 1}", leave=False, disable=not show
        ):
            inputs, labels = inputs.to(ctx.device), labels.to(ctx.device)
            optimizer.zero_grad(set_to_none=True)
            logits = wrapped(inputs)
            loss = nn.functional.cross_entropy(logits, labels)
            loss.backward()
            optimizer.step()
            loss_sum += float(loss.detach()) * len(labels)
            correct += float((logits.argmax(1) == labels).sum())
            count += len(labels)
        loss_sum, correct, count = ctx.sum([loss_sum, correct, count])
        elapsed = time.perf_counter() - started
        return {
            "epoch": epoch + 1,
            "loss": loss_sum / max(count, 1),
            "accuracy": correct / max(count, 1),
            "samples_per_s": count / elapsed if elapsed else 0.0,
            "world_size": ctx.world_size,
        }

    def _metadata(
        self, weights: dict[str, Any] | None, chain: list[str], ctx: Context, state: dict[str, int]
    ) -> dict[str, Any]:
        """The run's record in every checkpoint; ``weights`` (whole, on rank 0) are hashed,
        None for a DCP checkpoint, whose shards no rank holds whole."""
        cfg = self.config
        return {
            "ckptkit_version": VERSION,
            "torch_version": str(torch.__version__),  # a str subclass weights_only would refuse
            "mode": cfg.mode,
            "world_size": ctx.world_size,
            "nodes": ctx.nodes,
            "backend": ctx.backend,
            "device_type": ctx.device.type,
            "removed_prefixes": chain,
            "global_batch_size": cfg.batch_size,
            "per_rank_batch_size": cfg.batch_size // ctx.world_size,
            "seed": cfg.seed,
            "config": {k: _plain(v) for k, v in dataclasses.asdict(cfg).items()},
            "git_commit": _git_commit(),
            "host": platform.node(),
            "utc_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "weights_sha256": checkpoint.weights_sha256(weights) if weights is not None else None,
            **state,
        }

    def _save(
        self,
        inner: nn.Module,
        chain: list[str],
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: dict[str, int],
        rng: list[Any],
        ctx: Context,
    ) -> Path | None:
        """Save a checkpoint; every rank calls it (fsdp gathers, DCP writes on every rank).
        Returns its path (None on the ranks that do not write)."""
        cfg = self.config
        counters = {
            "scheduler": scheduler.state_dict(),
            "rng": rng,
            "epoch": state["epoch"],
            "step": state["step"],
            "samples_seen": state["samples"],
        }
        if cfg.save_format == "dcp":
            model_state, optim_state = training_state(inner, optimizer, ctx, sharded=True)
            meta = self._metadata(None, chain, ctx, state)
            return checkpoint.commit_dcp(
                Path(cfg.out),
                state["epoch"],
                {"model": model_state, "optim": optim_state},
                {**counters, "ckptkit": meta},
                is_main=ctx.is_main,
                share=lambda value: ctx.gather(value)[0],
                keep_last=cfg.keep_last,
            )
        model_state, optim_state = training_state(inner, optimizer, ctx, sharded=False)
        if not ctx.is_main:
            return None
        weights = {k: v.detach().to("cpu") for k, v in model_state.items()}
        payload = {
            "model": weights,
            "optimizer": _to_cpu(optim_state),
            **counters,
            "ckptkit": self._metadata(weights, chain, ctx, state),
        }
        formats = {"pt": ("pt",), "safetensors": ("safetensors",), "both": ("pt", "safetensors")}
        return checkpoint.commit(
            Path(cfg.out),
            state["epoch"],
            payload,
            keep_last=cfg.keep_last,
            formats=formats[cfg.save_format or "pt"],
        )

    def _restore(
        self,
        path: Path,
        inner: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: dict[str, int],
        ctx: Context,
    ) -> None:
        payload = checkpoint.load_payload(path)
        if "dcp" in payload:  # a DCP checkpoint: its shards, resharded to this run's world
            parts = payload["dcp"]
            model_state, optim_state = training_state(inner, optimizer, ctx, sharded=True)
            kept = optim_state if "optim" in parts else None
            if "model" in parts:  # a training checkpoint: its model, and optimizer if saved
                wanted = {"model": model_state, "optim": kept}
                checkpoint.load_dcp(path, {k: v for k, v in wanted.items() if v is not None})
            else:  # a bare state dict (convert --to dcp)
                checkpoint.load_dcp(path, model_state)
            load_training_state(inner, optimizer, ctx, model_state, kept, sharded=True)
            if kept is None and ctx.is_main:
                print(f"{path} holds weights only: the optimizer starts afresh", file=sys.stderr)
        else:
            target = inner.state_dict()
            match = match_keys(payload["model"], target)  # any wrapper chain (legacy `module.`)
            if not match.exact:
                raise UsageError(
                    mismatch_message(f"{path} does not fit the model", match),
                    "resume with the same --model",
                )
            weights = {
                new: payload["model"][old] for old, new in match.mapping.items() if new is not None
            }
            load_training_state(inner, optimizer, ctx, weights, payload.get("optimizer"),
                                sharded=False)  # fmt: skip
            if "optimizer" not in payload and ctx.is_main:
                print(f"{path} holds weights only: the optimizer starts afresh", file=sys.stderr)
        if "scheduler" in payload:
            scheduler.load_state_dict(payload["scheduler"])
        state["epoch"] = int(payload.get("epoch", 0))
        state["step"] = int(payload.get("step", 0))
        state["samples"] = int(payload.get("samples_seen", 0))
        rng = payload.get("rng")
        if isinstance(rng, list) and len(rng) == ctx.world_size:
            _set_rng_state(rng[ctx.rank])  # same world size: each rank continues its stream
        if ctx.is_main and not self.config.quiet:
            print(f"resumed from {path} at epoch {state['epoch']}", file=sys.stderr, flush=True)


def _plain(value: Any) -> Any:
    """A config value as checkpoint metadata may hold it (a factory becomes its name)."""
    if callable(value):
        return f"{value.__module__}:{value.__qualname__}"
    return value


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


def _to_cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
