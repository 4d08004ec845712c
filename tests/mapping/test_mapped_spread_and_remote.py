"""Mapped conversions wherever conversions go: a Meta folder at S3 (moto on 127.0.0.1), an
output at S3, and the shards spread over processes (--part I/N, then --finish)."""

from __future__ import annotations

import servers
import torch
from helpers import FIXTURE_DIR
from make_mapping import make_meta
from safetensors.torch import load_file

import ckptkit
from ckptkit.spread import finish

s3_server, s3, s3_env = servers.s3_server, servers.s3, servers.s3_env
REFERENCE = FIXTURE_DIR / "mapping" / "llama3-tp2" / "model.safetensors"


def same_as_transformers(path) -> None:
    ours, theirs = load_file(path), load_file(REFERENCE)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k].view(torch.int16), theirs[k].view(torch.int16)) for k in theirs)


def test_a_meta_folder_at_s3_maps_to_a_local_folder_and_back_to_s3(s3_env, tmp_path):
    make_meta(tmp_path / "meta", 2, "3")
    s3_env.bucket("models")
    s3_env.fs.put(str(tmp_path / "meta") + "/", "models/meta/", recursive=True)
    s3_env.fs.invalidate_cache()
    report = ckptkit.convert("s3://models/meta", tmp_path / "hf", mapping="llama-meta")
    same_as_transformers(tmp_path / "hf" / "model.safetensors")
    assert report.mapping["variables"]["tp"] == 2 and report.verified
    ckptkit.convert(
        tmp_path / "hf", "s3://models/back", mapping="llama-meta", reverse=True, sets={"tp": 2}
    )
    s3_env.fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in s3_env.fs.ls("models/back")) == [
        "consolidated.00.pth",
        "consolidated.01.pth",
        "params.json",
    ]
    s3_env.fs.get("models/back/consolidated.01.pth", str(tmp_path / "back1.pth"))
    original = torch.load(tmp_path / "meta" / "consolidated.01.pth", weights_only=True)
    back = torch.load(tmp_path / "back1.pth", weights_only=True)
    assert list(back) == list(original) and all(torch.equal(back[k], original[k]) for k in original)


def test_a_mapped_conversion_spreads_its_shards_over_parts(tmp_path):
    make_meta(tmp_path / "meta", 4, "3")
    whole = tmp_path / "whole" / "model.safetensors"
    whole.parent.mkdir()
    ckptkit.convert(tmp_path / "meta", whole, mapping="llama-meta", max_shard_size="20kB")
    spread = tmp_path / "spread" / "model.safetensors"
    spread.parent.mkdir()
    for index in range(3):
        ckptkit.convert(
            tmp_path / "meta",
            spread,
            mapping="llama-meta",
            max_shard_size="20kB",
            part=f"{index + 1}/3",
        )
    finish(spread)
    shards = sorted(p.name for p in whole.parent.iterdir())
    assert len(shards) > 2 and shards == sorted(p.name for p in spread.parent.iterdir())
    for name in shards:
        assert (whole.parent / name).read_bytes() == (spread.parent / name).read_bytes(), name
    merged = {}
    for name in shards:
        if name.endswith(".safetensors"):
            merged.update(load_file(whole.parent / name))
    reference = load_file(REFERENCE)
    assert all(
        torch.equal(merged[k].view(torch.int16), reference[k].view(torch.int16)) for k in reference
    )
