"""``scan``: a static safety scan of a checkpoint's pickles, for people and for CI gates."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.formats import pickles_in
from ckptkit.formats.pickle_scan import SAFE, PickleFindings, classify, scan_pickle, worst_of

__all__ = ["scan", "ScanReport"]

# The pickle torch.load reads in each zip format; any other pickle in the archive is hidden.
_EXPECTED_PICKLES = ("data.pkl", "constants.pkl")


@dataclass
class ScanReport:
    """What every pickle in one file would import and call, and the verdict."""

    path: str
    format: str
    pickles: list[PickleFindings] = field(default_factory=list)
    allowed: frozenset[str] = frozenset()

    @property
    def verdict(self) -> str:
        """``safe``, ``unknown`` or ``dangerous``: the worst finding (allowed globals are safe)."""
        return worst_of([p.verdict(self.allowed) for p in self.pickles])

    @property
    def safe(self) -> bool:
        return self.verdict == SAFE

    def globals(self) -> dict[str, str]:
        """Every global named anywhere in the file -> its class (allowed ones: ``allowed``)."""
        out: dict[str, str] = {}
        for findings in self.pickles:
            for name in findings.globals:
                cls = classify(name)
                out[name] = "allowed" if cls != SAFE and name in self.allowed else cls
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "verdict": self.verdict,
            "globals": self.globals(),
            "pickles": [p.to_dict(self.allowed) for p in self.pickles],
        }


def scan(path: str | Path, *, allow_globals: Iterable[str] = ()) -> ScanReport:
    """Scan a checkpoint's pickles statically, without executing or importing anything.

    Args:
        path: a torch zip or legacy file, a TorchScript archive, a plain pickle, or safetensors
            (which holds no pickle, so it is always safe).
        allow_globals: globals to count as safe (``module.Name``).

    Returns:
        Per pickle: the globals named, the non-safe calls made, problems such as computed global
        names or pickles hidden in other zip members; and the overall verdict.

    Raises:
        FormatError: a missing, empty or foreign file.
    """
    kind, blobs = pickles_in(path)
    report = ScanReport(str(path), kind, allowed=frozenset(allow_globals))
    for label, data in blobs:
        findings = scan_pickle(data, label)
        if kind in ("torch-zip", "torchscript") and not label.endswith(_EXPECTED_PICKLES):
            if kind == "torch-zip" or not label.endswith(".debug_pkl"):
                findings.problems.append(
                    f"nested pickle in zip member '{label}' (torch.load skips it; others may not)"
                )
        report.pickles.append(findings)
    return report
