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
from helpers import ROOT
from torch import nn

import ckptkit
from ckptkit.engine import TrainConfig, train
from ckptkit.engine.checkpoint import LATEST, list_checkpoints
from ckptkit.engine.demo import demo_model
from ckptkit.errors import UsageError

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


@pytest.mark.parametrize("mode", ["single", pytest.param("ddp", marks=pytest.mark.slow)])
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
    assert a["step"] == b["step"] == 128 and a["batch_in_epoch"] == b["batch_in_epoch"] == 0


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
from ckptkit.errors import UsageError


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


class Exiting(Crashing):
    """Rank 1 leaves without a word (os._exit), as a segfaulting extension or OOM-kill would."""

    def forward(self, x):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 3:
            os._exit(7)
        return self.net(x)


def exiting():
    return Exiting()


class Hanging(Crashing):
    """Rank HANG_RANK stops answering at its 3rd step, as a stuck data loader would."""

    def forward(self, x):
        self.calls += 1
        if os.environ.get("RANK") == os.environ.get("HANG_RANK", "1") and self.calls == 3:
            time.sleep(300)
        return self.net(x)


def hanging():
    return Hanging()


def threads():
    """Records the threads each worker runs with."""
    rank = os.environ.get("RANK", "0")
    with open(f"threads-{rank}.txt", "w") as f:
        f.write(f"{os.environ.get('OMP_NUM_THREADS')} {torch.get_num_threads()}")
    return demo_model()
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


@pytest.mark.slow  # 4-5 s of real worker processes; the full suite runs it
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


@pytest.mark.slow
def test_a_worker_that_exits_without_a_word_is_named_with_its_exit_code(helpers):
    proc = cli(
        helpers,
        "--mode",
        "ddp",
        "--model",
        "engine_helpers:exiting",
        "--out",
        "exit",
        "--timeout",
        "20",
        "-q",
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "Error: worker rank 1 failed: exit code 7; the other workers were stopped"
    ), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("hang", ["1", "0"])
def test_a_hung_rank_is_named_within_the_timeout(helpers, hang):
    started = time.monotonic()
    env = {**os.environ, "HANG_RANK": hang}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptkit",
            "train",
            "--mode",
            "ddp",
            "--model",
            "engine_helpers:hanging",
            "--out",
            "hang",
            "--timeout",
            "6",
            "-q",
        ],
        cwd=helpers,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"Error: rank {hang} hung: it never reached the collective the other ranks waited in for "
        "--timeout 6 s; see what it was doing: a stuck data loader, a deadlock, fewer batches "
        "than the others; the other workers were stopped"
    ), proc.stderr[-3000:]
    # the timeout, the check-in (5 s), the hung rank's grace after SIGTERM (5 s), start-up
    assert elapsed < 6 + 25, elapsed


@pytest.mark.slow
def test_workers_run_one_thread_each_as_under_torchrun(helpers):
    proc = cli(
        helpers,
        "--mode",
        "ddp",
        "--model",
        "engine_helpers:threads",
        "--epochs",
        "1",
        "--out",
        "threads",
    )
    assert proc.returncode == 0, proc.stderr
    assert "OMP_NUM_THREADS=1 in each of the 2 workers, as torchrun sets it" in proc.stderr
    for rank in (0, 1):
        assert (helpers / f"threads-{rank}.txt").read_text() == "1 1"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # the user's choice stands
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptkit",
            "train",
            "--mode",
            "ddp",
            "--model",
            "engine_helpers:threads",
            "--epochs",
            "1",
            "--out",
            "threads2",
            "-q",
        ],
        cwd=helpers,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert (helpers / "threads-1.txt").read_text() == "2 2"


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert sorted(p.name for p in out.iterdir()) == [
        "ckpt-epoch0001.pt",
        "latest",
        "metrics.jsonl",
        "steps.jsonl",
    ]


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert meta["config"]["nproc_per_node"] == 1  # what torchrun started, not the default 2


@pytest.mark.slow
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_mixed_precision_saves_and_resumes(tmp_path, precision):
    """Autocast on CUDA; fp16's gradient scaler state is saved in the checkpoint and taken
    up on resume; the weights stay fp32 and load on the CPU."""
    first = run(tmp_path, precision, epochs=1, device="cuda", precision=precision)
    payload = torch.load(first.checkpoint, map_location="cpu", weights_only=True)
    assert (payload["scaler"] is not None) == (precision == "fp16")
    assert all(v.dtype == torch.float32 for v in payload["model"].values() if v.is_floating_point())
    resumed = run(tmp_path, precision, epochs=2, device="cuda", precision=precision, resume="auto")
    assert resumed.epochs_run == 1 and resumed.metrics[-1]["loss"] < first.metrics[-1]["loss"]
    demo_model().load_state_dict(weights(resumed.checkpoint), strict=True)


def test_package_exposes_the_engine_lazily(tmp_path):
    code = (
        "import sys, ckptkit\n"
        "assert 'torch' not in sys.modules\n"
        f"r = ckptkit.train(epochs=1, out={str(tmp_path / 'lazy')!r}, quiet=True)\n"
        "assert r.epochs_run == 1 and isinstance(ckptkit.TrainConfig(), ckptkit.engine.TrainConfig)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- resuming and run-folder housekeeping ----------------------------------------------------


def test_resuming_with_nothing_left_to_train_is_a_usage_error(tmp_path, run_cli_train):
    run(tmp_path, "done", epochs=2)
    with pytest.raises(UsageError, match="ckpt-epoch0002.pt is at epoch 2 and --epochs is 2"):
        run(tmp_path, "done", epochs=2, resume="auto")
    # refused before any worker starts, in the parent
    result = run_cli_train(
        "--mode",
        "ddp",
        "--epochs",
        "1",
        "--resume",
        str(tmp_path / "done" / "ckpt-epoch0002.pt"),
        "-q",
    )
    assert result.exit_code == 2
    assert "is at epoch 2 and --epochs is 1: nothing left to train" in result.stderr
    assert "give --epochs above 2" in result.stderr


def test_metrics_are_rewound_to_the_checkpoint_resumed_from(tmp_path):
    run(tmp_path, "m", epochs=3, keep_last=0)
    out = tmp_path / "m"
    run(tmp_path, "m", epochs=4, resume=str(out / "ckpt-epoch0002.pt"))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2, 3, 4]
    run(tmp_path, "m", epochs=1, overwrite=True)  # a fresh run in the same folder starts anew
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1]


def test_a_killed_saves_temp_files_go_at_start_up(tmp_path):
    out = tmp_path / "stale"
    out.mkdir()
    stale = out / ".ckpt-epoch0007.pt.x1y2.tmp"
    stale.write_bytes(b"0" * 1024)
    seen = []

    def model():
        class Probe(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = demo_model()

            def forward(self, x):
                seen.append(stale.exists())  # the first step: before any save
                raise RuntimeError("stop here")

        return Probe()

    with pytest.raises(RuntimeError, match="stop here"):
        train(TrainConfig(out=str(out), model=model, **FAST))
    assert seen == [False]


def test_every_node_reports_what_rank_0_wrote():
    from ckptkit.render import train_lines

    result = ckptkit.engine.TrainResult(
        "run", 2, None, "run/ckpt-epoch0002.pt", rank=2, writer_host="node-a"
    )
    assert train_lines(result, "ddp")[-1] == (
        "Checkpoint run/ckpt-epoch0002.pt (written by rank 0 on node-a)"
    )


def test_the_modes_known_without_torch_are_the_engine_s():
    from ckptkit.engine.config import MODES
    from ckptkit.engine.distributed import Mode

    assert MODES == tuple(m.value for m in Mode)
