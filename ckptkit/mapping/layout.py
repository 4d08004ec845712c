"""A mapping's ops run on where bytes lie instead of on tensors (``formats/base/layout.py``), so
that a rule that only moves bytes (rank slices joined, q/k rows permuted, fused tensors cut)
makes its outputs by copying ranges of the source files, without torch.

:func:`lay` is :meth:`Step.run` again, on layouts: every op that rearranges elements whole has
one; ``transpose`` (which moves single elements) and ``cast`` (which computes) have none, and a
group that uses them is made through torch. ``tests/mapping/test_ops.py`` checks each op's
layout against its torch run, byte for byte.
"""

from __future__ import annotations

from typing import Any

from ckptkit.formats.base.layout import Layout, concat, pad, rope, split, stack, unstack
from ckptkit.mapping.ops import Step

__all__ = ["Check", "lay"]

# A check ``same`` leaves to when the bytes are read: (rank 0's copy, another rank's, the
# message should they differ).
Check = tuple[Layout, Layout, Exception]


def lay(step: Step, values: list[Any], checks: list[Check]) -> list[Any] | None:
    """``step.run`` on layouts (lists of them per rank where the values are per rank); None
    for an op that cannot be done by moving bytes. ``same``'s comparisons of rank copies are
    added to ``checks``, made when the bytes are read."""
    name, v = step.call.name, step.values
    if name in ("rename", "require"):
        return values
    if name == "drop":
        return []
    if name == "gather":
        return [concat(list(ranks), v["dim"], 1) for ranks in values]
    if name == "same":
        for ranks in values:
            for rank, other in enumerate(ranks[1:], 1):
                checks.append(
                    (ranks[0], other, step.fail(f"rank {rank}'s copy differs from rank 0's"))
                )
        return [ranks[0] for ranks in values]
    ranks = step.ranks or 1  # the target side's (scatter and replicate)
    if name == "scatter":
        out = []
        for t in values:
            dim = v["dim"] % len(t.shape)
            out.append(split(t, dim, [t.shape[dim] // ranks] * ranks, 1))
        return out
    if name == "replicate":
        return [[t] * ranks for t in values]
    if name == "concat":
        return [concat(values, v["dim"], v.get("groups", 1))]
    if name == "split":
        (t,) = values
        dim = v["dim"] % len(t.shape)
        parts = v.get("parts")
        sizes = step._sizes(t.shape[dim], parts if isinstance(parts, int) else None)
        return split(t, dim, sizes, v.get("groups", 1))
    if name == "stack":
        return [stack(values)]
    if name == "unstack":
        (t,) = values
        return unstack(t)
    if name in ("permute_rope", "unpermute_rope"):
        (t,) = values
        return [rope(t, v["heads"], forward=name == "permute_rope")]
    if name == "slice":
        (t,) = values
        dim = v["dim"] % len(t.shape)
        return [split(t, dim, [v["size"], t.shape[dim] - v["size"]], 1)[0]]
    if name == "pad":
        (t,) = values
        return [pad(t, v["dim"] % len(t.shape), v["full"])]
    return None  # transpose, cast: elements moved one by one or computed
