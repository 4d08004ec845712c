"""Every op and its inverse on real tensors: the inverse gives back the very bits
(inverse(op)(op(x)) == x), the shapes planned from headers are the shapes made, and an op
refuses what it cannot take before any tensor is read."""

from __future__ import annotations

import pytest
import torch
from helpers import bits
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import MappingError
from ckptkit.formats.base.layout import ZEROS, Layout
from ckptkit.formats.base.tensors import dtype_name
from ckptkit.mapping.layout import lay
from ckptkit.mapping.ops import Step, parse_op

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def step(text: str, names: dict | None = None, ranks: int | None = None) -> Step:
    return Step.bind(parse_op(text, "test"), names or {}, ranks, "rule 1 at 'k'")


def meta(value):
    if isinstance(value, list):
        return [meta(v) for v in value]
    return tuple(value.shape), dtype_name(value.dtype)


def run_planned(s: Step, values: list) -> list:
    """Run an op after planning it on the values' shapes: the plan must foresee the result,
    and the op laid out as byte ranges must give the very bytes it made (transpose and cast,
    which move single elements or compute, have no layout)."""
    planned, _ = s.plan([meta(v) for v in values])
    out = s.run(values)
    assert [meta(v) for v in out] == planned
    laid = laid_bytes(s, values)
    if s.call.name in ("transpose", "cast"):
        assert laid is None
    else:
        assert laid == as_bytes(out), s.call.text
    return out


def as_bytes(value):
    if isinstance(value, list):
        return [as_bytes(v) for v in value]
    return value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def laid_bytes(s: Step, values: list) -> list | None:
    """The op run by ``ckptkit.mapping.layout.lay`` on the values' layouts, each output's
    pieces then copied from the values' bytes; None when it has no layout. A ``same`` whose
    copies differ raises its error, as a conversion does once it reads them."""
    inputs: list[bytes] = []

    def layout_of(value):
        if isinstance(value, list):
            return [layout_of(v) for v in value]
        inputs.append(as_bytes(value))
        return Layout.of_input(len(inputs) - 1, value.shape, value.element_size())

    def made(layout):
        if isinstance(layout, list):
            return [made(t) for t in layout]
        got = b"".join(
            bytes(n) if slot == ZEROS else inputs[slot][at : at + n]
            for slot, at, n in layout.pieces
        )
        assert len(got) == layout.nbytes
        return got

    checks: list = []
    out = lay(s, [layout_of(v) for v in values], checks)
    for first, other, error in checks:
        if made(first) != made(other):
            raise error
    return None if out is None else made(out)


def same_bits(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list):
            if not isinstance(y, list) or not same_bits(x, y):
                return False
        elif bits(x) != bits(y):
            return False
    return True


def there_and_back(text: str, values: list, names: dict | None = None, ranks=None) -> None:
    forward = step(text, names, ranks)
    inverse_call = forward.call.inverse()
    assert inverse_call is not None
    back = Step.bind(inverse_call, names or {}, ranks, "rule 1 at 'k'")
    out = run_planned(forward, values)
    again = run_planned(back, out)
    assert same_bits(again, values), text


@st.composite
def tensors(draw, shape):
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), generator=gen)
    return raw.to(torch.uint8).view(dtype).reshape(shape)


dims = st.integers(1, 4)


@settings(max_examples=40, deadline=None)
@given(st.data(), dims, dims, st.integers(1, 4), st.integers(0, 1))
def test_gather_and_scatter_are_inverses(data, a, b, ranks, dim):
    whole = data.draw(tensors((a * ranks, b * ranks)))
    slices = list(whole.chunk(ranks, dim=dim))
    there_and_back(f"gather(dim={dim})", [slices], ranks=ranks)
    there_and_back(f"scatter(dim={dim})", [whole], ranks=ranks)


@settings(max_examples=30, deadline=None)
@given(st.data(), dims, st.integers(1, 4))
def test_same_and_replicate_are_inverses(data, n, ranks):
    t = data.draw(tensors((n, 3)))
    there_and_back("replicate()", [t], ranks=ranks)
    there_and_back("same()", [[t.clone() for _ in range(ranks)]], ranks=ranks)


@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(1, 3), st.lists(st.integers(0, 4), min_size=1, max_size=4))
def test_split_and_concat_by_sizes_and_groups_are_inverses(data, groups, sizes):
    total = sum(sizes) * groups
    t = data.draw(tensors((total, 2)))
    there_and_back(f"split(dim=0, sizes={sizes}, groups={groups})", [t])
    pieces = [data.draw(tensors((s * groups, 2))) for s in sizes]
    dtype = pieces[0].dtype
    pieces = [p.to(dtype) if p.dtype != dtype else p for p in pieces]
    if all(p.dtype == dtype for p in pieces):
        there_and_back(f"concat(dim=0, sizes={sizes}, groups={groups})", pieces)


def test_grouped_split_takes_each_groups_blocks_in_turn():
    """Megatron's fused q/k/v: per query group, its queries, then a key, then a value."""
    rows = torch.arange(2 * (4 + 1 + 1)).reshape(12, 1)  # 2 groups of [4 q, 1 k, 1 v]
    q, k, v = step("split(0, sizes=[4, 1, 1], groups=2)").run([rows])
    assert q.flatten().tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert k.flatten().tolist() == [4, 10] and v.flatten().tolist() == [5, 11]


@settings(max_examples=30, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3))
def test_permute_rope_and_its_inverse(data, heads, pairs, cols):
    t = data.draw(tensors((heads * pairs * 2, cols)))
    there_and_back(f"permute_rope(heads={heads})", [t])
    there_and_back(f"unpermute_rope(heads={heads})", [t])
    bias = data.draw(tensors((heads * pairs * 2,)))
    there_and_back(f"permute_rope(heads={heads})", [bias])


def test_permute_rope_is_transformers_permute():
    """transformers' convert_llama_weights_to_hf.permute, written out."""
    heads, dim1, dim2 = 4, 16, 3
    w = torch.randn(dim1, dim2)
    want = w.view(heads, dim1 // heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)
    (got,) = step(f"permute_rope(heads={heads})").run([w])
    assert torch.equal(got, want)


@settings(max_examples=30, deadline=None)
@given(st.data(), dims, dims, dims)
def test_stack_transpose_slice_pad_cast_are_undone(data, a, b, n):
    t = data.draw(tensors((a, b)))
    there_and_back("transpose(0, 1)", [t])
    there_and_back("stack(over=e)", [data.draw(tensors((a, b))).to(t.dtype) for _ in range(n)])
    there_and_back("unstack(over=e)", [data.draw(tensors((n, a, b)))])
    padded = torch.cat([t, torch.zeros((n, b), dtype=t.dtype)])
    there_and_back(f"slice(dim=0, size={a}, full={a + n})", [padded])
    floats = data.draw(tensors((a, b)))
    if floats.dtype.is_floating_point and floats.dtype != torch.float32:
        # widening is exact, so casting back gives the bits (NaN payloads aside)
        floats = torch.where(floats.isnan(), torch.zeros_like(floats), floats)
        there_and_back(f"cast('float32', back='{dtype_name(floats.dtype)}')", [floats])


@settings(max_examples=60, deadline=None)
@given(
    st.data(),
    st.lists(st.integers(1, 3), min_size=3, max_size=3),
    st.integers(0, 2),
    st.integers(1, 3),
    st.integers(1, 3),
)
def test_ops_along_any_dim_of_3d_tensors(data, shape, dim, ranks, groups):
    """Joining, cutting, slicing and padding along any dim: each outer slice's pieces in turn
    (what the layouts must get right beyond rows), there and back."""
    whole = list(shape)
    whole[dim] *= ranks * groups
    t = data.draw(tensors(tuple(whole)))
    there_and_back(f"scatter(dim={dim})", [t], ranks=ranks * groups)
    sizes = [shape[dim]] * ranks
    there_and_back(f"split(dim={dim}, sizes={sizes}, groups={groups})", [t])
    there_and_back(f"split(dim={dim}, parts={ranks}, groups={groups})", [t])
    run_planned(step(f"slice(dim={dim}, size={whole[dim] // groups})"), [t])
    there_and_back(f"pad(dim={dim}, size={whole[dim]}, full={whole[dim] + groups})", [t])


def test_a_layout_takes_ranges_across_its_pieces():
    """Pieces of pieces: a range that starts inside one piece and ends inside another, and
    zeros (pad) merged with zeros."""
    rows = [torch.arange(4 * i, 4 * i + 4, dtype=torch.int16).reshape(2, 2) for i in range(3)]
    padded = run_planned(step("pad(dim=1, size=2, full=3)"), [torch.cat(rows)])
    joined = run_planned(step("gather(dim=1)"), [rows])
    again = run_planned(step("permute_rope(heads=1)"), [joined[0]])
    assert padded[0][:, 2].eq(0).all() and again[0].shape == (2, 6)
    layout = Layout((6,), 2, [(0, 0, 4), (ZEROS, 0, 2), (ZEROS, 0, 2), (1, 8, 4)])
    assert layout.pieces == [(0, 0, 4), (ZEROS, 0, 4), (1, 8, 4)]
    assert layout.take(2, 8) == [(0, 2, 2), (ZEROS, 0, 4), (1, 8, 2)]
    assert layout.take(11, 1) == [(1, 11, 1)]


def test_drop_accounts_its_bytes_and_makes_nothing():
    s = step("drop(reason='rotary frequencies')")
    metas, lost = s.plan([((64,), "float32"), ((2, 3), "bfloat16")])
    assert metas == [] and lost == 64 * 4 + 2 * 3 * 2
    assert s.call.inverse() is None
    with pytest.raises(MappingError, match="reason, in words"):
        step("drop(reason='')").plan([((1,), "float32")])


def test_slice_counts_the_padding_it_cuts():
    metas, lost = step("slice(dim=0, size=10, full=12)").plan([((12, 4), "float16")])
    assert metas == [((10, 4), "float16")] and lost == 2 * 4 * 2


@pytest.mark.parametrize(
    ("text", "given", "needle"),
    [
        ("permute_rope(heads=3)", [((8, 2), "float32")], "is not 3 heads of pairs"),
        ("gather(dim=0)", [((8, 2), "float32")], "not one per rank"),
        ("gather(dim=1)", [[((8, 2), "float32"), ((4, 2), "float32")]], "differ beyond dim 1"),
        ("same()", [[((8, 2), "float32"), ((4, 2), "float32")]], "not copies"),
        ("concat(dim=0)", [[((8, 2), "float32")]], "one tensor per rank"),
        ("split(dim=0, sizes=[3, 3])", [((8, 2), "float32")], "add up to 6, but the dim is 8"),
        ("split(dim=0, parts=3)", [((8, 2), "float32")], "into 3 equal parts"),
        ("split(dim=2)", [((8, 2), "float32")], "not a dim of shape"),
        ("slice(dim=0, size=9)", [((8, 2), "float32")], "keeps 9 of dim 0"),
        ("pad(dim=0, size=8, full=4)", [((8, 2), "float32")], "which is smaller"),
        ("cast('int8')", [((8, 2), "float32")], "only floats are cast"),
        ("stack(over=e)", [((1,), "float32"), ((2,), "float32")], "different shapes"),
        ("require(n % 2 == 0, message='n is odd')", [((1,), "float32")], "n is odd"),
    ],
)
def test_ops_refuse_shapes_they_cannot_take(text, given, needle):
    with pytest.raises(MappingError) as caught:
        step(text, {"n": 3}, ranks=2).plan(given)
    message = str(caught.value)
    assert needle in message and message.startswith("rule 1 at 'k'"), message


def test_scatter_to_a_side_not_saved_per_rank_is_refused():
    with pytest.raises(MappingError, match="not saved per rank"):
        step("scatter(dim=0)", ranks=None).plan([((8, 2), "float32")])
    with pytest.raises(MappingError, match="does not split into 3 ranks"):
        step("scatter(dim=0)", ranks=3).plan([((8, 2), "float32")])


def test_same_refuses_ranks_whose_copies_differ():
    a = torch.ones(4)
    with pytest.raises(MappingError, match="rank 1's copy differs"):
        step("same()", ranks=2).run([[a, a + 1]])
