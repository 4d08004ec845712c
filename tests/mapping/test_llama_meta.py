"""The llama-meta pack end to end: Meta's consolidated.NN.pth folders (TP 1, 2 and 4, grouped-
query attention, Llama 2's column-split embedding and rotary frequencies) to Hugging Face, equal
bit for bit to transformers' own converter's output (fixtures/mapping, made by transformers
4.46.3: see fixtures/make_mapping.py), with the Meta model's logits; and back to the very
shards it came from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import FIXTURE_DIR, ROOT, one_error
from make_mapping import CASES, PARAMS, make_meta
from meta_llama import meta_logits
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import FormatError, MappingError, UsageError
from ckptkit.formats.base.tensors import bit_equal
from ckptkit.mapping.spec import PACKS

REFERENCES = FIXTURE_DIR / "mapping"
CASE_IDS = [name for name, _, _ in CASES]
# The config fields transformers' converter sets from params.json (max_position_embeddings
# and the token ids come from its own table of Llama versions, not from the checkpoint).
CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
)


@pytest.mark.parametrize(("name", "tp", "version"), CASES, ids=CASE_IDS)
def test_meta_to_hf_is_transformers_converter_bit_for_bit(tmp_path, name, tp, version):
    make_meta(tmp_path / "meta", tp, version)
    report = ckptkit.convert(tmp_path / "meta", tmp_path / "hf", mapping="llama-meta")
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    theirs = load_file(REFERENCES / name / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not bit_equal(ours[k], theirs[k])] == []
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    reference = json.loads((REFERENCES / name / "config.json").read_text())
    fields = (*CONFIG_FIELDS, "rope_scaling")  # Llama 3.1's (use_scaled_rope), else none
    assert {f: config.get(f) for f in fields} == {f: reference[f] for f in fields}
    if version == "3.1":  # the context is the pack's guess otherwise (said in the report)
        assert config["max_position_embeddings"] == reference["max_position_embeddings"]
    assert report.verified and report.made_files == ["config.json"]
    # Every rule only moves bytes (slices joined along rows or columns, q and k rows permuted,
    # norms checked equal on every rank), so no tensor goes through torch.
    assert (report.copied, report.through_torch) == (21, 0)
    mapping = report.mapping
    assert (
        mapping["accounted_bytes"]
        == mapping["source_bytes"]
        == sum(
            t.numel() * t.element_size()
            for r in range(tp)
            for t in torch.load(
                tmp_path / "meta" / f"consolidated.{r:02d}.pth", weights_only=True
            ).values()
        )
    )
    dropped = [d["bytes"] for d in mapping["dropped"]]
    assert dropped == ([tp * PARAMS["dim"] // PARAMS["n_heads"]] if version == "2" else [])


@pytest.mark.parametrize("name", ["llama3-tp2", "llama2-tp2"])
def test_the_converted_model_computes_the_meta_models_logits(tmp_path, name):
    """from_pretrained's logits equal Meta's forward pass on the source weights; the same
    mapping without the rotary permute gives other logits (what a silent converter bug does)."""
    from transformers import LlamaForCausalLM

    _, tp, version = next(c for c in CASES if c[0] == name)
    whole = make_meta(tmp_path / "meta", tp, version)
    tokens = torch.randint(
        0, PARAMS["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1)
    )
    want = meta_logits(whole, PARAMS, tokens)

    def logits(folder):
        model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            return model(tokens).logits

    ckptkit.convert(tmp_path / "meta", tmp_path / "hf", mapping="llama-meta")
    torch.testing.assert_close(logits(tmp_path / "hf"), want, rtol=1e-4, atol=1e-4)
    unpermuted = (
        (PACKS / "llama-meta.toml").read_text().replace(', "permute_rope(heads=n_heads)"', "")
    )
    (tmp_path / "no-permute.toml").write_text(unpermuted)
    ckptkit.convert(tmp_path / "meta", tmp_path / "wrong", mapping=tmp_path / "no-permute.toml")
    assert (logits(tmp_path / "wrong") - want).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "tp", "version"), CASES, ids=CASE_IDS)
def test_reversed_with_the_rank_count_it_gives_back_the_original_shards(
    tmp_path, name, tp, version
):
    make_meta(tmp_path / "meta", tp, version)
    sets = {"tp": tp} | ({"embed_dim": 1} if version == "2" else {})
    report = ckptkit.convert(
        REFERENCES / name,
        tmp_path / "back",
        mapping="llama-meta",
        reverse=True,
        sets=sets,
        check_roundtrip=True,
    )
    names = [f"consolidated.{r:02d}.pth" for r in range(tp)]
    assert sorted(os.listdir(tmp_path / "back")) == [*names, "params.json"]
    for file in names:
        original = torch.load(tmp_path / "meta" / file, weights_only=True)
        back = torch.load(tmp_path / "back" / file, weights_only=True)
        original.pop("rope.freqs", None)  # Llama 2's, dropped on the way (loaders compute it)
        assert list(back) == list(original)  # Meta's order too
        assert [k for k in original if not bit_equal(back[k], original[k])] == []
    params = json.loads((tmp_path / "back" / "params.json").read_text())
    assert {k: params[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")} == {
        k: PARAMS[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")
    }
    assert report.mapping["target_ranks"] == tp and report.mapping["direction"] == "hf -> meta"
    # mapped back in the stream: every group, but with one rank only q and k go through torch
    # (the rest are byte copies, whose inverse is the identity)
    expected = 21 if tp > 1 else 2 * PARAMS["n_layers"]
    assert report.mapping["roundtrip"]["mapped_back"] == expected
    taken = report.mapping["defaults_taken"]
    assert taken == ([] if version == "2" else ["embed_dim"])  # said in the report when taken


def test_the_cli_reports_each_rule_and_what_it_assumed(run, tmp_path):
    make_meta(tmp_path / "meta", 2, "2")
    result = run("convert", "meta", "hf", "--map", "llama-meta")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert (
        "Mapped   by llama-meta (meta -> hf): 13 of 13 rules ran; every source byte accounted for (58.0 kB)"
        in lines
    )
    assert "  rule 2: 4 keys -> 2 (gather(dim=0), permute_rope(heads=n_heads))" in lines
    assert any(line.startswith("Dropped  8 B by rule 13: the rotary frequencies") for line in lines)
    assert "Assumed  max_positions = 4096 (the mapping's default; --set max_positions=...)" in lines
    assert "Made     config.json from the mapping" in lines
    back = run(
        "convert",
        "hf",
        "back",
        "--map",
        "llama-meta",
        "--reverse",
        "--set",
        "tp=2",
        "--set",
        "embed_dim=1",
        "--json",
    )
    assert back.exit_code == 0, back.output
    report = json.loads(back.output)
    assert report["files"][-1].endswith("consolidated.01.pth") and report["mapping"]["reversed"]
    assert [r["keys_in"] for r in report["mapping"]["rules"]][:3] == [1, 2, 2]


def test_a_real_process_maps_and_refuses(tmp_path):
    make_meta(tmp_path / "meta", 4, "3")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPTKIT_DEBUG", None)

    def ckptkit_run(*args):
        return subprocess.run(
            [sys.executable, "-m", "ckptkit", "convert", *map(str, args)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    done = ckptkit_run("meta", "hf", "--map", "llama-meta", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["mapping"]["variables"]["tp"] == 4
    refused = ckptkit_run("meta/consolidated.01.pth", "one.safetensors")
    assert refused.returncode == 1 and refused.stderr.splitlines() == [
        "Error: meta/consolidated.01.pth is one of 4 model-parallel files of a Meta Llama "
        "checkpoint: a slice of every weight, not the model; convert their folder with --map "
        "llama-meta (see docs/mapping.md)"
    ]
    assert sorted(os.listdir(tmp_path)) == ["hf", "meta"]


_WITHOUT_TORCH = """
import sys
from ckptkit.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_a_mapping_that_only_moves_bytes_never_imports_torch(tmp_path):
    """Every llama-meta rule moves bytes (Llama 2's embedding joined by columns, q and k rows
    permuted), both ways: a conversion runs without importing torch, as fast as a copy."""
    make_meta(tmp_path / "meta", 2, "2")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def imported(*args):
        done = subprocess.run(
            [sys.executable, "-c", _WITHOUT_TORCH, "convert", *args, "--map", "llama-meta", "-q"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert imported("meta", "hf") == "[]"
    assert imported("hf", "back", "--reverse", "--set", "tp=2", "--set", "embed_dim=1") == "[]"
    for rank in range(2):
        name = f"consolidated.{rank:02d}.pth"
        original = torch.load(tmp_path / "meta" / name, weights_only=True)
        again = torch.load(tmp_path / "back" / name, weights_only=True)
        assert sorted(again) == sorted(k for k in original if k != "rope.freqs")
        assert all(bit_equal(again[k], original[k]) for k in again)


def test_mapping_refusals_name_the_file_and_the_fix(run, tmp_path):
    make_meta(tmp_path / "meta", 4, "3")
    one_error(
        run("convert", "meta", "x.safetensors"),
        "is a Meta Llama checkpoint in 4",
        "--map llama-meta",
    )
    one_error(
        run("convert", "meta/consolidated.00.pth", "x", "--map", "llama-meta"),
        "is one file",
        "name the folder",
    )
    one_error(run("convert", "meta", "x", "--reverse"), "go with --map")
    one_error(
        run("convert", "meta", "x", "--map", "llama-meta", "--set", "tp"), "is not NAME=VALUE"
    )
    one_error(run("convert", "meta", "x", "--map", "nope"), "no mapping 'nope'")
    one_error(
        run("convert", "meta", "x", "--map", "llama-meta", "--set", "tp=2"),
        "--set tp=2, but the source has 4 rank files",
    )
    ckptkit.convert(tmp_path / "meta", tmp_path / "hf", mapping="llama-meta")
    one_error(
        run("convert", "hf", "back.pth", "--map", "llama-meta", "--reverse"), "give a folder name"
    )
    one_error(
        run("convert", "hf", "back", "--map", "llama-meta", "--reverse", "--set", "tp=3"),
        "does not split into 3 ranks",
    )
    (tmp_path / "meta" / "consolidated.02.pth").unlink()
    one_error(
        run("convert", "meta", "y", "--map", "llama-meta"),
        "lacks rank 2's file (consolidated.02.pth)",
    )
    assert sorted(os.listdir(tmp_path)) == ["hf", "meta"]  # nothing written by a refusal


def test_a_meta_file_of_another_model_is_refused_by_its_rule(tmp_path):
    make_meta(tmp_path / "meta", 1, "3")
    state = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)
    state["layers.0.attention.extra.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "meta" / "consolidated.00.pth")
    with pytest.raises(
        MappingError,
        match="no rule of llama-meta .meta -> hf. takes 'layers.0.attention.extra.weight'",
    ):
        ckptkit.convert(tmp_path / "meta", tmp_path / "hf", mapping="llama-meta")
    params = {**PARAMS, "n_heads": 3}
    (tmp_path / "meta" / "params.json").write_text(json.dumps(params))
    state.pop("layers.0.attention.extra.weight")
    torch.save(state, tmp_path / "meta" / "consolidated.00.pth")
    with pytest.raises(MappingError, match="rule 2 .* is not 3 heads of pairs of rows"):
        ckptkit.convert(tmp_path / "meta", tmp_path / "hf", mapping="llama-meta")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(UsageError):
        ckptkit.convert(
            tmp_path / "meta", tmp_path / "hf", mapping="llama-meta", drop_adapters=True
        )
    with pytest.raises(FormatError):
        ckptkit.convert(
            tmp_path / "meta" / "consolidated.00.pth", tmp_path / "hf2", mapping="llama-meta"
        )


def test_inspect_recognises_the_layout_and_names_the_pack(run, tmp_path):
    """A Meta folder inspected without --map is shown through llama-meta (and said so); one
    of its rank files is said to be a slice; keys in Meta's names name the pack; torchtitan's
    DCP names its own; a Hugging Face model names none."""
    make_meta(tmp_path / "meta", 2, "3")
    make_meta(tmp_path / "one", 1, "3")
    shown = run("inspect", "meta")
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0] == (
        "meta is a Meta Llama checkpoint in 2 model-parallel files: shown as --map llama-meta "
        "maps it to Hugging Face"
    )
    assert lines[2].startswith("Mapped   by llama-meta (meta -> hf): 12 of 13 rules ran")
    document = json.loads(run("inspect", "meta", "--json").output)
    assert document["recognised"] == lines[0] and len(document["targets"]) == 21

    def mapping_of(path):
        return json.loads(run("inspect", str(path), "--json").output)["mapping"]

    rank_file = mapping_of("meta/consolidated.01.pth")
    assert rank_file["rank_file"].startswith("one of 2 model-parallel files of a Meta Llama")
    assert (
        "mapping     one of 2 model-parallel files"
        in run("inspect", "meta/consolidated.01.pth").output
    )
    assert mapping_of("one/consolidated.00.pth") == {"packs": ["llama-meta"], "rank_file": None}
    titan = FIXTURE_DIR / "torchtitan" / "torchtitan-llama3"
    assert mapping_of(titan) == {"packs": ["torchtitan-llama3"], "rank_file": None}
    text = run("inspect", str(titan)).output
    assert "which torchtitan-llama3 maps: `ckptkit convert --map torchtitan-llama3`" in text
    assert mapping_of(FIXTURE_DIR / "torchtitan" / "torchtitan-llama3-hf") is None
    assert sorted(os.listdir(tmp_path)) == ["meta", "one"]


def test_inspect_with_a_map_shows_the_plan_and_writes_nothing(run, tmp_path):
    make_meta(tmp_path / "meta", 2, "3")
    result = run(
        "inspect", "meta", "--map", "llama-meta", "--filter", "model.layers.1.self_attn.k*"
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert (
        lines[1]
        == "Mapped   by llama-meta (meta -> hf): 12 of 13 rules ran; every source byte accounted for (58.0 kB)"
    )
    assert lines[-1] == (
        "  model.layers.1.self_attn.k_proj.weight  bfloat16 [16, 32]  <- "
        "layers.1.attention.wk.weight (2 ranks), rule 3"
    )
    document = json.loads(run("inspect", "meta", "--map", "llama-meta", "--json").output)
    assert len(document["targets"]) == 21 and document["documents"] == ["config.json"]
    assert document["accounted_bytes"] == document["source_bytes"]
    assert sorted(os.listdir(tmp_path)) == ["meta"]
    one_error(run("inspect", "meta", "--reverse"), "go with --map")


_PEAK_ABOVE_IMPORTS = """
import sys, threading, time
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)
import torch, ckptkit.convert  # what the conversion imports, measured before it starts
from ckptkit.cli import main
base = anon()
threading.Thread(target=sample, daemon=True).start()
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print(peak[0] - base)
"""


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_memory_holds_a_group_not_the_model(tmp_path, tp):
    """Peak memory above the imports stays within twice the largest conversion set (here the
    embedding, 16 MB, joined from its ranks), for a model more than five times that."""
    params = {
        **PARAMS,
        "dim": 1024,
        "n_layers": 4,
        "n_heads": 16,
        "n_kv_heads": 8,
        "vocab_size": 8192,
        "multiple_of": 256,
    }
    make_meta(tmp_path / "meta", tp, "3", params)
    largest = params["vocab_size"] * params["dim"] * 2
    model = sum(p.stat().st_size for p in (tmp_path / "meta").glob("*.pth"))
    assert model > 5 * largest
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_ABOVE_IMPORTS, "convert", "meta", "hf", "--map", "llama-meta", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) <= 2 * largest, (int(done.stdout) / 1e6, largest / 1e6)


@pytest.mark.parametrize("through_torch", [False, True], ids=["as-bytes", "through-torch"])
def test_each_group_is_made_once_and_what_was_written_is_checked(
    tmp_path, monkeypatch, through_torch
):
    """Each source tensor is read once: a group's tensors are made once (by moving bytes, or
    through torch where --check-roundtrip maps them back), and the output is checked against
    the CRC-32 of the bytes made (a write that went wrong is caught, and nothing is left)."""
    import ckptkit.formats.output.copier as copier
    from ckptkit.errors import VerificationError
    from ckptkit.mapping.source import MappedSource

    make_meta(tmp_path / "meta", 2, "3")
    made = []
    maker = "_run" if through_torch else "_move"
    real_make = getattr(MappedSource, maker)
    monkeypatch.setattr(MappedSource, maker, lambda self, i: made.append(i) or real_make(self, i))
    options = {"mapping": "llama-meta", "check_roundtrip": through_torch}
    report = ckptkit.convert(tmp_path / "meta", tmp_path / "hf", **options)
    # 13 groups are made (q, k, o, down per layer and the norms): the other 8 are byte ranges
    assert len(made) == len(set(made)) == 13
    assert report.through_torch == (13 if through_torch else 0)
    writer = "write_all" if through_torch else "write_all_of"
    real_write = getattr(copier, writer)
    flipped = []

    def flipping(fd, data):  # the first made tensor reaches the disk with one bit flipped
        if not flipped:
            joined = bytearray(b"".join(data) if isinstance(data, list) else bytes(data))
            joined[0] ^= 1
            data = [memoryview(joined)] if isinstance(data, list) else joined
            flipped.append(True)
        real_write(fd, data)

    monkeypatch.setattr(copier, writer, flipping)
    with pytest.raises(VerificationError, match="model.layers.0.self_attn.q_proj.weight"):
        ckptkit.convert(tmp_path / "meta", tmp_path / "bad", **options)
    assert not (tmp_path / "bad").exists()
