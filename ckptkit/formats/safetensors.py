"""safetensors files: the header read with the stdlib, tensors through the safetensors library,
and a streaming writer that needs one tensor in memory at a time.

Layout: an 8-byte little-endian header length, a JSON header (``__metadata__`` plus, per tensor,
dtype, shape and ``data_offsets`` relative to the data section), then the tensor bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError
from ckptkit.formats.dtypes import DTYPES, from_safetensors, nbytes
from ckptkit.formats.source import Source, TensorInfo
from ckptkit.formats.tensors import as_bytes, dtype_name
from ckptkit.meta import CheckpointMeta

if TYPE_CHECKING:
    import torch

__all__ = ["SafetensorsSource", "TensorSpec", "read_header", "write_safetensors", "MAX_HEADER"]

MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """Read and check a safetensors header. Returns (header, offset of the data section).

    Raises:
        FormatError: not a safetensors file, or one that is truncated or inconsistent.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        size = f.seek(0, 2)
        if len(head) < 8:
            raise FormatError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise FormatError(f"{path} is truncated or not a safetensors file", "copy it again")
        f.seek(8)
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, ValueError):
            raise FormatError(f"{path} has a damaged safetensors header") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path} has a damaged safetensors header")
    data_size = size - 8 - length
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            from_safetensors(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(
                f"{path}: tensor '{key}' has a damaged or unknown header entry"
            ) from None
        if end > data_size:
            raise FormatError(
                f"{path} is truncated (tensor '{key}' ends past the file)", "copy it again"
            )
    return header, 8 + length


class SafetensorsSource(Source):
    """A single safetensors file; tensors come memory-mapped through ``safe_open``."""

    def __init__(self, path: Path, *, select: str | None = None) -> None:
        header, self._data_start = read_header(path)
        metadata = header.pop("__metadata__", None) or {}
        super().__init__(path=path, format="safetensors", metadata=dict(metadata))
        if select not in (None, ""):
            raise FormatError(
                f"{path} is a safetensors file: it holds one flat state dict", "drop --select"
            )
        self.selected_reason = "a safetensors file is a state dict"
        self.meta = CheckpointMeta.from_header(metadata)
        self.extras = dict(self.meta.extras)
        self._header = header
        self._handle: Any = None

    def entries(self) -> list[tuple[str, TensorInfo]]:
        def offset(item: tuple[str, Any]) -> int:
            return item[1]["data_offsets"][0]

        return [
            (
                key,
                TensorInfo(
                    from_safetensors(e["dtype"]).name,
                    tuple(e["shape"]),
                    byte_range=tuple(e["data_offsets"]),
                ),
            )
            for key, e in sorted(self._header.items(), key=offset)
        ]

    def aliases(self) -> dict[str, str]:
        # Each tensor owns its bytes here; ties survive only as recorded metadata.
        return dict(self.meta.aliases)

    def load(self, key: str) -> torch.Tensor:
        if self._handle is None:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
        return self._handle.get_tensor(key)

    def close(self) -> None:
        self._handle = None


@dataclass(frozen=True)
class TensorSpec:
    """What the writer must know of a tensor before its data: name, dtype, shape."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for tensors written back to back in ``specs`` order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        code = DTYPES[spec.dtype].safetensors
        if code is None:
            raise FormatError(
                f"tensor '{spec.key}' has dtype {spec.dtype}, which safetensors cannot store",
                "write a .pt file instead",
            )
        header[spec.key] = {
            "dtype": code,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad so the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    dst: Path,
    specs: list[TensorSpec],
    pairs: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str],
) -> None:
    """Stream tensors into a safetensors file, one at a time, in ``specs`` order.

    ``pairs`` must yield each spec's tensor in the same order; each is made contiguous as it is
    written, so peak memory is about the largest tensor.
    """
    with open(dst, "wb") as f:
        f.write(header_bytes(specs, metadata))
        expected = iter(specs)
        for key, tensor in pairs:
            spec = next(expected)
            if (
                key != spec.key
                or dtype_name(tensor.dtype) != spec.dtype
                or tuple(tensor.shape) != spec.shape
            ):
                raise ValueError(f"tensor '{key}' does not match its header entry")
            f.write(as_bytes(tensor.contiguous()))
