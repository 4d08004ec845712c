"""Conversion spread over processes: --part I/N and --finish, and torchrun's ranks (agreeing
over gloo before rank 0 writes the index); the output is byte-identical to one process's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, free_port
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import FormatError, OutputError, UsageError
from ckptkit.spread import Part, finish, parse_part

STATE = {
    f"module.layers.{i}.weight": torch.randn(128, 128, generator=torch.Generator().manual_seed(i))
    for i in range(12)
}
SHARD = "100kB"  # 64 kB tensors: 12 shards


@pytest.fixture
def src(tmp_path):
    torch.save(STATE, tmp_path / "m.pt")
    return tmp_path / "m.pt"


def files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


@pytest.fixture
def whole(src, tmp_path):
    ckptkit.convert(src, tmp_path / "one" / "model.safetensors", max_shard_size=SHARD)
    return files_of(tmp_path / "one")


def test_parts_are_disjoint_and_cover_every_shard():
    for count in range(1, 6):
        owned = [i for index in range(count) for i in Part(index, count).shards(12)]
        assert sorted(owned) == list(range(12))
    assert parse_part("2/8") == Part(1, 8) and str(Part(1, 8)) == "2/8"
    for bad in ("0/3", "4/3", "x", "1/0"):
        with pytest.raises(UsageError):
            parse_part(bad)


@pytest.mark.parametrize("count", [2, 3, 5])
def test_parts_and_finish_give_the_bytes_of_one_process(src, tmp_path, whole, run, count):
    dst = tmp_path / f"by{count}" / "model.safetensors"
    for index in range(1, count + 1):
        result = run("convert", src, dst, "--max-shard-size", SHARD, "--part", f"{index}/{count}")
        assert result.exit_code == 0, result.stderr
        assert f"part {index}/{count}" in result.stdout and "--finish" in result.stdout
        assert not (dst.parent / "model.safetensors.index.json").exists()  # never before finish
    result = run("convert", "--finish", dst, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["tensors"] == len(STATE) and len(doc["shards"]) == 12
    assert files_of(dst.parent) == whole


def test_finish_refuses_a_missing_shard_a_stale_mix_and_an_existing_index(src, tmp_path, run):
    dst = tmp_path / "out" / "model.safetensors"
    for index in (1, 2):
        run("convert", src, dst, "--max-shard-size", SHARD, "--part", f"{index}/3")
    result = run("convert", "--finish", dst)
    assert result.exit_code != 0 and "4 of 12 shards" in result.stderr and "--part" in result.stderr
    assert not (dst.parent / "model.safetensors.index.json").exists()
    run("convert", src, dst, "--max-shard-size", SHARD, "--part", "3/3")
    stale = dst.parent / "model-00001-of-00002.safetensors"
    shutil.copy(dst.parent / "model-00001-of-00012.safetensors", stale)
    with pytest.raises(FormatError, match="several conversions"):
        finish(dst)
    stale.unlink()
    finish(dst)
    with pytest.raises(OutputError, match="exists"):
        finish(dst)
    finish(dst, force=True)


def test_a_part_of_a_file_that_is_not_sharded_is_refused(src, run):
    result = run("convert", src, "m.safetensors", "--part", "1/2")
    assert result.exit_code != 0 and "--max-shard-size" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    result = run("convert", "--finish", "x.safetensors", src)
    assert result.exit_code == 2  # --finish takes DST alone


def _torchrun(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["PET_MASTER_PORT"] = str(free_port())  # torchrun's --master-port, not 29500
    env.pop("CKPTKIT_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ckptkit",
         "convert", *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_torchrun_ranks_share_the_shards_and_rank_0_writes_the_index(src, tmp_path, whole):
    dst = tmp_path / "tr" / "model.safetensors"
    done = _torchrun(src, dst, "--max-shard-size", SHARD, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Wrote") == 1 and "part 1/2" in done.stdout  # rank 0 reports
    assert files_of(dst.parent) == whole
    out = load_file(dst.parent / "model-00003-of-00012.safetensors")
    assert torch.equal(out["module.layers.2.weight"], STATE["module.layers.2.weight"])


def test_a_failing_rank_fails_them_all_and_no_index_is_written(src, tmp_path):
    dst = tmp_path / "tr" / "model.safetensors"
    dst.parent.mkdir()
    (dst.parent / "model-00002-of-00012.safetensors").write_bytes(b"in the way")  # rank 1's
    done = _torchrun(src, dst, "--max-shard-size", SHARD, cwd=tmp_path)
    assert done.returncode != 0
    assert "exists" in done.stderr and "another rank failed" in done.stderr  # ranks 1 and 0
    assert not (dst.parent / "model.safetensors.index.json").exists()


def test_an_output_folder_made_meanwhile_by_another_part_is_used(src, tmp_path, monkeypatch):
    """Parts started together race to create the output folder: the one that loses finds it
    made (FileExistsError, as from the other process) and goes on."""
    from pathlib import Path

    real_mkdir = Path.mkdir

    def raced(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)  # the other part wins...
        real_mkdir(self, *args, **kwargs)  # ...and this one finds it there

    monkeypatch.setattr(Path, "mkdir", raced)
    dst = tmp_path / "fresh" / "model.safetensors"
    report = ckptkit.convert(src, dst, max_shard_size=SHARD, part="1/2")
    assert report.verified and (dst.parent / "model-00001-of-00012.safetensors").is_file()


def test_under_torchrun_an_existing_index_is_refused_before_any_shard(src, tmp_path):
    dst = tmp_path / "tr" / "model.safetensors"
    dst.parent.mkdir()
    (dst.parent / "model.safetensors.index.json").write_text("{}")  # an earlier output's
    done = _torchrun(src, dst, "--max-shard-size", SHARD, cwd=tmp_path)
    assert done.returncode != 0 and "exists" in done.stderr
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model.safetensors.index.json"]


def test_sigterm_mid_convert_leaves_nothing_half_written(tmp_path):
    """A scheduler stopping the job (SIGTERM) is cleaned up as Ctrl-C is: one Error line,
    exit 143, and no output or temp file left."""
    import signal
    import time

    big = tmp_path / "big.safetensors"
    from safetensors.torch import save_file

    save_file({f"w{i}": torch.zeros(4 * 2**20) for i in range(32)}, big)  # 512 MiB
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPTKIT_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkit", "convert", str(big), str(tmp_path / "o.pt"), "-q"],
        cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not any(p.name.startswith(".o.pt") for p in tmp_path.iterdir()):  # writing now
        if proc.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the convert ended before the signal came")
    assert proc.returncode == 143 and err.strip().splitlines() == [
        "Error: terminated (SIGTERM); nothing was left half-written"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]
