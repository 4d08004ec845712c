"""Read a checkpoint's pickle statically: its structure and tensor layout, without executing it.

``read_pickle`` runs the pickle on :mod:`pickle_vm`'s machine with the handlers below: the calls
torch's ``weights_only`` loader makes (rebuilding tensors, ``OrderedDict``, ``torch.Size``...)
become pure functions that return fresh inert records (tensors become ``TensorStub`` records of
dtype, shape, stride, storage and offset), and every other global becomes an ``Opaque`` record of
the call. The same run lists every global and every suspicious construct, so a caller can refuse
a file before any tensor is read. Stdlib only: no torch import.
"""

from __future__ import annotations

import datetime
import math
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Any

from ckptkit.formats.base import dtypes
from ckptkit.formats.base.dtypes import DTYPES, STORAGE_DTYPES
from ckptkit.formats.pickles.machine import (
    Global,
    Opaque,
    PickleData,
    PickleRun,
    python3_name,
    run_pickle,
)
from ckptkit.formats.pickles.safe_globals import safe_globals

__all__ = [
    "StorageRef",
    "TensorStub",
    "UnsupportedTensor",
    "OpaqueObject",
    "PickleScan",
    "TORCH_CALLS",
    "DATA_CALLS",
    "DATA_GLOBALS",
    "DCP_METADATA_GLOBALS",
    "read_pickle",
    "python3_name",
]

#: What a call of a global outside the handled set leaves in the tree.
OpaqueObject = Opaque


@dataclass(frozen=True, slots=True)
class StorageRef:
    """One storage record of a torch file: its key (zip member or legacy id) and its size."""

    key: str
    dtype: str
    numel: int
    location: str
    type_name: str = ""  # the storage class (``QInt8Storage``), when the pickle names one

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(slots=True)
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
        start = last = self.offset
        for n, s in zip(self.shape, self.stride, strict=True):
            if n == 0:
                return start * itemsize, start * itemsize
            last += (n - 1) * s
        return start * itemsize, (last + 1) * itemsize


@dataclass
class UnsupportedTensor:
    """A tensor that is not one strided view of a storage (sparse, quantized, nested, meta,
    subclasses): what the pickle says of it, for ``inspect`` and for messages."""

    kind: str
    shape: tuple[int, ...] = ()
    dtype: str = "uint8"  # of its elements (a quantized tensor's: its integer storage's)
    detail: str = ""  # "COO, 7 stored values", "qint8, per_tensor_affine"
    # A sharded tensor's (DTensor, ShardedTensor) state as the pickle gave it: its local
    # shard and where that lies in the full tensor, read by ``formats.rank_files``.
    state: Any = field(default=None, compare=False, repr=False)


def _rebuild_sparse(layout: Any = None, data: Any = None, *_ignored: Any) -> UnsupportedTensor:
    """``_rebuild_sparse_tensor(layout, data)``: COO data is (indices, values, size, ...),
    compressed layouts (CSR, CSC, BSR, BSC) (compressed, plain, values, size)."""
    # The layout arrives as torch.serialization._get_layout's name ("torch.sparse_csr").
    name = layout if isinstance(layout, str) else _torch_name(layout)
    name = name.removeprefix("torch.").removeprefix("sparse_").upper() or "sparse"
    items = data if isinstance(data, tuple) else ()
    at = 1 if name == "COO" else 2
    values = items[at] if len(items) > at else None
    size = items[at + 1] if len(items) > at + 1 else ()
    shape = size if isinstance(size, tuple) and all(type(n) is int for n in size) else ()
    if not isinstance(values, TensorStub):
        return UnsupportedTensor("sparse", shape, detail=name)
    return UnsupportedTensor("sparse", shape, values.dtype, f"{name}, {values.numel} stored values")


def _rebuild_subclass(cls: Any = None, dtype: Any = None, size: Any = (), *_: Any) -> Any:
    """``_rebuild_wrapper_subclass(cls, dtype, size, ...)``: a DTensor records its full shape
    here (its local shard follows in BUILD state, which stays unread)."""
    name = cls.name if isinstance(cls, Global) else "a tensor subclass"
    shape = size if isinstance(size, tuple) and all(type(n) is int for n in size) else ()
    element = _torch_name(dtype) if _torch_name(dtype) in DTYPES else "uint8"
    kind = next((k for k in SHARDED_KINDS if name.endswith("." + k)), "tensor subclass")
    return UnsupportedTensor(kind, shape, element, "" if kind in SHARDED_KINDS else name)


SHARDED_KINDS = ("DTensor", "ShardedTensor")  # one rank's shard, its full shape recorded


_QUANTIZED = {
    "QInt8Storage": ("int8", "qint8"),
    "QUInt8Storage": ("uint8", "quint8"),
    "QInt32Storage": ("int32", "qint32"),
    "QUInt4x2Storage": ("uint8", "quint4x2"),
    "QUInt2x4Storage": ("uint8", "quint2x4"),
}


def _rebuild_qtensor(
    storage: Any = None,
    offset: Any = 0,
    size: Any = (),
    stride: Any = (),
    quantizer: Any = (),
    *_ignored: Any,
) -> UnsupportedTensor:
    shape = size if isinstance(size, tuple) and all(type(n) is int for n in size) else ()
    scheme = _torch_name(quantizer[0]) if isinstance(quantizer, tuple) and quantizer else ""
    dtype, qdtype = "uint8", "quantized"
    if isinstance(storage, StorageRef):
        dtype, qdtype = _QUANTIZED.get(storage.type_name, (storage.dtype, "quantized"))
    return UnsupportedTensor("quantized", shape, dtype, f"{qdtype}, {scheme or 'unknown scheme'}")


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not tuple and not isinstance(value, tuple):
        raise ValueError(f"{what} must be a tuple of non-negative integers, not {value!r}")
    for v in value:
        if type(v) is not int or v < 0:
            raise ValueError(f"{what} must be a tuple of non-negative integers, not {value!r}")
    if len(value) > 64:
        raise ValueError(f"{what} has {len(value)} dimensions")
    return value


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> TensorStub:
    if not isinstance(storage, StorageRef):
        raise ValueError("tensor record without a storage")
    if type(storage_offset) is not int or storage_offset < 0:
        raise ValueError(f"bad storage offset {storage_offset!r}")
    shape, strides = _dims(size, "shape"), _dims(stride, "stride")
    if len(shape) != len(strides):
        raise ValueError("shape and stride differ in length")
    return TensorStub(storage, storage_offset, _shared(shape), _shared(strides), storage.dtype)


_SHARED: dict[Any, Any] = {}


def _shared(value: Any) -> Any:
    """One object per distinct shape, stride or name: a state dict of 100,000 tensors repeats
    a few dozen (each tuple of its own took 60 bytes more per tensor)."""
    if len(_SHARED) > 4096:
        _SHARED.clear()
    return _SHARED.setdefault(value, value)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, *_ignored):
    stub = _rebuild_tensor(storage, storage_offset, size, stride)
    stub.requires_grad = bool(requires_grad)
    return stub


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_):
    stub = _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad)
    name = _torch_name(dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    stub.dtype = name
    return stub


def _rebuild_parameter(data, requires_grad=True, *_ignored):
    if isinstance(data, TensorStub):
        data.is_parameter, data.requires_grad = True, bool(requires_grad)
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    # The one handler that calls another: only ever one of the tensor rebuilders.
    handler = _REBUILDERS.get(func.name) if isinstance(func, Global) else None
    if handler is None or not isinstance(args, tuple):
        raise ValueError(f"_rebuild_from_type_v2 of {func!r}")
    result = handler(*args)
    if isinstance(result, UnsupportedTensor) and result.kind in SHARDED_KINDS:
        result.state = state
    if isinstance(new_type, Global) and new_type.name == "torch.nn.parameter.Parameter":
        result = _rebuild_parameter(result, getattr(result, "requires_grad", True))
    return result


def _unsupported(kind: str):
    return lambda *args, **kwargs: UnsupportedTensor(kind)


def _torch_name(value: Any) -> str:
    """``float32`` for the global ``torch.float32``; '' for anything else."""
    if isinstance(value, Global) and value.name.startswith("torch."):
        return value.name[len("torch.") :]
    return ""


def _device(kind: Any, index: Any = None) -> str:
    if not isinstance(kind, str) or not (index is None or type(index) is int):
        raise ValueError(f"device {kind!r}")
    return f"{kind}:{index}" if index is not None else kind


def _latin1_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles store bytes as _codecs.encode(text, "latin1"); no other codec is run.
    if not isinstance(text, str) or encoding.lower().replace("-", "") not in ("latin1", "latin_1"):
        raise ValueError(f"_codecs.encode with codec {encoding!r}")
    return text.encode("latin1")


def _bytes(value: Any = b"") -> bytes:
    if not isinstance(value, (bytes, bytearray)):  # bytes(10**12) would allocate it
        raise ValueError("bytes of anything but bytes")
    return bytes(value)


def _bytearray(value: Any = b"") -> bytearray:
    if not isinstance(value, (bytes, bytearray)):  # bytearray(10**12) would allocate it
        raise ValueError("bytearray of anything but bytes")
    return bytearray(value)


def _container(kind: type):
    def make(items: Any = ()) -> Any:
        if not isinstance(items, (list, tuple, set, frozenset, dict)):
            raise ValueError(f"{kind.__name__} of a {type(items).__name__}")
        return kind(items)

    return make


def _complex(real: Any = 0, imag: Any = 0) -> complex:
    if not all(isinstance(v, (int, float)) for v in (real, imag)):
        raise ValueError("complex of non-numbers")
    return complex(real, imag)


_REBUILDERS = {
    "torch._utils._rebuild_tensor": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._utils._rebuild_sparse_tensor": _rebuild_sparse,
    "torch._utils._rebuild_qtensor": _rebuild_qtensor,
    "torch._utils._rebuild_meta_tensor_no_storage": _unsupported("meta"),
    "torch._utils._rebuild_nested_tensor": _unsupported("nested"),
    "torch._utils._rebuild_wrapper_subclass": _rebuild_subclass,
    "torch._utils._rebuild_device_tensor_from_numpy": _unsupported("device tensor from numpy"),
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": _unsupported("device tensor"),
}

#: The calls of torch's safe set that mean something for the weights, as pure functions of their
#: arguments. The pickle never holds these functions: it names globals, and the machine calls
#: the handler with fresh values each time, so nothing it does can change them.
TORCH_CALLS: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        **_REBUILDERS,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "collections.OrderedDict": _container(OrderedDict),
        "collections.Counter": _container(Counter),
        "builtins.set": _container(set),
        "builtins.bytearray": _bytearray,
        "builtins.complex": _complex,
        "_codecs.encode": _latin1_encode,
        "torch.Size": _container(tuple),
        "torch.device": _device,
        "torch.serialization._get_layout": lambda name: str(name),
    }
)

_QUANTIZED_STORAGES = (
    "QInt8Storage",
    "QUInt8Storage",
    "QInt32Storage",
    "QUInt4x2Storage",
    "QUInt2x4Storage",
    "TypedStorage",
    "UntypedStorage",
)


def storage_dtype(storage_type: Any) -> str | None:
    """The dtype a storage-type global holds (``torch.FloatStorage`` -> ``float32``)."""
    if not isinstance(storage_type, Global):
        return None
    cls = storage_type.name.rsplit(".", 1)[-1]
    prefix = storage_type.name[: -len(cls)]
    if prefix not in ("torch.", "torch.cuda.", "torch.storage."):
        return None
    if cls in _QUANTIZED_STORAGES:
        return "uint8"
    return STORAGE_DTYPES.get(cls)


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
    code = dtype.args[0] if isinstance(dtype, Opaque) and dtype.args else None
    state = dtype.state if isinstance(dtype, Opaque) else None
    order = ">" if isinstance(state, tuple) and len(state) > 1 and state[1] == ">" else "<"
    fmt = _NUMPY_FORMATS.get(code) if isinstance(code, str) else None
    if fmt and isinstance(data, bytes) and len(data) == struct.calcsize(order + fmt):
        return struct.unpack(order + fmt, data)[0]
    return f"<numpy scalar {code}>"


class _ArrayRecord:
    """A NumPy array as its pickle describes it (``_reconstruct`` then BUILD): shape and dtype,
    never the object; its bytes stay unread."""

    def __init__(self, *_args: Any) -> None:
        self.shape: list[Any] = []
        self.dtype = "?"

    def __pickle_build__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) >= 4:
            shape, dtype = state[1], state[2]
            self.shape = list(shape) if isinstance(shape, tuple) else []
            code = dtype.args[0] if isinstance(dtype, Opaque) and dtype.args else None
            self.dtype = code if isinstance(code, str) else "?"

    def to_dict(self) -> dict[str, Any]:
        return {"__class__": "numpy.ndarray", "shape": self.shape, "dtype": self.dtype}


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("path parts must be strings")
    return str(PurePosixPath(*parts)) if parts else "."


def _datetime(kind: type) -> Callable[..., str]:
    # datetime's pickle is its packed bytes (and a tzinfo); the stdlib type parses them.
    def decode(state: Any, *_tz: Any) -> str:
        if not isinstance(state, bytes):
            raise ValueError(f"{kind.__name__} state")
        return str(kind(state).isoformat())

    return decode


def _timedelta(days: Any = 0, seconds: Any = 0, micro: Any = 0) -> str:
    if not all(type(v) is int for v in (days, seconds, micro)):
        raise ValueError("timedelta state")
    return str(datetime.timedelta(days=days, seconds=seconds, microseconds=micro))


def _deque(items: Any = (), maxlen: Any = None) -> list[Any]:
    return list(items) if isinstance(items, (list, tuple)) else []


#: Classes ordinary checkpoints hold as plain data (a training script's ``args``, NumPy values,
#: paths, times): decoded from their pickled state by pure functions, never imported, so they
#: are read without being admitted. Anything else outside the safe set is still refused.
DATA_CALLS: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        "numpy.core.multiarray.scalar": _numpy_scalar,
        "numpy._core.multiarray.scalar": _numpy_scalar,
        "numpy.core.multiarray._reconstruct": _ArrayRecord,
        "numpy._core.multiarray._reconstruct": _ArrayRecord,
        "pathlib.PosixPath": _path,
        "pathlib.WindowsPath": _path,
        "pathlib.PurePosixPath": _path,
        "pathlib.PureWindowsPath": _path,
        "pathlib.Path": _path,
        "datetime.datetime": _datetime(datetime.datetime),
        "datetime.date": _datetime(datetime.date),
        "datetime.time": _datetime(datetime.time),
        "datetime.timedelta": _timedelta,
        "collections.defaultdict": lambda *args: {},
        "collections.deque": _deque,
        "builtins.frozenset": _container(frozenset),
        "builtins.bytes": _bytes,  # b'' below protocol 3 pickles as bytes()
    }
)

_DCP = "torch.distributed.checkpoint."
# The classes of DCP's own .metadata (torch's dataclasses and one enum): read as data, never
# imported, as the fields of the objects they describe.
DCP_METADATA_GLOBALS = frozenset(
    {
        _DCP + "metadata.Metadata",
        _DCP + "metadata.TensorStorageMetadata",
        _DCP + "metadata.BytesStorageMetadata",
        _DCP + "metadata.TensorProperties",
        _DCP + "metadata.ChunkStorageMetadata",
        _DCP + "metadata.MetadataIndex",
        _DCP + "metadata.StorageMeta",
        _DCP + "metadata._MEM_FORMAT_ENCODING",
        _DCP + "filesystem._StorageInfo",
        # Megatron's torch_dist (dist_checkpointing) caches its save plan in the metadata
        _DCP + "planner.SavePlan",
        _DCP + "planner.WriteItem",
        _DCP + "planner.WriteItemType",
        _DCP + "planner.TensorWriteData",
    }
)

#: Every data class: those decoded above, and those that only appear as values or are built
#: by NEWOBJ and BUILD (their state recorded as it is).
DATA_GLOBALS: frozenset[str] = (
    frozenset(DATA_CALLS)
    | DCP_METADATA_GLOBALS
    | {
        "argparse.Namespace",
        "numpy.dtype",
        "numpy.ndarray",
        # plain types, named as values (a defaultdict's factory): recorded, never called
        "builtins.int",
        "builtins.float",
        "builtins.str",
        "builtins.bool",
        "builtins.list",
        "builtins.dict",
        "builtins.tuple",
        "builtins.bytes",
    }
)


@dataclass
class PickleScan:
    """The result of reading one pickle statically."""

    root: Any
    run: PickleRun
    storages: dict[str, StorageRef] = field(default_factory=dict)
    safe: frozenset[str] = frozenset()

    @property
    def damaged(self) -> str | None:
        return self.run.damaged

    @property
    def globals(self) -> list[str]:
        """Every global the pickle names, in the order it first names them."""
        return list(self.run.globals)

    @property
    def unsafe_globals(self) -> list[str]:
        """Globals outside torch's safe set, in the order the pickle names them."""
        return [g for g in self.run.globals if g not in self.safe]


class _StorageLoader:
    """Interprets torch's persistent ids (``("storage", type, key, location, numel)``)."""

    def __init__(self, legacy: bool) -> None:
        self.legacy = legacy
        self.storages: dict[str, StorageRef] = {}

    def __call__(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise ValueError(f"unknown persistent id {pid!r}")
        storage_type, key, location, numel = pid[1:5]
        if self.legacy and len(pid) > 5 and pid[5] is not None:
            raise ValueError("legacy storage views (torch < 0.4) are not supported")
        dtype = storage_dtype(storage_type)
        if dtype is None:
            raise ValueError(f"storage of unknown type {storage_type!r}")
        if type(numel) is not int or numel < 0 or not isinstance(key, (str, int)):
            raise ValueError(f"storage record {pid[2:5]!r}")
        kind = storage_type.name.rsplit(".", 1)[-1] if isinstance(storage_type, Global) else ""
        ref = StorageRef(str(key), dtype, numel, _shared(str(location)), _shared(kind))
        known = self.storages.setdefault(ref.key, ref)
        if known is not ref and known != ref:
            raise ValueError(f"storage '{ref.key}' described twice, differently")
        return known


def read_pickle(
    data: PickleData,
    start: int = 0,
    *,
    legacy: bool = False,
    file_mode: bool = True,
) -> PickleScan:
    """Read one pickle statically.

    Args:
        data: the bytes holding the pickle (a memory map is fine).
        start: where the pickle begins; the scan's ``run.end`` says where it ended.
        legacy: storage records use the legacy (non-zip) form.
        file_mode: read as torch.load's unpickler reads (a file), not as ``pickle.loads``.

    Returns:
        The object tree with tensors as :class:`TensorStub`, the run's findings (``run.damaged``
        says when it could not be read to its end), the storages.
    """
    calls = {**TORCH_CALLS, **DATA_CALLS}
    loader = _StorageLoader(legacy)
    run = run_pickle(data, start, calls=calls, persistent_load=loader, file_mode=file_mode)
    return PickleScan(run.root, run, loader.storages, safe_globals())
