"""``--check-roundtrip``: each group mapped back as it streams and compared with the source
bit for bit; a mapping that loses information is refused, naming the rule and the key, and
nothing is written."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import one_error
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.errors import VerificationError

LOSSY = """
from = "mine"
to = "theirs"

[[rules]]
from = "embed"
to = "embedding"
ops = ["slice(dim=0, size=6, full=8)"]

[[rules]]
from = "w.{i}"
to = "weight.{i}"
ops = ["cast('bfloat16', back='float32')"]

[[rules]]
from = "b.{i}"
to = "bias.{i}"
"""


def source(tmp_path, *, padding: float, weight: torch.Tensor):
    save_file(
        {
            "embed": torch.cat([torch.randn(6, 4), torch.full((2, 4), padding)]),
            "w.0": weight,
            "b.0": torch.randn(4),
        },
        tmp_path / "src.safetensors",
    )
    (tmp_path / "m.toml").write_text(LOSSY)


def test_a_lossless_mapping_maps_back_bit_for_bit(tmp_path, run):
    source(tmp_path, padding=0.0, weight=torch.randn(4, 4).bfloat16().float())
    result = run(
        "convert", "src.safetensors", "out.safetensors", "--map", "m.toml", "--check-roundtrip"
    )
    assert result.exit_code == 0, result.output
    assert (
        "Checked  mapped back bit for bit in the stream: 2 of 3 groups (1 renamed, copied as "
        "bytes; 0 dropped)"
    ) in result.output.splitlines()
    out = load_file(tmp_path / "out.safetensors")
    assert out["weight.0"].dtype == torch.bfloat16 and out["embedding"].shape == (6, 4)


@pytest.mark.parametrize(
    ("padding", "weight", "needle"),
    [
        (
            1.0,
            torch.full((4, 4), 0.5),
            "rule 1 (embed) at 'embed': mapped and mapped back, 'embed'",
        ),
        (0.0, torch.full((4, 4), 1 / 3), "rule 2 (w.{i}) at 'w.0': mapped and mapped back, 'w.0'"),
    ],
    ids=["padding that was not zeros", "a cast that rounds"],
)
def test_a_lossy_mapping_is_refused_and_nothing_is_written(tmp_path, run, padding, weight, needle):
    source(tmp_path, padding=padding, weight=weight)
    one_error(
        run(
            "convert", "src.safetensors", "out.safetensors", "--map", "m.toml", "--check-roundtrip"
        ),
        needle,
        "nothing was written",
    )
    assert sorted(os.listdir(tmp_path)) == ["m.toml", "src.safetensors"]
    with pytest.raises(VerificationError):
        ckptkit.convert(
            tmp_path / "src.safetensors",
            tmp_path / "o.safetensors",
            mapping=tmp_path / "m.toml",
            check_roundtrip=True,
        )
    # without the check, the loss is the mapping's to own: written as asked
    ckptkit.convert(
        tmp_path / "src.safetensors", tmp_path / "o.safetensors", mapping=tmp_path / "m.toml"
    )
