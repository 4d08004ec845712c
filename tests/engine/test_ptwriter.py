"""A training checkpoint's .pt written by ckptkit (storages first, the weights hashed as they go
out, the pickle last): torch.load reads it, ties and views survive, the digest is the one
weights_sha256 computes over the weights in a second pass, and both are the digest as defined,
recomputed here with hashlib alone."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open

import ckptkit
from ckptkit.engine import TrainConfig, train
from ckptkit.engine.checkpoint import weights_sha256
from ckptkit.engine.ptwriter import write_payload
from ckptkit.meta import CheckpointMeta


def independent_digest(state: dict[str, torch.Tensor]) -> str:
    """The weights digest from its definition, with hashlib: for each key in sorted order, the
    UTF-8 text ``key|dtype|[d0, d1]|`` (the dtype as torch names it less ``torch.``, the shape
    as a list), then the tensor's elements in row-major order as their raw bytes."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().cpu()
        dims = ", ".join(str(d) for d in tensor.shape)
        digest.update(f"{key}|{str(tensor.dtype).removeprefix('torch.')}|[{dims}]|".encode())
        flat = tensor.contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()


def test_the_digest_is_the_one_defined(tmp_path):
    """Keys hashed in sorted order whatever the dict's order; views, ties and strided tensors
    by their own elements; every dtype by its bytes."""
    w = torch.randn(4, 3)
    model = {
        "z.last": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "b.weight": w,
        "a.weight": w,  # tied
        "m.view": torch.arange(10)[2:5],
        "m.strided": torch.randn(3, 4).t(),
        "0.scalar": torch.tensor(-0.0),
        "e": torch.zeros(0, 2),
        "bf": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "flags": torch.tensor([True, False]),
        "u16": torch.tensor([1, 65535], dtype=torch.uint16),
        "f8": torch.tensor([0.5, -1.0]).to(torch.float8_e4m3fn),
    }
    expected = independent_digest(model)
    assert expected != independent_digest({**model, "e": torch.zeros(2, 0)})  # shapes count
    assert weights_sha256(model) == expected
    payload = {"model": model, "ckptkit": {"weights_sha256": None}}
    digest = write_payload(
        tmp_path / "ckpt.pt", payload, weights="model", meta="ckptkit", digest_key="weights_sha256"
    )
    assert digest == expected == payload["ckptkit"]["weights_sha256"]
    back = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert back["ckptkit"]["weights_sha256"] == expected == independent_digest(back["model"])


def test_torch_loads_what_is_written_and_the_digest_matches(tmp_path):
    w = torch.randn(4, 3)
    model = {
        "a.weight": w,
        "b.weight": w,  # tied
        "c": torch.arange(10)[2:5],  # a view into a larger storage
        "d": torch.tensor(3.0),  # 0-d
        "e": torch.zeros(0),
        "f": torch.randn(3, 4).t(),  # strided
        "g": torch.ones(2, dtype=torch.bfloat16),
        "h": torch.ones(2, dtype=torch.uint16),  # no typed storage: _rebuild_tensor_v3
    }
    payload = {
        "model": model,
        "optimizer": {
            "state": {0: {"exp_avg": torch.ones(3)}},
            "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.99)}],
        },
        "rng": [{"torch": torch.get_rng_state(), "python": (3, tuple(range(5)), None)}],
        "ckptkit": {"weights_sha256": None},
        "epoch": 2,
    }
    path = tmp_path / "ckpt.pt"
    digest = write_payload(
        path, payload, weights="model", meta="ckptkit", digest_key="weights_sha256"
    )
    assert digest == weights_sha256(model) == payload["ckptkit"]["weights_sha256"]
    for mmap in (False, True):
        back = torch.load(path, weights_only=True, mmap=mmap)
        assert list(back["model"]) == list(model)
        for key, tensor in model.items():
            assert back["model"][key].dtype == tensor.dtype and torch.equal(
                back["model"][key], tensor
            )
        assert back["model"]["a.weight"].data_ptr() == back["model"]["b.weight"].data_ptr()
        assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
        assert back["rng"][0]["python"] == (3, (0, 1, 2, 3, 4), None) and back["epoch"] == 2
        assert back["ckptkit"]["weights_sha256"] == digest
    summary = ckptkit.summarize(path)  # ckptkit's static reader too
    assert summary.selected == "model" and summary.safety.verdict == "safe"


def test_a_tensor_off_the_cpu_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot write a meta"):
        write_payload(
            tmp_path / "x.pt",
            {"model": {"w": torch.empty(2, device="meta")}, "ckptkit": {}},
            weights="model",
            meta="ckptkit",
            digest_key="d",
        )


@pytest.mark.parametrize("fmt", ["both", "safetensors"])
def test_every_format_carries_the_weights_digest(tmp_path, fmt, run):
    result = train(TrainConfig(out=str(tmp_path / fmt), epochs=1, save_format=fmt, quiet=True))
    stem = tmp_path / fmt / "ckpt-epoch0001"
    with safe_open(str(stem.with_suffix(".safetensors")), "pt") as f:
        header = CheckpointMeta.from_header(f.metadata()).training
        weights = {k: f.get_tensor(k) for k in f.keys()}
    digest = independent_digest(weights)
    assert header["weights_sha256"] == digest
    shown = [stem.with_suffix(".safetensors")]
    if fmt == "both":
        pt = torch.load(result.checkpoint, weights_only=True)
        assert list(pt["model"]) != sorted(pt["model"])  # the order hashed is not the dict's
        assert pt["ckptkit"]["weights_sha256"] == digest == independent_digest(pt["model"])
        shown.append(stem.with_suffix(".pt"))
    for path in shown:  # inspect shows it
        inspected = run("inspect", path)
        assert inspected.exit_code == 0, inspected.output
        assert f"weights     sha256 {digest}" in inspected.stdout.splitlines()


def test_staging_copies_each_tensor_once_and_keeps_the_tree():
    """--async-save writes from a staged copy: training may change the originals, a tie stays
    one tensor (one storage in the file), and the tree keeps its containers."""
    from collections import OrderedDict

    from ckptkit.engine.saver import staged

    weight = torch.arange(6.0).reshape(2, 3)
    payload = {"model": OrderedDict(a=weight, b=weight), "step": 3, "pair": (weight, [1.5])}
    copy = staged(payload)
    weight.add_(100)
    assert type(copy["model"]) is OrderedDict
    assert copy["model"]["a"] is copy["model"]["b"] is copy["pair"][0]
    assert torch.equal(copy["model"]["a"], torch.arange(6.0).reshape(2, 3))
    assert copy["step"] == 3 and copy["pair"][1] == [1.5]


def test_staging_copies_into_the_same_memory_at_every_save():
    """A background save's copies are kept: the next save copies into them, not into fresh
    memory, and a state that changed shape gets new ones."""
    from ckptkit.engine.saver import Staging

    staging = Staging()
    weight = torch.zeros(4, 3)
    first = staging.stage({"w": weight, "n": 1})
    weight.add_(2)
    second = staging.stage({"w": weight, "n": 2})
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert torch.equal(second["w"], torch.full((4, 3), 2.0)) and second["n"] == 2
    third = staging.stage({"w": torch.ones(5)})
    assert third["w"].shape == (5,) and torch.equal(third["w"], torch.ones(5))
