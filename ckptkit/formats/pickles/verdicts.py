"""Safety verdicts for pickles: what each global is, and what a pickle's run says about it.

The findings come from :mod:`pickle_vm`'s one parse (the same run the readers use), so the
verdict and the data can never disagree. Each global is classed as safe (torch's ``weights_only``
set), dangerous (code execution, imports, files, processes, network, nested unpickling, attribute
walks through dunders), or unknown. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import UsageError
from ckptkit.formats.pickles.machine import FRAME_PROBLEM, PickleData, PickleRun
from ckptkit.formats.pickles.safe_globals import safe_globals
from ckptkit.formats.pickles.unpickler import DATA_GLOBALS, PickleScan, read_pickle

__all__ = [
    "SAFE",
    "DATA",
    "UNKNOWN",
    "DAMAGED",
    "DANGEROUS",
    "PickleFindings",
    "check_allowed",
    "classify",
    "is_dangerous",
    "scan_pickle",
    "worst_of",
]

SAFE, UNKNOWN, DAMAGED, DANGEROUS = "safe", "unknown", "damaged", "dangerous"
# A plain-data class (argparse.Namespace, NumPy values, paths...) decoded without import: safe.
DATA = "data"
_RANK = {SAFE: 0, UNKNOWN: 1, DAMAGED: 2, DANGEROUS: 3}

# Modules whose callables can run code, import, touch files or processes, or reach the network.
_DANGEROUS_MODULES = (
    "os",
    "posix",
    "nt",
    "subprocess",
    "sys",
    "shutil",
    "socket",
    "importlib",
    "runpy",
    "pickle",
    "_pickle",
    "pickletools",
    "dill",
    "cloudpickle",
    "joblib",
    "marshal",
    "ctypes",
    "_ctypes",
    "pty",
    "webbrowser",
    "code",
    "codeop",
    "pdb",
    "bdb",
    "types",
    "asyncio",
    "multiprocessing",
    "threading",
    "_thread",
    "signal",
    "shelve",
    "zipimport",
    "pip",
    "setuptools",
    "pkg_resources",
    "urllib",
    "http",
    "requests",
    "ftplib",
    "smtplib",
    "telnetlib",
    "xmlrpc",
    "tempfile",
    "glob",
    "pathlib",
    "io",
    "_io",
    "inspect",
    "ast",
    "builtins.__import__",
    "_posixsubprocess",
    "commands",
    "platform",
    "sysconfig",
    "distutils",
    "venv",
    "ensurepip",
    "gc",
    "weakref",
    "operator",
    "functools",
    "copyreg",
    "copy",
    "timeit",
    "trace",
    "profile",
    "cProfile",
    "idlelib",
    "lib2to3",
    "imp",
    "numpy.testing",
    "numpy.f2py",
    "numpy.distutils",
    "torch.hub",
    "torch.jit",
    "torch._dynamo",
    "torch.ops",
    "torch.utils.cpp_extension",
    "torch.package",
    "torch._inductor",
    "torch.fx",
    "torch.compiler",
    "torch.serialization",
    "torch.utils.data.datapipes",
    "torch.distributed.rpc",
    "torch.backends",
)
# Single names that are as bad: evaluation, attribute tricks, nested loaders.
_DANGEROUS_NAMES = frozenset(
    {
        "builtins.eval",
        "builtins.exec",
        "builtins.compile",
        "builtins.open",
        "builtins.__import__",
        "builtins.getattr",
        "builtins.setattr",
        "builtins.delattr",
        "builtins.globals",
        "builtins.locals",
        "builtins.vars",
        "builtins.input",
        "builtins.breakpoint",
        "builtins.apply",
        "builtins.execfile",
        "builtins.file",
        "builtins.reload",
        "builtins.memoryview",
        "builtins.help",
        "builtins.exit",
        "builtins.quit",
        "builtins.type",
        "builtins.super",
        "builtins.object",
        "builtins.classmethod",
        "builtins.staticmethod",
        "builtins.property",
        "builtins.dir",
        "builtins.map",
        "builtins.filter",
        "builtins.print",
        "builtins.__build_class__",
        "torch.load",
        "numpy.load",
        "numpy.lib.npyio.load",
        "numpy.fromfile",
        "numpy.memmap",
        "_codecs.decode",
        "codecs.decode",
        "codecs.open",
        "numpy.ctypeslib",
    }
)
# torch.serialization's own safe helper stays safe though its module is not.
_SAFE_IN_DANGEROUS = frozenset({"torch.serialization._get_layout"})


def is_dangerous(name: str) -> bool:
    """True for a global that executes, imports, or walks attributes through a dunder."""
    if name in _SAFE_IN_DANGEROUS:
        return False
    if name in _DANGEROUS_NAMES or any(
        name == m or name.startswith(m + ".") for m in _DANGEROUS_MODULES
    ):
        return True
    # `module.Class.__init__.__globals__`: a protocol-4 dotted name walks attributes.
    return any(part.startswith("__") for part in name.split(".")[1:]) or "<" in name


def worst_of(verdicts: Iterable[str]) -> str:
    """The most severe of some verdicts (``safe`` for none)."""
    return max(verdicts, key=_RANK.__getitem__, default=SAFE)


def classify(name: str, safe: frozenset[str] | None = None) -> str:
    """``safe``, ``data``, ``dangerous`` or ``unknown`` for a global named ``module.name``."""
    if name in (safe if safe is not None else safe_globals()):
        return SAFE
    if name in DATA_GLOBALS:
        return DATA
    return DANGEROUS if is_dangerous(name) else UNKNOWN


@dataclass
class PickleFindings:
    """What one pickle would import and call, from its run."""

    label: str
    scan: PickleScan
    extra_problems: list[str] = field(default_factory=list)

    @property
    def run(self) -> PickleRun:
        return self.scan.run

    @property
    def globals(self) -> dict[str, int]:
        return self.run.globals

    @property
    def calls(self) -> dict[str, int]:
        return self.run.calls

    @property
    def problems(self) -> list[str]:
        return self.run.problems + self.extra_problems

    @property
    def damaged(self) -> str | None:
        return self.run.damaged

    def verdict(self, allowed: frozenset[str] = frozenset()) -> str:
        """The worst of: each global's class (``allowed`` ones count as safe), ``dangerous`` for
        any problem, ``damaged`` when the pickle cannot be read to its end."""
        safe = safe_globals() | allowed
        verdicts = [SAFE if (c := classify(g, safe)) == DATA else c for g in self.globals]
        if self.problems:
            verdicts.append(DANGEROUS)
        if self.damaged:
            verdicts.append(DAMAGED)
        return worst_of(verdicts)

    def to_dict(self, allowed: frozenset[str] = frozenset()) -> dict[str, Any]:
        safe = safe_globals()
        return {
            "pickle": self.label,
            "verdict": self.verdict(allowed),
            "opcodes": self.run.opcodes,
            "globals": [
                {"name": g, "class": classify(g, safe), "count": n} for g, n in self.globals.items()
            ],
            "calls": [
                {"name": c, "class": classify(c, safe), "count": n} for c, n in self.calls.items()
            ],
            "problems": self.problems,
            "damaged": self.damaged,
        }


def scan_pickle(
    data: PickleData,
    label: str = "pickle",
    start: int = 0,
    *,
    legacy: bool = False,
) -> PickleFindings:
    """Scan one pickle starting at ``data[start]``; never raises on bad input.

    It is read as ``torch.load`` and ``pickle.load`` read a file; where its frames disagree with
    its opcodes, ``pickle.loads`` reads other opcodes from the same bytes, and what that reading
    would import and call is added.
    """
    found = read_pickle(data, start, legacy=legacy)
    if FRAME_PROBLEM in found.run.problems:
        other = read_pickle(data, start, legacy=legacy, file_mode=False)
        found.run.merge(other.run)
    return PickleFindings(label, found)


def check_allowed(names: Iterable[str]) -> frozenset[str]:
    """The names to admit, refusing any that executes or imports.

    Raises:
        UsageError: a dangerous name, with the way to load such a file anyway.
    """
    names = frozenset(names)
    bad = sorted(n for n in names if is_dangerous(n))
    if bad:
        raise UsageError(
            f"{', '.join(bad)} cannot be admitted: a file that needs it runs code when loaded",
            "only if you trust the file, load it with --trust",
        )
    return names
