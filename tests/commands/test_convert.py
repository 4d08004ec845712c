"""convert(): every fixture round-trips bit-exact and loads strictly into its model."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from helpers import (
    FIXTURE_DIR,
    FIXTURES,
    NOT_IN_LEGACY,
    load_with_ties,
    reference_model,
    sample_input,
    state_dicts,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, load_model

import ckptkit
from ckptkit.errors import KeyMatchError, KeyTransformError, OutputError, VerificationError
from ckptkit.formats.base.tensors import bit_equal

transfer_module = importlib.import_module("ckptkit.formats.output.copier")
GOOD = [f for f in FIXTURES if not f.bad]


def assert_loads_into_its_model(fx, state=None, safetensors_file=None):
    """Load strictly into a fresh model, with load_state_dict or safetensors' own load_model."""
    model = reference_model(fx.model)
    expected = model(sample_input(model))
    fresh = type(model)() if fx.model != "tiny_bf16" else type(model)(torch.bfloat16)
    if safetensors_file is not None:
        load_model(fresh, safetensors_file, strict=True)
    else:
        fresh.load_state_dict(state, strict=True)
    fresh.eval()
    assert torch.equal(fresh(sample_input(fresh)), expected)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("fx", GOOD, ids=lambda f: f.name)
def test_every_fixture_converts_and_loads_strictly(fx, suffix, tmp_path):
    dst = tmp_path / f"out{suffix}"
    report = ckptkit.convert(
        FIXTURE_DIR / fx.name,
        dst,
        strip_wrappers=True,
        strip_prefixes=fx.strip,
        allow_globals=fx.allow,
    )
    assert report.verified and dst.exists()
    assert report.plan.removed == list(fx.wrappers) + list(fx.strip)
    if suffix == ".safetensors":
        state = load_file(dst)
        # A tied group is stored once, the other names recorded as save_model records them.
        assert set(report.aliases).isdisjoint(state)
        assert safe_open(dst, "pt").metadata().items() >= report.aliases.items()
    else:
        state = torch.load(dst, weights_only=True)
    with ckptkit.open_source(FIXTURE_DIR / fx.name, allow_globals=fx.allow) as source:
        for old, new in report.plan.mapping.items():
            if new is not None and new in state:
                assert bit_equal(state[new], source.load(old)), old
    if suffix == ".safetensors":
        assert_loads_into_its_model(fx, safetensors_file=dst)
    else:
        assert_loads_into_its_model(fx, state)


def test_metadata_keeps_where_it_came_from(tmp_path):
    dst = tmp_path / "m.safetensors"
    ckptkit.convert(FIXTURE_DIR / "training.pt", dst, strip_module=True)
    with safe_open(str(dst), "pt") as f:
        header = f.metadata()
    assert header["format"] == "pt"
    meta = ckptkit.meta.CheckpointMeta.from_header(header)
    assert meta.source == "training.pt" and meta.source_format == "torch-zip"
    assert meta.selected == "model"
    assert meta.removed_prefixes == ["module."]
    assert meta.extras["epoch"] == 3 and meta.extras["args"]["arch"] == "tiny"
    assert meta.dropped["optimizer"]["tensors"] > 0
    # A second conversion keeps the history and the foreign metadata.
    again = tmp_path / "again.safetensors"
    ckptkit.convert(dst, again, add_module=True)
    with ckptkit.open_source(again) as source:
        meta2 = source.meta
    assert meta2.removed_prefixes == ["module."] and meta2.added_prefixes == ["module."]
    assert meta2.extras["epoch"] == 3


def test_foreign_safetensors_metadata_is_kept(tmp_path):
    dst = tmp_path / "m.safetensors"
    ckptkit.convert(FIXTURE_DIR / "single.safetensors", dst)
    with safe_open(str(dst), "pt") as f:
        assert f.metadata()["origin"] == "fixture"


def test_slices_of_one_buffer_are_all_kept(tmp_path):
    dst = tmp_path / "flat.safetensors"
    report = ckptkit.convert(FIXTURE_DIR / "flat_buffer.pt", dst)
    assert report.tensors == 9 and not report.aliases
    assert len(load_file(dst)) == 9


def test_non_contiguous_tensors_are_packed(tmp_path):
    report = ckptkit.convert(FIXTURE_DIR / "transposed.pt", tmp_path / "t.safetensors")
    assert report.made_contiguous == ["body.0.weight"]


def test_add_module_makes_a_checkpoint_for_a_wrapped_model(tmp_path):
    dst = tmp_path / "dp_ready.pt"
    ckptkit.convert(FIXTURE_DIR / "single.pt", dst, add_module=True)
    wrapped = torch.nn.DataParallel(reference_model("tiny"))
    wrapped.load_state_dict(torch.load(dst, weights_only=True), strict=True)


def test_match_to_reference_layout(tmp_path):
    dst = tmp_path / "like_ddp_compiled.safetensors"
    report = ckptkit.convert(FIXTURE_DIR / "dp.pt", dst, match_to=FIXTURE_DIR / "ddp_compiled.pt")
    with ckptkit.open_source(FIXTURE_DIR / "ddp_compiled.pt") as ref:
        assert set(load_file(dst)) == set(ref.keys())
    assert report.match is not None and report.match.exact
    with pytest.raises(KeyMatchError, match="keys do not match .*tied.pt.* missing: embed.weight"):
        ckptkit.convert(
            FIXTURE_DIR / "single.pt", tmp_path / "no.safetensors", match_to=FIXTURE_DIR / "tied.pt"
        )
    assert not (tmp_path / "no.safetensors").exists()


def test_dry_run_writes_nothing(tmp_path):
    dst = tmp_path / "dry.safetensors"
    report = ckptkit.convert(FIXTURE_DIR / "dp.pt", dst, strip_module=True, dry_run=True)
    assert report.dry_run and not dst.exists()
    assert report.plan.mapping["module.head.bias"] == "head.bias"
    assert list(tmp_path.iterdir()) == []


def test_collisions_fail_before_writing(tmp_path):
    src = tmp_path / "clash.pt"
    torch.save({"module.w": torch.ones(1), "w": torch.zeros(1)}, src)
    with pytest.raises(KeyTransformError, match="'module.w' and 'w' -> 'w'"):
        ckptkit.convert(src, tmp_path / "o.safetensors", strip_module=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clash.pt"]


def test_output_rules(tmp_path, fixture_copy):
    src = fixture_copy("single.pt")
    dst = tmp_path / "o.safetensors"
    dst.write_bytes(b"keep me")
    with pytest.raises(OutputError, match="o.safetensors exists; pass force=True to overwrite it"):
        ckptkit.convert(src, dst)
    assert dst.read_bytes() == b"keep me"
    ckptkit.convert(src, dst, force=True)
    assert len(load_file(dst)) == 9
    with pytest.raises(OutputError, match="is the input file"):
        ckptkit.convert(src, src, force=True)
    ckptkit.convert(src, tmp_path / "missing" / "o.pt")  # the folder is made, as train --out's
    assert (tmp_path / "missing" / "o.pt").is_file()


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_output_permissions_follow_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        ckptkit.convert(FIXTURE_DIR / "single.pt", tmp_path / "o.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "o.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    real = transfer_module.copy_range
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(transfer_module, "copy_range", failing)
    with pytest.raises(OutputError, match="no space left on the device writing .*o.safetensors"):
        ckptkit.convert(FIXTURE_DIR / "single.pt", tmp_path / "o.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["o.safetensors", "o.pt"])
def test_verification_catches_a_corrupted_copy(tmp_path, corrupt_head_bias_copy, out):
    with pytest.raises(
        VerificationError, match="'head.bias' read back from .* differs from the source"
    ):
        ckptkit.convert(FIXTURE_DIR / "single.pt", tmp_path / out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["o.safetensors", "o.pt"])
def test_verification_catches_a_corrupted_cast(tmp_path, monkeypatch, out):
    """Tensors made by torch (a cast) are compared with their bytes made again."""
    real = transfer_module.write_all

    def corrupting(fd, data):
        if len(data) == 6:  # head.bias: 3 float16
            data = memoryview(b"\xff" + bytes(data[1:]))
        real(fd, data)

    monkeypatch.setattr(transfer_module, "write_all", corrupting)
    with pytest.raises(
        VerificationError, match="'head.bias' read back from .* differs from the source"
    ):
        ckptkit.convert(FIXTURE_DIR / "single.pt", tmp_path / out, dtype="fp16")
    assert list(tmp_path.iterdir()) == []


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(state=state_dicts(), legacy=st.booleans())
def test_round_trips_are_bit_exact(tmp_path_factory, state, legacy):
    tmp = tmp_path_factory.mktemp("rt")
    src = tmp / "src.pt"
    if legacy and any(t.dtype in NOT_IN_LEGACY for t in state.values()):
        legacy = False  # torch itself cannot read float8 from its legacy format
    torch.save(
        {"module." + k: v for k, v in state.items()}, src, _use_new_zipfile_serialization=not legacy
    )
    ckptkit.convert(src, tmp / "a.safetensors", strip_module=True)
    ckptkit.convert(tmp / "a.safetensors", tmp / "b.pt")
    back = torch.load(tmp / "b.pt", weights_only=True)
    safe = load_with_ties(tmp / "a.safetensors")
    assert list(back) == list(state) or set(back) == set(state)
    for key, tensor in state.items():
        assert bit_equal(safe[key], tensor.contiguous()), key
        assert bit_equal(back[key], tensor.contiguous()), key


class _Bar:
    def __init__(self, total, desc):
        self.total, self.done = total, 0

    def update(self, nbytes):
        self.done += nbytes

    def close(self):
        pass


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_progress_reaches_its_total_through_verification(tmp_path, monkeypatch, suffix, dtype):
    convert_module = importlib.import_module("ckptkit.conversion.write")
    bars = []
    monkeypatch.setattr(
        convert_module,
        "progress_bar",
        lambda total, desc: bars.append(_Bar(total, desc)) or bars[-1],
    )
    ckptkit.convert(
        FIXTURE_DIR / "training.pt", tmp_path / f"o{suffix}", dtype=dtype, progress=True
    )
    (bar,) = bars
    assert bar.total > 0 and bar.done == bar.total


@pytest.mark.parametrize(
    "dtype, change",
    [("float16", "Cast     8 floating-point tensors: "), ("fp16", None)],
)
def test_dtype_takes_torch_s_names_too(tmp_path, run, dtype, change):
    """--dtype float16 is --dtype fp16 (the library took both; the command only fp16)."""
    result = run(
        "convert", FIXTURE_DIR / "single.pt", tmp_path / f"{dtype}.safetensors", "--dtype", dtype
    )
    assert result.exit_code == 0, result.stderr
    assert "Cast     8 floating-point tensors: " in result.output and "saved" in result.output
    if change:
        assert change in result.output


def test_an_upcast_reports_how_much_larger_it_is(tmp_path, run):
    """fp32 from bf16 grows the file: said as such, never as a negative saving."""
    result = run(
        "convert", FIXTURE_DIR / "bf16.pt", tmp_path / "up.safetensors", "--dtype", "float32"
    )
    assert result.exit_code == 0, result.stderr
    cast = [line for line in result.output.splitlines() if line.startswith("Cast")]
    assert len(cast) == 1 and cast[0].endswith("230 B larger"), cast
