"""Tensor element types by name, without importing torch.

Names are torch's attribute names (``float32`` is ``torch.float32``); the table gives each one's
size in bytes and its safetensors code, so headers can be read and written with the stdlib alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DType", "DTYPES", "STORAGE_DTYPES", "TensorSpec", "dtype", "nbytes", "from_safetensors"]


@dataclass(frozen=True)
class DType:
    """One element type: torch name, bytes per element, safetensors code, and kind."""

    name: str
    itemsize: int
    safetensors: str | None
    kind: str  # "float", "int", "bool" or "complex"

    @property
    def short(self) -> str:
        """Compact display name: ``f32``, ``bf16``, ``i64``..."""
        return _SHORT.get(self.name, self.name)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float64", 8, "F64", "float"),
        DType("float32", 4, "F32", "float"),
        DType("float16", 2, "F16", "float"),
        DType("bfloat16", 2, "BF16", "float"),
        DType("float8_e4m3fn", 1, "F8_E4M3", "float"),
        DType("float8_e4m3fnuz", 1, "F8_E4M3FNUZ", "float"),
        DType("float8_e5m2", 1, "F8_E5M2", "float"),
        DType("float8_e5m2fnuz", 1, "F8_E5M2FNUZ", "float"),
        DType("float8_e8m0fnu", 1, None, "float"),
        DType("int64", 8, "I64", "int"),
        DType("int32", 4, "I32", "int"),
        DType("int16", 2, "I16", "int"),
        DType("int8", 1, "I8", "int"),
        DType("uint64", 8, "U64", "int"),
        DType("uint32", 4, "U32", "int"),
        DType("uint16", 2, "U16", "int"),
        DType("uint8", 1, "U8", "int"),
        DType("bool", 1, "BOOL", "bool"),
        DType("complex128", 16, None, "complex"),
        DType("complex64", 8, "C64", "complex"),
        DType("complex32", 4, None, "complex"),
    )
}

_SHORT = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint64": "u64",
    "uint32": "u32",
    "uint16": "u16",
    "uint8": "u8",
}

# torch's legacy typed-storage classes, as pickles name them, and the dtype each one holds.
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    # An UntypedStorage holds bytes; the tensor's dtype comes with _rebuild_tensor_v3.
    "UntypedStorage": "uint8",
}

_BY_SAFETENSORS = {d.safetensors: d for d in DTYPES.values() if d.safetensors}


def dtype(name: str) -> DType:
    """Look a dtype up by torch name (``float32`` or ``torch.float32``)."""
    return DTYPES[name.removeprefix("torch.")]


def nbytes(name: str, shape: tuple[int, ...]) -> int:
    """Bytes a dense tensor of this dtype and shape takes."""
    return math.prod(shape) * DTYPES[name].itemsize


def from_safetensors(code: str) -> DType:
    """Look a dtype up by safetensors code (``F32``); KeyError when unknown."""
    return _BY_SAFETENSORS[code]


@dataclass(frozen=True)
class TensorSpec:
    """What the writer must know of a tensor before its data: name, dtype, shape."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)
