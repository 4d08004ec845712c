"""Legacy Megatron saves written by ckptkit (``convert --to megatron --tp T --pp P``): each
rank file holds what megatron-core 0.16.1's own files hold (fixtures/megatron, written by
megatron-core itself), key for key and bit for bit, beside args that say the new sizes; a save
re-cut to another TP and back is the TP=1 model bit for bit; a Hugging Face model goes to rank
files through a pack; what Megatron could not load is refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import servers
import torch
from helpers import FIXTURE_DIR, ROOT, one_error
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.errors import FormatError
from ckptkit.formats.base.tensors import bit_equal

s3_server, s3, s3_env = servers.s3_server, servers.s3, servers.s3_env
MEGATRON = FIXTURE_DIR / "megatron"
VOCAB = 100  # the fixtures' tokenizer vocabulary: rows past it are Megatron's padding


def rank_files(save: Path) -> dict[str, dict]:
    """Each rank folder's torch.load (Megatron-LM's own loader: weights_only=False)."""
    iteration = next(p for p in save.iterdir() if p.is_dir())
    return {
        p.name: torch.load(p / "model_optim_rng.pt", weights_only=False)
        for p in sorted(iteration.iterdir())
    }


def assert_same_model(ours: dict, theirs: dict, *, padding: bool = True, rank: int = 0) -> None:
    """The same keys in the same order (None where megatron-core keeps an extra state), the
    same tensors bit for bit (with ``padding`` False, the vocabulary's padding rows ours are
    zeros, since a Hugging Face model has none to give: those of tensor-parallel ``rank``'s
    slice past the vocabulary)."""
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        if value is None:
            assert ours[key] is None, key
            continue
        mine = ours[key]
        if not padding and key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            real = max(0, VOCAB - rank * len(value))
            assert not mine[real:].any(), key
            mine, value = mine[:real], value[:real]
        assert mine.dtype == value.dtype and bit_equal(mine, value), key


LAYOUTS = [
    ("gqa-swiglu", "tp1", "tp2", ["--tp", "2"]),
    ("gqa-swiglu", "tp2", "pp2", ["--pp", "2"]),
    ("gqa-swiglu", "pp2", "tp1", []),
    ("mha-gelu", "tp1", "tp2", ["--tp", "2"]),
    ("mha-gelu", "tp2", "tp1", []),
    ("moe-swiglu", "tp1", "tp2ep2", ["--tp", "2", "--ep", "2"]),
    ("moe-swiglu", "tp2ep2", "ep2", ["--ep", "2"]),
    ("moe-swiglu", "ep2", "pp2", ["--pp", "2"]),
    ("moe-swiglu", "pp2", "tp1", []),
]


@pytest.mark.parametrize(("shape", "src", "dst", "flags"), LAYOUTS)
@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_rank_files_are_megatron_cores_own(run, tmp_path, shape, src, dst, flags, kind):
    """Any layout (legacy or torch_dist) re-cut to another is, rank file by rank file, what
    megatron-core wrote at that layout: the model's keys in its order, its tensors bit for bit,
    None where its modules keep an extra state; the args say the new sizes."""
    result = run("convert", MEGATRON / shape / src / kind, "out", "--to", "megatron", *flags)
    assert result.exit_code == 0, result.output
    ours, theirs = rank_files(tmp_path / "out"), rank_files(MEGATRON / shape / dst / "legacy")
    assert list(ours) == list(theirs)
    for name, file in theirs.items():
        assert_same_model(ours[name]["model"], file["model"])
        mine, args = ours[name], vars(ours[name]["args"])
        assert (mine["iteration"], mine["checkpoint_version"]) == (10, 3.0)
        assert mine["num_floating_point_operations_so_far"] == 0
        for arg in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "expert_model_parallel_size", "data_parallel_size", "world_size"):  # fmt: skip
            assert args[arg] == vars(file["args"])[arg], arg
        assert args["padded_vocab_size"] == 128 and args["params_dtype"] is torch.float32
    tracker = tmp_path / "out" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text() == "10"
    assert "Wrote    " in result.output and "rank file" in result.output


@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_virtual_stages_are_megatron_cores_own(run, tmp_path, kind):
    """--pp 2 --vpp 2: each rank file holds model0 and model1, megatron-core's own PP=2 x
    VPP=2 files (fixtures/make_megatron_vpp.py) key for key and bit for bit; and back."""
    source = MEGATRON / "vpp" / "tp1" / kind
    result = run("convert", source, "out", "--to", "megatron", "--pp", "2", "--vpp", "2")
    assert result.exit_code == 0, result.output
    assert "2 virtual stages on each" in result.output
    ours, theirs = rank_files(tmp_path / "out"), rank_files(MEGATRON / "vpp/pp2vpp2/legacy")
    assert list(ours) == list(theirs) == ["mp_rank_00_000", "mp_rank_00_001"]
    for name, file in theirs.items():
        assert list(ours[name]) == list(file)  # args, ..., model0, model1, ...
        for chunk in ("model0", "model1"):
            assert_same_model(ours[name][chunk], file[chunk])
        args = vars(ours[name]["args"])
        assert args["virtual_pipeline_model_parallel_size"] == 2
        assert args["num_layers_per_virtual_pipeline_stage"] == 1
    assert run("convert", "out", "back", "--to", "megatron").exit_code == 0
    back, reference = rank_files(tmp_path / "back"), rank_files(MEGATRON / "vpp/tp1/legacy")
    assert_same_model(back["mp_rank_00"]["model"], reference["mp_rank_00"]["model"])
    one_error(
        run("convert", source, "out2", "--to", "megatron", "--vpp", "2"), "add --pp 2 or more"
    )
    one_error(
        run("convert", source, "out3", "--to", "megatron", "--pp", "2", "--vpp", "4"),
        "4 layers do not share evenly over 2 pipeline stages x 4 virtual stages",
    )


def test_tp2_to_tp4_to_tp1_is_the_tp1_model_bit_for_bit(run, tmp_path):
    """TP=4 pads the vocabulary as Megatron-LM does for it (100 to a multiple of 64 x 4) with
    zero rows, and TP=1 cuts them again: the TP=1 files megatron-core wrote, bit for bit."""
    shape = MEGATRON / "mha-gelu"
    assert (
        run("convert", shape / "tp2/legacy", "tp4", "--to", "megatron", "--tp", "4").exit_code == 0
    )
    four = rank_files(tmp_path / "tp4")
    assert list(four) == ["mp_rank_00", "mp_rank_01", "mp_rank_02", "mp_rank_03"]
    assert vars(four["mp_rank_03"]["args"])["padded_vocab_size"] == 256
    assert four["mp_rank_03"]["model"]["embedding.word_embeddings.weight"].shape == (64, 48)
    assert not four["mp_rank_03"]["model"]["embedding.word_embeddings.weight"].any()
    assert run("convert", "tp4", "tp1", "--to", "megatron").exit_code == 0
    ours, theirs = rank_files(tmp_path / "tp1"), rank_files(shape / "tp1/legacy")
    assert_same_model(ours["mp_rank_00"]["model"], theirs["mp_rank_00"]["model"])
    report = ckptkit.convert(tmp_path / "tp4", tmp_path / "merged.safetensors")
    merged, reference = (
        load_file(tmp_path / "merged.safetensors"),
        load_file(shape / "reference.safetensors"),
    )
    assert all(bit_equal(merged[k][: len(reference[k])], reference[k]) for k in reference)
    assert report.through_torch == 0


def test_tied_embeddings_over_stages_keep_the_last_stages_copy(run, tmp_path):
    """With tied embeddings and two stages, the last holds the embedding as output_layer.weight
    (as megatron-core's last stage does); read back, the copy is checked and left out."""
    source = MEGATRON / "mha-gelu" / "tp2" / "legacy"
    assert run("convert", source, "pp", "--to", "megatron", "--tp", "2", "--pp", "2").exit_code == 0
    files = rank_files(tmp_path / "pp")
    last = files["mp_rank_01_001"]["model"]
    first = files["mp_rank_01_000"]["model"]
    assert bit_equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    assert list(last)[-2:] == ["output_layer.weight", "output_layer._extra_state"]
    with ckptkit.open_source(tmp_path / "pp") as merged:
        assert "output_layer.weight" not in merged.keys()
        assert "tied embedding's copy, checked equal and left out" in merged.selected_reason
    state = torch.load(
        tmp_path / "pp/iter_0000010/mp_rank_00_001/model_optim_rng.pt", weights_only=False
    )
    state["model"]["output_layer.weight"][0, 0] += 1.0
    torch.save(state, tmp_path / "pp/iter_0000010/mp_rank_00_001/model_optim_rng.pt")
    with pytest.raises(FormatError, match="output_layer.weight differs from the embedding"):
        ckptkit.open_source(tmp_path / "pp")


def test_written_from_views_without_torch_in_a_real_process(tmp_path):
    code = (
        "import sys; from ckptkit.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    )
    save = MEGATRON / "gqa-swiglu" / "tp2" / "legacy"
    args = ["convert", str(save), "out", "--to", "megatron", "--pp", "2", "--json"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    *document, imported = done.stdout.strip().splitlines()
    report = json.loads("\n".join(document))
    assert imported == "False" and report["through_torch"] == 0
    assert report["output_format"] == "megatron"
    assert report["megatron"] == {
        "tensor_parallel": 1,
        "pipeline_parallel": 2,
        "expert_parallel": 1,
        "virtual_stages": 1,
        "iteration": 10,
        "args_set": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2},
        "beside": [
            "args",
            "checkpoint_version",
            "iteration",
            "num_floating_point_operations_so_far",
        ],
    }
    assert [f.split("/")[-2] for f in report["files"]] == ["mp_rank_00_000", "mp_rank_00_001"]
    # each tensor named by its rank folder in the key plan (a --dry-run's list)
    assert report["keys"][0]["to"] == "mp_rank_00_000/embedding.word_embeddings.weight"
    assert report["keys"][-1]["to"].startswith("mp_rank_00_001/")


@pytest.mark.parametrize("shape", ["gqa-swiglu", "mha-gelu", "moe-swiglu"])
def test_a_hugging_face_model_goes_to_rank_files_through_its_pack(run, tmp_path, shape):
    """HF -> Megatron's names (the pack reversed, its args written) -> TP=2 rank files (and
    EP=2 for the mixture of experts): megatron-core's own files, but for the padding rows
    (zeros: HF has none); read back and mapped forward again, the same HF folder bit for bit."""
    pack = {"gqa-swiglu": "megatron-llama", "mha-gelu": "megatron-gpt2"}.get(shape)
    pack = pack or "megatron-mixtral"
    layout, experts = ("tp2ep2", ["--ep", "2"]) if shape == "moe-swiglu" else ("tp2", [])
    save = MEGATRON / shape / layout / "legacy"
    assert run("convert", save, "hf", "--map", pack).exit_code == 0
    result = run(
        "convert", "hf", "mg", "--map", pack, "--reverse", "--to", "megatron", "--tp", "2",
        *experts, "--set", "divisible=64",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"Mapped   by {pack} (hf -> megatron)" in result.output
    ours, theirs = rank_files(tmp_path / "mg"), rank_files(save)
    assert list(ours) == list(theirs)
    for name, file in theirs.items():
        rank = int(name.split("_")[2])
        assert_same_model(ours[name]["model"], file["model"], padding=False, rank=rank)
        args, given = vars(ours[name]["args"]), vars(file["args"])
        for arg in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "vocab_size", "padded_vocab_size", "swiglu", "normalization",
                    "position_embedding_type", "untie_embeddings_and_output_weights",
                    "add_bias_linear", "tensor_model_parallel_size", "max_position_embeddings"):  # fmt: skip
            assert args[arg] == given[arg], arg
    assert run("convert", "mg", "hf2", "--map", pack).exit_code == 0
    first, again = (
        load_file(tmp_path / "hf/model.safetensors"),
        load_file(tmp_path / "hf2/model.safetensors"),
    )
    assert sorted(first) == sorted(again) and all(bit_equal(first[k], again[k]) for k in first)


def test_refusals_name_the_file_and_the_fix(run, tmp_path):
    gqa = MEGATRON / "gqa-swiglu" / "tp2" / "legacy"
    one_error(
        run("convert", gqa, "out", "--to", "megatron", "--tp", "4"),
        "2 query groups do not share evenly over 4 tensor-parallel ranks",
        "choose a --tp that divides 2",
    )
    one_error(
        run("convert", gqa, "out", "--to", "megatron", "--pp", "3"),
        "2 layers do not share evenly over 3 pipeline stages",
    )
    one_error(
        run("convert", gqa, "out.pt", "--tp", "2"),
        "--tp, --pp, --ep and --vpp",
        "add --to megatron",
    )
    one_error(
        run("convert", gqa, "out", "--to", "megatron", "--ep", "2"),
        "has no experts to share over 2 expert-parallel ranks",
        "leave out --ep",
    )
    one_error(
        run("convert", MEGATRON / "moe-swiglu/ep2/legacy", "out", "--to", "megatron", "--ep", "3"),
        "4 experts do not share evenly over 3 expert-parallel ranks",
    )
    one_error(
        run("convert", gqa, "out.pt", "--to", "megatron"),
        "is a file's name, and a Megatron save is a folder",
    )
    (tmp_path / "there").mkdir()
    one_error(
        run("convert", gqa, "there", "--to", "megatron"), "ckptkit replaces none, even with --force"
    )
    one_error(
        run("convert", gqa, "out", "--to", "megatron", "--max-shard-size", "1MB"),
        "--max-shard-size writes safetensors shards",
    )
    assert run("convert", gqa, "hf", "--map", "megatron-llama").exit_code == 0
    one_error(
        run("convert", "hf/model.safetensors", "out", "--to", "megatron"),
        "'model.embed_tokens.weight'",
        "is not a key of Megatron's GPT model",
    )
    plain = {"decoder.final_layernorm.weight": torch.ones(4)}
    save_file(plain, tmp_path / "plain.safetensors")
    one_error(
        run("convert", "plain.safetensors", "out", "--to", "megatron"),
        "records no Megatron args",
        "--map megatron-llama --reverse",
    )
    one_error(run("convert", gqa, "out", "--to", "megatron", "--tp", "0"), "--tp")
    assert sorted(os.listdir(tmp_path)) == ["hf", "plain.safetensors", "there"]


def test_args_holding_an_object_are_refused_not_copied(tmp_path, run):
    """A save's args holding a callable are refused on reading; admitted with --allow-global
    (read as data), they are still never written into a new checkpoint, which Megatron loads
    with weights_only=False."""
    import shutil

    folder = tmp_path / "save"
    shutil.copytree(MEGATRON / "mha-gelu" / "tp1" / "legacy", folder)
    file = folder / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(file, weights_only=False)
    state["args"].hook = os.getcwd  # a global that is no dtype, enum or plain value
    torch.save(state, file)
    one_error(run("convert", folder, "out", "--to", "megatron"), "posix.getcwd")
    one_error(
        run("convert", folder, "out", "--to", "megatron", "--allow-global", "posix.getcwd"),
        "args.hook holds <global posix.getcwd>",
        "plain values, torch dtypes and megatron-core's enums only",
    )
    assert not (tmp_path / "out").exists()


def test_megatron_lms_enums_in_the_args_are_read_and_written_back(tmp_path, run):
    """Megatron-LM keeps megatron-core enums in its args (model_type, attention_backend): read
    as data without --allow-global, and written back as the same enum, which torch.load gives
    back where megatron-core is importable (a stand-in module of the same name here)."""
    import shutil

    fake = tmp_path / "fake" / "megatron" / "core"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "enums.py").write_text(
        "import enum\nclass ModelType(enum.Enum):\n    encoder_or_decoder = 1\n"
    )
    folder = tmp_path / "save"
    shutil.copytree(MEGATRON / "gqa-swiglu" / "tp2" / "legacy", folder)
    code = (
        "import sys, torch; from megatron.core.enums import ModelType\n"
        "for f in sys.argv[1:]:\n"
        "    s = torch.load(f, weights_only=False); s['args'].model_type = ModelType(1)\n"
        "    torch.save(s, f)\n"
    )
    files = sorted(str(p) for p in folder.rglob("model_optim_rng.pt"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    subprocess.run([sys.executable, "-c", code, *files], check=True, env=env, timeout=120)
    result = run("convert", folder, "out", "--to", "megatron")
    assert result.exit_code == 0, result.output
    check = (
        "import sys, torch; from megatron.core.enums import ModelType\n"
        "s = torch.load(sys.argv[1], weights_only=False)\n"
        "assert s['args'].model_type is ModelType.encoder_or_decoder, s['args'].model_type\n"
        "assert s['args'].params_dtype is torch.float32\n"
    )
    written = tmp_path / "out/iter_0000010/mp_rank_00/model_optim_rng.pt"
    done = subprocess.run(
        [sys.executable, "-c", check, str(written)], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    rows=st.integers(1, 3),
    cols=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
)
def test_every_cut_is_torchs_and_the_merge_undoes_it(tmp_path_factory, tp, rows, cols, dtype):
    """Each rule's cut of a tensor's layout writes the bytes torch's cut gives, and the merge's
    rule joins the ranks' cuts back into the tensor (inverse(op)(op(x)) == x)."""
    from ckptkit.formats.base.layout import Layout
    from ckptkit.formats.folders.megatron_ranks import _Cut, _cut_layout, _cut_tensor

    shape = (2 * tp * rows, tp * cols)
    x = (torch.arange(shape[0] * shape[1]) % 97).reshape(shape).to(dtype)
    data = x.contiguous().view(torch.uint8).numpy().tobytes()
    layout = Layout.of_input(0, shape, x.element_size())
    for rule in ("column", "glu", "row", "same"):
        parts = []
        for rank in range(tp):
            cut = _Cut("w", rule, rank, None)
            made = b"".join(data[o : o + n] for _, o, n in _cut_layout(layout, cut, tp).pieces)
            want = _cut_tensor(x, cut, tp)
            assert made == want.view(torch.uint8).numpy().tobytes(), (rule, rank)
            parts.append(want)
        if rule == "row":
            back = torch.cat(parts, dim=1)
        elif rule == "glu":
            back = torch.cat([p.chunk(2)[0] for p in parts] + [p.chunk(2)[1] for p in parts])
        elif rule == "column":
            back = torch.cat(parts)
        else:
            back = parts[0]
        assert bit_equal(back, x), rule


def test_a_save_goes_to_a_url(s3_env, run, tmp_path):
    """--to megatron at s3:// (moto on 127.0.0.1): the rank files and the tracker uploaded
    under their names, holding what a local output holds, bit for bit."""
    s3_env.bucket("runs")
    save = MEGATRON / "mha-gelu" / "tp2" / "legacy"
    result = run("convert", save, "s3://runs/tp4", "--to", "megatron", "--tp", "4")
    assert result.exit_code == 0, result.output
    assert run("convert", save, "local", "--to", "megatron", "--tp", "4").exit_code == 0
    s3_env.fs.invalidate_cache()
    names = sorted(p.removeprefix("runs/tp4/") for p in s3_env.fs.find("runs/tp4"))
    local = sorted(
        str(p.relative_to(tmp_path / "local"))
        for p in (tmp_path / "local").rglob("*")
        if p.is_file()
    )
    assert names == local and len(names) == 5
    for name in names:  # each archive has its own serialization_id, as torch.save's
        there = tmp_path / "there" / name
        there.parent.mkdir(parents=True, exist_ok=True)
        there.write_bytes(s3_env.fs.cat(f"runs/tp4/{name}"))
        if name.endswith(".txt"):
            assert there.read_text() == (tmp_path / "local" / name).read_text() == "10"
            continue
        ours, local = (
            torch.load(f, weights_only=False) for f in (there, tmp_path / "local" / name)
        )
        assert_same_model(ours["model"], local["model"])
        assert vars(ours["args"]) == vars(local["args"])
    again = run("convert", save, "s3://runs/tp4", "--to", "megatron", "--tp", "4")
    one_error(again, "exists")


def _resaved(tmp_path, save, change):
    """A copy of a fixture save, every rank file changed by ``change(state)``."""
    import shutil

    folder = tmp_path / f"{save.replace('/', '-')}-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(MEGATRON / save / "legacy", folder)
    for file in folder.rglob("model_optim_rng.pt"):
        state = torch.load(file, weights_only=False)
        change(state)
        torch.save(state, file)
    return folder


def test_what_megatron_would_not_load_or_a_hostile_save_is_refused(run, tmp_path):
    """Grouped-GEMM experts, experts cut otherwise than the rest, a padding multiple no run
    uses, args that share one list a billion ways: each one Error: line, in bounded time."""

    def grouped(state):
        model = state["model"]
        for key in [k for k in model if ".local_experts." in k]:
            head, _, rest = key.partition(".local_experts.")
            number, _, tail = rest.partition(".")
            model[f"{head}.{tail}{number}"] = model.pop(key)

    folder = _resaved(tmp_path, "moe-swiglu/ep2", grouped)
    one_error(run("inspect", folder), "is a grouped-GEMM expert weight", "--moe-grouped-gemm")
    folder = _resaved(
        tmp_path, "moe-swiglu/tp1", lambda s: setattr(s["args"], "expert_tensor_parallel_size", 2)
    )
    one_error(run("inspect", folder), "its experts are cut over 2 tensor-parallel ranks")
    folder = _resaved(
        tmp_path,
        "mha-gelu/tp1",
        lambda s: setattr(s["args"], "make_vocab_size_divisible_by", 10**12),
    )
    one_error(run("convert", folder, "out", "--to", "megatron"), "is no padding multiple")

    def shared(state):
        value: list = [1] * 10
        for _ in range(9):
            value = [value] * 10  # 10**9 values, each list pickled once
        state["args"].bomb = value

    folder = _resaved(tmp_path, "mha-gelu/tp1", shared)
    one_error(
        run("convert", folder, "out", "--to", "megatron", "--dry-run"),
        "the args hold more than 100000 values",
    )


def test_a_transformer_engine_mixture_keeps_its_pre_mlp_norm(run, tmp_path):
    """TransformerEngine's layer spec fuses the attention's norm into linear_qkv, but keeps
    pre_mlp_layernorm apart before experts: the names a strict load wants."""
    folder = _resaved(
        tmp_path,
        "moe-swiglu/tp1",
        lambda s: setattr(s["args"], "transformer_impl", "transformer_engine"),
    )
    assert run("convert", folder, "out", "--to", "megatron").exit_code == 0
    model = rank_files(tmp_path / "out")["mp_rank_00"]["model"]
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in model
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in model
    assert not any("linear_fc1.layer_norm" in k for k in model)


def test_a_model_from_elsewhere_is_checked_before_it_is_cut(run, tmp_path):
    """Experts numbered with a gap, an embedding without dims: refused; a folder name with a
    dot in it is a folder."""
    with ckptkit.open_source(MEGATRON / "moe-swiglu/tp1/legacy") as source:
        tensors = {k: source.load(k).clone() for k in source.keys()}
        args = json.dumps(source.extras["args"])
    gap = {k.replace("local_experts.3.", "local_experts.5."): v for k, v in tensors.items()}
    save_file(gap, tmp_path / "gap.safetensors", metadata={"args": args})
    one_error(
        run("convert", "gap.safetensors", "out", "--to", "megatron", "--ep", "2"),
        "do not each hold experts 0 to n - 1",
    )
    flat = dict(tensors, **{"embedding.word_embeddings.weight": torch.tensor(1.0)})
    save_file(flat, tmp_path / "flat.safetensors", metadata={"args": args})
    one_error(run("convert", "flat.safetensors", "out", "--to", "megatron"), "has 0 dims")
    dense = MEGATRON / "mha-gelu/tp2/legacy"
    assert run("convert", dense, "gpt2-v1.5-tp1", "--to", "megatron").exit_code == 0


def test_writing_a_save_spreads_over_parts_and_torchrun(run, tmp_path):
    """--part I/N: each process writes its rank files into the one folder, no tracker; --finish
    reads the save whole (every rank there, of one save) and writes the tracker. Under torchrun
    rank 0 writes it once every rank's files are verified. Both are the one-process save."""
    save = MEGATRON / "mha-gelu" / "tp2" / "legacy"
    flags = ["--to", "megatron", "--tp", "2", "--pp", "2"]
    assert run("convert", save, "whole", *flags).exit_code == 0
    for index in (1, 2, 3):
        result = run("convert", save, "parts", *flags, "--part", f"{index}/3")
        assert result.exit_code == 0, result.output
    assert "`ckptkit convert --finish parts` writes the tracker" in result.output
    assert not (tmp_path / "parts" / "latest_checkpointed_iteration.txt").exists()
    one_error(run("convert", save, "parts", *flags, "--part", "1/3"), "exists", "--force")
    shutil.rmtree(tmp_path / "parts/iter_0000010/mp_rank_01_000")  # part 2/3's
    one_error(run("convert", "--finish", "parts"), "lacks mp_rank_01_000")
    assert run("convert", save, "parts", *flags, "--part", "2/3").exit_code == 0
    assert run("convert", "--finish", "parts").exit_code == 0
    code = (
        f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 -m ckptkit "
        f"convert {save} launched {' '.join(flags)} --quiet"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(code.split(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=180, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    whole = rank_files(tmp_path / "whole")
    for name in ("parts", "launched"):
        assert (tmp_path / name / "latest_checkpointed_iteration.txt").read_text() == "10"
        spread = rank_files(tmp_path / name)
        assert list(spread) == list(whole)
        for rank, file in whole.items():
            assert_same_model(spread[rank]["model"], file["model"])
