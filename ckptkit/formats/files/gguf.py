"""GGUF files (llama.cpp, ``gguf``'s ``GGUFWriter``): their header read as data, described, not
converted. Stdlib only.

Layout (version 2 and 3, little-endian): ``GGUF``, version (u32), tensor count (u64), key/value
count (u64); the key/values (a string key, a u32 type, the value); each tensor's name, number
of dimensions (u32), dimensions (u64 each, fastest-varying first), ggml type (u32) and offset
(u64, from the data section); then the data section, aligned to ``general.alignment`` (32).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ckptkit.errors import FormatError
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.storage.location import Location, local_path
from ckptkit.storage.location import size as size_of

if TYPE_CHECKING:
    import torch

__all__ = ["MAGIC", "GGML_TYPES", "GGUFSource", "read_gguf_header"]

MAGIC = b"GGUF"
# ggml type id -> (name, elements per block, bytes per block, the dtype of a plain type).
GGML_TYPES: dict[int, tuple[str, int, int, str | None]] = {
    0: ("F32", 1, 4, "float32"),
    1: ("F16", 1, 2, "float16"),
    2: ("Q4_0", 32, 18, None),
    3: ("Q4_1", 32, 20, None),
    6: ("Q5_0", 32, 22, None),
    7: ("Q5_1", 32, 24, None),
    8: ("Q8_0", 32, 34, None),
    9: ("Q8_1", 32, 40, None),
    10: ("Q2_K", 256, 84, None),
    11: ("Q3_K", 256, 110, None),
    12: ("Q4_K", 256, 144, None),
    13: ("Q5_K", 256, 176, None),
    14: ("Q6_K", 256, 210, None),
    15: ("Q8_K", 256, 292, None),
    16: ("IQ2_XXS", 256, 66, None),
    17: ("IQ2_XS", 256, 74, None),
    18: ("IQ3_XXS", 256, 98, None),
    19: ("IQ1_S", 256, 50, None),
    20: ("IQ4_NL", 32, 18, None),
    21: ("IQ3_S", 256, 110, None),
    22: ("IQ2_S", 256, 82, None),
    23: ("IQ4_XS", 256, 136, None),
    24: ("I8", 1, 1, "int8"),
    25: ("I16", 1, 2, "int16"),
    26: ("I32", 1, 4, "int32"),
    27: ("I64", 1, 8, "int64"),
    28: ("F64", 1, 8, "float64"),
    29: ("IQ1_M", 256, 56, None),
    30: ("BF16", 1, 2, "bfloat16"),
    34: ("TQ1_0", 256, 54, None),
    35: ("TQ2_0", 256, 66, None),
    39: ("MXFP4", 32, 17, None),
}
# Key/value types: struct format of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_ITEMS = 1 << 26  # an array or count larger than this is damage, not a model
_SHOWN = 8  # array items kept in the metadata text
_MAX_DEPTH = 4  # arrays of arrays: never written by llama.cpp, bounded against a crafted file


class _Reader:
    """Bounded reads of a header: every count is checked against the file's size."""

    def __init__(self, f: IO[bytes], size: int, path: Path) -> None:
        self.f, self.size, self.path = f, size, path

    def take(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        data = self.f.read(n)
        if len(data) != n:
            raise FormatError(f"{self.path} is a damaged GGUF file (its header is cut short)")
        return struct.unpack(fmt, data)[0]

    def count(self, what: str) -> int:
        n = self.take("<Q")
        if n > _MAX_ITEMS or n > self.size:
            raise FormatError(f"{self.path} is a damaged GGUF file ({what} {n} is impossible)")
        return int(n)

    def string(self) -> str:
        data = self.f.read(self.count("string length"))
        return data.decode("utf-8", errors="surrogateescape")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            if depth >= _MAX_DEPTH:  # llama.cpp writes arrays of scalars and strings
                raise FormatError(
                    f"{self.path} is a damaged GGUF file (arrays nested over {_MAX_DEPTH} deep)"
                )
            item = self.take("<I")
            n = self.count("array length")
            shown = [self.value(item, depth + 1) for _ in range(min(n, _SHOWN))]
            if item in _SCALARS:  # the rest skipped unread: a count is no reason to allocate
                end = self.f.tell() + (n - len(shown)) * struct.calcsize(_SCALARS[item])
                if end > self.size:
                    raise FormatError(f"{self.path} is a damaged GGUF file (an array past its end)")
                self.f.seek(end)
            else:
                for _ in range(n - len(shown)):
                    self.value(item, depth + 1)
            return _Array(shown, n)
        raise FormatError(f"{self.path} is a damaged GGUF file (value type {kind})")


@dataclass(frozen=True)
class _Array:
    """A metadata array as it is shown: its first items and how many it holds (a tokenizer's
    vocabulary is not kept whole to be described)."""

    first: list[Any]
    count: int


def read_gguf_header(
    path: Path,
) -> tuple[int, dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """(version, key/values, tensors as (name, dims fastest first, ggml type, offset), data
    section offset) of a GGUF file, from its header alone."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size, path)
        if f.read(4) != MAGIC:
            raise FormatError(f"{path} is not a GGUF file")
        version = r.take("<I")
        if version not in (2, 3):
            raise FormatError(f"{path} is GGUF version {version}; ckptkit reads versions 2 and 3")
        tensors, pairs = r.count("tensor count"), r.count("key/value count")
        meta = {}
        for _ in range(pairs):
            key = r.string()
            meta[key] = r.value(r.take("<I"))
        infos = []
        for _ in range(tensors):
            name = r.string()
            ndim = r.take("<I")
            if ndim > 8:
                raise FormatError(f"{path} is a damaged GGUF file ({ndim} dimensions)")
            dims = tuple(r.take("<Q") for _ in range(ndim))
            infos.append((name, dims, r.take("<I"), r.take("<Q")))
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise FormatError(f"{path} is a damaged GGUF file (alignment {alignment!r})")
        data = -(-f.tell() // alignment) * alignment
    return version, meta, infos, data


def _text(value: Any) -> str:
    """A metadata value as text: arrays shortened to their first items."""
    if isinstance(value, _Array):
        shown = ", ".join(_text(v) for v in value.first)
        more = f", ... ({value.count} items)" if value.count > len(value.first) else ""
        return f"[{shown}{more}]"
    return str(value)


class GGUFSource(Source):
    """A GGUF file's tensors from its header: plain types (F32, F16, BF16...) load as they are;
    quantized ggml types are described (their block type and stored bytes), never decoded."""

    def __init__(self, path: Location) -> None:
        version, meta, infos, data = read_gguf_header(local_path(path))  # refused at a URL
        super().__init__(
            path=path,
            format="gguf",
            metadata={k: _text(v) for k, v in meta.items()},
        )
        self.version = version
        self.selected_reason = f"a GGUF v{version} file's tensors"
        size = size_of(path)
        self._spans: dict[str, tuple[int, int]] = {}
        self._entries: list[tuple[str, TensorInfo]] = []
        for name, dims, kind, offset in infos:
            if kind not in GGML_TYPES:
                raise FormatError(f"tensor '{name}' of {path} has ggml type {kind}, unknown here")
            label, block, block_bytes, dtype = GGML_TYPES[kind]
            shape = tuple(reversed(dims))  # PyTorch's order: slowest first
            numel = math.prod(shape)
            stored = -(-numel // block) * block_bytes
            start = data + offset
            if start + stored > size:
                raise FormatError(f"tensor '{name}' of {path} lies past its end (a cut file?)")
            self._spans[name] = (start, stored)
            if dtype is not None:
                info = TensorInfo(dtype, shape, byte_range=(start, start + stored))
            else:
                info = TensorInfo(
                    "uint8", shape, kind="quantized", detail=f"ggml {label}", stored=stored
                )
            self._entries.append((name, info))

    def entries(self) -> list[tuple[str, TensorInfo]]:
        return self._entries

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        start, length = self._spans[key]
        return (self.path, start, length)

    def load(self, key: str) -> torch.Tensor:
        info = dict(self._entries)[key]
        if info.kind != "dense":
            raise FormatError(
                f"'{key}' in {self.path} is {info.detail}, a quantized block type: ckptkit "
                "describes GGUF files but does not decode them",
                "dequantize it with llama.cpp's tools (gguf-py)",
            )
        from ckptkit.formats.base.tensors import from_buffer

        start, length = self._spans[key]
        with open(local_path(self.path), "rb") as f:
            f.seek(start)
            data = bytearray(f.read(length))
        return from_buffer(data, 0, length, info.dtype).reshape(info.shape)
