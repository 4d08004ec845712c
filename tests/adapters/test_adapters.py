"""LoRA adapters merged into their base: peft's own ``merge_and_unload`` bit for bit, the
consumers that load the result, PeftModel state dicts, one-line errors with nothing written,
the Hugging Face cache, several adapters in order, and the arithmetic (zero B, a bf16 base).

Tests that import peft or transformers (about 4 s the first time) are marked slow."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import make_adapters  # in fixtures/: helpers (imported by conftest first) puts it on sys.path
import pytest
import torch
from helpers import FIXTURE_DIR, ROOT, as_in_a_fresh_process, bits
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.adapters import read_adapter

ADAPTERS = FIXTURE_DIR / "adapters"
BERT_BASE = ADAPTERS / "bert_base"
GPT2_BASE = ADAPTERS / "gpt2_base"
CONV_BASE = ADAPTERS / "conv_base.safetensors"
KOHYA_BASE = ADAPTERS / "kohya_base.safetensors"
KOHYA_LORA = ADAPTERS / "kohya_lora.safetensors"
PEFT_FULL = ADAPTERS / "bert_peft_full.pt"
PEFT_FULL_CONFIG = ADAPTERS / "bert_peft_full_adapter_config.json"
PREFIX = "base_model.model."

# Every adapter folder peft wrote (bert_peft_full.pt has its own section).
PEFT_FOLDERS = [name for name in make_adapters.ADAPTERS if name != "bert_peft_full.pt"]
# Those with a low-rank change to check against the unmerged layer (all of them fp32).
LOW_RANK = [name for name in PEFT_FOLDERS if name != "bert_modules_to_save"]
QV = [f"bert.encoder.layer.{i}.attention.self.{p}" for i in (0, 1) for p in ("query", "value")]
TOKENIZER_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"]


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def quiet_hf():
    """Around peft and transformers: the warnings they raise inside themselves (the suite turns
    every warning into an error), each named."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        warnings.filterwarnings(
            "ignore", "The PEFT config's `base_model_name_or_path` was renamed", UserWarning
        )
        yield


@functools.cache
def peft_reference(name: str) -> dict[str, torch.Tensor]:
    """peft's own merge of a fixture (``merge_and_unload().state_dict()``), made once."""
    with quiet_hf():
        return make_adapters.peft_merged_state_dict(name)


def reference_model(name: str) -> torch.nn.Module:
    """The base model holding peft's merge of ``name``."""
    with quiet_hf():
        model = make_adapters.build_base(name)
    model.load_state_dict(peft_reference(name))
    return model


def base_model(name: str) -> torch.nn.Module:
    """The unmerged base model (to show a merge changed the outputs)."""
    with quiet_hf():
        return make_adapters.build_base(name)


def merge_args(name: str) -> list[Path | str]:
    """``convert``'s SRC (and ``--base`` where the adapter names none) for a fixture."""
    base = make_adapters.ADAPTERS[name]
    return [ADAPTERS / name] + (
        ["--base", ADAPTERS / base] if base.endswith(".safetensors") else []
    )


def written(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a written file or model folder (all its shards)."""
    if path.is_dir():
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(path.glob("*.safetensors")):
            state.update(load_file(shard))
        return state
    return load_file(path)


def assert_same(got: dict, want: dict, keys=None) -> None:
    """The same tensors bit for bit (dtype too) for ``keys`` (default: all of ``want``)."""
    for key in want if keys is None else keys:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


def ok(result) -> None:
    assert result.exit_code == 0, result.output


def report_of(result) -> dict:
    ok(result)
    return json.loads(result.stdout)


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def copy_adapter(name: str, tmp_path: Path, **config) -> Path:
    """A copy of an adapter folder in tmp_path, with ``config``'s fields set in its
    adapter_config.json."""
    folder = tmp_path / f"{name}_copy"
    shutil.copytree(ADAPTERS / name, folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}, indent=2))
    return folder


def bert_base_file(tmp_path: Path, drop=(), replace=None) -> Path:
    """bert_base's tensors as one safetensors file in tmp_path, less the keys ``drop``, with
    the tensors of ``replace`` (key -> tensor) in place of the base's."""
    state = load_file(BERT_BASE / "model.safetensors")
    for key in drop:
        del state[key]
    state.update(replace or {})
    path = tmp_path / "base.safetensors"
    save_file(state, path, metadata={"format": "pt"})
    return path


# ----------------------------------------------------------------------------- peft parity


@pytest.mark.slow
@pytest.mark.parametrize("name", PEFT_FOLDERS)
def test_merge_equals_peft_merge_and_unload(run, tmp_path, name):
    """Every peft fixture merged equals peft's merge bit for bit, key for key."""
    ok(run("convert", *merge_args(name), "out.safetensors"))
    got, want = written(tmp_path / "out.safetensors"), peft_reference(name)
    tied = {"lm_head.weight"} if name == "gpt2_lora" else set()  # not stored, as in the base
    assert set(got) == set(want) - tied
    if tied:
        assert torch.equal(want["lm_head.weight"], want["transformer.wte.weight"])
    assert_same(got, want, keys=got)


def test_kohya_equals_sd_scripts_merge(run, tmp_path):
    """The kohya file merges as sd-scripts' merge_to_sd_model does, bit for bit."""
    ok(run("convert", KOHYA_LORA, "out.safetensors", "--base", KOHYA_BASE))
    want = make_adapters.kohya_merge_reference(load_file(KOHYA_BASE), load_file(KOHYA_LORA))
    got = written(tmp_path / "out.safetensors")
    assert set(got) == set(want)
    assert_same(got, want)


def test_kohya_at_half_weight_equals_ratio_half(run, tmp_path):
    """``--adapter kohya_lora.safetensors:0.5`` is sd-scripts' ratio 0.5, exactly (the weight
    and the scales are powers of two)."""
    result = run(
        "convert", KOHYA_BASE, "half.safetensors", "--adapter", f"{KOHYA_LORA}:0.5", "--json"
    )
    assert [a["weight"] for a in report_of(result)["adapters"]] == [0.5]
    base, lora = load_file(KOHYA_BASE), load_file(KOHYA_LORA)
    want = make_adapters.kohya_merge_reference(base, lora, ratio=0.5)
    got = written(tmp_path / "half.safetensors")
    assert set(got) == set(want)
    assert_same(got, want)
    full = make_adapters.kohya_merge_reference(base, lora)
    changed = [k for k in got if not torch.equal(got[k], base[k])]
    assert len(changed) == 5 and all(not torch.equal(got[k], full[k]) for k in changed)


# ----------------------------------------------------------------------------- read_adapter

# fixture -> (kind, variant, {module: (layer, rank, alpha, scale)}, base_name)
TARGETS = {
    "bert_patterns": (
        "PEFT LoRA",
        "LoRA",
        {
            "bert.encoder.layer.0.attention.self.query": ("linear", 2, 8.0, 4.0),
            "bert.encoder.layer.0.attention.self.value": ("linear", 4, 16.0, 4.0),
            "bert.encoder.layer.1.attention.self.query": ("linear", 4, 8.0, 2.0),
            "bert.encoder.layer.1.attention.self.value": ("linear", 6, 16.0, 16 / 6),
        },
        "bert_base",
    ),
    "bert_embedding": (
        "PEFT LoRA",
        "LoRA",
        {"bert.embeddings.word_embeddings": ("embedding", 4, 8.0, 2.0)},
        "bert_base",
    ),
    "conv_lora": (
        "PEFT LoRA",
        "LoRA",
        {m: ("conv", 4, 8.0, 2.0) for m in ("stem", "mix", "seq")}
        | {"head": ("linear", 4, 8.0, 2.0)},
        None,
    ),
    "kohya_lora.safetensors": (
        "kohya LoRA",
        "LoRA",
        {
            "lora_unet_down_blocks_0_resnets_0_conv1": ("conv", 2, 1.0, 0.5),
            "lora_unet_down_blocks_0_attentions_0_proj_in": ("conv", 4, 2.0, 0.5),
            "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q": (
                "linear",
                4,
                2.0,
                0.5,
            ),
            "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_k": (
                "linear",
                4,
                2.0,
                0.5,
            ),
            "lora_te_text_model_encoder_layers_0_self_attn_q_proj": ("linear", 4, 2.0, 0.5),
        },
        None,
    ),
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_read_adapter_targets(name):
    """Kind, variant, and each module's layer, rank, alpha and scale (rank_pattern and
    alpha_pattern per module; kohya's alpha / rank)."""
    kind, variant, modules, base_name = TARGETS[name]
    adapter = read_adapter(ADAPTERS / name)
    try:
        assert (adapter.kind, adapter.variant, adapter.base_name) == (kind, variant, base_name)
        got = {t.module: (t.layer, t.rank, t.alpha) for t in adapter.targets}
        assert got == {m: v[:3] for m, v in modules.items()}
        for target in adapter.targets:
            assert math.isclose(target.scale, modules[target.module][3], rel_tol=1e-15)
    finally:
        adapter.close()


def test_read_adapter_variants_and_extras():
    """rsLoRA's scale, DoRA's magnitudes, fan_in_fan_out, modules_to_save, trainable tokens."""
    opened = {n: read_adapter(ADAPTERS / n) for n in PEFT_FOLDERS}
    try:
        rs = opened["bert_rslora"]
        assert rs.variant == "rsLoRA" and len(rs.targets) == 13
        assert {t.scale for t in rs.targets} == {4.0}
        dora = opened["bert_dora"]
        assert dora.variant == "DoRA" and all(t.magnitude for t in dora.targets)
        assert opened["conv_dora"].variant == "DoRA"
        assert all(t.fan_in_fan_out for t in opened["gpt2_lora"].targets)
        assert len(opened["gpt2_lora"].targets) == 6
        assert opened["bert_modules_to_save"].replaced == {
            "classifier.weight": PREFIX + "classifier.weight",
            "classifier.bias": PREFIX + "classifier.bias",
        }
        tokens = opened["bert_trainable_tokens"].token_rows
        key = PREFIX + "bert.embeddings.word_embeddings.token_adapter.trainable_tokens_delta"
        assert tokens == {"bert.embeddings.word_embeddings.weight": (key, (1, 2, 5))}
        assert all(t.bias for t in opened["bert_lora_bias"].targets)
        assert [t.module for t in opened["bert_lora_bin"].targets] == [
            t.module for t in opened["bert_lora"].targets
        ]
    finally:
        for adapter in opened.values():
            adapter.close()


# ----------------------------------------------------------------------------- consumers


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["bert_lora", "bert_dora", "bert_modules_to_save", "bert_trainable_tokens"]
)
def test_bert_folder_loads_in_transformers(run, tmp_path, name):
    """The merged folder: the base's config and tokenizer files, and transformers' model from it
    gives peft's merged model's logits exactly."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    report = report_of(run("convert", ADAPTERS / name, "merged", "--json"))
    folder = tmp_path / "merged"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        TOKENIZER_FILES + ["model.safetensors"]
    )
    assert sorted(report["copied_files"]) == TOKENIZER_FILES
    for file in TOKENIZER_FILES:
        assert (folder / file).read_bytes() == (BERT_BASE / file).read_bytes(), file
    with quiet_hf():
        model = BertForSequenceClassification.from_pretrained(folder).eval()
        tokens = AutoTokenizer.from_pretrained(folder)(
            ["the cat sat on the mat", "i like this movie !"], padding=True, return_tensors="pt"
        )
    assert tokens["input_ids"][0, 1] == make_adapters.VOCAB.index("the")
    with torch.no_grad():
        got = model(**tokens).logits
        want = reference_model(name)(**tokens).logits
        base = base_model("bert_base")(**tokens).logits
    assert torch.equal(got, want)
    assert not torch.allclose(got, base)


@pytest.mark.slow
def test_gpt2_folder_keeps_shards_and_loads(run, tmp_path):
    """The merged GPT-2 folder: 3 shards grouped as the base's index groups them, the tied
    lm_head left out, and GPT2LMHeadModel's logits equal peft's merged model's."""
    from transformers import GPT2LMHeadModel

    ok(run("convert", ADAPTERS / "gpt2_lora", "merged"))
    folder = tmp_path / "merged"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in GPT2_BASE.iterdir())
    base_index = json.loads((GPT2_BASE / "model.safetensors.index.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == base_index["weight_map"]
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3
    for shard in shards:
        held = {k for k, v in index["weight_map"].items() if v == shard}
        assert set(load_file(folder / shard)) == held, shard
    for file in ("config.json", "generation_config.json"):
        assert (folder / file).read_bytes() == (GPT2_BASE / file).read_bytes()
    with quiet_hf():
        model = GPT2LMHeadModel.from_pretrained(folder).eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    ids = torch.tensor([[2, 7, 9, 11, 40, 3]])
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = reference_model("gpt2_lora")(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_sharded_index_total_size_counts_what_was_written(tmp_path, dtype):
    """The merged folder's index says how many bytes its shards hold, as a number (as
    transformers writes it), not the base index's figure copied over."""
    ckptkit.merge_adapters(GPT2_BASE, [ADAPTERS / "gpt2_lora"], tmp_path / "merged", dtype=dtype)
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    state = written(tmp_path / "merged")
    assert set(index["weight_map"]) == set(state) and len(set(index["weight_map"].values())) == 3
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert nbytes == (32512 if dtype is None else 16256)
    assert index["metadata"]["total_size"] == nbytes


# ----------------------------------------------------------------------------- --check-outputs


@pytest.mark.parametrize("name", LOW_RANK + ["kohya_lora.safetensors"])
def test_check_outputs_fp32(run, name):
    """Every merged layer computes what the unmerged adapter did, to fp32 rounding (DoRA and
    fan_in_fan_out included)."""
    if name == "kohya_lora.safetensors":
        args = [KOHYA_LORA, "--base", KOHYA_BASE]
    else:
        args = merge_args(name)
    report = report_of(run("convert", *args, "out.safetensors", "--check-outputs", "--json"))
    check = report["output_check"]
    assert check["layers"] == report["adapters"][0]["modules"] > 0
    assert len(check["errors"]) == check["layers"]
    assert set(check["errors"]) <= set(report["merged"])
    assert check["worst"]["relative_error"] == max(check["errors"].values())
    assert check["worst"]["relative_error"] < 1e-5


def test_check_outputs_needs_a_merge(run, tmp_path):
    """--check-outputs on a plain conversion is refused in one line."""
    result = run("convert", CONV_BASE, "out.safetensors", "--check-outputs")
    assert result.exit_code != 0
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "--check-outputs" in line
    assert listing(tmp_path) == []


# ----------------------------------------------------------------------------- PeftModel state dict


def test_peft_model_state_refused_without_options(run, tmp_path):
    """A PeftModel state dict alone: one Error line naming the options, nothing written."""
    result = run("convert", PEFT_FULL, "out.safetensors")
    assert result.exit_code == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error:") and "Traceback" not in result.output
    assert "--drop-adapters" in line and "--lora-alpha" in line and "--adapter-config" in line
    assert listing(tmp_path) == []


def test_drop_adapters_gives_the_base(run, tmp_path):
    """--drop-adapters: exactly bert_base's tensors under their plain names; the report lists
    the 10 adapter tensors (8 LoRA factors, 2 modules_to_save copies) as dropped."""
    report = report_of(run("convert", PEFT_FULL, "out.safetensors", "--drop-adapters", "--json"))
    got, want = written(tmp_path / "out.safetensors"), load_file(BERT_BASE / "model.safetensors")
    assert set(got) == set(want)
    assert_same(got, want)
    assert not any(k.startswith(PREFIX) or "base_layer" in k for k in got)
    assert [(d["tensors"], d["bytes"]) for d in report["dropped"]] == [(10, 2252)]
    assert "adapter" in report["dropped"][0]["path"]
    assert report["adapters"] == [] and report["merged"] == {}


@pytest.mark.slow
def test_adapter_config_equals_peft(run, tmp_path):
    """--adapter-config merges as peft does with that config, bit for bit."""
    ok(run("convert", PEFT_FULL, "out.safetensors", "--adapter-config", PEFT_FULL_CONFIG))
    want = peft_reference("bert_peft_full.pt")
    got = written(tmp_path / "out.safetensors")
    assert set(got) == set(want)
    assert_same(got, want)


def test_lora_alpha_equals_adapter_config(run, tmp_path):
    """The config says r=4, lora_alpha=8: --lora-alpha 8 merges the same tensors; --lora-alpha
    16 doubles every LoRA change."""
    config = json.loads(PEFT_FULL_CONFIG.read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 8, False)
    ok(run("convert", PEFT_FULL, "config.safetensors", "--adapter-config", PEFT_FULL_CONFIG))
    ok(run("convert", PEFT_FULL, "alpha8.safetensors", "--lora-alpha", "8"))
    ok(run("convert", PEFT_FULL, "alpha16.safetensors", "--lora-alpha", "16"))
    by_config = written(tmp_path / "config.safetensors")
    alpha8 = written(tmp_path / "alpha8.safetensors")
    alpha16 = written(tmp_path / "alpha16.safetensors")
    assert set(by_config) == set(alpha8)
    assert_same(alpha8, by_config)
    base = load_file(BERT_BASE / "model.safetensors")
    for module in QV:
        key = module + ".weight"
        assert torch.allclose(alpha16[key] - base[key], 2 * (alpha8[key] - base[key]), atol=1e-5)
        assert not torch.equal(alpha16[key], alpha8[key])
    assert_same(alpha16, alpha8, keys=["classifier.weight", "classifier.bias"])


@pytest.mark.parametrize(
    "args",
    [
        [PEFT_FULL, "out.safetensors", "--drop-adapters", "--lora-alpha", "8"],
        [ADAPTERS / "bert_lora", "out.safetensors", "--drop-adapters"],  # not a PeftModel's
    ],
    ids=["both", "not_peft_model_state"],
)
def test_drop_adapters_misused(run, tmp_path, args):
    """--drop-adapters with --lora-alpha, or on an adapter folder: one Error line naming it."""
    result = run("convert", *args)
    assert result.exit_code != 0 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "--drop-adapters" in line
    assert listing(tmp_path) == []


# ----------------------------------------------------------------------------- errors
# Each case builds its inputs in tmp_path and gives convert's arguments (SRC, DST, options)
# and the words the one error line must hold.

VALUE = "bert.encoder.layer.1.attention.self.value.weight"
QUERY = "bert.encoder.layer.0.attention.self.query.weight"
BERT_LORA = ADAPTERS / "bert_lora"


def _truncated_adapter(tmp_path, monkeypatch):
    folder = copy_adapter("bert_lora", tmp_path)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # the header whole, the data cut
    return [folder, "merged", "--base", BERT_BASE], ["adapter_model.safetensors", "truncated"]


def _truncated_base(tmp_path, monkeypatch):
    base = bert_base_file(tmp_path)
    base.write_bytes(base.read_bytes()[:20000])
    return [BERT_LORA, "out.safetensors", "--base", base], ["base.safetensors", "truncated"]


def _wrong_base(tmp_path, monkeypatch):  # bert's adapter, the conv net's base
    return [BERT_LORA, "out.safetensors", "--base", CONV_BASE], [QUERY, "--base"]


def _wrong_shape(tmp_path, monkeypatch):
    base = bert_base_file(tmp_path, replace={VALUE: torch.zeros(32, 16)})
    return [BERT_LORA, "out.safetensors", "--base", base], [VALUE, "[32, 16]"]


def _wrong_rank(tmp_path, monkeypatch):
    folder = copy_adapter("bert_lora", tmp_path, r=2)
    return [folder, "out.safetensors", "--base", BERT_BASE], ["rank 4", "r=2"]


def _missing_key(tmp_path, monkeypatch):
    base = bert_base_file(tmp_path, drop=[VALUE])
    return [BERT_LORA, "out.safetensors", "--base", base], [VALUE, "does not hold"]


def _base_nowhere(tmp_path, monkeypatch):
    (tmp_path / "empty_cache").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    folder = copy_adapter("bert_lora", tmp_path, base_model_name_or_path="nope/none")
    return [folder, "merged"], ["'nope/none'", "--base"]


def _ia3(tmp_path, monkeypatch):
    folder = copy_adapter("bert_lora", tmp_path, peft_type="IA3")
    return [folder, "out.safetensors", "--base", BERT_BASE], ["IA3"]


def _int8_base(tmp_path, monkeypatch):
    base = bert_base_file(tmp_path, replace={QUERY: torch.ones(16, 16, dtype=torch.int8)})
    return [BERT_LORA, "out.safetensors", "--base", base], [QUERY, "int8", "quantized"]


def _kohya_on_bert(tmp_path, monkeypatch):
    return [BERT_BASE, "out.safetensors", "--adapter", KOHYA_LORA], ["matches no base weight"]


def _weighted_dora(tmp_path, monkeypatch):
    dora = f"{ADAPTERS / 'bert_dora'}:0.5"
    return [BERT_BASE, "out.safetensors", "--adapter", dora], ["DoRA", "weight"]


def _weighted_modules_to_save(tmp_path, monkeypatch):
    saved = f"{ADAPTERS / 'bert_modules_to_save'}:0.5"
    return [BERT_BASE, "merged", "--adapter", saved], ["modules_to_save", "weight"]


ERRORS = {
    "truncated_adapter": _truncated_adapter,
    "truncated_base": _truncated_base,
    "wrong_base": _wrong_base,
    "wrong_shape": _wrong_shape,
    "wrong_rank": _wrong_rank,
    "missing_key": _missing_key,
    "base_nowhere": _base_nowhere,
    "ia3": _ia3,
    "int8_base": _int8_base,
    "kohya_on_bert": _kohya_on_bert,
    "weighted_dora": _weighted_dora,
    "weighted_modules_to_save": _weighted_modules_to_save,
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_refused_in_one_line_writing_nothing(run, tmp_path, monkeypatch, case):
    """One ``Error:`` line naming the problem, exit 1, no traceback, nothing at DST and no
    temp file left."""
    args, words = ERRORS[case](tmp_path, monkeypatch)
    before = listing(tmp_path)
    result = run("convert", *args)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "Traceback" not in result.output
    for word in words:
        assert word in line, (word, line)
    assert not (tmp_path / args[1]).exists()
    assert listing(tmp_path) == before


# ----------------------------------------------------------------------------- Hugging Face cache


def test_base_found_in_hf_cache(run, tmp_path, monkeypatch):
    """A base named ``org/tiny-bert`` is the snapshot refs/main points to in HF_HUB_CACHE (not
    another snapshot beside it), and merges as the local base does."""
    repo = tmp_path / "hub" / "models--org--tiny-bert"
    good, other = "a" * 40, "b" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(good)
    shutil.copytree(BERT_BASE, repo / "snapshots" / good)
    shutil.copytree(BERT_BASE, repo / "snapshots" / other)
    (repo / "snapshots" / other / "model.safetensors").write_bytes(b"not this one")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    adapter = copy_adapter("bert_lora", tmp_path, base_model_name_or_path="org/tiny-bert")
    report = report_of(run("convert", adapter, "cached.safetensors", "--json"))
    assert report["adapters"][0]["base"] == str(repo / "snapshots" / good)
    ok(run("convert", ADAPTERS / "bert_lora", "local.safetensors"))
    got, want = written(tmp_path / "cached.safetensors"), written(tmp_path / "local.safetensors")
    assert set(got) == set(want)
    assert_same(got, want)


# ----------------------------------------------------------------------------- several adapters


def test_several_adapters_in_order(run, tmp_path):
    """``--adapter bert_lora --adapter bert_rslora`` in one pass equals the two merges one after
    the other: on an fp32 base, rounding between them to fp32 changes nothing, so bit for bit."""
    result = run(
        "convert", BERT_BASE, "both.safetensors", "--adapter", ADAPTERS / "bert_lora",
        "--adapter", ADAPTERS / "bert_rslora", "--json",
    )  # fmt: skip
    report = report_of(result)
    assert [(Path(a["path"]).name, a["variant"]) for a in report["adapters"]] == [
        ("bert_lora", "LoRA"),
        ("bert_rslora", "rsLoRA"),
    ]
    ok(run("convert", ADAPTERS / "bert_lora", "step1.safetensors"))
    ok(
        run(
            "convert",
            "step1.safetensors",
            "step2.safetensors",
            "--adapter",
            ADAPTERS / "bert_rslora",
        )
    )
    got, want = written(tmp_path / "both.safetensors"), written(tmp_path / "step2.safetensors")
    assert set(got) == set(want)
    for key in got:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-6), key
    assert_same(got, want)  # the strongest that holds
    base = load_file(BERT_BASE / "model.safetensors")
    assert len([k for k in got if not torch.equal(got[k], base[k])]) == 13  # rslora's modules
    assert set(report["merged"]) == {k for k in got if not torch.equal(got[k], base[k])}


# ----------------------------------------------------------------------------- zero B (property)

LORA_TENSORS = load_file(ADAPTERS / "bert_lora" / "adapter_model.safetensors")
LORA_CONFIG = json.loads((ADAPTERS / "bert_lora" / "adapter_config.json").read_text())


@settings(max_examples=10, deadline=None)
@given(
    zeroed=st.sets(st.sampled_from(QV), min_size=1),
    alpha=st.floats(0.125, 4096, allow_nan=False, allow_infinity=False),
    rank=st.integers(1, 4),
    rslora=st.booleans(),
)
def test_zero_b_gives_the_base_back(zeroed, alpha, rank, rslora):
    """Modules whose lora_B is all zeros keep the base's weights bit for bit, whatever the
    alpha, rank or rsLoRA; the other modules change."""
    base = load_file(BERT_BASE / "model.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "zero_b"
        folder.mkdir()
        tensors = {}
        for key, tensor in LORA_TENSORS.items():
            module = key[len(PREFIX) :].rsplit(".", 2)[0]
            if ".lora_A." in key:
                tensor = tensor[:rank]
            else:
                tensor = tensor[:, :rank] * (0 if module in zeroed else 1)
            tensors[key] = tensor.contiguous()
        save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
        config = {**LORA_CONFIG, "r": rank, "lora_alpha": alpha, "use_rslora": rslora}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        report = ckptkit.merge_adapters(BERT_BASE, [folder], Path(tmp) / "out.safetensors")
        got = load_file(Path(tmp) / "out.safetensors")
    assert set(got) == set(base)
    for key in base:
        if key[: -len(".weight")] in set(QV) - zeroed:
            assert not torch.equal(got[key], base[key]), key
            assert report.merged[key] > 0
        else:
            assert bits(got[key]) == bits(base[key]), key
    assert all(report.merged[m + ".weight"] == 0.0 for m in zeroed)


# ----------------------------------------------------------------------------- bf16 base


def _conv_delta(name: str, lora: dict, scale: float) -> torch.Tensor:
    """peft's ``get_delta_weight`` for TinyConvNet's modules, written out here."""
    a = lora[f"{PREFIX}{name}.lora_A.weight"]
    b = lora[f"{PREFIX}{name}.lora_B.weight"]
    functional = torch.nn.functional
    if name == "head":  # Linear
        return scale * (b @ a)
    if name == "mix":  # Conv2d 1x1
        return scale * (b.squeeze(3).squeeze(2) @ a.squeeze(3).squeeze(2))[..., None, None]
    if name == "stem":  # Conv2d 3x3
        return scale * functional.conv2d(a.transpose(0, 1), b).transpose(0, 1)
    return scale * functional.conv1d(a.transpose(0, 1), b).transpose(0, 1)  # seq: Conv1d k=3


def test_bf16_base_is_rounded_once(run, tmp_path):
    """Into a bf16 base the merge stays bf16 and is ``(W.float() + delta).to(bf16)``: one
    rounding, not peft's two (delta rounded, then the sum)."""
    base = {k: v.to(torch.bfloat16) for k, v in load_file(CONV_BASE).items()}
    save_file(base, tmp_path / "conv_bf16.safetensors", metadata={"format": "pt"})
    ok(run("convert", ADAPTERS / "conv_lora", "out.safetensors", "--base", "conv_bf16.safetensors"))
    got = written(tmp_path / "out.safetensors")
    assert set(got) == set(base) and {t.dtype for t in got.values()} == {torch.bfloat16}
    lora = load_file(ADAPTERS / "conv_lora" / "adapter_model.safetensors")
    config = json.loads((ADAPTERS / "conv_lora" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    twice = 0
    for name in ("head", "mix", "stem", "seq"):
        weight, delta = base[name + ".weight"], _conv_delta(name, lora, scale)
        assert delta.shape == weight.shape
        want = (weight.float() + delta).to(torch.bfloat16)
        assert bits(got[name + ".weight"]) == bits(want), name
        twice += not torch.equal(want, weight + delta.to(torch.bfloat16))
        assert bits(got[name + ".bias"]) == bits(base[name + ".bias"])
    assert twice > 0  # double rounding differs here, so the test tells them apart


# ----------------------------------------------------------------------------- library


def test_library_merge_and_load(tmp_path):
    """merge_adapters, load_state_dict and load_into agree with the CLI's merge."""
    report = ckptkit.merge_adapters(CONV_BASE, [ADAPTERS / "conv_lora"], tmp_path / "m.safetensors")
    assert report.verified and set(report.merged) == {
        f"{m}.weight" for m in ("stem", "mix", "seq", "head")
    }
    merged = load_file(tmp_path / "m.safetensors")
    state = ckptkit.load_state_dict(ADAPTERS / "conv_lora", base=CONV_BASE)
    assert_same(dict(state), merged)
    via_adapters = ckptkit.load_state_dict(CONV_BASE, adapters=[ADAPTERS / "conv_lora"])
    assert_same(dict(via_adapters), merged)
    model = make_adapters.TinyConvNet()
    ckptkit.load_into(model, ADAPTERS / "conv_lora", base=CONV_BASE)
    assert_same(model.state_dict(), merged)


def test_pt_output_and_force(run, tmp_path):
    """A .pt DST holds the same merge as a .safetensors one; an existing DST is kept unless
    --force."""
    ok(run("convert", *merge_args("conv_lora"), "m.safetensors"))
    ok(run("convert", *merge_args("conv_lora"), "m.pt"))
    got, want = (
        torch.load(tmp_path / "m.pt", weights_only=True),
        written(tmp_path / "m.safetensors"),
    )
    assert set(got) == set(want)
    assert_same(got, want)
    (tmp_path / "taken.safetensors").write_bytes(b"old")
    result = run("convert", *merge_args("conv_lora"), "taken.safetensors")
    assert (
        result.exit_code == 1 and result.stderr.startswith("Error: ") and "--force" in result.stderr
    )
    assert (tmp_path / "taken.safetensors").read_bytes() == b"old"
    ok(run("convert", *merge_args("conv_lora"), "taken.safetensors", "--force"))
    assert_same(written(tmp_path / "taken.safetensors"), want)


# ----------------------------------------------------------------------------- subprocess


@pytest.mark.slow
def test_real_process_merges_and_refuses(tmp_path):
    """``python -m ckptkit convert``: a kohya merge (exit 0, the JSON report, sd-scripts'
    numbers) and a refusal (exit 1, one line, no traceback, nothing written)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPTKIT_DEBUG", None)

    def ckptkit_run(*args):
        return subprocess.run(
            [sys.executable, "-m", "ckptkit", "convert", *map(str, args)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    done = ckptkit_run(KOHYA_LORA, "out.safetensors", "--base", KOHYA_BASE, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [a["kind"] for a in report["adapters"]] == ["kohya LoRA"] and report["verified"]
    assert len(report["merged"]) == 5
    with as_in_a_fresh_process():  # as the subprocess computed it
        want = make_adapters.kohya_merge_reference(load_file(KOHYA_BASE), load_file(KOHYA_LORA))
    assert_same(load_file(tmp_path / "out.safetensors"), want)
    refused = ckptkit_run(PEFT_FULL, "refused.safetensors")
    assert refused.returncode == 1 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert line.startswith("Error: ") and "--drop-adapters" in line
    assert not (tmp_path / "refused.safetensors").exists()


# ----------------------------------------------------------------------------- JSON report


def test_json_report_is_strict_json(run):
    """A merged tensor whose base is all zeros (classifier.bias, replaced by modules_to_save)
    has no relative change; the --json report must still be valid JSON (no ``Infinity``)."""
    result = run("convert", ADAPTERS / "bert_modules_to_save", "out.safetensors", "--json")
    ok(result)

    def reject(constant):
        raise ValueError(f"{constant} is not JSON")

    report = json.loads(result.stdout, parse_constant=reject)
    assert "classifier.bias" in report["merged"]


# ----------------------------------------------------------------------------- inspect


def inspect_json(run, path) -> dict:
    return report_of(run("inspect", path, "--json"))["adapter"]


def test_inspect_peft_adapter_per_module_ranks(run):
    """rank_pattern / alpha_pattern: every (rank, alpha) pair, and each module's, as peft
    resolves them."""
    adapter = inspect_json(run, ADAPTERS / "bert_patterns")
    assert adapter["kind"] == "PEFT LoRA" and adapter["base"] == "bert_base"
    pairs = {(p["rank"], p["alpha"]) for p in adapter["rank_alpha"]}
    assert pairs == {(2, 8.0), (4, 16.0), (4, 8.0), (6, 16.0)}
    by_module = {t["module"]: (t["rank"], t["alpha"]) for t in adapter["targets"]}
    assert by_module["bert.encoder.layer.0.attention.self.query"] == (2, 8.0)
    assert by_module["bert.encoder.layer.1.attention.self.value"] == (6, 16.0)
    text = run("inspect", ADAPTERS / "bert_patterns").stdout
    assert "bert.encoder.layer.0.attention.self.query: r=2 alpha=8" in text


@pytest.mark.parametrize(
    ("name", "variant", "extra"),
    [
        ("bert_dora", "DoRA", ("targets", "query")),
        ("bert_rslora", "rsLoRA", ("targets", "dense")),
        ("bert_modules_to_save", "LoRA", ("modules_to_save", "classifier")),
    ],
)
def test_inspect_names_the_variant_and_what_it_replaces(run, name, variant, extra):
    adapter = inspect_json(run, ADAPTERS / name)
    assert adapter["variant"] == variant
    field, value = extra
    if field == "targets":
        assert value in adapter["target_modules"]
    else:
        assert adapter[field] == [value]
    assert adapter["bytes"] == sum(
        t.numel() * t.element_size()
        for t in load_file(ADAPTERS / name / "adapter_model.safetensors").values()
    )


def test_inspect_trainable_tokens_and_kohya(run):
    tokens = inspect_json(run, ADAPTERS / "bert_trainable_tokens")["trainable_tokens"]
    assert tokens == {"bert.embeddings.word_embeddings.weight": [1, 2, 5]}
    kohya = inspect_json(run, KOHYA_LORA)
    assert kohya["kind"] == "kohya LoRA" and kohya["base"] is None
    assert kohya["target_modules"] == ["lora_te (1 module)", "lora_unet (4 modules)"]
    assert {(p["rank"], p["alpha"]) for p in kohya["rank_alpha"]} == {(2, 1.0), (4, 2.0)}
    assert "convert needs --base PATH" in run("inspect", KOHYA_LORA).stdout


def test_inspect_peft_model_state_says_how_to_convert(run):
    adapter = inspect_json(run, PEFT_FULL)
    assert adapter["kind"] == "PeftModel state dict"
    assert adapter["adapter_tensors"] == 10
    assert "--drop-adapters" in adapter["convert"] and "--lora-alpha" in adapter["convert"]


def test_inspect_of_a_model_has_no_adapter(run):
    assert inspect_json(run, BERT_BASE) is None
