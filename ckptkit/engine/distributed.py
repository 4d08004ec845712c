"""The one module that knows about modes: process groups, wrapping, unwrapping, rank helpers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptkit.errors import UsageError

__all__ = ["Mode", "Context", "setup", "teardown", "wrap", "unwrap", "under_launcher"]


class Mode(str, Enum):
    SINGLE = "single"
    DP = "dp"
    DDP = "ddp"


@dataclass(frozen=True)
class Context:
    """Where this process stands: its mode, rank, world and device."""

    mode: Mode
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    nodes: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Every rank waits here; the group's timeout turns a missing rank into an error."""
        if self.mode is Mode.DDP:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over all ranks."""
        if self.mode is not Mode.DDP:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` from every rank, in rank order (on every rank)."""
        if self.mode is not Mode.DDP:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def under_launcher() -> bool:
    """True inside a worker started by torchrun or torch's elastic launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but no CUDA device is visible", "use --device cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(mode: Mode, device: str = "cpu", *, timeout_s: float = 60.0) -> Context:
    """Join the process group for DDP (from the launcher's environment), or stay alone."""
    if mode is not Mode.DDP:
        return Context(mode=mode, device=_device(device, 0))
    if not under_launcher():
        raise UsageError(
            "DDP workers need a launcher's environment", "run `ckptkit train --mode ddp`"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = "nccl" if device == "cuda" else "gloo"
    dev = _device(device, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Context(Mode.DDP, rank, local_rank, world, max(1, world // local_world), backend, dev)


def teardown(ctx: Context) -> None:
    if ctx.mode is Mode.DDP and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: Context) -> nn.Module:
    """Wrap for the mode: DataParallel, DistributedDataParallel, or nothing."""
    model = model.to(ctx.device)
    if ctx.mode is Mode.DP:
        return nn.DataParallel(model)  # with no GPU it simply runs the module on the CPU
    if ctx.mode is Mode.DDP:
        ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model


def unwrap(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """The model inside its wrappers, and the key prefixes those wrappers add (outermost first)."""
    chain: list[str] = []
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            chain.append("module.")
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            chain.append("_orig_mod.")
            model = model._orig_mod
        else:
            return model, chain
