"""``OpenOptions``: how a checkpoint is opened, one object from the CLI to the readers; and the
adapter kinds as a table of readers, each kind's binding its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import FIXTURE_DIR
from safetensors.torch import save_file

import ckptkit
from ckptkit.adapters import read_adapter
from ckptkit.adapters.kinds import READERS, adapter_of
from ckptkit.adapters.kohya import KohyaAdapter
from ckptkit.convert import ReadOptions
from ckptkit.errors import SelectError
from ckptkit.formats.open import OpenOptions, open_source

ADAPTERS = FIXTURE_DIR / "adapters"


def test_options_object_and_keywords_open_the_same(tmp_path):
    """``open_source(p, OpenOptions(select=...))`` is ``open_source(p, select=...)``; fields
    given by name change those of the object."""
    torch.save({"a": {"w": torch.ones(2)}, "b": {"w": torch.zeros(3)}}, tmp_path / "two.pt")
    with open_source(tmp_path / "two.pt", OpenOptions(select="b")) as by_object:
        assert by_object.selected == "b" and by_object.keys() == ["w"]
    with open_source(tmp_path / "two.pt", select="b") as by_name:
        assert by_name.selected == "b"
    with open_source(tmp_path / "two.pt", OpenOptions(select="b"), select="a") as changed:
        assert changed.selected == "a"
    with pytest.raises(TypeError):
        open_source(tmp_path / "two.pt", selct="b")


def test_options_are_values():
    """Frozen, hashable, keyword-only; any iterable of globals kept as a tuple."""
    options = OpenOptions(select="model", allow_globals=["fractions.Fraction"])
    assert options.allow_globals == ("fractions.Fraction",)
    assert hash(options) == hash(OpenOptions(select="model", allow_globals=("fractions.Fraction",)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.select = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        OpenOptions("model")  # type: ignore[misc]
    assert ckptkit.OpenOptions is OpenOptions


@pytest.mark.parametrize(
    "options",
    [
        OpenOptions(select="model"),
        OpenOptions(ema=True),
        OpenOptions(variant="fp16"),
        OpenOptions(names_from="model_folder"),
    ],
)
def test_safety_keeps_what_applies_to_any_file(options):
    """``safety()``: the options an adapter is opened with (nothing to choose in it)."""
    trusted = dataclasses.replace(options, trust=True, allow_globals=("a.B",), check_safety=False)
    assert options.chooses_weights and trusted.chooses_weights
    safety = trusted.safety()
    assert not safety.chooses_weights
    assert safety == OpenOptions(trust=True, allow_globals=("a.B",), check_safety=False)


def test_read_options_are_open_options():
    """convert's ReadOptions are OpenOptions with what is merged and the URL workers beside:
    given to open_source as they are."""
    read = ReadOptions(select="model", workers=4)
    assert isinstance(read, OpenOptions) and read.select == "model"
    assert read.safety() == OpenOptions()


def test_read_adapter_takes_the_safety_options():
    """An adapter is opened with the options it is given (never with a select: refused)."""
    adapter = read_adapter(ADAPTERS / "bert_lora", options=OpenOptions(allow_globals=("a.B",)))
    adapter.close()
    with pytest.raises(SelectError):
        read_adapter(ADAPTERS / "bert_lora", options=OpenOptions(variant="fp16"))


def test_adapter_kinds_are_a_table():
    """Each kind is told and read by its row; a kohya file's binding is its adapter's own."""
    assert [reader.kind for reader in READERS] == ["kohya LoRA", "PEFT LoRA"]
    with open_source(ADAPTERS / "kohya_lora.safetensors") as source:
        kohya = adapter_of(source)
        assert isinstance(kohya, KohyaAdapter) and kohya.kind == "kohya LoRA"
        assert kohya.target_modules() == ["lora_te (1 module)", "lora_unet (4 modules)"]
    with open_source(ADAPTERS / "bert_lora" / "adapter_model.safetensors") as source:
        peft = adapter_of(source)
        assert peft is not None and not isinstance(peft, KohyaAdapter)
        assert peft.kind == "PEFT LoRA" and peft.target_modules() == ["query", "value"]
        names = [t.module for t in peft.targets]
        peft.bind(["anything.weight"])  # PEFT names are the base's paths already
        assert [t.module for t in peft.targets] == names


def test_a_model_is_no_adapter(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    with open_source(tmp_path / "model.safetensors") as source:
        assert adapter_of(source) is None
