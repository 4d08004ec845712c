"""ckptkit: PyTorch checkpoints that move between single-device, DataParallel, DDP and FSDP, and
between torch files, safetensors, DCP, DeepSpeed and Hugging Face folders.

Importing the package is cheap: each name below is imported on first use (PEP 562), so a command
imports only what it uses, and torch only when a tensor is actually needed.
"""

from __future__ import annotations

import sys


def _run_as_module() -> bool:
    """Whether this import is ``python -m ckptkit`` (or ``torchrun -m ckptkit``, whose workers
    are started that way) locating the module: ``sys.argv`` is ``["-m"]`` only then, and the
    module runpy is locating is named in its frame (whatever flags came with ``-m``: ``-Em``)."""
    if sys.argv[:1] != ["-m"]:
        return False
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "_run_module_as_main"
            and frame.f_globals.get("__name__") == "runpy"
        ):
            name = frame.f_locals.get("mod_name", "")
            return isinstance(name, str) and (name == "ckptkit" or name.startswith("ckptkit."))
        frame = frame.f_back
    return False


# `python -m` puts the current folder first on sys.path, so a downloaded folder's click.py or
# torch.py would run at the first import: drop it before importing anything, as `python -P`
# does. A trusted unpickle puts it back while it runs (torchfile._current_folder_importable).
if _run_as_module() and not getattr(sys.flags, "safe_path", False) and sys.path:
    import os

    if sys.path[0] in ("", os.getcwd()):
        del sys.path[0]

# Imported after the current folder left sys.path.
import importlib  # noqa: E402
import types  # noqa: E402 - (the annotation above is never evaluated)
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from ckptkit.convert import ConvertReport, convert, merge_adapters
    from ckptkit.diff import DiffReport, diff
    from ckptkit.engine import Engine, TrainConfig, TrainResult, train
    from ckptkit.errors import CkptkitError
    from ckptkit.formats.open import OpenOptions, open_source
    from ckptkit.keys import detect_wrappers
    from ckptkit.load import LoadReport, load_into, load_state_dict
    from ckptkit.scan import ScanReport, scan
    from ckptkit.stats import TensorStats, tensor_stats
    from ckptkit.summary import Summary, summarize

__all__ = [
    "__version__",
    "CkptkitError",
    "convert",
    "merge_adapters",
    "ConvertReport",
    "load_state_dict",
    "load_into",
    "LoadReport",
    "open_source",
    "OpenOptions",
    "detect_wrappers",
    "summarize",
    "Summary",
    "diff",
    "DiffReport",
    "scan",
    "ScanReport",
    "tensor_stats",
    "TensorStats",
    "train",
    "Engine",
    "TrainConfig",
    "TrainResult",
]

# Public name -> the module that defines it.
_WHERE = {
    "CkptkitError": "ckptkit.errors",
    "convert": "ckptkit.convert",
    "merge_adapters": "ckptkit.convert",
    "ConvertReport": "ckptkit.convert",
    "load_state_dict": "ckptkit.load",
    "load_into": "ckptkit.load",
    "LoadReport": "ckptkit.load",
    "open_source": "ckptkit.formats.open",
    "OpenOptions": "ckptkit.formats.open",
    "detect_wrappers": "ckptkit.keys",
    "summarize": "ckptkit.summary",
    "Summary": "ckptkit.summary",
    "diff": "ckptkit.diff",
    "DiffReport": "ckptkit.diff",
    "scan": "ckptkit.scan",
    "ScanReport": "ckptkit.scan",
    "tensor_stats": "ckptkit.stats",
    "TensorStats": "ckptkit.stats",
    "train": "ckptkit.engine",  # imports torch
    "Engine": "ckptkit.engine",
    "TrainConfig": "ckptkit.engine",
    "TrainResult": "ckptkit.engine",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read from the package metadata on first use
        from ckptkit.meta import version

        return version()
    if name not in _WHERE:
        raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    setattr(sys.modules[__name__], name, value)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package module, which keeps ``ckptkit.convert`` (and ``diff``, ``scan``) the
    function: importing the submodule of the same name would otherwise bind the module
    there (the submodule stays reachable in ``sys.modules``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
