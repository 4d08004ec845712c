"""inspect / summarize: everything from headers, no tensor data, no torch import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import FIXTURE_DIR, FIXTURES, ROOT
from safetensors.torch import save_file

import ckptkit
from ckptkit.render import tree_lines
from ckptkit.summary import collapse, summarize


@pytest.mark.parametrize("fx", FIXTURES, ids=lambda f: f.name)
def test_every_fixture_is_summarized(fx):
    summary = summarize(FIXTURE_DIR / fx.name)
    assert summary.selected == fx.selected
    assert [w.prefix for w in summary.wrappers] == list(fx.wrappers)
    assert len(summary.tensors) == {"tied.pt": 2, "swa.pt": 10}.get(fx.name, 9)
    expected_verdict = "dangerous" if fx.bad else ("unknown" if fx.allow else "safe")
    assert summary.safety.verdict == expected_verdict
    doc = summary.to_dict()
    json.dumps(doc)  # JSON-ready
    assert doc["tensor_count"] == len(doc["tensors"])


def test_training_checkpoint_details():
    summary = summarize(FIXTURE_DIR / "training.pt")
    assert summary.parameters == 116 and summary.nbytes == 468
    assert summary.bytes_by_dtype == {"float32": 460, "int64": 8}
    (optimizer,) = summary.dropped
    assert (optimizer.path, optimizer.tensors) == ("optimizer", 18)
    assert summary.extras["epoch"] == 3
    doc = summary.to_dict()
    assert doc["convert_strips"] == "module."
    assert doc["other_parts"] == [{"path": "optimizer", "tensors": 18, "bytes": 816}]


def test_tied_shared_and_strided():
    assert summarize(FIXTURE_DIR / "tied.pt").aliases == {"head.weight": "embed.weight"}
    (group,) = summarize(FIXTURE_DIR / "flat_buffer.pt").shared
    assert len(group) == 8
    assert summarize(FIXTURE_DIR / "transposed.pt").non_contiguous == ["body.0.weight"]


def test_converted_metadata_is_decoded(tmp_path):
    dst = tmp_path / "m.safetensors"
    ckptkit.convert(FIXTURE_DIR / "training.pt", dst, strip_module=True)
    summary = summarize(dst)
    meta = summary.ckptkit_metadata
    assert meta["source"] == "training.pt" and meta["removed_prefixes"] == ["module."]
    assert meta["extras"]["epoch"] == 3
    assert summary.to_dict()["metadata"] == {"format": "pt"}


def test_collapse_folds_repeated_layers_only_when_complete():
    same = ("f32", (4,))
    rows = [(f"layers.{i}.w", same) for i in range(12)] + [("head.w", same)]
    assert collapse(rows) == [(("layers", "{0..11}", "w"), same, 12), (("head", "w"), same, 1)]
    # Nested indices fold when every combination is there.
    grid = [(f"b.{i}.l.{j}.w", same) for i in range(3) for j in range(4)]
    assert collapse(grid) == [(("b", "{0..2}", "l", "{0..3}", "w"), same, 12)]
    # Gaps are listed, different shapes stay apart, two are not folded.
    gaps = [(f"x.{i}.w", same) for i in (0, 2, 5)] + [("x.7.w", ("f32", (8,)))]
    assert collapse(gaps)[0] == (("x", "{0,2,5}", "w"), same, 3)
    assert collapse([("a.0.w", same), ("a.1.w", same)]) == [
        (("a", "0", "w"), same, 1),
        (("a", "1", "w"), same, 1),
    ]


def test_tree_fits_a_big_model_on_a_screen(tmp_path):
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 40)
    path = tmp_path / "big.pt"
    torch.save(model.state_dict(), path)
    summary = summarize(path)
    assert len(summary.tensors) == 480
    lines = tree_lines(summary)
    assert lines[0] == "layers.{0..39}  (480 tensors, 1.4 MB)"
    assert "    in_proj_weight  [96, 32] f32  x40  491.5 kB" in lines
    assert len(lines) < 25
    assert tree_lines(summary, depth=1) == [lines[0]]
    assert tree_lines(summary, key_filter="layers.3.norm1.*") == [
        "layers.3.norm1  (2 tensors, 256 B)",
        "  weight  [32] f32  128 B",
        "  bias    [32] f32  128 B",
    ]


def test_sharded_folder(tmp_path):
    state = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    keys = list(state)
    save_file({k: state[k] for k in keys[:5]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in keys[5:]}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {
        k: f"model-0000{1 if i < 5 else 2}-of-00002.safetensors" for i, k in enumerate(keys)
    }
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 468}, "weight_map": weight_map})
    )
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        summary = summarize(path)
        assert summary.format == "sharded safetensors" and len(summary.tensors) == 9
        assert len(summary.shards) == 2
    # ...and diff / convert read it too.
    assert ckptkit.diff(tmp_path, FIXTURE_DIR / "single.pt").equal
    ckptkit.convert(tmp_path, tmp_path / "merged.safetensors")
    assert ckptkit.diff(tmp_path / "merged.safetensors", FIXTURE_DIR / "dp.pt").equal


def test_inspect_cli_views(run, fixture_copy):
    fixture_copy("training.pt")
    result = run("inspect", "training.pt")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == "training.pt  (torch-zip, 9.8 kB on disk)"
    assert "state dict  'model' (found by its name)" in lines
    assert "tensors     9, 116 elements, 468 B (f32 460 B, i64 8 B)" in lines
    assert "also        optimizer: 18 tensors, 816 B (not weights)" in lines
    assert "safety      safe: 4 globals, all in torch's weights_only set" in lines
    flat = run("inspect", "training.pt", "--flat", "--filter", "*head*")
    assert flat.stdout.splitlines()[-2:] == [
        "module.head.weight  [3, 8] f32  96 B",
        "module.head.bias    [3] f32  12 B",
    ]
    doc = json.loads(run("inspect", "training.pt", "--json", "--filter", "*bias").stdout)
    assert [t["key"] for t in doc["tensors"]] == [
        "module.body.0.bias",
        "module.body.1.bias",
        "module.head.bias",
    ]
    bad = run("inspect", "training.pt", "--flat", "--depth", "2")
    assert (
        bad.exit_code == 2
        and bad.stderr == "Error: --flat and --depth do not go together; use one of them\n"
    )


def test_inspect_shows_unsafe_files_without_running_them(run, fixture_copy, tmp_path):
    fixture_copy("malicious.pt")
    result = run("inspect", "malicious.pt")
    assert result.exit_code == 0
    assert (
        "safety      dangerous: builtins.exec (dangerous); `ckptkit scan` explains" in result.stdout
    )
    assert not (tmp_path / "ckptkit_pwned").exists()


@pytest.mark.parametrize("name", ["training.pt", "legacy_dp.pt", "single.safetensors"])
def test_inspect_and_help_do_not_import_torch(name):
    code = (
        "import sys\n"
        "from ckptkit.cli import cli\n"
        f"cli.main(['inspect', {str(FIXTURE_DIR / name)!r}], standalone_mode=False)\n"
        "cli.main(['--help'], standalone_mode=False)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_tree_keeps_file_order_for_unfolded_keys():
    same = ("f32", (8,))
    rows = [("a.0.bias", same), ("a.1.weight", same), ("a.1.bias", same)]
    assert [parts for parts, _, _ in collapse(rows)] == [
        ("a", "0", "bias"),
        ("a", "1", "weight"),
        ("a", "1", "bias"),
    ]


def test_tied_bytes_count_once_and_shards_are_in_order(tmp_path):
    tied = summarize(FIXTURE_DIR / "tied.pt")
    (alias,) = tied.aliases
    assert tied.nbytes == sum(i.nbytes for k, i in tied.tensors if k != alias)
    out = tmp_path / "s.safetensors"
    ckptkit.convert(FIXTURE_DIR / "single.pt", out, max_shard_size="200B")
    shards = list(summarize(tmp_path / "s.safetensors.index.json").shards)
    assert shards == sorted(shards) and len(shards) > 1


def test_inspect_suggests_a_prefix_every_key_shares(run, fixture_copy):
    assert summarize(FIXTURE_DIR / "lightning.ckpt").common_prefix == "model."
    assert summarize(FIXTURE_DIR / "single.pt").common_prefix is None
    assert summarize(FIXTURE_DIR / "ddp_compiled.pt").common_prefix is None  # wrappers aside
    fixture_copy("lightning.ckpt")
    lines = run("inspect", "lightning.ckpt").stdout.splitlines()
    assert (
        "prefix      every key starts with 'model.'; `ckptkit convert --strip-prefix model.` "
        "removes it" in lines
    )
