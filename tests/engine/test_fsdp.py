"""``train --mode fsdp``: FSDP2 across real gloo processes, DCP checkpoints committed like the
others, resumed exactly, and resumed across modes in both directions."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import ROOT, single_process_dcp
from safetensors.torch import load_file

import ckptkit
from ckptkit.engine import TrainConfig, train
from ckptkit.engine.checkpoint import LATEST, list_checkpoints
from ckptkit.engine.demo import demo_model
from ckptkit.formats.base.tensors import bit_equal

FAST = {"quiet": True, "timeout_s": 30.0}


def run(tmp_path: Path, name: str, **options) -> ckptkit.engine.TrainResult:
    return train(TrainConfig(out=str(tmp_path / name), **FAST, **options))


def final_weights(checkpoint: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, whatever its format, read through ckptkit."""
    out = tmp_path / f"w{len(list(tmp_path.glob('w*.safetensors')))}.safetensors"
    ckptkit.convert(checkpoint, out)
    return load_file(out)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """One 2-process FSDP run of 2 epochs with DCP checkpoints, shared by tests that read it."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    result = train(TrainConfig(mode="fsdp", epochs=2, nproc_per_node=2, out=str(out), **FAST))
    return Path(result.checkpoint)


def test_a_dcp_checkpoint_is_a_committed_folder(fsdp_run):
    run_dir = fsdp_run.parent
    assert fsdp_run.name == "ckpt-epoch0002" and fsdp_run.is_dir()
    assert (run_dir / LATEST).read_text() == "ckpt-epoch0002\n"
    assert list_checkpoints(run_dir) == [run_dir / "ckpt-epoch0001", fsdp_run]
    assert sorted(os.listdir(fsdp_run)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert not [p for p in os.listdir(run_dir) if p.endswith(".tmp")]
    meta = torch.load(fsdp_run / "meta.pt", weights_only=True)
    assert (meta["epoch"], meta["step"], len(meta["rng"])) == (2, 64, 2)
    info = meta["ckptkit"]
    assert (info["mode"], info["world_size"], info["backend"]) == ("fsdp", 2, "gloo")
    assert info["weights_sha256"] is None  # no rank holds the weights whole
    with ckptkit.open_source(fsdp_run) as source:  # ckptkit reads it as any DCP folder
        assert source.format == "dcp" and source.selected == "model"
        assert [d.path for d in source.dropped] == ["optim"]
        assert source.extras["epoch"] == 2


def test_the_dcp_checkpoint_is_the_model_and_loads_anywhere(fsdp_run, tmp_path):
    """torch's own reader and ckptkit's agree, and the weights fit the plain model."""
    state = demo_model().state_dict()
    with single_process_dcp():
        dcp.load({"model": state}, checkpoint_id=str(fsdp_run), no_dist=True)
    ours = final_weights(str(fsdp_run), tmp_path)
    assert set(ours) == set(state)
    assert all(bit_equal(ours[k], state[k]) for k in state)
    demo_model().load_state_dict(ours, strict=True)


@pytest.mark.slow
def test_fsdp_resume_is_exact(tmp_path, fsdp_run):
    straight = run(tmp_path, "straight", mode="fsdp", epochs=3)
    shutil.copytree(fsdp_run.parent, tmp_path / "split")
    resumed = run(tmp_path, "split", mode="fsdp", epochs=3, resume="auto")
    assert resumed.resumed_from.endswith("ckpt-epoch0002") and resumed.epochs_run == 1
    a = final_weights(straight.checkpoint, tmp_path)
    b = final_weights(resumed.checkpoint, tmp_path)
    assert all(bit_equal(a[k], b[k]) for k in a)
    ma = torch.load(Path(straight.checkpoint) / "meta.pt", weights_only=True)
    mb = torch.load(Path(resumed.checkpoint) / "meta.pt", weights_only=True)
    assert ma["step"] == mb["step"] == 96 and ma["batch_in_epoch"] == mb["batch_in_epoch"] == 0


@pytest.mark.slow
def test_fsdp_async_save_writes_what_a_synchronous_save_writes(tmp_path, fsdp_run):
    """--async-save in fsdp: every rank stages its shards and writes them on a thread (DCP's
    collectives on a group of their own); rank 0 commits once all are written. The folders
    hold the same weights, and the run resumes from them."""
    sync = fsdp_run.parent
    background = run(tmp_path, "async", mode="fsdp", epochs=2, async_save=True)
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == [
        p.name for p in list_checkpoints(sync)
    ]
    assert sorted(os.listdir(background.checkpoint)) == sorted(os.listdir(fsdp_run))
    for name in ("ckpt-epoch0001", "ckpt-epoch0002"):
        a = final_weights(str(sync / name), tmp_path)
        b = final_weights(str(tmp_path / "async" / name), tmp_path)
        assert all(bit_equal(a[k], b[k]) for k in a)
    resumed = run(tmp_path, "async", mode="fsdp", epochs=3, async_save=True, resume="auto")
    assert resumed.epochs_run == 1 and resumed.checkpoint.endswith("ckpt-epoch0003")


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (("fsdp", 2, "dcp"), ("single", 1, None)),
        pytest.param(("fsdp", 2, "dcp"), ("ddp", 2, None), marks=pytest.mark.slow),
        pytest.param(("fsdp", 2, "dcp"), ("fsdp", 1, None), marks=pytest.mark.slow),
        pytest.param(("fsdp", 2, "pt"), ("single", 1, None), marks=pytest.mark.slow),
        pytest.param(("ddp", 2, None), ("fsdp", 2, None), marks=pytest.mark.slow),
        pytest.param(("single", 1, None), ("fsdp", 2, "pt"), marks=pytest.mark.slow),
    ],
    ids=lambda spec: f"{spec[0]}x{spec[1]}-{spec[2] or 'default'}",
)
def test_resume_across_modes_with_the_optimizer(tmp_path, first, then):
    """Two epochs in one mode, the third in another: the optimizer state (momentum) carries
    over, so the result is the uninterrupted run's up to the rounding of another reduction
    order; a run whose optimizer restarted lands measurably further away."""
    mode, ranks, fmt = first
    reference = run(tmp_path, "reference", mode="single", epochs=3)
    run(tmp_path, "run", mode=mode, nproc_per_node=ranks, epochs=2, save_format=fmt)
    mode, ranks, fmt = then
    resumed = run(
        tmp_path, "run", mode=mode, nproc_per_node=ranks, epochs=3, save_format=fmt, resume="auto"
    )
    assert resumed.epochs_run == 1
    a = final_weights(reference.checkpoint, tmp_path)
    b = final_weights(resumed.checkpoint, tmp_path)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-4, worst


@pytest.mark.slow
def test_a_checkpoint_ckptkit_wrote_with_to_dcp_loads_into_a_sharded_model(tmp_path):
    """`convert --to dcp` output read by dcp.load into FSDP2 shards on 2 ranks (and resumed
    by the engine, which does exactly that)."""
    first = run(tmp_path, "single", mode="single", epochs=1)
    weights_only = tmp_path / "weights"
    ckptkit.convert(first.checkpoint, weights_only, to="dcp")
    resumed = run(
        tmp_path, "fsdp", mode="fsdp", nproc_per_node=2, epochs=2, resume=str(weights_only)
    )
    assert resumed.epochs_run == 2  # weights only: no epoch counter in the folder
    expected = torch.load(first.checkpoint, weights_only=True)["model"]
    shards_read = tmp_path / "check.py"
    shards_read.write_text(_SHARDED_LOAD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(shards_read),
            str(weights_only),
            str(tmp_path / "gathered.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, _ranks_said(proc.stderr)
    gathered = torch.load(tmp_path / "gathered.pt", weights_only=True)
    assert set(gathered) == set(expected)
    assert all(bit_equal(gathered[k], expected[k]) for k in expected)


def _ranks_said(stderr: str) -> str:
    """What the ranks printed before torchrun's failure summary (the summary hides it)."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith(("[", "  ")))[
        -4000:
    ]


_SHARDED_LOAD = """
import os
import sys
from datetime import timedelta
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from ckptkit.engine.demo import demo_model

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
model = fully_shard(demo_model(), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
state = model.state_dict()  # this rank's shards
assert all(type(v).__name__ == "DTensor" for v in state.values())
dcp.load(state, checkpoint_id=sys.argv[1])
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if dist.get_rank() == 0:
    torch.save(full, sys.argv[2])
dist.barrier()  # no rank tears the group down while another still uses it
dist.destroy_process_group()
# Skip interpreter finalization: gloo's worker threads can still hold work objects whose
# tensors are freed there, which aborts the process (SIGABRT, "terminate called without an
# active exception") about once in 20 runs here. Everything this script does is done.
os._exit(0)
"""


def test_plain_values_in_a_dcp_folder_go_through_the_safe_loader(tmp_path):
    """DCP's default planner unpickles plain values in full, so a hostile value runs code;
    ckptkit's resume reads them with torch's safe loader and refuses it."""
    from ckptkit.engine.payload import load_dcp
    from ckptkit.errors import FormatError

    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "hostile"
    state = {"model": demo_model().state_dict(), "note": Boom()}
    with single_process_dcp():
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    with pytest.raises(FormatError, match="not plain data, and torch's safe loader refused it"):
        load_dcp(folder, {"model": demo_model().state_dict(), "note": 0})
    assert not marker.exists()
    with single_process_dcp():
        dcp.load(
            {"model": demo_model().state_dict(), "note": 0}, checkpoint_id=str(folder), no_dist=True
        )
    assert marker.exists()  # what torch's own planner does with the same folder


@pytest.mark.slow
def test_cli_fsdp_in_a_subprocess(tmp_path):
    """Through the real launcher, as a user types it."""
    out = tmp_path / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptkit",
            "train",
            "--mode",
            "fsdp",
            "--epochs",
            "1",
            "--out",
            str(out),
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, _ranks_said(proc.stderr)
    assert proc.stdout.splitlines()[-1] == f"Checkpoint {out / 'ckpt-epoch0001'}"
    assert "Trained 1 epoch in fsdp mode" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fsdp_with_nccl_reads_back_on_the_cpu(tmp_path):
    world = min(2, torch.cuda.device_count())
    out = tmp_path / "run"
    result = train(
        TrainConfig(
            mode="fsdp", epochs=2, nproc_per_node=world, device="cuda", out=str(out), **FAST
        )
    )
    folder = Path(result.checkpoint)
    meta = torch.load(folder / "meta.pt", map_location="cpu", weights_only=True)["ckptkit"]
    assert (meta["mode"], meta["backend"], meta["device_type"]) == ("fsdp", "nccl", "cuda")
    # the DCP folder holds CUDA-tagged chunks; ckptkit reads them on the CPU, statically
    report = ckptkit.convert(folder, tmp_path / "model.safetensors")
    assert report.verified
    missing, unexpected = load_file_into_demo(tmp_path / "model.safetensors")
    assert not missing and not unexpected


def load_file_into_demo(path):
    from safetensors.torch import load_model

    return load_model(demo_model(), path, device="cpu")
