"""``--check-outputs``: each merged layer run against its unmerged form on seeded inputs.

The unmerged form is how the adapter runs before merging: the base layer plus the low-rank path
``scale * B(A(x))`` (and DoRA's per-row rescaling), never the merged weight. The relative error
between the two outputs shows that the merged model computes what the adapter did, up to the
rounding of the merged weight to the base's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptkit.adapters.changes import BiasDelta, LowRank, Tensors, conv_of

if TYPE_CHECKING:
    import torch

    from ckptkit.adapters.merged import MergedSource

__all__ = ["OutputCheck", "check_outputs"]

SAMPLES = 8  # inputs per layer
SEED = 0


@dataclass
class OutputCheck:
    """The worst relative error of each checked layer's merged output against its unmerged one."""

    errors: dict[str, float] = field(default_factory=dict)  # weight key -> relative error

    @property
    def worst(self) -> tuple[str, float] | None:
        return max(self.errors.items(), key=lambda kv: kv[1]) if self.errors else None

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "layers": len(self.errors),
            "worst": None if worst is None else {"key": worst[0], "relative_error": worst[1]},
            "errors": self.errors,
        }


def _forward(layout: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The base layer's output for input ``x``, weight in ``layout``."""
    if layout == "linear":
        return x @ weight.T
    if layout == "linear_t":
        return x @ weight
    if layout == "embedding":
        return weight[x]
    return conv_of(weight)(x, weight)


def _low_rank_path(change: LowRank, tensors: Tensors, x: torch.Tensor) -> torch.Tensor:
    """``scale * B(A(x))``, as the unmerged adapter computes it."""
    a, b = tensors(change.a), tensors(change.b)
    if change.layout in ("linear", "linear_t"):
        return (x @ a.T) @ b.T * change.scale
    if change.layout == "embedding":
        return a.T[x] @ b.T * change.scale
    conv = conv_of(a)
    return conv(conv(x, a), b) * change.scale


def _input(layout: str, weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    import torch

    if layout == "embedding":
        return torch.randint(0, weight.shape[0], (SAMPLES,), generator=generator)
    if layout == "linear":
        return torch.randn(SAMPLES, weight.shape[1], generator=generator)
    if layout == "linear_t":
        return torch.randn(SAMPLES, weight.shape[0], generator=generator)
    size = [max(2 * k, 4) for k in weight.shape[2:]]
    return torch.randn(SAMPLES, weight.shape[1], *size, generator=generator)


def _rows_shape(y: torch.Tensor, layout: str) -> list[int]:
    """How a per-output-row factor broadcasts over a layer's output."""
    if layout in ("linear", "linear_t", "embedding"):
        return [1, -1]
    return [1, -1] + [1] * (y.dim() - 2)


def _unmerged(source: MergedSource, key: str, x: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """The layer's unmerged output (adapters applied in order), or None when the key is not
    a layer weight with a low-rank change (a bias, a replaced module)."""
    import torch

    steps = [(c, source.tensors_of(a)) for a, c in source.changes[key]]
    low = [c for c, _ in steps if isinstance(c, LowRank)]
    if not low or len(low) != len(steps):
        return None
    layout = low[0].layout
    weight = source.base.load(key).to(torch.float32)
    y = _forward(layout, weight, x)
    for change, tensors in steps:
        assert isinstance(change, LowRank)
        delta = change.delta(0, weight.shape[0], tensors).reshape(weight.shape)
        y = y + _low_rank_path(change, tensors, x)
        if change.magnitude is not None:  # DoRA: rows rescaled by magnitude / |W + delta|
            merged = weight + delta
            columns = layout in ("linear_t", "embedding")
            norm = merged.norm(dim=0) if columns else merged.flatten(1).norm(dim=1)
            factor = tensors(change.magnitude).reshape(-1) / norm
            y = y * factor.reshape(_rows_shape(y, layout))
            weight = merged * (
                factor.reshape(1, -1) if columns else factor.reshape(-1, *[1] * (merged.dim() - 1))
            )
        else:
            weight = weight + delta
    return layout, y


def check_outputs(source: MergedSource) -> OutputCheck:
    """Run every merged layer weight and its unmerged form on seeded inputs."""
    import torch

    check = OutputCheck()
    generator = torch.Generator().manual_seed(SEED)
    for key, changes in source.changes.items():
        if any(isinstance(c, BiasDelta) for _, c in changes):
            continue  # a bias: checked with its weight's layer
        first = next((c for _, c in changes if isinstance(c, LowRank)), None)
        if first is None:
            continue
        base = source.base.load(key)
        x = _input(first.layout, base, generator)
        unmerged = _unmerged(source, key, x)
        if unmerged is None:
            continue
        layout, want = unmerged
        got = _forward(layout, source.load(key).to(torch.float32), x)
        scale = float(torch.linalg.vector_norm(want)) or 1.0
        check.errors[key] = float(torch.linalg.vector_norm(got - want)) / scale
    return check
