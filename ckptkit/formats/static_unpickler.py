"""Read a checkpoint's pickle statically: its structure and tensor layout, without executing it.

``read_pickle`` runs the stdlib unpickler with a ``find_class`` that never imports anything: the
globals torch's ``weights_only`` loader allows are replaced by inert stand-ins (tensors become
``TensorStub`` records of dtype, shape, stride, storage and offset), and every other global
becomes an ``OpaqueObject`` class that only records the arguments and state it is given. The scan
lists every global the pickle names, so a caller can refuse a file before any tensor is read.
Stdlib only: no torch import.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import io
import math
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import FormatError
from ckptkit.formats import dtypes
from ckptkit.formats.dtypes import DTYPES, STORAGE_DTYPES

__all__ = [
    "StorageRef",
    "TensorStub",
    "UnsupportedTensor",
    "OpaqueObject",
    "PickleScan",
    "SAFE_GLOBALS",
    "read_pickle",
]


@dataclass(frozen=True)
class StorageRef:
    """One storage record of a torch file: its key (zip member or legacy id) and its size."""

    key: str
    dtype: str
    numel: int
    location: str

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class TensorStub:
    """A tensor as the pickle describes it: a strided view into a storage. ``offset`` and
    ``stride`` count elements of ``dtype``."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    is_parameter: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return dtypes.nbytes(self.dtype, self.shape)

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def byte_range(self) -> tuple[int, int]:
        """The [start, end) bytes of the storage this view touches (empty for zero elements)."""
        itemsize = DTYPES[self.dtype].itemsize
        start = self.offset * itemsize
        if self.numel == 0:
            return start, start
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return start, (last + 1) * itemsize


@dataclass
class UnsupportedTensor:
    """A tensor kind ckptkit cannot convert (sparse, quantized, nested, meta, subclasses)."""

    kind: str


class OpaqueObject:
    """Stand-in for an instance of a global outside the safe set: records, never runs."""

    global_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> OpaqueObject:
        self = object.__new__(cls)
        self.args, self.kwargs, self.state, self.items, self.mapping = args, kwargs, None, [], {}
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.mapping[key] = value

    def __repr__(self) -> str:
        return f"<{self.global_name}>"

    def to_dict(self) -> dict[str, Any]:
        """What the pickle gave this object, for metadata and display."""
        out: dict[str, Any] = {"__class__": self.global_name}
        state = self.state
        # BUILD's (dict_state, slot_state) form; a plain __dict__ is the common case.
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and isinstance(state[0], (dict, type(None)))
        ):
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            out.update({str(k): v for k, v in state.items()})
        elif state is not None:
            out["state"] = state
        if self.args:
            out["args"] = list(self.args)
        if self.items:
            out["items"] = self.items
        if self.mapping:
            out["mapping"] = self.mapping
        return out


@dataclass(frozen=True)
class _StorageType:
    dtype: str


@dataclass(frozen=True)
class _DTypeRef:
    name: str


class _Marker:
    """A torch class the pickle names only as a type tag (Parameter, Tensor)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> TensorStub:
    if not isinstance(storage, StorageRef):
        raise FormatError("tensor record without a storage")
    return TensorStub(storage, int(storage_offset), tuple(size), tuple(stride), storage.dtype)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, *_ignored):
    stub = _rebuild_tensor(storage, storage_offset, size, stride)
    stub.requires_grad = bool(requires_grad)
    return stub


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_):
    stub = _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad)
    if not isinstance(dtype, _DTypeRef) or dtype.name not in DTYPES:
        raise FormatError(f"tensor record with unknown dtype {dtype!r}")
    stub.dtype = dtype.name
    return stub


def _rebuild_parameter(data, requires_grad=True, *_ignored):
    if isinstance(data, TensorStub):
        data.is_parameter, data.requires_grad = True, bool(requires_grad)
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    result = func(*args)
    if isinstance(new_type, _Marker) and new_type.name == "Parameter":
        result = _rebuild_parameter(result, getattr(result, "requires_grad", True))
    return result


def _unsupported(kind: str):
    return lambda *args, **kwargs: UnsupportedTensor(kind)


def _device(kind: Any, index: Any = None) -> str:
    return f"{kind}:{index}" if index is not None else str(kind)


def _latin1_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles store bytes as _codecs.encode(text, "latin1"); no other codec is run.
    if not isinstance(text, str) or codecs.lookup(encoding).name != "iso8859-1":
        raise FormatError(f"pickle calls _codecs.encode with codec {encoding!r}")
    return text.encode("latin1")


_TORCH_UTILS = {
    "_rebuild_tensor": _rebuild_tensor,
    "_rebuild_tensor_v2": _rebuild_tensor_v2,
    "_rebuild_tensor_v3": _rebuild_tensor_v3,
    "_rebuild_parameter": _rebuild_parameter,
    "_rebuild_parameter_with_state": _rebuild_parameter,
    "_rebuild_sparse_tensor": _unsupported("sparse"),
    "_rebuild_qtensor": _unsupported("quantized"),
    "_rebuild_meta_tensor_no_storage": _unsupported("meta"),
    "_rebuild_nested_tensor": _unsupported("nested"),
    "_rebuild_wrapper_subclass": _unsupported("tensor subclass"),
    "_rebuild_device_tensor_from_numpy": _unsupported("device tensor from numpy"),
    "_rebuild_device_tensor_from_cpu_tensor": _unsupported("device tensor"),
}

_QSCHEMES = {
    "per_tensor_affine",
    "per_channel_affine",
    "per_tensor_symmetric",
    "per_channel_symmetric",
    "per_channel_affine_float_qparams",
}


def _safe_table() -> dict[str, Any]:
    table: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "collections.Counter": collections.Counter,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "builtins.bytearray": bytearray,
        "builtins.complex": complex,
        "_codecs.encode": _latin1_encode,
        "torch.Size": tuple,
        "torch.device": _device,
        "torch.Tensor": _Marker("Tensor"),
        "torch.nn.parameter.Parameter": _Marker("Parameter"),
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.serialization._get_layout": str,
        "torch.storage.TypedStorage": _StorageType("uint8"),
    }
    table.update({f"torch._utils.{name}": fn for name, fn in _TORCH_UTILS.items()})
    for cls, dt in STORAGE_DTYPES.items():
        module = "torch.storage" if cls == "UntypedStorage" else "torch"
        table[f"{module}.{cls}"] = _StorageType(dt)
        if cls != "UntypedStorage":
            table[f"torch.cuda.{cls}"] = _StorageType(dt)
    for name in (
        "QInt8Storage",
        "QUInt8Storage",
        "QInt32Storage",
        "QUInt4x2Storage",
        "QUInt2x4Storage",
    ):
        table[f"torch.{name}"] = _StorageType("uint8")
    table.update({f"torch.{name}": _DTypeRef(name) for name in DTYPES})
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4"):
        table[f"torch.{name}"] = _DTypeRef(name)
    table.update({f"torch.{q}": q for q in _QSCHEMES})
    return table


_SAFE = _safe_table()

# NumPy scalars (a `best_acc` saved as np.float64) are outside the safe set and refused unless
# admitted; once admitted, their value is decoded from the pickled bytes, never by numpy.
_NUMPY_FORMATS = {
    "f8": "d",
    "f4": "f",
    "f2": "e",
    "i8": "q",
    "i4": "i",
    "i2": "h",
    "i1": "b",
    "u8": "Q",
    "u4": "I",
    "u2": "H",
    "u1": "B",
    "b1": "?",
}


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    code = dtype.args[0] if isinstance(dtype, OpaqueObject) and dtype.args else None
    state = dtype.state if isinstance(dtype, OpaqueObject) else None
    order = ">" if isinstance(state, tuple) and len(state) > 1 and state[1] == ">" else "<"
    fmt = _NUMPY_FORMATS.get(code) if isinstance(code, str) else None
    if fmt and isinstance(data, bytes) and len(data) == struct.calcsize(order + fmt):
        return struct.unpack(order + fmt, data)[0]
    return f"<numpy scalar {code}>"


_DECODERS = {
    "numpy.core.multiarray.scalar": _numpy_scalar,
    "numpy._core.multiarray.scalar": _numpy_scalar,
}

#: Globals a checkpoint may name without being refused: the part of torch's ``weights_only``
#: allow-list that plain checkpoints use.
SAFE_GLOBALS: frozenset[str] = frozenset(_SAFE)


@dataclass
class PickleScan:
    """The result of reading one pickle statically."""

    root: Any
    globals: list[str] = field(default_factory=list)
    storages: dict[str, StorageRef] = field(default_factory=dict)

    @property
    def unsafe_globals(self) -> list[str]:
        """Globals outside :data:`SAFE_GLOBALS`, in the order the pickle names them."""
        return [g for g in self.globals if g not in SAFE_GLOBALS]


def python3_name(module: str, name: str) -> str:
    """``module.name`` as Python 3 knows it: protocol 0-2 pickles may say ``__builtin__.exec``."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


class _StaticUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, scan: PickleScan, legacy: bool) -> None:
        super().__init__(file, encoding="latin1")
        self._scan = scan
        self._legacy = legacy
        self._opaque: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = python3_name(module, name)
        if full not in self._scan.globals:
            self._scan.globals.append(full)
        if full in _SAFE:
            return _SAFE[full]
        if full in _DECODERS:
            return _DECODERS[full]
        if full not in self._opaque:
            attrs = {"global_name": full, "__module__": "ckptkit.opaque", "__qualname__": name}
            self._opaque[full] = type(name, (OpaqueObject,), attrs)
        return self._opaque[full]

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage" and len(pid) >= 5):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        storage_type, key, location, numel = pid[1:5]
        if self._legacy and len(pid) > 5 and pid[5] is not None:
            raise FormatError("legacy storage views (torch < 0.4) are not supported")
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"storage of unknown type {storage_type!r}")
        ref = StorageRef(str(key), storage_type.dtype, int(numel), str(location))
        return self._scan.storages.setdefault(ref.key, ref)


def read_pickle(data: bytes | io.BufferedIOBase, *, legacy: bool = False) -> PickleScan:
    """Read one pickle statically.

    Args:
        data: the pickle's bytes, or a binary file positioned at its start (it is left just
            past the pickle's STOP, so successive pickles can be read).
        legacy: storage records use the legacy (non-zip) form.

    Returns:
        The object tree with tensors as :class:`TensorStub`, the globals named, the storages.

    Raises:
        FormatError: the pickle is damaged or has records ckptkit does not understand.
    """
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    scan = PickleScan(root=None)
    try:
        scan.root = _StaticUnpickler(stream, scan, legacy).load()
    except FormatError:
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        UnicodeDecodeError,
        RecursionError,
    ) as exc:
        raise FormatError(f"damaged pickle ({type(exc).__name__}: {exc})") from None
    return scan
