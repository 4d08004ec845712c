"""DCP folders read as a Source (issue 12, item 1 so far): the flattened state unflattened, the
model's state dict found, row shards copied as bytes and other layouts assembled through torch,
all bit for bit what torch's own ``dcp_to_torch_save`` gives; damaged folders refused.

The folders under ``fixtures/dcp`` were written by ``dcp.save`` from 2 ranks (``make_dcp.py``).
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from helpers import FIXTURE_DIR, bits, dcp_to_torch, no_torch_imported, single_process_dcp
from safetensors.torch import load_file, load_model

import ckptkit
from ckptkit.errors import FormatError

DCP = FIXTURE_DIR / "dcp"
LIGHTNING = "lightning/epoch=0-step=3.ckpt"  # Lightning's FSDP strategy folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What torch's own dcp_to_torch_save makes of each fixture folder."""
    return {
        name: dcp_to_torch(DCP / name, tmp_path_factory.mktemp("ref"))
        for name in ("fsdp2", "columns", LIGHTNING)
    }


@pytest.mark.parametrize("name", ["fsdp2", "columns"])
def test_conversion_equals_dcp_to_torch_save(name, reference, tmp_path):
    report = ckptkit.convert(DCP / name, tmp_path / "out.safetensors")
    assert report.verified and report.selected == "model"
    written = load_file(tmp_path / "out.safetensors")
    expected = reference[name]["model"]
    assert {k: bits(v) for k, v in written.items()} == {k: bits(v) for k, v in expected.items()}
    # Row shards are byte ranges of their tensor, copied range by range; column shards are
    # written from views of their chunks: none goes through torch.
    assert (report.copied, report.through_torch) == (len(expected), 0)


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
    assert {k: bits(v) for k, v in written.items()} == {
        k: bits(v) for k, v in reference["fsdp2"]["model"].items()
    }
    state = ckptkit.load_state_dict(DCP / "fsdp2", select="optim.state.1.weight")
    assert bits(state["exp_avg"]) == bits(
        reference["fsdp2"]["optim"]["state"]["1.weight"]["exp_avg"]
    )


def test_load_into_a_plain_model(reference, tmp_path):
    from make_dcp import build_model

    expected = reference["fsdp2"]["model"]  # torch's own dcp_to_torch_save
    model = build_model()
    before = {k: bits(v) for k, v in model.state_dict().items()}
    assert before != {k: bits(v) for k, v in expected.items()}  # so loading has work to do
    report = ckptkit.load_into(model, DCP / "fsdp2")
    assert report.loaded == 5
    assert {k: bits(v) for k, v in model.state_dict().items()} == {
        k: bits(v) for k, v in expected.items()
    }
    # diff finds the folder equal to torch's conversion of it, and not to one changed by an ulp.
    torch.save(expected, tmp_path / "ref.pt")
    assert ckptkit.diff(DCP / "fsdp2", tmp_path / "ref.pt").equal
    key = next(k for k, v in expected.items() if v.is_floating_point() and v.numel() > 1)
    changed = {k: v.clone() for k, v in expected.items()}
    changed[key].view(-1)[-1] = torch.nextafter(changed[key].view(-1)[-1], torch.tensor(1e9))
    torch.save(changed, tmp_path / "changed.pt")
    report = ckptkit.diff(DCP / "fsdp2", tmp_path / "changed.pt")
    assert not report.equal and [t.key for t in report.different] == [key]


@pytest.mark.parametrize(("name", "count"), [("fsdp2", 5), ("hf", 6)])
def test_inspect_reads_the_folder_without_importing_torch(name, count):
    no_torch_imported(
        "from ckptkit.summary import summarize\n"
        f"assert len(summarize({str(DCP / name)!r}).tensors) == {count}"
    )


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
    from ckptkit.formats.folders.chunks import Chunk, ChunkedTensor, check_cover, contiguous_start

    def tensor(*chunks):
        return ChunkedTensor(
            "w", "float32", (4, 6), [Chunk(o, s, tmp_path, 0, 1) for o, s in chunks]
        )

    check_cover(tmp_path, tensor(((0, 0), (2, 6)), ((2, 0), (2, 6))))
    with pytest.raises(FormatError, match="does not hold all of 'w' \\(12 of 24"):
        check_cover(tmp_path, tensor(((0, 0), (2, 6))))
    with pytest.raises(FormatError, match="overlapping chunks of 'w'"):
        check_cover(tmp_path, tensor(((0, 0), (3, 6)), ((2, 0), (2, 6))))
    with pytest.raises(FormatError, match="outside its shape"):
        check_cover(tmp_path, tensor(((0, 0), (5, 6))))
    rows, cols = Chunk((2, 0), (2, 6), tmp_path, 0, 1), Chunk((0, 3), (4, 3), tmp_path, 0, 1)
    assert contiguous_start((4, 6), rows) == 12 and contiguous_start((4, 6), cols) is None
    one_row_part = Chunk((1, 2), (1, 3), tmp_path, 0, 1)
    assert contiguous_start((4, 6), one_row_part) == 8


def test_lightning_fsdp_folder_converts_with_its_trainer_state(reference, tmp_path, run):
    summary = ckptkit.summarize(DCP / LIGHTNING)
    assert summary.common_prefix == "model."
    assert summary.extras["global_step"] == 3 and summary.extras["hyper_parameters"] == {"lr": 0.01}
    assert [part.path for part in summary.dropped] == ["optimizer_0"]
    result = run("convert", DCP / LIGHTNING, "lit.safetensors", "--strip-prefix", "model.")
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "lit.safetensors")
    assert {k: bits(v) for k, v in written.items()} == {
        k.removeprefix("model."): bits(v) for k, v in reference[LIGHTNING]["model"].items()
    }
    sys.path.insert(0, str(FIXTURE_DIR))
    from make_dcp import inner_model  # what the LightningModule holds; lightning not needed

    net = inner_model()
    missing, unexpected = load_model(net, tmp_path / "lit.safetensors")
    assert not missing and not unexpected


# DCP's Hugging Face writer: one safetensors file per rank, chunk offsets in its header.


def test_hf_writer_folder_equals_consolidate_safetensors_files(tmp_path, run):
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    keys = ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias", "h"]
    (tmp_path / "torch").mkdir()
    with single_process_dcp():  # torch's consolidation loads through dcp in this process
        consolidate_safetensors_files(
            str(DCP / "hf"), str(tmp_path / "torch"), dict.fromkeys(keys, 1)
        )
    expected = load_file(tmp_path / "torch" / "model-00001-of-00001.safetensors")
    assert expected["h"].dtype == torch.bfloat16 and expected["0.weight"].shape == (10, 6)
    result = run("convert", DCP / "hf", "out.safetensors", "--json")
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "out.safetensors")
    assert {k: bits(v) for k, v in written.items()} == {k: bits(v) for k, v in expected.items()}
    report = ckptkit.convert(DCP / "hf", tmp_path / "again.safetensors")
    assert report.verified and report.copied == 6  # row shards as ranges, "h" by column views
    # torch's own reader of the flavour agrees with what ckptkit reads from it
    state = {k: torch.empty_like(v) for k, v in expected.items()}
    with single_process_dcp():
        reader = HuggingFaceStorageReader(str(DCP / "hf"))
        torch.distributed.checkpoint.load(state, storage_reader=reader, no_dist=True)
    assert {k: bits(v) for k, v in state.items()} == {k: bits(v) for k, v in written.items()}


def test_hf_writer_missing_rank_or_foreign_file_is_refused(tmp_path, run):
    folder = tmp_path / "hf"
    shutil.copytree(DCP / "hf", folder)
    (folder / "shard-00001-model-00001-of-00001.safetensors").unlink()
    result = run("convert", folder, "out.safetensors")
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    assert "does not hold all of '0.weight'" in result.stderr, result.stderr
    assert not (tmp_path / "out.safetensors").exists()
    # a safetensors file that is not a DCP shard among the shards
    shutil.copy(
        FIXTURE_DIR / "single.safetensors", folder / "shard-00001-model-00001-of-00001.safetensors"
    )
    with pytest.raises(FormatError, match="no valid DCP_SHARDING_INFO"):
        ckptkit.summarize(folder)


def test_hf_writer_truncated_shard_is_refused(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(DCP / "hf", folder)
    shard = folder / "shard-00002-model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(FormatError, match="truncated"):
        ckptkit.convert(folder, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_one_hf_writer_shard_alone_is_refused_with_its_folder(run):
    shard = DCP / "hf" / "shard-00002-model-00001-of-00001.safetensors"
    result = run("inspect", shard)
    assert result.exit_code == 1
    assert "one rank's shard of a DCP checkpoint" in result.stderr
    assert f"give the folder that holds every rank's file: {DCP / 'hf'}" in result.stderr
