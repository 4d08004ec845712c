"""One torch.save per rank of an FSDP2 model (DTensor values), merged statically: the same tensors
torch's own dcp_to_torch_save gives for the DCP save of the same state, bit for bit.

``fixtures/dcp/ranks`` and ``fixtures/dcp/fsdp2`` hold the same FSDP2 state after one Adam step,
saved per rank with torch.save and with dcp.save (``make_dcp.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from helpers import FIXTURE_DIR, bits, dcp_to_torch, no_torch_imported
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import FormatError

DCP = FIXTURE_DIR / "dcp"
RANKS = DCP / "ranks"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """torch's own dcp_to_torch_save of the DCP saves of the same state."""
    return {n: dcp_to_torch(DCP / n, tmp_path_factory.mktemp("ref")) for n in ("fsdp2", "columns")}


@pytest.mark.parametrize("given", [RANKS, RANKS / "model_rank*.pt"], ids=["folder", "glob"])
def test_rank_files_merge_to_what_dcp_holds(given, reference, tmp_path, run):
    result = run("convert", str(given), "out.safetensors")
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "out.safetensors")
    expected = reference["fsdp2"]["model"]
    assert {k: bits(v) for k, v in written.items()} == {k: bits(v) for k, v in expected.items()}
    assert "Copied   5 of 5 tensors as bytes" in result.output  # row shards: no torch


def test_the_training_checkpoint_view_and_other_layouts(reference, tmp_path):
    summary = ckptkit.summarize(RANKS)
    assert summary.format == "rank files" and summary.selected == "model"
    assert summary.extras["step"] == 3
    assert sorted(part.path for part in summary.dropped) == ["columns", "optim"]
    # Adam's state is sharded the same way: merged too
    state = ckptkit.load_state_dict(RANKS, select="optim.state.1.weight")
    expected = reference["fsdp2"]["optim"]["state"]["1.weight"]
    assert bits(state["exp_avg"]) == bits(expected["exp_avg"])
    # column shards (Shard(1), bf16) written from views of their chunks, and a replicated
    # tensor copied as its one range: none through torch
    report = ckptkit.convert(RANKS, tmp_path / "cols.safetensors", select="columns")
    assert report.verified and (report.copied, report.through_torch) == (3, 0)
    written = load_file(tmp_path / "cols.safetensors")
    columns = reference["columns"]["model"]
    assert {k: bits(v) for k, v in written.items()} == {k: bits(v) for k, v in columns.items()}


def test_a_missing_rank_is_refused_and_nothing_written(tmp_path, run):
    folder = tmp_path / "ranks"
    shutil.copytree(RANKS, folder)
    (folder / "model_rank1.pt").unlink()
    result = run("convert", folder, "out.safetensors")
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    assert "does not hold all of 'model.0.weight' (30 of 60 elements)" in result.stderr
    assert "a rank's file is missing" in result.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_one_rank_file_alone_names_the_set(run, tmp_path):
    # torch admits DTensor's classes once torch.distributed.tensor is imported: then the file
    # opens, and the refusal comes from its DTensor values; the hint is the same either way.
    import torch.distributed.tensor  # noqa: F401 - torch's safe set now admits DTensor

    result = run("convert", RANKS / "model_rank1.pt", "out.safetensors")
    assert result.exit_code == 1
    assert "model_rank1.pt is one rank's part of a sharded save (DTensors)" in result.stderr
    assert f"a glob such as '{RANKS / 'model_rank*.pt'}'" in result.stderr
    code = f"from ckptkit.cli import main; main(['convert', {str(RANKS / 'model_rank1.pt')!r}, 'x.safetensors'])"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 1 and "one rank's part of a sharded save" in done.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_files_of_two_saves_or_two_sets_are_refused(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(RANKS / "model_rank0.pt", mixed / "model_rank0.pt")
    shutil.copy(DCP / "fsdp1_ranks" / "model_rank1.pt", mixed / "other_rank1.pt")
    with pytest.raises(FormatError, match="several sets of rank files"):
        ckptkit.summarize(mixed)
    torch.save({"model": {"0.weight": torch.zeros(10, 6)}}, mixed / "model_rank1.pt")
    with pytest.raises(FormatError, match="differ in|holds '"):
        ckptkit.summarize(mixed / "model_rank*.pt")
    with pytest.raises(FormatError, match="matches no file"):
        ckptkit.summarize(tmp_path / "nothing_rank*.pt")


def test_fsdp1_sharded_state_dicts_merge_to_the_full_model(tmp_path, run):
    """FSDP1's SHARDED_STATE_DICT, one torch.save per rank (ShardedTensors, written by FSDP1
    itself): each shard's offsets come from its metadata, and ShardedTensor.ProcessGroupState,
    which the pickle reaches through builtins.getattr, is named, never looked up."""
    folder = DCP / "fsdp1_ranks"
    result = run("convert", folder, "out.safetensors")
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "out.safetensors")
    full = torch.load(DCP / "fsdp1_full.pt", weights_only=True)
    assert {k: bits(v) for k, v in written.items()} == {k: bits(v) for k, v in full.items()}
    alone = run("convert", folder / "model_rank1.pt", "x.safetensors")
    assert alone.exit_code == 1
    assert "model_rank1.pt is one rank's part of a sharded save (ShardedTensors)" in alone.stderr
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(folder / "model_rank0.pt", one / "model_rank0.pt")  # rank 1's rows missing
    missing = run("convert", one, "y.safetensors")
    assert missing.exit_code == 1 and "does not hold all of '0.weight'" in missing.stderr
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "y.safetensors").exists()


def test_getattr_in_a_rank_file_reaches_only_the_nested_class_it_names(tmp_path):
    """The one getattr admitted in rank files is ShardedTensor.ProcessGroupState: the same
    files asking getattr for any other attribute are refused, naming what they reach."""
    import zipfile

    from ckptkit.errors import UnsafeCheckpointError

    forged = tmp_path / "forged"
    forged.mkdir()
    for rank in (0, 1):
        src = DCP / "fsdp1_ranks" / f"model_rank{rank}.pt"
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(forged / src.name, "w") as zout:
            for item in zin.infolist():
                data = zin.read(item)
                if item.filename.endswith("data.pkl"):
                    data = data.replace(b"ProcessGroupState", b"ProcessGroupStatX")
                zout.writestr(item, data)
    with pytest.raises(UnsafeCheckpointError, match=r"ShardedTensor\.ProcessGroupStatX"):
        ckptkit.load_state_dict(forged)


def test_inspect_reads_rank_files_without_importing_torch():
    no_torch_imported(
        f"from ckptkit.summary import summarize\nassert len(summarize({str(RANKS)!r}).tensors) == 5"
    )


@pytest.mark.parametrize("layout", ["whole storages", "views"])
def test_plain_tensors_that_differ_between_ranks_are_slices_and_refused(tmp_path, layout):
    """Plain tensors in every rank's file are copies (data parallel) only if they are equal:
    tensor-parallel slices of the same shape would otherwise be taken as the model, one rank's
    part converted and verified. The zip's CRC-32s tell (whole storages), or the bytes (views
    of a larger storage, whose member's CRC covers more)."""
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    for rank in range(2):
        piece = full.chunk(2)[rank]
        if layout == "whole storages":
            weight = piece.clone()
        else:  # a view into a storage that also holds the norm
            storage = torch.cat([piece.flatten(), torch.ones(4)])
            weight = storage[:16].view(4, 4)
        torch.save({"w": weight, "norm": torch.ones(4)}, tmp_path / f"model_rank{rank}.pt")
    with pytest.raises(FormatError, match="hold different values for 'w'.*not copies.*--map"):
        ckptkit.convert(tmp_path, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    copies = torch.randn(4, 4)
    for rank in range(2):  # true copies: read once
        torch.save({"w": copies.clone(), "norm": torch.ones(4)}, tmp_path / f"model_rank{rank}.pt")
    ckptkit.convert(tmp_path, tmp_path / "out.safetensors")
    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], copies)
