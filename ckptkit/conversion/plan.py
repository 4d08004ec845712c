"""What a conversion will write, computed from headers before any tensor is read: which
tensors, under which keys, in which dtype, in which shard, and how ties are written. What an
output format can do is asked of its writer class (``formats/output/writers.py``)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckptkit.conversion.options import OutputOptions
from ckptkit.errors import FormatError, KeyMatchError, UsageError
from ckptkit.formats.base.dtypes import DTYPES, TensorSpec
from ckptkit.formats.base.source import KEPT_IN_TORCH, KINDS, Source, TensorInfo
from ckptkit.formats.folders.layouts import (
    folder_files,
    model_parallel_files,
    model_parallel_name,
    model_parallel_refusal,
)
from ckptkit.formats.folders.megatron_ranks import MegatronRanks
from ckptkit.formats.open import open_source
from ckptkit.formats.output.copier import Item
from ckptkit.formats.output.plan import parse_size, plan_shards, shard_paths
from ckptkit.formats.output.writers import able, writer_class
from ckptkit.keys import KeyMatch, KeyPlan, KeyRules, match_keys, mismatch_message, plan_ties
from ckptkit.mapping.source import MappedSource
from ckptkit.spread import Part
from ckptkit.storage.location import Location, is_local

__all__ = [
    "Plan",
    "make_plan",
    "part_of",
    "shard_limit",
    "cast_target",
    "refuse_unconvertible",
    "documents_into",
]


@dataclass
class Plan:
    """What a conversion will write, computed from headers alone."""

    src: Location
    dst: Path
    fmt: str
    keys: KeyPlan
    match: KeyMatch | None
    entries: dict[str, TensorInfo]
    items: list[Item]
    shards: list[list[Item]]
    outputs: list[Path]  # one per shard, then the index of a sharded output
    aliases: dict[str, str]  # tied name -> the name written (safetensors: named in metadata)
    ties: str
    allow_overflow: bool = False
    special: frozenset[str] = field(default_factory=frozenset)  # kept as they are in .pt
    folder: Path | None = None  # a model folder output: the outputs are inside it
    copies: list[Location] = field(default_factory=list)  # the source folder's config, tokenizer...
    into: bool = False  # the model folder exists: its files are replaced one by one
    documents: dict[str, str] = field(default_factory=dict)  # made for a model folder output


def make_plan(
    source: Source,
    src: Location,
    dst: Path,
    fmt: str,
    keys: KeyRules,
    output: OutputOptions,
    target: str | None,
    shard_limit: int | None,
    folder: Path | None = None,
) -> Plan:
    entries = dict(source.entries())
    refuse_special(src, entries, fmt)
    key_plan = keys.plan(entries)
    kind = writer_class(fmt)
    if kind.text_keys:  # a JSON header (safetensors, DCP's metadata) holds UTF-8 text only
        for new in key_plan.mapping.values():
            if new is not None and not new.isascii():
                try:
                    new.encode("utf-8")
                except UnicodeEncodeError:
                    raise FormatError(
                        f"key '{new}' of {src} is not valid UTF-8 text, which a {fmt} header "
                        "cannot hold",
                        "rename it with --rename REGEX=REPL, or write a .pt output",
                    ) from None
    match = match_reference(key_plan, entries, Path(keys.match_to)) if keys.match_to else None
    items = []
    for old, new in key_plan.mapping.items():
        if new is not None:
            info = entries[old]
            spec = TensorSpec(new, item_dtype(info, new, target, output), info.shape)
            items.append(Item(old, spec, info.dtype))
    if kind.widest_first:
        # Widest dtypes first, so every tensor's data stays aligned for memory mapping.
        items.sort(key=lambda item: -DTYPES[item.spec.dtype].itemsize)
    aliases = {
        new_a: new_b
        for a, b in source.aliases().items()
        if (new_a := key_plan.mapping.get(a)) and (new_b := key_plan.mapping.get(b))
    }
    ties = kind.ties or ("copies" if output.keep_tied_copies else "once")
    if ties == "once":  # one tensor per tied group, the others named in the metadata
        aliases = plan_ties(aliases)
        items = [item for item in items if item.spec.key not in aliases]
    by_key = {item.spec.key: item for item in items}
    units = [(i.spec.key, i.spec.nbytes, aliases.get(i.spec.key, i.spec.key)) for i in items]
    shards = [[by_key[k] for k in shard] for shard in plan_shards(units, shard_limit)]
    if folder is not None and shard_limit is None and source.folder is not None:
        shards = shards_as_in(source, items) or shards
    beside = source.folder or source.config_folder  # its config, tokenizer...
    return Plan(
        src=src,
        dst=dst,
        fmt=fmt,
        keys=key_plan,
        match=match,
        entries=entries,
        items=items,
        shards=shards,
        outputs=shard_paths(dst, len(shards)),
        aliases=aliases,
        ties=ties,
        allow_overflow=output.allow_overflow,
        special=frozenset(old for old, info in entries.items() if info.kind != "dense"),
        folder=folder,
        copies=folder_files(beside) if folder is not None and beside is not None else [],
        documents=dict(source.documents) if folder is not None else {},
    )


def per_rank(plan: Plan, source: MappedSource | MegatronRanks, folder: Path) -> Plan:
    """A target saved one file per rank (Meta's consolidated.NN.pth, a legacy Megatron
    save's model_optim_rng.pt): each rank's tensors, under their own keys, in its file in
    ``folder``."""
    names = source.rank_files
    assert names is not None
    shards: list[list[Item]] = [[] for _ in names]
    for item in plan.items:
        rank, key = source.placed(item.old)
        shards[rank].append(replace(item, spec=replace(item.spec, key=key)))
    return replace(
        plan,
        items=[item for shard in shards for item in shard],
        shards=shards,
        outputs=[folder / name for name in names],
        aliases={},
    )


def refuse_special(src: Location, entries: dict[str, TensorInfo], fmt: str) -> None:
    """Refuse, naming the key, what the output cannot hold as it is: a placeholder or a meta
    tensor is never written as weights; sparse and quantized tensors and packed parameters go
    only to ``.pt`` output, which keeps them (safetensors stores dense tensors only)."""
    for key, info in entries.items():
        if info.kind == "dense" or (info.kind in KEPT_IN_TORCH and writer_class(fmt).keeps_special):
            continue
        what = KINDS.get(info.kind, info.kind)
        if info.kind == "tensor subclass" and info.detail:
            what += f" ({info.detail})"
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

            raise one_rank_refusal(src, info.kind)
        else:
            hint = "convert it to a dense tensor in PyTorch first"
        raise FormatError(f"tensor '{key}' in {src} is {what}; ckptkit cannot convert it", hint)


def match_reference(plan: KeyPlan, entries: dict[str, TensorInfo], ref_path: Path) -> KeyMatch:
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


def refuse_unconvertible(source: Source, src: Location, check_outputs: bool) -> None:
    """Refuse, before planning, a source there is nothing to convert from (GGUF, no tensors)
    and ``--check-outputs`` where nothing is merged."""
    from ckptkit.adapters.merged import MergedSource

    if source.format == "gguf":
        raise FormatError(
            f"{src} is a GGUF file (llama.cpp): ckptkit describes it (inspect, diff, scan) "
            "but does not convert it",
            "convert it with llama.cpp's tools (gguf-py)",
        )
    if not source.entries():
        raise FormatError(
            f"{src} {source.selected_reason}"
            if source.selected_reason.startswith("holds no tensors")
            else f"{src} holds no tensors ({source.selected_reason})",
            "nothing to convert: `ckptkit inspect` shows what it holds",
        )
    if check_outputs and not isinstance(source, MergedSource):
        raise UsageError("--check-outputs checks merged adapters", "merge one, or drop it")
    named = model_parallel_name(src.name) and not isinstance(source, MappedSource)
    parallel = model_parallel_files(src.parent) if named else None  # listed only then
    if parallel is not None and src.name in parallel[0] and len(parallel[0]) > 1:
        # One rank's slice of every weight: converted alone it would be verified, and wrong.
        raise model_parallel_refusal(src, parallel)


def part_of(plan: Plan, part: Part) -> Plan:
    """The share of a sharded output's shards that ``part`` writes (no index: see
    :func:`ckptkit.conversion.write.write_agreed` and ``ckptkit.spread.finish``)."""
    kind = writer_class(plan.fmt)
    folder = plan.folder is not None and not kind.spreads_in_folder
    if folder or not kind.spreadable or len(plan.shards) < 2:
        spreadable = " or ".join(c.format for c in able("spreadable"))
        raise UsageError(
            f"--part {part} spreads the shards of a sharded {spreadable} file, and {plan.dst} "
            f"would be {'one file' if len(plan.shards) < 2 else 'a folder'}",
            "give DST a .safetensors name and --max-shard-size (smaller than the model)",
        )
    mine = part.shards(len(plan.shards))
    shards, outputs = [plan.shards[i] for i in mine], [plan.outputs[i] for i in mine]
    if kind.spreads_in_folder:  # each file committed on its own; the entry once all are done
        return replace(plan, shards=shards, outputs=outputs, into=True, documents={})
    return replace(plan, shards=shards, outputs=outputs)


def shard_limit(output: OutputOptions, fmt: str) -> int | None:
    if output.max_shard_size is None:
        return None
    limit = parse_size(output.max_shard_size)
    if not writer_class(fmt).shardable:
        able_ = able("shardable")
        raise UsageError(
            f"--max-shard-size writes {' or '.join(c.format for c in able_)} shards",
            f"give a {' or '.join(c.suffixes[0] for c in able_)} DST",
        )
    return limit


_CASTS = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
}


def cast_target(dtype: str | None) -> str | None:
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


def item_dtype(info: TensorInfo, key: str, target: str | None, output: OutputOptions) -> str:
    """The dtype an output tensor is written in: dense ones may be cast; others stay as they
    are (sparse, quantized, packed parameters)."""
    if info.kind != "dense":
        return info.dtype
    return _out_dtype(info.dtype, key, target, list(output.keep_dtype))


def copies_into(plan: Plan, force: bool) -> list[Location]:
    """The source folder's config files to write into an existing folder: those it lacks or
    holds otherwise (which need ``--force``); one it holds as they are is left alone."""
    assert plan.folder is not None
    copies = []
    for path in plan.copies:
        there = plan.folder / path.name
        if there.is_file() and is_local(path):  # a URL's: not compared
            if (
                there.stat().st_size == path.stat().st_size
                and there.read_bytes() == path.read_bytes()
            ):
                continue
        copies.append(path)
    return copies


def documents_into(plan: Plan) -> dict[str, str]:
    """The documents a mapping made to write into an existing folder: those it lacks or holds
    otherwise (which need ``--force``, as the copies do); one it holds as made is left alone."""
    assert plan.folder is not None
    made = {}
    for name, text in plan.documents.items():
        there = plan.folder / name
        if there.is_file() and there.read_bytes() == text.encode("utf-8"):
            continue
        made[name] = text
    return made


def weights_name(source: Source) -> str:
    """The weights file name of a folder output: the source library's (diffusers'
    ``diffusion_pytorch_model.safetensors``), else transformers' ``model.safetensors``."""
    base = getattr(source, "base", None)  # a merge: its base's
    return source.weights_name or getattr(base, "weights_name", None) or "model.safetensors"


def shards_as_in(source: Source, items: list[Item]) -> list[list[Item]] | None:
    """The items grouped as the source's own shard index groups their keys (a sharded model
    stays sharded the same way), or None for one weights file."""
    from ckptkit.formats.folders.sharded import read_index

    base = getattr(source, "base", source)  # a merge: its base's
    if base.format != "sharded":
        return None
    where, _ = read_index(base.path)  # a sharded source's path is its index
    names = sorted(set(where.values()))
    groups: dict[str, list[Item]] = {name: [] for name in names}
    for item in items:
        groups[where.get(item.old, names[-1])].append(item)
    return [group for group in groups.values() if group]
