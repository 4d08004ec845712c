"""The training engine: exact resume, modes that agree, portable checkpoints, failures that
lose nothing. Real DDP with gloo across processes, short process-group timeouts."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

import ckptkit
from ckptkit.engine import TrainConfig, train
from ckptkit.engine.checkpoint import LATEST, list_checkpoints
from ckptkit.engine.demo import demo_model

FAST = {"quiet": True, "timeout_s": 30.0}


def run(tmp_path: Path, name: str, **options) -> ckptkit.engine.TrainResult:
    return train(TrainConfig(out=str(tmp_path / name), **FAST, **options))


def weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_bit_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """One 2-process DDP run of 2 epochs, shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("ddp")
    result = train(
        TrainConfig(mode="ddp", epochs=2, nproc_per_node=2, out=str(out / "run"), **FAST)
    )
    return Path(result.checkpoint)


@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_resume_is_exact(tmp_path, mode):
    straight = run(tmp_path, "straight", mode=mode, epochs=4)
    run(tmp_path, "split", mode=mode, epochs=2)
    resumed = run(tmp_path, "split", mode=mode, epochs=4, resume="auto")
    assert resumed.resumed_from.endswith("ckpt-epoch0002.pt") and resumed.epochs_run == 2
    a = torch.load(straight.checkpoint, weights_only=True)
    b = torch.load(resumed.checkpoint, weights_only=True)
    assert_bit_equal(a["model"], b["model"])
    for sa, sb in zip(
        a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True
    ):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert a["scheduler"] == b["scheduler"] and a["step"] == b["step"] == 128


def test_modes_agree(tmp_path, ddp_run):
    single = weights(run(tmp_path, "single", mode="single", epochs=2).checkpoint)
    dp = weights(run(tmp_path, "dp", mode="dp", epochs=2).checkpoint)
    ddp = weights(ddp_run)
    assert_bit_equal(single, dp)  # on a CPU, DataParallel runs the very same module
    # DDP averages per-rank gradients: the same sums in another order, so rounding differs.
    worst = max(float((single[k] - ddp[k]).abs().max()) for k in single)
    assert worst < 1e-5, worst


def test_metrics_and_metadata(ddp_run):
    lines = [json.loads(x) for x in (ddp_run.parent / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2] and all(m["world_size"] == 2 for m in lines)
    assert lines[1]["loss"] < lines[0]["loss"] and lines[1]["accuracy"] > 0.95
    payload = torch.load(ddp_run, weights_only=True)
    meta = payload["ckptkit"]
    assert (meta["mode"], meta["world_size"], meta["nodes"], meta["backend"]) == (
        "ddp",
        2,
        1,
        "gloo",
    )
    assert meta["removed_prefixes"] == ["module."]
    assert (meta["global_batch_size"], meta["per_rank_batch_size"]) == (64, 32)
    assert meta["weights_sha256"] == ckptkit.engine.checkpoint.weights_sha256(payload["model"])
    assert meta["config"]["epochs"] == 2 and meta["torch_version"] == str(torch.__version__)
    assert {"host", "utc_time", "git_commit", "ckptkit_version", "seed"} <= set(meta)
    assert len(payload["rng"]) == 2  # each rank's stream
    assert not any(k.startswith("module.") for k in payload["model"])  # unwrapped before saving


def test_ddp_checkpoint_loads_anywhere(tmp_path, ddp_run):
    plain = demo_model()
    plain.load_state_dict(weights(ddp_run), strict=True)
    for mode in ("single", "dp"):
        folder = tmp_path / mode
        shutil.copytree(ddp_run.parent, folder)
        result = run(tmp_path, mode, mode=mode, epochs=3, resume="auto")
        assert result.resumed_from.endswith("ckpt-epoch0002.pt") and result.epochs_run == 1
    assert ckptkit.diff(ddp_run, FIXTURE_like(tmp_path, ddp_run)).equal


def FIXTURE_like(tmp_path, ddp_run):  # noqa: N802 - a converted copy, for diff
    dst = tmp_path / "weights.safetensors"
    ckptkit.convert(ddp_run, dst)
    return dst


def test_single_checkpoint_resumes_in_ddp_and_legacy_module_keys_resume(tmp_path):
    first = run(tmp_path, "single", mode="single", epochs=1)
    payload = torch.load(first.checkpoint, weights_only=True)
    # An old-style DDP checkpoint: `module.` keys, legacy (pre-1.6) file format.
    payload["model"] = {f"module.{k}": v for k, v in payload["model"].items()}
    legacy = tmp_path / "legacy.pt"
    torch.save(payload, legacy, _use_new_zipfile_serialization=False)
    for mode in ("ddp", "single"):
        result = run(
            tmp_path,
            f"from-legacy-{mode}",
            mode=mode,
            epochs=2,
            resume=str(legacy),
            nproc_per_node=2,
        )
        assert result.epochs_run == 1 and result.resumed_from == str(legacy)


def test_keep_last_latest_and_formats(tmp_path):
    result = run(tmp_path, "keep", epochs=4, keep_last=2, save_format="both")
    folder = Path(result.out)
    assert [p.name for p in list_checkpoints(folder)] == ["ckpt-epoch0003.pt", "ckpt-epoch0004.pt"]
    assert (folder / "ckpt-epoch0004.safetensors").exists()
    assert not (folder / "ckpt-epoch0002.safetensors").exists()
    assert (folder / LATEST).read_text().strip() == "ckpt-epoch0004.pt"
    summary = ckptkit.summarize(folder / "ckpt-epoch0004.safetensors")
    assert summary.training["epoch"] == 4 and summary.training["mode"] == "single"
    # A weights-only run resumes its weights and epoch counter from the safetensors file.
    only = run(tmp_path, "st", epochs=2, save_format="safetensors")
    assert only.checkpoint.endswith("ckpt-epoch0002.safetensors")
    again = run(tmp_path, "st", epochs=3, save_format="safetensors", resume="auto")
    assert again.epochs_run == 1


def test_bad_options(tmp_path):
    from ckptkit.errors import UsageError

    with pytest.raises(UsageError, match="does not split over 2 ranks"):
        run(tmp_path, "odd", mode="ddp", batch_size=63, nproc_per_node=2)
    with pytest.raises(UsageError, match="is not MODULE:FACTORY"):
        run(tmp_path, "bad", model="nonsense")
    with pytest.raises(ckptkit.CkptkitError, match="cannot resume: .*nope.pt does not exist"):
        run(tmp_path, "x", resume=str(tmp_path / "nope.pt"))


# --- failures, in real processes ------------------------------------------------------------

HELPERS = '''
import os, time
import torch
from torch import nn
from ckptkit.engine.demo import demo_model


class Crashing(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = demo_model()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 5:
            raise RuntimeError("rank one fell over on purpose")
        return self.net(x)


def crashing():
    return Crashing()


class Ballast(nn.Module):
    """The demo model plus 120 MB of buffer, so a save takes long enough to be interrupted."""

    def __init__(self):
        super().__init__()
        self.net = demo_model()
        self.register_buffer("ballast", torch.zeros(30_000_000))

    def forward(self, x):
        return self.net(x)


def ballast():
    return Ballast()
'''


@pytest.fixture
def helpers(tmp_path):
    (tmp_path / "engine_helpers.py").write_text(HELPERS)
    return tmp_path


def cli(cwd, *args, preexec=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "ckptkit", "train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec,
    )


def test_a_crashing_worker_ends_the_job_fast_naming_its_rank(helpers):
    started = time.monotonic()
    proc = cli(
        helpers,
        "--mode",
        "ddp",
        "--nproc-per-node",
        "2",
        "--model",
        "engine_helpers:crashing",
        "--out",
        "crash",
        "--timeout",
        "20",
        "-q",
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "Error: worker rank 1 failed: RuntimeError: rank one fell over on purpose; "
        "the other workers were stopped"
    )
    assert elapsed < 20, elapsed  # the launcher stops rank 0 at once, no timeout is waited out


def test_sigkill_during_a_save_loses_nothing(helpers):
    out = helpers / "killed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptkit",
            "train",
            "--model",
            "engine_helpers:ballast",
            "--epochs",
            "3",
            "--out",
            str(out),
            "-q",
        ],
        cwd=helpers,
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / LATEST).exists() and list(out.glob(".ckpt-epoch0002.pt.*.tmp")):
                proc.send_signal(signal.SIGKILL)  # mid-way through writing epoch 2
                break
            time.sleep(0.001)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the save finished before it could be interrupted"
    assert (out / LATEST).read_text().strip() == "ckpt-epoch0001.pt"
    assert [p.name for p in list_checkpoints(out)] == ["ckpt-epoch0001.pt"]
    assert torch.load(out / "ckpt-epoch0001.pt", weights_only=True)["epoch"] == 1
    resumed = cli(
        helpers,
        "--model",
        "engine_helpers:ballast",
        "--epochs",
        "2",
        "--out",
        str(out),
        "--resume",
        "auto",
        "--json",
        "-q",
    )
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    assert result["resumed_from"].endswith("ckpt-epoch0001.pt") and result["epochs_run"] == 1
    assert not list(out.glob("*.tmp"))  # the torn temp file was cleaned up


def _file_size_limit(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_save_that_runs_out_of_space_keeps_the_previous_checkpoint(helpers):
    out = helpers / "full"
    assert cli(helpers, "--epochs", "1", "--out", str(out), "-q").returncode == 0
    before = (out / "ckpt-epoch0001.pt").read_bytes()
    # The next checkpoint cannot be written whole: the file-size limit stands in for a full disk.
    proc = cli(
        helpers,
        "--epochs",
        "2",
        "--out",
        str(out),
        "--resume",
        "auto",
        "-q",
        preexec=_file_size_limit(20_000),
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1].startswith(
        f"Error: cannot write {out}/ckpt-epoch0002.pt: File too large"
    )
    assert (out / "ckpt-epoch0001.pt").read_bytes() == before
    assert (out / LATEST).read_text().strip() == "ckpt-epoch0001.pt"
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-epoch0001.pt", "latest", "metrics.jsonl"]


def test_a_read_only_run_folder_fails_before_training(helpers):
    out = helpers / "frozen"
    assert cli(helpers, "--epochs", "1", "--out", str(out), "-q").returncode == 0
    if os.geteuid() == 0:
        frozen = subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode == 0
        if not frozen:
            pytest.skip("root without chattr: no way to make a folder read-only here")
        undo = ["chattr", "-i", str(out)]
    else:
        out.chmod(0o555)
        undo = ["chmod", "755", str(out)]
    try:
        proc = cli(helpers, "--epochs", "2", "--out", str(out), "--resume", "auto", "-q")
    finally:
        subprocess.run(undo, check=True)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1].startswith(f"Error: cannot write to --out {out}: ")
    assert torch.load(out / "ckpt-epoch0001.pt", weights_only=True)["epoch"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_simulated_on_localhost(tmp_path):
    """examples/two_nodes.sh: two torchrun agents, one per 'node', rendezvous over TCP on
    localhost; ckptkit runs in place under each."""
    out = tmp_path / "two-nodes"
    env = {**os.environ, "OUT": str(out), "MASTER_PORT": str(_free_port())}
    proc = subprocess.run(
        ["bash", "examples/two_nodes.sh", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    meta = torch.load(out / "ckpt-epoch0002.pt", weights_only=True)["ckptkit"]
    assert (meta["world_size"], meta["nodes"], meta["mode"]) == (2, 2, "ddp")


def test_examples_train_own_model_and_load_anywhere(tmp_path):
    out = tmp_path / "own"
    proc = subprocess.run(
        [sys.executable, "examples/train_own_model.py", "single", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("single: accuracy ")
    meta = torch.load(out / "ckpt-epoch0003.pt", weights_only=True)["ckptkit"]
    assert meta["config"]["model"] == "__main__:make_model"
    demo = run(tmp_path, "demo", epochs=1)
    proc = subprocess.run(
        [sys.executable, "examples/load_anywhere.py", demo.checkpoint],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "DataParallel: add 'module.'" in proc.stdout
        and "torch.compile: add '_orig_mod.'" in proc.stdout
    )


def test_cli_train_in_process(run_cli_train):
    result = run_cli_train("--epochs", "1", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["epochs_run"] == 1 and doc["checkpoint"].endswith("ckpt-epoch0001.pt")


@pytest.fixture
def run_cli_train(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ckptkit.cli import cli as group

    monkeypatch.chdir(tmp_path)
    return lambda *args: CliRunner().invoke(group, ["train", "--out", "run", *args])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["single", "dp", "ddp"])
def test_cuda_modes(tmp_path, mode):
    result = run(
        tmp_path,
        mode,
        mode=mode,
        epochs=2,
        device="cuda",
        nproc_per_node=min(2, torch.cuda.device_count()),
    )
    meta = torch.load(result.checkpoint, map_location="cpu", weights_only=True)["ckptkit"]
    assert meta["device_type"] == "cuda"
    assert meta["backend"] == ("nccl" if mode == "ddp" else None)
    demo_model().load_state_dict(weights(result.checkpoint), strict=True)  # loads on the CPU


def test_package_exposes_the_engine_lazily(tmp_path):
    code = (
        "import sys, ckptkit\n"
        "assert 'torch' not in sys.modules\n"
        f"r = ckptkit.train(epochs=1, out={str(tmp_path / 'lazy')!r}, quiet=True)\n"
        "assert r.epochs_run == 1 and isinstance(ckptkit.TrainConfig(), ckptkit.engine.TrainConfig)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
