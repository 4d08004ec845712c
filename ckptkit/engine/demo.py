"""The built-in model and data: small, deterministic, and learnable in a few epochs on a CPU."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

__all__ = ["demo_model", "demo_data", "BlobData"]

FEATURES, CLASSES = 16, 4


def demo_model() -> nn.Module:
    """An MLP classifier. No BatchNorm or dropout, so every mode computes the same updates."""
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
    )


class BlobData(Dataset):
    """Points around four fixed centres; the label is the centre. Same data on every rank."""

    def __init__(self, size: int = 2048, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        centres = torch.randn(CLASSES, FEATURES, generator=gen) * 1.5
        self.labels = torch.randint(0, CLASSES, (size,), generator=gen)
        self.inputs = centres[self.labels] + torch.randn(size, FEATURES, generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


def demo_data() -> Dataset:
    """The built-in dataset: 2048 labelled points."""
    return BlobData()
