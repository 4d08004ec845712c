"""Small torch helpers shared by the readers and writers; torch is imported on first use."""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ckptkit.formats.base.dtypes import DTYPES

if TYPE_CHECKING:
    import torch

__all__ = [
    "torch_dtype",
    "dtype_name",
    "as_bytes",
    "bit_equal",
    "same_value",
    "from_buffer",
    "with_versions",
]


def with_versions(state: OrderedDict[str, Any], versions: dict[str, Any]) -> None:
    """Give a state dict torch's per-module version records, as ``Module.state_dict()`` does
    (its ``_metadata`` attribute: quantized modules read them when loaded). Still a plain
    OrderedDict: torch's safe loader reads it back."""
    vars(state)["_metadata"] = versions


def torch_dtype(name: str) -> torch.dtype:
    """``float32`` -> ``torch.float32``."""
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (and without numpy).

    The view keeps the tensor alive, so ``as_bytes(t.contiguous())`` is safe.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("as_bytes needs a contiguous CPU tensor")
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array.owner = tensor  # type: ignore[attr-defined]  # the view holds the array, it the tensor
    return memoryview(array).cast("B")


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape and the same bytes (so NaNs and -0.0 compare exactly)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(_raw(a), _raw(b))


def same_value(a: Any, b: Any) -> bool:
    """Bit-exact equality of what a state dict may hold beside dense tensors: sparse tensors
    (layout, shape and every stored index and value), quantized ones (integer values and
    quantizer), tuples of them (packed parameters), and plain values."""
    import torch

    if isinstance(a, tuple | list) or isinstance(b, tuple | list):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_value(x, y) for x, y in zip(a, b, strict=True))
        )
    if not (torch.is_tensor(a) and torch.is_tensor(b)):
        return bool(a == b) and type(a) is type(b)
    plain = (torch.Tensor, torch.nn.Parameter)
    if type(a) not in plain or type(b) not in plain:  # a subclass (torchao): its inner tensors
        if type(a) is not type(b) or not hasattr(a, "__tensor_flatten__"):
            return False
        (names, context), (names_b, context_b) = (
            a.__tensor_flatten__(),
            b.__tensor_flatten__(),  # type: ignore[attr-defined]
        )
        return (
            names == names_b
            and repr(context) == repr(context_b)
            and all(same_value(getattr(a, n), getattr(b, n)) for n in names)
        )
    if a.layout != b.layout or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_quantized:
        scheme = a.qscheme()
        if scheme != b.qscheme() or not bit_equal(a.int_repr(), b.int_repr()):
            return False
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            return (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point())
        return (
            bit_equal(a.q_per_channel_scales(), b.q_per_channel_scales())
            and bit_equal(a.q_per_channel_zero_points(), b.q_per_channel_zero_points())
            and a.q_per_channel_axis() == b.q_per_channel_axis()
        )
    if a.layout == torch.sparse_coo:
        a, b = a.coalesce(), b.coalesce()
        return bit_equal(a.indices(), b.indices()) and bit_equal(a.values(), b.values())
    if a.layout != torch.strided:  # compressed layouts: compare the dense values they hold
        return bit_equal(a.to_dense(), b.to_dense())
    return bit_equal(a, b)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def from_buffer(buffer: object, offset: int, nbytes: int, dtype: str) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` over ``buffer[offset:offset + nbytes]``.

    Shares memory with the buffer when ``offset`` suits the dtype's alignment, copies otherwise.
    """
    import torch

    target = torch_dtype(dtype)
    if nbytes == 0:
        return torch.empty(0, dtype=target)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    if offset % DTYPES[dtype].itemsize:
        raw = raw.clone()
    return raw.view(target)
