"""bench/run.py --quick keeps working (the full run is not part of CI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

# Every quick run the tests below read, started together when the first of them runs (each is
# mostly child processes importing torch: run side by side they take half the time).
RUNS = [
    ("run.py",),
    ("dcp.py",),
    ("train.py",),
    ("save.py", "--mode", "single"),
    ("save.py", "--mode", "fsdp"),
    ("adapters.py",),
    ("scale.py",),
    ("remote.py",),
    ("mapping.py",),
    ("megatron.py",),
]


@pytest.fixture(scope="module")
def started():
    procs = {
        run: subprocess.Popen(
            [sys.executable, f"bench/{run[0]}", "--quick", "--json", *run[1:]],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in RUNS
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture
def quick(started):
    def results(script: str, *args: str) -> dict:
        """``bench/SCRIPT --quick --json``'s results, the run checked to have ended well."""
        out, err = started[(script, *args)].communicate(timeout=600)
        assert started[(script, *args)].returncode == 0, err
        return json.loads(out)

    return results


@pytest.mark.slow
def test_bench_quick_runs_and_reports_every_way(quick):
    results = quick("run.py")
    ways = results["inspect"]
    assert set(ways) == {
        "ckptkit inspect --json",
        "torch.load (full)",
        "torch.load (mmap=True)",
        "import torch (alone)",
    }
    assert all(r["wall_s"] > 0 and r["peak_anon_bytes"] > 0 for r in ways.values())
    assert len(results["convert"]) == 4 and len(results["flat_memory"]) == 2
    assert set(results["torch"]) == {
        "import torch (alone)",
        "--dtype bf16 to .safetensors",
        "to .pt",
        "--dtype bf16 to .pt",
    }
    assert results["checkpoint"]["largest_tensor_bytes"] > 0
    assert set(results["diff"]) == {"ckptkit diff --atol 1e-2", "cat both files once"}


@pytest.mark.slow
def test_dcp_bench_quick_runs_and_reports_every_way(quick):
    results = quick("dcp.py")
    anchors = {"cp of the model's bytes", "cp, then sync of the file"}
    assert set(results["to safetensors"]) == {
        "ckptkit convert (verified)",
        "dcp_to_torch_save + torch.load + save_file",
        *anchors,
    }
    assert set(results["hf writer to safetensors"]) == {
        "ckptkit convert (verified)",
        "consolidate_safetensors_files",
        *anchors,
    }
    assert len(results["to .pt and dcp"]) == 6
    assert results["checkpoint"]["model_bytes"] > 0
    assert all(r["wall_s"] > 0 for r in results["inspect"].values())


@pytest.mark.slow
def test_train_and_save_benches_quick_run_and_report_every_way(quick):
    ways = quick("train.py")
    assert len(ways) == 5 and all(r["loop_samples_per_s"] > 0 for r in ways.values())
    for mode in ("single", "fsdp"):
        stalls = quick("save.py", "--mode", mode)
        assert set(stalls) == {"synchronous", "--async-save"}
        assert all(r["saves"] == 3 and r["median_stall_s"] > 0 for r in stalls.values())


@pytest.mark.slow
def test_adapters_bench_quick_runs_and_reports_every_way(quick):
    results = quick("adapters.py")
    assert set(results["merge"]) == {
        "ckptkit convert --base (verified)",
        "peft merge_and_unload + save_pretrained",
        "cp -r of the base, then sync",
        "import torch (alone)",
    }
    assert all(r["wall_s"] > 0 and r["peak_rss_bytes"] > 0 for r in results["merge"].values())
    assert set(results["flat_memory"]) == {"half", "full"}
    checks = results["correctness"]
    assert len(checks) == 3
    for name in ("bf16 base, fp32 adapter (peft's defaults)", "fp32 base, fp32 adapter"):
        assert checks[name]["bit_equal"] == checks[name]["tensors"]


@pytest.mark.slow
def test_scale_bench_quick_runs_and_reports_every_way(quick):
    results = quick("scale.py")
    counts = results["counts"]
    for n in counts:
        pt, st = results[f"{n} tensors, pt"], results[f"{n} tensors, safetensors"]
        assert {"ckptkit inspect", "ckptkit scan", "torch.load(mmap=True)"} <= set(pt) & set(st)
        assert len(pt) == 6 and len(st) == 6
        assert all(r["wall_s"] > 0 and r["peak_rss_bytes"] > 0 for r in [*pt.values()])
    sharded = results[f"{results['shards']} shards, {counts[-1]} keys"]
    assert "ckptkit inspect" in sharded and len(sharded) == 4
    assert len(results["deflated storage"]) == 4 and results["deflated_bytes"] > 0


@pytest.mark.slow
def test_remote_bench_quick_runs_and_reports_every_way(quick):
    results = quick("remote.py")
    assert results["server"]["per"] == "request" and results["server"]["latency_s"] > 0
    inspect = results["inspect"]
    kinds = ("pt", "safetensors")
    names = {f"ckptkit inspect --json ({kind} URL)" for kind in kinds}
    assert set(inspect["ways"]) == set(inspect["fetched"]) == names
    for fetched in inspect["fetched"].values():
        assert fetched["requests"] > 0 and fetched["bytes"] > 0
        assert 0 < fetched["fraction"] < 1 and fetched["server_requests"] > 0
    convert = results["convert"]
    remote = ("ckptkit convert URL --workers 8", "ckptkit convert URL --workers 1")
    ways = {*remote, "fsspec get, then ckptkit convert"}
    assert set(convert["ways"]) == set(convert["wire"]) == ways
    assert all(w["server_requests"] > 0 for w in convert["wire"].values())
    assert convert["fsspec_get_over_workers_8"] > 0
    spread = results["spread"]
    assert len(spread["ways"]) == 5 and spread["shards"] > 1
    assert spread["disk_speedup"] > 0 and spread["target_s"] > 0
    for part in ("inspect", "convert", "spread"):
        ways = results[part]["ways"].values()
        assert all(r["wall_s"] > 0 and r["peak_rss_bytes"] > 0 for r in ways)
    assert all(results["files"][kind]["tensors"] > 100 for kind in kinds)


@pytest.mark.slow
def test_mapping_and_megatron_benches_quick_run_and_check_their_outputs(quick):
    """The mapped conversions' benches: every way measured, and ckptkit's output checked bit
    for bit against the other way's (transformers' converter when installed, the
    whole-state-dict merge of a Megatron save)."""
    mapping = quick("mapping.py")
    ways = mapping["convert"]
    assert "ckptkit convert --map llama-meta (verified)" in ways
    assert all(r["wall_s"] > 0 for r in ways.values())
    if mapping["bit_for_bit"] is not None:  # transformers 4.46.3 at --transformers
        assert mapping["bit_for_bit"]["bit_equal"] == mapping["bit_for_bit"]["tensors"]
    megatron = quick("megatron.py")
    assert len(megatron["convert"]) == 6
    assert "ckptkit convert --to megatron (cut to another TP, verified)" in megatron["convert"]
    assert all(r["wall_s"] > 0 for r in megatron["convert"].values())
    assert megatron["bit_for_bit"]["whole_state_dict"]["equal"]
    assert megatron["bit_for_bit"]["tp1_model"]["equal"]
