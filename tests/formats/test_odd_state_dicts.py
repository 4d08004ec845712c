"""Odd but real state dicts (issue 11, items 7 and 10): parametrizations, quantized models with
packed parameters, sparse and quantized tensors, complex and float8 dtypes, 0-dim and int64
buffers. Each is written by torch itself, described by ``inspect``, kept by ``.pt`` output and
refused by safetensors output naming the key and the reason; nothing is written as weights that
is not one."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from safetensors.torch import load_file, load_model

import ckptkit
from ckptkit.errors import FormatError


@contextlib.contextmanager
def _made_on_purpose():
    """Making these tensors is the point: torch's warnings that CSR support is in beta, that
    quantized tensors and dynamic quantization are deprecated, are about them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        warnings.filterwarnings("ignore", ".*quantized tensor creation functions", UserWarning)
        warnings.filterwarnings("ignore", "torch.ao.quantization is deprecated", DeprecationWarning)
        yield


def _quantized():
    with _made_on_purpose():
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        return torch.ao.quantization.quantize_dynamic(net, {torch.nn.Linear}, dtype=torch.qint8)


class Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        with _made_on_purpose():
            coo = torch.randn(4, 5, generator=g).relu().to_sparse()
            csr = torch.randn(4, 5, generator=g).relu().to_sparse_csr()
            scales, zeros = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 2])
            qt = torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 3, torch.qint8)
            qc = torch.quantize_per_channel(torch.randn(3, 4), scales, zeros, 0, torch.quint8)
        for name, tensor in {"coo": coo, "csr": csr, "qt": qt, "qc": qc}.items():
            self.register_buffer(name, tensor)


def _same(a, b) -> bool:
    from ckptkit.formats.base.tensors import same_value

    return same_value(a, b)


def test_quantized_model_is_described_kept_in_pt_and_loads(tmp_path):
    torch.manual_seed(0)
    model = _quantized()
    torch.save(model.state_dict(), tmp_path / "q.pt")
    kinds = {k: (i.kind, i.detail) for k, i in ckptkit.summarize(tmp_path / "q.pt").tensors}
    assert kinds["0._packed_params._packed_params"] == (
        "packed params",
        "qint8, per_tensor_affine [3, 4], float32 [3]",
    )
    assert kinds["0._packed_params.dtype"] == ("value", "torch.qint8")
    assert kinds["0.scale"] == ("dense", "")
    report = ckptkit.convert(tmp_path / "q.pt", tmp_path / "out.pt")
    assert report.verified
    x = torch.randn(5, 4)
    for loaded in (
        torch.load(tmp_path / "out.pt", weights_only=True),  # torch's own safe loader
        ckptkit.load_state_dict(tmp_path / "q.pt"),
    ):
        fresh = _quantized()
        fresh.load_state_dict(loaded)
        assert torch.equal(fresh(x), model(x))
    fresh = _quantized()
    assert ckptkit.load_into(fresh, tmp_path / "out.pt").loaded == 8
    assert torch.equal(fresh(x), model(x))


def test_renamed_quantized_model_keeps_its_version_records(tmp_path):
    model = _quantized()
    wrapped = torch.nn.Sequential()
    wrapped.add_module("module", model)  # keys "module.0.scale": a DataParallel-style save
    torch.save(wrapped.state_dict(), tmp_path / "dp.pt")
    ckptkit.convert(tmp_path / "dp.pt", tmp_path / "out.pt", strip_module=True)
    fresh = _quantized()
    fresh.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), model(x))


def test_safetensors_output_refuses_them_naming_the_key(tmp_path, run):
    torch.save(_quantized().state_dict(), tmp_path / "q.pt")
    torch.save(Odd().state_dict(), tmp_path / "odd.pt")
    result = run("convert", "q.pt", "q.safetensors")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: '0._packed_params.dtype' in q.pt is ")
    assert (
        "which safetensors cannot store (dense tensors only); write a .pt output" in result.stderr
    )
    result = run("convert", "odd.pt", "odd.safetensors")
    assert result.stderr.startswith("Error: 'coo' in odd.pt is a sparse tensor, which safetensors")
    assert not list(tmp_path.glob("*.safetensors"))


def test_sparse_and_quantized_tensors_are_described_and_kept(tmp_path, run):
    odd = Odd()
    torch.save(odd.state_dict(), tmp_path / "odd.pt")
    info = dict(ckptkit.summarize(tmp_path / "odd.pt").tensors)
    assert (info["coo"].kind, info["coo"].shape, info["coo"].dtype) == ("sparse", (4, 5), "float32")
    assert info["coo"].detail.startswith("COO, ") and info["csr"].detail.startswith("CSR, ")
    assert (info["qt"].kind, info["qt"].detail) == ("quantized", "qint8, per_tensor_affine")
    assert info["qc"].detail == "quint8, per_channel_affine"
    inspected = run("inspect", "--flat", "odd.pt")
    assert "a sparse tensor (COO, " in inspected.output
    report = ckptkit.convert(tmp_path / "odd.pt", tmp_path / "out.pt", dtype="bf16")
    assert report.cast == ["lin.weight", "lin.bias"]  # the special ones keep their dtype
    written = torch.load(tmp_path / "out.pt", weights_only=True)
    for key in ("coo", "csr", "qt", "qc"):
        assert _same(written[key], odd.state_dict()[key]), key


def test_same_value_tells_them_apart():
    with _made_on_purpose():
        a = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
        b = torch.quantize_per_tensor(torch.ones(3), 0.2, 0, torch.qint8)
    assert _same(a, a) and not _same(a, b)
    s = torch.eye(3).to_sparse()
    assert _same(s, torch.eye(3).to_sparse()) and not _same(s, (2 * torch.eye(3)).to_sparse())
    assert not _same((a, None), (a,)) and _same((a, None), (a, None))


def test_parametrizations_and_plain_odd_dtypes_round_trip(tmp_path):
    from torch.nn.utils import parametrizations

    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        parametrizations.weight_norm(net[0])
        net.register_buffer("f8", torch.arange(4.0).to(torch.float8_e4m3fn))
        net.register_buffer("cplx", torch.tensor([1 + 2j, -3j], dtype=torch.complex64))
        net.register_buffer("scalar", torch.tensor(2.5))
        net.register_buffer("steps", torch.tensor([1, 2, 3]))
        return net

    source = model()
    torch.save(source.state_dict(), tmp_path / "p.pt")
    keys = [k for k, _ in ckptkit.summarize(tmp_path / "p.pt").tensors]
    assert "0.parametrizations.weight.original1" in keys
    ckptkit.convert(tmp_path / "p.pt", tmp_path / "p.safetensors")
    target = model()
    for p in target.parameters():
        p.data.zero_()
    missing, unexpected = load_model(target, tmp_path / "p.safetensors")
    assert not missing and not unexpected
    written = load_file(tmp_path / "p.safetensors")
    for key, value in source.state_dict().items():
        assert _same(written[key], value), key


def test_meta_tensors_are_refused_whatever_the_output(tmp_path):
    torch.save({"w": torch.empty(3, device="meta"), "b": torch.ones(2)}, tmp_path / "m.pt")
    assert dict(ckptkit.summarize(tmp_path / "m.pt").tensors)["w"].kind == "meta"
    for out in ("m.safetensors", "m_out.pt"):
        with pytest.raises(FormatError, match="'w' in .* is a meta tensor"):
            ckptkit.convert(tmp_path / "m.pt", tmp_path / out)


def test_trusted_reading_keeps_them_too(tmp_path):
    model = _quantized()
    torch.save(model.state_dict(), tmp_path / "q.pt")
    torch.save(Odd().state_dict(), tmp_path / "odd.pt")
    ckptkit.convert(tmp_path / "q.pt", tmp_path / "q_out.pt", trust=True)
    fresh = _quantized()
    fresh.load_state_dict(torch.load(tmp_path / "q_out.pt", weights_only=True))
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), model(x))
    report = ckptkit.convert(tmp_path / "odd.pt", tmp_path / "odd_out.pt", trust=True)
    assert report.verified
    with pytest.raises(FormatError, match="'coo' in .* is a sparse tensor"):
        ckptkit.convert(tmp_path / "odd.pt", tmp_path / "odd.safetensors", trust=True)


_DTENSOR_SAVE = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(6, 5))
fully_shard(model)
torch.save(model.state_dict(), sys.argv[1])
dist.destroy_process_group()
"""


def test_a_dtensor_shard_is_described_and_refused(tmp_path, run):
    """One rank's torch.save of an FSDP2 model: DTensors, described with their full shape and
    never written as weights (the DTensor globals admitted, so the refusal is the kind's)."""
    import subprocess
    import sys

    path = tmp_path / "rank0.pt"
    done = subprocess.run(
        [sys.executable, "-c", _DTENSOR_SAVE, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    info = dict(ckptkit.summarize(path).tensors)["0.weight"]
    assert (info.kind, info.shape, info.dtype) == ("DTensor", (5, 6), "float32")
    # Unknown here, or safe once torch.distributed.tensor is imported (it registers them).
    names = [n for n in ckptkit.summarize(path).safety.globals() if "distributed" in n]
    assert "torch.distributed.tensor.DTensor" in names
    with pytest.raises(
        FormatError, match=r"rank0.pt is one rank's part of a sharded save \(DTensors\)"
    ):
        ckptkit.convert(path, tmp_path / "out.safetensors", allow_globals=names)
    assert not (tmp_path / "out.safetensors").exists()
