"""Train your own model and data with ckptkit's engine from Python, in any mode.

    python3 examples/train_own_model.py [single|dp|ddp] [OUT_DIR]

The factories must be importable functions (DDP workers are separate processes that import them).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ckptkit.engine


def make_model() -> nn.Module:
    """A small CNN for 1x8x8 "images"."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 2)
    )


def make_data() -> TensorDataset:
    """Images whose label says whether the top half is brighter than the bottom half."""
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(1024, 1, 8, 8, generator=gen)
    labels = (images[:, :, :4].mean((1, 2, 3)) > images[:, :, 4:].mean((1, 2, 3))).long()
    return TensorDataset(images, labels)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "single"
    out = sys.argv[2] if len(sys.argv) > 2 else f"runs/own-{mode}"
    result = ckptkit.engine.train(
        mode=mode,
        model=make_model,
        data=make_data,
        epochs=3,
        batch_size=32,
        lr=0.05,
        out=out,
        nproc_per_node=2,
    )
    last = result.metrics[-1]
    print(
        f"{mode}: accuracy {last['accuracy']:.3f} after {result.epochs_run} epochs; "
        f"checkpoint {result.checkpoint}"
    )


if __name__ == "__main__":
    main()
