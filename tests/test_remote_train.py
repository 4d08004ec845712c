"""train --out URL against moto's S3 server on 127.0.0.1: checkpoints mirrored as they commit
(files, then latest), pruned there as here, refused runs, and --resume auto from the URL."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import servers
import torch
from helpers import FIXTURE_DIR, ROOT

import ckptkit
from ckptkit.engine import train
from ckptkit.formats.base.tensors import bit_equal

range_server = servers.range_server
s3_server = servers.s3_server
s3 = servers.s3
s3_env = servers.s3_env


def objects(s3, prefix):
    s3.fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in s3.fs.find(prefix))


def weights(path):
    return torch.load(path, weights_only=True)["model"]


def test_a_run_saves_to_s3_prunes_there_and_resumes_exactly(s3_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s3_env.bucket("runs")
    first = train(mode="single", epochs=2, out="s3://runs/a", keep_last=1)
    assert first.out == "s3://runs/a" and first.checkpoint == "s3://runs/a/ckpt-epoch0002.pt"
    assert objects(s3_env, "runs/a") == [
        "ckpt-epoch0002.pt", "latest", "metrics.jsonl", "steps.jsonl"
    ]  # fmt: skip
    assert s3_env.fs.cat("runs/a/latest") == b"ckpt-epoch0002.pt\n"
    with pytest.raises(ckptkit.CkptkitError, match="--resume auto"):
        train(mode="single", epochs=3, out="s3://runs/a")
    s3_env.fs.pipe("runs/a/best", b"ckpt-epoch0002.pt\n")  # as --monitor would name it
    resumed = train(mode="single", epochs=4, out="s3://runs/a", resume="auto", keep_last=1)
    assert resumed.resumed_from == "s3://runs/a/ckpt-epoch0002.pt"
    # --keep-last 1 over the URL's checkpoints: epoch 3 goes, epoch 2 stays because best names it
    assert [n for n in objects(s3_env, "runs/a") if n.startswith("ckpt")] == [
        "ckpt-epoch0002.pt", "ckpt-epoch0004.pt"
    ]  # fmt: skip
    s3_env.fs.rm("runs/a/best")
    train(mode="single", epochs=5, out="s3://runs/a", resume="auto", keep_last=2)
    assert [n for n in objects(s3_env, "runs/a") if n.startswith("ckpt")] == [
        "ckpt-epoch0004.pt", "ckpt-epoch0005.pt"
    ]  # fmt: skip
    straight = train(mode="single", epochs=5, out=str(tmp_path / "local"))
    s3_env.fs.get("runs/a/ckpt-epoch0005.pt", str(tmp_path / "remote.pt"))
    remote, local = weights(tmp_path / "remote.pt"), weights(straight.checkpoint)
    assert remote.keys() == local.keys()
    assert all(bit_equal(remote[k], local[k]) for k in local)
    # inspect reads it at the URL, as any checkpoint
    assert ckptkit.summarize("s3://runs/a/ckpt-epoch0005.pt").selected == "model"


def test_the_cli_trains_to_s3_and_refuses_an_unwritable_url(s3_env, run):
    s3_env.bucket("runs")
    result = run("train", "--mode", "single", "--epochs", "1", "--out", "s3://runs/cli")
    assert result.exit_code == 0, result.stderr
    assert "s3://runs/cli/ckpt-epoch0001.pt" in result.stdout
    result = run("train", "--epochs", "1", "--out", "s3://no-such-bucket/run")
    assert result.exit_code != 0 and "cannot write to --out" in result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.slow
def test_ddp_workers_mirror_to_s3_and_resume_from_it(s3_env, tmp_path):
    s3_env.bucket("runs")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ENDPOINT_URL": s3_env.endpoint_url}
    common = ["--mode", "ddp", "--nproc-per-node", "2", "--epochs", "1", "--out", "s3://runs/d"]
    cut = subprocess.run(
        [sys.executable, "-m", "ckptkit", "train", *common, "--max-steps", "10"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cut.returncode == 0, cut.stderr[-2000:]
    assert s3_env.fs.cat("runs/d/latest") == b"ckpt-epoch0000-step00000010.pt\n"
    done = subprocess.run(
        [sys.executable, "-m", "ckptkit", "train", *common, "--resume", "auto"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from s3://runs/d/ckpt-epoch0000-step00000010.pt" in done.stderr
    assert "ckpt-epoch0001.pt" in objects(s3_env, "runs/d")


def test_a_dcp_run_is_mirrored_file_by_file_and_resumes_from_the_url(s3_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s3_env.bucket("runs")
    train(mode="single", epochs=2, out="s3://runs/dcp", save_format="dcp", keep_last=1)
    names = objects(s3_env, "runs/dcp")
    assert ".metadata" in names and "latest" in names
    assert s3_env.fs.cat("runs/dcp/latest") == b"ckpt-epoch0002\n"
    assert not s3_env.fs.exists("runs/dcp/ckpt-epoch0001")  # pruned there as here
    summary = ckptkit.summarize("s3://runs/dcp/ckpt-epoch0002")  # a DCP folder at a URL
    assert summary.format == "dcp" and summary.selected == "model"
    resumed = train(mode="single", epochs=3, out="s3://runs/dcp", save_format="dcp", resume="auto")
    assert resumed.resumed_from == "s3://runs/dcp/ckpt-epoch0002"
    straight = train(mode="single", epochs=3, out=str(tmp_path / "local"), save_format="dcp")
    s3_env.fs.get("runs/dcp/ckpt-epoch0003/", str(tmp_path / "back") + "/", recursive=True)
    assert ckptkit.diff(tmp_path / "back", straight.checkpoint).equal


def test_resume_from_a_checkpoint_url_and_urls_that_cannot_be_written(
    s3_env, run, range_server, monkeypatch
):
    s3_env.bucket("runs")
    train(mode="single", epochs=1, out="s3://runs/r")
    result = run(
        "train",
        "--epochs",
        "2",
        "--out",
        "s3://runs/r2",
        "--resume",
        "s3://runs/r/ckpt-epoch0001.pt",
    )
    assert result.exit_code == 0, result.stderr
    assert "resumed from" in result.stderr and "epoch 2" in result.stdout.lower() + result.stderr
    result = run("train", "--epochs", "1", "--out", range_server.url("run"))
    assert result.exit_code != 0 and "HTTP" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and not range_server.requests  # nothing sent
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    servers.drop_cached_filesystems()
    result = run("convert", FIXTURE_DIR / "single.pt", "s3://runs/nc/model.safetensors")
    assert result.exit_code != 0 and "cannot write to s3://runs/nc" in result.stderr
    assert "internal error" not in result.stderr and len(result.stderr.splitlines()) == 1


def test_tensorboard_events_are_mirrored_too(s3_env, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    s3_env.bucket("runs")
    train(mode="single", epochs=1, out="s3://runs/tb", log=("tensorboard",))
    events = [p for p in s3_env.fs.find("runs/tb/tensorboard") if "events.out.tfevents" in p]
    assert events and s3_env.fs.size(events[0]) > 0
