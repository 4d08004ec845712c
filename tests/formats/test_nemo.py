"""NeMo 2 checkpoints (fixtures/nemo2, built by fixtures/make_nemo2.py to NeMo's layout with
megatron-core's own dist_checkpointing: NeMo itself does not install here): the weights read
as Megatron's torch_dist under NeMo's ``module.`` prefix, the model's config in
context/model.yaml as Megatron's args, to Hugging Face through megatron-llama with
megatron-core's own logits; a missing, damaged or hostile config refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import FIXTURE_DIR, one_error
from safetensors.torch import load_file

import ckptkit
from ckptkit.formats.base.tensors import bit_equal

NEMO = FIXTURE_DIR / "nemo2" / "llama-tiny"
MEGATRON = FIXTURE_DIR / "megatron" / "gqa-swiglu"
TE_NAMES = {  # torch_dist names a local-spec model's norms as TransformerEngine does
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def test_the_weights_are_megatrons_model_bit_for_bit(tmp_path):
    report = ckptkit.convert(NEMO, tmp_path / "out.safetensors")
    assert report.source_format == "nemo 2" and report.through_torch == 0
    assert report.selected_reason.startswith(
        "weights/ of a NeMo 2 checkpoint, its settings from context/model.yaml"
    )
    ours, reference = (
        load_file(tmp_path / "out.safetensors"),
        load_file(MEGATRON / "reference.safetensors"),
    )
    for key, value in ours.items():
        for te, local in TE_NAMES.items():
            key = key.replace(te, local)
        assert bit_equal(value, reference[key]), key
    assert len(ours) == len(reference)
    with ckptkit.open_source(NEMO) as source:
        args = source.extras["args"]
        assert (args["num_query_groups"], args["group_query_attention"]) == (2, True)
        assert (args["swiglu"], args["untie_embeddings_and_output_weights"]) == (True, True)
        assert args["vocab_size"] == 100  # the tokenizer's; the config counts the padding


def test_to_hugging_face_with_megatron_cores_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    report = ckptkit.convert(NEMO, tmp_path / "hf", mapping="megatron-llama")
    assert report.mapping["accounted_bytes"] == report.mapping["source_bytes"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    reference = load_file(MEGATRON / "logits.safetensors")
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    worst = (logits - reference["logits"][..., :100]).abs().max().item()
    assert worst < 1e-5, worst
    first = tmp_path / "from-megatron"
    ckptkit.convert(MEGATRON / "tp1" / "legacy", first, mapping="megatron-llama")
    ours, theirs = (
        load_file(tmp_path / "hf/model.safetensors"),
        load_file(first / "model.safetensors"),
    )
    assert sorted(ours) == sorted(theirs) and all(bit_equal(ours[k], theirs[k]) for k in ours)


def test_to_a_legacy_megatron_save_under_transformer_engines_names(run, tmp_path):
    """NeMo's layer spec is TransformerEngine's: the rank files keep its norm names."""
    result = run("convert", NEMO, "mg", "--to", "megatron", "--tp", "2")
    assert result.exit_code == 0, result.output
    state = torch.load(tmp_path / "mg/release/mp_rank_01/model_optim_rng.pt", weights_only=False)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in state["model"]
    assert vars(state["args"])["transformer_impl"] == "transformer_engine"
    theirs = torch.load(
        MEGATRON / "tp2/legacy/iter_0000010/mp_rank_01/model_optim_rng.pt", weights_only=False
    )["model"]
    for key, value in state["model"].items():
        if value is None:
            continue
        for te, local in TE_NAMES.items():
            key = key.replace(te, local)
        assert bit_equal(value, theirs[key]), key


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (None, "context/model.yaml is missing"),
        ("config: [unclosed", "is not YAML"),
        ("tokenizer: {}\n", "holds no model config"),
        ("config: !!python/object/apply:os.system ['true']\n", "is not YAML"),
        ("- just\n- a list\n", "holds no model config"),
    ],
)
def test_a_config_missing_damaged_or_hostile_is_refused(run, tmp_path, text, needle):
    folder = tmp_path / "ckpt"
    shutil.copytree(NEMO, folder)
    config = folder / "context" / "model.yaml"
    if text is None:
        config.unlink()
    else:
        config.write_text(text)
    one_error(run("inspect", folder), needle)


def test_a_nemo_1_archive_is_refused_by_name_not_taken_for_a_torch_tar(run, tmp_path):
    """A .nemo file is a tar (model_config.yaml, model_weights.ckpt): said so, not taken for a
    legacy torch tar checkpoint that only --trust would read."""
    import tarfile

    (tmp_path / "model_config.yaml").write_text("num_layers: 2\n")
    torch.save({"model.decoder.final_layernorm.weight": torch.ones(2)}, tmp_path / "w.ckpt")
    with tarfile.open(tmp_path / "llama.nemo", "w:") as tar:
        tar.add(tmp_path / "model_config.yaml", arcname="./model_config.yaml")
        tar.add(tmp_path / "w.ckpt", arcname="./model_weights.ckpt")
    one_error(run("inspect", "llama.nemo"), "is a NeMo 1 archive", "NeMo 2 checkpoint folder")
    one_error(run("convert", "llama.nemo", "x.safetensors"), "is a NeMo 1 archive")


def test_a_config_whose_aliases_share_lists_is_read_in_bounded_time(run, tmp_path):
    """YAML aliases can share one list a billion ways: only plain values are read."""
    import time

    folder = tmp_path / "ckpt"
    shutil.copytree(NEMO, folder)
    config = folder / "context" / "model.yaml"
    bomb = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, 10):
        bomb.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    text = config.read_text().replace("config:\n", "bomb:\n  " + "\n  ".join(bomb) + "\nconfig:\n")
    config.write_text(text.replace("  hidden_size: 32", "  hidden_size: 32\n  extra: *a9"))
    started = time.monotonic()
    result = run("inspect", folder)
    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 20
