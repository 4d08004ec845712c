"""The torchtitan-llama3 pack: a real torchtitan 0.3.0 run's DCP checkpoints
(fixtures/torchtitan, made by fixtures/make_torchtitan.py with torchtitan's own model,
optimizer and CheckpointManager) to Hugging Face, equal bit for bit to torchtitan's own export
(Llama3StateDictAdapter.to_hf), and back to the DCP torchtitan saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import FIXTURE_DIR, one_error, single_process_dcp
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.errors import MappingError
from ckptkit.formats.base.tensors import bit_equal
from ckptkit.mapping.spec import PACKS

RUN = FIXTURE_DIR / "torchtitan" / "torchtitan-llama3"
EXPORT = FIXTURE_DIR / "torchtitan" / "torchtitan-llama3-hf"
ARGS = json.loads((RUN / "model_args.json").read_text())


def titan_weights(step: str) -> dict[str, torch.Tensor]:
    """What torchtitan saved at a step, read by torch's own DCP reader (model keys only)."""
    metadata = dcp.FileSystemReader(str(RUN / "checkpoint" / step)).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if not key.startswith(("optimizer.", "lr_scheduler.", "dataloader.", "train_state."))
    }
    with single_process_dcp():
        dcp.load(state, checkpoint_id=str(RUN / "checkpoint" / step), no_dist=True)
    return state


def test_the_newest_step_maps_to_torchtitans_own_export_bit_for_bit(tmp_path):
    report = ckptkit.convert(
        RUN, tmp_path / "hf", mapping="torchtitan-llama3", sets={"n_heads": ARGS["n_heads"]}
    )
    ours, theirs = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(EXPORT / "model.safetensors"),
    )
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not bit_equal(ours[k], theirs[k])] == []
    assert "step-10, the newest of the run's 2 step checkpoints" in report.selected_reason
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert (config["num_hidden_layers"], config["intermediate_size"], config["vocab_size"]) == (
        2,
        32,
        64,
    )
    # torchtitan's Llama 3 settings, which the checkpoint lacks: assumed, and said so
    taken = report.mapping["defaults_taken"]
    assert taken == ["norm_eps", "rope_theta", "max_positions", "rope_factor"]
    exported = json.loads((EXPORT / "config.json").read_text())
    for field in ("rms_norm_eps", "rope_theta", "rope_scaling"):
        assert config[field] == exported[field], field
    assert report.copied == 21 and report.through_torch == 0  # q and k rows permuted as bytes


def test_a_full_training_save_leaves_its_optimizer_out(tmp_path):
    report = ckptkit.convert(
        RUN, tmp_path / "hf", mapping="torchtitan-llama3", select="step-5", sets={"n_heads": 8}
    )
    assert [d.path for d in report.dropped] == ["optimizer"]
    assert {"lr_scheduler", "train_state", "dataloader"} <= set(report.extras)
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    saved = titan_weights("step-5")
    assert bit_equal(
        ours["model.layers.1.mlp.down_proj.weight"], saved["layers.1.feed_forward.w2.weight"]
    )


def test_mapped_back_it_is_the_dcp_torchtitan_saved(tmp_path):
    report = ckptkit.convert(
        EXPORT,
        tmp_path / "back",
        mapping="torchtitan-llama3",
        reverse=True,
        to="dcp",
        check_roundtrip=True,
    )
    assert (
        report.mapping["direction"] == "hf -> titan"
        and report.mapping["roundtrip"]["mapped_back"] == 4
    )
    saved = titan_weights("step-10")
    state = {key: torch.empty_like(t) for key, t in saved.items()}
    with single_process_dcp():  # torch's own reader, the keys at the top level as torchtitan's
        dcp.load(state, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert [k for k in saved if not bit_equal(state[k], saved[k])] == []


def test_refusals_name_the_rule_the_key_and_the_fix(tmp_path, run):
    one_error(
        run("convert", str(RUN), "hf", "--map", "torchtitan-llama3"),
        "reads 'n_heads', which is not set",
        "--set n_heads=VALUE",
    )
    one_error(
        run("convert", str(RUN), "hf", "--map", "torchtitan-llama3", "--set", "n_heads=3"),
        "rule 2 (layers.{i}.attention.qkv_linear.wq.weight)",
        "is not 3 heads of pairs of rows",
    )
    # A fused q/k/v left unsplit (what torchtitan's to_hf skips without a word) is refused.
    state = {k: t.contiguous() for k, t in titan_weights("step-10").items()}
    fused = torch.cat([state.pop(f"layers.1.attention.qkv_linear.w{x}.weight") for x in "qkv"])
    state["layers.1.attention.qkv_linear.wqkv.weight"] = fused
    save_file(state, tmp_path / "fused.safetensors")
    with pytest.raises(MappingError, match="takes 'layers.1.attention.qkv_linear.wqkv.weight'"):
        ckptkit.convert(
            tmp_path / "fused.safetensors",
            tmp_path / "out.safetensors",
            mapping="torchtitan-llama3",
            sets={"n_heads": 8},
        )
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("permuted", [True, False], ids=["as-the-pack", "without-permute"])
def test_the_converted_model_computes_torchtitans_own_logits(tmp_path, permuted):
    """transformers' LlamaForCausalLM on the converted folder gives the logits torchtitan's own
    model computed on the checkpoint (fixtures/make_torchtitan.py --logits: torchtitan's
    forward with its FlexAttention); a pack that forgets the rotary permute is caught."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    pack = "torchtitan-llama3"
    if not permuted:  # the same pack, q and k left in torchtitan's interleaved rotary order
        text = (PACKS / f"{pack}.toml").read_text()
        pack = str(tmp_path / "no-permute.toml")
        for heads in ("n_heads", "n_kv_heads"):
            text = text.replace(f'"permute_rope(heads={heads})"', '"rename()"')
        Path(pack).write_text(text)
        assert 'ops = ["permute_rope' not in text
    ckptkit.convert(RUN, tmp_path / "hf", mapping=pack, sets={"n_heads": ARGS["n_heads"]})
    reference = load_file(RUN.parent / "torchtitan-llama3-logits.safetensors")
    with safe_open(RUN.parent / "torchtitan-llama3-logits.safetensors", "pt") as f:
        made = json.loads(f.metadata()["ckptkit_reference"])
    assert made["checkpoint"] == "step-10" and made["rms_norm_eps"] == 1e-05
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    worst = (logits - reference["logits"]).abs().max().item()
    if permuted:
        assert worst < 1e-5, worst  # measured 1.2e-7: float rounding
    else:
        assert worst > 1e-4, worst  # measured 2e-4: attention is a small part of these logits
