"""ckptkit: PyTorch checkpoints that move between single-device, DataParallel, DDP and safetensors.

Importing the package is cheap: torch is imported only when a tensor is actually needed.
"""

from __future__ import annotations

from ckptkit.convert import ConvertReport, convert
from ckptkit.diff import DiffReport, diff
from ckptkit.errors import CkptkitError
from ckptkit.formats import open_source
from ckptkit.keys import detect_wrappers
from ckptkit.load import LoadReport, load_into, load_state_dict
from ckptkit.meta import VERSION as __version__
from ckptkit.scan import ScanReport, scan
from ckptkit.summary import Summary, summarize

__all__ = [
    "__version__",
    "CkptkitError",
    "convert",
    "ConvertReport",
    "load_state_dict",
    "load_into",
    "LoadReport",
    "open_source",
    "detect_wrappers",
    "summarize",
    "Summary",
    "diff",
    "DiffReport",
    "scan",
    "ScanReport",
    "train",
    "Engine",
    "TrainConfig",
]

# The training engine imports torch, so it loads on first use only (PEP 562).
_ENGINE = {"train", "Engine", "TrainConfig", "TrainResult"}


def __getattr__(name: str) -> object:
    if name in _ENGINE:
        import ckptkit.engine

        return getattr(ckptkit.engine, name)
    raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")
