"""A plan written through a :class:`~ckptkit.storage.destination.Destination`, in one loop.

Whatever the output (a file, shards and their index, a model folder with its config files, a
DCP folder; on a local disk or at a URL), its files are written one after another to the paths
the destination gives, each read back and compared with the plan by its format's writer, handed
to the destination once it compared equal, and committed together, in order, at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from ckptkit.conversion.plan import Plan
from ckptkit.conversion.report import ConvertReport
from ckptkit.errors import CastError, OutputError
from ckptkit.formats.base.source import Source
from ckptkit.formats.output.copier import Copier, Item
from ckptkit.formats.output.plan import index_document
from ckptkit.formats.output.writers import Writer, writer_class, writer_for
from ckptkit.progress import progress_bar
from ckptkit.spread import Part, all_succeeded
from ckptkit.storage.destination import Destination, Files
from ckptkit.storage.location import Location

__all__ = ["outputs_of", "write", "write_agreed", "parent_folders"]


def outputs_of(plan: Plan) -> tuple[list[Path], Path | None]:
    """What the destination commits, in order, and the folder that appears whole (a folder
    format's, a new model folder's), if any."""
    kind = writer_class(plan.fmt)
    if kind.folder:
        return [plan.outputs[0] / name for name in kind.files], plan.outputs[0]
    copies = [plan.folder / path.name for path in plan.copies] if plan.folder else []
    made = [plan.folder / name for name in plan.documents] if plan.folder else []
    whole = plan.folder if plan.folder is not None and not plan.into else None
    return copies + made + plan.outputs, whole


def write(
    source: Source,
    plan: Plan,
    report: ConvertReport,
    header: dict[str, str],
    target: Destination,
    *,
    verify: bool,
    progress: bool,
    workers: int = 8,
) -> None:
    """Every output file written, verified and handed to ``target``, which commits them all
    (in order, the index last) or none."""
    # The bar counts the output's bytes: with verify, a tensor counts half when it is written and
    # half when it is checked, so the bar neither stalls at the end nor counts past the size.
    bar = progress_bar(report.nbytes, "convert") if progress else None
    share = 0.5 if verify else 1.0
    copier = Copier(
        source,
        progress=lambda nbytes: bar.update(nbytes * share) if bar else None,
        workers=workers,
    )
    outputs, whole = outputs_of(plan)
    kind = writer_class(plan.fmt)
    try:
        with target.files(outputs, folder=whole, owns=kind.owns if kind.folder else None) as files:
            if files.streaming is not None:  # the disk holds a few parts of a file
                # Tensors made through torch are then checked by the CRC-32 of the bytes
                # written, since their bytes have left the disk when the writer's check comes.
                copier.crc_made, copier.batch_bytes = verify, files.streaming
            if source.made_once:  # each source byte read once: made tensors checked by CRC
                copier.crc_made = verify
            writer = writer_for(
                plan.fmt,
                copier,
                aliases=plan.aliases,
                header=header,
                special=plan.special,
                verify=verify,
                reserve=files.streaming is None,  # a file uploaded as written is never whole
            )
            for path, out in zip(plan.copies, outputs, strict=False):  # a model folder's, first
                _copy_file(path, files.path(out))
                files.done(out)
            if plan.folder is not None:
                for name, text in plan.documents.items():  # a config a mapping made
                    files.path(plan.folder / name).write_text(text, encoding="utf-8")
                    files.done(plan.folder / name)
                report.copied_files = [path.name for path in plan.copies]
                report.made_files = list(plan.documents)
            _write_files(writer, copier, plan, header, files, verify)
        report.verified = verify
        report.copied, report.through_torch = copier.copied, copier.through_torch
        report.made = copier.made
        report.overflowed = list(copier.overflowed)
    finally:
        copier.close()
        if bar:
            bar.close()


def _write_files(
    writer: Writer, copier: Copier, plan: Plan, header: dict[str, str], files: Files, verify: bool
) -> None:
    """Each shard (a folder format: its one folder), then the index of a sharded output."""
    if writer.folder:
        folder = plan.outputs[0]
        tmp = files.path(folder)
        _begin(files, copier, folder / writer.files[0], tmp / writer.files[0])
        _write_shard(writer, copier, tmp, plan.shards[0], folder, plan, verify)
        copier.forget(tmp / writer.files[0])
        for name in writer.files:  # in the writer's order: the entry (.metadata) last
            files.done(folder / name)
        return
    for shard, out in zip(plan.shards, plan.outputs, strict=False):
        tmp = files.path(out)
        _begin(files, copier, out, tmp)
        _write_shard(writer, copier, tmp, shard, out, plan, verify)
        copier.forget(tmp)  # every range checked (a streamed file's parts handed over)
        files.done(out)
    if len(plan.outputs) > len(plan.shards):  # the index of a sharded output
        files.path(plan.outputs[-1]).write_text(_index(plan, header))
        files.done(plan.outputs[-1])


def _begin(files: Files, copier: Copier, out: Path, tmp: Path) -> None:
    """``out`` is sent out while it is written, where the destination can: each range of it
    the copier has written and checked is handed to the stream."""
    stream = files.stream(out)
    if stream is None:
        return
    # The copier's descriptor of the file (opened when its first range is written).
    copier.on_settled = lambda fd, start, end: (
        stream.settled(start, end) if fd == copier.fd(tmp) else None
    )


def _index(plan: Plan, header: dict[str, str]) -> str:
    sizes = [[(i.spec.key, i.spec.nbytes) for i in s] for s in plan.shards]
    return index_document(sizes, [p.name for p in plan.outputs[:-1]], header)


def _copy_file(path: Location, dst: Path) -> None:
    """A model folder's small file (config.json...) copied beside the weights, from a local
    folder or one at a URL (read whole: such files are small)."""
    dst.write_bytes(path.read_bytes())


def _write_shard(
    writer: Writer,
    copier: Copier,
    tmp: Path,
    items: list[Item],
    shown: Path,
    plan: Plan,
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


def entry_of(whole: Plan, header: dict[str, str]) -> tuple[Path, str]:
    """What a spread output's last file is, written once every part is done: a sharded
    output's index, or a legacy Megatron save's tracker."""
    if writer_class(whole.fmt).spreads_in_folder:
        assert whole.folder is not None
        name, text = next(iter(whole.documents.items()))
        return whole.folder / name, text
    return whole.outputs[-1], _index(whole, header)


def write_agreed(
    write: Callable[[], None],
    whole: Plan,
    part: Part,
    header: dict[str, str],
    target: Destination,
) -> None:
    """Under torchrun: this rank's shards, then, once every rank says its own are written and
    verified, the index (a Megatron save's tracker) by rank 0. A rank that failed makes every
    rank fail: no index."""
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
    # Every rank's shards where the index will name them (a shared disk).
    index, text = entry_of(whole, header)
    shards = whole.outputs if writer_class(whole.fmt).spreads_in_folder else whole.outputs[:-1]
    missing = target.missing(shards)
    if missing:
        raise OutputError(
            f"{len(missing)} shards of {whole.dst} are not in {whole.dst.parent} "
            f"({', '.join(missing[:3])}): the ranks wrote to different disks; no index",
            "write to a folder every node shares, or to a URL",
        )
    with target.files([index]) as files:
        files.path(index).write_text(text)
        files.done(index)


@contextlib.contextmanager
def parent_folders(dst: Path) -> Iterator[None]:
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
