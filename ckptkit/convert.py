"""``convert``: plan from headers, stream tensors one at a time into the output, verify.

The key plan (select, strip, add, rename, match) is computed from headers before any tensor is
read, so ``dry_run`` shows it and collisions fail before anything is written. The output appears
atomically, only after it was read back and compared bit-exact with the source.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CastError, FormatError, KeyMatchError, UsageError
from ckptkit.formats.base.dtypes import DTYPES, TensorSpec
from ckptkit.formats.base.source import KEPT_IN_TORCH, KINDS, Source, TensorInfo
from ckptkit.formats.base.tree import DroppedPart
from ckptkit.formats.io.atomic import (
    atomic_folder,
    atomic_outputs,
    check_folder_output,
    check_output,
    syncing,
)
from ckptkit.formats.open import open_source
from ckptkit.formats.output import output_format
from ckptkit.formats.output.transfer import Item, Transfer
from ckptkit.keys import (
    KeyMatch,
    KeyPlan,
    build_plan,
    detect_wrappers,
    match_keys,
    mismatch_message,
    parse_rename_rule,
    plan_ties,
)
from ckptkit.meta import TRAINING_KEY, CheckpointMeta
from ckptkit.progress import progress_bar

if TYPE_CHECKING:
    pass

__all__ = ["convert", "ConvertReport", "TRAINING_KEY"]


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
    source_nbytes: int = 0
    cast: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    copied: int = 0
    through_torch: int = 0
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
            "aliases": self.aliases,
            "ties": self.ties,
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
    ema: bool = False,
    strip_wrappers: bool = False,
    strip_module: bool = False,
    strip_prefixes: Iterable[str] = (),
    add_module: bool = False,
    add_prefixes: Iterable[str] = (),
    renames: Iterable[str | tuple[re.Pattern[str], str]] = (),
    match_to: str | Path | None = None,
    dtype: str | None = None,
    keep_dtype: Iterable[str] = (),
    allow_overflow: bool = False,
    max_shard_size: int | str | None = None,
    keep_tied_copies: bool = False,
    to: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    verify: bool = True,
    trust: bool = False,
    allow_globals: Iterable[str] = (),
    progress: bool = False,
) -> ConvertReport:
    """Convert a checkpoint's state dict to safetensors, a plain ``.pt`` state dict or a DCP
    folder.

    Args:
        src: the checkpoint to read (torch zip or legacy, safetensors, or sharded).
        dst: the output; its suffix picks the format (``.safetensors``, ``.pt``) unless
            ``to`` does.
        select: dotted path of the state dict in a training checkpoint (default: found).
        ema: take a training checkpoint's EMA copy of the weights (timm's ``state_dict_ema``,
            ``model_ema``, ``ema``...); the report says which part was taken and why.
        strip_wrappers: strip the whole detected wrapper chain (``module._orig_mod.`` ...).
        strip_module: strip one leading ``module.`` (DataParallel / DDP).
        strip_prefixes: further prefixes to strip, such as Lightning's ``model.``.
        add_module: add ``module.`` so the result loads into a DP / DDP-wrapped model.
        add_prefixes: further prefixes to add (the first ends up innermost).
        renames: ``REGEX=REPLACEMENT`` rules applied to every key, in order.
        match_to: a reference checkpoint whose key layout the output must match exactly.
        dtype: cast floating-point tensors to ``bf16``, ``fp16`` or ``fp32``; integer and bool
            tensors never change.
        keep_dtype: globs of (output) keys that keep their dtype.
        allow_overflow: let a cast turn finite values into infinities.
        max_shard_size: split safetensors output into shards of at most this many bytes
            (``"5GB"``, ``"2GiB"`` or an int), with a Hugging Face style index.
        to: the output format: ``safetensors``, ``pt``, or ``dcp`` (a folder that
            ``torch.distributed.checkpoint.load`` reads, into a plain or a sharded model).
        keep_tied_copies: write every name of a tied group to safetensors (by default one
            tensor is written and the others are named in the metadata, as
            ``safetensors.torch.save_model`` does; ``.pt`` output keeps one shared storage).
        dry_run: plan and report only; write nothing.
        force: replace existing outputs.
        verify: read the output back and compare every tensor bit-exact with the source.
        trust: read ``src`` with torch's full unpickler (only for files you trust).
        allow_globals: pickle globals to admit beside torch's safe set (never imported).
        progress: show a progress bar on stderr.

    Returns:
        The report: where the state dict was, the key plan, what was dropped, cast and written.

    Raises:
        CkptkitError: a subclass naming the file, the key and the fix, before anything is
            written whenever the problem can be seen from headers.
    """
    src, dst = Path(src), Path(dst)
    if dst.is_dir() and to != "dcp":  # a model folder: save_pretrained's names
        dst = dst / "model.safetensors"
    fmt = output_format(dst, to)
    rules = [parse_rename_rule(r) if isinstance(r, str) else r for r in renames]
    target = _cast_target(dtype)
    shard_limit = parse_size(max_shard_size) if max_shard_size is not None else None
    if shard_limit is not None and fmt != "safetensors":
        raise UsageError("--max-shard-size writes safetensors shards", "give a .safetensors DST")
    with open_source(
        src, select=select, trust=trust, allow_globals=allow_globals, ema=ema
    ) as source:
        entries = dict(source.entries())
        _refuse_special(src, entries, fmt)
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
        keep = list(keep_dtype)
        items = [
            Item(
                old,
                TensorSpec(
                    new,
                    _out_dtype(entries[old].dtype, new, target, keep)
                    if entries[old].kind == "dense"
                    else entries[old].dtype,  # kept as it is
                    entries[old].shape,
                ),
                entries[old].dtype,
            )
            for old, new in plan.mapping.items()
            if new is not None
        ]
        if fmt == "safetensors":
            # Widest dtypes first, so every tensor's data stays aligned for memory mapping.
            items.sort(key=lambda item: -DTYPES[item.spec.dtype].itemsize)
        aliases = {
            new_a: new_b
            for a, b in source.aliases().items()
            if (new_a := plan.mapping.get(a)) and (new_b := plan.mapping.get(b))
        }
        ties = {"torch": "shared", "dcp": "chunk"}.get(fmt) or (
            "copies" if keep_tied_copies else "once"
        )
        if ties == "once":  # one tensor per tied group, the others named in the metadata
            aliases = plan_ties(aliases)
            items = [item for item in items if item.spec.key not in aliases]
        shards = _shards(items, aliases, shard_limit) if fmt == "safetensors" else [items]
        outputs = _output_paths(dst, len(shards))
        report = ConvertReport(
            source=str(src),
            source_format=source.format,
            destination=str(dst),
            output_format=fmt,
            selected=source.selected,
            selected_reason=source.selected_reason,
            plan=plan,
            tensors=len(items),
            nbytes=sum(item.spec.nbytes for item in items),
            source_nbytes=sum(entries[item.old].nbytes for item in items),
            cast=[item.spec.key for item in items if item.cast],
            files=[str(p) for p in outputs],
            aliases=aliases,
            ties=ties,
            dropped=list(source.dropped),
            made_contiguous=[item.spec.key for item in items if not entries[item.old].contiguous],
            extras=sorted(source.extras),
            match=match,
            dry_run=dry_run,
            # Wrappers the source had and the output still has, when none were asked for.
            kept_wrappers=[]
            if plan.added or plan.removed or match is not None
            else [w.prefix for w in detect_wrappers(item.spec.key for item in items)],
        )
        if dry_run:
            return report
        for path in outputs:
            if fmt == "dcp":
                check_folder_output(path, force=force, inputs=[src])
            else:
                check_output(path, force=force, inputs=[src])
        header = _metadata(source, report).to_header()
        if ties == "once":  # as safetensors.torch.save_model records a removed name
            header.update({k: v for k, v in aliases.items() if k not in header})
        _write(
            source,
            shards,
            outputs,
            header,
            aliases,
            report,
            # Kept as they are in .pt output: sparse, quantized, packed parameters.
            special={old for old, info in entries.items() if info.kind != "dense"},
            force=force,
            verify=verify,
            allow_overflow=allow_overflow,
            progress=progress,
            src=src,
        )
        if force and fmt == "safetensors":
            _remove_stale_shards(dst, outputs)
    return report


def _refuse_special(src: Path, entries: dict[str, TensorInfo], fmt: str) -> None:
    """Refuse, naming the key, what the output cannot hold as it is: a placeholder or a meta
    tensor is never written as weights; sparse and quantized tensors and packed parameters go
    only to ``.pt`` output, which keeps them (safetensors stores dense tensors only)."""
    for key, info in entries.items():
        if info.kind == "dense" or (info.kind in KEPT_IN_TORCH and fmt == "torch"):
            continue
        what = KINDS.get(info.kind, info.kind)
        if info.kind == "placeholder":
            hint = (
                "convert the DeepSpeed checkpoint folder (the one holding 'latest'), "
                "which rebuilds the weights"
            )
        elif info.kind in KEPT_IN_TORCH:
            raise FormatError(
                f"'{key}' in {src} is {what}, which safetensors cannot store (dense tensors only)",
                "write a .pt output, which keeps it, or make it dense in PyTorch first",
            )
        elif info.kind in ("DTensor", "ShardedTensor"):  # as when torch's safe set lacks it
            from ckptkit.formats.folders.rank_files import one_rank_refusal

            raise one_rank_refusal(Path(src), info.kind)
        else:
            hint = "convert it to a dense tensor in PyTorch first"
        raise FormatError(f"tensor '{key}' in {src} is {what}; ckptkit cannot convert it", hint)


def _remove_stale_shards(dst: Path, outputs: list[Path]) -> None:
    """After a forced re-run, the shards and index of an earlier run into the same place that
    this run did not write (a model now in 3 shards, not 5; or in one file): loaders would
    otherwise find a stale index or a mix of runs."""
    stem = dst.name.removesuffix(".safetensors")
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")
    stale = [p for p in dst.parent.iterdir() if shard.fullmatch(p.name)]
    stale.append(dst.with_name(dst.name + ".index.json"))
    for path in stale:
        if path not in outputs and path.is_file():
            path.unlink()


def _write(
    source: Source,
    shards: list[list[Item]],
    outputs: list[Path],
    header: dict[str, str],
    aliases: dict[str, str],
    report: ConvertReport,
    *,
    special: set[str],
    force: bool,
    verify: bool,
    allow_overflow: bool,
    progress: bool,
    src: Path,
) -> None:
    """Write every output file to a temp file, verify it, and only then put them all in place."""
    # Writing, then checking what was written: both count, so the bar does not stall at the end.
    total = report.nbytes * (2 if verify else 1)
    bar = progress_bar(total, "convert") if progress else None
    transfer = Transfer(source, progress=bar.update if bar else lambda nbytes: None)
    try:
        if report.output_format == "dcp":
            with atomic_folder(outputs[0], force=force, inputs=[src]) as tmp:
                transfer.write_dcp(tmp, shards[0], aliases, header, verify=verify)
                _refuse_overflow(transfer, allow_overflow)
                if verify:
                    transfer.verify_dcp(tmp, shards[0], aliases, header, outputs[0])
        else:
            # In order, or none: the index (last) appears only once every shard is in place.
            with atomic_outputs(outputs, force=force, inputs=[src]) as temps:
                for shard, tmp, path in zip(shards, temps, outputs, strict=False):
                    if report.output_format == "torch" and special:
                        transfer.save_values(tmp, shard, aliases, special)
                    elif report.output_format == "torch":
                        transfer.write_torch(tmp, shard, aliases, verify=verify)
                    else:
                        transfer.write_safetensors(tmp, shard, header, verify=verify)
                    _refuse_overflow(transfer, allow_overflow)
                    if verify:
                        with syncing(tmp):  # the disk write-back overlaps the read-back
                            if report.output_format == "torch" and special:
                                transfer.verify_values(tmp, shard, path, special)
                            elif report.output_format == "torch":
                                transfer.verify_torch(tmp, shard, aliases, path)
                            else:
                                transfer.verify_safetensors(tmp, shard, header, path)
                if len(outputs) > len(shards):  # the index of a sharded output
                    _write_index(temps[-1], shards, outputs, header)
        report.verified = verify
        report.copied, report.through_torch = transfer.copied, transfer.through_torch
        report.overflowed = list(transfer.overflowed)
    finally:
        transfer.close()
        if bar:
            bar.close()


def _refuse_overflow(transfer: Transfer, allow_overflow: bool) -> None:
    if transfer.overflowed and not allow_overflow:
        names = ", ".join(transfer.overflowed[:5])
        raise CastError(
            f"the cast turns finite values into inf in {names}; nothing was written",
            "keep them with --keep-dtype GLOB, or pass --allow-overflow",
        )


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
        # The source's own header entries, less its tie records (written afresh for the keys
        # as they are now).
        other={
            k: v
            for k, v in source.metadata.items()
            if not k.startswith("ckptkit.") and k not in source.aliases()
        },
    )


_CASTS = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
}


def _cast_target(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    if dtype not in _CASTS:
        raise UsageError(f"unknown --dtype '{dtype}'", "use bf16, fp16 or fp32")
    return _CASTS[dtype]


def _out_dtype(dtype: str, key: str, target: str | None, keep: list[str]) -> str:
    """The dtype a tensor is written in: floating point ones cast, unless a glob keeps them."""
    if (
        target is None
        or DTYPES[dtype].kind != "float"
        or any(fnmatch.fnmatchcase(key, g) for g in keep)
    ):
        return dtype
    return target


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2 * 2**30; an int is bytes.

    Raises:
        UsageError: not a positive size.
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise UsageError(f"cannot read size '{size}'", "write it like 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"size '{size}' must be positive")
    return value


def _shards(items: list[Item], aliases: dict[str, str], limit: int | None) -> list[list[Item]]:
    """Group items into shards of at most ``limit`` bytes, in order; tied tensors share a
    shard, and a tensor larger than the limit gets one of its own."""
    if limit is None:
        return [items]
    root = {key: aliases.get(key, key) for key in (i.spec.key for i in items)}
    units: dict[str, list[Item]] = {}
    for item in items:
        units.setdefault(root[item.spec.key], []).append(item)
    shards: list[list[Item]] = [[]]
    size = 0
    for unit in units.values():
        unit_size = sum(i.spec.nbytes for i in unit)
        if shards[-1] and size + unit_size > limit:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += unit_size
    return shards


def _output_paths(dst: Path, count: int) -> list[Path]:
    """One file, or ``stem-0000i-of-0000n.safetensors`` shards plus ``dst.index.json`` last."""
    if count == 1:
        return [dst]
    stem = dst.name.removesuffix(".safetensors")
    shards = [
        dst.with_name(f"{stem}-{i:05d}-of-{count:05d}.safetensors") for i in range(1, count + 1)
    ]
    return shards + [dst.with_name(dst.name + ".index.json")]


def _write_index(
    path: Path, shards: list[list[Item]], outputs: list[Path], header: dict[str, str]
) -> None:
    """The Hugging Face index: total_size in metadata, and the shard of every key."""
    weight_map = {
        item.spec.key: out.name
        for shard, out in zip(shards, outputs, strict=False)
        for item in shard
    }
    total = sum(item.spec.nbytes for shard in shards for item in shard)
    index = {"metadata": {"total_size": total, **header}, "weight_map": weight_map}
    path.write_text(json.dumps(index, indent=2) + "\n")
