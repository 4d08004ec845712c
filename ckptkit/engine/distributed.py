"""The one module that knows about modes: process groups, wrapping, unwrapping, rank helpers,
and taking or restoring the training state (model and optimizer) whatever the mode: plain state
dicts in single, dp and ddp; FSDP2's sharded ones (DTensors) or gathered full ones in fsdp."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptkit.engine.config import under_launcher
from ckptkit.errors import HungRankError, UsageError

__all__ = [
    "Mode",
    "Context",
    "setup",
    "teardown",
    "wrap",
    "unwrap",
    "under_launcher",
    "hung_rank",
    "gradient_sync",
    "StopVote",
    "training_state",
    "load_training_state",
    "quiet_single_process_dcp",
]


class Mode(str, Enum):
    SINGLE = "single"
    DP = "dp"
    DDP = "ddp"
    FSDP = "fsdp"

    @property
    def distributed(self) -> bool:
        """One process per rank, in a process group."""
        return self in (Mode.DDP, Mode.FSDP)


@dataclass(frozen=True)
class Context:
    """Where this process stands: its mode, rank, world and device."""

    mode: Mode
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # ranks on this node
    nodes: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")
    # A gloo group beside the main one, for naming a rank that hangs (monitored_barrier is
    # gloo's; nccl has none).
    monitor: Any = None
    timeout_s: float = 60.0
    # Another gloo group, for the collectives of a DCP save running in the background: on the
    # training group they would interleave with the training's own.
    saves: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Every rank waits here; the group's timeout turns a missing rank into an error."""
        if self.mode.distributed:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over all ranks."""
        if not self.mode.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` from every rank, in rank order (on every rank)."""
        if not self.mode.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but no CUDA device is visible", "use --device cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(mode: Mode, device: str = "cpu", *, timeout_s: float = 60.0) -> Context:
    """Join the process group for DDP and FSDP (from the launcher's environment), or stay
    alone."""
    if not mode.distributed:
        return Context(mode=mode, device=_device(device, 0))
    if not under_launcher():
        raise UsageError(
            f"{mode.value} workers need a launcher's environment",
            f"run `ckptkit train --mode {mode.value}`",
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = "nccl" if device == "cuda" else "gloo"
    dev = _device(device, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    monitor = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    saves = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return Context(
        mode,
        rank,
        local_rank,
        world,
        local_world,
        max(1, world // local_world),
        backend,
        dev,
        monitor,
        timeout_s,
        saves,
    )


class StopVote:
    """Whether any rank wants to stop (it got SIGTERM), agreed by all: every ``every`` steps
    the ranks' votes are summed while the next steps run, so voting costs no wait and little
    traffic (a blocking all-reduce each step cost 4% of a DDP step here)."""

    def __init__(self, ctx: Context, every: int = 8) -> None:
        self.ctx, self.every, self.round = ctx, every, 0
        self.pending: Any = None
        self.votes = torch.zeros(1, device=ctx.device)

    def cast(self, mine: bool) -> bool:
        """Vote after a step; returns whether any rank voted to stop in the previous round (in
        a single process: this vote, at once)."""
        if not self.ctx.mode.distributed:
            return mine
        self.round += 1
        if self.round % self.every:
            return False
        stop = False
        if self.pending is not None:
            self.pending.wait()
            stop = bool(self.votes.item() > 0)
        self.votes = torch.full((1,), 1.0 if mine else 0.0, device=self.ctx.device)
        self.pending = dist.all_reduce(self.votes, async_op=True)
        return stop

    def close(self) -> None:
        """Wait for the last round (before the group's next collectives or its end)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


_MONITOR_WAIT_S = 5.0  # how long the ranks that timed out wait for the others to check in
_MISSING = (
    re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier"),  # rank 0's view
    re.compile(r"waiting for send/recv from rank (\d+)"),  # the others': rank 0 did not answer
)


def hung_rank(ctx: Context, exc: BaseException) -> HungRankError | None:
    """After ``exc``, when it is a collective that timed out: which rank never came. Every rank
    that timed out meets the others at a monitored barrier on the side group; the rank that
    hangs does not arrive, and gloo names it. None when ``exc`` is no timeout, or every rank
    arrives."""
    if ctx.monitor is None or "Timed out" not in str(exc):
        return None
    try:
        dist.monitored_barrier(
            group=ctx.monitor, timeout=timedelta(seconds=_MONITOR_WAIT_S), wait_all_ranks=True
        )
    except RuntimeError as err:
        found = next((m for rx in _MISSING if (m := rx.search(str(err)))), None)
        if found is None:
            return None
        ranks = [int(r) for r in found.group(1).split(",")]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return HungRankError(
            f"{who} hung: it never reached the collective the other ranks waited in for "
            f"--timeout {ctx.timeout_s:g} s",
            "see what it was doing: a stuck data loader, a deadlock, fewer batches than the others",
        )
    return None


def teardown(ctx: Context) -> None:
    if ctx.mode.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: Context) -> nn.Module:
    """Wrap for the mode: DataParallel, DistributedDataParallel, FSDP2's ``fully_shard`` (each
    child module with parameters its own unit, then the root), or nothing."""
    model = model.to(ctx.device)
    if ctx.mode is Mode.DP:
        return nn.DataParallel(model)  # with no GPU it simply runs the module on the CPU
    if ctx.mode is Mode.DDP:
        ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if ctx.mode is Mode.FSDP:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for child in model.children():  # shards as units: one gathered at a time
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model  # the same module, its parameters now DTensors
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, ctx: Context, *, enabled: bool) -> Iterator[None]:
    """Backward passes inside, with ``enabled`` False, keep their gradients on this rank (a
    micro-batch before the last of an optimizer step): DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``; nothing to do in the other modes."""
    if enabled or not ctx.mode.distributed:
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:  # FSDP2: the module itself
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise TypeError(f"{type(model).__name__} is not sharded by FSDP2")
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


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


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, ctx: Context, *, sharded: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's state dict and the optimizer's, to save.

    ``sharded`` (for DCP, in any mode): as ``torch.distributed.checkpoint.state_dict``'s
    ``get_state_dict`` gives them, the optimizer's keyed by parameter name, so a DCP
    checkpoint has the same keys whatever the mode; in fsdp each rank holds its shards
    (DTensors). Otherwise the whole state: the plain state dicts outside fsdp (the optimizer's
    keyed by index, as ``optimizer.state_dict()`` gives it); in fsdp gathered to rank 0 on the
    CPU, keyed by name (the other ranks get empty dicts).
    """
    if not sharded and ctx.mode is not Mode.FSDP:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = not sharded
    return get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full)
    )


def load_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: Context,
    model_state: dict[str, Any],
    optim_state: dict[str, Any] | None,
    *,
    sharded: bool,
) -> None:
    """Load state dicts into ``model`` and ``optimizer``: ``sharded`` ones as
    :func:`training_state` gave them (filled in by DCP), or whole ones saved in any mode, of
    which each fsdp rank keeps its shards. An optimizer state keyed by parameter name (fsdp's)
    or by index (``optimizer.state_dict()``'s) both load; None leaves the optimizer as it is."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    by_name = optim_state is not None and _keyed_by_name(optim_state)
    if not sharded and ctx.mode is not Mode.FSDP and not by_name:
        model.load_state_dict(model_state)
        if optim_state is not None:
            optimizer.load_state_dict(optim_state)
        return
    options = StateDictOptions(full_state_dict=not sharded, strict=True)
    if optim_state is None:
        set_model_state_dict(model, model_state, options=options)
        return
    if not by_name:
        optim_state = _by_name(model, optim_state)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=options,
    )


def _keyed_by_name(optim_state: dict[str, Any]) -> bool:
    groups = optim_state.get("param_groups") or [{}]
    return any(isinstance(p, str) for g in groups for p in g.get("params", []))


def _by_name(model: nn.Module, optim_state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()``'s parameter indices replaced by the parameters' names: the
    optimizer was built over ``model.parameters()``, in that order."""
    names = [name for name, _ in model.named_parameters()]
    return {
        "state": {names[i]: v for i, v in optim_state.get("state", {}).items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]
        ],
    }


def quiet_single_process_dcp() -> None:
    """DCP warns on every save and load outside a process group, which is what a single-device
    run means to do: that one warning is left out (a filter on its text, kept)."""
    warnings.filterwarnings(
        "ignore",
        message="torch.distributed is disabled, unavailable or uninitialized",
        category=UserWarning,
    )
