"""diffusers' folders held to the hostile-input promises (issue 30): scan covers a pipeline's
components; model_index.json and model configs are read bounded and checked, with one Error
line in every command; --names-from builds nothing past what the weights hold; a broken
diffusers installation is one Error line, and importing it prints nothing and leaves nothing in
TMPDIR; a whole pipeline converts into a pipeline folder that diffusers loads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import warnings

import pytest
import torch
from helpers import FIXTURE_DIR, ROOT, one_error
from safetensors.torch import load_file

import ckptkit

HERE = FIXTURE_DIR / "diffusers"
PIPELINE = HERE / "pipeline"
EMA = HERE / "ema_unet.pt"
MALICIOUS = FIXTURE_DIR / "malicious.pt"
WEIGHTS = "diffusion_pytorch_model.safetensors"
COMPONENTS = ("text_encoder", "unet", "vae")  # the fixture pipeline's components with weights


@pytest.fixture
def pipeline(tmp_path):
    """A copy of the fixture pipeline, to spoil."""
    return shutil.copytree(PIPELINE, tmp_path / "pipeline")


# ---------------------------------------------------------------------------- scan (item 1)


def test_scan_of_a_pipeline_covers_every_components_weights(run):
    result = run("scan", PIPELINE)
    assert result.exit_code == 0, result.output
    for name in COMPONENTS:
        assert f"{name}/" in result.stdout


@pytest.mark.parametrize(
    "where",
    [
        "unet/diffusion_pytorch_model.bin",  # what from_pretrained reads without safetensors
        "unet/diffusion_pytorch_model.fp16.bin",  # a variant
        "vae/diffusion_pytorch_model-00002-of-00002.bin",  # a shard
        "text_encoder/pytorch_model.bin",  # a transformers component
    ],
)
def test_scan_finds_a_pickle_that_runs_code_in_a_pipeline_component(run, pipeline, where):
    shutil.copyfile(MALICIOUS, pipeline / where)
    result = run("scan", pipeline)
    assert result.exit_code == 1, result.output  # scan's code for a file that is not safe
    assert f"{pipeline / where}: dangerous" in result.stdout
    assert "builtins.exec" in result.stdout


def test_scan_of_a_pipeline_at_a_url_covers_its_components(run):
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in PIPELINE.rglob("*"):
        if path.is_file():
            fs.pipe(f"/hostile-pipe/{path.relative_to(PIPELINE).as_posix()}", path.read_bytes())
    fs.pipe("/hostile-pipe/unet/diffusion_pytorch_model.bin", MALICIOUS.read_bytes())
    try:
        result = run("scan", "memory://hostile-pipe", "--json")
    finally:
        fs.rm("/hostile-pipe", recursive=True)
    assert result.exit_code == 1, result.output
    verdicts = {r["path"]: r["verdict"] for r in json.loads(result.stdout)["files"]}
    assert verdicts == {
        "memory://hostile-pipe/text_encoder/model.safetensors": "safe",
        "memory://hostile-pipe/unet/diffusion_pytorch_model.bin": "dangerous",
        "memory://hostile-pipe/unet/diffusion_pytorch_model.safetensors": "safe",
        "memory://hostile-pipe/vae/diffusion_pytorch_model.safetensors": "safe",
    }


# ------------------------------------------------------------- model_index.json (item 3)


def _deep(path):
    path.write_text("[" * 100_000 + "]" * 100_000)


def _huge(path):
    path.write_text('{"_class_name": "StableDiffusionPipeline"' + " " * (2 << 20) + "}")


def _set(**fields):
    def spoil(path):
        index = json.loads(path.read_text())
        index.update(fields)
        path.write_text(json.dumps(index))

    return spoil


SPOILED_INDEX = {
    "deep": (_deep, "nests too many levels"),
    "huge": (_huge, "too large"),
    "a list": (lambda p: p.write_text("[1, 2]"), "not a mapping"),
    "class not a string": (_set(_class_name=["x"] * 3), "'_class_name'"),
    "class huge": (_set(_class_name="x" * 100_000), "'_class_name'"),
    "component odd": (_set(unet=["diffusers", 5]), "'unet'"),
    "component climbs out": (_set(**{"../up": ["diffusers", "UNet2DConditionModel"]}), "../up"),
}
COMMANDS = {
    "inspect": ("inspect", "{p}"),
    "inspect --stats": ("inspect", "--stats", "{p}"),
    "scan": ("scan", "{p}"),
    "convert": ("convert", "{p}", "out"),
    "convert --select": ("convert", "{p}", "out", "--select", "unet"),
    "diff": ("diff", "{p}", "{p}", "--select-a", "unet", "--select-b", "unet"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("spoiled", list(SPOILED_INDEX))
def test_a_spoiled_model_index_is_one_error_line_in_every_command(run, pipeline, spoiled, command):
    spoil, needle = SPOILED_INDEX[spoiled]
    spoil(pipeline / "model_index.json")
    args = [a.format(p=pipeline) for a in COMMANDS[command]]
    line = one_error(run(*args), "model_index.json", needle)
    assert len(line) < 400


# ------------------------------------------------------- --names-from's config (item 2)


@pytest.fixture
def unet_copy(tmp_path):
    return shutil.copytree(PIPELINE / "unet", tmp_path / "unet")


def _config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("layers_per_block", 1200, "1200"),  # 827 MiB and 30 s of modules, before
        ("layers_per_block", -1, "-1"),
        ("layers_per_block", True, "true"),  # a count is a whole number, not a boolean...
        ("layers_per_block", 1.5, "1.5"),  # ... nor a fraction ...
        ("layers_per_block", "2", '"2"'),  # ... nor text (each reached diffusers' own errors)
        ("transformer_layers_per_block", [1, 10**6], "[1, 1000000]"),
        ("norm_eps", float("nan"), "NaN"),
        ("norm_eps", float("inf"), "Infinity"),
        ("sample_size", 10**40, str(10**40)),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "convert", "diff"])
def test_a_names_from_config_out_of_range_is_refused_naming_field_and_value(
    run, unet_copy, field, value, shown, command
):
    _config(unet_copy, **{field: value})
    args = {
        "inspect": ["inspect", EMA, "--names-from", unet_copy],
        "convert": ["convert", EMA, "out.safetensors", "--names-from", unet_copy],
        "diff": ["diff", EMA, EMA, "--names-from-a", unet_copy, "--names-from-b", unet_copy],
    }[command]
    one_error(run(*args), str(unet_copy / "config.json"), f"'{field}'", shown)


def test_a_bad_names_from_config_is_refused_before_diffusers_is_imported():
    code = (
        "import json, shutil, sys, tempfile, pathlib\n"
        "from ckptkit.cli import main\n"
        f"src = pathlib.Path({str(PIPELINE / 'unet')!r})\n"
        "unet = pathlib.Path(tempfile.mkdtemp()) / 'unet'\n"
        "shutil.copytree(src, unet)\n"
        "c = json.loads((unet / 'config.json').read_text()); c['layers_per_block'] = 1200\n"
        "(unet / 'config.json').write_text(json.dumps(c))\n"
        "try:\n"
        f"    main(['inspect', {str(EMA)!r}, '--names-from', str(unet)])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 1, e.code\n"
        "assert 'diffusers' not in sys.modules, 'diffusers imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "'layers_per_block' is 1200" in done.stderr


@pytest.mark.parametrize(
    "content, needle",
    [
        ("[" * 100_000 + "]" * 100_000, "nests too many levels"),
        ("[1, 2]", "not a mapping"),
        ("{" + " " * (2 << 20) + "}", "too large"),
    ],
    ids=["deep", "a list", "huge"],
)
def test_a_spoiled_names_from_config_is_one_error_line(run, unet_copy, content, needle):
    (unet_copy / "config.json").write_text(content)
    one_error(run("inspect", EMA, "--names-from", unet_copy), "config.json", needle)


@pytest.mark.slow  # imports diffusers
def test_a_config_that_builds_more_parameters_than_the_weights_hold_stops_there(run, unet_copy):
    # 100 layers per block is in range, but builds thousands of parameters for a file of 208:
    # construction stops at the 209th instead of building them all.
    _config(unet_copy, layers_per_block=100)
    one_error(
        run("inspect", EMA, "--names-from", unet_copy),
        "builds more than 208 parameters",
        f"{WEIGHTS} holds 208 tensors",
    )


# ------------------------------------------------------ a broken diffusers import (item 4)


class _BrokenDiffusers(types.ModuleType):
    def __getattr__(self, name):
        raise RuntimeError("Failed to import diffusers.models.unets because of a broken wheel")


def test_a_diffusers_import_failing_with_a_runtime_error_is_one_error_line(run, monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", _BrokenDiffusers("diffusers"))
    one_error(
        run("inspect", EMA, "--names-from", PIPELINE / "unet"),
        "importing diffusers",
        "RuntimeError: Failed to import diffusers.models.unets",
        "repair the diffusers installation",
    )


# ------------------------------------------- what importing diffusers prints or leaves (item 5)


@pytest.mark.slow  # a fresh interpreter importing diffusers
def test_the_diffusers_import_prints_nothing_and_leaves_nothing_in_tmpdir(tmp_path):
    unet = shutil.copytree(PIPELINE / "unet", tmp_path / "unet")
    _config(unet, layers_per_block=2)  # in range: built (diffusers imported), then refused
    private = tmp_path / "tmp"
    private.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR")}
    env.update(TMPDIR=str(private), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "ckptkit", "inspect", str(EMA), "--names-from", str(unet)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    assert "builds more than 208 parameters" in lines[0]
    assert list(private.iterdir()) == []


# -------------------------------------------------------- a whole pipeline (item 6)


def _tree(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_a_pipeline_converts_whole_into_a_pipeline_folder(run, tmp_path):
    result = run("convert", PIPELINE, "out", "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    assert _tree(out) == _tree(PIPELINE)  # same names: weights, configs, tokenizer, scheduler
    for name in COMPONENTS:
        weights = next((out / name).glob("*.safetensors"))
        want = load_file(PIPELINE / name / weights.name)
        got = load_file(weights)
        assert got.keys() == want.keys()
        for key, tensor in got.items():
            assert torch.equal(tensor, want[key].to(torch.bfloat16)), key
        assert f"Wrote    out/{name}/{weights.name} (safetensors), verified" in result.stdout
    for name in ("model_index.json", "scheduler/scheduler_config.json", "unet/config.json"):
        assert (out / name).read_bytes() == (PIPELINE / name).read_bytes()


def test_a_pipeline_converts_into_an_existing_folder_and_force_keeps_other_files(run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # an empty folder made with mkdir: filled, no --force needed
    assert run("convert", PIPELINE, out).exit_code == 0
    (out / "important.txt").write_text("mine")
    (out / "unet" / "sub").mkdir()
    (out / "unet" / "sub" / "notes.md").write_text("mine")
    stale = out / "unet" / "diffusion_pytorch_model-00001-of-00002.safetensors"
    stale.write_bytes(b"an earlier run's shard")
    one_error(run("convert", PIPELINE, out), f"{out} exists", "--force")
    result = run("convert", PIPELINE, out, "--force", "--dtype", "fp16")
    assert result.exit_code == 0, result.stderr
    assert (out / "important.txt").read_text() == "mine"
    assert (out / "unet" / "sub" / "notes.md").read_text() == "mine"
    assert not stale.exists()  # a weights file by name, not written this time
    assert {t.dtype for t in load_file(out / "unet" / WEIGHTS).values()} == {torch.float16}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_a_pipeline_variant_is_taken_where_a_component_holds_it(run, pipeline, tmp_path):
    shutil.copyfile(
        HERE / "vae_variants" / "diffusion_pytorch_model.fp16.safetensors",
        pipeline / "vae" / "diffusion_pytorch_model.fp16.safetensors",
    )
    report = ckptkit.convert(pipeline, tmp_path / "out", variant="fp16")
    assert report.verified
    vae = load_file(tmp_path / "out" / "vae" / WEIGHTS)  # the variant, under the plain name
    assert {t.dtype for t in vae.values()} == {torch.float16}
    unet = load_file(tmp_path / "out" / "unet" / WEIGHTS)  # no fp16 there: the default
    assert {t.dtype for t in unet.values()} == {torch.float32}
    one_error(run("convert", PIPELINE, "o", "--variant", "int8"), "variant 'int8'")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--strip-module"], "key and format options"),
        (["--to", "pt"], "key and format options"),
    ],
)
def test_a_pipeline_convert_refuses_what_would_not_load(run, flags, needle, tmp_path):
    one_error(run("convert", PIPELINE, "out", *flags), needle)
    assert not (tmp_path / "out").exists()


def test_a_pipeline_component_that_is_not_a_regular_file_is_left_out_and_named(
    run, pipeline, tmp_path
):
    os.mkfifo(pipeline / "tokenizer" / "vocab.json")  # would block a copy for good
    os.symlink("/etc/hostname", pipeline / "scheduler" / "elsewhere.json")
    os.symlink("/etc/hostname", pipeline / "README.md")
    result = run("convert", pipeline, "out")
    assert result.exit_code == 0, result.stderr
    assert (
        "tokenizer: left out (links, special files, weights and pickles are not copied): vocab.json"
        in result.stdout
    )
    assert (
        "scheduler: left out (links, special files, weights and pickles are not copied): elsewhere.json"
        in result.stdout
    )
    assert "Left out README.md (links, not copied)" in result.stdout
    out = tmp_path / "out"
    assert not [
        p for p in out.rglob("*") if p.name in ("vocab.json", "elsewhere.json", "README.md")
    ]


@pytest.mark.slow  # imports diffusers
def test_a_converted_pipeline_loads_with_diffusion_pipeline_from_pretrained(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from diffusers import DiffusionPipeline

        ckptkit.convert(PIPELINE, tmp_path / "out", dtype="bf16")
        got = DiffusionPipeline.from_pretrained(tmp_path / "out", torch_dtype=torch.bfloat16)
        want = DiffusionPipeline.from_pretrained(PIPELINE)
    assert type(got) is type(want)
    assert type(got.scheduler) is type(want.scheduler)
    assert type(got.tokenizer) is type(want.tokenizer)
    for name in COMPONENTS:
        a, b = getattr(got, name).state_dict(), getattr(want, name).state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key].to(torch.bfloat16)), f"{name}.{key}"


def test_force_over_a_pipeline_writes_through_no_link(run, tmp_path):
    """A component folder of the output that is a link elsewhere: --force neither writes nor
    deletes through it (the folder it leads to keeps its files), and nothing is replaced."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    assert run("convert", PIPELINE, out).exit_code == 0
    shutil.copytree(out / "vae", victim)
    (victim / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"not ckptkit's")
    shutil.rmtree(out / "vae")
    (out / "vae").symlink_to(victim)
    before = {p.name: p.read_bytes() for p in victim.iterdir()}
    index = (out / "model_index.json").stat().st_mtime_ns
    one_error(run("convert", PIPELINE, out, "--force"), f"{out / 'vae'} is a link")
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before
    assert (out / "model_index.json").stat().st_mtime_ns == index  # nothing replaced


def test_a_folder_in_the_way_stops_a_pipeline_before_anything_is_replaced(run, tmp_path):
    out = tmp_path / "out"
    assert run("convert", PIPELINE, out).exit_code == 0
    (out / "vae" / "config.json").unlink()
    (out / "vae" / "config.json").mkdir()
    index = (out / "model_index.json").stat().st_mtime_ns
    one_error(
        run("convert", PIPELINE, out, "--force"), f"{out / 'vae' / 'config.json'} is in the way"
    )
    assert (out / "model_index.json").stat().st_mtime_ns == index


def test_pickles_in_a_pipeline_s_other_folders_are_not_copied(run, pipeline, tmp_path):
    """A scheduler or tokenizer folder holding a pickle (a .ckpt, a .pt) does not carry it
    into the converted pipeline: a model folder's copy leaves weights and pickles behind."""
    malicious = MALICIOUS.read_bytes()
    (pipeline / "scheduler" / "model.ckpt").write_bytes(malicious)
    (pipeline / "tokenizer" / "evil.pt").write_bytes(malicious)
    result = run("convert", pipeline, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "out" / "scheduler" / "model.ckpt").exists()
    assert not (tmp_path / "out" / "tokenizer" / "evil.pt").exists()
    assert "scheduler: left out" in result.stdout and "model.ckpt" in result.stdout
    assert run("scan", tmp_path / "out").exit_code == 0


def test_a_pipeline_is_not_converted_into_itself(run, pipeline):
    one_error(run("convert", pipeline, pipeline / "unet", "--force"), "is inside the pipeline")


def test_a_component_folder_linked_out_of_the_pipeline_is_said(run, pipeline, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(pipeline / "vae", elsewhere)
    (pipeline / "vae").symlink_to(elsewhere)
    result = run("convert", pipeline, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    assert (
        f"vae: read from outside the pipeline: {pipeline / 'vae'} -> {elsewhere}" in result.stdout
    )
