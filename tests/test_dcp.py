"""DCP folders read as a Source (issue 12, item 1 so far): the flattened state unflattened, the
model's state dict found, row shards copied as bytes and other layouts assembled through torch,
all bit for bit what torch's own ``dcp_to_torch_save`` gives; damaged folders refused.

The folders under ``fixtures/dcp`` were written by ``dcp.save`` from 2 ranks (``make_dcp.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import FIXTURE_DIR, ROOT
from safetensors.torch import load_file, load_model

import ckptkit
from ckptkit.errors import FormatError

DCP = FIXTURE_DIR / "dcp"
LIGHTNING = "lightning/epoch=0-step=3.ckpt"  # Lightning's FSDP strategy folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What torch's own dcp_to_torch_save makes of each fixture folder."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for name in ("fsdp2", "columns", LIGHTNING):
        path = tmp_path_factory.mktemp("ref") / "ref.pt"
        dcp_to_torch_save(DCP / name, path)
        out[name] = torch.load(path, weights_only=True)
    return out


def _bits(t):
    return t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("name", ["fsdp2", "columns"])
def test_conversion_equals_dcp_to_torch_save(name, reference, tmp_path):
    report = ckptkit.convert(DCP / name, tmp_path / "out.safetensors")
    assert report.verified and report.selected == "model"
    written = load_file(tmp_path / "out.safetensors")
    expected = reference[name]["model"]
    assert {k: _bits(v) for k, v in written.items()} == {k: _bits(v) for k, v in expected.items()}
    # Row shards are byte ranges of their tensor: copied without torch. Column shards are not.
    assert report.copied == (len(expected) if name == "fsdp2" else 1)  # "b" is replicated


def test_the_training_checkpoint_view(reference, tmp_path, run):
    summary = ckptkit.summarize(DCP / "fsdp2")
    assert summary.format == "dcp" and summary.selected == "model"
    assert summary.extras["step"] == 3 and summary.extras["extra"] == {
        "lr": 0.01,
        "name": "ckptkit",
    }
    assert [part.path for part in summary.dropped] == ["optim"]
    assert {p["name"] for p in summary.parts} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
    result = run("convert", DCP / "fsdp2" / ".metadata", "model.pt")  # the .metadata names it too
    assert result.exit_code == 0, result.output
    written = torch.load(tmp_path / "model.pt", weights_only=True)
    assert {k: _bits(v) for k, v in written.items()} == {
        k: _bits(v) for k, v in reference["fsdp2"]["model"].items()
    }
    state = ckptkit.load_state_dict(DCP / "fsdp2", select="optim.state.1.weight")
    assert _bits(state["exp_avg"]) == _bits(
        reference["fsdp2"]["optim"]["state"]["1.weight"]["exp_avg"]
    )


def test_load_into_a_plain_model():
    sys.path.insert(0, str(FIXTURE_DIR))
    from make_dcp import build_model

    model = build_model()
    report = ckptkit.load_into(model, DCP / "fsdp2")
    assert report.loaded == 5
    assert ckptkit.diff(DCP / "fsdp2", DCP / "fsdp2").equal


def test_inspect_reads_the_folder_without_importing_torch():
    code = (
        "import sys; from ckptkit.summary import summarize; "
        f"s = summarize({str(DCP / 'fsdp2')!r}); "
        "assert len(s.tensors) == 5; assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def folder(tmp_path):
    copy = tmp_path / "ck"
    shutil.copytree(DCP / "fsdp2", copy)
    return copy


def test_a_missing_rank_file_is_named_and_nothing_written(folder, tmp_path, run):
    (folder / "__1_0.distcp").unlink()
    result = run("convert", folder, "out.safetensors")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "__1_0.distcp is missing" in result.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_a_truncated_rank_file_is_refused(folder, tmp_path):
    data = (folder / "__1_0.distcp").read_bytes()
    (folder / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="truncated|damaged"):
        ckptkit.convert(folder, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_chunks_that_do_not_cover_or_overlap_are_refused(tmp_path):
    from ckptkit.formats.dcp import _check_cover, _Chunk, _contiguous_start, _Tensor

    def tensor(*chunks):
        return _Tensor("w", "float32", (4, 6), [_Chunk(o, s, tmp_path, 0, 1) for o, s in chunks])

    _check_cover(tmp_path, tensor(((0, 0), (2, 6)), ((2, 0), (2, 6))))
    with pytest.raises(FormatError, match="does not hold all of 'w' \\(12 of 24"):
        _check_cover(tmp_path, tensor(((0, 0), (2, 6))))
    with pytest.raises(FormatError, match="overlapping chunks of 'w'"):
        _check_cover(tmp_path, tensor(((0, 0), (3, 6)), ((2, 0), (2, 6))))
    with pytest.raises(FormatError, match="outside its shape"):
        _check_cover(tmp_path, tensor(((0, 0), (5, 6))))
    rows, cols = _Chunk((2, 0), (2, 6), tmp_path, 0, 1), _Chunk((0, 3), (4, 3), tmp_path, 0, 1)
    assert _contiguous_start((4, 6), rows) == 12 and _contiguous_start((4, 6), cols) is None
    one_row_part = _Chunk((1, 2), (1, 3), tmp_path, 0, 1)
    assert _contiguous_start((4, 6), one_row_part) == 8


def test_lightning_fsdp_folder_converts_with_its_trainer_state(reference, tmp_path, run):
    summary = ckptkit.summarize(DCP / LIGHTNING)
    assert summary.common_prefix == "model."
    assert summary.extras["global_step"] == 3 and summary.extras["hyper_parameters"] == {"lr": 0.01}
    assert [part.path for part in summary.dropped] == ["optimizer_0"]
    result = run("convert", DCP / LIGHTNING, "lit.safetensors", "--strip-prefix", "model.")
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "lit.safetensors")
    assert {k: _bits(v) for k, v in written.items()} == {
        k.removeprefix("model."): _bits(v) for k, v in reference[LIGHTNING]["model"].items()
    }
    sys.path.insert(0, str(FIXTURE_DIR))
    from make_dcp import inner_model  # what the LightningModule holds; lightning not needed

    net = inner_model()
    missing, unexpected = load_model(net, tmp_path / "lit.safetensors")
    assert not missing and not unexpected
