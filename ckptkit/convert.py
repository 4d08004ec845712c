"""``convert``: plan from headers, stream tensors one at a time into the output, verify.

The key plan (select, strip, add, rename, match) is computed from headers before any tensor is
read, so ``dry_run`` shows it and collisions fail before anything is written. The output appears
atomically, only after it was read back and compared bit-exact with the source.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, KeyMatchError, VerificationError
from ckptkit.formats import Source, TensorInfo, open_source, output_format
from ckptkit.formats.atomic import atomic_output, check_output
from ckptkit.formats.dtypes import DTYPES
from ckptkit.formats.tree import DroppedPart
from ckptkit.keys import (
    KeyMatch,
    KeyPlan,
    build_plan,
    match_keys,
    mismatch_message,
    parse_rename_rule,
)
from ckptkit.meta import CheckpointMeta

if TYPE_CHECKING:
    import torch

__all__ = ["convert", "ConvertReport", "TRAINING_KEY"]

# Where ckptkit's training engine keeps a run's metadata inside its checkpoints.
TRAINING_KEY = "ckptkit"


@dataclass
class ConvertReport:
    """What ``convert`` read, planned, wrote and checked."""

    source: str
    source_format: str
    destination: str
    output_format: str
    selected: str
    selected_reason: str
    plan: KeyPlan
    tensors: int
    nbytes: int
    aliases: dict[str, str] = field(default_factory=dict)
    dropped: list[DroppedPart] = field(default_factory=list)
    made_contiguous: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    match: KeyMatch | None = None
    dry_run: bool = False
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the schema of ``ckptkit convert --json``)."""
        return {
            "source": self.source,
            "source_format": self.source_format,
            "destination": self.destination,
            "output_format": self.output_format,
            "selected": self.selected,
            "selected_reason": self.selected_reason,
            "steps": self.plan.steps,
            "removed_prefixes": self.plan.removed,
            "added_prefixes": self.plan.added,
            "keys": [{"from": old, "to": new} for old, new in self.plan.mapping.items()],
            "dropped_keys": self.plan.dropped,
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "aliases": self.aliases,
            "dropped": [part.to_dict() for part in self.dropped],
            "made_contiguous": self.made_contiguous,
            "extras": self.extras,
            "match": self.match.describe() if self.match else None,
            "dry_run": self.dry_run,
            "verified": self.verified,
        }


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    select: str | None = None,
    strip_wrappers: bool = False,
    strip_module: bool = False,
    strip_prefixes: Iterable[str] = (),
    add_module: bool = False,
    add_prefixes: Iterable[str] = (),
    renames: Iterable[str | tuple[re.Pattern[str], str]] = (),
    match_to: str | Path | None = None,
    dry_run: bool = False,
    force: bool = False,
    verify: bool = True,
    trust: bool = False,
    allow_globals: Iterable[str] = (),
    progress: bool = False,
) -> ConvertReport:
    """Convert a checkpoint's state dict to safetensors or a plain ``.pt`` state dict.

    Args:
        src: the checkpoint to read (torch zip or legacy, or safetensors).
        dst: the output; its suffix picks the format (``.safetensors``, ``.pt``).
        select: dotted path of the state dict in a training checkpoint (default: found).
        strip_wrappers: strip the whole detected wrapper chain (``module._orig_mod.`` ...).
        strip_module: strip one leading ``module.`` (DataParallel / DDP).
        strip_prefixes: further prefixes to strip, such as Lightning's ``model.``.
        add_module: add ``module.`` so the result loads into a DP / DDP-wrapped model.
        add_prefixes: further prefixes to add (the first ends up innermost).
        renames: ``REGEX=REPLACEMENT`` rules applied to every key, in order.
        match_to: a reference checkpoint whose key layout the output must match exactly.
        dry_run: plan and report only; write nothing.
        force: replace an existing ``dst``.
        verify: read the output back and compare every tensor bit-exact with the source.
        trust: read ``src`` with torch's full unpickler (only for files you trust).
        allow_globals: pickle globals to admit beside torch's safe set (never imported).
        progress: show a progress bar on stderr.

    Returns:
        The report: where the state dict was, the key plan, what was dropped and written.

    Raises:
        CkptkitError: a subclass naming the file, the key and the fix, before anything is
            written whenever the problem can be seen from headers.
    """
    src, dst = Path(src), Path(dst)
    fmt = output_format(dst)
    rules = [parse_rename_rule(r) if isinstance(r, str) else r for r in renames]
    with open_source(src, select=select, trust=trust, allow_globals=allow_globals) as source:
        if not dry_run:
            check_output(dst, force=force, inputs=[src])
        entries = dict(source.entries())
        for key, info in entries.items():
            if info.kind != "dense":
                raise FormatError(
                    f"tensor '{key}' in {src} is {info.kind}, which ckptkit cannot convert",
                    "convert it to a dense tensor in PyTorch first",
                )
        plan = build_plan(
            entries,
            strip_wrappers=strip_wrappers,
            strip_module=strip_module,
            strip_prefixes=strip_prefixes,
            add_module=add_module,
            add_prefixes=add_prefixes,
            renames=rules,
        )
        match = _match_reference(plan, entries, Path(match_to)) if match_to else None
        kept = [(old, new) for old, new in plan.mapping.items() if new is not None]
        aliases = {
            plan.mapping[a]: plan.mapping[b]
            for a, b in source.aliases().items()
            if plan.mapping.get(a) and plan.mapping.get(b)
        }
        report = ConvertReport(
            source=str(src),
            source_format=source.format,
            destination=str(dst),
            output_format=fmt,
            selected=source.selected,
            selected_reason=source.selected_reason,
            plan=plan,
            tensors=len(kept),
            nbytes=sum(entries[old].nbytes for old, _ in kept),
            aliases=aliases,
            dropped=list(source.dropped),
            made_contiguous=[new for old, new in kept if not entries[old].contiguous],
            extras=sorted(source.extras),
            match=match,
            dry_run=dry_run,
        )
        if dry_run:
            return report
        meta = _metadata(source, report)
        if fmt == "safetensors":
            # Widest dtypes first, so every tensor's data stays aligned for memory mapping.
            kept.sort(key=lambda pair: -DTYPES[entries[pair[0]].dtype].itemsize)
        with atomic_output(dst, force=force, inputs=[src]) as tmp:
            pairs = _stream(source, kept, progress=progress, total=report.nbytes)
            if fmt == "safetensors":
                from ckptkit.formats.safetensors import TensorSpec, write_safetensors

                specs = [
                    TensorSpec(new, entries[old].dtype, entries[old].shape) for old, new in kept
                ]
                write_safetensors(tmp, specs, pairs, meta.to_header())
            else:
                from ckptkit.formats.torchfile import write_torch

                write_torch(tmp, pairs, aliases)
            if verify:
                _verify(tmp, fmt, source, kept, dst)
                report.verified = True
    return report


def _match_reference(plan: KeyPlan, entries: dict[str, TensorInfo], ref_path: Path) -> KeyMatch:
    """Extend the plan so its output keys are exactly the reference's; shapes must agree too."""
    with open_source(ref_path) as ref:
        ref_entries = dict(ref.entries())
    planned = {new: old for old, new in plan.mapping.items() if new is not None}
    match = match_keys(planned, ref_entries)
    mismatched = [
        f"{target} {list(entries[planned[new]].shape)} vs {list(ref_entries[target].shape)}"
        for new, target in match.mapping.items()
        if target in ref_entries and entries[planned[new]].shape != ref_entries[target].shape
    ]
    if not match.exact or mismatched:
        raise KeyMatchError(
            mismatch_message(f"keys do not match {ref_path}", match, mismatched),
            "check --select and the prefix options, or use --dry-run to see the plan",
        )
    for old, new in plan.mapping.items():
        if new is not None:
            plan.mapping[old] = match.mapping[new]
    plan.steps.append(f"match {ref_path.name}: {match.describe()}")
    plan.removed += match.removed
    plan.added += match.added
    return match


def _metadata(source: Source, report: ConvertReport) -> CheckpointMeta:
    inherited = getattr(source, "meta", None) or CheckpointMeta()
    return CheckpointMeta(
        source=source.path.name,
        source_format=source.format,
        selected=source.selected or None,
        removed_prefixes=inherited.removed_prefixes + report.plan.removed,
        added_prefixes=inherited.added_prefixes + report.plan.added,
        key_steps=inherited.key_steps + report.plan.steps,
        aliases=report.aliases,
        dropped={
            part.path: {"tensors": part.tensors, "bytes": part.nbytes} for part in report.dropped
        }
        | {key: "wrapper bookkeeping" for key in report.plan.dropped},
        extras={k: v for k, v in source.extras.items() if k != TRAINING_KEY} | inherited.extras,
        training=inherited.training or source.extras.get(TRAINING_KEY) or {},
        other={k: v for k, v in source.metadata.items() if not k.startswith("ckptkit.")},
    )


def _stream(
    source: Source, kept: list[tuple[str, str]], *, progress: bool, total: int
) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm import tqdm

    with tqdm(
        total=total, unit="B", unit_scale=True, disable=not progress, leave=False, desc="convert"
    ) as bar:
        for old, new in kept:
            tensor = source.load(old)
            yield new, tensor
            bar.update(tensor.numel() * tensor.element_size())


def _verify(path: Path, fmt: str, source: Source, kept: list[tuple[str, str]], dst: Path) -> None:
    """Reopen the written file with its own library and compare every tensor with the source."""
    from ckptkit.formats.tensors import bit_equal

    if fmt == "safetensors":
        from safetensors import safe_open

        handle = safe_open(str(path), framework="pt", device="cpu")
        written_keys, get = set(handle.keys()), handle.get_tensor
    else:
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        written_keys, get = set(state), state.__getitem__
    expected = {new for _, new in kept}
    if written_keys != expected:
        raise VerificationError(f"{dst} would not hold the planned keys; nothing was written")
    for old, new in kept:
        if not bit_equal(get(new), source.load(old)):
            raise VerificationError(
                f"tensor '{new}' read back from {dst} differs from the source; nothing was written",
                "report this with CKPTKIT_DEBUG=1 output",
            )
