"""The megatron-llama, megatron-gpt2 and megatron-mixtral packs on megatron-core 0.16.1's own
saves (fixtures/megatron): every layout (TP=1, TP=2, PP=2, EP=2, TP=2 x EP=2; legacy and
torch_dist) maps to the same
Hugging Face folder, whose model computes megatron-core's own logits; mapped back it is the
TP=1 model in Megatron's names, bit for bit (the vocabulary's padding rows, cut on the way out,
come back as zeros); a pack given the other family's model is refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FIXTURE_DIR, one_error
from safetensors.torch import load_file

import ckptkit
from ckptkit.formats.base.tensors import bit_equal

MEGATRON = FIXTURE_DIR / "megatron"
CASES = (
    [
        ("megatron-llama", "gqa-swiglu", layout, kind)
        for layout in ("tp1", "tp2", "pp2")
        for kind in ("legacy", "torch_dist")
    ]
    + [
        ("megatron-gpt2", "mha-gelu", layout, kind)
        for layout in ("tp1", "tp2")
        for kind in ("legacy", "torch_dist")
    ]
    + [
        ("megatron-mixtral", "moe-swiglu", layout, kind)
        for layout in ("tp1", "ep2", "tp2ep2", "pp2")
        for kind in ("legacy", "torch_dist")
    ]
)
IDS = [f"{shape}-{layout}-{kind}" for _, shape, layout, kind in CASES]
VOCAB = 100  # the tokenizer's; Megatron pads the embedding to 128 rows


@pytest.mark.parametrize(("pack", "shape", "layout", "kind"), CASES, ids=IDS)
def test_every_layout_maps_to_a_model_that_computes_megatrons_logits(
    tmp_path, pack, shape, layout, kind
):
    from transformers import AutoModelForCausalLM

    report = ckptkit.convert(MEGATRON / shape / layout / kind, tmp_path / "hf", mapping=pack)
    assert report.verified and report.mapping["accounted_bytes"] == report.mapping["source_bytes"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    reference = load_file(MEGATRON / shape / "logits.safetensors")  # megatron-core's forward
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    assert logits.shape[-1] == VOCAB
    worst = (logits - reference["logits"][..., :VOCAB]).abs().max().item()
    assert worst < 1e-5, worst  # measured 9e-8: float rounding
    if (layout, kind) != ("tp1", "legacy"):  # every layout gives the very same folder
        first = tmp_path / "first"
        ckptkit.convert(MEGATRON / shape / "tp1" / "legacy", first, mapping=pack)
        ours, theirs = (
            load_file(tmp_path / "hf" / "model.safetensors"),
            load_file(first / "model.safetensors"),
        )
        assert sorted(ours) == sorted(theirs) and all(bit_equal(ours[k], theirs[k]) for k in ours)
        assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
            (first / "config.json").read_text()
        )


@pytest.mark.parametrize(
    ("pack", "shape"),
    [
        ("megatron-llama", "gqa-swiglu"),
        ("megatron-gpt2", "mha-gelu"),
        ("megatron-mixtral", "moe-swiglu"),
    ],
)
def test_mapped_back_it_is_the_tp1_model_in_megatrons_names(tmp_path, pack, shape):
    layout = "tp2ep2" if shape == "moe-swiglu" else "tp2"
    ckptkit.convert(MEGATRON / shape / layout / "legacy", tmp_path / "hf", mapping=pack)
    report = ckptkit.convert(
        tmp_path / "hf", tmp_path / "back.safetensors", mapping=pack, reverse=True
    )
    back, reference = (
        load_file(tmp_path / "back.safetensors"),
        load_file(MEGATRON / shape / "reference.safetensors"),
    )
    assert sorted(back) == sorted(reference)
    padded = [
        k for k in reference if k in ("embedding.word_embeddings.weight", "output_layer.weight")
    ]
    for key in reference:
        if key in padded:  # the rows past the vocabulary were cut: they come back as zeros
            assert bit_equal(back[key][:VOCAB], reference[key][:VOCAB])
            assert not back[key][VOCAB:].any()
        else:
            assert bit_equal(back[key], reference[key]), key
    assert report.mapping["defaults_taken"] == [
        "divisible",
        "padded",
    ]  # 128 from the vocabulary, said


def test_the_cli_names_the_pack_and_refuses_the_other_family(run, tmp_path):
    shown = run("inspect", MEGATRON / "mha-gelu" / "tp2" / "legacy")
    assert "which megatron-gpt2 maps" in shown.output, shown.output
    # both packs' names cover a Llama-like model's keys: the one whose mapping plans is named
    shown = run("inspect", MEGATRON / "gqa-swiglu" / "pp2" / "torch_dist")
    assert "which megatron-llama maps:" in shown.output, shown.output
    one_error(
        run("convert", MEGATRON / "mha-gelu" / "tp2" / "legacy", "hf", "--map", "megatron-llama"),
        "megatron-llama: this model lacks SwiGLU, RMSNorm or rotary positions",
        "--map megatron-gpt2",
    )
    one_error(
        run("convert", MEGATRON / "gqa-swiglu" / "tp2" / "legacy", "hf", "--map", "megatron-gpt2"),
        "megatron-gpt2: this model has SwiGLU or grouped-query attention",
        "--map megatron-llama",
    )


def test_args_that_do_not_fit_the_weights_are_refused(run, tmp_path):
    """The config is written from the args: a feed-forward size the weights do not have, or no
    vocab_size (Megatron leaves it unset with a Hugging Face tokenizer), is refused, and
    --set gives the missing one."""
    import shutil

    save = tmp_path / "save"
    shutil.copytree(MEGATRON / "gqa-swiglu" / "tp1" / "legacy", save)
    rank = save / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(rank, weights_only=False)
    state["args"].ffn_hidden_size, state["args"].vocab_size = 999, None
    torch.save(state, rank)
    one_error(
        run("convert", save, "hf", "--map", "megatron-llama"), "but args say ffn_hidden_size 999"
    )
    state["args"].ffn_hidden_size = 64
    torch.save(state, rank)
    one_error(
        run("convert", save, "hf", "--map", "megatron-llama"), "'0 < vocab <= padded'", "vocab = 0"
    )
    done = run("convert", save, "hf", "--map", "megatron-llama", "--set", "vocab=100")
    assert done.exit_code == 0, done.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 100


def test_config_from_a_model_folder_is_taken_as_it_is_and_checked(run, tmp_path):
    """--config-from: the config.json (and tokenizer files) of a model folder go with the
    weights, its numbers read as the mapping's (Megatron with a Hugging Face tokenizer leaves
    vocab_size unset: the config gives it), and weights that do not fit it are refused."""
    import shutil

    save = tmp_path / "save"
    shutil.copytree(MEGATRON / "gqa-swiglu" / "tp2" / "legacy", save)
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = save / "iter_0000010" / rank / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        state["args"].vocab_size = None
        torch.save(state, path)
    given = tmp_path / "given"
    ckptkit.convert(MEGATRON / "gqa-swiglu" / "tp1" / "legacy", given, mapping="megatron-llama")
    config = json.loads((given / "config.json").read_text())
    config["bos_token_id"] = 1  # a field the mapping does not write: it must survive
    (given / "config.json").write_text(json.dumps(config))
    (given / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    done = run("convert", save, "hf", "--map", "megatron-llama", "--config-from", given)
    assert done.exit_code == 0, done.output
    assert f"Config   taken from {given} (--config-from)" in done.output
    assert f"Copied   config.json, tokenizer.json from {given}" in done.output
    assert (tmp_path / "hf" / "config.json").read_text() == (given / "config.json").read_text()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    ours, theirs = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(given / "model.safetensors"),
    )
    assert all(bit_equal(ours[k], theirs[k]) for k in theirs)
    config["hidden_size"] = 64  # another model's config
    (given / "config.json").write_text(json.dumps(config))
    one_error(
        run("convert", save, "hf2", "--map", "megatron-llama", "--config-from", given),
        "fails the mapping's check",
        "dim = 64",
    )
    one_error(run("convert", save, "hf3", "--config-from", given), "go with --map")


def test_config_from_never_overrides_what_the_source_says_with_a_constant(run, tmp_path):
    """The Hugging Face side's constants and defaults (interleaved = False) are not the given
    config's: a Megatron run with interleaved rotary pairs is still refused."""
    import shutil

    save = tmp_path / "save"
    shutil.copytree(MEGATRON / "gqa-swiglu" / "tp1" / "legacy", save)
    path = save / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["args"].rotary_interleaved = True
    torch.save(state, path)
    given = tmp_path / "given"
    ckptkit.convert(MEGATRON / "gqa-swiglu" / "tp1" / "legacy", given, mapping="megatron-llama")
    one_error(
        run("convert", save, "hf", "--map", "megatron-llama", "--config-from", given),
        "rotary_interleaved rotates pairs",
    )


def test_gpt2s_end_of_text_is_the_vocabularys_last_token(tmp_path):
    """GPT2Config's default bos/eos (50256) would lie past a smaller vocabulary."""
    ckptkit.convert(MEGATRON / "mha-gelu/tp2/legacy", tmp_path / "hf", mapping="megatron-gpt2")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == config["vocab_size"] - 1 == 99


def test_a_wrong_direction_or_family_says_which_pack_or_flag(run, tmp_path):
    """A mixture of experts given to megatron-llama names megatron-mixtral; a Hugging Face
    folder given to a Megatron pack without --reverse is told to add it."""
    one_error(
        run("convert", MEGATRON / "moe-swiglu/tp1/legacy", "hf", "--map", "megatron-llama"),
        "this model is a mixture of experts: --map megatron-mixtral",
    )
    one_error(
        run("convert", FIXTURE_DIR / "mapping/llama3-tp1", "mg", "--map", "megatron-llama"),
        "records no args",
        "a Hugging Face model folder: to map it the other way, add --reverse",
    )
