"""The features of a real training run (issue 13): gradient accumulation, mixed precision,
optimizers and schedules, losses and models that return their own, --max-steps and mid-epoch
checkpoints that resume bit-exactly, SIGTERM and Ctrl-C, TOML config files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import single_process_dcp
from torch import nn
from torch.utils.data import Dataset

from ckptkit.engine import TrainConfig, train
from ckptkit.engine.build import lr_factor
from ckptkit.engine.checkpoint import list_checkpoints
from ckptkit.engine.demo import BlobData, demo_model
from ckptkit.errors import UsageError

FAST = {"quiet": True, "timeout_s": 30.0}


def run(tmp_path: Path, name: str, **options):
    return train(TrainConfig(out=str(tmp_path / name), **FAST, **options))


def model_of(result) -> dict[str, torch.Tensor]:
    return torch.load(result.checkpoint, map_location="cpu", weights_only=True)["model"]


def dcp_weights(folder: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = demo_model().state_dict()
    with single_process_dcp():
        dcp.load({"model": state}, checkpoint_id=str(folder), no_dist=True)
    return state


def bit_equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# --- the update ------------------------------------------------------------------------------


def reference_training(epochs: int, grad_accum: int, batch_size: int = 64, lr: float = 0.05):
    """The engine's single-device run written out by hand, as the PyTorch docs write gradient
    accumulation: the seeded demo model, SGD with momentum 0.9, each global batch of the
    seeded shuffle cut into ``grad_accum`` micro-batches whose losses, each divided by
    ``grad_accum``, are backpropagated before one optimizer step."""
    from torch.utils.data import DataLoader, DistributedSampler

    torch.manual_seed(0)
    model = demo_model()
    data = BlobData()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []  # each epoch's mean loss over its samples, as the metrics report it
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        loss_sum, samples = 0.0, 0.0
        for inputs, labels in DataLoader(data, batch_size, sampler=sampler, drop_last=True):
            optimizer.zero_grad(set_to_none=True)
            step_sum = 0.0
            for x, y in zip(
                inputs.tensor_split(grad_accum), labels.tensor_split(grad_accum), strict=True
            ):
                loss = nn.functional.cross_entropy(model(x), y)
                (loss / grad_accum).backward()
                step_sum += float(loss.detach()) * len(y)
                samples += len(y)
            optimizer.step()
            loss_sum += step_sum
        losses.append(loss_sum / samples)
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def test_grad_accumulation_is_one_batch_of_the_same_size(tmp_path):
    result = run(tmp_path, "accum", epochs=1, lr_schedule="constant", grad_accum=4)
    accum, losses = reference_training(epochs=1, grad_accum=4)
    assert bit_equal(model_of(result), accum)  # the very same steps
    assert [m["loss"] for m in result.metrics] == pytest.approx(losses, rel=1e-12)
    result = run(tmp_path, "whole", epochs=1, lr_schedule="constant")
    whole, losses = reference_training(epochs=1, grad_accum=1)
    assert bit_equal(model_of(result), whole)
    assert [m["loss"] for m in result.metrics] == pytest.approx(losses, rel=1e-12)
    # Accumulating 4 micro-batches of 16 is one batch of 64 summed in another order: to float
    # tolerance the same update, and not merely the same one run twice.
    assert not bit_equal(whole, accum)
    for key in whole:
        torch.testing.assert_close(accum[key], whole[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_grad_accumulation_in_ddp_matches_single(tmp_path):
    single = model_of(run(tmp_path, "single", epochs=1))
    ddp = model_of(run(tmp_path, "ddp", epochs=1, mode="ddp", nproc_per_node=2, grad_accum=2))
    for key in single:
        torch.testing.assert_close(ddp[key], single[key], rtol=1e-5, atol=1e-6)


def test_learning_rate_schedules():
    cfg = TrainConfig(epochs=4, warmup_steps=4, lr_schedule="cosine")
    factors = [lr_factor(cfg, step, 10) for step in range(40)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert factors[-1] < 0.01
    step = TrainConfig(lr_schedule="step", lr_step_epochs=2, lr_gamma=0.1)
    assert [lr_factor(step, s, 10) for s in (0, 19, 20, 40)] == [1.0, 1.0, 0.1, pytest.approx(0.01)]
    assert lr_factor(TrainConfig(lr_schedule="constant"), 99, 10) == 1.0


def test_optimizers_precision_and_clipping_train_and_are_recorded(tmp_path):
    result = run(
        tmp_path,
        "adamw",
        epochs=2,
        optimizer="adamw",
        lr=1e-3,
        weight_decay=0.01,
        lr_schedule="cosine",
        warmup_steps=5,
        precision="bf16",
        clip_grad_norm=1.0,
    )
    metrics = result.metrics
    assert metrics[-1]["loss"] < metrics[0]["loss"] and metrics[-1]["accuracy"] > 0.5
    assert metrics[-1]["lr"] < metrics[0]["lr"]  # cosine
    saved = torch.load(result.checkpoint, weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["weight_decay"] == 0.01
    assert "exp_avg" in next(iter(saved["optimizer"]["state"].values()))
    config = saved["ckptkit"]["config"]
    assert (config["optimizer"], config["precision"], config["clip_grad_norm"]) == (
        "adamw",
        "bf16",
        1.0,
    )


def test_fp16_saves_and_resumes_its_gradient_scaler(tmp_path):
    first = run(tmp_path, "fp16", epochs=1, precision="fp16")
    scaler = torch.load(first.checkpoint, weights_only=True)["scaler"]
    assert scaler["scale"] > 0 and "_growth_tracker" in scaler
    resumed = run(tmp_path, "fp16", epochs=2, precision="fp16", resume="auto")
    assert resumed.epochs_run == 1 and resumed.metrics[-1]["loss"] == resumed.metrics[-1]["loss"]


# --- tasks beyond classification ---------------------------------------------------------------


class Regression(Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 16, generator=gen)
        self.y = self.x @ torch.randn(16, 4, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class OwnLoss(nn.Module):
    """A model that takes keyword inputs and returns its own loss, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.net = demo_model()

    def forward(self, features, labels):
        logits = self.net(features)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Keyed(Dataset):
    def __init__(self):
        self.blobs = BlobData(512)

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, i):
        x, y = self.blobs[i]
        return {"features": x, "labels": y}


def l1(output, target):
    return (output - target).abs().mean()


def test_mse_a_custom_loss_and_a_model_that_returns_its_loss(tmp_path):
    mse = run(tmp_path, "mse", epochs=2, loss="mse", data=Regression, lr=0.01)
    assert mse.metrics[-1]["loss"] < mse.metrics[0]["loss"]
    assert mse.metrics[-1]["accuracy"] is None  # not a classification
    custom = run(tmp_path, "l1", epochs=1, loss=f"{__name__}:l1", data=Regression, lr=0.01)
    assert custom.metrics[0]["loss"] > 0
    own = run(tmp_path, "own", epochs=2, model=OwnLoss, data=Keyed, grad_accum=2)
    assert own.metrics[-1]["accuracy"] > 0.5  # its logits, the labels of the batch
    with pytest.raises(UsageError, match="unknown --loss 'hinge'"):
        run(tmp_path, "bad", loss="hinge")


# --- stopping and resuming mid-epoch -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["single", pytest.param("ddp", marks=pytest.mark.slow)])
def test_a_run_stopped_mid_epoch_resumes_bit_exactly(tmp_path, mode):
    procs = {"mode": mode, "nproc_per_node": 2}
    straight = run(tmp_path, "straight", epochs=3, **procs)
    stopped = run(
        tmp_path, "stopped", epochs=3, max_steps=45, save_every_steps=10, keep_last=0, **procs
    )
    assert stopped.stopped == "max_steps" and stopped.steps == 45
    names = [p.name for p in list_checkpoints(tmp_path / "stopped")]
    assert names == [
        "ckpt-epoch0000-step00000010.pt",
        "ckpt-epoch0000-step00000020.pt",
        "ckpt-epoch0000-step00000030.pt",
        "ckpt-epoch0001.pt",
        "ckpt-epoch0001-step00000040.pt",
        "ckpt-epoch0001-step00000045.pt",
    ]
    with pytest.raises(UsageError, match="is at step 45 and --max-steps is 45: nothing left"):
        run(tmp_path, "stopped", epochs=3, resume="auto", max_steps=45, **procs)
    resumed = run(tmp_path, "stopped", epochs=3, resume="auto", **procs)
    assert resumed.steps == 96 and resumed.epochs_run == 2
    assert bit_equal(model_of(resumed), model_of(straight))
    # the epoch cut in two reports what the straight run reported
    assert resumed.metrics[0]["loss"] == straight.metrics[1]["loss"]
    lines = (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]


DROPOUT = """
from torch import nn
from ckptkit.engine.demo import CLASSES, FEATURES


def dropout_model():
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, CLASSES)
    )
"""


@pytest.mark.parametrize("mode", ["single", pytest.param("ddp", marks=pytest.mark.slow)])
def test_a_resumed_run_continues_each_rank_s_random_stream(tmp_path, monkeypatch, mode):
    """With dropout, each step draws from the rank's RNG: a run stopped mid-epoch and resumed
    equals the straight run bit for bit only because the checkpoint gives every rank its own
    stream back. The same checkpoint without its RNG states (or, in DDP, with the ranks' states
    swapped) resumes into a different run: what the comparison would miss otherwise."""
    (tmp_path / "dropout_models.py").write_text(DROPOUT)
    monkeypatch.chdir(tmp_path)  # the workers import the model from here
    common = {
        "model": "dropout_models:dropout_model",
        "epochs": 1,
        "mode": mode,
        "nproc_per_node": 2,
        "lr_schedule": "constant",
    }
    straight = model_of(run(tmp_path, "straight", **common))
    stopped = run(tmp_path, "cut", max_steps=10, **common)
    assert stopped.stopped == "max_steps" and stopped.steps == 10  # mid-way through the epoch
    resumed = run(tmp_path, "cut", resume="auto", **common)
    assert resumed.steps == 32
    assert bit_equal(model_of(resumed), straight)

    checkpoint = tmp_path / "cut" / "ckpt-epoch0000-step00000010.pt"
    payload = torch.load(checkpoint, weights_only=True)
    world = 2 if mode == "ddp" else 1
    assert len(payload["rng"]) == world  # one stream per rank
    if world == 2:
        assert not torch.equal(payload["rng"][0]["torch"], payload["rng"][1]["torch"])
    # Without the states (single; DDP restores them the same way), or with the ranks' swapped.
    if world == 1:
        variants = {"without": {k: v for k, v in payload.items() if k != "rng"}}
    else:
        variants = {"swapped": {**payload, "rng": payload["rng"][::-1]}}
    for name, changed in variants.items():
        torch.save(changed, tmp_path / f"{name}.pt")
        other = run(tmp_path, name, resume=str(tmp_path / f"{name}.pt"), **common)
        assert other.steps == 32
        assert not bit_equal(model_of(other), straight), name


def test_data_loader_workers_give_the_same_run(tmp_path):
    plain = run(tmp_path, "w0", epochs=1)
    workers = run(tmp_path, "w2", epochs=1, num_workers=2)
    assert bit_equal(model_of(plain), model_of(workers))


# --- signals, in real processes ----------------------------------------------------------------

SLOW = """
import time
from torch import nn
from ckptkit.engine.demo import demo_model


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = demo_model()

    def forward(self, x):
        time.sleep(0.02)
        return self.net(x)


def slow():
    return Slow()
"""


def _start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ckptkit", "train", "--model", "helpers_slow:slow", *args],
        cwd=cwd,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal or a scheduler has
    )


def _signal_after_first_epoch(proc: subprocess.Popen, sig: int) -> str:
    seen = []
    for line in proc.stderr:  # type: ignore[union-attr]
        seen.append(line)
        if line.startswith("epoch 1/"):
            time.sleep(0.3)  # well into epoch 2
            os.killpg(proc.pid, sig)
            break
    _, rest = proc.communicate(timeout=120)
    return "".join(seen) + rest


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_sigterm_saves_at_the_next_step_and_the_run_resumes_exactly(tmp_path, mode):
    (tmp_path / "helpers_slow.py").write_text(SLOW)
    common = ["--mode", mode, "--epochs", "3", "--timeout", "30"]
    # The uninterrupted run, side by side with the one stopped (both mostly wait in sleep).
    straight = _start(tmp_path, *common, "--out", "straight", "-q")
    try:
        proc = _start(tmp_path, *common, "--out", "cut")
        stderr = _signal_after_first_epoch(proc, signal.SIGTERM)
        assert proc.returncode == 143, stderr
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("Error: stopped by SIGTERM") and "ckpt-epoch0001-step" in last, (
            stderr
        )
        assert last.endswith("resume with --resume auto") and "Traceback" not in stderr
        resumed = subprocess.run(
            [
                sys.executable,
                "-m",
                "ckptkit",
                "train",
                "--model",
                "helpers_slow:slow",
                *common,
                "--out",
                "cut",
                "--resume",
                "auto",
                "-q",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert resumed.returncode == 0, resumed.stderr
    except BaseException:  # a failure above leaves no run behind
        os.killpg(straight.pid, signal.SIGKILL)
        straight.communicate()
        raise
    _, straight_err = straight.communicate(timeout=300)
    assert straight.returncode == 0, straight_err
    a = torch.load(tmp_path / "straight" / "ckpt-epoch0003.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "ckpt-epoch0003.pt", weights_only=True)["model"]
    assert bit_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_ctrl_c_stops_cleanly(tmp_path, mode):
    (tmp_path / "helpers_slow.py").write_text(SLOW)
    proc = _start(tmp_path, "--mode", mode, "--epochs", "5", "--out", "int")
    stderr = _signal_after_first_epoch(proc, signal.SIGINT)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "Error: interrupted"
    assert "Traceback" not in stderr


# --- config files -----------------------------------------------------------------------------


@pytest.fixture
def run_cli(run):
    return run


def test_a_toml_config_with_flags_over_it(tmp_path, run_cli):
    (tmp_path / "run.toml").write_text(
        '[train]\nepochs = 1\nlr = 0.1\ngrad-accum = 2\noptimizer = "adam"\nout = "toml-run"\n'
    )
    result = run_cli("train", "--config", "run.toml", "--lr", "0.2", "-q", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    saved = torch.load(doc["checkpoint"], weights_only=True)["ckptkit"]["config"]
    assert (saved["epochs"], saved["lr"], saved["grad_accum"], saved["optimizer"]) == (
        1,
        0.2,
        2,
        "adam",
    )
    (tmp_path / "bad.toml").write_text("lr = 0.1\nlearning_rate = 3\n")
    result = run_cli("train", "--config", "bad.toml")
    assert result.exit_code == 2
    assert "names an unknown option 'learning_rate'" in result.stderr


@pytest.mark.slow
def test_compiled_model_saves_canonical_keys(tmp_path):
    result = run(tmp_path, "compiled", epochs=1, compile=True)
    saved = torch.load(result.checkpoint, weights_only=True)
    assert all(not k.startswith("_orig_mod.") for k in saved["model"])
    assert saved["ckptkit"]["removed_prefixes"] == ["_orig_mod."]
    demo_model().load_state_dict(saved["model"])


# --- validation, best and early stopping ---------------------------------------------------------


def test_validation_best_pointer_and_early_stopping(tmp_path):
    result = run(
        tmp_path,
        "val",
        epochs=12,
        val_fraction=0.25,
        monitor="val_accuracy",
        monitor_mode="max",
        keep_last=1,
        early_stop_patience=2,
    )
    metrics = result.metrics
    assert all(m["val_loss"] > 0 and 0 <= m["val_accuracy"] <= 1 for m in metrics)
    accuracy = [m["val_accuracy"] for m in metrics]
    first_best = accuracy.index(max(accuracy))
    # it stops two validations without a better accuracy after its best (the demo reaches 1.0)
    assert result.stopped == "early_stop" and len(metrics) == first_best + 3 < 12
    out = tmp_path / "val"
    best = (out / "best").read_text().strip()
    assert best == f"ckpt-epoch{first_best + 1:04d}.pt"
    assert (out / best).is_file()  # kept whatever --keep-last says
    saved = torch.load(out / best, weights_only=True)
    assert saved["monitor"] == {"best": max(accuracy), "bad": 0}
    last = torch.load(result.checkpoint, weights_only=True)["monitor"]
    assert last["bad"] == 2 and (out / "latest").read_text().strip() != best


def test_validation_data_split_over_ranks_counts_every_item_once(tmp_path):
    from ckptkit.engine.build import Run

    holder = Run.__new__(Run)
    holder.val_dataset, holder.per_rank_batch = BlobData(10), 4
    seen = []
    for rank in range(3):  # 10 items over 3 ranks: 4 batches-worth each, 2 repeated
        batches = list(holder.val_batches(rank, 3))
        assert len(batches) == 1 and batches[0][0][0].shape[0] == 4
        seen.append(batches[0][1])
    assert seen == [4, 3, 3]


@pytest.mark.slow
def test_validation_in_ddp_agrees_with_single(tmp_path):
    single = run(tmp_path, "vs", epochs=1, val_fraction=0.3)
    ddp = run(tmp_path, "vd", epochs=1, val_fraction=0.3, mode="ddp", nproc_per_node=2)
    assert ddp.metrics[0]["val_loss"] == pytest.approx(single.metrics[0]["val_loss"], rel=1e-5)
    assert ddp.metrics[0]["val_accuracy"] == single.metrics[0]["val_accuracy"]


def test_monitoring_needs_what_it_monitors(tmp_path):
    with pytest.raises(UsageError, match="--monitor val_loss needs validation data"):
        run(tmp_path, "x", monitor="val_loss")
    with pytest.raises(UsageError, match="--early-stop-patience needs --monitor"):
        run(tmp_path, "x", early_stop_patience=2)


# --- logs and plots ------------------------------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.slow
def test_plot_draws_a_single_and_a_ddp_run_side_by_side(tmp_path, run):
    pytest.importorskip("matplotlib")
    single = tmp_path / "single"
    run_result = train(TrainConfig(out=str(single), epochs=2, val_fraction=0.2, **FAST))
    ddp = train(
        TrainConfig(
            out=str(tmp_path / "ddp"),
            epochs=2,
            val_fraction=0.2,
            mode="ddp",
            nproc_per_node=2,
            **FAST,
        )
    )
    steps = [json.loads(line) for line in (single / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(10, run_result.steps + 1, 10))
    assert all(s["lr"] == 0.05 and 0 < s["loss"] for s in steps)
    result = run("plot", single, tmp_path / "ddp", "-o", "curves.png", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["image"] == "curves.png" and len(doc["runs"]) == 2
    assert _png_size(tmp_path / "curves.png") == (1200, 400)
    assert (tmp_path / "curves.png").stat().st_size > 10_000  # curves drawn, not a blank frame
    again = run("plot", single, "-o", "curves.png")
    assert again.exit_code == 1 and "exists" in again.stderr
    assert ddp.steps == run_result.steps


def test_plot_refuses_a_folder_that_is_no_run(tmp_path, run):
    result = run("plot", tmp_path, "-o", "c.png")
    assert result.exit_code == 1
    assert "holds no steps.jsonl or metrics.jsonl" in result.stderr
    assert not (tmp_path / "c.png").exists()


def test_steps_log_is_rewound_on_resume(tmp_path):
    run(tmp_path, "s", epochs=3, keep_last=0)
    run(tmp_path, "s", epochs=3, resume=str(tmp_path / "s" / "ckpt-epoch0001.pt"))
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "s" / "steps.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(10, 97, 10))


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    """--log tensorboard: the jsonl values as event files, read back by TensorBoard's own
    reader; a resumed run purges what the first one logged past its checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, "tb", epochs=3, keep_last=0, log=("tensorboard",), val_fraction=0.25)
    run(
        tmp_path,
        "tb",
        epochs=3,
        resume=str(tmp_path / "tb" / "ckpt-epoch0001.pt"),
        log=("tensorboard",),
        val_fraction=0.25,
    )
    board = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    board.Reload()
    lines = [
        json.loads(line) for line in (tmp_path / "tb" / "steps.jsonl").read_text().splitlines()
    ]
    losses = board.Scalars("train/loss")
    assert [e.step for e in losses] == [line["step"] for line in lines]  # each once, in order
    for event, line in zip(losses, lines, strict=True):
        assert event.value == pytest.approx(line["loss"], rel=1e-6)
    epochs = [
        json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [e.step for e in board.Scalars("epoch/val_loss")] == [m["step"] for m in epochs]
    assert [e.value for e in board.Scalars("epoch/lr")] == pytest.approx([m["lr"] for m in epochs])
    with pytest.raises(UsageError, match="unknown --log 'csv'"):
        TrainConfig(log=("csv",)).check()


def test_progress_lines_go_through_logging(tmp_path, capsys):
    """Rank 0's lines reach stderr, and any handler an application adds to ckptkit.train."""
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep()
    logging.getLogger("ckptkit.train").addHandler(keep)
    try:
        train(TrainConfig(out=str(tmp_path / "a"), epochs=2, timeout_s=30.0))
        train(TrainConfig(out=str(tmp_path / "a"), epochs=3, resume="auto", timeout_s=30.0))
        shown = len(seen)
        train(TrainConfig(out=str(tmp_path / "q"), epochs=1, timeout_s=30.0, quiet=True))
    finally:
        logging.getLogger("ckptkit.train").removeHandler(keep)
    assert [line.split("  ")[0] for line in seen] == [
        "epoch 1/2",
        "epoch 2/2",
        f"resumed from {tmp_path / 'a' / 'ckpt-epoch0002.pt'} at epoch 2",
        "epoch 3/3",
    ]
    assert shown == len(seen)  # --quiet: none
    err = capsys.readouterr().err
    assert "epoch 1/2  loss " in err and "samples/s" in err


# --- saving in the background ----------------------------------------------------------------


def test_async_save_writes_what_a_synchronous_save_writes(tmp_path):
    sync = run(tmp_path, "sync", epochs=3, keep_last=2)
    background = run(tmp_path, "async", epochs=3, keep_last=2, async_save=True)
    assert len(background.save_stalls) == 3
    for name in ("ckpt-epoch0002.pt", "ckpt-epoch0003.pt"):  # each save its own state
        a, b = (torch.load(tmp_path / r / name, weights_only=True) for r in ("sync", "async"))
        assert bit_equal(a["model"], b["model"]) and a["step"] == b["step"]
    a = torch.load(sync.checkpoint, weights_only=True)
    b = torch.load(background.checkpoint, weights_only=True)
    assert a["ckptkit"]["weights_sha256"] == b["ckptkit"]["weights_sha256"]
    names = [p.name for p in list_checkpoints(tmp_path / "async")]
    assert names == ["ckpt-epoch0002.pt", "ckpt-epoch0003.pt"]  # committed and pruned alike
    assert (tmp_path / "async" / "latest").read_text().strip() == "ckpt-epoch0003.pt"
    resumed = run(tmp_path, "async", epochs=4, resume="auto", async_save=True)
    assert resumed.epochs_run == 1


def test_async_dcp_save_commits_what_a_synchronous_one_does(tmp_path):
    """A DCP checkpoint written in the background (dcp.async_save) is the same folder, and the
    `best` pointer moves only once the checkpoint it names is complete."""
    options = {"epochs": 3, "keep_last": 1, "save_format": "dcp", "monitor": "loss"}
    sync = run(tmp_path, "sync", **options)
    background = run(tmp_path, "async", async_save=True, **options)
    assert len(background.save_stalls) == 3
    for name in ("latest", "best"):
        assert (tmp_path / "async" / name).read_text() == "ckpt-epoch0003\n"
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == ["ckpt-epoch0003"]
    assert not list((tmp_path / "async").glob(".*.tmp"))
    a, b = (dcp_weights(Path(r.checkpoint)) for r in (sync, background))
    assert bit_equal(a, b)
    meta = torch.load(Path(background.checkpoint) / "meta.pt", weights_only=True)
    assert meta["step"] == 96


def test_a_failed_background_save_is_raised(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    blocker = out / "ckpt-epoch0001.pt"
    blocker.mkdir()  # the commit cannot replace a folder with the file
    with pytest.raises(Exception, match="ckpt-epoch0001"):
        run(tmp_path, "ro", epochs=2, async_save=True)


def test_a_training_log_line_nested_deep_is_skipped_not_a_recursion_error(tmp_path):
    """metrics.jsonl is read on resume (rewound) and by plot: a damaged line, nested 100,000
    deep, is skipped as a torn line is."""
    from ckptkit.engine.runlog import records

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n' + "[" * 100_000 + "]" * 100_000 + '\n{"step": 2}\n')
    assert records(log) == [{"step": 1}, {"step": 2}]
