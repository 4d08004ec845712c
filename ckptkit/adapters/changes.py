"""What an adapter does to one base tensor, and the arithmetic of merging it, in fp32.

Each ``Change`` names the adapter tensors it needs (read when the base tensor is merged) and
changes a block of the base tensor's rows. A merge walks the base tensor a block of rows at a
time, applies every change of every adapter in order in fp32, and rounds once to the base's
dtype, so memory holds the output tensor and one block, and a bf16 base is rounded once where
peft rounds the delta and then the sum.

The formulas are peft 0.21's (``peft/tuners/lora/layer.py`` ``get_delta_weight`` and
``merge``, ``dora.py``) and sd-scripts' ``networks/lora.py`` for kohya files; the tests compare
them with peft's own ``merge_and_unload``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "conv_of",
    "Change",
    "LowRank",
    "BiasDelta",
    "Replace",
    "TokenRows",
    "Tensors",
    "merge_rows",
    "NotFinite",
]

# An adapter's tensors by key, as fp32 on the CPU.
Tensors = Callable[[str], "torch.Tensor"]

# Output rows per block: about 16 MiB of fp32 temporaries for a 4096-wide weight.
BLOCK_ELEMENTS = 4 * 1024 * 1024


def conv_of(weight: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The convolution a weight of this many dimensions belongs to (conv1d, 2d or 3d)."""
    import torch

    functional = torch.nn.functional
    return {3: functional.conv1d, 4: functional.conv2d}.get(weight.dim(), functional.conv3d)


@dataclass(frozen=True)
class Change:
    """One adapter's change to one base tensor (a base of ``shape``)."""

    def keys(self) -> list[str]:
        """The adapter tensors it reads."""
        raise NotImplementedError

    def row_local(self) -> bool:
        """Whether a block of output rows depends only on the same rows of the base."""
        return True

    def apply(self, rows: torch.Tensor, start: int, tensors: Tensors) -> torch.Tensor:
        """``rows`` (fp32, the base's rows ``start:start+len(rows)`` flattened to 2-D, with
        every earlier change applied) with this change applied. ``rows`` is the merge's own
        buffer: a change may update it in place and return it."""
        raise NotImplementedError


@dataclass(frozen=True)
class LowRank(Change):
    """A LoRA update ``scale * B @ A`` laid out as the base weight is, optionally DoRA's
    rescaling of each output row to ``magnitude``.

    ``layout`` is ``linear`` (weight ``out x in``), ``linear_t`` (``fan_in_fan_out``: GPT-2's
    ``Conv1D`` keeps ``in x out``), ``embedding`` (``lora_embedding_A`` is ``r x vocab``, ``B``
    ``dim x r``) or ``conv`` (``A`` a ``k x k`` conv to ``r`` channels, ``B`` a ``1 x 1`` one).
    """

    a: str
    b: str
    scale: float
    layout: str
    magnitude: str | None = None

    def keys(self) -> list[str]:
        return [self.a, self.b] + ([self.magnitude] if self.magnitude else [])

    def row_local(self) -> bool:
        # DoRA normalises each output row; with fan_in_fan_out those are the stored columns.
        return not (self.magnitude and self.layout in ("linear_t", "embedding"))

    def delta(self, start: int, stop: int, tensors: Tensors) -> torch.Tensor:
        """Rows ``start:stop`` of ``scale * B @ A`` in the base's layout, flattened to 2-D."""

        a, b = tensors(self.a), tensors(self.b)
        if self.layout == "linear":  # (B @ A) * scale, as peft: the product, then the scale
            return (b[start:stop] @ a).mul_(self.scale)
        if self.layout in ("linear_t", "embedding"):  # the stored rows are A's columns
            return (b @ a[:, start:stop]).mul_(self.scale).T
        out = b[start:stop]
        if a.dim() == 4 and a.shape[2:] == (1, 1):  # 1x1 Conv2d: a matrix product, as in peft
            product = out.flatten(1) @ a.flatten(1)
        else:  # k x k: compose the two convolutions
            product = conv_of(a)(a.transpose(0, 1), out).transpose(0, 1).flatten(1)
        return product.mul_(self.scale)

    def norm_sq(self, tensors: Tensors) -> float:
        """``|scale * B @ A|^2`` (Frobenius) from the factors alone: ``scale^2`` times the sum
        of ``(B^T B) * (A A^T)``, a rank x rank product instead of a pass over the delta."""
        a, b = tensors(self.a).flatten(1), tensors(self.b).flatten(1)
        return float(((b.T @ b) * (a @ a.T)).sum()) * self.scale**2

    def apply(self, rows: torch.Tensor, start: int, tensors: Tensors) -> torch.Tensor:
        stop = start + rows.shape[0]
        merged = rows.add_(self.delta(start, stop, tensors))
        if self.magnitude is None:
            return merged
        magnitude = tensors(self.magnitude).reshape(-1)
        if not self.row_local():  # the whole tensor, stored transposed: norm its columns
            return merged.mul_((magnitude / merged.norm(dim=0)).reshape(1, -1))
        factor = magnitude[start:stop] / merged.norm(dim=1)
        return merged.mul_(factor.reshape(-1, 1))


@dataclass(frozen=True)
class BiasDelta(Change):
    """``lora_bias``: the adapter's ``lora_B`` bias times the scale, added to the base bias."""

    bias: str
    scale: float

    def keys(self) -> list[str]:
        return [self.bias]

    def apply(self, rows: torch.Tensor, start: int, tensors: Tensors) -> torch.Tensor:
        bias = tensors(self.bias).reshape(-1, 1)[start : start + rows.shape[0]]
        return rows + bias * self.scale


@dataclass(frozen=True)
class Replace(Change):
    """``modules_to_save``: the adapter's trained copy of the tensor replaces the base's."""

    key: str

    def keys(self) -> list[str]:
        return [self.key]

    def apply(self, rows: torch.Tensor, start: int, tensors: Tensors) -> torch.Tensor:
        new = tensors(self.key)
        return new.reshape(new.shape[0], -1)[start : start + rows.shape[0]].clone()


@dataclass(frozen=True)
class TokenRows(Change):
    """Trainable tokens: the adapter's rows replace the embedding's rows ``indices``."""

    rows_key: str
    indices: tuple[int, ...]

    def keys(self) -> list[str]:
        return [self.rows_key]

    def apply(self, rows: torch.Tensor, start: int, tensors: Tensors) -> torch.Tensor:
        new = tensors(self.rows_key)
        rows = rows.clone()
        for position, index in enumerate(self.indices):
            if start <= index < start + rows.shape[0]:
                rows[index - start] = new[position]
        return rows


class NotFinite(ArithmeticError):
    """A merge made NaN or inf where the base held a finite value (at ``row``, flattened)."""

    def __init__(self, row: int, value: float) -> None:
        super().__init__(f"row {row}: {value}")
        self.row, self.value = row, value


def _check_finite(
    rows: torch.Tensor, merged: torch.Tensor, block: torch.Tensor, start: int
) -> None:
    """Refuse a merged block holding NaN or inf where the base block did not: a NaN alpha, an
    overflowing scale or damaged factors would otherwise be written (and verified) as weights.

    ``rows`` is the block in fp32, ``merged`` the same rounded to the base's dtype. One
    reduction over ``rows`` (its least and greatest values: NaN propagates) clears nearly every
    block; only a block that comes near the dtype's range is looked at element by element."""
    import torch

    low, high = (float(v) for v in torch.aminmax(rows))
    limit = torch.finfo(merged.dtype).max
    if -limit <= low and high <= limit:  # false for NaN and inf too
        return
    created = ~torch.isfinite(merged) & torch.isfinite(block.reshape(merged.shape))
    if bool(created.any()):
        row = int(created.any(dim=1).nonzero()[0])
        raise NotFinite(start + row, float(merged[row][created[row]][0]))


def merge_rows(
    base: torch.Tensor, steps: list[tuple[Change, Tensors]], out: torch.Tensor
) -> tuple[float, float]:
    """Merge ``steps`` (each change with its adapter's tensors, in order) into ``base`` a block
    of rows at a time, computing in fp32 and rounding once into ``out`` (the base's shape and
    dtype). Returns the squared norms of the change and of the base, for the report.

    Raises:
        NotFinite: the merge made NaN or inf where the base had a finite value.

    The blocks reuse two fp32 buffers, so a merge allocates little beyond its delta: fresh
    16 MiB temporaries per block cost page faults and grow the heap.
    """
    import torch

    flat = base.reshape(base.shape[0], -1) if base.dim() else base.reshape(1, 1)
    target = out.view(flat.shape)
    row_local = all(change.row_local() for change, _ in steps)
    step = max(1, BLOCK_ELEMENTS // max(1, flat.shape[1])) if row_local else flat.shape[0]
    rows_buffer = torch.empty((min(step, flat.shape[0]), flat.shape[1]), dtype=torch.float32)
    # One plain LoRA: the change's norm comes from its factors, so no copy of the base is kept.
    single = steps[0][0] if len(steps) == 1 else None
    factored = isinstance(single, LowRank) and single.magnitude is None
    before_buffer = None if factored else torch.empty_like(rows_buffer)
    change_sq = base_sq = 0.0
    for start in range(0, flat.shape[0], step):
        block = flat[start : start + step]
        rows = rows_buffer[: block.shape[0]].copy_(block)
        base_sq += float(torch.linalg.vector_norm(rows)) ** 2
        before = None if before_buffer is None else before_buffer[: block.shape[0]].copy_(rows)
        for change, tensors in steps:
            rows = change.apply(rows, start, tensors)
        target[start : start + step].copy_(rows)
        _check_finite(rows, target[start : start + step], block, start)
        if before is not None:
            change_sq += float(torch.linalg.vector_norm(rows.sub_(before))) ** 2
    if factored:
        assert isinstance(single, LowRank)
        change_sq = single.norm_sq(steps[0][1])
    return change_sq, base_sq
