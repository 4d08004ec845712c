"""What a training checkpoint holds, and how it is put back.

A checkpoint's payload is a dict: the weights, the optimizer's state, where the run stands
(:class:`Progress`: epochs done, optimizer steps, samples seen, batches of the epoch done, the
epoch's running sums, the ``--monitor`` record), every rank's RNG, the AMP scaler's state, and
the run's metadata under :data:`ckptkit.meta.TRAINING_KEY`. :func:`file_payload` and
:func:`dcp_payload` gather it from a run, :func:`load_payload` reads it back safely and
:func:`restore` puts it back into a run. Writing it is the commit protocol's job
(:mod:`ckptkit.engine.checkpoint`).
"""

from __future__ import annotations

import io
import pickle
import platform
import random
import subprocess
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import torch

from ckptkit.engine.distributed import (
    load_training_state,
    quiet_single_process_dcp,
    training_state,
)
from ckptkit.engine.remote import dcp_storage, shown_path
from ckptkit.engine.runlog import logger
from ckptkit.errors import FormatError, UsageError
from ckptkit.formats.base.tree import map_leaves
from ckptkit.keys import match_keys, mismatch_message
from ckptkit.meta import TRAINING_KEY, version
from ckptkit.storage.location import Location, is_local
from ckptkit.text import escape

if TYPE_CHECKING:
    from ckptkit.engine.build import Run
    from ckptkit.engine.config import TrainConfig
    from ckptkit.engine.distributed import Context

__all__ = [
    "Progress",
    "file_payload",
    "dcp_payload",
    "load_payload",
    "load_dcp",
    "restore",
    "rng_state",
]

# The parts of a training checkpoint, named once: saving writes them, restoring reads them.
MODEL, OPTIMIZER, OPTIM_DCP, META = "model", "optimizer", "optim", TRAINING_KEY
EPOCH, STEP, SAMPLES, BATCH = "epoch", "step", "samples_seen", "batch_in_epoch"
PARTIAL, RNG, SCALER, MONITOR = "epoch_partial", "rng", "scaler", "monitor"
DIGEST = "weights_sha256"  # in META: set by the commit as the weights are written
SHARDS = "dcp"  # what reading a DCP checkpoint adds: the parts its shards hold
TRAIN_STATE = "meta.pt"  # beside a DCP checkpoint's shards: counters, scheduler, RNG, metadata


@dataclass
class Progress:
    """Where the run stands: epochs done, optimizer steps, samples seen, batches of the
    current epoch done, and the epoch's running sums (loss x samples, correct, samples)."""

    epoch: int = 0
    step: int = 0
    samples: int = 0
    batch: int = 0
    partial: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    best: float | None = None  # the best --monitor value so far
    bad: int = 0  # validations since it last improved


# Saving: the payload gathered from a run.


def file_payload(
    cfg: TrainConfig, run: Run, ctx: Context, progress: Progress, rng: list[Any]
) -> dict[str, Any] | None:
    """The whole training state, on the CPU, for a ``.pt`` or ``.safetensors`` file; every
    rank calls it (fsdp gathers to rank 0). None on the ranks that do not write."""
    model_state, optim_state = training_state(run.inner, run.optimizer, ctx, sharded=False)
    if not ctx.is_main:
        return None
    return {
        MODEL: {k: v.detach().to("cpu") for k, v in model_state.items()},
        OPTIMIZER: map_leaves(optim_state, torch.is_tensor, _on_cpu),
        **_counters(run, progress, rng),
        META: _metadata(cfg, run.chain, ctx, progress),
    }


def dcp_payload(
    cfg: TrainConfig, run: Run, ctx: Context, progress: Progress, rng: list[Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DCP checkpoint's parts: the shards every rank writes (``model``, ``optim``) and the
    rest, which rank 0 writes as ``meta.pt``."""
    counters = _counters(run, progress, rng)
    model_state, optim_state = training_state(run.inner, run.optimizer, ctx, sharded=True)
    shards = {MODEL: model_state, OPTIM_DCP: optim_state}
    return shards, {**counters, META: _metadata(cfg, run.chain, ctx, progress)}


def _counters(run: Run, progress: Progress, rng: list[Any]) -> dict[str, Any]:
    return {
        RNG: rng,
        EPOCH: progress.epoch,
        STEP: progress.step,
        SAMPLES: progress.samples,
        BATCH: progress.batch,
        PARTIAL: list(progress.partial),
        SCALER: run.scaler.state_dict() if run.scaler is not None else None,
        MONITOR: {"best": progress.best, "bad": progress.bad},
    }


def _metadata(
    cfg: TrainConfig, chain: list[str], ctx: Context, progress: Progress
) -> dict[str, Any]:
    """The run's record in every checkpoint. The weights' digest is left to the commit,
    which hashes them as it writes them (None stays for a DCP checkpoint, whose shards no
    rank holds whole)."""
    return {
        "ckptkit_version": version(),
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
        "config": cfg.recorded(),
        "git_commit": _git_commit(),
        "host": platform.node(),
        "utc_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        DIGEST: None,
        "epoch": progress.epoch,
        "step": progress.step,
        "samples": progress.samples,
        "batch": progress.batch,
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu")


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch's, Python's, CUDA's when in use), to save."""
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


# Restoring: the payload read back, and put back into a run.


def restore(path: Location, run: Run, progress: Progress, ctx: Context) -> None:
    """Resume from the checkpoint at ``path``: the weights and optimizer into ``run`` (a DCP
    checkpoint resharded to this run's world), where it stood into ``progress``, and this
    rank's RNG when the world size is the same.

    Raises:
        UsageError: the weights do not fit the model.
        FormatError: the checkpoint cannot be read.
    """
    payload = load_payload(path)
    if SHARDS in payload:
        optimizer_restored = _restore_shards(path, payload[SHARDS], run, ctx)
    else:
        optimizer_restored = _restore_whole(path, payload, run, ctx)
    if not optimizer_restored and ctx.is_main:
        logger.warning("%s holds weights only: the optimizer starts afresh", escape(str(path)))
    if payload.get(SCALER) and run.scaler is not None:
        run.scaler.load_state_dict(payload[SCALER])
    progress.epoch = int(payload.get(EPOCH, 0))
    progress.step = int(payload.get(STEP, 0))
    progress.samples = int(payload.get(SAMPLES, 0))
    progress.batch = int(payload.get(BATCH, 0) or 0)
    monitor = payload.get(MONITOR)
    if isinstance(monitor, Mapping):
        progress.best, progress.bad = monitor.get("best"), int(monitor.get("bad", 0))
    partial = payload.get(PARTIAL)
    if isinstance(partial, list) and len(partial) == 3:
        progress.partial = [float(v) for v in partial]
    rng = payload.get(RNG)
    if isinstance(rng, list) and len(rng) == ctx.world_size:
        _set_rng_state(rng[ctx.rank])  # same world size: each rank continues its stream
    where = f"epoch {progress.epoch}" + (f", step {progress.step}" if progress.batch else "")

    logger.info("resumed from %s at %s", escape(shown_path(path)), where)


def _restore_shards(path: Location, parts: set[str], run: Run, ctx: Context) -> bool:
    """A DCP checkpoint's shards, resharded to this run's world. Returns whether it held the
    optimizer's state."""
    inner, optimizer = run.inner, run.optimizer
    model_state, optim_state = training_state(inner, optimizer, ctx, sharded=True)
    kept = optim_state if OPTIM_DCP in parts else None
    if MODEL in parts:  # a training checkpoint: its model, and optimizer if saved
        wanted = {MODEL: model_state, OPTIM_DCP: kept}
        load_dcp(path, {k: v for k, v in wanted.items() if v is not None})
    else:  # a bare state dict (convert --to dcp)
        load_dcp(path, model_state)
    load_training_state(inner, optimizer, ctx, model_state, kept, sharded=True)
    return kept is not None


def _restore_whole(path: Location, payload: dict[str, Any], run: Run, ctx: Context) -> bool:
    """A file's weights (under any wrapper chain) and optimizer state. Returns whether it held
    the optimizer's state."""
    match = match_keys(payload[MODEL], run.inner.state_dict())  # any chain (legacy `module.`)
    if not match.exact:
        raise UsageError(
            mismatch_message(f"{path} does not fit the model", match),
            "resume with the same --model",
        )
    weights = {new: payload[MODEL][old] for old, new in match.mapping.items() if new is not None}
    kept = payload.get(OPTIMIZER)
    load_training_state(run.inner, run.optimizer, ctx, weights, kept, sharded=False)
    return kept is not None


def load_payload(path: Location, *, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's contents, read safely (weights_only) onto the CPU. A safetensors file
    gives its weights and the epoch counters its header recorded. ``mmap`` maps a zip file's
    tensors instead of reading them."""
    if path.suffix == ".safetensors":
        return _load_weights(path)
    if not is_local(path) or path.is_dir():  # a DCP checkpoint (the only kind read at a URL)
        return _dcp_train_state(path)
    payload = _safe_load(path, mmap=mmap)
    if (
        isinstance(payload, Mapping)
        and MODEL not in payload
        and all(torch.is_tensor(v) for v in payload.values())
    ):
        payload = {MODEL: payload}  # a bare state dict resumes the weights only
    if not isinstance(payload, Mapping) or MODEL not in payload:
        raise FormatError(f"{path} holds no 'model' state dict to resume from")
    return dict(payload)


def _safe_load(path: Location, *, mmap: bool = False) -> Any:
    try:
        if not is_local(path):  # a DCP checkpoint's meta.pt at a URL: small, read whole
            return torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
        mapped = mmap and zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as exc:
        raise FormatError(
            f"cannot resume from {path}: {exc}".splitlines()[0],
            "check the file with `ckptkit inspect`",
        ) from exc


def _load_weights(path: Location) -> dict[str, Any]:
    from safetensors import safe_open

    from ckptkit.meta import CheckpointMeta

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {key: f.get_tensor(key) for key in f.keys()}
            training = CheckpointMeta.from_header(f.metadata() or {}).training
    except Exception as exc:
        raise FormatError(f"cannot resume from {path}: {exc}") from None
    counters = {
        EPOCH: training.get("epoch", 0),
        STEP: training.get("step", 0),
        SAMPLES: training.get("samples", 0),
        BATCH: training.get("batch", 0),
    }
    return {MODEL: state, **counters}


def _dcp_train_state(path: Location) -> dict[str, Any]:
    """A DCP checkpoint's ``meta.pt``, its ``.metadata`` checked (read statically), here or at
    a URL: the shards themselves are read by :func:`load_dcp`."""
    from ckptkit.formats.folders.dcp import METADATA, read_metadata

    metadata = path / METADATA
    items = read_metadata(metadata, metadata.read_bytes()).get("state_dict_metadata")
    payload = _safe_load(path / TRAIN_STATE) if (path / TRAIN_STATE).is_file() else {}
    if not isinstance(payload, Mapping) or not isinstance(items, Mapping):
        raise FormatError(f"{path} is not a training checkpoint", "check it with ckptkit inspect")
    # What it holds: a training checkpoint's "model" and "optim", or a bare state dict.
    parts = {str(key).split(".", 1)[0] for key in items}
    return {**payload, SHARDS: {MODEL, OPTIM_DCP} & parts or {"state dict"}}


def load_dcp(path: Location, shards: dict[str, Any]) -> None:
    """Fill ``shards`` (``model``, ``optim``: each rank's own, as saved) from a DCP
    checkpoint, here or at a URL (torch's ``FsspecReader``: nothing downloaded first); DCP
    reshards to this run's world. Plain values stored in it are read with torch's safe loader
    (DCP's default planner would unpickle them in full)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    quiet_single_process_dcp()
    try:
        dcp.load(shards, **dcp_storage(path), planner=_safe_load_planner())
    except (Exception, CheckpointException) as exc:
        raise FormatError(
            f"cannot resume from {path}: {_dcp_failure(exc)}",
            "check it with `ckptkit inspect`; resume with the same --model",
        ) from exc


def _dcp_failure(exc: BaseException) -> str:
    """What went wrong in ``dcp.load``, in one line (it wraps each rank's exception)."""
    failures = getattr(exc, "failures", None)  # rank -> (exception, traceback)
    if isinstance(failures, dict) and failures:
        failure = next(iter(failures.values()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        exc = inner if isinstance(inner, BaseException) else exc
    if isinstance(exc, pickle.UnpicklingError):
        return "a stored value is not plain data, and torch's safe loader refused it"
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _safe_load_planner() -> Any:
    """DCP's default load planner, but plain values go through torch's safe loader. (Made
    here: importing torch.distributed.checkpoint costs half a second every run would pay.)"""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
