"""Tied weights both ways, as the Hugging Face ecosystem does it: safetensors output stores one
tensor per tied group and names the others in the metadata as ``save_model`` does; reading
understands that form (and ckptkit's own) everywhere."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FIXTURE_DIR, reference_model, sample_input
from hypothesis import given
from hypothesis import strategies as st
from make_fixtures import TiedLM
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_model

import ckptkit
from ckptkit.keys import plan_ties


def _outputs(model):
    return model.eval()(sample_input(model))


@pytest.fixture
def tied_st(tmp_path):
    dst = tmp_path / "tied.safetensors"
    report = ckptkit.convert(FIXTURE_DIR / "tied.pt", dst)
    return dst, report


def test_one_tensor_per_group_named_in_the_metadata_as_save_model_does(tied_st, tmp_path):
    dst, report = tied_st
    assert report.aliases == {"head.weight": "embed.weight"} and report.ties == "once"
    assert set(load_file(dst)) == {"embed.weight"}
    with safe_open(str(dst), "pt") as f:
        assert f.metadata()["head.weight"] == "embed.weight"
    # safetensors' own save_model keeps the same name and records the same entry.
    ref = tmp_path / "ref.safetensors"
    save_model(reference_model("tied"), str(ref))
    with safe_open(str(ref), "pt") as f:
        assert set(f.keys()) == {"embed.weight"} and f.metadata()["head.weight"] == "embed.weight"


def test_the_loaders_accept_it(tied_st):
    dst, _ = tied_st
    expected = _outputs(reference_model("tied"))
    strict = TiedLM()
    load_model(strict, str(dst), strict=True)  # safetensors' own loader
    assert torch.equal(_outputs(strict), expected)
    loose = TiedLM()
    missing, unexpected = loose.load_state_dict(load_file(dst), strict=False)
    assert missing == ["head.weight"] and unexpected == []  # and it is tied: nothing lost
    assert torch.equal(_outputs(loose), expected)
    filled = TiedLM()
    report = ckptkit.load_into(filled, dst)  # the recorded tie gives both names
    assert report.loaded == 2 and torch.equal(_outputs(filled), expected)


def test_keep_tied_copies_writes_every_name(tmp_path, run, fixture_copy):
    fixture_copy("tied.pt")
    result = run("convert", "tied.pt", "both.safetensors", "--keep-tied-copies")
    assert result.exit_code == 0, result.stderr
    assert "Tied     head.weight = embed.weight (written twice, recorded in metadata)" in (
        result.stdout.splitlines()
    )
    assert set(load_file(tmp_path / "both.safetensors")) == {"embed.weight", "head.weight"}


def test_reading_the_save_model_form_everywhere(tied_st, tmp_path):
    dst, _ = tied_st
    # .pt output restores the alias as one shared storage.
    pt = tmp_path / "back.pt"
    report = ckptkit.convert(dst, pt)
    assert report.aliases == {"head.weight": "embed.weight"} and report.ties == "shared"
    back = torch.load(pt, weights_only=True)
    assert back["head.weight"].data_ptr() == back["embed.weight"].data_ptr()
    # inspect shows the tie and counts its bytes once.
    summary = ckptkit.summarize(dst)
    assert summary.aliases == {"head.weight": "embed.weight"}
    assert summary.nbytes == 10 * 4 * 4
    # diff treats an alias as its target: the .pt with two names equals the file with one.
    assert ckptkit.diff(FIXTURE_DIR / "tied.pt", dst).equal
    # load_state_dict gives both names, so a strict load works.
    fresh = TiedLM()
    fresh.load_state_dict(ckptkit.load_state_dict(dst), strict=True)
    assert torch.equal(_outputs(fresh), _outputs(reference_model("tied")))


def test_load_into_fills_a_tied_name_the_file_left_out(tmp_path):
    """save_pretrained drops a tied name without recording it: the model's own ties tell."""
    model = reference_model("tied")
    path = tmp_path / "pretrained.safetensors"
    from safetensors.torch import save_file

    save_file({"embed.weight": model.embed.weight.detach()}, path, metadata={"format": "pt"})
    fresh = TiedLM()
    report = ckptkit.load_into(fresh, path)  # strict, and nothing missing
    assert report.loaded == 1 and torch.equal(_outputs(fresh), _outputs(model))


def test_rnn_flat_buffers_keep_every_view(tmp_path):
    report = ckptkit.convert(FIXTURE_DIR / "flat_buffer.pt", tmp_path / "flat.safetensors")
    assert report.tensors == 9 and not report.aliases


def test_tied_report_line(run, fixture_copy):
    fixture_copy("tied.pt")
    result = run("convert", "tied.pt", "tied.safetensors")
    assert (
        "Tied     head.weight = embed.weight (written once, named in the metadata as save_model "
        "does)" in result.stdout.splitlines()
    )


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.sampled_from("abcdefgh"), max_size=8))
def test_plan_ties_keeps_the_first_name_of_each_group(aliases):
    removed = plan_ties(aliases)
    # Every name of a group maps to the group's smallest name, which is never removed.
    assert all(kept not in removed and kept < name for name, kept in removed.items())
    for alias, target in aliases.items():
        if alias != target:
            assert removed.get(alias, alias) == removed.get(target, target)


def test_gpt2_loads_with_from_pretrained_and_is_the_size_save_pretrained_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=4000, n_positions=64, n_embd=64, n_layer=2, n_head=2, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    hf = tmp_path / "hf"
    model.save_pretrained(hf)  # the reference layout and size
    src = tmp_path / "gpt2.pt"
    torch.save(model.state_dict(), src)  # both names, one storage
    out = tmp_path / "ours"
    out.mkdir()
    config.save_pretrained(out)
    ckptkit.convert(src, out / "model.safetensors")
    ours, theirs = (out / "model.safetensors").stat().st_size, (hf / "model.safetensors").stat()
    assert abs(ours - theirs.st_size) / theirs.st_size < 0.01
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    json.dumps(ckptkit.summarize(out / "model.safetensors").to_dict())
