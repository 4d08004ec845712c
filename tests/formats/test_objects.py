"""What is not a plain state dict: a mapping of tensors with plain values beside them, files
that hold no tensors (transformers' training_args.bin), and folders of no known layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file


def test_a_mixed_mapping_is_a_state_dict_with_extras(tmp_path, run):
    state = {"enc.weight": torch.randn(3, 2), "enc.bias": torch.randn(3)}
    torch.save({**state, "epoch": 3, "dtype": torch.float16}, tmp_path / "mixed.pt")
    doc = json.loads(run("inspect", tmp_path / "mixed.pt", "--json").stdout)
    assert [t["key"] for t in doc["tensors"]] == list(state)
    assert doc["extras"]["epoch"] == 3 and "float16" in doc["extras"]["dtype"]
    result = run("convert", tmp_path / "mixed.pt", "out.safetensors")
    assert result.exit_code == 0, result.output
    assert "Kept     dtype, epoch in the metadata" in result.stdout
    written = load_file(tmp_path / "out.safetensors")
    assert set(written) == set(state)
    assert all(torch.equal(written[k], v) for k, v in state.items())
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert json.loads(f.metadata()["ckptkit.extras"])["epoch"] == 3


def test_a_value_holding_tensors_keeps_it_a_tree(tmp_path, run):
    """A mapping whose plain-looking values hold tensors of their own is not 'mixed': the
    state dict is found inside it as before."""
    weights = {"w": torch.ones(2)}
    torch.save(
        {"model": weights, "optim": {"state": {0: torch.zeros(2)}}, "epoch": 1}, tmp_path / "t.pt"
    )
    doc = json.loads(run("inspect", tmp_path / "t.pt", "--json").stdout)
    assert doc["state_dict"]["path"] == "model"


def test_a_file_without_tensors_says_what_it_holds(tmp_path, run):
    torch.save({"lr": 0.1, "name": "run-1"}, tmp_path / "config.pt")
    result = run("inspect", tmp_path / "config.pt")
    assert result.exit_code == 0, result.output
    assert "holds no tensors: a mapping of 2 plain values" in result.stdout
    assert "also        name = run-1" in result.stdout
    refused = run("convert", tmp_path / "config.pt", "out.safetensors")
    assert refused.exit_code == 1
    (line,) = refused.stderr.splitlines()
    assert line.startswith("Error: ") and "holds no tensors" in line
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.slow
def test_training_arguments_are_shown_as_data_never_imported(tmp_path, run):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), learning_rate=3e-5)
    torch.save(args, tmp_path / "training_args.bin")
    result = run("inspect", tmp_path / "training_args.bin", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["tensor_count"] == 0
    assert "holds no tensors: a TrainingArguments object" in doc["state_dict"]["reason"]
    assert doc["extras"]["learning_rate"] == 3e-5
    assert doc["extras"]["output_dir"] == str(tmp_path / "o")


def test_a_folder_of_no_known_layout_lists_its_checkpoint_files(tmp_path, run):
    """skorch's save_params folder: the error names the files that may hold the weights."""
    folder = tmp_path / "skorch_run"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "params.pt")
    torch.save({}, folder / "optimizer.pt")
    (folder / "history.json").write_text("[]")
    result = run("convert", folder, "out.safetensors")
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.endswith("give the checkpoint file inside it (optimizer.pt, params.pt)")


@pytest.mark.slow
def test_a_skorch_checkpoint_folder(tmp_path, run):
    """skorch's own save_params: the folder error names params.pt, which converts."""
    skorch = pytest.importorskip("skorch")

    torch.manual_seed(0)
    net = skorch.NeuralNetClassifier(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
        max_epochs=1,
        batch_size=8,
        train_split=None,
        verbose=0,
    )
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    net.fit(x, y)
    folder = tmp_path / "run"
    folder.mkdir()
    net.save_params(
        f_params=folder / "params.pt",
        f_optimizer=folder / "optimizer.pt",
        f_history=folder / "history.json",
    )
    result = run("convert", folder, "out.safetensors")
    assert result.exit_code == 1
    assert "give the checkpoint file inside it (optimizer.pt, params.pt)" in result.stderr
    ok = run("convert", folder / "params.pt", "out.safetensors")
    assert ok.exit_code == 0, ok.output
    written = load_file(tmp_path / "out.safetensors")
    want = net.module_.state_dict()
    assert set(written) == set(want)
    assert all(torch.equal(written[k], v) for k, v in want.items())
