"""The globals torch's ``weights_only`` loader admits, as a table that needs no torch import.

The table is generated from torch itself (``torch._weights_only_unpickler._get_allowed_globals``):
``python -m ckptkit.formats.pickles.safe_globals`` rewrites it from the installed torch, and a test
fails when the two differ. :func:`safe_globals` adds what the running process registered with
``torch.serialization.add_safe_globals`` when torch is already imported (importing it just for
that would cost a second).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["TORCH_SAFE_GLOBALS", "safe_globals", "generate"]

# BEGIN GENERATED
# from torch 2.13.0+cpu
TORCH_SAFE_GLOBALS: frozenset[str] = frozenset(
    {
        "_codecs.encode",
        "builtins.bytearray",
        "builtins.complex",
        "builtins.set",
        "collections.Counter",
        "collections.OrderedDict",
        "torch.BFloat16Storage",
        "torch.BFloat16Tensor",
        "torch.BoolStorage",
        "torch.BoolTensor",
        "torch.ByteStorage",
        "torch.ByteTensor",
        "torch.CharStorage",
        "torch.CharTensor",
        "torch.ComplexDoubleStorage",
        "torch.ComplexFloatStorage",
        "torch.DoubleStorage",
        "torch.DoubleTensor",
        "torch.FloatStorage",
        "torch.FloatTensor",
        "torch.HalfStorage",
        "torch.HalfTensor",
        "torch.IntStorage",
        "torch.IntTensor",
        "torch.LongStorage",
        "torch.LongTensor",
        "torch.QInt32Storage",
        "torch.QInt8Storage",
        "torch.QUInt2x4Storage",
        "torch.QUInt4x2Storage",
        "torch.QUInt8Storage",
        "torch.ShortStorage",
        "torch.ShortTensor",
        "torch.Size",
        "torch.Tensor",
        "torch._tensor._rebuild_from_type_v2",
        "torch._utils._rebuild_device_tensor_from_cpu_tensor",
        "torch._utils._rebuild_device_tensor_from_numpy",
        "torch._utils._rebuild_meta_tensor_no_storage",
        "torch._utils._rebuild_nested_tensor",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._utils._rebuild_qtensor",
        "torch._utils._rebuild_sparse_tensor",
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_wrapper_subclass",
        "torch.bfloat16",
        "torch.bits16",
        "torch.bits1x8",
        "torch.bits2x4",
        "torch.bits4x2",
        "torch.bits8",
        "torch.bool",
        "torch.complex128",
        "torch.complex32",
        "torch.complex64",
        "torch.cuda.BFloat16Storage",
        "torch.cuda.BFloat16Tensor",
        "torch.cuda.BoolStorage",
        "torch.cuda.BoolTensor",
        "torch.cuda.ByteStorage",
        "torch.cuda.ByteTensor",
        "torch.cuda.CharStorage",
        "torch.cuda.CharTensor",
        "torch.cuda.ComplexDoubleStorage",
        "torch.cuda.ComplexFloatStorage",
        "torch.cuda.DoubleStorage",
        "torch.cuda.DoubleTensor",
        "torch.cuda.FloatStorage",
        "torch.cuda.FloatTensor",
        "torch.cuda.HalfStorage",
        "torch.cuda.HalfTensor",
        "torch.cuda.IntStorage",
        "torch.cuda.IntTensor",
        "torch.cuda.LongStorage",
        "torch.cuda.LongTensor",
        "torch.cuda.ShortStorage",
        "torch.cuda.ShortTensor",
        "torch.cuda.sparse.BFloat16Tensor",
        "torch.cuda.sparse.ByteTensor",
        "torch.cuda.sparse.CharTensor",
        "torch.cuda.sparse.DoubleTensor",
        "torch.cuda.sparse.FloatTensor",
        "torch.cuda.sparse.HalfTensor",
        "torch.cuda.sparse.IntTensor",
        "torch.cuda.sparse.LongTensor",
        "torch.cuda.sparse.ShortTensor",
        "torch.device",
        "torch.float16",
        "torch.float32",
        "torch.float4_e2m1fn_x2",
        "torch.float64",
        "torch.float8_e4m3fn",
        "torch.float8_e4m3fnuz",
        "torch.float8_e5m2",
        "torch.float8_e5m2fnuz",
        "torch.float8_e8m0fnu",
        "torch.int1",
        "torch.int16",
        "torch.int2",
        "torch.int3",
        "torch.int32",
        "torch.int4",
        "torch.int5",
        "torch.int6",
        "torch.int64",
        "torch.int7",
        "torch.int8",
        "torch.nn.parameter.Parameter",
        "torch.per_channel_affine",
        "torch.per_channel_affine_float_qparams",
        "torch.per_channel_symmetric",
        "torch.per_tensor_affine",
        "torch.per_tensor_symmetric",
        "torch.qint32",
        "torch.qint8",
        "torch.quint2x4",
        "torch.quint4x2",
        "torch.quint8",
        "torch.serialization._get_layout",
        "torch.sparse.BFloat16Tensor",
        "torch.sparse.ByteTensor",
        "torch.sparse.CharTensor",
        "torch.sparse.DoubleTensor",
        "torch.sparse.FloatTensor",
        "torch.sparse.HalfTensor",
        "torch.sparse.IntTensor",
        "torch.sparse.LongTensor",
        "torch.sparse.ShortTensor",
        "torch.storage.TypedStorage",
        "torch.storage.UntypedStorage",
        "torch.uint1",
        "torch.uint16",
        "torch.uint2",
        "torch.uint3",
        "torch.uint32",
        "torch.uint4",
        "torch.uint5",
        "torch.uint6",
        "torch.uint64",
        "torch.uint7",
        "torch.uint8",
    }
)
# END GENERATED


def safe_globals() -> frozenset[str]:
    """torch's ``weights_only`` allow-list, plus the process's own registrations when torch is
    already imported."""
    torch = sys.modules.get("torch")
    serialization = getattr(torch, "serialization", None)
    if serialization is None or not hasattr(serialization, "get_safe_globals"):
        return TORCH_SAFE_GLOBALS
    extra = set()
    for item in serialization.get_safe_globals():
        obj = item[0] if isinstance(item, tuple) else item
        name = item[1] if isinstance(item, tuple) else None
        extra.add(name or f"{obj.__module__}.{obj.__qualname__}")
    return TORCH_SAFE_GLOBALS | extra


def generate() -> list[str]:
    """The allow-list of the installed torch, sorted (imports torch)."""
    from torch._weights_only_unpickler import _get_allowed_globals

    return sorted(_get_allowed_globals())


def _write() -> None:
    path = Path(__file__)
    text = path.read_text()
    head, rest = text.split("# BEGIN GENERATED\n")
    _, tail = rest.split("# END GENERATED\n")
    import torch

    body = [f"# from torch {torch.__version__}", "TORCH_SAFE_GLOBALS: frozenset[str] = frozenset("]
    body += [
        "    {",
        *(f'        "{name}",' for name in generate()),
        "    }",
        ")",
    ]  # as ruff lays it
    path.write_text(head + "# BEGIN GENERATED\n" + "\n".join(body) + "\n# END GENERATED\n" + tail)


if __name__ == "__main__":
    _write()
