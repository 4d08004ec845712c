"""One model's conversion: its destination picked, its source opened, the plan made, written,
reported. The output goes wherever ``dst`` names (a local path, or a URL through a staging
folder): this module writes through one :class:`~ckptkit.storage.destination.Destination`
and does not ask which."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

from ckptkit.adapters import AdapterOptions, open_merged
from ckptkit.conversion.options import Job, OutputOptions, ReadOptions
from ckptkit.conversion.plan import (
    Plan,
    cast_target,
    copies_into,
    documents_into,
    make_plan,
    part_of,
    per_rank,
    refuse_unconvertible,
    shard_limit,
    weights_name,
)
from ckptkit.conversion.report import (
    ConvertReport,
    make_report,
    merge_report,
    output_header,
    roundtrip_report,
)
from ckptkit.conversion.write import entry_of, outputs_of, parent_folders, write, write_agreed
from ckptkit.errors import UsageError
from ckptkit.formats.base.source import Source
from ckptkit.formats.folders.megatron import LATEST
from ckptkit.formats.folders.megatron_dist import MegatronDist
from ckptkit.formats.folders.megatron_ranks import MegatronRanks, parallel_sizes
from ckptkit.formats.output import output_format
from ckptkit.formats.output.plan import stale_names
from ckptkit.formats.output.writers import OUTPUT_FORMATS, TO_FORMATS, writer_class
from ckptkit.mapping.source import MappedSource, open_mapped
from ckptkit.spread import Part
from ckptkit.storage.destination import Destination, destination
from ckptkit.storage.location import Location, location

__all__ = ["convert_model"]


def convert_model(src: str | Path, dst: str | Path, job: Job) -> ConvertReport:
    """Convert one model (not a whole pipeline: see ``ckptkit.convert``) to ``dst``, a local
    path or a URL; ``part``: only that share of the shards (and the index, for rank 0 of a
    launched run, once every rank has written its own)."""
    source_path = location(src)
    whole = _saved_whole(job.output)
    target = destination(
        dst, force=job.force, inputs=[source_path], whole=whole, parts=job.part is not None
    )
    with target.planned() as planned:
        report = _convert(source_path, planned, target, job)
    # The report names the outputs where they went.
    report.destination = target.shown(Path(report.destination))
    kind = writer_class(report.output_format)
    if kind.folder:
        report.files = target.show_folder(Path(report.files[0]), kind.files)
    else:
        report.files = [target.shown(Path(name)) for name in report.files]
    return report


def _saved_whole(output: OutputOptions) -> bool:
    """Whether ``--to`` names a folder format (DCP), which is saved whole."""
    fmt = TO_FORMATS.get(output.to or "")
    return fmt is not None and writer_class(fmt).folder


def _convert(src: Location, dst: Path, target: Destination, job: Job) -> ConvertReport:
    """The conversion at the local path ``dst`` (the output itself, or its staged copy)."""
    read, output, part = job.read, job.output, job.part
    megatron = output.to in ("megatron", "megatron-dist")
    shared = part is not None and output.to == "megatron"  # the parts' one folder
    if megatron and dst.exists() and not (shared and dst.is_dir()):
        raise UsageError(
            f"{dst} exists: a Megatron save is written as a new folder (its tracker and "
            "iteration folder inside), and ckptkit replaces none, even with --force",
            "give a new folder's name, or remove that one first",
        )
    if megatron and dst.suffix.lower() in OUTPUT_FORMATS:
        raise UsageError(
            f"{dst} is a file's name, and a Megatron save is a folder",
            "give a folder's name, without a suffix",
        )
    into = dst if dst.is_dir() and not _saved_whole(output) and not megatron else None
    if into is not None:  # a model folder: save_pretrained's names (the source's, once open)
        dst = into / "model.safetensors"
    # A new name without a suffix: a model folder, when the source is one (checked once open).
    folder = dst if not dst.suffix and output.to is None and not dst.exists() else None
    fmt = "safetensors" if folder else output_format(dst, output.to)
    keys = replace(job.keys, renames=tuple(job.keys.rename_rules()))  # a bad rule fails first
    dtype, limit = cast_target(output.dtype), shard_limit(output, fmt)
    with _opened(src, read) as opened, _cut(opened, output) as source:
        refuse_unconvertible(source, src, job.check_outputs)
        ranks = source.rank_files if isinstance(source, (MappedSource, MegatronRanks)) else None
        if ranks is not None:  # saved one file per rank (a mapping's target, Megatron's)
            folder = _rank_folder(dst, into, ranks, output)
            dst, fmt = folder / ranks[0], output_format(Path(ranks[0]))
            if isinstance(source, MegatronRanks):
                fmt = "megatron"
        elif isinstance(source, MegatronDist):  # the run folder: the iteration's DCP folder
            dst = dst / source.folder_name
        else:
            dst, folder = _placed(source, dst, fmt, into, folder)
        plan = make_plan(source, src, dst, fmt, keys, output, dtype, limit, folder)
        if ranks is not None:
            assert isinstance(source, (MappedSource, MegatronRanks)) and folder is not None
            plan = per_rank(plan, source, folder)
        if folder is not None and folder is into:
            plan.into = True
            plan.copies = copies_into(plan, job.force)
            plan.documents = documents_into(plan)
        report = make_report(source, plan, job.dry_run)
        if isinstance(source, (MegatronRanks, MegatronDist)):
            report.megatron = source.describe()
        whole = plan
        if part is not None:
            plan = part_of(plan, part)
            last = str(entry_of(whole, {})[0])
            index = [last] if part.launched and part.index == 0 else []
            report.files = [str(p) for p in plan.outputs] + index
            report.part = str(part)
        if job.dry_run:
            return report
        header = output_header(source, report, plan)
        with parent_folders(folder or dst):  # made as train --out makes its folder
            _write_checked(
                source, plan, whole, report, header, target, read, job.verify, job.progress, part
            )
        if isinstance(source, MegatronDist):  # the tracker last, as Megatron writes it
            tracker = dst.parent / LATEST
            with target.files([tracker]) as files:
                files.path(tracker).write_text(source.tracker, encoding="ascii")
                files.done(tracker)
            report.made_files = [LATEST]
        merge_report(source, report, job.check_outputs)
        roundtrip_report(source, report)
        if job.force and part is None and not writer_class(fmt).folder:
            written = [path.name for path in plan.outputs]
            target.remove_stale(plan.dst, lambda present: stale_names(dst.name, written, present))
    return report


def _opened(src: Location, read: ReadOptions) -> AbstractContextManager[Source]:
    """The source, read through a mapping (``--map``) or with adapters merged into it."""
    if read.mapping is None:
        return open_merged(src, read.adapters, read)
    if read.adapters != AdapterOptions():
        raise UsageError(
            "--map and adapters (--base, --adapter, --drop-adapters) do not go together",
            "merge the adapter first, then map the merged checkpoint",
        )
    return open_mapped(src, read.mapping, read)


@contextlib.contextmanager
def _cut(source: Source, output: OutputOptions) -> Iterator[Source]:
    """The source, cut into a legacy Megatron save's rank files for ``--to megatron``, or
    stacked as a torch_dist save's tensors for ``--to megatron-dist``."""
    sizes = (
        output.tensor_parallel,
        output.pipeline_parallel,
        output.expert_parallel,
        output.virtual_stages,
    )
    if output.to != "megatron" and any(size is not None for size in sizes):
        raise UsageError(
            "--tp, --pp, --ep and --vpp say how a legacy Megatron save is cut across ranks "
            "(a torch_dist save holds whole tensors, which any run loads its slices of)",
            "add --to megatron, or leave them out",
        )
    if output.to not in ("megatron", "megatron-dist"):
        yield source
        return
    # torch_dist is parallelism-free: any run loads its own slices of it.
    cut: Source
    if output.to == "megatron-dist":
        cut = MegatronDist(source)
    else:
        cut = MegatronRanks(source, *parallel_sizes(*sizes))
    try:
        yield cut
    finally:
        cut.close()


def _rank_folder(dst: Path, into: Path | None, ranks: list[str], output: OutputOptions) -> Path:
    """The folder a target saved per rank goes to: DST itself, new or existing (a Megatron
    save: new, its iteration folders and tracker its own)."""
    if output.to == "megatron":  # a new folder (checked before the source was opened)
        return dst
    if output.to is not None or output.max_shard_size is not None:
        raise UsageError(
            f"the mapping's target is {len(ranks)} file(s) named like {ranks[0]}, one per rank: "
            "--to and --max-shard-size do not apply",
            "leave them out",
        )
    if into is not None:
        return into
    if dst.suffix:
        raise UsageError(
            f"{dst}: the mapping's target is a folder of {ranks[0]}... (one file per rank)",
            "give a folder name as DST",
        )
    return dst


def _placed(
    source: Source, dst: Path, fmt: str, into: Path | None, folder: Path | None
) -> tuple[Path, Path | None]:
    """The weights file's path in a model folder output (named as the source library names
    it), and the model folder, if the output is one."""
    beside = source.folder or source.config_folder  # the model folder whose files go along
    if folder is not None:
        if beside is None and not source.documents:
            output_format(dst)  # the error that names the suffixes
        return folder / weights_name(source), folder
    if into is not None:
        dst = into / weights_name(source)
        made = beside is not None or source.documents
        if made and writer_class(fmt).model_folder:
            return dst, into  # a model folder written into one: its config files too
    return dst, None


def _write_checked(
    source: Source,
    plan: Plan,
    whole: Plan,
    report: ConvertReport,
    header: dict[str, str],
    target: Destination,
    read: ReadOptions,
    verify: bool,
    progress: bool,
    part: Part | None,
) -> None:
    """The outputs checked (none may exist without ``force``), then written; under torchrun,
    every rank's shards before rank 0's index."""

    def checked_write() -> None:
        # Under torchrun rank 0 writes the index too: every rank checks it now, so that an
        # existing one stops them all before any shard is written.
        index = [entry_of(whole, header)[0]] if part and part.launched else []
        committed, folder = outputs_of(plan)
        if writer_class(plan.fmt).spreads_in_folder and plan.into:
            for out in plan.outputs:  # a part's rank files, each in its rank folder
                out.parent.mkdir(parents=True, exist_ok=True)
        if writer_class(plan.fmt).folder:
            target.check(committed, folder=folder)
        else:
            copies = committed[: len(committed) - len(plan.outputs)]
            target.check(plan.outputs + index + copies, folder=folder)
        write(
            source,
            plan,
            report,
            header,
            target,
            verify=verify,
            progress=progress,
            workers=read.workers,
        )

    if part is not None and part.launched:
        write_agreed(checked_write, whole, part, header, target)
    else:
        checked_write()
