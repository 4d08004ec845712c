"""Small torch helpers shared by the readers and writers; torch is imported on first use."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from ckptkit.formats.dtypes import DTYPES

if TYPE_CHECKING:
    import torch

__all__ = ["torch_dtype", "dtype_name", "as_bytes", "bit_equal", "from_buffer"]


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
