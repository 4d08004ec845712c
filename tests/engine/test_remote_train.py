"""train --out URL against moto's S3 server on 127.0.0.1: checkpoints mirrored as they commit
(files, then latest), pruned there as here, refused runs, and --resume auto from the URL; DCP
checkpoints written there by every rank and read back from there."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import threading

import pytest
import servers
import torch
from helpers import FIXTURE_DIR, ROOT, single_process_dcp

import ckptkit
from ckptkit.engine import train
from ckptkit.engine.demo import demo_model
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


def dcp_weights(checkpoint):
    """A DCP checkpoint's model, read by torch itself: at a URL through its FsspecReader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    state = demo_model().state_dict()
    url = "://" in checkpoint
    where = {"storage_reader": FsspecReader(checkpoint)} if url else {"checkpoint_id": checkpoint}
    with single_process_dcp():
        dcp.load({"model": state}, no_dist=True, **where)
    return state


@contextlib.contextmanager
def watched(folder):
    """The names of what appears under ``folder`` (files and folders) while the block runs,
    looked at every 10 ms."""
    seen, done = set(), threading.Event()

    def look():
        while True:
            for _, dirs, files in os.walk(folder):  # os.walk skips what vanishes meanwhile
                seen.update(dirs, files)
            if done.wait(0.01):
                return

    watcher = threading.Thread(target=look)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


@pytest.fixture
def stage(tmp_path, monkeypatch):
    """``$CKPTKIT_STAGING``: where a run at a URL stages its folder."""
    folder = tmp_path / "stage"
    folder.mkdir()
    monkeypatch.setenv("CKPTKIT_STAGING", str(folder))
    return folder


def staged_nothing_of_dcp(seen):
    """A run was staged (its folder seen), and no DCP file ever was."""
    assert any(name.startswith("ckptkit-run-") for name in seen), seen  # the right folder
    return not [n for n in seen if n.endswith(".distcp") or n in (".metadata", "meta.pt")]


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
    s3_env.fs.rm(["runs/a/best", "runs/a/latest"])  # a lost pointer: the newest still found
    again = train(mode="single", epochs=5, out="s3://runs/a", resume="auto", keep_last=2)
    assert again.resumed_from == "s3://runs/a/ckpt-epoch0004.pt"  # not a fresh run
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


def test_a_dcp_run_writes_to_s3_unstaged_and_resumes_from_there(
    s3_env, tmp_path, monkeypatch, stage
):
    monkeypatch.chdir(tmp_path)
    s3_env.bucket("runs")
    with watched(stage) as seen:
        train(mode="single", epochs=2, out="s3://runs/dcp", save_format="dcp", keep_last=1)
    assert staged_nothing_of_dcp(seen)
    assert objects(s3_env, "runs/dcp/ckpt-epoch0002") == [".metadata", "__0_0.distcp", "meta.pt"]
    assert s3_env.fs.cat("runs/dcp/latest") == b"ckpt-epoch0002\n"
    assert not s3_env.fs.exists("runs/dcp/ckpt-epoch0001")  # pruned there as here
    summary = ckptkit.summarize("s3://runs/dcp/ckpt-epoch0002")  # a DCP folder at a URL
    assert summary.format == "dcp" and summary.selected == "model"
    with watched(stage) as seen:
        resumed = train(
            mode="single", epochs=3, out="s3://runs/dcp", save_format="dcp", resume="auto"
        )
    assert staged_nothing_of_dcp(seen)  # read in place, not downloaded
    assert resumed.resumed_from == "s3://runs/dcp/ckpt-epoch0002"
    straight = train(mode="single", epochs=3, out=str(tmp_path / "local"), save_format="dcp")
    s3_env.fs.get("runs/dcp/ckpt-epoch0003/", str(tmp_path / "back") + "/", recursive=True)
    assert ckptkit.diff(tmp_path / "back", straight.checkpoint).equal


@pytest.mark.slow
def test_fsdp_ranks_write_their_dcp_shards_to_s3_and_resume_from_there(
    s3_env, tmp_path, monkeypatch, stage
):
    """Each rank writes its own shards to the URL (torch's FsspecWriter), none staged here;
    `latest` names the save once complete; --resume auto reads it in place on every rank and
    goes on as the uninterrupted run does, with --async-save too."""
    monkeypatch.chdir(tmp_path)
    s3_env.bucket("runs")
    fsdp = {"mode": "fsdp", "nproc_per_node": 2, "save_format": "dcp", "quiet": True}
    with watched(stage) as seen:
        first = train(epochs=2, out="s3://runs/f", keep_last=1, **fsdp)
    assert staged_nothing_of_dcp(seen)
    assert first.checkpoint == "s3://runs/f/ckpt-epoch0002"
    assert objects(s3_env, "runs/f/ckpt-epoch0002") == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"
    ]  # fmt: skip
    assert s3_env.fs.cat("runs/f/latest") == b"ckpt-epoch0002\n"
    assert objects(s3_env, "runs/f/ckpt-epoch0001") == []  # pruned there
    with watched(stage) as seen:
        resumed = train(epochs=3, out="s3://runs/f", resume="auto", async_save=True, **fsdp)
    assert staged_nothing_of_dcp(seen)
    assert resumed.resumed_from == "s3://runs/f/ckpt-epoch0002" and resumed.epochs_run == 1
    assert s3_env.fs.cat("runs/f/latest") == b"ckpt-epoch0003\n"
    meta = torch.load(io.BytesIO(s3_env.fs.cat("runs/f/ckpt-epoch0003/meta.pt")), weights_only=True)
    assert (meta["epoch"], meta["step"], len(meta["rng"])) == (3, 96, 2)
    train(epochs=3, out=str(tmp_path / "straight"), **fsdp)
    for name in ("ckpt-epoch0002", "ckpt-epoch0003"):  # what was written, then what went on
        there = dcp_weights(f"s3://runs/f/{name}")
        here = dcp_weights(str(tmp_path / "straight" / name))
        assert all(bit_equal(there[k], here[k]) for k in here), name


@pytest.mark.slow
def test_dcp_shards_reach_the_url_from_two_nodes(s3_env, stage):
    """Two torchrun agents, one per 'node' (examples/two_nodes.sh, on localhost), each staging
    its own run folder: each rank writes its shards to the URL, and no node stages them."""
    s3_env.bucket("runs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "OUT": "s3://runs/nodes",
        "MASTER_PORT": str(port),
        "PYTHONPATH": str(ROOT),
    }
    with watched(stage) as seen:
        done = subprocess.run(
            ["bash", "examples/two_nodes.sh", "--save-format", "dcp"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Checkpoint s3://runs/nodes/ckpt-epoch0002" in done.stdout
    assert staged_nothing_of_dcp(seen)
    assert objects(s3_env, "runs/nodes/ckpt-epoch0002") == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"
    ]  # fmt: skip
    assert s3_env.fs.cat("runs/nodes/latest") == b"ckpt-epoch0002\n"
    meta = torch.load(
        io.BytesIO(s3_env.fs.cat("runs/nodes/ckpt-epoch0002/meta.pt")), weights_only=True
    )
    assert (meta["ckptkit"]["world_size"], meta["ckptkit"]["nodes"]) == (2, 2)


def test_an_incomplete_dcp_save_at_the_url_is_never_resumed_and_goes(s3_env, run, tmp_path):
    """A killed run's save (shards, no .metadata): the next run there removes it before it
    trains, --resume auto goes on from what `latest` names, and --resume naming it is refused."""
    s3_env.bucket("runs")
    dcp = {"mode": "single", "save_format": "dcp", "quiet": True, "out": "s3://runs/k"}
    train(epochs=1, **dcp)
    s3_env.fs.pipe("runs/k/ckpt-epoch0003/__0_0.distcp", b"torn")  # newer than latest's
    s3_env.fs.pipe("runs/k/ckpt-epoch0002/__5_0.distcp", b"torn")  # a rank this run lacks
    resumed = train(epochs=2, resume="auto", **dcp)
    assert resumed.resumed_from == "s3://runs/k/ckpt-epoch0001"
    assert objects(s3_env, "runs/k/ckpt-epoch0003") == []
    assert objects(s3_env, "runs/k/ckpt-epoch0002") == [".metadata", "__0_0.distcp", "meta.pt"]
    assert s3_env.fs.cat("runs/k/latest") == b"ckpt-epoch0002\n"
    s3_env.fs.pipe("runs/k/ckpt-epoch0009/__0_0.distcp", b"torn")
    result = run(
        "train", "--epochs", "12", "--save-format", "dcp", "--out", "s3://runs/k",
        "--resume", "s3://runs/k/ckpt-epoch0009",
    )  # fmt: skip
    assert result.exit_code != 0, result.stdout
    assert "s3://runs/k/ckpt-epoch0009 holds no complete DCP checkpoint" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert s3_env.fs.cat("runs/k/latest") == b"ckpt-epoch0002\n"  # nothing trained
    # latest naming a save cut short (its .metadata gone: a save of that name, killed): the
    # newest complete one is resumed, as locally, not a fresh run and not a failure
    s3_env.fs.rm("runs/k/ckpt-epoch0002/.metadata")
    again = train(epochs=2, resume="auto", **dcp)
    assert again.resumed_from == "s3://runs/k/ckpt-epoch0001"


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
