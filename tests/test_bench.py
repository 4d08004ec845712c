"""bench/run.py --quick keeps working (the full run is not part of CI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_bench_quick_runs_and_reports_every_way():
    proc = subprocess.run([sys.executable, "bench/run.py", "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    ways = results["inspect"]
    assert set(ways) == {"ckptkit inspect --json", "torch.load (full)", "torch.load (mmap=True)",
                         "import torch (alone)"}  # fmt: skip
    assert all(r["wall_s"] > 0 and r["peak_anon_bytes"] > 0 for r in ways.values())
    assert len(results["convert"]) == 4 and len(results["flat_memory"]) == 2
    assert set(results["torch"]) == {"import torch (alone)", "--dtype bf16 to .safetensors",
                                     "to .pt", "--dtype bf16 to .pt"}  # fmt: skip
    assert results["checkpoint"]["largest_tensor_bytes"] > 0
    assert set(results["diff"]) == {"ckptkit diff --atol 1e-2", "cat both files once"}


@pytest.mark.slow
def test_dcp_bench_quick_runs_and_reports_every_way():
    proc = subprocess.run([sys.executable, "bench/dcp.py", "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert set(results["to safetensors"]) == {
        "ckptkit convert (verified)", "dcp_to_torch_save + torch.load + save_file",
        "cp of the model's bytes"}  # fmt: skip
    assert len(results["to .pt and dcp"]) == 5
    assert results["checkpoint"]["model_bytes"] > 0
    assert all(r["wall_s"] > 0 for r in results["inspect"].values())
