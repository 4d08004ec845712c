"""``python -m ckptkit`` run inside a downloaded folder imports nothing from it (as ``python -P``
does): a ``click.py`` or ``torch.py`` lying there never runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, free_port

BAIT = "import pathlib; pathlib.Path(__file__).with_suffix('.ran').write_text('ran')\n"


def _bait_folder(tmp_path):
    for name in ("click", "torch", "tqdm", "safetensors", "json"):
        (tmp_path / f"{name}.py").write_text(BAIT)
    return tmp_path


def _env():
    # ckptkit itself from this checkout; the current folder is what is under test.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONSAFEPATH", None)
    return env


@pytest.mark.parametrize(
    "flags",
    [
        ["-m"],
        ["-Em"],
        pytest.param(["-Bm"], marks=pytest.mark.slow),
        pytest.param(["-u", "-m"], marks=pytest.mark.slow),
        pytest.param(["-X", "utf8", "-m"], marks=pytest.mark.slow),
    ],
)
def test_python_m_ckptkit_runs_nothing_from_the_current_folder(tmp_path, flags):
    """However -m comes (alone, or after other flags in one argument: -Em)."""
    folder = _bait_folder(tmp_path)
    done = subprocess.run(
        [sys.executable, *flags, "ckptkit", "inspect", str(ROOT / "fixtures" / "ddp.pt")],
        cwd=folder,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "state dict" in done.stdout
    assert not list(folder.glob("*.ran")), "a module in the current folder was imported"


def test_the_bait_is_real(tmp_path):
    """The same folder does hijack a plain ``python -c 'import click'``: the test above can fail."""
    folder = _bait_folder(tmp_path)
    subprocess.run(
        [sys.executable, "-c", "import click"], cwd=folder, env=_env(), check=True, timeout=60
    )
    assert (folder / "click.ran").exists()


@pytest.mark.slow
def test_torchrun_m_ckptkit_runs_nothing_from_the_current_folder(tmp_path):
    folder = _bait_folder(tmp_path)
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"),  # its own sys.path: the script's folder
            "--nproc-per-node",
            "1",
            "-m",
            "ckptkit",
            "inspect",
            str(ROOT / "fixtures" / "ddp.pt"),
        ],
        cwd=folder,
        env={**_env(), "PET_MASTER_PORT": str(free_port())},  # torchrun's --master-port
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert not list(folder.glob("*.ran")), "a module in the current folder was imported"
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--batch-size", "3", "--nproc-per-node", "2", "--mode", "ddp"], "does not split"),
        (["--resume", "missing.pt"], "cannot resume: missing.pt does not exist"),
        (["--lr", "nan"], "--lr nan is not a finite number"),
        # A subprocess each: the rest in the full suite.
        *[
            pytest.param(flags, needle, marks=pytest.mark.slow)
            for flags, needle in [
                (["--grad-accum", "3", "--batch-size", "4"], "does not split"),
                (["--model", "nomodule"], "is not MODULE:FACTORY"),
                (["--loss", "nofn"], "unknown --loss"),
                (["--early-stop-patience", "2"], "needs --monitor"),
                (["--lr", "-1"], "--lr -1.0 is not a finite number"),
                (["--lr", "0"], "--lr must be positive"),
                (["--weight-decay", "inf"], "--weight-decay inf is not a finite number"),
            ]
        ],
    ],
)
def test_train_usage_errors_answer_before_torch_is_imported(tmp_path, flags, needle):
    """A usage error of train is checked from the flags alone: torch (seconds to import) is
    not imported to say it."""
    probe = (
        "import sys\n"
        "from ckptkit.cli import main\n"
        f"sys.argv = ['ckptkit', 'train', '--out', 'run', *{flags!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('torch imported:', 'torch' in sys.modules, 'exit', code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "torch imported: False exit 2", (done.stdout, done.stderr)
    (line,) = done.stderr.splitlines()
    assert line.startswith("Error: ") and needle in line
