"""The comparison the other tests use as their oracle: ``bit_equal`` is true exactly when two
tensors have the same dtype, shape and bytes, and ``same_value`` extends it to what a state dict
holds beside dense tensors. Each case is judged against the bytes themselves (struct, raw uint8
views), not against ckptkit."""

from __future__ import annotations

import struct
import warnings

import pytest
import torch

from ckptkit.formats.base.tensors import bit_equal, same_value


def from_bits(dtype: torch.dtype, words: list[int]) -> torch.Tensor:
    """A tensor of ``dtype`` whose elements have exactly the given bit patterns."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    itemsize = torch.empty((), dtype=dtype).element_size()
    signed = [w - (1 << 8 * itemsize) if w >= 1 << (8 * itemsize - 1) else w for w in words]
    raw = torch.tensor(words if itemsize == 1 else signed, dtype=width[itemsize])
    return raw.view(dtype)


def test_the_same_bits_are_equal_and_one_flipped_bit_is_not():
    a = torch.randn(7, 5)
    assert bit_equal(a, a.clone())
    for index in (0, 17, 34):
        for bit in (0, 22, 31):  # the lowest mantissa bit, the highest, the sign
            b = a.clone()
            b.view(-1).view(torch.int32)[index] ^= 1 << bit
            assert not bit_equal(a, b), (index, bit)
            assert not bit_equal(b, a), (index, bit)


def test_negative_zero_is_not_zero():
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal as values...
    assert not bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # ...not as bits
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        zero, negative = torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=dtype)
        negative[1] = -0.0
        assert not bit_equal(zero, negative), dtype
        assert bit_equal(negative, negative.clone()), dtype


def test_nan_is_equal_to_itself_but_not_to_another_payload():
    quiet, payload, negative = 0x7FC00000, 0x7FC00001, 0xFFC00000
    for word in (quiet, payload, negative):
        value = struct.unpack("<f", struct.pack("<I", word))[0]
        assert value != value  # a NaN every time
    a = from_bits(torch.float32, [quiet, 0x3F800000])
    assert bit_equal(a, from_bits(torch.float32, [quiet, 0x3F800000]))  # NaN == NaN here
    assert not torch.equal(a, a.clone())  # as torch compares values, it never is
    assert not bit_equal(a, from_bits(torch.float32, [payload, 0x3F800000]))
    assert not bit_equal(a, from_bits(torch.float32, [negative, 0x3F800000]))
    half = from_bits(torch.float16, [0x7E00, 0x7E01])
    assert not bit_equal(half[:1], half[1:])
    brain = from_bits(torch.bfloat16, [0x7FC0, 0x7FC1])
    assert not bit_equal(brain[:1], brain[1:])


@pytest.mark.parametrize(
    ("dtype", "one", "other"),
    [
        (torch.bfloat16, 0x3F80, 0x3F81),  # 1.0 and the next bf16
        (torch.float16, 0x3C00, 0x3C01),
        (torch.float64, 0x3FF0000000000000, 0x3FF0000000000001),
        (torch.int64, 5, 6),
        (torch.int32, 0x7FFFFFFF, 0x7FFFFFFE),
        (torch.int8, 0x80, 0x7F),
        (torch.uint8, 255, 254),
        (torch.bool, 1, 0),
        (torch.float8_e4m3fn, 0x38, 0x39),
    ],
    ids=str,
)
def test_every_dtype_compares_its_bits(dtype, one, other):
    a = from_bits(dtype, [one, one, other])
    assert bit_equal(a, from_bits(dtype, [one, one, other]))
    assert not bit_equal(a, from_bits(dtype, [one, other, other]))
    assert not bit_equal(a, from_bits(dtype, [one, one, one]))


def test_the_same_bytes_in_another_dtype_or_shape_are_not_equal():
    a = torch.arange(6, dtype=torch.int32)
    assert not bit_equal(a, a.view(torch.float32))  # same bytes, another dtype
    assert not bit_equal(a, a.reshape(2, 3))  # same bytes, another shape
    assert not bit_equal(a.reshape(2, 3), a.reshape(3, 2))
    assert not bit_equal(torch.zeros(0), torch.zeros(0, 3))
    assert bit_equal(torch.zeros(0, 3), torch.ones(0, 3))  # no elements: nothing differs
    assert bit_equal(torch.tensor(2.5), torch.tensor(2.5))  # 0-d
    assert not bit_equal(torch.tensor(2.5), torch.tensor([2.5]))


def test_views_compare_by_their_elements_not_their_storage():
    base = torch.randn(4, 6)
    transposed = base.t()  # non-contiguous
    assert not transposed.is_contiguous()
    assert bit_equal(transposed, transposed.contiguous())
    assert bit_equal(base[:, 1::2], base.clone()[:, 1::2].contiguous())
    other = base.clone()
    other[3, 5] = -other[3, 5]  # an element the strided view shows
    assert not bit_equal(transposed, other.t())
    assert not bit_equal(base[:, 1::2], other[:, 1::2])
    hidden = base.clone()
    hidden[0, 0] += 1  # outside the view: not part of what is compared
    assert bit_equal(base[:, 1::2], hidden[:, 1::2])
    assert not bit_equal(base.t(), base)  # the same storage, other elements in other places
    assert bit_equal(base.expand(2, 4, 6), base.unsqueeze(0).repeat(2, 1, 1))


def test_same_value_of_plain_values_and_containers():
    assert same_value(3, 3) and same_value("a", "a") and same_value(None, None)
    assert not same_value(1, 1.0) and not same_value(1, True) and not same_value(0, False)
    assert not same_value("a", "b") and not same_value(2, 3)
    w = torch.randn(3)
    assert same_value((w, [1, "x"]), (w.clone(), [1, "x"]))
    assert not same_value((w, 1), [w, 1])  # a tuple is not a list
    assert not same_value((w,), (w, w))
    flipped = w.clone()
    flipped.view(torch.int32)[2] ^= 1
    assert not same_value((w, 1), (flipped, 1))
    assert not same_value(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_value(w, w.double())


def test_same_value_of_sparse_tensors():
    indices = torch.tensor([[0, 1, 2], [2, 0, 1]])
    values = torch.tensor([1.0, -0.0, 3.0])

    def coo(indices, values, shape):
        return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True)

    sparse = coo(indices, values, (3, 3))
    assert same_value(sparse, coo(indices, values.clone(), (3, 3)))
    # The same entries in another order: coalesced, they are the same tensor.
    order = torch.tensor([2, 0, 1])
    assert same_value(sparse, coo(indices[:, order], values[order], (3, 3)))
    assert not same_value(sparse, coo(indices, torch.tensor([1.0, 0.0, 3.0]), (3, 3)))  # -0.0
    assert not same_value(sparse, coo(indices, values, (3, 4)))
    assert not same_value(sparse, sparse.to_dense())
    with warnings.catch_warnings():  # deliberate: torch says CSR support is in beta
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        csr = sparse.to_dense().to_sparse_csr()
        assert same_value(csr, sparse.to_dense().to_sparse_csr())
        assert not same_value(csr, (sparse.to_dense() * 2).to_sparse_csr())


def _quantized(x, scale, zero_point):
    with warnings.catch_warnings():  # deliberate: torch deprecates making quantized tensors
        warnings.filterwarnings("ignore", ".*quantized tensor creation", UserWarning)
        if isinstance(scale, torch.Tensor):
            return torch.quantize_per_channel(x, scale, zero_point, 1, torch.qint8)
        return torch.quantize_per_tensor(x, scale, zero_point, torch.qint8)


def test_same_value_of_quantized_tensors():
    x = torch.randn(4, 3)
    q = _quantized(x, 0.1, 3)
    assert same_value(q, _quantized(x, 0.1, 3))
    assert not same_value(q, _quantized(x, 0.1, 4))  # the zero point
    assert not same_value(q, _quantized(x, 0.2, 3))  # the scale
    assert not same_value(q, _quantized(x + 1, 0.1, 3))  # the integer values
    scales, zeros = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64), torch.tensor([0, 1, 2])
    per_channel = _quantized(x, scales, zeros)
    assert same_value(per_channel, _quantized(x, scales, zeros))
    assert not same_value(per_channel, _quantized(x, scales * 2, zeros))
    assert not same_value(per_channel, _quantized(x, scales, zeros + 1))
    assert not same_value(per_channel, q)
