"""Folder layouts at URLs: DeepSpeed checkpoints, every rank's files (a folder or a glob),
Accelerate's save_state and diffusers' folders, uploaded to moto's S3 (and fsspec's memory://)
and read in place, with ranged requests, as their local copies are read; over HTTP, where
nothing is listed, a folder that must be listed is refused in one line naming the fix."""

from __future__ import annotations

import shutil

import fsspec
import pytest
import servers
from helpers import FIXTURE_DIR, one_error
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import FormatError, SelectError, UsageError
from ckptkit.storage.remote import RemotePath

range_server = servers.range_server
s3_server = servers.s3_server
s3 = servers.s3
s3_env = servers.s3_env

DS = FIXTURE_DIR / "deepspeed"
DCP = FIXTURE_DIR / "dcp"
PIPELINE = FIXTURE_DIR / "diffusers" / "pipeline"
ACCELERATE = FIXTURE_DIR / "accelerate_state"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def upload(s3, local, key):
    """A local folder at s3://folders/KEY (the bucket made first); its URL."""
    if not s3.fs.exists("folders"):
        s3.bucket("folders")
    s3.fs.put(str(local) + "/", f"folders/{key}/", recursive=True)
    s3.fs.invalidate_cache()
    return f"s3://folders/{key}"


def same_summary(url, local, **options):
    """The summary of a URL, checked against the local copy's; returned."""
    remote, here = ckptkit.summarize(url, **options), ckptkit.summarize(local, **options)
    got, want = remote.to_dict(), here.to_dict()
    for field in ("format", "tensors", "state_dict", "extras", "aliases", "file_size"):
        assert got[field] == want[field], field
    assert remote.fetched is not None and remote.fetched["requests"] > 0
    return remote


def same_conversion(url, local, tmp_path, **options):
    """convert of a URL: verified, equal to the local copy, and to its local conversion."""
    out, mine = tmp_path / "out.safetensors", tmp_path / "local.safetensors"
    for old in (out, mine):  # a second conversion in one test
        old.unlink(missing_ok=True)
    report = ckptkit.convert(url, out, **options)
    assert report.verified and report.tensors > 0
    ckptkit.convert(local, mine, **options)
    sides = {f"{name}_b": value for name, value in options.items()}  # select_b, variant_b
    assert ckptkit.diff(out, local, **sides).equal
    written, expected = load_file(out), load_file(mine)
    assert written.keys() == expected.keys()
    assert all(written[k].equal(expected[k]) for k in expected)
    return report


# ------------------------------------------------------------------------------- DeepSpeed


@pytest.mark.parametrize(
    "name", ["zero1_bf16", "zero2_fp16", "zero3_bf16", "zero1_bf16/global_step3"]
)
def test_a_deepspeed_folder_at_s3_is_read_as_its_local_copy(name, s3_env, tmp_path):
    url = upload(s3_env, DS / name.split("/")[0], "ds/" + name.split("/")[0])
    url += name.removeprefix(name.split("/")[0])  # the root (latest) or its tag folder
    summary = same_summary(url, DS / name)
    assert summary.format == "deepspeed" and summary.extras["deepspeed"]["world_size"] == 2
    report = same_conversion(url, DS / name, tmp_path)
    assert report.copied == report.tensors  # byte ranges of the partitions, never torch


def test_inspect_of_a_deepspeed_folder_lists_each_folder_once(s3_env):
    """ZeRO-3 at S3: the root listed, latest read, the tag folder listed, and each of its four
    small files read in one request (its size came with the listing); no tensor data beyond
    what those requests bring, no listing twice."""
    url = upload(s3_env, DS / "zero3_bf16", "ds/zero3")
    summary = ckptkit.summarize(url)
    files = sorted((DS / "zero3_bf16" / "global_step3").iterdir())
    assert summary.fetched["requests"] == 3 + len(files)
    assert summary.fetched["bytes"] == sum(p.stat().st_size for p in files) + len("global_step3")


def test_lightnings_deepspeed_folder_named_like_a_file(s3_env, tmp_path):
    """Lightning saves DeepSpeed's folder as epoch=0-step=3.ckpt/: no object by that name,
    so the prefix is listed and read by its layout."""
    local = DS / "lightning" / "epoch=0-step=3.ckpt"
    url = upload(s3_env, local, "ds/lightning/epoch=0-step=3.ckpt")
    assert same_summary(url, local).format == "deepspeed"
    same_conversion(url, local, tmp_path)


def test_deepspeed_module_select_and_a_missing_rank_at_s3(s3_env, tmp_path):
    url = upload(s3_env, DS / "zero2_bf16", "ds/zero2")
    assert same_summary(url, DS / "zero2_bf16", select="module").selected == "module"
    s3_env.fs.rm("folders/ds/zero2/global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(FormatError, match="a rank's .*_optim_states.pt is missing"):
        ckptkit.summarize(url)


# ------------------------------------------------------------------------- every rank's files


@pytest.mark.parametrize("given", ["", "/model_rank*.pt"], ids=["folder", "glob"])
def test_rank_files_at_s3_merge_as_the_local_ones(given, s3_env, tmp_path):
    url = upload(s3_env, DCP / "ranks", "ranks/fsdp2") + given
    local = str(DCP / "ranks") + given
    summary = same_summary(url, local)
    assert summary.format == "rank files" and summary.extras["step"] == 3
    assert summary.fetched["requests"] == 3  # the listing, and each rank's file once
    report = same_conversion(url, local, tmp_path)
    assert report.copied == report.tensors  # row shards: byte ranges
    same_conversion(url, local, tmp_path, select="columns")  # column shards, through torch


def test_one_rank_file_at_s3_alone_names_the_set(s3_env, run):
    url = upload(s3_env, DCP / "ranks", "ranks/one")
    one_error(
        run("convert", url + "/model_rank1.pt", "o.safetensors"),
        "model_rank1.pt is one rank's part of a sharded save (DTensors)",
        f"a glob such as '{url}/model_rank*.pt'",
    )


def test_fsdp1_rank_files_at_memory_urls(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.put(str(DCP / "fsdp1_ranks") + "/", "/remote-folders/fsdp1/", recursive=True)
    try:
        url = "memory://remote-folders/fsdp1"
        assert same_summary(url, DCP / "fsdp1_ranks").format == "rank files"
        same_conversion(url, DCP / "fsdp1_ranks", tmp_path)
        with pytest.raises(FormatError, match="matches no file"):
            ckptkit.summarize(url + "/nothing_rank*.pt")
    finally:
        fs.rm("/remote-folders", recursive=True)


# -------------------------------------------------------------------- Accelerate and diffusers


def test_an_accelerate_folder_at_s3_takes_its_models_by_select(s3_env, tmp_path):
    url = upload(s3_env, ACCELERATE, "acc/state")
    first = same_summary(url, ACCELERATE)
    assert "--select model_1 for another" in first.selected_reason
    # the listing, and each .safetensors header once (checked for DCP's Hugging Face writer,
    # then read: model.safetensors's request is not made twice)
    assert first.fetched["requests"] == 3
    assert (
        "model_1.safetensors of the folder"
        in same_summary(url, ACCELERATE, select="model_1").selected_reason
    )
    same_conversion(url, ACCELERATE, tmp_path, select="model_1")
    with pytest.raises(SelectError, match="holds no model file 'model_7'"):
        ckptkit.summarize(url, select="model_7")


def test_a_diffusers_pipeline_at_s3_gives_its_components(s3_env, tmp_path, run):
    url = upload(s3_env, PIPELINE, "sd/pipe")
    for component in ("unet", "text_encoder", "vae"):
        summary = same_summary(url, PIPELINE, select=component)
        assert f"the '{component}' component" in summary.selected_reason
        # the pipeline's listing, model_index.json, the component's listing, its header: the
        # other components' folders are not listed
        assert summary.fetched["requests"] == 4
    same_conversion(url, PIPELINE, tmp_path, select="unet")
    whole, local = ckptkit.summarize(url), ckptkit.summarize(PIPELINE)  # the component table
    assert whole.format == "diffusers pipeline" and whole.pipeline == local.pipeline
    assert whole.file_size == local.file_size and whole.fetched["requests"] > 0
    shown = run("inspect", url).stdout.splitlines()
    assert "at the URL" in shown[0] and shown[1].startswith("fetched")
    one_error(run("convert", url, "o.safetensors"), "is a diffusers pipeline", "--select unet")
    one_error(run("convert", url, "o.safetensors", "--select", "scheduler"), "holds no weights")


def test_an_ema_models_shadow_params_take_names_from_a_folder_at_s3(s3_env, tmp_path):
    ema = FIXTURE_DIR / "diffusers" / "ema_unet.pt"
    url = upload(s3_env, PIPELINE, "sd/pipe")
    s3_env.fs.put(str(ema), "folders/sd/ema_unet.pt")
    summary = same_summary("s3://folders/sd/ema_unet.pt", ema, names_from=url + "/unet")
    assert summary.ema_model["shadow_params"] == len(summary.tensors)
    named_there = ckptkit.summarize(ema, names_from=url + "/unet")  # the model's folder at S3
    named_here = ckptkit.summarize(ema, names_from=PIPELINE / "unet")
    assert named_there.to_dict()["tensors"] == named_here.to_dict()["tensors"]
    out, mine = tmp_path / "out.safetensors", tmp_path / "local.safetensors"
    report = ckptkit.convert("s3://folders/sd/ema_unet.pt", out, names_from=url + "/unet")
    ckptkit.convert(ema, mine, names_from=PIPELINE / "unet")
    assert report.verified and ckptkit.diff(out, mine).equal
    assert load_file(out).keys() == load_file(PIPELINE / "unet" / WEIGHTS).keys()


def test_a_diffusers_model_folder_at_s3_takes_its_variant(s3_env, tmp_path):
    local = FIXTURE_DIR / "diffusers" / "vae_variants"
    url = upload(s3_env, local, "sd/vae")
    assert "(variant fp16)" in same_summary(url, local, variant="fp16").selected_reason
    same_conversion(url, local, tmp_path, variant="fp16")
    with pytest.raises(SelectError, match="no variant 'int8'"):
        ckptkit.summarize(url, variant="int8")
    with pytest.raises(UsageError, match="is a file"):  # a file still takes no variant
        ckptkit.summarize(url + "/diffusion_pytorch_model.safetensors", variant="fp16")


# ---------------------------------------------------------------------- what a URL cannot do


def test_a_folder_over_http_that_must_be_listed_is_one_line_naming_the_fix(
    tmp_path, range_server, run
):
    shutil.copytree(DS / "zero1_bf16", tmp_path / "ds")
    shutil.copytree(DCP / "ranks", tmp_path / "ranks")
    one_error(run("inspect", range_server.url("ds")), "cannot be listed over HTTP", "s3://")
    one_error(
        run("convert", range_server.base_url + "/ranks/model_rank*.pt", "o.safetensors"),
        "cannot be listed over HTTP",
        "local copy",
    )
    assert not (tmp_path / "o.safetensors").exists()


def test_a_dcp_hugging_face_writer_folder_at_s3_is_read_in_place(s3_env, tmp_path):
    """DCP's Hugging Face writer (no .metadata): each rank's .safetensors header, read with
    ranged requests, gives where its chunks lie, as locally."""
    url = upload(s3_env, DCP / "hf", "dcp/hf")
    summary, local = ckptkit.summarize(url), ckptkit.summarize(DCP / "hf")
    assert summary.format == "dcp" and summary.to_dict()["tensors"] == local.to_dict()["tensors"]
    report = ckptkit.convert(url, tmp_path / "o.safetensors")
    assert report.verified and ckptkit.diff(tmp_path / "o.safetensors", DCP / "hf").equal


def test_a_url_path_learns_a_folder_once_and_forgets_it_when_made_anew(s3_env):
    url = upload(s3_env, DCP / "ranks", "learn/ranks")
    folder = RemotePath(url)
    assert folder.is_dir() and sorted(p.name for p in folder.iterdir()) == [
        "model_rank0.pt",
        "model_rank1.pt",
    ]
    s3_env.fs.pipe("folders/learn/ranks/model_rank2.pt", b"new")
    child = folder / "model_rank2.pt"
    assert not child.exists() and not (folder / "nothing").is_file()  # the listing it made
    assert [p.name for p in folder.glob("*rank1.pt")] == ["model_rank1.pt"]
    assert (folder / "model_rank0.pt").size() == (DCP / "ranks" / "model_rank0.pt").stat().st_size
    assert len(list(RemotePath(url).iterdir())) == 3  # made anew: listed anew
    assert "model_rank2.pt" in (folder.names() or [])  # names() always lists now
