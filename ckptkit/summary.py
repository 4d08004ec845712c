"""``summarize``: what is in a checkpoint, from headers alone (its views are in ``render``).

Nothing here reads tensor data or executes pickled code, and for torch and safetensors files
nothing imports torch: the answer comes from the zip's pickle, the legacy pickles or the
safetensors header.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ckptkit.adapters import describe
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.base.tree import EMA_MODEL_WHY, Candidate, DroppedPart
from ckptkit.formats.files.readings import readings as find_readings
from ckptkit.formats.files.readings import remote_readings
from ckptkit.formats.folders.diffusers import is_pipeline
from ckptkit.formats.open import open_source
from ckptkit.inspect_view import inspect_lines
from ckptkit.keyfold import collapse, keep
from ckptkit.keys import WRAPPERS, Wrapper, build_plan, detect_wrappers
from ckptkit.meta import NAMESPACE, CheckpointMeta, training_of
from ckptkit.scan import ScanReport, report_of
from ckptkit.storage.backends.base import counting
from ckptkit.storage.location import (
    Location,
    is_local,
    is_remote,
    local_path,
    location,
    may_be_folder,
    size,
    tree_size,
)

__all__ = ["summarize", "Summary", "collapse", "keep"]


@dataclass
class Summary:
    """Everything ``inspect`` shows about one checkpoint."""

    def __str__(self) -> str:
        """What ``ckptkit inspect`` prints of it."""
        return "\n".join(inspect_lines(self))

    path: str
    format: str
    file_size: int
    selected: str = ""
    selected_reason: str = ""
    tensors: list[tuple[str, TensorInfo]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    dropped: list[DroppedPart] = field(default_factory=list)
    wrappers: tuple[Wrapper, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    shared: list[list[str]] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    safety: ScanReport | None = None
    candidates: list[Candidate] = field(default_factory=list)  # every tensor map that could be it
    # A folder's files (an Accelerate save_state folder, a model folder): name, what it is,
    # bytes, and its scan verdict.
    parts: list[dict[str, Any]] = field(default_factory=list)
    shards: dict[str, int] = field(default_factory=dict)
    adapter: dict[str, Any] | None = None  # a LoRA adapter's kind, base, ranks, targets
    # A diffusers pipeline folder (inspected without --select): its class and each component's
    # name, library, class and weights (see ``_pipeline``).
    pipeline: dict[str, Any] | None = None
    # A diffusers EMAModel state dict: how many shadow parameters, their settings, and whether
    # they are named (``names_from``).
    ema_model: dict[str, Any] | None = None
    # A file at a URL: the ranged requests made to read its headers, and the bytes they brought.
    fetched: dict[str, int] | None = None
    # A model folder's weights (config.json beside them): their names are the model's own,
    # whatever prefix they share (``transformer.``), and from_pretrained needs them as they are.
    model_folder: bool = False
    # Keys in a model family's own names, or one of its rank files: the shipped packs that map
    # them ("packs"), and for a rank file, that it is one slice of the model ("rank_file").
    mapping: dict[str, Any] | None = None

    @cached_property  # the views ask more than once; 100,000 tensors make it count
    def parameters(self) -> int:
        """Elements in all tensors of the state dict (parameters and buffers)."""
        return sum(info.numel for _, info in self.tensors)

    @cached_property
    def nbytes(self) -> int:
        aliases = self.aliases
        return sum(info.nbytes for key, info in self.tensors if key not in aliases)

    @cached_property
    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for key, info in self.tensors:
            if key not in self.aliases:
                out[info.dtype] += info.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @cached_property
    def common_prefix(self) -> str | None:
        """A first name every key shares once wrappers are stripped (Lightning's ``model.``),
        which ``--strip-prefix`` removes; None when the keys do not all share one."""
        keys = _wrappers_stripped([k for k, _ in self.tensors])
        heads = {k.split(".", 1)[0] for k in keys if k}
        if len(keys) < 2 or len(heads) != 1 or not all(k and "." in k for k in keys):
            return None
        return heads.pop() + "."

    @cached_property
    def non_contiguous(self) -> list[str]:
        return [key for key, info in self.tensors if not info.contiguous]

    @property
    def training(self) -> dict[str, Any]:
        """The training run's metadata, from an engine checkpoint or a converted file's header."""
        return training_of(self.extras, self.metadata)

    @property
    def ckptkit_metadata(self) -> dict[str, Any]:
        """The ``ckptkit.`` metadata, decoded (empty when there is none)."""
        if not any(k.startswith(NAMESPACE) for k in self.metadata):
            return {}
        meta = CheckpointMeta.from_header(self.metadata).to_dict()
        return {k: v for k, v in meta.items() if v not in (None, [], {}) and k != "other"}

    def to_dict(self, key_filter: str | None = None) -> dict[str, Any]:
        """The fields of the ``inspect --json`` document (see ``render.SCHEMAS``)."""
        return {
            "path": self.path,
            "format": self.format,
            "file_size": self.file_size,
            "shards": self.shards,
            "state_dict": {"path": self.selected, "reason": self.selected_reason},
            "tensor_count": len(self.tensors),
            "parameters": self.parameters,
            "bytes": self.nbytes,
            "bytes_by_dtype": self.bytes_by_dtype,
            "wrappers": [{"prefix": w.prefix, "added_by": w.added_by} for w in self.wrappers],
            "convert_strips": "".join(w.prefix for w in self.wrappers),
            "weights_candidates": [c.to_dict() for c in self.candidates],
            "parts": self.parts,
            "common_prefix": self.common_prefix,
            "model_folder": self.model_folder,
            "aliases": self.aliases,
            "shared_storage": self.shared,
            "non_contiguous": self.non_contiguous,
            "extras": self.extras,
            "other_parts": [part.to_dict() for part in self.dropped],
            "metadata": {k: v for k, v in self.metadata.items() if not k.startswith(NAMESPACE)},
            "ckptkit_metadata": self.ckptkit_metadata,
            "safety": self.safety.to_dict() if self.safety else None,
            "adapter": self.adapter,
            "pipeline": self.pipeline,
            "ema_model": self.ema_model,
            "fetched": self.fetched,
            "mapping": self.mapping,
            "tensors": [
                {"key": key, **info.to_dict(), "contiguous": info.contiguous}
                for key, info in self.tensors
                if keep(key, key_filter)
            ],
        }


def summarize(
    path: str | Path,
    *,
    select: str | None = None,
    variant: str | None = None,
    names_from: str | Path | None = None,
) -> Summary:
    """Describe a checkpoint without loading tensor data or running its pickle.

    Args:
        path: a torch zip or legacy file, safetensors, or a sharded checkpoint (index or folder).
            A diffusers pipeline folder without ``select`` is described by its components.
        select: dotted path of the state dict inside a training checkpoint (default: found); a
            diffusers pipeline's component.
        variant: in a model folder (or each component of a pipeline), the weights of this
            variant (``fp16``).
        names_from: the model a diffusers ``EMAModel`` state dict belongs to, whose parameter
            names its ``shadow_params`` take (without it they are shown by position).

    Returns:
        The summary: format, sizes, where the state dict is and what else is there, tensors,
        wrapper chain, tied and shared tensors, metadata, and the pickle's safety verdict.

    Raises:
        CkptkitError: the file cannot be read as a checkpoint.
    """
    with counting() as traffic:  # what reading it cost, at a URL: listings, headers, verdict
        summary = _summarize(where := location(path), select, variant, names_from)
    if is_remote(where):
        summary.fetched = {"requests": traffic.requests, "bytes": traffic.bytes}
    return summary


def _summarize(
    path: Location, select: str | None, variant: str | None, names_from: str | Path | None
) -> Summary:
    # (A URL with a suffix names a file, or a glob: no folder listed to find out.)
    if select is None and names_from is None and may_be_folder(path) and is_pipeline(path):
        return _pipeline(path, variant)
    # Reading is static, so an unsafe file can be shown too; its verdict comes from the same
    # parse the reader made.
    with open_source(
        path,
        select=select,
        check_safety=False,
        variant=variant,
        names_from=names_from,
        unnamed=True,
    ) as source:
        safety = _safety(source)
        entries = source.entries()
        summary = Summary(
            path=str(path),
            format=source.format
            if source.format != "sharded"
            else f"sharded {getattr(source, 'shard_format', '?')}",
            file_size=_size_on_disk(source),
            selected=source.selected,
            selected_reason=source.selected_reason,
            tensors=entries,
            extras=source.extras,
            dropped=source.dropped,
            wrappers=detect_wrappers(key for key, _ in entries),
            aliases=source.aliases(),
            shared=_shared_groups(entries, source.aliases()),
            metadata=dict(source.metadata),
            safety=safety,
            candidates=list(source.candidates),
            parts=_folder_parts(local_path(source.folder or path), safety)  # a component's
            if is_local(path) and path.is_dir() and source.format != "sharded"
            else [],
            shards={
                name: _size_on_disk(shard) for name, shard in getattr(source, "shards", {}).items()
            },
            adapter=describe(source),
            ema_model=_ema_model(source, path, names_from),
            model_folder=source.folder is not None,
            mapping=_mapping(path, entries),
        )
    return summary


def _mapping(path: Location, entries: list[tuple[str, TensorInfo]]) -> dict[str, Any] | None:
    """The shipped packs that map keys in a model family's own names, and whether the file is
    one of several model-parallel rank files (a local file's folder listed to find out)."""
    from ckptkit.mapping.recognise import model_parallel, packs_for

    def fits(pack: str) -> bool:  # the whole mapping plans on it: its checks, its requires
        from ckptkit.errors import CkptkitError
        from ckptkit.mapping.source import MapOptions, map_plan

        try:
            map_plan(path, MapOptions(mapping=pack))
        except CkptkitError:
            return False
        return True

    found = packs_for((key for key, _ in entries), path.name, fits)
    rank_file = None
    if is_local(path) and not path.is_dir():
        recognised = model_parallel(path.parent)
        rank_file = recognised.one_of(path.name) if recognised else None
    if not found and rank_file is None:
        return None
    return {"packs": found, "rank_file": rank_file}


def _safety(source: Source) -> ScanReport | None:
    """A source's verdict, from the parse its reader made (a safetensors file scanned)."""
    readings = getattr(source, "readings", None)
    inner = getattr(source, "inner", None)  # an EMAModel's shadow_params under their names
    if not readings and inner is not None:
        readings = getattr(inner, "readings", None)
    raw = source.remote_file  # a file at a URL: read through it
    if readings:
        return report_of(source.path, readings, raw=raw)
    if source.format == "safetensors":  # the file itself (path may be its model folder)
        # The source has read and checked its header: the verdict needs no second parse.
        found = (
            find_readings(str(source.path)) if raw is None else remote_readings(source.path, raw)
        )
        return report_of(
            source.path, found, structure_checked=found[0].kind == "safetensors", raw=raw
        )
    return None


def _ema_model(
    source: Source, path: Location, names_from: str | Path | None
) -> dict[str, Any] | None:
    """What a diffusers EMAModel state dict holds, or None for anything else."""
    shadow = next((c for c in source.candidates if c.why == EMA_MODEL_WHY), None)
    if shadow is None:
        return None
    return {
        "shadow_params": shadow.tensors,
        "names_from": None if names_from is None else str(names_from),
        "settings": dict(source.extras),  # decay, optimization_step, ...
        "convert": f"ckptkit convert {path} OUT --ema --names-from "
        + ("MODEL_FOLDER" if names_from is None else str(names_from)),
    }


def _pipeline(folder: Location, variant: str | None) -> Summary:
    """A diffusers pipeline folder: its class and, for each component, what weights it holds
    (the file read, tensors, bytes by dtype, verdict) or why none can be read."""
    from ckptkit.errors import CkptkitError
    from ckptkit.formats.folders.diffusers import pipeline_components, read_model_index

    index = read_model_index(folder)
    components = []
    for component in pipeline_components(folder):
        row: dict[str, Any] = {
            "name": component.name,
            "library": component.library,
            "class": component.cls,
            "weights": None,
        }
        if component.holds_weights():
            try:
                with open_source(component.folder, variant=variant, check_safety=False) as source:
                    entries = source.entries()
                    aliases = source.aliases()
                    safety = _safety(source)
                    dtypes: dict[str, int] = defaultdict(int)
                    for key, info in entries:
                        if key not in aliases:
                            dtypes[info.dtype] += info.nbytes
                    row["weights"] = {
                        "file": source.path.name,
                        "format": source.format
                        if source.format != "sharded"
                        else f"sharded {getattr(source, 'shard_format', '?')}",
                        "reason": source.selected_reason,
                        "tensors": len(entries),
                        "parameters": sum(info.numel for _, info in entries),
                        "bytes": sum(dtypes.values()),
                        "bytes_by_dtype": dict(sorted(dtypes.items(), key=lambda kv: -kv[1])),
                        "verdict": safety.verdict if safety is not None else None,
                    }
            except CkptkitError as exc:
                row["error"] = exc.cli_text
        components.append(row)
    return Summary(
        path=str(folder),
        format="diffusers pipeline",
        file_size=tree_size(folder),
        selected_reason="a diffusers pipeline: --select COMPONENT takes one",
        pipeline={
            "class": index.get("_class_name"),
            "diffusers_version": index.get("_diffusers_version"),
            "components": components,
        },
    )


def _folder_parts(folder: Path, opened: ScanReport | None) -> list[dict[str, Any]]:
    """Each file of a folder, what it is and its verdict; the file already opened (and
    scanned) as the folder's model is not scanned again."""
    from ckptkit.formats.folders.layouts import folder_parts
    from ckptkit.scan import scan_many

    named = folder_parts(folder)
    done = {Path(opened.path).name: opened} if opened is not None else {}
    rest = iter(scan_many(folder / name for name, _ in named if name not in done))
    reports = [done[name] if name in done else next(rest) for name, _ in named]
    return [
        {
            "name": name,
            "kind": kind,
            "bytes": (folder / name).stat().st_size,
            "verdict": report.verdict if report.error is None else "not a checkpoint",
        }
        for (name, kind), report in zip(named, reports, strict=True)
    ]


def _size_on_disk(source: Any) -> int:
    raw = source.remote_file
    if raw is not None:  # a file at a URL: its size came with the first read
        return int(raw.remote.size)
    shards = getattr(source, "shards", None)
    if shards:  # each shard's (at a URL: known from its first read)
        return sum(_size_on_disk(shard) for shard in shards.values())
    sized = getattr(source, "file_size", None)  # sizes a folder's listing gave
    return sum(sized(path) if sized else size(path) for path in source.files())


def _wrappers_stripped(keys: list[str]) -> list[str | None]:
    """The keys as ``convert --strip-wrappers`` renames them (None: dropped), as
    ``build_plan(keys, strip_wrappers=True)`` gives them; the plan itself only when some key
    may hold a wrapper inside it (its search for those took 2 s for 100,000 keys)."""
    stripped: list[str | None] = list(keys)
    for wrapper in detect_wrappers(keys):  # every key carries it, a wrapper's own keys aside
        prefix = len(wrapper.prefix)
        stripped = [None if k is None or k in wrapper.own_keys else k[prefix:] for k in stripped]
    text = "\n".join(k for k in stripped if k is not None)
    if _INNER_WRAPPER.search(text) or any(own in text for w in WRAPPERS for own in w.own_keys):
        return list(build_plan(keys, strip_wrappers=True).mapping.values())
    return stripped


# A known wrapper's name inside a key ("blocks.0._orig_mod.attn"), which needs the full plan.
_INNER_WRAPPER = re.compile("|".join(re.escape("." + w.prefix) for w in WRAPPERS))


def _shared_groups(
    entries: list[tuple[str, TensorInfo]], aliases: dict[str, str]
) -> list[list[str]]:
    """Keys that live in one storage without being the same tensor (views, flat buffers)."""
    by_storage: dict[str, list[str]] = defaultdict(list)
    for key, info in entries:
        if info.storage is not None and key not in aliases:
            by_storage[info.storage].append(key)
    return [keys for keys in by_storage.values() if len(keys) > 1]
