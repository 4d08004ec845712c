"""Files that hold whole pickled modules or tensor subclasses, read with ``--trust``: the current
folder importable as it is for ``python``, a module's ``state_dict()`` taken at any level, and
torchao's tensor subclasses kept in ``.pt`` output or refused for safetensors by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class TinyDetect(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
            self.head = nn.Linear(4, 2)
    """
)

# Written by a project's own script, run from its folder: a whole model, and the layout
# Ultralytics' trainer saves ({"model": module, "ema": module, ...}), in fp16 as it keeps them.
SAVE = textwrap.dedent(
    """
    import torch
    from mynet import TinyDetect

    torch.manual_seed(0)
    model, ema = TinyDetect(), TinyDetect()
    torch.save(model, "whole.pt")
    torch.save(model.state_dict(), "model_sd.pt")  # the references, in fp32
    torch.save(ema.state_dict(), "ema_sd.pt")
    torch.save(
        {"epoch": 3, "model": model.half(), "ema": ema.half(), "optimizer": None},
        "trainer.pt",
    )
    """
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder holding ``mynet.py`` and the checkpoints its script saved."""
    (tmp_path / "mynet.py").write_text(MODULE)
    subprocess.run([sys.executable, "-c", SAVE], cwd=tmp_path, check=True)
    return tmp_path


def ckptkit(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, run in ``folder`` (whose path a console script's
    ``sys.path`` does not hold, unlike ``python``'s)."""
    exe = Path(sys.executable).with_name("ckptkit")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "ckptkit"]
    return subprocess.run(
        [*command, *args], cwd=folder, capture_output=True, text=True, check=False
    )


@pytest.mark.slow
def test_whole_model_converts_with_trust_from_its_folder(project):
    result = ckptkit(project, "convert", "whole.pt", "out.safetensors", "--trust")
    assert result.returncode == 0, result.stderr
    want = torch.load(project / "model_sd.pt")
    got = load_file(project / "out.safetensors")
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.slow
def test_trainer_layout_takes_the_model_or_ema_and_keeps_fp16(project):
    for flags, reference in (([], "model_sd.pt"), (["--ema"], "ema_sd.pt")):
        out = f"out{len(flags)}.safetensors"
        result = ckptkit(project, "convert", "trainer.pt", out, "--trust", *flags)
        assert result.returncode == 0, result.stderr
        got = load_file(project / out)
        want = torch.load(project / reference)
        for key, tensor in want.items():
            if tensor.is_floating_point():
                assert got[key].dtype == torch.float16, key
                assert torch.equal(got[key], tensor.half()), key
            else:
                assert torch.equal(got[key], tensor), key


@pytest.mark.slow
def test_whole_model_without_trust_is_refused_in_one_line(project):
    result = ckptkit(project, "convert", "whole.pt", "out.safetensors")
    assert result.returncode != 0
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "mynet.TinyDetect" in line and "--trust" in line
    assert not (project / "out.safetensors").exists()


@pytest.mark.slow
def test_a_missing_module_names_the_folder_to_run_from(project, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    result = ckptkit(elsewhere, "convert", str(project / "whole.pt"), "out.pt", "--trust")
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert "mynet" in line and "PYTHONPATH" in line
    assert not (elsewhere / "out.pt").exists()


@pytest.mark.slow
def test_torchao_subclass_kept_in_pt_refused_for_safetensors(tmp_path, run):
    torchao = pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))
    quantize_(model, Int8WeightOnlyConfig())
    cls = type(model[0].weight)
    assert cls.__module__.startswith(torchao.__name__)
    torch.save(model.state_dict(), tmp_path / "int8.pt")

    result = run("convert", tmp_path / "int8.pt", "out.pt", "--trust")
    assert result.exit_code == 0, result.output
    written = torch.load(tmp_path / "out.pt", weights_only=False)
    assert type(written["0.weight"]) is cls
    assert torch.equal(written["0.weight"].dequantize(), model[0].weight.dequantize())

    result = run("convert", tmp_path / "int8.pt", "out.safetensors", "--trust")
    assert result.exit_code != 0
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "'0.weight'" in line and cls.__name__ in line
    assert not (tmp_path / "out.safetensors").exists()

    shown = run("inspect", tmp_path / "int8.pt").stdout
    assert f"a tensor subclass ({cls.__module__}.{cls.__qualname__})" in shown
