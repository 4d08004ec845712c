"""gs:// URLs against gcp-storage-emulator on 127.0.0.1 (tests/servers.py ``gcs_env``), read and
written by gcsfs: the same paths as s3:// (fsspec underneath), on a second real back-end."""

from __future__ import annotations

import gcsfs
import pytest
import servers
import torch
from helpers import one_error
from safetensors.torch import save_file

import ckptkit

gcs_env = servers.gcs_env

STATE = {
    "module.encoder.weight": torch.randn(64, 32, generator=torch.Generator().manual_seed(0)),
    "module.encoder.bias": torch.zeros(64),
    "module.head.weight": torch.ones(10, 64, dtype=torch.bfloat16),
}


@pytest.fixture
def gcs(gcs_env):
    """A gcsfs filesystem on the emulator (anonymous), its listings never stale."""
    fs = gcsfs.GCSFileSystem(token="anon")
    fs.invalidate_cache()
    return fs


def objects(fs, prefix):
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(prefix))


def test_inspect_of_gs_reads_headers_with_ranged_requests(tmp_path, gcs):
    save_file(STATE, tmp_path / "m.safetensors")
    torch.save({"model": STATE, "epoch": 3}, tmp_path / "m.pt")
    gcs.put(str(tmp_path / "m.safetensors"), "ckpts/run/m.safetensors")
    gcs.put(str(tmp_path / "m.pt"), "ckpts/run/m.pt")
    for name, most in (("m.safetensors", 2), ("m.pt", 3)):  # the size, then the header
        summary = ckptkit.summarize(f"gs://ckpts/run/{name}")
        local = ckptkit.summarize(tmp_path / name)
        assert summary.to_dict()["tensors"] == local.to_dict()["tensors"]
        assert summary.fetched is not None and summary.fetched["requests"] <= most


def test_convert_from_gs_and_to_gs_is_bit_exact(tmp_path, gcs, run):
    torch.save({"model": STATE, "epoch": 3}, tmp_path / "m.pt")
    gcs.put(str(tmp_path / "m.pt"), "ckpts/m.pt")
    report = ckptkit.convert("gs://ckpts/m.pt", tmp_path / "local.safetensors")
    assert report.verified and report.copied == len(STATE)
    assert ckptkit.diff(tmp_path / "local.safetensors", tmp_path / "m.pt").equal
    result = run(
        "convert", tmp_path / "m.pt", "gs://ckpts/out/model.safetensors",
        "--max-shard-size", "8kB", "--strip-wrappers",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    names = objects(gcs, "ckpts/out")
    assert names[-1] == "model.safetensors.index.json" and len(names) >= 3
    back = ckptkit.load_state_dict("gs://ckpts/out/model.safetensors.index.json")
    assert all(torch.equal(back[k.removeprefix("module.")], v) for k, v in STATE.items())
    one_error(
        run(
            "convert",
            tmp_path / "m.pt",
            "gs://ckpts/out/model.safetensors",
            "--max-shard-size",
            "8kB",
        ),
        "exists",
        "--force",
    )


def test_a_failed_conversion_to_gs_leaves_no_object(tmp_path, gcs, run):
    """The cast of the last tensor overflows: no object. (Kept under one upload part: the
    emulator does not implement cancelling a resumable upload, answering 501, which gcsfs
    retries for 30 s; the abort of parts already up is tested against S3.)"""
    state = {f"a.{i}": torch.randn(2**16, 4) for i in range(6)}  # 3 MB in fp16
    state["zz.big"] = torch.full((8,), 1e30)
    save_file(state, tmp_path / "over.safetensors")
    result = run(
        "convert", tmp_path / "over.safetensors", "gs://ckpts/x.safetensors", "--dtype", "fp16"
    )
    one_error(result, "inf")
    assert objects(gcs, "ckpts") == []
