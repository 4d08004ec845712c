"""What a conversion read, planned, wrote and checked (``ConvertReport``), and the metadata
its output's header carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptkit.conversion.plan import Plan
from ckptkit.formats.base.source import Source
from ckptkit.formats.base.tree import DroppedPart
from ckptkit.keys import KeyMatch, KeyPlan, detect_wrappers
from ckptkit.meta import TRAINING_KEY, CheckpointMeta

if TYPE_CHECKING:
    from ckptkit.mapping.source import MappedSource

__all__ = ["ConvertReport", "make_report", "merge_report", "roundtrip_report", "output_header"]


@dataclass
class ConvertReport:
    """What ``convert`` read, planned, wrote and checked."""

    def __str__(self) -> str:
        """What ``ckptkit convert`` prints of it."""
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """The report's text lines (a line may hold any character a key holds: never split
        ``str()`` to get them back)."""
        from ckptkit.render import convert_lines

        return convert_lines(self)

    source: str
    source_format: str
    destination: str
    output_format: str
    selected: str
    selected_reason: str
    plan: KeyPlan
    tensors: int
    nbytes: int
    source_nbytes: int = 0
    cast: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    copied: int = 0
    through_torch: int = 0
    made: int = 0  # of the copied: made from views of their ranges (checked by CRC-32)
    overflowed: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    # How tied tensors were written: "once" (safetensors: the others named in the metadata, as
    # save_model does), "copies" (--keep-tied-copies) or "shared" (.pt: one storage).
    ties: str = "once"
    dropped: list[DroppedPart] = field(default_factory=list)
    made_contiguous: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    match: KeyMatch | None = None
    dry_run: bool = False
    verified: bool = False
    kept_wrappers: list[str] = field(default_factory=list)  # wrapper prefixes still on the keys
    adapters: list[dict[str, Any]] = field(default_factory=list)  # merged, in order
    # key -> |merged - base| / |base| (None where the base tensor is all zeros)
    merged: dict[str, float | None] = field(default_factory=dict)
    output_check: dict[str, Any] | None = None  # --check-outputs: merged vs unmerged layers
    copied_files: list[str] = field(default_factory=list)  # a folder output's config, tokenizer
    made_files: list[str] = field(default_factory=list)  # ...and the config a mapping made
    mapping: dict[str, Any] | None = None  # --map: the rules that ran, what they took
    part: str | None = None  # "I/N": this process wrote that share of the shards
    megatron: dict[str, Any] | None = None  # --to megatron: the sizes cut to, the args set

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the schema of ``ckptkit convert --json``)."""
        return {
            "kept_wrappers": self.kept_wrappers,
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
            "bytes_saved": self.source_nbytes - self.nbytes,
            "cast": self.cast,
            "overflowed": self.overflowed,
            "files": self.files,
            "copied_as_bytes": self.copied,
            "through_torch": self.through_torch,
            "made_from_ranges": self.made,
            "aliases": self.aliases,
            "ties": self.ties,
            "dropped": [part.to_dict() for part in self.dropped],
            "made_contiguous": self.made_contiguous,
            "extras": self.extras,
            "match": self.match.describe() if self.match else None,
            "dry_run": self.dry_run,
            "verified": self.verified,
            "adapters": self.adapters,
            "merged": self.merged,
            "output_check": self.output_check,
            "copied_files": self.copied_files,
            "made_files": self.made_files,
            "mapping": self.mapping,
            "part": self.part,
            "megatron": self.megatron,
        }


def make_report(source: Source, plan: Plan, dry_run: bool) -> ConvertReport:
    """The report of a plan, before anything is written."""
    from ckptkit.adapters.merged import MergedSource

    items, entries = plan.items, plan.entries
    rewritten = plan.keys.added or plan.keys.removed or plan.match is not None
    # A merge reads the base: name it, whichever of base and adapter SRC was.
    base = source.base if isinstance(source, MergedSource) else None
    report = ConvertReport(
        source=str(base.folder or base.path) if base else str(plan.src),
        source_format=source.format,
        destination=str(plan.dst),
        output_format=plan.fmt,
        selected=source.selected,
        selected_reason=source.selected_reason,
        plan=plan.keys,
        tensors=len(items),
        nbytes=sum(item.spec.nbytes for item in items),
        source_nbytes=sum(entries[item.old].nbytes for item in items),
        cast=[item.spec.key for item in items if item.cast],
        files=[str(p) for p in plan.outputs],
        aliases=plan.aliases,
        ties=plan.ties,
        dropped=list(source.dropped),
        made_contiguous=[item.spec.key for item in items if not entries[item.old].contiguous],
        extras=sorted(source.extras),
        match=plan.match,
        dry_run=dry_run,
        # Wrappers the source had and the output still has, when none were asked for.
        kept_wrappers=[]
        if rewritten
        else [w.prefix for w in detect_wrappers(item.spec.key for item in items)],
    )
    if isinstance(source, MergedSource):
        report.adapters = [
            {
                "path": str(a.path),
                "kind": a.kind,
                "variant": a.variant,
                "weight": a.weight,
                "modules": len(a.targets),
                "base": report.source,
                "base_from": a.base_from,  # how the base was found: --base, the adapter's config
                "left_out": a.left_out,  # a kohya LoRA's other pipeline components
            }
            for a in source.adapters
        ]
    mapped = _mapped(source)
    if mapped is not None:
        report.mapping = mapped.plan.describe()
    return report


def _mapped(source: Source) -> MappedSource | None:
    """The mapping a conversion read through, if any (under a Megatron save's cut too)."""
    from ckptkit.formats.folders.megatron_dist import MegatronDist
    from ckptkit.formats.folders.megatron_ranks import MegatronRanks
    from ckptkit.mapping.source import MappedSource

    inner = source.inner if isinstance(source, (MegatronRanks, MegatronDist)) else source
    return inner if isinstance(inner, MappedSource) else None


def merge_report(source: Source, report: ConvertReport, check_outputs: bool) -> None:
    """What was merged (adapters, each tensor's relative change) and, if asked, how merged
    layers compare with their unmerged forms."""
    from ckptkit.adapters.merged import MergedSource

    if not isinstance(source, MergedSource):
        return
    for key in source.changes:
        if key not in source.relative:
            source.load(key)
    report.merged = {key: source.relative[key] for key in source.changes}
    if check_outputs:
        from ckptkit.adapters.check import check_outputs as run_checks

        report.output_check = run_checks(source).to_dict()


def roundtrip_report(source: Source, report: ConvertReport) -> None:
    """``--check-roundtrip``: how many groups were mapped back bit-equal in the stream (those a
    rule only renames are copied as bytes, their inverse the identity)."""
    mapped = _mapped(source)
    if mapped is None or not mapped.check_roundtrip:
        return
    assert report.mapping is not None
    groups = mapped.plan.groups
    report.mapping["roundtrip"] = {
        "groups": len(groups),
        "mapped_back": len(mapped.roundtrips),
        "dropped": sum(1 for g in groups if g.inverse_steps() is None),
    }


def output_header(source: Source, report: ConvertReport, plan: Plan) -> dict[str, str]:
    """The metadata the output's header carries: where it came from and what was done to it,
    and, where ties are written once, each removed name's target (as
    ``safetensors.torch.save_model`` records it)."""
    header = _metadata(source, report).to_header()
    if plan.ties == "once":
        header.update({k: v for k, v in plan.aliases.items() if k not in header})
    return header


def _metadata(source: Source, report: ConvertReport) -> CheckpointMeta:
    inherited = getattr(source, "meta", None) or CheckpointMeta()
    return CheckpointMeta(
        source=source.path.name,
        source_format=source.format,
        selected=source.selected or None,
        removed_prefixes=inherited.removed_prefixes + report.plan.removed,
        added_prefixes=inherited.added_prefixes + report.plan.added,
        key_steps=inherited.key_steps
        + [
            f"merged {a['path']} ({a['kind']}, {a['variant']}, weight {a['weight']:g})"
            for a in report.adapters
        ]
        + report.plan.steps,
        aliases=report.aliases,
        dropped={
            part.path: {"tensors": part.tensors, "bytes": part.nbytes} for part in report.dropped
        }
        | {key: "wrapper bookkeeping" for key in report.plan.dropped},
        extras={k: v for k, v in source.extras.items() if k != TRAINING_KEY} | inherited.extras,
        training=inherited.training or source.extras.get(TRAINING_KEY) or {},
        # The source's own header entries, less its tie records (written afresh for the keys
        # as they are now).
        other={
            k: v
            for k, v in source.metadata.items()
            if not k.startswith("ckptkit.") and k not in source.aliases()
        },
    )
