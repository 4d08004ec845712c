"""``convert`` of a whole diffusers pipeline folder into another pipeline folder.

Each component that holds weights goes through convert's own machinery, a tensor at a time,
into a model folder of its own (safetensors, cast where asked, verified as any conversion is);
the components without weights (scheduler, tokenizer, feature extractor) and
``model_index.json`` are copied. The output is made in a temporary folder beside it, then
put in place: a new folder by one rename; an existing one (empty, or with ``--force``) gets
the pipeline's files, and only the weights files of the components written are replaced
(files of other names in it are left alone).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptkit.adapters import AdapterOptions, read_adapter
from ckptkit.conversion.options import Job
from ckptkit.conversion.report import ConvertReport
from ckptkit.conversion.run import convert_model
from ckptkit.errors import OutputError, SelectError, UsageError
from ckptkit.formats.folders.diffusers import (
    MODEL_INDEX,
    Component,
    is_weights_name,
    pipeline_components,
    read_model_index,
    variants_in,
)
from ckptkit.formats.folders.layouts import copied_beside_weights, folder_files
from ckptkit.keys import KeyPlan, KeyRules
from ckptkit.storage.atomic import check_folder_output

__all__ = ["PipelineReport", "ComponentResult", "convert_pipeline"]


@dataclass
class ComponentResult:
    """One component of a converted pipeline: its weights' conversion, or the files copied."""

    name: str
    library: str
    cls: str
    report: ConvertReport | None = None  # None: no weights, its files copied
    copied: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # not regular files (links, FIFOs...)
    followed: str | None = None  # the folder, where a link leads it out of the pipeline

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "library": self.library,
            "class": self.cls,
            "convert": self.report.to_dict() if self.report is not None else None,
            "copied": self.copied,
            "left_out": self.left_out,
            "followed": self.followed,
        }


@dataclass
class PipelineReport(ConvertReport):
    """A pipeline's conversion: each component's report, and the files copied."""

    pipeline: str = ""  # the pipeline's class (model_index.json's _class_name)
    components: list[ComponentResult] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # top-level links, not copied

    def lines(self) -> list[str]:
        from ckptkit.render import convert_lines, plural

        lines = [f"Pipeline {self.source} ({self.pipeline}) -> {self.destination}"]
        for c in self.components:
            if c.followed:
                lines.append(f"{c.name}: read from outside the pipeline: {c.followed}")
            if c.report is not None:
                lines.append(f"{c.name} ({c.cls}):")
                lines += [f"  {line}" for line in convert_lines(c.report)]
            elif c.copied:
                lines.append(f"{c.name} ({c.cls}): copied {plural(len(c.copied), 'file')}")
            if c.left_out:
                lines.append(
                    f"{c.name}: left out (links, special files, weights and pickles are not "
                    f"copied): {', '.join(c.left_out)}"
                )
        if self.left_out:
            lines.append(f"Left out {', '.join(self.left_out)} (links, not copied)")
        verb = "Would write" if self.dry_run else "Wrote   "
        lines.append(f"{verb} {', '.join(self.copied_files)}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "pipeline": self.pipeline,
            "components": [c.to_dict() for c in self.components],
            "left_out": self.left_out,
        }


def is_default_keys(keys: KeyRules) -> bool:
    return keys == KeyRules()


def convert_pipeline(src: Path, dst: Path, job: Job) -> PipelineReport:
    """A diffusers pipeline folder converted into the pipeline folder ``dst``.

    Raises:
        UsageError: options that would make the pipeline unloadable (key rewrites, another
            format than safetensors).
        SelectError: ``read.variant`` held by no component.
        OutputError: ``dst`` is a file, holds other files without ``force``, or is the source.
    """
    read, output, dry_run = job.read, job.output, job.dry_run
    if not is_default_keys(job.keys) or output.to not in (None, "safetensors"):
        raise UsageError(
            f"{src} is a diffusers pipeline: converting it whole writes a pipeline folder "
            "(safetensors, diffusers' key names)",
            "drop the key and format options, or take one component with --select NAME",
            api_hint="drop the key and format options, or take one component with select=",
        )
    components = pipeline_components(src)
    cls = read_model_index(src).get("_class_name") or "pipeline"
    _check_variant(src, components, read.variant)
    changed = _changed_components(src, components, read.adapters)
    check_folder_output(dst, force=True, inputs=[src])
    if dst.resolve().is_relative_to(src.resolve()):  # into a component: the source rewritten
        raise OutputError(f"output {dst} is inside the pipeline {src}", "write to a new path")
    existing = dst.is_dir() and any(dst.iterdir())
    if existing and not job.force:
        raise OutputError(
            f"{dst} exists and holds files",
            "pass --force to replace the pipeline's files in it (its other files are kept)",
            api_hint="pass force=True to replace the pipeline's files in it",
        )
    report = PipelineReport(
        source=str(src),
        source_format="diffusers pipeline",
        destination=str(dst),
        output_format="diffusers pipeline",
        selected="",
        selected_reason="every component",
        plan=KeyPlan({}),
        tensors=0,
        nbytes=0,
        pipeline=str(cls),
        dry_run=dry_run,
    )
    if dry_run:
        _convert_into(src, dst, components, changed, report, job)
        return report
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.pipeline-") as tmp:
        stage = Path(tmp) / dst.name
        stage.mkdir()
        _convert_into(src, stage, components, changed, report, job)
        _put_in_place(stage, dst, report)
    _named_in(report, stage, dst)
    return report


def _named_in(report: PipelineReport, stage: Path, dst: Path) -> None:
    """The report names the files where they are now, in ``dst``, not where they were made."""

    def moved(path: str) -> str:
        return str(dst / Path(path).relative_to(stage)) if path.startswith(str(stage)) else path

    report.files = [moved(f) for f in report.files]
    for c in report.components:
        if c.report is not None:
            c.report.destination = moved(c.report.destination)
            c.report.files = [moved(f) for f in c.report.files]


def _check_variant(src: Path, components: list[Component], variant: str | None) -> None:
    """A variant must be held by some component (the others are read without one, as
    diffusers' ``from_pretrained(variant=...)`` falls back to them)."""
    if variant is None:
        return
    if not any(variant in variants_in(c.folder) for c in components if c.holds_weights()):
        raise SelectError(
            f"no component of the diffusers pipeline {src} holds weights of variant '{variant}'",
            "drop --variant, or give one its components hold",
            api_hint="drop variant=, or give one its components hold",
        )


def _changed_components(
    src: Path, components: list[Component], adapters: AdapterOptions
) -> set[str]:
    """The components the kohya LoRAs to merge change (a whole pipeline takes those: each part
    merged into its own component).

    Raises:
        UsageError: an adapter of another kind (it has one base: merge it with --select), or
            one that changes a component the pipeline lacks.
    """
    changed: set[str] = set()
    for path, weight in adapters.adapters:
        adapter = read_adapter(path, weight=weight)
        parts = adapter.components()
        if parts is None:
            raise UsageError(
                f"{path} is a {adapter.kind}: merged into a whole pipeline only a kohya LoRA "
                "finds its components",
                "merge it into one component with --select NAME",
                api_hint="merge it into one component with select=",
            )
        held = {c.name for c in components if c.holds_weights()}
        missing = sorted(set(parts) - held)
        if missing:
            raise UsageError(
                f"{path} changes {', '.join(missing)}, which the pipeline {src} lacks",
                "merge it into the pipeline it was trained on",
            )
        changed |= set(parts)
    return changed


def _convert_into(
    src: Path,
    out: Path,
    components: list[Component],
    changed: set[str],
    report: PipelineReport,
    job: Job,
) -> None:
    """Every component into ``out``: the weights converted, the other folders copied; then
    ``model_index.json`` and the pipeline's other top-level files (not weights)."""
    read, dry_run = job.read, job.dry_run
    for c in components:
        result = ComponentResult(c.name, c.library, c.cls)
        folder = src / c.name  # c.folder, on the local disk
        if not folder.resolve().is_relative_to(src.resolve()):  # followed, and said so
            result.followed = f"{folder} -> {folder.resolve()}"
        if c.holds_weights():
            variant = read.variant if read.variant in variants_in(folder) else None
            merged = c.name in changed  # the LoRAs' parts for it, read through the pipeline
            own = replace(
                read,
                variant=variant,
                select=c.name if merged else None,
                adapters=read.adapters if merged else AdapterOptions(),
            )
            # one model (a component is never a pipeline itself), its keys as they are
            sub = convert_model(
                src if merged else folder,
                out / c.name,
                replace(job, read=own, keys=KeyRules(), force=False, check_outputs=False),
            )
            result.report = sub
            report.tensors += sub.tensors
            report.nbytes += sub.nbytes
            report.source_nbytes += sub.source_nbytes
            report.cast += [f"{c.name}/{key}" for key in sub.cast]
            report.files += sub.files
            report.overflowed += [f"{c.name}/{key}" for key in sub.overflowed]
        elif folder.is_dir():
            result.copied, result.left_out = _copy_tree(folder, out / c.name, dry_run)
        report.components.append(result)
    # model_index.json was read and checked; the other top-level files (a model card): not
    # links, which may lead anywhere
    others = [p for p in folder_files(src) if p.name != MODEL_INDEX]
    report.left_out = [p.name for p in others if p.is_symlink()]
    for path in [src / MODEL_INDEX] + [p for p in others if not p.is_symlink()]:
        if not dry_run:
            shutil.copyfile(path, out / path.name)
        report.copied_files.append(path.name)
    converted = [c.report for c in report.components if c.report is not None]
    report.verified = not dry_run and job.verify and all(r.verified for r in converted)


def _copy_tree(folder: Path, out: Path, dry_run: bool) -> tuple[list[str], list[str]]:
    """A component's folder without weights (a tokenizer's, a scheduler's), copied: its regular
    files, in sub-folders too; links, special files (a FIFO would block the copy) and what a
    model folder's copy leaves behind (weights and pickles of any name, training state) are
    left out and named."""
    copied, left_out = [], []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            left_out.append(rel)
        elif path.is_file() and not copied_beside_weights(path.name):
            left_out.append(rel)
        elif path.is_file():  # rglob does not go into linked folders
            copied.append(rel)
            if not dry_run:
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, out / rel)
    if not dry_run:
        out.mkdir(exist_ok=True)
    return copied, left_out


def _check_target(dst: Path, rel: Path) -> None:
    """A staged file's place in the existing ``dst``: reached through real folders only (a link
    in the way would send the write, and the clean-up of stale weights, out of ``dst``), and not
    taken by a folder.

    Raises:
        OutputError: naming the obstacle, before anything is replaced.
    """
    target, at = dst / rel, dst
    for part in rel.parts:
        at = at / part
        if at.is_symlink():
            raise OutputError(
                f"{at} is a link: ckptkit writes a pipeline through no link",
                "remove the link, or write to a new folder",
            )
        last = at == target
        if at.exists() and at.is_dir() == last:  # a folder where the file goes, or the reverse
            raise OutputError(
                f"{at} is in the way of the pipeline's {'file' if last else 'folder'} {target}",
                "move it away, or write to a new folder",
            )


def _put_in_place(stage: Path, dst: Path, report: PipelineReport) -> None:
    """The staged pipeline becomes ``dst``: a new folder by one rename; in an existing one,
    each staged file replaces its namesake, and in each component folder written the weights
    files this conversion did not write (an earlier run's shards, a variant) are removed."""
    if not dst.exists():
        os.rename(stage, dst)
        return
    for c in report.components:
        target = dst / c.name
        if target.exists() and not target.is_dir():
            raise OutputError(
                f"{target} is a file where the pipeline's '{c.name}' folder goes",
                "move it away, or write to a new folder",
            )
    staged = [path for path in sorted(stage.rglob("*")) if path.is_file()]
    for path in staged:  # every obstacle found before anything is replaced
        _check_target(dst, path.relative_to(stage))
    for path in staged:
        target = dst / path.relative_to(stage)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    for c in report.components:
        if c.report is None:
            continue
        written = {Path(f).name for f in c.report.files}
        for path in (dst / c.name).iterdir():
            if is_weights_name(path.name) and path.name not in written and path.is_file():
                path.unlink()
