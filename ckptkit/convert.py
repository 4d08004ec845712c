"""``convert``: plan from headers, write tensor by tensor, report what was done.

The plan (which tensors, under which keys, in which dtype, in which shard) is computed from
headers before any tensor is read, so ``dry_run`` shows it and collisions fail before anything
is written. Each output format's writer (``formats/output/writers.py``) writes it to temporary
paths and reads it back; the output appears atomically, only after it compared bit-exact with
the source.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptkit.adapters import AdapterOptions, adapter_options, open_merged
from ckptkit.errors import (
    CastError,
    CkptkitError,
    FormatError,
    KeyMatchError,
    OutputError,
    UsageError,
)
from ckptkit.formats.base.dtypes import DTYPES, TensorSpec
from ckptkit.formats.base.source import KEPT_IN_TORCH, KINDS, Source, TensorInfo
from ckptkit.formats.base.tree import DroppedPart
from ckptkit.formats.files.readings import WEIGHT_SUFFIXES
from ckptkit.formats.folders.dcp import DISTCP, METADATA, SIDECAR
from ckptkit.formats.folders.layouts import folder_files
from ckptkit.formats.open import OpenOptions, open_source
from ckptkit.formats.output import output_format
from ckptkit.formats.output.copier import Copier, Item
from ckptkit.formats.output.plan import (
    index_document,
    parse_size,
    plan_shards,
    shard_paths,
    stale_names,
    stale_shards,
)
from ckptkit.formats.output.writers import Writer, writer_for
from ckptkit.keys import (
    KeyMatch,
    KeyPlan,
    KeyRules,
    detect_wrappers,
    match_keys,
    mismatch_message,
    plan_ties,
)
from ckptkit.meta import TRAINING_KEY, CheckpointMeta
from ckptkit.progress import progress_bar
from ckptkit.spread import Part, all_succeeded, parse_part
from ckptkit.storage.atomic import atomic_folder, atomic_outputs, check_folder_output, check_output
from ckptkit.storage.remote import RemotePath, as_path, is_url
from ckptkit.storage.upload import PART, Uploads, staging_folder

__all__ = [
    "convert",
    "merge_adapters",
    "convert_checkpoint",
    "ConvertReport",
    "ReadOptions",
    "OutputOptions",
    "KeyRules",
    "parse_size",
]


@dataclass(frozen=True, kw_only=True)
class ReadOptions(OpenOptions):
    """How the source is read: how it is opened (``OpenOptions``: which weights, how safely;
    an adapter SRC's base takes them, see ``open_merged``), what is merged into it or stripped
    from it, and how many ranged requests a URL source gets."""

    adapters: AdapterOptions = field(default_factory=AdapterOptions)
    workers: int = 8  # ranged requests in flight for a source at a URL (local files: unused)


@dataclass(frozen=True)
class OutputOptions:
    """What the output is: its format, dtype, sharding and how ties are written."""

    to: str | None = None
    dtype: str | None = None
    keep_dtype: tuple[str, ...] = ()
    allow_overflow: bool = False
    max_shard_size: int | str | None = None
    keep_tied_copies: bool = False


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
    part: str | None = None  # "I/N": this process wrote that share of the shards

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
            "adapters": self.adapters,
            "merged": self.merged,
            "output_check": self.output_check,
            "copied_files": self.copied_files,
            "part": self.part,
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
    variant: str | None = None,
    names_from: str | Path | None = None,
    workers: int = 8,
    part: str | None = None,
    drop_adapters: bool = False,
    lora_alpha: float | None = None,
    adapter_config: str | Path | None = None,
) -> ConvertReport:
    """Convert a checkpoint's state dict to safetensors, a plain ``.pt`` state dict or a DCP
    folder.

    Args:
        src: the checkpoint to read (torch zip or legacy, safetensors, or sharded). A diffusers
            pipeline folder without ``select`` is converted whole into the pipeline folder
            ``dst`` (see ``pipeline_convert.py``).
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
        variant: in a model folder, the weights of this variant (diffusers'
            ``diffusion_pytorch_model.fp16.safetensors`` for ``"fp16"``).
        names_from: the model folder a diffusers ``EMAModel`` state dict belongs to: its
            ``shadow_params`` take the model's parameter names, in order, and a folder ``dst``
            gets the model's config.
        workers: ranged requests in flight when ``src`` is a URL (``s3://``, ``https://``...);
            memory holds about ``workers + 1`` requests of 8 MiB.
        part: ``"I/N"``: write only part I of N of a sharded output's shards, no index
            (``ckptkit.spread.finish`` writes it once every part is done).
        drop_adapters: ``src`` is a PeftModel state dict: write the base model alone.
        lora_alpha: ``src`` is a PeftModel state dict: merge its adapter with this
            ``lora_alpha`` (the rank from the factors' shapes).
        adapter_config: ``src`` is a PeftModel state dict: merge its adapter as this
            ``adapter_config.json`` says.

    Returns:
        The report: where the state dict was, the key plan, what was dropped, cast and written.

    Raises:
        CkptkitError: a subclass naming the file, the key and the fix, before anything is
            written whenever the problem can be seen from headers.
    """
    # The keyword front of convert_checkpoint: its length is its arguments and their docs.
    return convert_checkpoint(
        src,
        dst,
        read=ReadOptions(
            select=select,
            ema=ema,
            trust=trust,
            allow_globals=tuple(allow_globals),
            variant=variant,
            adapters=AdapterOptions(
                drop_adapters=drop_adapters,
                lora_alpha=lora_alpha,
                adapter_config=None if adapter_config is None else str(adapter_config),
            ),
            names_from=None if names_from is None else str(names_from),
            workers=workers,
        ),
        keys=KeyRules(
            strip_wrappers,
            strip_module,
            tuple(strip_prefixes),
            add_module,
            tuple(add_prefixes),
            tuple(renames),
            None if match_to is None else str(match_to),
        ),
        output=OutputOptions(
            to, dtype, tuple(keep_dtype), allow_overflow, max_shard_size, keep_tied_copies
        ),
        dry_run=dry_run,
        force=force,
        verify=verify,
        progress=progress,
        part=part,
    )


def merge_adapters(
    base: str | Path,
    adapters: Iterable[str | Path | tuple[str | Path, float]],
    dst: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: int | str | None = None,
    force: bool = False,
    verify: bool = True,
    check_outputs: bool = False,
    progress: bool = False,
) -> ConvertReport:
    """Merge LoRA adapters into a base model, one tensor at a time, and write the result.

    Args:
        base: the base model (a file, or a Hugging Face folder, which gives a folder ``dst``
            with its config and tokenizer files).
        adapters: PEFT adapter folders or kohya LoRA files, merged in order: ``PATH``,
            ``"PATH:WEIGHT"`` or ``(PATH, WEIGHT)``.
        dst: the output file, or a new folder for a folder base.
        dtype: cast the output (``bf16``, ``fp16``, ``fp32``); by default the base's dtypes.
        max_shard_size: shard the output (default: as the base folder was sharded).
        force: replace an existing ``dst``.
        verify: read the output back: merged tensors against a fresh merge from the files,
            the others bit-exact.
        check_outputs: run each merged layer and its unmerged form on seeded inputs.
        progress: show a progress bar on stderr.

    Returns:
        The report, with each merged tensor's relative change (and the output check).
    """
    return convert_checkpoint(
        base,
        dst,
        read=ReadOptions(adapters=adapter_options(None, adapters)),
        output=OutputOptions(dtype=dtype, max_shard_size=max_shard_size),
        force=force,
        verify=verify,
        check_outputs=check_outputs,
        progress=progress,
    )


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    read: ReadOptions | None = None,
    keys: KeyRules | None = None,
    output: OutputOptions | None = None,
    dry_run: bool = False,
    force: bool = False,
    verify: bool = True,
    check_outputs: bool = False,
    progress: bool = False,
    part: Part | str | None = None,
) -> ConvertReport:
    """:func:`convert` with its options grouped, as the CLI gives them: plan, write, report.
    A ``dst`` URL is written through a local staging folder (see ``storage/upload.py``);
    ``part`` writes one share of a sharded output's shards (see ``ckptkit.spread``)."""
    read, keys, output = read or ReadOptions(), keys or KeyRules(), output or OutputOptions()
    options = {
        "part": parse_part(part) if isinstance(part, str) else part,
        "read": read,
        "keys": keys,
        "output": output,
        "dry_run": dry_run,
        "force": force,
        "verify": verify,
        "check_outputs": check_outputs,
        "progress": progress,
    }
    if _whole_pipeline(src, dst, read, part):
        return _convert_pipeline(src, dst, options)
    if not is_url(str(dst)):
        return _convert(src, Path(dst), None, **options)  # type: ignore[arg-type]
    url = RemotePath(str(dst))
    if output.to == "dcp":
        return _convert_to_url_dcp(src, url, options)
    if not url.suffix:  # a folder: "s3://b/model/" (into it) or a model folder "s3://b/model"
        return _convert_to_url_folder(src, url, str(dst).endswith("/"), options)
    if url.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise UsageError(
            f"{url}: an output at a URL is a .safetensors or .pt file (shards and their index "
            "beside it with --max-shard-size), or a folder",
            "name the file, e.g. s3://bucket/run/model.safetensors",
        )
    with staging_folder() as stage, _named_at(url.parent, stage):
        uploads = Uploads(url.parent, force=force)
        report = _convert(src, stage / url.name, uploads, **options)  # type: ignore[arg-type]
    report.destination = str(url)
    report.files = [str(url.parent / Path(name).name) for name in report.files]
    if force and not dry_run and options["part"] is None:
        _remove_stale_there(url, report.files)
    return report


def _whole_pipeline(
    src: str | Path, dst: str | Path, read: ReadOptions, part: Part | str | None
) -> bool:
    """A local diffusers pipeline folder, converted whole into a folder (no component selected,
    nothing merged, not an EMAModel's weights, not a share of the shards). Into a file, the
    pipeline's error asks which component."""
    from ckptkit.formats.folders.diffusers import is_pipeline

    plain = read.select is None and not read.ema and read.names_from is None
    into_file = Path(str(dst)).suffix.lower() in WEIGHT_SUFFIXES
    merges_only = replace(read.adapters, adapters=()) == AdapterOptions()  # kohya LoRAs merged
    return (
        plain
        and not into_file
        and merges_only
        and part is None
        and not is_url(str(src))  # a pipeline at a URL: one component with --select
        and is_pipeline(Path(src))
    )


def _convert_pipeline(src: str | Path, dst: str | Path, options: dict[str, Any]) -> ConvertReport:
    """``convert PIPELINE OUT``: every component, into a pipeline folder (pipeline_convert.py)."""
    from ckptkit.pipeline_convert import convert_pipeline

    if is_url(str(dst)):
        raise UsageError(
            f"{src} is a diffusers pipeline: converted whole, it is written to a local folder",
            "give a local folder, or take one component with --select NAME",
            api_hint="give a local folder, or take one component with select=",
        )
    if options["check_outputs"]:
        raise UsageError(
            "--check-outputs checks the merge of one model",
            "take one component with --select NAME",
            api_hint="take one component with select=",
        )
    del options["part"], options["check_outputs"]
    return convert_pipeline(as_path(src), Path(dst), **options)


def _remove_stale_there(url: RemotePath, written: list[str]) -> None:
    """``--force`` at a URL, as on disk: an earlier conversion's shards and index beside the
    output that this one did not write (a model now in 3 shards, not 8) are deleted."""
    stale = stale_names(url.name, [Path(f).name for f in written], url.parent.names() or [])
    Uploads(url.parent, force=True).remove(stale)


@contextlib.contextmanager
def _named_at(url: RemotePath, stage: Path) -> Iterator[None]:
    """Errors name the output at its URL, not in the staging folder it was made in."""
    try:
        yield
    except CkptkitError as exc:
        exc.message = exc.message.replace(str(stage), str(url))
        exc.args = (exc.message,)
        raise


DCP_FILES = (DISTCP, SIDECAR, METADATA)  # what a DCP output holds, in the order it goes up
# What --force replaces in a DCP folder: a save's files (any rank's data files), never the rest.
_DCP_NAMES = re.compile(r"\.metadata|ckptkit\.json|__\d+_\d+\.distcp")


def _is_dcp_file(name: str) -> bool:
    return _DCP_NAMES.fullmatch(name) is not None


def _convert_to_url_dcp(src: str | Path, url: RemotePath, options: dict[str, Any]) -> ConvertReport:
    """A DCP folder at a URL, as ``dcp.save`` lays one out: its chunks' file uploaded as it is
    written, then ``ckptkit.json``, then ``.metadata`` (a reader finds the save by it), made
    visible together. A folder that holds anything needs ``--force``, which then removes the
    DCP files this save did not write (another save's rank files), and nothing else."""
    if options["part"] is not None:
        raise UsageError(f"{url}: --part writes shards of a safetensors or .pt output")
    earlier = url.names() or []
    if earlier and not options["force"] and not options["dry_run"]:
        raise OutputError(f"output {url} exists", "pass --force to replace it")
    uploads = Uploads(url, force=True)
    with staging_folder() as stage, _named_at(url.parent, stage):
        report = _convert(src, stage / url.name, uploads, **options)
    report.destination = str(url)
    report.files = [str(url / name) for name in DCP_FILES]
    if not options["dry_run"]:
        uploads.remove({name for name in earlier if _is_dcp_file(name)} - set(DCP_FILES))
    return report


def _convert_to_url_folder(
    src: str | Path, url: RemotePath, into: bool, options: dict[str, Any]
) -> ConvertReport:
    """A folder at a URL, as a local one: ``s3://b/model/`` (a trailing slash) is written into
    (``model.safetensors``, or shards and their index), ``s3://b/model`` is a model folder (the
    source's config and tokenizer files beside the weights, uploaded first). Each file is
    uploaded as it is written; all are made visible together, the index last."""
    if options["part"] is not None:
        raise UsageError(
            f"--part writes shards beside a file: name it, e.g. {url}/model.safetensors"
        )
    with staging_folder() as stage, _named_at(url.parent, stage):
        local = stage / url.name
        if into:
            local.mkdir()
        report = _convert(src, local, Uploads(url, force=options["force"]), **options)
    return _named_at_url(report, local, url, options)


def _named_at_url(
    report: ConvertReport, local: Path, url: RemotePath, options: dict[str, Any]
) -> ConvertReport:
    """A folder output's report named as a local folder output is: its weights file (or the
    folder), at the URL; with ``--force``, an earlier output's shards it did not write
    removed there, as on disk."""
    report.destination = report.destination.replace(str(local), str(url))
    report.files = [f"{url}/{Path(name).relative_to(local).as_posix()}" for name in report.files]
    if options["force"] and not options["dry_run"] and report.files:
        _remove_stale_there(RemotePath(report.files[0]), report.files)
    return report


def _convert(
    src: str | Path,
    dst: Path,
    uploads: Uploads | None,
    *,
    read: ReadOptions,
    keys: KeyRules,
    output: OutputOptions,
    dry_run: bool,
    force: bool,
    verify: bool,
    check_outputs: bool,
    progress: bool,
    part: Part | None,
) -> ConvertReport:
    """The conversion itself; ``uploads``: the outputs go to a URL once written in ``dst``'s
    (local, staging) folder; ``part``: only that share of the shards (and the index, for
    rank 0 of a launched run, once every rank has written its own)."""
    src = as_path(src)
    into = dst if dst.is_dir() and output.to != "dcp" else None
    if into is not None:  # a model folder: save_pretrained's names (the source's, once open)
        dst = into / "model.safetensors"
    # A new name without a suffix: a model folder, when the source is one (checked once open).
    folder = dst if not dst.suffix and output.to is None and not dst.exists() else None
    fmt = "safetensors" if folder else output_format(dst, output.to)
    keys = replace(keys, renames=tuple(keys.rename_rules()))  # a bad rule fails before reading
    target, shard_limit = _cast_target(output.dtype), _shard_limit(output, fmt)
    with open_merged(src, read.adapters, read) as source:
        _refuse_unconvertible(source, src, check_outputs)
        if folder is not None:
            if source.folder is None:
                output_format(dst)  # the error that names the suffixes
            dst = folder / _weights_name(source)
        elif into is not None:
            dst = into / _weights_name(source)
            if source.folder is not None and fmt == "safetensors":
                folder = into  # a model folder written into one: its config files too
        plan = _plan(source, src, dst, fmt, keys, output, target, shard_limit, folder)
        if folder is not None and folder is into:
            plan.into = True
            plan.copies = _copies_into(plan, force)
        report = _report(source, plan, dry_run)
        whole = plan
        if part is not None:
            plan = _part_of(plan, part)
            index = [str(whole.outputs[-1])] if part.launched and part.index == 0 else []
            report.files = [str(p) for p in plan.outputs] + index
            report.part = str(part)
        if dry_run:
            return report
        header = _metadata(source, report).to_header()
        if plan.ties == "once":  # as safetensors.torch.save_model records a removed name
            header.update({k: v for k, v in plan.aliases.items() if k not in header})
        with _parent_folders(folder or dst):  # made as train --out makes its folder

            def write() -> None:
                if folder is not None and not plan.into:
                    check_folder_output(folder, force=force, inputs=[src])
                # Under torchrun rank 0 writes the index too: every rank checks it now, so
                # that an existing one stops them all before any shard is written.
                index = [whole.outputs[-1]] if part and part.launched else []
                for path in [] if folder and not plan.into else plan.outputs + index:
                    check = check_folder_output if fmt == "dcp" else check_output
                    check(path, force=force, inputs=[src])
                if uploads is not None:  # a DCP folder's files, or each output file
                    names = [p.name for p in plan.outputs + index + plan.copies]
                    uploads.check(list(DCP_FILES) if fmt == "dcp" else names)
                _write(
                    source,
                    plan,
                    report,
                    header,
                    force=force,
                    verify=verify,
                    progress=progress,
                    workers=read.workers,
                    uploads=uploads,
                )

            if part is not None and part.launched:
                _write_agreed(write, whole, part, header, force, uploads)
            else:
                write()
        _merge_report(source, report, check_outputs)
        if (folder is not None and not plan.into) or uploads is not None or part is not None:
            return report
        if force and fmt == "safetensors":
            for path in stale_shards(dst, plan.outputs, dst.parent.iterdir()):
                if path.is_file():
                    path.unlink()
    return report


def _refuse_unconvertible(source: Source, src: Path, check_outputs: bool) -> None:
    """Refuse, before planning, a source there is nothing to convert from (GGUF, no tensors)
    and ``--check-outputs`` where nothing is merged."""
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
    if check_outputs and not _is_merge(source):
        raise UsageError("--check-outputs checks merged adapters", "merge one, or drop it")


def _part_of(plan: _Plan, part: Part) -> _Plan:
    """The share of a sharded output's shards that ``part`` writes (no index: see
    :func:`_write_agreed` and ``ckptkit.spread.finish``)."""
    if plan.folder is not None or plan.fmt != "safetensors" or len(plan.shards) < 2:
        raise UsageError(
            f"--part {part} spreads the shards of a sharded safetensors file, and {plan.dst} "
            f"would be {'one file' if len(plan.shards) < 2 else 'a folder'}",
            "give DST a .safetensors name and --max-shard-size (smaller than the model)",
        )
    mine = part.shards(len(plan.shards))
    return replace(
        plan, shards=[plan.shards[i] for i in mine], outputs=[plan.outputs[i] for i in mine]
    )


def _write_agreed(
    write: Callable[[], None],
    whole: _Plan,
    part: Part,
    header: dict[str, str],
    force: bool,
    uploads: Uploads | None,
) -> None:
    """Under torchrun: this rank's shards, then, once every rank says its own are written and
    verified, the index by rank 0. A rank that failed makes every rank fail: no index."""
    try:
        write()
    except BaseException:
        all_succeeded(False)
        raise
    if not all_succeeded(True):
        raise OutputError(
            f"another rank failed to write its shards of {whole.dst}; no index was written",
            "see that rank's error, then run it again",
        )
    if part.index != 0:
        return
    if uploads is None:  # every rank's shards where the index will name them (a shared disk)
        missing = [p.name for p in whole.outputs[:-1] if not p.is_file()]
        if missing:
            raise OutputError(
                f"{len(missing)} shards of {whole.dst} are not in {whole.dst.parent} "
                f"({', '.join(missing[:3])}): the ranks wrote to different disks; no index",
                "write to a folder every node shares, or to a URL",
            )
    sizes = [[(i.spec.key, i.spec.nbytes) for i in s] for s in whole.shards]
    text = index_document(sizes, [p.name for p in whole.outputs[:-1]], header)
    index = whole.outputs[-1]
    if uploads is not None:
        index.write_text(text)
        with uploads:
            uploads.add(index, index.name)
            uploads.commit()
        return
    with atomic_outputs([index], force=force) as (tmp,):
        tmp.write_text(text)


@dataclass
class _Plan:
    """What a conversion will write, computed from headers alone."""

    src: Path
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
    copies: list[Path] = field(default_factory=list)  # the source folder's config, tokenizer...
    into: bool = False  # the model folder exists: its files are replaced one by one


def _plan(
    source: Source,
    src: Path,
    dst: Path,
    fmt: str,
    keys: KeyRules,
    output: OutputOptions,
    target: str | None,
    shard_limit: int | None,
    folder: Path | None = None,
) -> _Plan:
    entries = dict(source.entries())
    _refuse_special(src, entries, fmt)
    key_plan = keys.plan(entries)
    if fmt != "torch":  # a JSON header (safetensors, DCP's metadata) holds UTF-8 text only
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
    match = _match_reference(key_plan, entries, Path(keys.match_to)) if keys.match_to else None
    items = []
    for old, new in key_plan.mapping.items():
        if new is not None:
            info = entries[old]
            spec = TensorSpec(new, _item_dtype(info, new, target, output), info.shape)
            items.append(Item(old, spec, info.dtype))
    if fmt == "safetensors":
        # Widest dtypes first, so every tensor's data stays aligned for memory mapping.
        items.sort(key=lambda item: -DTYPES[item.spec.dtype].itemsize)
    aliases = {
        new_a: new_b
        for a, b in source.aliases().items()
        if (new_a := key_plan.mapping.get(a)) and (new_b := key_plan.mapping.get(b))
    }
    ties = {"torch": "shared", "dcp": "chunk"}.get(fmt) or (
        "copies" if output.keep_tied_copies else "once"
    )
    if ties == "once":  # one tensor per tied group, the others named in the metadata
        aliases = plan_ties(aliases)
        items = [item for item in items if item.spec.key not in aliases]
    by_key = {item.spec.key: item for item in items}
    units = [(i.spec.key, i.spec.nbytes, aliases.get(i.spec.key, i.spec.key)) for i in items]
    shards = [[by_key[k] for k in shard] for shard in plan_shards(units, shard_limit)]
    if folder is not None and shard_limit is None and source.folder is not None:
        shards = _shards_as_in(source, items) or shards
    return _Plan(
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
        copies=folder_files(source.folder) if folder is not None and source.folder else [],
    )


def _copies_into(plan: _Plan, force: bool) -> list[Path]:
    """The source folder's config files to write into an existing folder: those it lacks or
    holds otherwise (which need ``--force``); one it holds as they are is left alone."""
    assert plan.folder is not None
    copies = []
    for path in plan.copies:
        there = plan.folder / path.name
        if there.is_file() and not isinstance(path, RemotePath):
            if (
                there.stat().st_size == path.stat().st_size
                and there.read_bytes() == path.read_bytes()
            ):
                continue
        copies.append(path)
    return copies


def _weights_name(source: Source) -> str:
    """The weights file name of a folder output: the source library's (diffusers'
    ``diffusion_pytorch_model.safetensors``), else transformers' ``model.safetensors``."""
    base = getattr(source, "base", None)  # a merge: its base's
    return source.weights_name or getattr(base, "weights_name", None) or "model.safetensors"


def _shards_as_in(source: Source, items: list[Item]) -> list[list[Item]] | None:
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


def _report(source: Source, plan: _Plan, dry_run: bool) -> ConvertReport:
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
    return report


def _write(
    source: Source,
    plan: _Plan,
    report: ConvertReport,
    header: dict[str, str],
    *,
    force: bool,
    verify: bool,
    progress: bool,
    workers: int = 8,
    uploads: Uploads | None = None,
) -> None:
    """Write every output to a temp path, verify it, and only then put them all in place (or,
    with ``uploads``, upload each as it is done and make them all visible at the end)."""
    # The bar counts the output's bytes: with verify, a tensor counts half when it is written and
    # half when it is checked, so the bar neither stalls at the end nor counts past the size.
    bar = progress_bar(report.nbytes, "convert") if progress else None
    share = 0.5 if verify else 1.0
    copier = Copier(
        source,
        progress=lambda nbytes: bar.update(nbytes * share) if bar else None,
        workers=workers,
    )
    writer = writer_for(
        plan.fmt,
        copier,
        aliases=plan.aliases,
        header=header,
        special=plan.special,
        verify=verify,
        reserve=uploads is None or not uploads.deferred,  # one uploaded as written: never whole
    )
    inputs = [plan.src]
    try:
        if writer.folder and uploads is not None:  # a DCP folder at a URL
            tmp = plan.outputs[0]
            tmp.mkdir()
            with uploads:
                begin = _streamer(uploads, copier, verify)
                if begin is not None:
                    begin(tmp / DCP_FILES[0], DCP_FILES[0])
                _write_shard(writer, copier, tmp, plan.shards[0], plan.outputs[0], plan, verify)
                copier.forget(tmp / DCP_FILES[0])
                for name in DCP_FILES:  # .metadata last: a reader finds the save by it
                    uploads.add(tmp / name, name)
                uploads.commit(entry_first=True)
        elif writer.folder:
            with atomic_folder(
                plan.outputs[0], force=force, inputs=inputs, owns=_is_dcp_file, entry=METADATA
            ) as tmp:
                _write_shard(writer, copier, tmp, plan.shards[0], plan.outputs[0], plan, verify)
        elif uploads is not None:  # uploaded as written, visible all at once
            with uploads:
                if plan.folder is not None:  # a model folder: its config files too, first
                    plan.folder.mkdir(exist_ok=plan.into)
                    for path in plan.copies:
                        _copy_file(path, plan.folder / path.name)
                        uploads.add(plan.folder / path.name, path.name)
                    report.copied_files = [path.name for path in plan.copies]
                begin = _streamer(uploads, copier, verify)
                _write_files(writer, copier, plan, plan.outputs, header, verify, uploads.add, begin)
                uploads.commit(entry_first=True)
        elif plan.into:  # a model folder written into one: its files appear together
            assert plan.folder is not None
            copies = [plan.folder / path.name for path in plan.copies]
            with atomic_outputs(copies + plan.outputs, force=force, inputs=inputs) as temps:
                for path, tmp in zip(plan.copies, temps, strict=False):
                    _copy_file(path, tmp)
                _write_files(writer, copier, plan, temps[len(copies) :], header, verify)
            report.copied_files = [path.name for path in plan.copies]
        elif plan.folder is not None:  # a model folder appears whole, or not at all
            with atomic_folder(plan.folder, force=force, inputs=inputs) as tmp:
                _write_files(
                    writer, copier, plan, [tmp / p.name for p in plan.outputs], header, verify
                )
                for path in plan.copies:
                    _copy_file(path, tmp / path.name)
                report.copied_files = [path.name for path in plan.copies]
        else:
            # In order, or none: the index (last) appears only once every shard is in place.
            with atomic_outputs(plan.outputs, force=force, inputs=inputs) as temps:
                _write_files(writer, copier, plan, temps, header, verify)
        report.verified = verify
        report.copied, report.through_torch = copier.copied, copier.through_torch
        report.overflowed = list(copier.overflowed)
    finally:
        copier.close()
        if bar:
            bar.close()


def _copy_file(path: Path, dst: Path) -> None:
    """A model folder's small file (config.json...) copied beside the weights, from a local
    folder or one at a URL."""
    if isinstance(path, RemotePath):
        dst.write_bytes(path.read_bytes())
    else:
        shutil.copyfile(path, dst)


def _write_files(
    writer: Writer,
    copier: Copier,
    plan: _Plan,
    temps: list[Path],
    header: dict[str, str],
    verify: bool,
    done: Callable[[Path, str], None] = lambda path, name: None,
    begin: Callable[[Path, str], None] | None = None,
) -> None:
    """Each shard to its temp path, then the index of a sharded output; ``begin(temp, name)``
    before a shard is written, ``done(temp, name)`` after each file is written and verified."""
    for shard, tmp, path in zip(plan.shards, temps, plan.outputs, strict=False):
        if begin is not None:
            begin(tmp, path.name)
        _write_shard(writer, copier, tmp, shard, path, plan, verify)
        copier.forget(tmp)  # every range checked (a streamed file's parts handed over)
        done(tmp, path.name)
    if len(plan.outputs) > len(plan.shards):  # the index of a sharded output
        sizes = [[(i.spec.key, i.spec.nbytes) for i in s] for s in plan.shards]
        names = [p.name for p in plan.outputs[:-1]]
        temps[-1].write_text(index_document(sizes, names, header))
        done(temps[-1], plan.outputs[-1].name)


def _streamer(uploads: Uploads, copier: Copier, verify: bool) -> Callable[[Path, str], None] | None:
    """``begin(temp, name)``: each output file is uploaded while it is written (see
    ``io/upload.py``); None where the store cannot defer a commit (then each goes up whole).
    Tensors made through torch are then checked by the CRC-32 of the bytes written, since
    their bytes have left the disk when the writer's check comes."""
    if not uploads.deferred:
        return None
    copier.crc_made, copier.batch_bytes = verify, PART  # the disk holds a few parts

    def begin(tmp: Path, name: str) -> None:
        stream = uploads.stream(tmp, name)
        # The copier's descriptor of the file (opened when its first range is written).
        copier.on_settled = lambda fd, start, end: (
            stream.settled(start, end) if fd == copier.fd(tmp) else None
        )

    return begin


def _is_merge(source: Source) -> bool:
    from ckptkit.adapters.merged import MergedSource

    return isinstance(source, MergedSource)


def _merge_report(source: Source, report: ConvertReport, check_outputs: bool) -> None:
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


def _write_shard(
    writer: Writer,
    copier: Copier,
    tmp: Path,
    items: list[Item],
    shown: Path,
    plan: _Plan,
    verify: bool,
) -> None:
    writer.write(tmp, items)
    if copier.overflowed and not plan.allow_overflow:
        names = ", ".join(copier.overflowed[:5])
        raise CastError(
            f"the cast turns finite values into inf in {names}; nothing was written",
            "keep them with --keep-dtype GLOB, or pass --allow-overflow",
        )
    if verify:
        writer.verify(tmp, items, shown)


def _refuse_special(src: Path, entries: dict[str, TensorInfo], fmt: str) -> None:
    """Refuse, naming the key, what the output cannot hold as it is: a placeholder or a meta
    tensor is never written as weights; sparse and quantized tensors and packed parameters go
    only to ``.pt`` output, which keeps them (safetensors stores dense tensors only)."""
    for key, info in entries.items():
        if info.kind == "dense" or (info.kind in KEPT_IN_TORCH and fmt == "torch"):
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


@contextlib.contextmanager
def _parent_folders(dst: Path) -> Iterator[None]:
    """Create the missing folders above ``dst``; remove them again if the body fails, so a
    failed conversion leaves nothing behind."""
    made = []  # by this process: another (a --part job, a torchrun rank) may make one too
    for folder in [p for p in dst.parents if not p.exists()][::-1]:  # outermost first
        try:
            folder.mkdir()
            made.append(folder)
        except FileExistsError:
            continue
        except OSError as exc:
            raise OutputError(f"cannot create folder {folder}: {exc.strerror}") from exc
    try:
        yield
    except BaseException:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty: never anything that was written there
        raise


def _item_dtype(info: TensorInfo, key: str, target: str | None, output: OutputOptions) -> str:
    """The dtype an output tensor is written in: dense ones may be cast; others stay as they
    are (sparse, quantized, packed parameters)."""
    if info.kind != "dense":
        return info.dtype
    return _out_dtype(info.dtype, key, target, list(output.keep_dtype))


def _shard_limit(output: OutputOptions, fmt: str) -> int | None:
    if output.max_shard_size is None:
        return None
    limit = parse_size(output.max_shard_size)
    if fmt != "safetensors":
        raise UsageError("--max-shard-size writes safetensors shards", "give a .safetensors DST")
    return limit
