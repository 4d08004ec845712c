"""``inspect --stats``: every tensor's min, max, mean, std and non-finite counts, read once,
against torch's own reductions."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

import ckptkit
from ckptkit.stats import PIECE


def values() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(PIECE + 12345, generator=gen) * 3 + 1  # more than one piece
    odd = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -2.0, float("nan")])
    return {
        "big": big,
        "bf16": torch.randn(300, 7, generator=gen).to(torch.bfloat16),
        "half": torch.randn(64, generator=gen).half(),
        "odd": odd,
        "steps": torch.arange(10, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "all_nan": torch.full((3,), float("nan")),
    }


def expected(t: torch.Tensor) -> dict:
    wide = t.double() if t.is_floating_point() else t.to(torch.float64)
    finite = wide[torch.isfinite(wide)]
    nan = int(torch.isnan(wide).sum())
    out = {"nan": nan, "inf": wide.numel() - finite.numel() - nan}
    if finite.numel():
        out |= {
            "min": float(finite.min()),
            "max": float(finite.max()),
            "mean": float(finite.mean()),
            "std": float(finite.std(unbiased=False)),
        }
    return out


def check(got: dict, tensor: torch.Tensor) -> None:
    want = expected(tensor)
    assert (got["nan"], got["inf"]) == (want["nan"], want["inf"])
    assert got["elements"] == tensor.numel()
    for name in ("min", "max", "mean", "std"):
        if name not in want:
            assert got[name] is None
        else:
            assert math.isclose(got[name], want[name], rel_tol=1e-9, abs_tol=1e-9), name


@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_stats_match_torch(tmp_path, run, suffix):
    state = values()
    path = tmp_path / f"model.{suffix}"
    if suffix == "safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)
    result = run("inspect", path, "--stats", "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert set(stats) == set(state)
    for key, tensor in state.items():
        check(stats[key], tensor)


def test_strided_and_special_tensors(tmp_path):
    """A transposed view goes through torch; a sparse tensor is named, not summarised."""
    base = torch.randn(5, 3)
    path = tmp_path / "odd.pt"
    torch.save({"t": base.T, "sparse": torch.eye(3).to_sparse()}, path)
    stats = ckptkit.tensor_stats(path)
    check(stats["t"].to_dict(), base.T)
    assert stats["sparse"].skipped == "sparse" and stats["sparse"].mean is None


def test_text_table_and_the_non_finite_line(tmp_path, run):
    save_file(values(), tmp_path / "m.safetensors")
    result = run("inspect", tmp_path / "m.safetensors", "--stats", "--filter", "o*")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("key "))
    assert lines[header].split() == ["key", "min", "max", "mean", "std", "nan", "inf"]
    assert lines[header + 1].split() == ["odd", "-2", "1", "-0.5", "1.5", "2", "2"]
    assert lines[-1] == "not finite  1 of 1 tensors hold NaN or inf: odd"
    save_file({"w": torch.ones(4)}, tmp_path / "ok.safetensors")
    ok = run("inspect", tmp_path / "ok.safetensors", "--stats").stdout.splitlines()
    assert ok[-1] == "finite      every value of the 1 tensors"
