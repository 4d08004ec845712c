"""``scan``: a static safety scan of what loading a file would run, for people and for CI gates.

Every reading a loader would make of the file is scanned (see ``formats.detect.readings``):
``torch.load``'s zip, legacy tar or pickle stream, ``pickle.load``'s stream, a zip another tool
finds at the end, safetensors. A file more than one loader reads differently is reported as a
polyglot, never safe; a file no reading gets through whole is ``damaged``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.errors import CkptkitError, FormatError
from ckptkit.formats.files.readings import WEIGHT_SUFFIXES, Reading, readings, remote_readings
from ckptkit.formats.folders.diffusers import MODEL_INDEX, is_pipeline, pipeline_components
from ckptkit.formats.folders.layouts import folder_parts
from ckptkit.formats.pickles.safe_globals import safe_globals
from ckptkit.formats.pickles.verdicts import (
    DAMAGED,
    DANGEROUS,
    SAFE,
    PickleFindings,
    check_allowed,
    classify,
    worst_of,
)
from ckptkit.storage.location import Location, fresh_names, is_local, location, url_file

__all__ = ["scan", "scan_many", "overall_verdict", "report_of", "ScanReport"]


@dataclass
class ScanReport:
    """What every pickle in one file would import and call, and the verdict."""

    path: str
    format: str
    readings: list[Reading] = field(default_factory=list)
    allowed: frozenset[str] = frozenset()
    problems: list[str] = field(default_factory=list)  # about the file: polyglots
    error: str | None = None  # the file could not be scanned at all

    @property
    def pickles(self) -> list[PickleFindings]:
        return [p for r in self.readings for p in r.pickles]

    @property
    def damaged(self) -> list[str]:
        """Why readings could not be completed: damaged containers and pickles."""
        out = [f"{r.kind}: {r.damaged}" for r in self.readings if r.damaged]
        return out + [f"{p.label}: {p.damaged}" for p in self.pickles if p.damaged]

    @property
    def verdict(self) -> str:
        """``safe``, ``unknown``, ``damaged`` or ``dangerous`` (``error``: not scanned)."""
        if self.error is not None:
            return "error"
        verdicts = [p.verdict(self.allowed) for p in self.pickles]
        if self.problems:
            verdicts.append(DANGEROUS)
        if any(r.damaged for r in self.readings):
            verdicts.append(DAMAGED)
        return worst_of(verdicts)

    @property
    def safe(self) -> bool:
        return self.verdict == SAFE

    def globals(self) -> dict[str, str]:
        """Every global named anywhere in the file -> its class (allowed ones: ``allowed``)."""
        safe = safe_globals()
        out: dict[str, str] = {}
        for findings in self.pickles:
            for name in findings.globals:
                cls = classify(name, safe)
                out[name] = "allowed" if cls != SAFE and name in self.allowed else cls
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "verdict": self.verdict,
            "error": self.error,
            "readings": [{"kind": r.kind, "reader": r.reader} for r in self.readings],
            "globals": self.globals(),
            "problems": self.problems,
            "damaged": self.damaged,
            "pickles": [p.to_dict(self.allowed) for p in self.pickles],
        }


def scan(path: str | Path, *, allow_globals: Iterable[str] = ()) -> ScanReport:
    """Scan a file statically for what loading it would import and call; nothing is executed.

    Args:
        path: any file: a torch zip, legacy or tar checkpoint, TorchScript, a plain pickle,
            safetensors (no pickle), or a polyglot of them.
        allow_globals: globals to count as safe (``module.Name``); names that execute or import
            are refused.

    Returns:
        Per reading and pickle: the globals named, the non-safe calls made, problems (computed
        names, hidden pickles, frames that disagree, polyglots), damage; and the verdict.

    Raises:
        FormatError: a missing or unreadable file, or one no loader would read at all.
        UsageError: a dangerous name in ``allow_globals``.
    """
    allowed = check_allowed(allow_globals)
    where = location(path)
    raw = url_file(where)
    if raw is not None:  # a file at a URL: its directory and pickles read in ranged requests
        with raw:
            return report_of(where, remote_readings(where, raw), allowed, raw=raw)
    found = readings(path)
    if not found:
        raise FormatError(
            f"{path} is not a checkpoint, a pickle or a safetensors file",
            "nothing in it would be unpickled by torch.load or pickle.load",
        )
    return report_of(path, found, allowed)


def report_of(
    path: str | Path | Location,
    found: list[Reading],
    allowed: frozenset[str] = frozenset(),
    *,
    structure_checked: bool = False,
    raw: Any = None,
) -> ScanReport:
    """The report for readings already made (a reader's own, so nothing is parsed twice);
    ``structure_checked``: a reader has already read the file's structure (a safetensors
    header) whole, so it is not read again. ``raw``: the file at a URL (a RangeFile)."""
    report = ScanReport(str(path), found[0].kind, found, allowed)
    if found[0].damaged is None and not structure_checked:
        found[0].damaged = _structure_damage(location(str(path)), found, raw)
    if len(found) > 1:
        ways = "; ".join(f"{r.reader} reads {_article(r.kind)}" for r in found)
        report.problems.append(f"polyglot: loaders disagree on what this file is ({ways})")
    return report


def scan_many(
    paths: Iterable[str | Path], *, allow_globals: Iterable[str] = ()
) -> list[ScanReport]:
    """Scan each file; a file that cannot be scanned gets a report whose ``error`` says why.
    A folder (Accelerate, DeepSpeed, a model folder) stands for every file in it that a loader
    would read (a DeepSpeed tag folder's too); its other files (JSON, text) are passed over.

    Raises:
        UsageError: a dangerous name in ``allow_globals`` (before any file is read).
    """
    allowed = check_allowed(allow_globals)
    reports = []
    for path in paths:
        try:
            where = location(path)
            if is_local(where) and where.is_dir():
                reports.extend(_scan_folder(where, allowed))
            elif not is_local(where) and not where.suffix:  # at a URL: a folder by its name
                reports.extend(_scan_url_folder(where, allowed))
            else:
                reports.append(scan(path, allow_globals=allowed))
        except CkptkitError as exc:
            reports.append(ScanReport(str(path), "unknown", allowed=allowed, error=exc.cli_text))
    return reports


def _scan_folder(folder: Path, allowed: frozenset[str]) -> list[ScanReport]:
    """A folder's files that a loader would read; a diffusers pipeline's are in the folders of
    the components its ``model_index.json`` names (each model folder's weights, every variant
    and shard)."""
    folders = (
        [folder / c.name for c in pipeline_components(folder)] if is_pipeline(folder) else [folder]
    )
    reports = []
    for part in folders:
        if not part.is_dir():
            continue  # a component with nothing saved (a pipeline loads it without weights)
        for name, _ in folder_parts(part):
            found = readings(part / name)
            if found:
                reports.append(report_of(part / name, found, allowed))
    if not reports:
        raise FormatError(f"{folder} holds no file that a loader would read")
    return reports


def _scan_url_folder(folder: Location, allowed: frozenset[str]) -> list[ScanReport]:
    """A folder (a prefix) at a URL: each checkpoint file in it, by its name; a diffusers
    pipeline's, in the folders of its components."""
    names = fresh_names(folder)
    if names is None:  # http(s): no listing
        return [scan(str(folder), allow_globals=allowed)]
    if MODEL_INDEX in names:
        parts = [folder / c.name for c in pipeline_components(folder)]
        picked = [p / n for p in parts for n in sorted(fresh_names(p) or []) if _loaded(n)]
    else:
        picked = [folder / n for n in sorted(names) if _loaded(n)]
    if not picked:
        if not names:
            raise FormatError(f"{folder} does not exist, or holds nothing")
        raise FormatError(f"{folder} holds no file that a loader would read")
    reports = []
    for path in picked:
        try:
            reports.append(scan(str(path), allow_globals=allowed))
        except CkptkitError as exc:
            reports.append(ScanReport(str(path), "unknown", allowed=allowed, error=exc.cli_text))
    return reports


def _loaded(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)  # a URL's files are listed by name, not opened


def overall_verdict(reports: Iterable[ScanReport]) -> str:
    """The verdict of many files: ``error`` when one could not be scanned, else the worst."""
    verdicts = [r.verdict for r in reports]
    return "error" if "error" in verdicts else worst_of(verdicts)


def _structure_damage(path: Any, found: list[Reading], raw: Any = None) -> str | None:
    """Damage a loader would hit beyond the pickles: storages, tensor extents, headers."""
    kind = found[0].kind
    if kind in ("safetensors", "gguf"):  # data only: a header that reads is all there is
        from ckptkit.formats.files.gguf import read_gguf_header
        from ckptkit.formats.files.safetensors import read_header

        try:
            if kind == "safetensors":
                read_header(path, raw)
            else:
                read_gguf_header(path)
        except FormatError as exc:
            return exc.message
        return None
    from ckptkit.formats.files.torchfile import structure_damage

    return structure_damage(path, found, raw)


def _article(kind: str) -> str:
    return {
        "torch-zip": "a torch zip archive",
        "torchscript": "a TorchScript archive",
        "zip": "a zip archive",
        "legacy-tar": "a legacy tar archive",
        "torch-legacy": "a legacy torch pickle stream",
        "pickle": "a pickle",
        "safetensors": "a safetensors file",
        "gguf": "a GGUF file",
    }.get(kind, kind)
