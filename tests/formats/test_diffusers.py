"""diffusers' files: model folders by diffusers' names and variants (single, .bin, sharded),
pipeline folders (components listed, one taken with --select), folder outputs keeping diffusers'
names, and EMAModel state dicts named after their model. The fixtures are written by diffusers
itself (fixtures/make_diffusers.py); outputs are loaded back with diffusers' own from_pretrained.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from helpers import FIXTURE_DIR
from safetensors.torch import load_file

import ckptkit
from ckptkit.cli import cli
from ckptkit.errors import FormatError, SelectError, UsageError
from ckptkit.formats.open import open_source

HERE = FIXTURE_DIR / "diffusers"
PIPELINE = HERE / "pipeline"
UNET = PIPELINE / "unet"
EMA = HERE / "ema_unet.pt"
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


def _has_flag(command: str, name: str) -> bool:
    return any(p.name == name for p in cli.commands[command].params)


needs_variant_flag = pytest.mark.skipif(
    not _has_flag("convert", "variant"), reason="the CLI has no --variant yet"
)
needs_names_from_flag = pytest.mark.skipif(
    not _has_flag("convert", "names_from"), reason="the CLI has no --names-from yet"
)


def _state(path):
    """A model folder's weights, read without ckptkit: every file's tensors by key."""
    out = {}
    for file in sorted(path.glob("diffusion_pytorch_model*")):
        if file.suffix == ".safetensors":
            out.update(load_file(file))
        elif file.suffix == ".bin":
            out.update(torch.load(file, weights_only=True))
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _one_error_line(result, *needles):
    assert result.exit_code != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------ model folders


@pytest.mark.parametrize(
    "folder, file",
    [
        (UNET, WEIGHTS),
        (HERE / "unet_bin", "diffusion_pytorch_model.bin"),
        (HERE / "unet_ema", WEIGHTS),  # EMAModel.save_pretrained
        (HERE / "vae_bin", "diffusion_pytorch_model.bin"),
        (HERE / "vae_variants", WEIGHTS),  # the file without a variant, by default
        (HERE / "vae_fp16", "diffusion_pytorch_model.fp16.safetensors"),  # the only one
        (HERE / "vae_sharded", INDEX),
    ],
    ids=lambda v: v.name if hasattr(v, "name") else v,
)
def test_a_diffusers_model_folder_is_read_by_its_names(folder, file, run):
    with open_source(folder) as source:
        assert source.path.name == file
        assert file in source.selected_reason
        assert source.folder == folder and source.weights_name == WEIGHTS
        keys = source.keys()
    if file.endswith(".safetensors"):
        assert sorted(keys) == sorted(load_file(folder / file))
    elif file.endswith(".bin"):  # a torch file: in its own order
        assert keys == list(torch.load(folder / file, weights_only=True))
    else:
        assert sorted(keys) == sorted(json.loads((folder / file).read_text())["weight_map"])
    result = run("inspect", folder)
    assert result.exit_code == 0, result.stderr
    assert file in result.stdout


def test_the_variant_is_chosen_and_a_default_needs_no_choice(tmp_path):
    with open_source(HERE / "vae_variants", variant="fp16") as source:
        assert source.path.name == "diffusion_pytorch_model.fp16.safetensors"
        assert {info.dtype for _, info in source.entries()} == {"float16"}
        assert "variant fp16" in source.selected_reason
    with open_source(HERE / "vae_variants") as source:
        assert source.path.name == WEIGHTS
        assert "--variant fp16 for another" in source.selected_reason
    with pytest.raises(SelectError, match="holds no variant 'bf16'; its weights: none") as info:
        open_source(HERE / "vae_variants", variant="bf16")
    assert "fp16 (diffusion_pytorch_model.fp16.safetensors)" in str(info.value)
    # Two variants and none without one: an error listing them.
    two = tmp_path / "two"
    two.mkdir()
    fp16 = HERE / "vae_fp16" / "diffusion_pytorch_model.fp16.safetensors"
    shutil.copy(fp16, two / fp16.name)
    shutil.copy(fp16, two / "diffusion_pytorch_model.ema.safetensors")
    with pytest.raises(SelectError) as info:
        open_source(two)
    assert str(info.value) == (
        f"{two} holds weights in 2 variants and none without one: "
        "ema (diffusion_pytorch_model.ema.safetensors), "
        "fp16 (diffusion_pytorch_model.fp16.safetensors); choose one with variant='ema'"
    )
    with open_source(two, variant="ema") as source:
        assert source.path.name == "diffusion_pytorch_model.ema.safetensors"


def test_a_variant_for_a_file_or_a_folder_without_it_is_refused(fixture_copy):
    with pytest.raises(UsageError, match="is not a folder; drop variant="):
        open_source(HERE / "vae_fp16" / "diffusion_pytorch_model.fp16.safetensors", variant="x")
    with pytest.raises(SelectError, match="holds no variant 'fp16'"):
        open_source(UNET, variant="fp16")


def test_sharded_variants_are_read_through_their_own_index(tmp_path):
    folder = HERE / "vae_sharded"
    with open_source(folder) as plain, open_source(folder, variant="fp16") as half:
        assert plain.path.name == INDEX and plain.format == "sharded"
        assert half.path.name == "diffusion_pytorch_model.safetensors.index.fp16.json"
        assert plain.keys() != [] and sorted(plain.keys()) == sorted(half.keys())
        assert {i.dtype for _, i in half.entries()} == {"float16"}
        assert len(plain.shards) == 5 and len(half.shards) == 2
    # The variant's index named directly is an index too.
    with open_source(folder / "diffusion_pytorch_model.safetensors.index.fp16.json") as source:
        assert source.format == "sharded"
    # A folder output keeps the source's sharding, under diffusers' names without the variant.
    report = ckptkit.convert(folder, tmp_path / "out", variant="fp16")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [
        "config.json",
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
        INDEX,
    ]
    assert report.copied_files == ["config.json"]  # not the other variant's index
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    source_index = json.loads(
        (folder / "diffusion_pytorch_model.safetensors.index.fp16.json").read_text()
    )
    rename = {
        f"diffusion_pytorch_model.fp16-0000{i}-of-00002.safetensors": f"diffusion_pytorch_model-0000{i}-of-00002.safetensors"
        for i in (1, 2)
    }
    assert index["weight_map"] == {k: rename[v] for k, v in source_index["weight_map"].items()}


def test_a_transformers_variant_folder_is_read_too(tmp_path):
    folder = tmp_path / "te"
    folder.mkdir()
    shutil.copy(PIPELINE / "text_encoder" / "model.safetensors", folder / "model.fp16.safetensors")
    shutil.copy(PIPELINE / "text_encoder" / "config.json", folder / "config.json")
    with open_source(folder) as source:
        assert source.path.name == "model.fp16.safetensors" and source.weights_name is None
    report = ckptkit.convert(folder, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert report.verified


def test_a_model_folder_output_keeps_diffusers_names(run, tmp_path):
    result = run("convert", HERE / "unet_bin", "out")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", WEIGHTS]
    _same(load_file(tmp_path / "out" / WEIGHTS), _state(HERE / "unet_bin"))
    # Into an existing folder too, with its config: loadable as a new folder is.
    (tmp_path / "existing").mkdir()
    result = run("convert", UNET, "existing")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "existing").iterdir()) == ["config.json", WEIGHTS]
    # And sharded by --max-shard-size, with diffusers' shard and index names.
    result = run("convert", UNET, "sharded", "--max-shard-size", "20kB")
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert INDEX in names and "config.json" in names
    shards = [n for n in names if n.startswith("diffusion_pytorch_model-0")]
    assert len(shards) > 1 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    got = {}
    for name in shards:
        got.update(load_file(tmp_path / "sharded" / name))
    _same(got, _state(UNET))


# ---------------------------------------------------------------------------- pipelines


def test_a_pipeline_is_refused_without_select_and_names_its_components(run, tmp_path):
    result = run("convert", PIPELINE, "out.safetensors")
    _one_error_line(
        result,
        "is a diffusers pipeline (StableDiffusionPipeline) whose components hold the weights: "
        "text_encoder (CLIPTextModel), unet (UNet2DConditionModel), vae (AutoencoderKL)",
        "take one with --select unet",
    )
    assert list(tmp_path.iterdir()) == []
    for select, needle in (
        ("scheduler", "the 'scheduler' component (DDIMScheduler) of"),
        ("nope", "no component 'nope'"),
    ):
        result = run("convert", PIPELINE, "out.safetensors", "--select", select)
        _one_error_line(result, needle, "--select unet")
        assert list(tmp_path.iterdir()) == []


def test_inspect_lists_a_pipelines_components(run):
    summary = ckptkit.summarize(PIPELINE)
    assert summary.format == "diffusers pipeline" and summary.tensors == []
    pipeline = summary.pipeline
    assert pipeline["class"] == "StableDiffusionPipeline"
    rows = {c["name"]: c for c in pipeline["components"]}
    assert list(rows) == ["scheduler", "text_encoder", "tokenizer", "unet", "vae"]
    assert rows["scheduler"]["weights"] is None and rows["tokenizer"]["weights"] is None
    assert (
        rows["unet"]["class"] == "UNet2DConditionModel" and rows["unet"]["library"] == "diffusers"
    )
    unet = rows["unet"]["weights"]
    assert unet["file"] == WEIGHTS and unet["tensors"] == len(load_file(UNET / WEIGHTS))
    assert unet["verdict"] == "safe" and unet["bytes_by_dtype"] == {"float32": unet["bytes"]}
    assert rows["text_encoder"]["weights"]["file"] == "model.safetensors"
    assert rows["text_encoder"]["library"] == "transformers"
    result = run("inspect", PIPELINE, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["pipeline"] == json.loads(json.dumps(pipeline))
    result = run("inspect", PIPELINE)
    assert result.exit_code == 0, result.stderr
    # One component, with --select.
    selected = ckptkit.summarize(PIPELINE, select="vae")
    assert "the 'vae' component (AutoencoderKL)" in selected.selected_reason
    assert [p["name"] for p in selected.parts] == ["config.json", WEIGHTS]


def test_convert_select_takes_one_component_into_a_folder(run, tmp_path):
    result = run("convert", PIPELINE, "unet", "--select", "unet")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "unet").iterdir()) == ["config.json", WEIGHTS]
    assert (tmp_path / "unet" / "config.json").read_bytes() == (UNET / "config.json").read_bytes()
    _same(load_file(tmp_path / "unet" / WEIGHTS), _state(UNET))
    result = run("convert", PIPELINE, "te", "--select", "text_encoder")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "te").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


# ---------------------------------------------------------------------------- EMAModel


def _shadow():
    return torch.load(EMA, weights_only=True)["shadow_params"]


def test_an_ema_model_state_dict_says_what_it_is(run):
    summary = ckptkit.summarize(EMA)
    count = len(_shadow())
    assert summary.ema_model["shadow_params"] == count and summary.ema_model["names_from"] is None
    assert summary.ema_model["settings"]["optimization_step"] == 2
    assert summary.selected == "shadow_params"
    assert summary.selected_reason == (
        f"a diffusers EMAModel: {count} shadow parameters, no names; "
        "convert --ema --names-from MODEL_FOLDER maps them"
    )
    assert [k for k, _ in summary.tensors] == [str(i) for i in range(count)]
    result = run("inspect", EMA)
    assert result.exit_code == 0, result.stderr
    assert f"a diffusers EMAModel: {count} shadow parameters, no names" in result.stdout
    named = ckptkit.summarize(EMA, names_from=HERE / "unet_bin")
    assert named.tensors[0][0] == "conv_in.weight"
    assert named.ema_model["names_from"] == str(HERE / "unet_bin")


def test_an_ema_model_without_names_is_refused_naming_the_option(run, tmp_path):
    for args in ((), ("--ema",)):
        result = run("convert", EMA, "out.safetensors", *args)
        _one_error_line(
            result,
            f"{EMA} is a diffusers EMAModel state dict: its 208 weights are 'shadow_params', "
            "a list without names",
            "--ema --names-from MODEL_FOLDER",
        )
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(SelectError, match="names_from=MODEL_FOLDER"):
        ckptkit.convert(EMA, tmp_path / "out.safetensors", ema=True)
    with pytest.raises(UsageError, match="holds no EMAModel state dict; drop names_from="):
        ckptkit.convert(UNET, tmp_path / "out.safetensors", names_from=UNET)
    assert list(tmp_path.iterdir()) == []


def test_shadow_params_take_the_names_of_a_torch_saved_model_in_order(tmp_path):
    # A torch file keeps its state dict's order: parameters() order, buffers among them.
    report = ckptkit.convert(
        EMA, tmp_path / "ema.safetensors", ema=True, names_from=HERE / "unet_bin"
    )
    assert report.verified and "named after" in report.selected_reason
    names = list(torch.load(HERE / "unet_bin" / "diffusion_pytorch_model.bin", weights_only=True))
    got = load_file(tmp_path / "ema.safetensors")
    _same(got, dict(zip(names, _shadow(), strict=True)))
    assert ckptkit.load_state_dict(tmp_path / "ema.safetensors").keys() == set(names)


def test_shadow_params_that_do_not_fit_the_model_are_refused(tmp_path):
    # Another model: the counts differ.
    with pytest.raises(
        FormatError, match="holds 208 shadow parameters and .*vae_bin 92 parameters"
    ):
        ckptkit.convert(EMA, tmp_path / "out.safetensors", ema=True, names_from=HERE / "vae_bin")
    # Two shadow parameters swapped: the first that does not fit is named.
    state = torch.load(EMA, weights_only=True)
    shadow = state["shadow_params"]
    shadow[0], shadow[2] = shadow[2], shadow[0]
    torch.save(state, tmp_path / "swapped.pt")
    with pytest.raises(FormatError) as info:
        ckptkit.convert(
            tmp_path / "swapped.pt", tmp_path / "out.safetensors", names_from=HERE / "unet_bin"
        )
    assert str(info.value).startswith(
        f"shadow parameter 0 of {tmp_path / 'swapped.pt'} has shape [16, 4], but parameter 0 of "
        f"{HERE / 'unet_bin'}, 'conv_in.weight', has [4, 2, 3, 3]"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swapped.pt"]


@needs_variant_flag
def test_the_cli_variant_flag(run, tmp_path):
    result = run("convert", HERE / "vae_variants", "out", "--variant", "fp16")
    assert result.exit_code == 0, result.stderr
    assert {t.dtype for t in load_file(tmp_path / "out" / WEIGHTS).values()} == {torch.float16}
    result = run("convert", HERE / "vae_variants", "bad", "--variant", "bf16")
    _one_error_line(result, "holds no variant 'bf16'", "--variant NAME")
    assert not (tmp_path / "bad").exists()


@needs_names_from_flag
def test_the_cli_names_from_flag(run, tmp_path):
    result = run("convert", EMA, "ema.safetensors", "--ema", "--names-from", HERE / "unet_bin")
    assert result.exit_code == 0, result.stderr
    assert next(iter(load_file(tmp_path / "ema.safetensors"))) is not None
    result = run("convert", EMA, "bad.safetensors", "--ema", "--names-from", HERE / "vae_bin")
    _one_error_line(result, "holds 208 shadow parameters")
    assert not (tmp_path / "bad.safetensors").exists()


def test_diff_and_load_take_a_variant_and_names_for_shadow_params(run):
    # fp16 against the fp32 file of one folder: every tensor retyped, equal within fp16's step
    report = ckptkit.diff(HERE / "vae_variants", HERE / "vae_variants", variant_a="fp16")
    assert not report.equal and len(report.retyped) == report.common == 92
    assert ckptkit.diff(
        HERE / "vae_variants", HERE / "vae_variants", atol=1e-2, variant_a="fp16"
    ).equal
    # an EMAModel state dict named after its model equals what EMAModel.save_pretrained wrote
    assert ckptkit.diff(EMA, HERE / "unet_ema", names_from_a=HERE / "unet_bin").equal
    result = run("diff", HERE / "unet_ema", EMA, "--names-from-b", HERE / "unet_bin", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["common"] == 208
    result = run("diff", HERE / "vae_variants", HERE / "vae_fp16", "--variant-a", "fp16", "-q")
    assert result.exit_code in (0, 1), result.stderr  # compared, not refused
    _one_error_line(run("diff", HERE / "unet_ema", EMA), "shadow_params", "--names-from-b MODEL")
    state = ckptkit.load_state_dict(HERE / "vae_variants", variant="fp16")
    assert {t.dtype for t in state.values()} == {torch.float16}
    named = ckptkit.load_state_dict(EMA, names_from=HERE / "unet_bin")
    assert sorted(named) == sorted(_state(HERE / "unet_ema"))


# ------------------------------------------------- loaded back by diffusers (slow: its import)


@pytest.fixture(scope="module")
def diffusers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import diffusers as module
    return module


def _from_pretrained(cls, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(*args, **kwargs)


@pytest.mark.slow
def test_a_component_converted_loads_with_from_pretrained(diffusers, run, tmp_path):
    result = run("convert", PIPELINE, "unet", "--select", "unet", "--dtype", "fp16")
    assert result.exit_code == 0, result.stderr
    assert {t.dtype for t in load_file(tmp_path / "unet" / WEIGHTS).values()} == {torch.float16}
    got = _from_pretrained(
        diffusers.UNet2DConditionModel, tmp_path / "unet", torch_dtype=torch.float16
    )
    want = _from_pretrained(diffusers.UNet2DConditionModel, PIPELINE, subfolder="unet")
    _same(got.state_dict(), {k: v.half() for k, v in want.state_dict().items()})


@pytest.mark.slow
def test_a_sharded_variant_converted_loads_with_from_pretrained(diffusers, tmp_path):
    ckptkit.convert(HERE / "vae_sharded", tmp_path / "vae", variant="fp16")
    got = _from_pretrained(diffusers.AutoencoderKL, tmp_path / "vae", torch_dtype=torch.float16)
    want = _from_pretrained(
        diffusers.AutoencoderKL, HERE / "vae_sharded", variant="fp16", torch_dtype=torch.float16
    )
    _same(got.state_dict(), want.state_dict())


@pytest.mark.slow
def test_an_ema_model_converted_loads_as_the_model_it_averages(diffusers, tmp_path):
    # The model folder is safetensors (keys sorted): the order comes from its class, built on
    # the meta device from config.json.
    report = ckptkit.convert(EMA, tmp_path / "ema_unet", ema=True, names_from=UNET)
    assert report.copied_files == ["config.json"]
    assert sorted(p.name for p in (tmp_path / "ema_unet").iterdir()) == ["config.json", WEIGHTS]
    got = _from_pretrained(diffusers.UNet2DConditionModel, tmp_path / "ema_unet")
    model = _from_pretrained(diffusers.UNet2DConditionModel, UNET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from diffusers.training_utils import EMAModel

        ema = EMAModel(model.parameters())
    ema.load_state_dict(torch.load(EMA, weights_only=True))
    ema.copy_to(model.parameters())  # diffusers' own way to put the averages in the model
    _same(got.state_dict(), model.state_dict())
    # EMAModel.save_pretrained's folder holds the same weights under the same names.
    _same(load_file(tmp_path / "ema_unet" / WEIGHTS), load_file(HERE / "unet_ema" / WEIGHTS))


@pytest.mark.slow
def test_the_fixtures_regenerate_byte_for_byte(tmp_path):
    import make_diffusers

    make_diffusers.build(tmp_path)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    kept = sorted(
        p.relative_to(HERE) for p in HERE.rglob("*") if p.is_file() and p.name != "README.md"
    )
    assert made == kept
    for rel in made:
        assert (tmp_path / rel).read_bytes() == (HERE / rel).read_bytes(), rel
