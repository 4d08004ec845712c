"""``diff``: compare two checkpoints of any formats, wrapper chains normalised, tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.formats import Source, TensorInfo, open_source
from ckptkit.keys import build_plan, match_keys

if TYPE_CHECKING:
    import torch

__all__ = ["diff", "DiffReport", "TensorDiff"]


@dataclass
class TensorDiff:
    """How one common tensor compares: ``equal`` (bit-exact), ``close`` or ``different``."""

    key: str
    status: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    differing: int = 0  # elements outside the tolerance

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "status": self.status, "max_abs": self.max_abs,
                "max_rel": self.max_rel, "differing": self.differing}  # fmt: skip


@dataclass
class Side:
    """One checkpoint as diff saw it."""

    path: str
    format: str
    removed: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "removed_prefixes": self.removed}


@dataclass
class DiffReport:
    """Keys only in A or B, header mismatches, and value differences of common tensors."""

    a: Side
    b: Side
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, TensorInfo, TensorInfo]] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    common: int = 0
    atol: float = 0.0
    rtol: float = 0.0
    keys_only: bool = False

    @property
    def different(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status == "different"]

    @property
    def equal(self) -> bool:
        """No key, shape or dtype difference, and every value bit-equal or within tolerance."""
        return not (self.only_a or self.only_b or self.mismatched or self.different)

    def to_dict(self) -> dict[str, Any]:
        """The ``diff --json`` document."""
        return {
            "equal": self.equal,
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "common": self.common,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "mismatched": [
                {"key": key, "a": a.to_dict(), "b": b.to_dict()} for key, a, b in self.mismatched
            ],
            "tensors": [t.to_dict() for t in self.tensors],
            "atol": self.atol,
            "rtol": self.rtol,
            "keys_only": self.keys_only,
        }


def _canonical(source: Source) -> tuple[dict[str, str], list[str]]:
    """Canonical key -> the key in the file, with the wrapper chain stripped."""
    plan = build_plan(source.keys(), strip_wrappers=True)
    return {new: old for old, new in plan.mapping.items() if new is not None}, plan.removed


def diff(
    a: str | Path,
    b: str | Path,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    keys_only: bool = False,
    select_a: str | None = None,
    select_b: str | None = None,
    allow_globals: Iterable[str] = (),
) -> DiffReport:
    """Compare two checkpoints after stripping each one's wrapper chain (and a leading prefix
    that only one side has, such as Lightning's ``model.``).

    Args:
        a, b: checkpoints of any supported format (a DDP ``.pt`` and its safetensors compare
            equal).
        atol, rtol: tolerance for values (``|a - b| <= atol + rtol * |b|``); 0 and 0 mean
            bit-exact.
        keys_only: compare keys, shapes and dtypes from the headers; read no tensor.
        select_a, select_b: where each state dict is inside a training checkpoint.
        allow_globals: pickle globals to admit beside torch's safe set.

    Returns:
        The report; ``report.equal`` tells the verdict. Tensors are read one pair at a time.
    """
    with (
        open_source(a, select=select_a, allow_globals=allow_globals) as src_a,
        open_source(b, select=select_b, allow_globals=allow_globals) as src_b,
    ):
        keys_a, removed_a = _canonical(src_a)
        keys_b, removed_b = _canonical(src_b)
        # Beyond wrappers: a shared prefix only one side has (Lightning's `model.`).
        match = match_keys(keys_a, keys_b)
        if sum(new in keys_b for new in match.mapping.values()) > len(
            keys_a.keys() & keys_b.keys()
        ):
            keys_a = {match.mapping[k]: old for k, old in keys_a.items() if match.mapping[k]}
            removed_a += match.removed
            removed_b += match.added
        info_a, info_b = dict(src_a.entries()), dict(src_b.entries())
        report = DiffReport(
            a=Side(str(a), src_a.format, removed_a),
            b=Side(str(b), src_b.format, removed_b),
            only_a=[k for k in keys_a if k not in keys_b],
            only_b=[k for k in keys_b if k not in keys_a],
            atol=atol,
            rtol=rtol,
            keys_only=keys_only,
        )
        for key in (k for k in keys_a if k in keys_b):
            ia, ib = info_a[keys_a[key]], info_b[keys_b[key]]
            report.common += 1
            if (ia.dtype, ia.shape) != (ib.dtype, ib.shape):
                report.mismatched.append((key, ia, ib))
            elif not keys_only:
                tensor_a, tensor_b = src_a.load(keys_a[key]), src_b.load(keys_b[key])
                report.tensors.append(compare(key, tensor_a, tensor_b, atol=atol, rtol=rtol))
    return report


def compare(key: str, a: torch.Tensor, b: torch.Tensor, *, atol: float, rtol: float) -> TensorDiff:
    """Compare two tensors of one dtype and shape: bit-equal, within tolerance, or not."""
    import torch

    from ckptkit.formats.tensors import bit_equal

    if bit_equal(a, b):
        return TensorDiff(key, "equal")
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)
    wide = torch.complex128 if a.is_complex() else torch.float64
    da, db = a.to(wide), b.to(wide)
    gap = (da - db).abs()
    both_nan = (
        torch.isnan(da) & torch.isnan(db)
        if not a.is_complex()
        else torch.zeros_like(gap, dtype=torch.bool)
    )
    gap = torch.where(both_nan, torch.zeros_like(gap), gap)
    scale = db.abs()
    bad = ~(gap <= atol + rtol * scale)  # NaN gaps count as bad
    nonzero = scale > 0
    max_abs = float(gap.max()) if gap.numel() else 0.0
    max_rel = float((gap[nonzero] / scale[nonzero]).max()) if bool(nonzero.any()) else max_abs
    differing = int(bad.sum())
    return TensorDiff(key, "close" if not differing else "different", max_abs, max_rel, differing)
