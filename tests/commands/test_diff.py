"""diff: any two formats, wrappers normalised, bit-exact by default, diff(1) exit codes."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch
from helpers import FIXTURE_DIR, FIXTURES, ROOT, run_measured
from safetensors.torch import save_file

import ckptkit


@pytest.mark.parametrize(
    "fx", [f for f in FIXTURES if f.model == "tiny" and not f.bad], ids=lambda f: f.name
)
def test_every_tiny_fixture_equals_the_plain_one(fx):
    report = ckptkit.diff(FIXTURE_DIR / fx.name, FIXTURE_DIR / "single.pt", allow_globals=fx.allow)
    # (AveragedModel's n_averaged goes with its wrapper, as convert --strip-wrappers drops it.)
    assert report.equal, report.to_dict()
    assert len(report.tensors) == 9 and all(t.status == "equal" for t in report.tensors)


def test_ddp_checkpoint_and_its_safetensors_compare_equal(tmp_path):
    dst = tmp_path / "m.safetensors"
    ckptkit.convert(FIXTURE_DIR / "ddp_compiled.pt", dst, strip_wrappers=True)
    report = ckptkit.diff(FIXTURE_DIR / "ddp_compiled.pt", dst)
    assert report.equal and report.a.removed == ["module.", "_orig_mod."]


def _pair(tmp_path, change):
    state = dict(torch.load(FIXTURE_DIR / "single.pt", weights_only=True))
    a = tmp_path / "a.pt"
    torch.save(state, a)
    changed = dict(state)
    change(changed)
    b = tmp_path / "b.pt"
    torch.save(changed, b)
    return a, b


def test_value_differences_and_tolerances(tmp_path):
    def nudge(s):
        s["head.bias"] = s["head.bias"] + torch.tensor([0.0, 1e-6, 0.0])

    a, b = _pair(tmp_path, nudge)
    report = ckptkit.diff(a, b)
    assert not report.equal
    (different,) = report.different
    assert different.key == "head.bias" and different.differing == 1
    assert different.max_abs == pytest.approx(1e-6, rel=0.1)
    assert ckptkit.diff(a, b, atol=1e-5).equal
    assert ckptkit.diff(a, b, rtol=1.0).equal
    assert not ckptkit.diff(a, b, atol=1e-9).equal


def test_nan_compares_bit_exact(tmp_path):
    def put_nan(s):
        s["head.bias"] = torch.tensor([float("nan"), 1.0, 2.0])

    a, b = _pair(tmp_path, put_nan)
    c = tmp_path / "c.pt"
    torch.save(torch.load(b, weights_only=True), c)
    assert ckptkit.diff(b, c).equal  # the same NaN bits
    assert not ckptkit.diff(a, b, atol=10).equal  # NaN against a number is never close


def test_keys_shapes_dtypes(tmp_path):
    def reshape(s):
        s["head.weight"] = s["head.weight"].double()
        s["body.0.bias"] = torch.zeros(9)
        del s["head.bias"]
        s["extra"] = torch.ones(1)

    a, b = _pair(tmp_path, reshape)
    report = ckptkit.diff(a, b, keys_only=True)
    assert report.only_a == ["head.bias"] and report.only_b == ["extra"]
    assert [m[0] for m in report.mismatched] == ["body.0.bias", "head.weight"]
    assert report.tensors == []  # keys-only reads no data


def test_keys_only_does_not_import_torch():
    code = (
        "import sys\nfrom ckptkit.diff import diff\n"
        f"r = diff({str(FIXTURE_DIR / 'dp.pt')!r}, {str(FIXTURE_DIR / 'single.safetensors')!r}, keys_only=True)\n"
        "assert r.equal and 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_diff_cli(run, tmp_path, fixture_copy):
    fixture_copy("ddp.pt")
    fixture_copy("single.safetensors")
    fixture_copy("tied.pt")
    same = run("diff", "ddp.pt", "single.safetensors")
    assert same.exit_code == 0
    assert same.stdout.splitlines() == [
        "A  ddp.pt (torch-zip, stripped module.)",
        "B  single.safetensors (safetensors)",
        "values       9 bit-equal, 0 within tolerance, 0 different",
        "equal",
    ]
    other = run("diff", "ddp.pt", "tied.pt", "--json")
    assert other.exit_code == 1
    doc = json.loads(other.stdout)
    assert doc["equal"] is False and doc["only_b"] == ["embed.weight"]
    missing = run("diff", "ddp.pt", "nope.pt")
    assert missing.exit_code == 2
    assert missing.stderr == "Error: nope.pt does not exist; check the path\n"
    assert run("diff", "ddp.pt", "tied.pt", "-q").stdout == ""


def test_across_dtypes_values_are_compared_in_the_wider_type(tmp_path):
    state = {"w": torch.randn(64, 33), "i": torch.arange(10)}
    a, b = tmp_path / "fp32.pt", tmp_path / "bf16.pt"
    torch.save(state, a)
    torch.save({"w": state["w"].bfloat16(), "i": state["i"].int()}, b)
    exact = ckptkit.diff(a, b)
    assert not exact.equal and not exact.mismatched
    assert {t.key: t.dtypes for t in exact.retyped} == {
        "w": ("float32", "bfloat16"),
        "i": ("int64", "int32"),
    }
    w = next(t for t in exact.tensors if t.key == "w")
    expected = (state["w"].double() - state["w"].bfloat16().double()).abs().max().item()
    assert w.status == "different" and w.max_abs == pytest.approx(expected)
    assert next(t for t in exact.tensors if t.key == "i").status == "equal"
    assert ckptkit.diff(a, b, atol=1e-1).equal  # a tolerance lets the values decide
    assert ckptkit.diff(a, b, keys_only=True).mismatched  # headers alone: dtypes differ


def test_strided_and_contiguous_sides_line_up(tmp_path, monkeypatch):
    diff_module = importlib.import_module("ckptkit.diff")
    monkeypatch.setattr(diff_module, "PIECE", 7)  # many pieces, uneven on both sides
    base = torch.randn(13, 11)
    a, b = tmp_path / "t.pt", tmp_path / "c.safetensors"
    torch.save({"x": base.t(), "y": base[::2]}, a)
    changed = base.t().contiguous().clone()
    changed[5, 3] += 1.0
    save_file({"x": changed, "y": base[::2].contiguous()}, b)
    report = ckptkit.diff(a, b)
    by_key = {t.key: t for t in report.tensors}
    assert by_key["y"].status == "equal"
    assert by_key["x"].status == "different" and by_key["x"].differing == 1
    assert by_key["x"].max_abs == pytest.approx(1.0)


@pytest.mark.slow
def test_diff_memory_stays_flat_on_a_big_checkpoint(tmp_path):
    """Two 512 MB checkpoints, one tensor changed by 1e-3: compared with --atol in a child
    whose own peak resident memory (VmHWM) stays under 256 MB."""
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(16 * 1024 * 1024, generator=gen) for i in range(8)}
    save_file(state, tmp_path / "a.safetensors")
    state["w3"] = state["w3"] + 1e-3
    torch.save(state, tmp_path / "b.pt")
    del state
    code, stdout, said, peak_mb = run_measured(
        ["diff", "a.safetensors", "b.pt", "--atol", "1e-2", "--json"], tmp_path, 300
    )
    assert code == 0, said
    doc = json.loads(stdout)
    assert doc["schema"] == 2 and doc["equal"]
    assert [t["key"] for t in doc["tensors"] if t["status"] == "close"] == ["w3"]
    assert peak_mb < 256, f"diff peaked at {peak_mb:.0f} MB"


def test_a_shard_symlinked_out_of_its_folder_is_read_and_said(tmp_path):
    """What a folder's reader followed out of the folder is named by every command, never
    silent; the values are compared as they are."""
    from click.testing import CliRunner

    from ckptkit.cli import cli

    folder, outside = tmp_path / "m", tmp_path / "outside"
    outside.mkdir()
    ckptkit.convert(FIXTURE_DIR / "single.pt", folder / "model.safetensors", max_shard_size=200)
    shard = next(folder.glob("model-00001-*"))
    shard.rename(outside / shard.name)
    shard.symlink_to(outside / shard.name)
    said = f"{shard} -> {outside / shard.name}"

    def invoke(*args):
        return CliRunner().invoke(cli, [str(a) for a in args], prog_name="ckptkit")

    shown = invoke("diff", folder, FIXTURE_DIR / "single.pt")
    assert shown.exit_code == 0 and "equal" in shown.output, shown.output
    assert f"read from outside its folder: {said}" in shown.output
    assert (
        said
        in json.loads(invoke("diff", folder, FIXTURE_DIR / "single.pt", "--json").output)["a"][
            "followed"
        ]
    )
    assert said in invoke("inspect", folder).output
    converted = invoke("convert", folder, tmp_path / "o.safetensors")
    assert converted.exit_code == 0 and said in converted.output
