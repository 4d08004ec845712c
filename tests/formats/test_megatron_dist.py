"""Megatron torch_dist saves written by ckptkit (``convert --to megatron-dist``): the iteration
folder holds what megatron-core 0.16.1's own dist_checkpointing.save wrote for the same model
(fixtures/megatron/*/tp1/torch_dist): the same keys, global shapes and objects, every tensor
bit for bit, common.pt's args; read back it is the model again; the tracker comes last."""

from __future__ import annotations

import pytest
import servers
import torch
from helpers import FIXTURE_DIR, one_error, single_process_dcp

import ckptkit
from ckptkit.formats.base.tensors import bit_equal

s3_server, s3, s3_env = servers.s3_server, servers.s3, servers.s3_env
MEGATRON = FIXTURE_DIR / "megatron"


def dcp_contents(folder):
    """A DCP folder's entries: tensors (loaded whole with torch's own reader) and the keys of
    its byte objects."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(folder)
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with single_process_dcp():
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors, sorted(k for k in metadata if k not in tensors)


@pytest.mark.parametrize(
    ("shape", "source"),
    [
        ("gqa-swiglu", "tp2/legacy"),
        ("gqa-swiglu", "pp2/torch_dist"),
        ("mha-gelu", "tp2/legacy"),
        ("moe-swiglu", "tp2ep2/legacy"),
        ("vpp", "pp2vpp2/legacy"),
    ],
)
def test_a_torch_dist_save_is_megatron_cores_own(run, tmp_path, shape, source):
    result = run("convert", MEGATRON / shape / source, "out", "--to", "megatron-dist")
    assert result.exit_code == 0, result.output
    folder = tmp_path / "out" / "iter_0000010"
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json",
    ]  # fmt: skip
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "10"
    ours, our_objects = dcp_contents(folder)
    theirs, their_objects = dcp_contents(MEGATRON / shape / "tp1/torch_dist/iter_0000010")
    assert sorted(ours) == sorted(theirs) and our_objects == their_objects
    for key, value in theirs.items():
        assert ours[key].shape == value.shape and bit_equal(ours[key], value), key
    common = torch.load(folder / "common.pt", weights_only=False)
    reference = torch.load(
        MEGATRON / shape / "tp1/torch_dist/iter_0000010/common.pt", weights_only=False
    )
    assert list(common) == list(reference)
    assert (common["iteration"], common["checkpoint_version"]) == (10, 3.0)
    for arg in ("num_layers", "hidden_size", "padded_vocab_size", "params_dtype"):
        assert vars(common["args"])[arg] == vars(reference["args"])[arg], arg
    with (
        ckptkit.open_source(tmp_path / "out") as back,
        ckptkit.open_source(MEGATRON / shape / "tp1/torch_dist") as model,
    ):
        assert sorted(back.keys()) == sorted(model.keys())
        assert all(bit_equal(back.load(k), model.load(k)) for k in model.keys())


def test_refusals(run, tmp_path):
    save = MEGATRON / "gqa-swiglu/tp2/legacy"
    one_error(
        run("convert", save, "out", "--to", "megatron-dist", "--tp", "2"),
        "a torch_dist save holds whole tensors",
    )
    (tmp_path / "there").mkdir()
    one_error(
        run("convert", save, "there", "--to", "megatron-dist"),
        "ckptkit replaces none, even with --force",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]


def test_a_torch_dist_save_goes_to_a_url(s3_env, run, tmp_path):
    """--to megatron-dist at s3:// (moto on 127.0.0.1): the iteration folder, then the tracker;
    read back from there, the model bit for bit."""
    s3_env.bucket("runs")
    save = MEGATRON / "gqa-swiglu" / "tp2" / "legacy"
    result = run("convert", save, "s3://runs/dist", "--to", "megatron-dist")
    assert result.exit_code == 0, result.output
    s3_env.fs.invalidate_cache()
    names = sorted(p.removeprefix("runs/dist/") for p in s3_env.fs.find("runs/dist"))
    assert names == [
        "iter_0000010/.metadata", "iter_0000010/__0_0.distcp", "iter_0000010/__0_1.distcp",
        "iter_0000010/common.pt", "iter_0000010/metadata.json",
        "latest_checkpointed_iteration.txt",
    ]  # fmt: skip
    dist = MEGATRON / "gqa-swiglu" / "tp1" / "torch_dist"  # the same names: TE's norms
    with ckptkit.open_source("s3://runs/dist") as back, ckptkit.open_source(dist) as model:
        assert sorted(back.keys()) == sorted(model.keys())
        assert all(bit_equal(back.load(k), model.load(k)) for k in model.keys())


def test_from_hugging_face_the_report_says_the_mapping(run, tmp_path):
    """A Hugging Face folder mapped back (the pack's args written) to a torch_dist save: the
    report names the mapping and its defaults, as for any mapped conversion."""
    result = run(
        "convert", FIXTURE_DIR / "mapping/llama3-tp1", "dist", "--map", "megatron-llama",
        "--reverse", "--to", "megatron-dist", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    assert report["mapping"]["name"] == "megatron-llama" and report["megatron"]["torch_dist"]
    assert report["megatron"]["iteration"] == "release"
    assert (tmp_path / "dist/latest_checkpointed_iteration.txt").read_text() == "release"
    common = torch.load(tmp_path / "dist/release/common.pt", weights_only=False)
    assert vars(common["args"])["num_layers"] == 2
