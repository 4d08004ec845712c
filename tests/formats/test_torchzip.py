"""torch's zip format written by ckptkit: read back by torch itself and by zipfile."""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch

from ckptkit.formats.base.dtypes import TensorSpec
from ckptkit.formats.base.tensors import as_bytes, bit_equal, dtype_name
from ckptkit.formats.files.torchzip import ALIGNMENT, begin_archive, state_pickle
from ckptkit.storage.bytecopy import write_all

STATE = {
    "a": torch.arange(6.0).reshape(2, 3),
    "b": torch.tensor([1, -2], dtype=torch.int64),
    "c": torch.ones(3, dtype=torch.bfloat16),
    "empty": torch.zeros(0, 4),
    "scalar": torch.tensor(7, dtype=torch.int16),
    "f8": torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn),
}


def _write(fd: int, state: dict[str, torch.Tensor], aliases=None, *, zip64=False, bare=False):
    specs = [TensorSpec(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in state.items()]
    pickled, storages = state_pickle(specs, aliases, bare=bare)
    archive = begin_archive(fd, pickled, zip64=zip64)
    starts = {}
    for spec in specs:
        record = storages[spec.key]
        if record.key not in starts:
            data = as_bytes(state[spec.key].contiguous())
            starts[record.key] = archive.add_stream(
                f"data/{record.key}", spec.nbytes, lambda data=data: write_all(fd, data)
            )
    return archive.finish(), starts


@pytest.mark.parametrize("zip64", [False, True])
def test_torch_loads_what_is_written(tmp_path, zip64):
    path = tmp_path / "o.pt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        length, starts = _write(fd, STATE, zip64=zip64)
    finally:
        os.close(fd)
    assert length == path.stat().st_size
    assert all(start % ALIGNMENT == 0 for start in starts.values())
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert list(loaded) == list(STATE)
        for key, tensor in STATE.items():
            assert loaded[key].dtype == tensor.dtype
            assert bit_equal(loaded[key], tensor)
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        assert names[:4] == [
            f"archive/{n}"
            for n in ("data.pkl", ".format_version", ".storage_alignment", "byteorder")
        ]
        assert names[-2:] == ["archive/version", "archive/.data/serialization_id"]
        assert zf.read("archive/data.pkl")  # the small records carry real CRCs
        assert zf.read("archive/version") == b"3\n"


def test_ties_share_one_storage(tmp_path):
    path = tmp_path / "tied.pt"
    weight = torch.randn(4, 3)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        _write(fd, {"emb": weight, "head": weight}, {"head": "emb"})
    finally:
        os.close(fd)
    loaded = torch.load(path, weights_only=True)
    assert loaded["emb"].untyped_storage().data_ptr() == loaded["head"].untyped_storage().data_ptr()
    assert torch.equal(loaded["head"], weight)


def test_an_archive_inside_a_file_reads_from_its_own_start(tmp_path):
    """How DCP keeps each chunk: one archive after another in a .distcp file."""
    path = tmp_path / "chunks"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    spans = []
    try:
        os.write(fd, b"x" * 100)  # the archive starts at no particular alignment
        for tensor in (torch.arange(5.0), torch.ones(2, 2, dtype=torch.float16)):
            start = os.lseek(fd, 0, os.SEEK_CUR)
            length, _ = _write(fd, {"t": tensor}, bare=True)
            spans.append((start, length, tensor))
    finally:
        os.close(fd)
    raw = path.read_bytes()
    for start, length, tensor in spans:
        loaded = torch.load(io.BytesIO(raw[start : start + length]), weights_only=True)
        assert torch.equal(loaded, tensor)
