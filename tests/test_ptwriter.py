"""A training checkpoint's .pt written by ckptkit (storages first, the weights hashed as they go
out, the pickle last): torch.load reads it, ties and views survive, the digest is the one
weights_sha256 computes over the weights in a second pass."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import ckptkit
from ckptkit.engine import TrainConfig, train
from ckptkit.engine.checkpoint import weights_sha256
from ckptkit.engine.ptwriter import write_payload
from ckptkit.meta import CheckpointMeta


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
        "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}},
                      "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.99)}]},
        "rng": [{"torch": torch.get_rng_state(), "python": (3, tuple(range(5)), None)}],
        "ckptkit": {"weights_sha256": None},
        "epoch": 2,
    }  # fmt: skip
    path = tmp_path / "ckpt.pt"
    digest = write_payload(path, payload, weights="model", meta="ckptkit",
                           digest_key="weights_sha256")  # fmt: skip
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
        write_payload(tmp_path / "x.pt", {"model": {"w": torch.empty(2, device="meta")},
                                          "ckptkit": {}}, weights="model", meta="ckptkit",
                      digest_key="d")  # fmt: skip


@pytest.mark.parametrize("fmt", ["both", "safetensors"])
def test_every_format_carries_the_weights_digest(tmp_path, fmt):
    result = train(TrainConfig(out=str(tmp_path / fmt), epochs=1, save_format=fmt, quiet=True))
    stem = tmp_path / fmt / "ckpt-epoch0001"
    with safe_open(str(stem.with_suffix(".safetensors")), "pt") as f:
        header = CheckpointMeta.from_header(f.metadata()).training
        weights = {k: f.get_tensor(k) for k in f.keys()}
    assert header["weights_sha256"] == weights_sha256(weights)
    if fmt == "both":
        pt = torch.load(result.checkpoint, weights_only=True)
        assert pt["ckptkit"]["weights_sha256"] == header["weights_sha256"]


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
