"""load_state_dict and load_into: any wrapper chain into any other, with precise errors."""

from __future__ import annotations

import pytest
import torch
from helpers import FIXTURE_DIR, FIXTURES, reference_model, sample_input
from safetensors.torch import load_model
from torch import nn

import ckptkit
from ckptkit.errors import KeyMatchError


def test_load_state_dict_strips_on_request():
    raw = ckptkit.load_state_dict(FIXTURE_DIR / "ddp_compiled.pt")
    assert all(k.startswith("module._orig_mod.") for k in raw)
    clean = ckptkit.load_state_dict(FIXTURE_DIR / "ddp_compiled.pt", strip_wrappers=True)
    reference_model("tiny").load_state_dict(clean, strict=True)


def _wrapped(kind):
    model = reference_model("tiny")
    nn.init.zeros_(model.head.weight)  # so a load that did nothing shows
    if kind == "dp":
        return nn.DataParallel(model)
    if kind == "compiled":
        return torch.compile(model)
    if kind == "dp_compiled":
        return nn.DataParallel(torch.compile(model))
    return model


@pytest.mark.parametrize("target", ["plain", "dp", "compiled", "dp_compiled"])
@pytest.mark.parametrize(
    "fx",
    [f for f in FIXTURES if f.model == "tiny" and not f.bad and not f.allow],
    ids=lambda f: f.name,
)
def test_load_into_any_wrapping(fx, target):
    model = _wrapped(target)
    report = ckptkit.load_into(model, FIXTURE_DIR / fx.name)
    assert report.loaded == 9 and report.match.exact
    inner = model
    while not isinstance(inner, type(reference_model("tiny"))):
        inner = inner.module if hasattr(inner, "module") else inner._orig_mod
    expected = reference_model("tiny")
    assert torch.equal(inner(sample_input(inner)), expected(sample_input(expected)))


def test_strict_load_names_what_does_not_fit(tmp_path):
    state = reference_model("tiny").state_dict()
    state["head.weight"] = torch.zeros(5, 8)
    del state["head.bias"]
    state["extra.w"] = torch.zeros(1)
    path = tmp_path / "bad.pt"
    torch.save({"module." + k: v for k, v in state.items()}, path)
    model = reference_model("tiny")
    before = model.head.weight.clone()
    with pytest.raises(KeyMatchError) as err:
        ckptkit.load_into(model, path)
    text = str(err.value)
    assert "1 missing: head.bias" in text
    assert "1 unexpected: module.extra.w" in text
    assert "head.weight [5, 8] vs model [3, 8]" in text
    assert torch.equal(model.head.weight, before)  # strict: nothing loaded
    report = ckptkit.load_into(model, path, strict=False)
    assert report.missing == ["head.bias"] and report.unexpected == ["module.extra.w"]
    assert [k for k, _, _ in report.mismatched] == ["head.weight"]
    assert report.loaded == 7


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)


class _Blocks(torch.nn.Module):
    def __init__(self, wrap=lambda block: block):
        super().__init__()
        self.blocks = torch.nn.ModuleList(wrap(_Block()) for _ in range(2))
        self.head = torch.nn.Linear(4, 2)


class _LightningLike(torch.nn.Module):
    """A compiled model held as `.model`, as a LightningModule holds it."""

    def __init__(self):
        super().__init__()
        self.model = torch.compile(_Blocks())


def _wrapper_cases():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    compiled = _Blocks(torch.compile)
    checkpointed = _Blocks(checkpoint_wrapper)
    lightning = _LightningLike()
    return {
        # torch.compile block by block: blocks.0._orig_mod.attn.weight
        "compiled blocks": (compiled.state_dict(), ()),
        # activation checkpointing, as a trainer that saves named_parameters() writes it
        # (checkpoint_wrapper's own state_dict hook removes the segment)
        "checkpointed": ({k: p.detach() for k, p in checkpointed.named_parameters()}, ()),
        # a compiled model under Lightning: model._orig_mod.blocks.0...
        "lightning compiled": (lightning.state_dict(), ("model.",)),
    }


@pytest.mark.parametrize("case", ["compiled blocks", "checkpointed", "lightning compiled"])
def test_wrappers_inside_keys_need_no_other_option(tmp_path, case):
    state, strip = _wrapper_cases()[case]
    assert any("._orig_mod." in k or "._checkpoint_wrapped_module." in k for k in state)
    src = tmp_path / "src.pt"
    torch.save(state, src)
    dst = tmp_path / "plain.safetensors"
    ckptkit.convert(src, dst, strip_wrappers=True, strip_prefixes=strip)
    plain = _Blocks()
    load_model(plain, str(dst), strict=True)
    loaded = ckptkit.load_state_dict(src, strip_wrappers=True)
    if strip:
        loaded = {k.removeprefix("model."): v for k, v in loaded.items()}
    assert set(loaded) == set(plain.state_dict())
    if not strip:  # load_into maps them too, and diff sees through them
        fresh = _Blocks()
        assert ckptkit.load_into(fresh, src).loaded == len(fresh.state_dict())
        assert ckptkit.diff(src, dst).equal
