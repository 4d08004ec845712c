"""The mistral pack: Mistral AI's own layout (consolidated.safetensors and params.json, built by
fixtures/make_mapping.py to mistral-inference's names), dense and mixture of experts, to Hugging
Face MistralForCausalLM and MixtralForCausalLM: the converted model computes the source's logits
(mistral-inference's forward, tests/support/meta_llama.py), Hugging Face's own Mixtral maps to
Mistral's layout and back bit for bit, and a checkpoint whose experts do not match its
params.json is refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import one_error
from make_mapping import MISTRAL, make_mistral
from meta_llama import meta_logits
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import MappingError
from ckptkit.formats.base.tensors import bit_equal


@pytest.mark.parametrize("experts", [0, 4], ids=["mistral", "mixtral"])
def test_the_converted_model_computes_the_mistral_models_logits(tmp_path, experts):
    from transformers import AutoModelForCausalLM

    weights = make_mistral(tmp_path / "mistral", experts)
    params = json.loads((tmp_path / "mistral" / "params.json").read_text())
    report = ckptkit.convert(tmp_path / "mistral", tmp_path / "hf", mapping="mistral")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == (
        ["MixtralForCausalLM"] if experts else ["MistralForCausalLM"]
    )
    assert config.get("num_local_experts") == (experts or None)
    assert report.through_torch == 0  # q and k rows permuted as bytes, the rest copied
    tokens = torch.randint(
        0, MISTRAL["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3)
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(tokens).logits
    torch.testing.assert_close(got, meta_logits(weights, params, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("experts", [0, 4], ids=["mistral", "mixtral"])
def test_mapped_back_it_is_the_same_file(tmp_path, experts):
    weights = make_mistral(tmp_path / "mistral", experts)
    ckptkit.convert(tmp_path / "mistral", tmp_path / "hf", mapping="mistral")
    report = ckptkit.convert(
        tmp_path / "hf", tmp_path / "back", mapping="mistral", reverse=True, check_roundtrip=True
    )
    back = load_file(tmp_path / "back" / "consolidated.safetensors")
    assert sorted(back) == sorted(weights)
    assert [k for k in weights if not bit_equal(back[k], weights[k])] == []
    params = json.loads((tmp_path / "back" / "params.json").read_text())
    assert params == json.loads((tmp_path / "mistral" / "params.json").read_text())
    assert report.mapping["roundtrip"]["mapped_back"] == 2 * MISTRAL["n_layers"]


def test_hugging_faces_own_mixtral_maps_to_mistrals_layout_and_back(tmp_path):
    """A Mixtral saved by transformers' save_pretrained (the producer of the Hugging Face side)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=64, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    MixtralForCausalLM(config).save_pretrained(tmp_path / "hf")
    ckptkit.convert(tmp_path / "hf", tmp_path / "mistral", mapping="mistral", reverse=True)
    params = json.loads((tmp_path / "mistral" / "params.json").read_text())
    assert params["moe"] == {"num_experts": 4, "num_experts_per_tok": 2}
    ckptkit.convert(tmp_path / "mistral", tmp_path / "again", mapping="mistral")
    a = load_file(tmp_path / "hf" / "model.safetensors")
    b = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not bit_equal(a[k], b[k])] == []


def test_experts_that_do_not_match_params_json_are_refused(tmp_path, run):
    make_mistral(tmp_path / "dense", 0)
    one_error(
        run("convert", "dense", "x.safetensors"), "dense is a Mistral checkpoint", "--map mistral"
    )
    params = {**MISTRAL, "moe": {"num_experts": 4, "num_experts_per_tok": 2}}
    (tmp_path / "dense" / "params.json").write_text(json.dumps(params))
    one_error(
        run("convert", "dense", "a", "--map", "mistral"),
        "params.json says mixture of experts, the layers are dense",
    )
    make_mistral(tmp_path / "moe", 4)
    (tmp_path / "moe" / "params.json").write_text(json.dumps(MISTRAL))
    one_error(
        run("convert", "moe", "b", "--map", "mistral"),
        "params.json says dense, the layers hold experts",
    )
    weights = make_mistral(tmp_path / "short", 4)
    from safetensors.torch import save_file

    for w in ("w1", "w2", "w3"):  # layer 1 loses its last expert: Hugging Face would make one up
        weights.pop(f"layers.1.feed_forward.experts.3.{w}.weight")
    save_file(weights, tmp_path / "short" / "consolidated.safetensors")
    with pytest.raises(MappingError, match="an expert is missing"):
        ckptkit.convert(tmp_path / "short", tmp_path / "c", mapping="mistral")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "moe", "short"]


def test_inspect_names_the_mistral_pack(tmp_path, run):
    """Its folder is shown through the pack; its one file, in Mistral's names, names it."""
    make_mistral(tmp_path / "mistral", 4)
    shown = run("inspect", "mistral")
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines()[0] == (
        "mistral is a Mistral checkpoint (consolidated.safetensors): shown as --map mistral "
        "maps it to Hugging Face"
    )
    document = json.loads(run("inspect", "mistral/consolidated.safetensors", "--json").output)
    assert document["mapping"] == {"packs": ["mistral"], "rank_file": None}
