"""DeepSpeed ZeRO folders (stages 1, 2 and 3, Lightning's DeepSpeed strategy): the fp32 master
weights rebuilt bit-exact against DeepSpeed's own ``zero_to_fp32``, copied as bytes from the
partitions, and damaged folders refused.

The folders under ``fixtures/deepspeed`` were written by DeepSpeed itself (``make_deepspeed.py``);
beside each, ``<name>.fp32.safetensors`` is what ``get_fp32_state_dict_from_zero_checkpoint``
rebuilt from it. Where DeepSpeed is installed, it is also run here on the same folders.

``zero2_bf16_aligned`` is the one DeepSpeed did not write (it does not install here): laid out
by hand as DeepSpeed lays out ZeRO-1/2 with parameter alignment, so that its partitions carry
alignment padding; its reference is the tensors the maker started from.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import FIXTURE_DIR, bits, load_with_ties
from safetensors import safe_open
from safetensors.torch import load_file, load_model

import ckptkit
from ckptkit.errors import FormatError, SelectError

DS = FIXTURE_DIR / "deepspeed"
RUNS = ["zero1_bf16", "zero2_fp16", "zero2_bf16", "zero3_bf16", "zero3_fp32"]
LIGHTNING = DS / "lightning" / "epoch=0-step=3.ckpt"


def _reference(name: str) -> dict[str, torch.Tensor]:
    """What zero_to_fp32 rebuilt, tied names included (recorded in the file's metadata)."""
    path = DS / f"{name}.fp32.safetensors"
    state = load_file(path)
    with safe_open(str(path), "pt") as f:
        ties = ast.literal_eval(f.metadata()["tied"])
    return state | {alias: state[target] for alias, target in ties.items()}


def _model():
    from make_deepspeed import build_model

    return build_model()


@pytest.mark.parametrize("name", RUNS)
def test_rebuilt_weights_equal_zero_to_fp32_bit_for_bit(name, tmp_path):
    out = tmp_path / "out.safetensors"
    report = ckptkit.convert(DS / name, out)
    assert report.verified and report.copied == report.tensors  # bytes, never through torch
    written = load_with_ties(out)
    reference = _reference(name)
    for key, tensor in reference.items():
        assert bits(written[key]) == bits(tensor), key
    # bf16 ZeRO-1 keeps no fp32 copy of frozen parameters (zero_to_fp32 drops them): the
    # module's copy is taken and said so; nothing else is added.
    extra = set(written) - set(reference)
    assert extra == ({"frozen.weight", "frozen.bias"} if name == "zero1_bf16" else set())
    # And the file loads into the model with safetensors' own loader.
    missing, unexpected = load_model(_model(), out, strict=True)
    assert not missing and not unexpected


@pytest.mark.parametrize("name", RUNS)
def test_equal_to_deepspeed_itself_where_it_is_installed(name):
    zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    theirs = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(DS / name))
    ours = ckptkit.load_state_dict(DS / name)
    for key, tensor in theirs.items():
        assert bits(ours[key]) == bits(tensor), key


def test_inspect_says_the_stage_the_ranks_and_the_dtypes(run):
    summary = ckptkit.summarize(DS / "zero3_bf16")
    info = summary.extras["deepspeed"]
    assert (info["zero_stage"], info["world_size"], info["module_dtype"]) == (3, 2, "bfloat16")
    assert summary.selected == "fp32" and "ZeRO-3 partitions of 2 ranks" in summary.selected_reason
    assert summary.aliases == {"tied.weight": "emb.weight"}
    kinds = {p["name"]: p["kind"] for p in summary.parts}
    assert kinds["global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"].startswith("fp32")
    result = run("inspect", DS / "zero3_bf16")
    assert result.exit_code == 0, result.output
    assert "rebuilt from the ZeRO-3 partitions of 2 ranks" in result.output
    assert "trained in bfloat16" in result.output


def test_select_module_takes_the_training_dtype_copy(tmp_path):
    name = "zero2_fp16"
    out = tmp_path / "module.pt"
    report = ckptkit.convert(DS / name, out, select="module")
    assert report.selected == "module"
    written = torch.load(out, weights_only=True)
    module = torch.load(
        DS / name / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False
    )["module"]
    assert written.keys() == module.keys()
    for key in module:
        assert bits(written[key]) == bits(module[key]), key
    assert written["tied.weight"].data_ptr() == written["emb.weight"].data_ptr()


def test_zero3_module_states_are_placeholders_and_never_written(tmp_path, run):
    with pytest.raises(SelectError, match="placeholders"):
        ckptkit.convert(DS / "zero3_bf16", tmp_path / "x.safetensors", select="module")
    states = DS / "zero3_bf16" / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    kinds = {k: i.kind for k, i in ckptkit.summarize(states).tensors}
    assert kinds["emb.weight"] == "placeholder" and kinds["seen"] == "dense"
    result = run("convert", states, "x.safetensors")
    assert result.exit_code == 1
    assert result.output.startswith("Error: tensor 'emb.weight' in ")
    assert "placeholder" in result.output and "'latest'" in result.output
    assert not (tmp_path / "x.safetensors").exists()
    inspected = run("inspect", states)
    assert "placeholder" in inspected.output


def test_lightning_deepspeed_folder_loads_after_stripping_model(tmp_path, run):
    summary = ckptkit.summarize(LIGHTNING)
    assert summary.common_prefix == "model."
    assert summary.extras["pytorch-lightning_version"] and summary.extras["global_step"] == 3
    result = run("convert", LIGHTNING, "lit.safetensors", "--strip-prefix", "model.")
    assert result.exit_code == 0, result.output
    reference = _reference("lightning")
    written = load_with_ties(tmp_path / "lit.safetensors")
    assert {k: bits(v) for k, v in written.items()} == {
        k.removeprefix("model."): bits(v) for k, v in reference.items()
    }
    report = ckptkit.load_into(_model(), LIGHTNING)
    assert report.loaded == len(_model().state_dict())


@pytest.fixture
def folder(tmp_path):
    copy = tmp_path / "zero3"
    shutil.copytree(DS / "zero3_bf16", copy)
    return copy


def test_a_missing_rank_is_named_and_nothing_is_written(folder, tmp_path, run):
    (folder / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    result = run("convert", folder, "out.safetensors")
    assert result.exit_code == 1
    assert "optimizer states of ranks [0] but the run had 2" in result.output
    assert list(tmp_path.glob("out*")) == []


def test_a_truncated_partition_is_refused(folder, tmp_path):
    optim = folder / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:-2000])
    with pytest.raises(FormatError):
        ckptkit.convert(folder, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_latest_naming_a_missing_tag_is_refused(folder, tmp_path):
    (folder / "latest").write_text("global_step9")
    with pytest.raises(FormatError, match="latest tag 'global_step9' is missing"):
        ckptkit.summarize(folder)
    (folder / "latest").write_text("../../etc")
    with pytest.raises(FormatError, match="names no tag folder"):
        ckptkit.summarize(folder)


def test_the_tag_folder_itself_is_read_too(tmp_path):
    whole = ckptkit.load_state_dict(DS / "zero2_bf16")
    tag = ckptkit.load_state_dict(DS / "zero2_bf16" / "global_step3")
    assert {k: bits(v) for k, v in whole.items()} == {k: bits(v) for k, v in tag.items()}


ALIGNED = "zero2_bf16_aligned"  # laid out by hand: DeepSpeed does not install here


def _optim_states(path: Path) -> dict:
    """An optimizer-states file as torch's own full unpickler reads it, DeepSpeed's classes
    (absent here) read as plain records of what they were built from."""
    import pickle
    import types

    class Record:
        def __init__(self, *args):
            self.args = args

        def __setstate__(self, state):
            self.__dict__.update(state)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("deepspeed."):
                return type(name, (Record,), {})
            return super().find_class(module, name)

    module = types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="pickle")
    return torch.load(path, weights_only=False, pickle_module=module)["optimizer_state_dict"]


def test_zero12_alignment_padding_is_skipped_bit_for_bit(tmp_path):
    """ZeRO-1/2 with parameter alignment: padding after parameters inside the partitions, and
    tail padding left out of the saved ones. The rebuilt fp32 weights are the tensors the
    folder was made from (make_deepspeed.aligned_originals), bit for bit."""
    from make_deepspeed import aligned_model, aligned_originals

    originals = aligned_originals()
    tag = DS / ALIGNED / "global_step3"
    ranks = [
        _optim_states(tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in (0, 1)
    ]
    # What makes this folder worth having: padding between parameters and at a group's end.
    assert ranks[0]["param_alignment_paddings"] == [[1, 3, 0], [1, 1, 1, 0]]
    assert [r["group_paddings"] for r in ranks] == [[0, 0], [1, 3]]
    # ...which is there in the partitions: the fp32 elements after emb.weight are padding.
    emb = originals["emb.weight"].reshape(-1)
    first = ranks[0]["single_partition_of_fp32_groups"][0]
    assert bits(first[: emb.numel()]) == bits(emb) and first[emb.numel()] == 0
    # The committed reference is what the maker starts from.
    reference = load_file(DS / f"{ALIGNED}.fp32.safetensors")
    assert {k: bits(v) for k, v in reference.items()} == {k: bits(v) for k, v in originals.items()}

    out = tmp_path / "out.safetensors"
    report = ckptkit.convert(DS / ALIGNED, out)
    assert report.verified and report.selected == "fp32"
    written = load_file(out)
    assert {k: bits(v) for k, v in written.items()} == {k: bits(v) for k, v in originals.items()}
    missing, unexpected = load_model(aligned_model(), out, strict=True)
    assert not missing and not unexpected
    # The module's bf16 copy (views of the padded bf16 buffer) is the originals cast by torch.
    module = ckptkit.load_state_dict(DS / ALIGNED, select="module")
    buffers = ("scale", "seen")  # kept as they are
    expected = {k: v if k in buffers else v.to(torch.bfloat16) for k, v in originals.items()}
    assert {k: bits(v) for k, v in module.items()} == {k: bits(v) for k, v in expected.items()}


def test_zero12_tail_padding_saved_in_the_partitions_is_tolerated(tmp_path):
    """Older DeepSpeed saved whole partitions, tail padding included: the partitions then hold
    more elements than the parameters use (fewer than 2 * world more), as zero_to_fp32 allows."""
    from make_deepspeed import aligned_originals, write_aligned

    write_aligned(tmp_path / "old", strip_tail=False)
    written = ckptkit.load_state_dict(tmp_path / "old")
    assert {k: bits(v) for k, v in written.items()} == {
        k: bits(v) for k, v in aligned_originals().items()
    }


def test_zero12_partitions_that_do_not_fit_the_parameters_are_refused(tmp_path):
    """Model states of another run (a larger head) beside these partitions: refused, not
    rebuilt from the wrong elements."""
    from make_deepspeed import write_aligned

    write_aligned(tmp_path / "mixed")
    states = tmp_path / "mixed" / "global_step3" / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=True)
    saved["param_shapes"][0]["head.weight"] = torch.Size([5, 8])
    torch.save(saved, states)
    with pytest.raises(FormatError, match="inconsistent: group 0 holds 99 elements"):
        ckptkit.convert(tmp_path / "mixed", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_fixtures_hold_no_deepspeed_script():
    """make_deepspeed.py removes the zero_to_fp32.py DeepSpeed copies into every folder."""
    assert not list(DS.rglob("*.py"))


def test_scan_of_a_folder_scans_every_file_a_loader_reads(run):
    result = run("scan", "--json", DS / "zero3_bf16")
    doc = json.loads(result.output)
    names = sorted(Path(f["path"]).name for f in doc["files"])
    assert names == sorted(p.name for p in (DS / "zero3_bf16" / "global_step3").iterdir())
    verdicts = {Path(f["path"]).name: f["verdict"] for f in doc["files"]}
    assert verdicts["zero_pp_rank_0_mp_rank_00_model_states.pt"] == "safe"
    # DeepSpeed's own classes are not torch's: reported as they are, read as data by convert.
    assert verdicts["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"] == "unknown"
    assert doc["verdict"] == "unknown" and result.exit_code == 1
