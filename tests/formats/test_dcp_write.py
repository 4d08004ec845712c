"""``convert --to dcp``: DCP folders that torch.distributed.checkpoint reads as its own."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import FIXTURE_DIR, reference_model, single_process_dcp, state_dicts
from hypothesis import HealthCheck, given, settings
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_model

import ckptkit
from ckptkit.errors import OutputError, VerificationError
from ckptkit.formats.base.tensors import bit_equal


def _dcp_load(folder, like):
    """What ``dcp.load`` reads into a state dict shaped like ``like``."""
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    with single_process_dcp():
        dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    return target


def _same_values(loaded, tensor):
    if tensor.dtype == torch.bool:  # dcp.load copies into its target, storing a bool as 0 or 1
        stored = tensor.contiguous().reshape(-1).view(torch.uint8) != 0
        return torch.equal(loaded.reshape(-1), stored)
    return bit_equal(loaded, tensor.contiguous())


def test_dcp_load_reads_it_into_a_plain_model(tmp_path, run):
    result = run(
        "convert", FIXTURE_DIR / "ddp.pt", tmp_path / "out", "--to", "dcp", "--strip-module"
    )
    assert result.exit_code == 0, result.output
    assert "Wrote    " + str(tmp_path / "out") + " (dcp), verified bit-exact" in result.output
    assert sorted(os.listdir(tmp_path / "out")) == [".metadata", "__0_0.distcp", "ckptkit.json"]
    model = reference_model("tiny")
    state = model.state_dict()
    loaded = _dcp_load(tmp_path / "out", state)
    expected = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    assert set(loaded) == set(expected)
    assert all(bit_equal(loaded[k], expected[k]) for k in expected)
    model.load_state_dict(loaded)  # strict


def test_back_from_dcp_is_bit_exact_and_keeps_the_metadata(tmp_path):
    ckptkit.convert(
        FIXTURE_DIR / "lightning.ckpt", tmp_path / "out", to="dcp", strip_prefixes=["model."]
    )
    with ckptkit.open_source(tmp_path / "out") as source:
        assert source.format == "dcp"
        # The same str -> str header a safetensors output carries.
        assert json.loads(source.metadata["ckptkit.source"]) == "lightning.ckpt"
        assert "epoch" in json.loads(source.metadata["ckptkit.extras"])
    report = ckptkit.convert(tmp_path / "out", tmp_path / "back.safetensors")
    assert report.copied == report.tensors  # every chunk copied as bytes
    back = load_file(tmp_path / "back.safetensors")
    expected = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    assert all(bit_equal(back[k], expected[k]) for k in expected)


class _TiedHead(torch.nn.Module):
    """An embedding whose weight the output layer shares, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 5)
        self.head.weight = self.emb.weight


def test_ties_are_one_chunk_and_survive(tmp_path):
    model = _TiedHead()
    weight = model.emb.weight.detach()
    torch.save(model.state_dict(), tmp_path / "tied.pt")  # two names, one storage
    report = ckptkit.convert(tmp_path / "tied.pt", tmp_path / "out", to="dcp")
    assert report.aliases == {"head.weight": "emb.weight"}
    # DCP's own reader of .metadata: both names are the one chunk, which is written once.
    storage = dcp.FileSystemReader(str(tmp_path / "out")).read_metadata().storage_data
    where = {i.fqn: (s.relative_path, s.offset, s.length) for i, s in storage.items()}
    assert where["head.weight"] == where["emb.weight"] != where["head.bias"]
    untied = {**model.state_dict(), "head.weight": weight.clone()}
    torch.save(untied, tmp_path / "untied.pt")
    ckptkit.convert(tmp_path / "untied.pt", tmp_path / "copies", to="dcp")
    once, twice = ((tmp_path / d / "__0_0.distcp").stat().st_size for d in ("out", "copies"))
    assert once <= twice - weight.nbytes
    loaded = _dcp_load(tmp_path / "out", model.state_dict())
    assert all(bit_equal(loaded[k], v) for k, v in model.state_dict().items())
    with ckptkit.open_source(tmp_path / "out") as source:
        assert source.aliases() == {"head.weight": "emb.weight"}

    # Out of the folder, the tie is what each format makes of one: one storage in a .pt...
    ckptkit.convert(tmp_path / "out", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["head.weight"].data_ptr() == back["emb.weight"].data_ptr()
    assert bit_equal(back["emb.weight"], weight)
    # ...and in safetensors one tensor, the other name recorded as save_model records it.
    ckptkit.convert(tmp_path / "out", tmp_path / "back.safetensors")
    save_model(_TiedHead(), str(tmp_path / "save_model.safetensors"))
    forms = []
    for name in ("back", "save_model"):
        with safe_open(str(tmp_path / f"{name}.safetensors"), "pt") as f:
            forms.append((sorted(f.keys()), (f.metadata() or {}).get("head.weight")))
    assert forms[0] == forms[1] == (["emb.weight", "head.bias"], "emb.weight")
    fresh = _TiedHead()
    missing, unexpected = load_model(fresh, str(tmp_path / "back.safetensors"), strict=True)
    assert not missing and not unexpected
    assert fresh.head.weight is fresh.emb.weight and bit_equal(fresh.emb.weight.detach(), weight)


def test_a_sharded_dcp_folder_becomes_one_chunk_per_tensor(tmp_path):
    """FSDP2's 2-rank folder in, one writer's folder out: the same values."""
    ckptkit.convert(FIXTURE_DIR / "dcp" / "fsdp2", tmp_path / "out", to="dcp")
    ckptkit.convert(FIXTURE_DIR / "dcp" / "fsdp2", tmp_path / "ref.safetensors")
    ref = load_file(tmp_path / "ref.safetensors")
    assert all(
        bit_equal(v, r)
        for v, r in zip(_dcp_load(tmp_path / "out", ref).values(), ref.values(), strict=True)
    )


def test_a_cast_goes_through_torch_and_is_checked(tmp_path):
    report = ckptkit.convert(FIXTURE_DIR / "single.pt", tmp_path / "out", to="dcp", dtype="bf16")
    assert report.through_torch == 8 and report.copied == 1  # num_batches_tracked: int64
    expected = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    like = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected.items()}
    loaded = _dcp_load(tmp_path / "out", like)
    assert all(bit_equal(loaded[k], like[k]) for k in like)


def test_an_existing_folder_needs_force(tmp_path, run):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    result = run("convert", FIXTURE_DIR / "single.pt", "out", "--to", "dcp")
    assert result.exit_code == 1
    assert result.stderr.strip() == "Error: out exists; pass --force to replace it"
    assert os.listdir(tmp_path / "out") == ["old"]
    result = run("convert", FIXTURE_DIR / "single.pt", "out", "--to", "dcp", "--force")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path / "out")) == [
        ".metadata",
        "__0_0.distcp",
        "ckptkit.json",
        "old",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp left


def test_force_replaces_only_a_dcp_save_s_own_files(tmp_path, run):
    """--force over a folder that also holds the user's files replaces the save (another
    save's rank files too) and keeps everything else, subfolders included."""
    out = tmp_path / "out"
    assert run("convert", FIXTURE_DIR / "single.pt", out, "--to", "dcp").exit_code == 0
    (out / "__1_0.distcp").write_bytes(b"a second rank's chunks of an earlier save")
    (out / "important.txt").write_text("keep me")
    (out / "sub").mkdir()
    (out / "sub" / "notes.md").write_text("and me")
    result = run("convert", FIXTURE_DIR / "ddp.pt", out, "--to", "dcp", "--force", "--strip-module")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out)) == [
        ".metadata",
        "__0_0.distcp",
        "ckptkit.json",
        "important.txt",
        "sub",
    ]
    assert (out / "important.txt").read_text() == "keep me"
    assert (out / "sub" / "notes.md").read_text() == "and me"
    expected = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    loaded = _dcp_load(out, expected)
    assert all(bit_equal(loaded[k], expected[k]) for k in expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp left


def test_a_file_is_not_a_dcp_output(tmp_path, run):
    (tmp_path / "out").write_text("x")
    result = run("convert", FIXTURE_DIR / "single.pt", "out", "--to", "dcp", "--force")
    assert result.exit_code == 1
    assert result.stderr.strip() == "Error: output out is a file; give a folder name"
    result = run("convert", FIXTURE_DIR / "single.pt", "o.safetensors", "--to", "pt")
    assert result.exit_code == 2
    assert "o.safetensors ends in .safetensors, which is not a pt output" in result.stderr


def test_a_corrupted_write_leaves_nothing(tmp_path, corrupt_head_bias_copy):
    with pytest.raises(VerificationError, match="'head.bias' read back from .*out differs"):
        ckptkit.convert(FIXTURE_DIR / "single.pt", tmp_path / "out", to="dcp")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_run_s_temp_folder_is_removed_by_the_next(tmp_path):
    import fcntl
    import subprocess
    import sys
    import time

    # A writer that dies holding its temp folder: made as atomic_folder makes it, then killed.
    code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from ckptkit.storage.atomic import atomic_folder\n"
        "with atomic_folder(Path(sys.argv[1])) as tmp:\n"
        "    (tmp / 'part').write_bytes(b'x' * 100)\n"
        "    print(tmp, flush=True)\n"
        "    time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True
    )
    temp = child.stdout.readline().strip()
    held = os.open(os.path.join(temp, ".ckptkit-lock"), os.O_RDONLY)
    with pytest.raises(BlockingIOError):  # the living writer holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(held)
    child.kill()
    child.communicate()  # reaped, its pipe closed
    old = time.time() - 10
    os.utime(temp, (old, old))
    ckptkit.convert(FIXTURE_DIR / "single.pt", tmp_path / "out", to="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_output_cannot_hold_the_input(tmp_path):
    shutil.copytree(FIXTURE_DIR / "dcp" / "fsdp2", tmp_path / "in")
    with pytest.raises(OutputError, match="is the input or holds it"):
        ckptkit.convert(tmp_path / "in", tmp_path / "in", to="dcp", force=True)
    assert sorted(os.listdir(tmp_path / "in")) == sorted(os.listdir(FIXTURE_DIR / "dcp" / "fsdp2"))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(state=state_dicts())
def test_any_state_dict_through_dcp_and_back_is_bit_exact(tmp_path_factory, state):
    tmp = tmp_path_factory.mktemp("dcp")
    torch.save(state, tmp / "src.pt")
    ckptkit.convert(tmp / "src.pt", tmp / "out", to="dcp")
    ckptkit.convert(tmp / "out", tmp / "back.pt")
    back = torch.load(tmp / "back.pt", weights_only=True)
    loaded = _dcp_load(tmp / "out", {k: v.contiguous() for k, v in state.items()})
    assert set(back) == set(state)
    for key, tensor in state.items():
        assert bit_equal(back[key], tensor.contiguous()), key
        assert _same_values(loaded[key], tensor), key


def test_force_stopped_by_a_folder_leaves_the_earlier_save_whole(tmp_path, run):
    """A folder by a DCP file's name (here a rank file's) stops --force before the earlier
    save's files go: it still loads."""
    out = tmp_path / "out"
    assert run("convert", FIXTURE_DIR / "single.pt", out, "--to", "dcp").exit_code == 0
    (out / "notes.txt").write_text("keep me")
    (out / "__5_0.distcp").mkdir()
    before = sorted(os.listdir(out))
    result = run("convert", FIXTURE_DIR / "single.pt", out, "--to", "dcp", "--force")
    assert result.exit_code == 1
    assert "__5_0.distcp is a folder" in result.stderr
    assert sorted(os.listdir(out)) == before
    expected = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    loaded = _dcp_load(out, expected)
    assert all(bit_equal(loaded[k], expected[k]) for k in expected)
