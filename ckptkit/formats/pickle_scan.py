"""Safety scan of a pickle at the opcode level: what it would import and call, never running it.

The scan walks the opcodes with ``pickletools.genops`` and tracks just enough of the pickle stack
(string constants, the memo, marks) to name every global, including ``STACK_GLOBAL`` names built
from memoised strings, and every call made through ``REDUCE``, ``NEWOBJ``, ``INST`` or ``OBJ``.
Each global is classed as safe (torch's ``weights_only`` set), dangerous (code execution, files,
processes, network, nested unpickling), or unknown. It works on damaged or hostile pickles that
an unpickler would reject. Stdlib only.
"""

from __future__ import annotations

import io
import pickletools
from dataclasses import dataclass, field
from typing import Any

from ckptkit.formats.static_unpickler import SAFE_GLOBALS, python3_name

__all__ = ["SAFE", "UNKNOWN", "DANGEROUS", "PickleFindings", "classify", "scan_pickle", "worst_of"]

SAFE, UNKNOWN, DANGEROUS = "safe", "unknown", "dangerous"
_RANK = {SAFE: 0, UNKNOWN: 1, DANGEROUS: 2}

# Modules whose every callable can run code, touch files or processes, or reach the network.
_DANGEROUS_MODULES = (
    "os", "posix", "nt", "subprocess", "sys", "shutil", "socket", "importlib", "runpy", "pickle",
    "_pickle", "dill", "cloudpickle", "joblib", "marshal", "ctypes", "pty", "webbrowser", "code",
    "codeop", "pdb", "bdb", "types", "asyncio", "multiprocessing", "threading", "signal", "shelve",
    "zipimport", "pip", "setuptools", "urllib", "http", "requests", "ftplib", "smtplib",
    "telnetlib", "xmlrpc", "tempfile", "glob", "pathlib", "io", "_io", "inspect", "ast",
    "torch.hub", "torch.jit", "torch._dynamo", "torch.ops", "torch.utils.cpp_extension",
)  # fmt: skip
# Single names that are as bad: evaluation, attribute tricks, nested loaders.
_DANGEROUS_NAMES = frozenset({
    "builtins.eval", "builtins.exec", "builtins.compile", "builtins.open", "builtins.__import__",
    "builtins.getattr", "builtins.setattr", "builtins.delattr", "builtins.globals",
    "builtins.locals", "builtins.vars", "builtins.input", "builtins.breakpoint", "builtins.apply",
    "builtins.execfile", "builtins.file", "builtins.reload", "builtins.memoryview",
    "operator.attrgetter", "operator.methodcaller", "functools.partial", "functools.reduce",
    "copyreg._reconstructor", "torch.load", "torch.serialization.load", "numpy.load",
    "numpy.lib.npyio.load", "_codecs.decode",
})  # fmt: skip


def worst_of(verdicts: list[str]) -> str:
    """The most severe of some verdicts (``safe`` for none)."""
    return max(verdicts, key=_RANK.__getitem__, default=SAFE)


def classify(name: str) -> str:
    """``safe``, ``dangerous`` or ``unknown`` for a global named ``module.name``."""
    if name in SAFE_GLOBALS:
        return SAFE
    if name in _DANGEROUS_NAMES or any(
        name == m or name.startswith(m + ".") for m in _DANGEROUS_MODULES
    ):
        return DANGEROUS
    return UNKNOWN


@dataclass
class PickleFindings:
    """What one pickle would import and call."""

    label: str
    globals: dict[str, int] = field(default_factory=dict)  # name -> times named
    calls: dict[str, int] = field(default_factory=dict)  # callable (non-safe) -> times called
    problems: list[str] = field(default_factory=list)  # computed names, parse errors...
    opcodes: int = 0

    def verdict(self, allowed: frozenset[str] = frozenset()) -> str:
        """The worst class among the globals (``allowed`` ones count as safe) and problems."""
        worst = max((_RANK[classify(g)] for g in self.globals if g not in allowed), default=0)
        if self.problems:
            worst = max(worst, _RANK[DANGEROUS if self.dangerous_problem else UNKNOWN])
        return worst_of([v for v, rank in _RANK.items() if rank == worst])

    @property
    def dangerous_problem(self) -> bool:
        return any(
            p.startswith(("computed", "nested", "extension", "call of")) for p in self.problems
        )

    def to_dict(self, allowed: frozenset[str] = frozenset()) -> dict[str, Any]:
        return {
            "pickle": self.label,
            "verdict": self.verdict(allowed),
            "opcodes": self.opcodes,
            "globals": [
                {"name": g, "class": classify(g), "count": n} for g, n in self.globals.items()
            ],
            "calls": [{"name": c, "class": classify(c), "count": n} for c, n in self.calls.items()],
            "problems": self.problems,
        }


class _Global:
    def __init__(self, name: str) -> None:
        self.name = name


_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
               "BINUNICODE", "BINUNICODE8"}  # fmt: skip
_MARK = object()
_UNKNOWN = object()


def scan_pickle(data: bytes | io.BufferedIOBase, label: str = "pickle") -> PickleFindings:
    """Scan one pickle (bytes, or a stream left just past its STOP). Never raises on bad input:
    a parse error is recorded as a problem."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    found = PickleFindings(label)
    stack: list[Any] = []
    memo: dict[int, Any] = {}

    def note_global(name: str) -> _Global:
        found.globals[name] = found.globals.get(name, 0) + 1
        return _Global(name)

    def note_call(target: Any) -> None:
        if isinstance(target, _Global) and classify(target.name) != SAFE:
            found.calls[target.name] = found.calls.get(target.name, 0) + 1

    def pop() -> Any:
        return stack.pop() if stack else _UNKNOWN

    def pop_mark() -> list[Any]:
        items: list[Any] = []
        while stack and stack[-1] is not _MARK:
            items.append(stack.pop())
        if stack:
            stack.pop()
        return items[::-1]

    try:
        for op, arg, _pos in pickletools.genops(stream):
            found.opcodes += 1
            name = op.name
            if name in _STRING_OPS:
                stack.append(arg.decode("latin1") if isinstance(arg, bytes) else arg)
            elif name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                g = note_global(python3_name(module, attr))
                if name == "INST":
                    pop_mark()
                    note_call(g)
                stack.append(g)
            elif name == "STACK_GLOBAL":
                attr, module = pop(), pop()
                if isinstance(module, str) and isinstance(attr, str):
                    stack.append(note_global(python3_name(module, attr)))
                else:
                    found.problems.append(
                        "computed global: STACK_GLOBAL with a name built at load time"
                    )
                    stack.append(_UNKNOWN)
            elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
                if name == "NEWOBJ_EX":
                    pop()
                pop()  # arguments
                target = pop()
                note_call(target)
                if not isinstance(target, _Global):
                    found.problems.append("call of a value made at load time (not a named global)")
                stack.append(_UNKNOWN)
            elif name == "OBJ":
                items = pop_mark()
                if items:
                    note_call(items[0])
                stack.append(_UNKNOWN)
            elif name in ("EXT1", "EXT2", "EXT4"):
                found.problems.append(f"extension code {arg}: a global from copyreg's registry")
                stack.append(_UNKNOWN)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = stack[-1] if stack else _UNKNOWN
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else _UNKNOWN
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(int(arg), _UNKNOWN))
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "STOP":
                break
            else:
                _generic(op, stack, pop, pop_mark)
    except Exception as exc:  # genops raises ValueError and more on hostile input
        found.problems.append(f"unparseable after {found.opcodes} opcodes ({exc})")
    return found


def _generic(op: Any, stack: list[Any], pop: Any, pop_mark: Any) -> None:
    """Apply an opcode's documented stack effect, keeping nothing but its shape."""
    before = [getattr(x, "name", x) for x in op.stack_before]
    if "mark" in before:
        pop_mark()
        for _ in range(before.index("mark")):
            pop()
    else:
        for _ in before:
            pop()
    stack.extend(_UNKNOWN for _ in op.stack_after)
