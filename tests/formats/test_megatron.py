"""Megatron-LM saves written by megatron-core 0.16.1 itself (fixtures/megatron, made by
fixtures/make_megatron.py: the same model at TP=1, TP=2 and PP=2, resharded by Megatron's own
dist_checkpointing): a legacy save's ranks merge into the TP=1 model bit for bit, without torch;
a torch_dist save reads as DCP; one rank's file, a missing rank, a tracker naming nothing, a
rank whose copy differs and a key no rule knows are refused by name."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import servers
import torch
from helpers import FIXTURE_DIR, ROOT, one_error
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import FormatError
from ckptkit.formats.base.tensors import bit_equal

s3_server, s3, s3_env = servers.s3_server, servers.s3, servers.s3_env
MEGATRON = FIXTURE_DIR / "megatron"
SAVES = ["gqa-swiglu/tp1", "gqa-swiglu/tp2", "gqa-swiglu/pp2", "mha-gelu/tp1", "mha-gelu/tp2"]
# A mixture of experts (fixtures/make_megatron_moe.py): experts shared over expert-parallel
# ranks (mp_rank_TT_EEE), and cut over tensor-parallel ones too.
SAVES += ["moe-swiglu/tp1", "moe-swiglu/ep2", "moe-swiglu/tp2ep2", "moe-swiglu/pp2"]
LAYOUTS = {
    "tp1": (1, 1, 1),
    "tp2": (2, 1, 1),
    "pp2": (1, 2, 1),
    "ep2": (1, 1, 2),
    "tp2ep2": (2, 1, 2),
}


def reference(save: str) -> dict[str, torch.Tensor]:
    """The TP=1 model's state dict, as megatron-core's model.state_dict() gave it."""
    return load_file(MEGATRON / save.split("/")[0] / "reference.safetensors")


@pytest.mark.parametrize("save", SAVES)
def test_a_legacy_save_merges_into_the_tp1_model_bit_for_bit(tmp_path, save):
    report = ckptkit.convert(MEGATRON / save / "legacy", tmp_path / "out.safetensors")
    ours, theirs = load_file(tmp_path / "out.safetensors"), reference(save)
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not bit_equal(ours[k], theirs[k])] == []
    assert report.verified and report.through_torch == 0
    tp, pp, ep = LAYOUTS[save.split("/")[1]]
    experts = f" x {ep} expert" if ep > 1 else ""
    assert report.selected_reason.startswith(
        f"iter_0000010, named by latest_checkpointed_iteration.txt; {tp} tensor x {pp} "
        f"pipeline{experts}-parallel ranks merged; "
    )
    assert "_extra_state entries left out" in report.selected_reason


def test_the_merge_is_checked_and_written_from_views(tmp_path):
    """TP=2's row-parallel weights (linear_proj, linear_fc2) are joined by columns: written from
    views of the two ranks' files; the args travel in the output's metadata."""
    save = MEGATRON / "gqa-swiglu" / "tp2" / "legacy"
    with ckptkit.open_source(save) as source:
        assert source.byte_pieces("decoder.layers.0.self_attention.linear_proj.weight") is None
        laid = source.laid_out("decoder.layers.0.self_attention.linear_proj.weight")
        assert laid is not None and len(laid.spans) == 2  # a column block from each rank
        # SwiGLU: each rank's [gate_r; up_r] joins as [gate; up]: four row ranges
        assert len(source.byte_pieces("decoder.layers.1.mlp.linear_fc1.weight")) == 4
        args = source.extras["args"]
        assert (args["tensor_model_parallel_size"], args["num_query_groups"]) == (2, 2)
    report = ckptkit.convert(save / "iter_0000010", tmp_path / "out.safetensors")
    assert report.selected_reason.startswith("iter_0000010, the iteration folder given")


def test_a_real_process_merges_without_torch(tmp_path):
    code = (
        "import sys; from ckptkit.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    )
    save = MEGATRON / "mha-gelu" / "tp2" / "legacy"
    done = subprocess.run(
        [sys.executable, "-c", code, "convert", str(save), "out.safetensors", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    *document, imported = done.stdout.strip().splitlines()
    assert imported == "False"
    assert json.loads("\n".join(document))["verified"]


@pytest.mark.parametrize("save", SAVES)
def test_a_torch_dist_save_reads_as_one_tensor_per_layer(tmp_path, save):
    """Megatron's torch_dist: DCP with its save plan cached in .metadata (read as data), the
    TP=1 tensors whatever the parallelism, a block's layers stacked on a first dim and read
    one per layer, the norms under TransformerEngine's names; common.pt's args."""
    theirs = reference(save)
    te_names = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    }
    report = ckptkit.convert(MEGATRON / save / "torch_dist", tmp_path / "out.safetensors")
    assert report.verified and report.through_torch == 0
    assert "its layers unstacked; " in report.selected_reason
    ours = load_file(tmp_path / "out.safetensors")
    renamed = {}
    for key, tensor in ours.items():
        layer, _, rest = key.removeprefix("decoder.layers.").partition(".")
        if key.startswith("decoder.layers.") and rest in te_names:
            key = f"decoder.layers.{layer}.{te_names[rest]}"
        renamed[key] = tensor
    assert sorted(renamed) == sorted(theirs)
    assert [k for k in theirs if not bit_equal(renamed[k], theirs[k])] == []
    with ckptkit.open_source(MEGATRON / save / "torch_dist") as source:
        assert source.extras["args"]["num_layers"] == 2 and source.extras["iteration"] == 10


def copy_save(tmp_path, save="gqa-swiglu/tp2"):
    folder = tmp_path / "save"
    shutil.copytree(MEGATRON / save / "legacy", folder)
    return folder


def rank_file(folder, rank="mp_rank_01"):
    return folder / "iter_0000010" / rank / "model_optim_rng.pt"


def resave(path, change):
    """A rank file loaded with torch, changed, and saved again (a hostile copy)."""
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


def test_refusals_name_the_file_and_the_fix(run, tmp_path):
    folder = copy_save(tmp_path)
    one_error(
        run("inspect", folder / "iter_0000010" / "mp_rank_01"),
        "is one rank's folder of a Megatron save (2 rank folders in iter_0000010)",
        "give the save's folder",
    )
    one_error(
        run("convert", rank_file(folder), "x.safetensors"),
        "is one rank's file of a Megatron save (2 rank folders in iter_0000010)",
        "give the save's folder",
    )
    (folder / "latest_checkpointed_iteration.txt").write_text("20")
    one_error(run("inspect", folder), "names iteration 20, but iter_0000020 is not there")
    (folder / "latest_checkpointed_iteration.txt").write_text("ten\n")
    one_error(run("inspect", folder), "says 'ten', not an iteration number")
    (folder / "latest_checkpointed_iteration.txt").write_text("10")
    shutil.rmtree(folder / "iter_0000010" / "mp_rank_01")
    shutil.copytree(
        MEGATRON / "gqa-swiglu/tp2/legacy/iter_0000010/mp_rank_01",
        folder / "iter_0000010" / "mp_rank_02",
    )
    one_error(run("convert", folder, "x.safetensors"), "lacks mp_rank_01", "copy every rank")
    assert sorted(os.listdir(tmp_path)) == ["save"]


def test_a_rank_whose_copy_differs_is_refused(tmp_path):
    folder = copy_save(tmp_path)
    key = "decoder.layers.1.pre_mlp_layernorm.weight"
    resave(rank_file(folder), lambda s: s["model"][key].add_(1.0))
    with pytest.raises(FormatError, match=f"'{key}' differs from rank 0's"):
        ckptkit.open_source(folder)


def test_a_key_no_rule_knows_and_a_wrong_rank_count_are_refused(tmp_path):
    folder = copy_save(tmp_path)
    for rank in ("mp_rank_00", "mp_rank_01"):
        resave(
            rank_file(folder, rank),
            lambda s: s["model"].update({"decoder.layers.0.mlp.odd.weight": torch.ones(2)}),
        )
    with pytest.raises(
        FormatError, match="'decoder.layers.0.mlp.odd.weight' is not a key ckptkit knows"
    ):
        ckptkit.open_source(folder)
    folder = copy_save(tmp_path / "b")
    resave(
        rank_file(folder, "mp_rank_00"),
        lambda s: setattr(s["args"], "tensor_model_parallel_size", 4),
    )
    with pytest.raises(FormatError, match="has 2 tensor-parallel rank folders, but its args say"):
        ckptkit.open_source(folder)


def test_inspect_shows_the_merged_model_and_the_args(run):
    shown = run("inspect", MEGATRON / "gqa-swiglu" / "pp2" / "legacy", "--json")
    assert shown.exit_code == 0, shown.output
    document = json.loads(shown.output)
    assert document["format"] == "megatron" and document["tensor_count"] == 15
    assert document["extras"]["args"]["pipeline_model_parallel_size"] == 2
    assert document["extras"]["iteration"] == 10


def test_pipeline_stages_laid_out_alike_are_not_taken_for_ties(tmp_path):
    """Four stages whose two middle files hold the same keys at the same offsets (every rank
    file is named model_optim_rng.pt): each layer is its own stage's, never another's."""
    pp2 = MEGATRON / "gqa-swiglu" / "pp2" / "legacy" / "iter_0000010"
    first = torch.load(pp2 / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)
    last = torch.load(pp2 / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    middle = {k: v for k, v in last["model"].items() if k.startswith("decoder.layers.")}
    stages = [
        first,
        {**last, "model": dict(middle)},
        {**last, "model": {k: v + 1 for k, v in middle.items() if v is not None}},
        last,
    ]
    for state in (*stages[1:3],):
        for key in [k for k in middle if middle[k] is None]:
            state["model"][key] = None
    folder = tmp_path / "pp4" / "iter_0000010"
    for stage, state in enumerate(stages):
        state = {**state, "args": first["args"]}
        state["args"].pipeline_model_parallel_size, state["args"].num_layers = 4, 4
        (folder / f"mp_rank_00_{stage:03d}").mkdir(parents=True)
        torch.save(state, folder / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt")
    report = ckptkit.convert(folder, tmp_path / "out.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    assert len(out) == 2 + 4 * 6 + 1 and report.verified
    for layer, state in ((1, stages[1]), (2, stages[2])):
        for key, value in state["model"].items():
            if value is not None:
                global_key = key.replace("decoder.layers.0.", f"decoder.layers.{layer}.")
                assert bit_equal(out[global_key], value), global_key


def hostile(tmp_path, change):
    folder = copy_save(tmp_path)
    change(folder / "iter_0000010")
    with pytest.raises(FormatError) as raised:
        ckptkit.open_source(folder)
    return raised.value.message


def test_rank_folders_that_cannot_be_one_save_are_refused(tmp_path):
    """Each rank named once, in one naming, its own file: anything else would join slices
    wrongly and still look whole."""

    def twice(it):
        shutil.copytree(it / "mp_rank_01", it / "mp_rank_001")

    assert "names one rank twice (mp_rank_001 and mp_rank_01)" in hostile(tmp_path / "a", twice)

    def mixed(it):
        shutil.copytree(it / "mp_rank_01", it / "mp_rank_02_000")

    assert "mixes rank folders named with 1 and 2 numbers" in hostile(tmp_path / "b", mixed)

    def linked(it):
        shutil.rmtree(it / "mp_rank_01")
        (it / "mp_rank_01").symlink_to(it / "mp_rank_00")

    assert "is the very file" in hostile(tmp_path / "c", linked)

    def copied(it):
        shutil.rmtree(it / "mp_rank_01")
        shutil.copytree(it / "mp_rank_00", it / "mp_rank_01")

    assert "'embedding.word_embeddings.weight' that tensor-parallel rank 0 holds" in hostile(
        tmp_path / "d", copied
    )

    def stray(it):
        (it / "mp_rank_x").mkdir()

    assert "is not a rank folder's name Megatron writes" in hostile(tmp_path / "e", stray)


def test_rank_files_megatron_would_not_write_are_refused(tmp_path):
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    cases = {
        "uneven": (
            lambda s: s["model"].update({key: s["model"][key][:16]}),
            "differ in size along dim 0",
        ),
        "gap": (
            lambda s: s["model"].update(
                {
                    k.replace("layers.1.", "layers.5."): s["model"].pop(k)
                    for k in [k for k in s["model"] if "layers.1." in k]
                }
            ),
            "numbers its layers [0, 5]",
        ),
        "key": (lambda s: s["model"].update({3: s["model"][key]}), "has a key that is no name"),
        "layers": (
            lambda s: setattr(s["args"], "num_layers", 7),
            "hold 2 layers, but its args say num_layers 7",
        ),
    }
    for name, (change, needle) in cases.items():
        folder = copy_save(tmp_path / name)
        for rank in ("mp_rank_01",) if name == "uneven" else ("mp_rank_00", "mp_rank_01"):
            resave(rank_file(folder, rank), change)
        with pytest.raises(FormatError, match=re.escape(needle)):
            ckptkit.open_source(folder)


def test_a_tracker_is_read_as_a_number_never_whole(tmp_path):
    folder = copy_save(tmp_path)
    with open(folder / "latest_checkpointed_iteration.txt", "wb") as f:
        f.truncate(20 * 1024**3)  # sparse: 20 GB of zeros
    with pytest.raises(FormatError, match="not an iteration number"):
        ckptkit.open_source(folder)
    (folder / "latest_checkpointed_iteration.txt").unlink()
    (folder / "latest_checkpointed_iteration.txt").mkdir()
    with pytest.raises(FormatError, match="latest_checkpointed_iteration.txt is not a file"):
        ckptkit.open_source(folder)


@pytest.mark.parametrize("also", ["decoder.layers.0.x", "decoder.layers."])
def test_a_torch_dist_save_with_a_layer_named_twice_is_refused(tmp_path, also):
    """A stacked tensor and a layer's own of the same name (or a key that names no layer):
    one would overwrite the other."""
    import argparse

    import torch.distributed.checkpoint as dcp
    from helpers import single_process_dcp

    folder = tmp_path / "iter_0000001"
    state = {"decoder.layers.x": torch.ones(2, 3), also: torch.zeros(3)}
    with single_process_dcp():
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    torch.save({"args": argparse.Namespace(num_layers=2), "iteration": 1}, folder / "common.pt")
    with pytest.raises(FormatError, match="both stacked and on its own|named 'decoder.layers.'"):
        ckptkit.open_source(folder)


def test_an_iteration_folder_of_any_name_converts_and_a_run_without_tracker_says_so(tmp_path, run):
    renamed = tmp_path / "mysave"
    shutil.copytree(MEGATRON / "gqa-swiglu" / "tp2" / "legacy" / "iter_0000010", renamed)
    report = ckptkit.convert(renamed, tmp_path / "out.safetensors")
    assert report.selected_reason.startswith("mysave, the iteration folder given")
    one_error(
        run("convert", renamed / "mp_rank_00" / "model_optim_rng.pt", "x.safetensors"),
        f"give the save's folder, {renamed}",
    )
    folder = copy_save(tmp_path / "run")
    (folder / "latest_checkpointed_iteration.txt").unlink()
    one_error(
        run("inspect", folder),
        "holds Megatron iterations (iter_0000010) but no latest_checkpointed_iteration.txt",
        "iter_0000010",
    )


def test_a_merge_spreads_its_shards_over_parts(tmp_path):
    """--part I/N over a Megatron save: each process writes its shards, --finish the index;
    the files are those one process writes."""
    from ckptkit.spread import finish

    save = MEGATRON / "mha-gelu" / "tp2" / "legacy"
    whole = tmp_path / "whole" / "model.safetensors"
    whole.parent.mkdir()
    ckptkit.convert(save, whole, max_shard_size="60kB")
    spread = tmp_path / "spread" / "model.safetensors"
    spread.parent.mkdir()
    for index in range(3):
        ckptkit.convert(save, spread, max_shard_size="60kB", part=f"{index + 1}/3")
    finish(spread)
    shards = sorted(p.name for p in whole.parent.iterdir())
    assert len(shards) > 2 and shards == sorted(p.name for p in spread.parent.iterdir())
    for name in shards:
        assert (whole.parent / name).read_bytes() == (spread.parent / name).read_bytes(), name


@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_a_save_is_read_at_a_url(s3_env, run, tmp_path, kind):
    """A save at s3:// (moto on 127.0.0.1): the tracker, the rank files or common.pt and the
    chunks read by ranged requests, the copies compared there too; the model bit for bit as
    from a local disk, and mapped to Hugging Face."""
    s3_env.bucket("runs")
    local = MEGATRON / "moe-swiglu" / "tp2ep2" / kind
    s3_env.fs.put(str(local) + "/", f"runs/{kind}/", recursive=True)
    s3_env.fs.invalidate_cache()
    result = run("convert", f"s3://runs/{kind}", "remote.safetensors")
    assert result.exit_code == 0, result.output
    assert "named by latest_checkpointed_iteration.txt" in result.output
    here = ckptkit.convert(local, tmp_path / "local.safetensors")
    ours, theirs = load_file(tmp_path / "remote.safetensors"), load_file(here.destination)
    assert sorted(ours) == sorted(theirs) and all(bit_equal(ours[k], theirs[k]) for k in ours)
    mapped = run("convert", f"s3://runs/{kind}", "hf", "--map", "megatron-mixtral")
    assert mapped.exit_code == 0, mapped.output


def test_a_copy_that_differs_is_refused_at_a_url_too(s3_env, run, tmp_path):
    folder = copy_save(tmp_path)
    key = "decoder.layers.1.pre_mlp_layernorm.weight"
    resave(rank_file(folder), lambda s: s["model"][key].add_(1.0))
    s3_env.bucket("runs")
    s3_env.fs.put(str(folder) + "/", "runs/bad/", recursive=True)
    s3_env.fs.invalidate_cache()
    one_error(run("inspect", "s3://runs/bad"), f"'{key}' differs from rank 0's")


def test_pipeline_stages_of_another_order_or_save_are_refused(tmp_path):
    """Stage folders swapped (the embeddings on the last stage), or one stage from another
    iteration's save: never joined into a model."""
    folder = tmp_path / "swapped"
    shutil.copytree(MEGATRON / "gqa-swiglu" / "pp2" / "legacy", folder)
    it = folder / "iter_0000010"
    (it / "mp_rank_00_000").rename(it / "x")
    (it / "mp_rank_00_001").rename(it / "mp_rank_00_000")
    (it / "x").rename(it / "mp_rank_00_001")
    with pytest.raises(FormatError, match="is on pipeline stage 0 of 2, where Megatron never"):
        ckptkit.open_source(folder)
    folder = tmp_path / "mixed"
    shutil.copytree(MEGATRON / "gqa-swiglu" / "pp2" / "legacy", folder)
    resave(
        folder / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt",
        lambda s: s.update(iteration=20),
    )
    with pytest.raises(FormatError, match="is of iteration 20, rank 0's of 10"):
        ckptkit.open_source(folder)


def test_expert_parallel_ranks_that_cannot_be_one_save_are_refused(tmp_path):
    """An expert rank missing, a copy of the rest that differs between expert ranks, experts
    the args do not count, experts cut otherwise than the rest: each refused by name."""

    def case(name, change):
        folder = copy_save(tmp_path / name, "moe-swiglu/tp2ep2")
        change(folder / "iter_0000010")
        with pytest.raises(FormatError) as raised:
            ckptkit.open_source(folder)
        return raised.value.message

    assert "lacks mp_rank_01_001" in case(
        "missing", lambda it: shutil.rmtree(it / "mp_rank_01_001")
    )
    norm = "decoder.layers.1.pre_mlp_layernorm.weight"
    message = case(
        "norm",
        lambda it: resave(it / "mp_rank_00_001" / "model_optim_rng.pt",
                          lambda s: s["model"][norm].add_(1.0)),
    )  # fmt: skip
    assert f"'{norm}' differs from expert rank 0's" in message

    def more_experts(it):
        for file in it.rglob("model_optim_rng.pt"):
            resave(file, lambda s: setattr(s["args"], "num_experts", 8))

    assert "holds experts [0, 1, 2, 3], not 0 to 7 (num_experts 8)" in case("count", more_experts)

    def other_cut(it):
        for file in it.rglob("model_optim_rng.pt"):
            resave(file, lambda s: setattr(s["args"], "expert_tensor_parallel_size", 1))

    assert "its experts are cut over 1 tensor-parallel ranks" in case("etp", other_cut)


def test_a_torch_dist_save_unstacks_its_experts_too(tmp_path):
    """megatron-core's torch_dist stacks a layer's experts under experts.experts.NAME: read as
    one tensor per expert, as a legacy save names them, bit for bit the TP=1 model's."""
    with ckptkit.open_source(MEGATRON / "moe-swiglu" / "tp2ep2" / "torch_dist") as source:
        key = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
        assert source.info(key).shape == (128, 32)
        assert not any(".experts.experts." in k for k in source.keys())
        assert bit_equal(source.load(key), reference("moe-swiglu/tp1")[key])


def test_virtual_pipeline_stages_merge_in_megatrons_layer_order(tmp_path):
    """PP=2 x VPP=2 (megatron-core's own save, fixtures/make_megatron_vpp.py): each rank file
    holds model0 and model1, each numbering its layers from 0; layer l of chunk v on stage p
    is layer v * L / VPP + p * L / (PP * VPP) + l, as get_transformer_layer_offset says."""
    report = ckptkit.convert(MEGATRON / "vpp/pp2vpp2/legacy", tmp_path / "out.safetensors")
    ours, theirs = load_file(tmp_path / "out.safetensors"), reference("vpp/tp1")
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not bit_equal(ours[k], theirs[k])] == []
    assert "1 tensor x 2 pipeline-parallel ranks merged, 2 virtual pipeline stages on each" in (
        report.selected_reason
    )
    folder = copy_save(tmp_path / "bad", "vpp/pp2vpp2")
    for file in folder.rglob("model_optim_rng.pt"):
        resave(file, lambda s: setattr(s["args"], "virtual_pipeline_model_parallel_size", 3))
    with pytest.raises(FormatError, match="holds 2 virtual pipeline stages .* but its args say"):
        ckptkit.open_source(folder)


def test_a_torch_dist_saves_optimizer_state_is_left_out_by_name(tmp_path):
    """A training save's torch_dist folder holds the optimizer's state beside the model
    (optimizer.*): left out and counted, the model read as it is."""
    import torch.distributed.checkpoint as dcp
    from helpers import single_process_dcp

    source = MEGATRON / "gqa-swiglu" / "tp1" / "torch_dist" / "iter_0000010"
    reader = dcp.FileSystemReader(source)
    shapes = {k: m.size for k, m in reader.read_metadata().state_dict_metadata.items()
              if hasattr(m, "size")}  # fmt: skip
    state = {k: torch.empty(size) for k, size in shapes.items()}
    with single_process_dcp():
        dcp.load(state, storage_reader=reader, no_dist=True)
        state["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = torch.ones(32)
        folder = tmp_path / "save" / "iter_0000010"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(source / name, folder / name)
    with ckptkit.open_source(folder) as merged:
        assert "1 tensor of the optimizer left out" in merged.selected_reason
        assert not any(k.startswith("optimizer.") for k in merged.keys())
        assert bit_equal(
            merged.load("decoder.final_layernorm.weight"),
            reference("gqa-swiglu/tp1")["decoder.final_layernorm.weight"],
        )
