"""Hugging Face model folders: read without naming the file, written with save_pretrained's
names, and a forced re-run leaves no stale shard behind."""

from __future__ import annotations

import pytest
import torch

import ckptkit


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=500, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder)  # config.json + model.safetensors
    return transformers, model, folder


def _logits(model):
    with torch.no_grad():
        return model(torch.arange(12).unsqueeze(0)).logits


def test_a_model_folder_is_read_without_naming_the_file(gpt2, tmp_path):
    _, model, folder = gpt2
    summary = ckptkit.summarize(folder)
    assert summary.path == str(folder) and len(summary.tensors) > 0
    assert ckptkit.diff(folder, folder / "model.safetensors").equal
    state = ckptkit.load_state_dict(folder)
    assert set(state) >= {k for k in model.state_dict() if k != "lm_head.weight"}
    report = ckptkit.convert(folder, tmp_path / "out.pt")
    assert report.source.endswith(str(folder))


def test_sharded_output_into_a_folder_loads_with_from_pretrained(gpt2, tmp_path, run):
    transformers, model, folder = gpt2
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_bytes((folder / "config.json").read_bytes())
    result = run("convert", folder, out, "--max-shard-size", "40kB")
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names
    shards = [n for n in names if n.startswith("model-0")]
    assert len(shards) > 2 and all("-of-" in n and n.endswith(".safetensors") for n in shards)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert torch.equal(_logits(loaded), _logits(model))
    # A forced re-run in fewer shards removes the earlier run's extra shards...
    again = run("convert", folder, out, "--max-shard-size", "80kB", "--force")
    assert again.exit_code == 0, again.stderr
    fewer = sorted(p.name for p in out.iterdir() if p.name.startswith("model-0"))
    assert 1 < len(fewer) < len(shards)
    assert all(f"-of-{len(fewer):05d}" in n for n in fewer)
    # ...and one written whole removes the index too.
    whole = run("convert", folder, out, "--force")
    assert whole.exit_code == 0, whole.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",  # the model folder's, written into the folder as well
        "model.safetensors",
    ]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert torch.equal(_logits(loaded), _logits(model))


def test_a_folder_without_weights_says_so(run, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run("inspect", "empty")
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: empty is a folder with no sharded index, model.safetensors, "
        "pytorch_model.bin, diffusers, PEFT, DeepSpeed or DCP checkpoint; give a checkpoint "
        "file; it holds none ckptkit knows by its name\n"
    )


class _Tracker:
    """A custom object registered for checkpointing; its state names a non-safe class."""

    def state_dict(self):
        import fractions

        return {"ratio": fractions.Fraction(1, 3)}

    def load_state_dict(self, state):
        pass


def test_accelerate_save_state_folder(tmp_path, run):
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 2), torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(first.parameters())
    first, second, opt = acc.prepare(first, second, opt)
    acc.register_for_checkpointing(_Tracker())
    folder = tmp_path / "ckpt"
    acc.save_state(folder)
    summary = ckptkit.summarize(folder)
    parts = {p["name"]: (p["kind"], p["verdict"]) for p in summary.parts}
    assert parts["optimizer.bin"] == ("optimizer state", "safe")
    assert parts["random_states_0.pkl"] == ("RNG states of one process", "safe")  # NumPy: data
    assert parts["custom_checkpoint_0.pkl"] == ("a registered custom object", "unknown")
    assert "--select model_1 for another" in summary.selected_reason
    # The model converts whatever the other parts hold; --select takes another model.
    out = tmp_path / "first.safetensors"
    assert run("convert", folder, out).exit_code == 0
    assert ckptkit.diff(out, folder / "model.safetensors").equal
    second_out = tmp_path / "second.safetensors"
    assert run("convert", folder, second_out, "--select", "model_1").exit_code == 0
    state = ckptkit.load_state_dict(second_out)
    assert torch.equal(state["weight"], second.weight.detach())
    missing = run("inspect", folder, "--select", "model_7")
    assert missing.exit_code == 1 and "holds no model file 'model_7'" in missing.stderr


@pytest.mark.parametrize("made", ["mkdir", "holding other files"])
def test_a_model_folder_written_into_an_existing_folder_loads(gpt2, tmp_path, run, made):
    """Into a folder that exists (even an empty one), the output is as loadable as into a new
    name: the config and generation config come along, the folder's other files stay."""
    transformers, model, folder = gpt2
    out = tmp_path / "out"
    out.mkdir()
    if made != "mkdir":
        (out / "notes.txt").write_text("mine")
    result = run("convert", folder, out)
    assert result.exit_code == 0, result.stderr
    assert "Copied   config.json, generation_config.json from the model folder" in result.output
    expected = {"config.json", "generation_config.json", "model.safetensors"}
    assert {p.name for p in out.iterdir()} == expected | (
        {"notes.txt"} if made != "mkdir" else set()
    )
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert torch.equal(_logits(loaded), _logits(model))


def test_a_differing_config_in_the_folder_needs_force(gpt2, tmp_path, run):
    _, _, folder = gpt2
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    result = run("convert", folder, out)
    assert result.exit_code == 1
    assert (
        result.stderr.strip()
        == f"Error: {out / 'config.json'} exists; pass --force to overwrite it"
    )
    assert [p.name for p in out.iterdir()] == ["config.json"]  # nothing written
    assert run("convert", folder, out, "--force").exit_code == 0
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()


def test_a_trainer_checkpoint_s_state_stays_out_of_the_converted_folder(gpt2, tmp_path, run):
    """checkpoint-N of transformers' Trainer: its trainer_state.json and pickled states are not
    part of the released model."""
    _, _, folder = gpt2
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    for p in folder.iterdir():
        (checkpoint / p.name).write_bytes(p.read_bytes())
    (checkpoint / "trainer_state.json").write_text('{"global_step": 4}')
    (checkpoint / "random_states_0.pkl").write_bytes(b"\x80\x04N.")
    torch.save({"state": {}}, checkpoint / "optimizer.pt")
    result = run("convert", checkpoint, tmp_path / "release")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "release").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_a_trainer_output_dir_gives_its_newest_checkpoint(gpt2, tmp_path, run):
    """transformers' Trainer output_dir holding checkpoint-N folders: the newest by N (10, not
    9) is read and the report says so; --select names another."""
    transformers, model, folder = gpt2
    output_dir = tmp_path / "output_dir"
    for step in (9, 10):
        checkpoint = output_dir / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        for p in folder.iterdir():
            (checkpoint / p.name).write_bytes(p.read_bytes())
        (checkpoint / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    changed = transformers.GPT2LMHeadModel.from_pretrained(output_dir / "checkpoint-9")
    with torch.no_grad():
        changed.lm_head.weight.mul_(2)  # tied: the embedding doubles too
    changed.save_pretrained(output_dir / "checkpoint-9")
    shown = run("inspect", output_dir)
    assert shown.exit_code == 0, shown.stderr
    assert "checkpoint-10, the newest of the Trainer's 2 checkpoints" in shown.output
    assert run("convert", output_dir, tmp_path / "newest").exit_code == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "newest").eval()
    assert torch.equal(_logits(loaded), _logits(model))
    older = run("convert", output_dir, tmp_path / "older", "--select", "checkpoint-9")
    assert older.exit_code == 0, older.stderr
    assert ckptkit.diff(tmp_path / "older", output_dir / "checkpoint-9").equal
    missing = run("inspect", output_dir, "--select", "checkpoint-3")
    assert missing.exit_code != 0 and "give one of checkpoint-9, checkpoint-10" in missing.stderr


def test_inspect_of_a_model_folder_does_not_suggest_stripping_its_names(gpt2, run):
    """GPT-2's keys all start with 'transformer.' (its head is tied): the model's own names,
    which from_pretrained needs; stripping them would break loading."""
    _, _, folder = gpt2
    result = run("inspect", folder)
    assert result.exit_code == 0, result.stderr
    assert "--strip-prefix" not in result.output
    assert "every key starts with 'transformer.': the model folder's own names" in result.output
    shown = run("inspect", folder, "--json")
    assert '"model_folder": true' in shown.output


def test_a_trainer_output_dir_with_its_final_model_reads_that_unless_a_checkpoint_is_named(
    gpt2, tmp_path, run
):
    """trainer.save_model() puts the final model beside the checkpoint-N folders: the folder
    reads as that model; --select checkpoint-N still takes a checkpoint. training_args.bin
    (a pickle of the Trainer's) is no model of the folder's own."""
    _, _, folder = gpt2
    output_dir = tmp_path / "output_dir"
    (output_dir / "checkpoint-2").mkdir(parents=True)
    for p in folder.iterdir():
        (output_dir / "checkpoint-2" / p.name).write_bytes(p.read_bytes())
    torch.save({"not": "weights"}, output_dir / "training_args.bin")
    shown = run("inspect", output_dir)
    assert shown.exit_code == 0, shown.stderr
    assert "checkpoint-2, the newest of the Trainer's 1 checkpoints" in shown.output
    for p in folder.iterdir():
        (output_dir / p.name).write_bytes(p.read_bytes())
    final = run("inspect", output_dir)
    assert final.exit_code == 0 and "checkpoint-2" not in final.output, final.output
    chosen = run("inspect", output_dir, "--select", "checkpoint-2")
    assert chosen.exit_code == 0, chosen.stderr
    assert "checkpoint-2, chosen with --select" in chosen.output


def test_a_model_folder_file_linked_out_of_the_folder_is_said_when_copied(gpt2, tmp_path, run):
    """A config linked elsewhere is copied into the converted folder as the link leads: said
    in the report, never silent."""
    _, _, folder = gpt2
    model = tmp_path / "model"
    model.mkdir()
    for p in folder.iterdir():
        (model / p.name).write_bytes(p.read_bytes())
    (tmp_path / "elsewhere.json").write_bytes((folder / "generation_config.json").read_bytes())
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").symlink_to(tmp_path / "elsewhere.json")
    result = run("convert", model, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    said = f"read from outside {model}: {model / 'generation_config.json'} -> {tmp_path / 'elsewhere.json'}"
    assert said in result.stdout
