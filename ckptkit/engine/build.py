"""Building a run from its config: model (wrapped for the mode), optimizer, learning-rate
schedule, data, loss, and the gradient scaler for fp16."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

from ckptkit.engine.config import TrainConfig
from ckptkit.engine.demo import demo_data, demo_model
from ckptkit.engine.distributed import Context, Mode, unwrap, wrap
from ckptkit.engine.runlog import logger
from ckptkit.errors import UsageError

__all__ = ["Run", "build", "factory"]


@dataclass
class Run:
    """What the loop trains with."""

    wrapped: nn.Module  # as the mode wraps it (DDP, DataParallel, FSDP2, compiled)
    inner: nn.Module  # the model itself: its state dict has the canonical keys
    chain: list[str]  # the key prefixes the wrappers add, outermost first
    optimizer: torch.optim.Optimizer
    sampler: DistributedSampler[Any]
    dataset: Dataset[Any]
    per_rank_batch: int
    loss: Callable[[Any, Any], torch.Tensor]
    scaler: Any  # torch.amp.GradScaler for fp16, else None
    steps_per_epoch: int
    val_dataset: Dataset[Any] | None = None

    def loader(
        self, epoch: int, skip_batches: int = 0, *, num_workers: int = 0, seed: int = 0
    ) -> DataLoader[Any]:
        """The epoch's batches from the ``skip_batches``-th on (a resume mid-epoch)."""
        self.sampler.set_epoch(epoch)
        # Its own generator (for the workers' seeds): making an iterator draws from it, which
        # must not move the global RNG (a run resumed mid-epoch makes it at another moment).
        return DataLoader(
            self.dataset,
            batch_size=self.per_rank_batch,
            sampler=_Skip(self.sampler, skip_batches * self.per_rank_batch),
            drop_last=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(seed + epoch),
        )

    def val_batches(self, rank: int, world: int) -> Iterator[tuple[Any, int]]:
        """This rank's share of the validation data, in batches, each with how many of its
        items count: every rank runs as many batches (FSDP gathers in each forward), so the
        ranks with fewer items repeat some and count them 0 times."""
        assert self.val_dataset is not None
        total = len(self.val_dataset)  # type: ignore[arg-type]
        share = math.ceil(total / world)
        mine = [min(rank + world * i, total - 1) for i in range(share)]
        valid = [rank + world * i < total for i in range(share)]
        for start in range(0, share, self.per_rank_batch):
            items = [self.val_dataset[j] for j in mine[start : start + self.per_rank_batch]]
            counted = sum(valid[start : start + self.per_rank_batch])
            batch = torch.utils.data.default_collate(items)
            yield batch, counted


class _Skip(Sampler[int]):
    """A sampler's indices from the ``start``-th on."""

    def __init__(self, sampler: DistributedSampler[Any], start: int) -> None:
        self.sampler, self.start = sampler, start

    def __iter__(self) -> Iterator[int]:
        indices = iter(self.sampler)
        for _ in range(self.start):
            next(indices, None)
        return indices

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.start)


def factory(spec: str | Callable[[], Any] | None, default: Callable[[], Any], what: str) -> Any:
    """What a ``MODULE:FACTORY`` option (or a callable) makes; ``default()`` when None."""
    if spec is None:
        return default()
    if callable(spec):
        return spec()
    return _resolve(spec, what)()


def _resolve(spec: str, what: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        form = "MODULE:FN" if what == "loss" else "MODULE:FACTORY"
        raise UsageError(f"--{what} '{spec}' is not {form}", f"e.g. --{what} mypkg.{what}:build")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the current folder's modules are importable
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot load --{what} '{spec}': {exc}") from exc


def build(cfg: TrainConfig, ctx: Context) -> Run:
    """Make the run: the same initial weights on every rank (seeded), wrapped for the mode."""
    per_rank = cfg.batch_size // ctx.world_size
    if cfg.batch_size % ctx.world_size or per_rank % cfg.grad_accum:
        raise UsageError(
            f"--batch-size {cfg.batch_size} does not split over {ctx.world_size} ranks "
            f"x {cfg.grad_accum} micro-batches",
            f"use a multiple of {ctx.world_size * cfg.grad_accum}",
        )
    torch.manual_seed(cfg.seed)
    model = factory(cfg.model, demo_model, "model")
    dataset: Dataset[Any] = factory(cfg.data, demo_data, "data")
    val: Dataset[Any] | None = None
    if cfg.val_data is not None:
        val = factory(cfg.val_data, demo_data, "val-data")
    elif cfg.val_fraction is not None:  # held out by a seeded shuffle, the same on every rank
        seeded = torch.Generator().manual_seed(cfg.seed)
        order = torch.randperm(len(dataset), generator=seeded)  # type: ignore[arg-type]
        cut = len(order) - max(1, int(len(order) * cfg.val_fraction))
        dataset, val = Subset(dataset, order[:cut].tolist()), Subset(dataset, order[cut:].tolist())
    if cfg.compile:
        model = torch.compile(model)
    wrapped = wrap(model, ctx)
    if ctx.mode is Mode.DP and ctx.device.type != "cuda":
        logger.info("dp: no GPU visible, so DataParallel runs the module on the CPU")
    inner, chain = unwrap(wrapped)
    # One shuffling rule for every mode: DistributedSampler over the world (of 1 outside DDP),
    # so a global batch holds the same samples whatever the world size.
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset,
        num_replicas=ctx.world_size,
        rank=ctx.rank,
        shuffle=True,
        seed=cfg.seed,
        drop_last=True,
    )
    steps = len(sampler) // per_rank
    if steps == 0:
        raise UsageError(
            f"the data holds fewer than --batch-size {cfg.batch_size} samples per rank",
            "use a smaller --batch-size",
        )
    scaler = None
    if cfg.precision == "fp16":
        scaler = torch.amp.GradScaler(ctx.device.type)
    return Run(
        wrapped,
        inner,
        chain,
        _optimizer(cfg, wrapped),
        sampler,
        dataset,
        per_rank,
        _loss(cfg.loss),
        scaler,
        steps,
        val,
    )


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_factor(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based), as a factor of ``--lr``: linear
    warmup, then ``constant``, ``step`` (times ``lr_gamma`` every ``lr_step_epochs`` epochs) or
    ``cosine`` (to 0 at the last step)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "step":
        return float(cfg.lr_gamma ** ((step // steps_per_epoch) // cfg.lr_step_epochs))
    if cfg.lr_schedule == "cosine":
        total = cfg.max_steps or cfg.epochs * steps_per_epoch
        span = max(1, total - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup_steps) / span)))
    return 1.0


def _loss(spec: str) -> Callable[[Any, Any], torch.Tensor]:
    if spec == "cross_entropy":
        return nn.functional.cross_entropy
    if spec == "mse":
        return nn.functional.mse_loss
    fn = _resolve(spec, "loss")
    if not callable(fn):
        raise UsageError(f"--loss '{spec}' is not a function")
    return fn


def forward(run: Run, batch: Any, device: torch.device) -> tuple[torch.Tensor, Any, Any]:
    """One micro-batch through the model: (loss, output, target). A mapping batch is passed as
    keyword arguments (Hugging Face style); an (input, target) pair as the input. A model that
    returns a mapping with ``loss`` has its loss used; otherwise ``--loss`` of (output, target)."""
    if isinstance(batch, Mapping):
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        output, target = run.wrapped(**batch), batch.get("labels")
    else:
        inputs, target = batch[0].to(device), batch[1].to(device)
        output = run.wrapped(inputs)
    if isinstance(output, Mapping) and output.get("loss") is not None:
        return output["loss"], output.get("logits"), target
    if target is None:
        raise UsageError(
            "the batches hold no target and the model returns no loss",
            "give (input, target) items, or a model that returns its loss",
        )
    return run.loss(output, target), output, target
