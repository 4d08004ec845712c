"""Writing: one writer per output format, and the output format a path or ``--to`` names
(both tables made from what each writer declares, in ``writers.py``)."""

from __future__ import annotations

from pathlib import Path

from ckptkit.errors import FormatError, UsageError
from ckptkit.formats.output.writers import OUTPUT_FORMATS, TO_FORMATS

__all__ = ["OUTPUT_FORMATS", "TO_FORMATS", "output_format"]


def output_format(path: str | Path, to: str | None = None) -> str:
    """``safetensors``, ``torch`` or ``dcp``: ``to`` when given (``safetensors``, ``pt`` or
    ``dcp``, a DCP folder), else from the output file's suffix.

    Raises:
        FormatError: a suffix ckptkit does not write.
        UsageError: ``to`` is unknown, or the suffix names another format.
    """
    suffix = Path(path).suffix.lower()
    if to is not None:
        if to not in TO_FORMATS:
            raise UsageError(f"unknown output format {to!r}", "use " + ", ".join(TO_FORMATS))
        implied = OUTPUT_FORMATS.get(suffix)
        if implied is not None and implied != TO_FORMATS[to]:
            raise UsageError(
                f"{path} ends in {suffix}, which is not a {to} output",
                "drop --to, or give DST another name",
            )
        return TO_FORMATS[to]
    if suffix not in OUTPUT_FORMATS:
        raise FormatError(
            f"cannot tell the output format of {path}",
            "end the name with .safetensors, or .pt (.pth, .bin, .ckpt, .pth.tar), "
            "or pass --to dcp for a DCP folder",
        )
    return OUTPUT_FORMATS[suffix]
