"""Hostile and contradictory inputs to a mapped conversion (found by trying to break it): each
gets one Error line naming the file or the check, in bounded time and memory, and nothing is
written outside what ckptkit owns."""

from __future__ import annotations

import json
import os

import torch
from helpers import FIXTURE_DIR, one_error
from make_mapping import PARAMS, make_meta
from safetensors.torch import load_file, save_file

from ckptkit.mapping.spec import PACKS


def pack_with(tmp_path, old: str, new: str):
    text = (PACKS / "llama-meta.toml").read_text()
    assert old in text
    path = tmp_path / "m.toml"
    path.write_text(text.replace(old, new))
    return path


def test_a_mapping_cannot_write_outside_its_output(tmp_path, run):
    make_meta(tmp_path / "meta", 2, "3")
    (tmp_path / "victim.txt").write_text("mine")
    pack_with(tmp_path, 'file = "params.json"', 'file = "../victim.txt"')
    one_error(run("convert", "meta", "out", "--map", "m.toml"), "names its 'file'")
    pack_with(tmp_path, 'files = "consolidated.{rank:02}.pth"', 'files = "../EVIL.{rank:02}.pth"')
    one_error(run("convert", "meta", "out", "--map", "m.toml"), "by its number alone")
    assert (tmp_path / "victim.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["m.toml", "meta", "victim.txt"]


def test_rank_names_the_pattern_would_not_write_are_not_ranks(tmp_path, run):
    """A stray consolidated.1.pth (rank 0's copy) beside consolidated.01.pth is no second rank
    1; a rank number no folder holds is refused at once (it once asked for its gap's list)."""
    make_meta(tmp_path / "meta", 2, "3")
    (tmp_path / "meta" / "consolidated.1.pth").write_bytes(
        (tmp_path / "meta" / "consolidated.00.pth").read_bytes()
    )
    assert run("convert", "meta", "a", "--map", "llama-meta").exit_code == 0
    want = load_file(FIXTURE_DIR / "mapping" / "llama3-tp2" / "model.safetensors")
    got = load_file(tmp_path / "a" / "model.safetensors")
    assert all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want)
    one_error(
        run("convert", "meta/consolidated.00.pth", "x.safetensors"), "one of 2 model-parallel"
    )
    (tmp_path / "meta" / "consolidated.1.pth").unlink()
    (tmp_path / "meta" / "consolidated.99999999999.pth").touch()
    one_error(
        run("inspect", "meta", "--map", "llama-meta"),
        "rank 99999999999's file: more than 4096 ranks",
    )


def test_a_params_json_of_another_model_is_refused_by_the_packs_checks(tmp_path, run):
    make_meta(tmp_path / "meta", 2, "3")
    (tmp_path / "meta" / "params.json").write_text(json.dumps({**PARAMS, "dim": 16, "n_heads": 4}))
    one_error(
        run("convert", "meta", "a", "--map", "llama-meta"),
        "fails the mapping's check 'shape('norm.weight', 0) == dim' (dim = 16)",
    )
    (tmp_path / "meta" / "params.json").write_text('{"dim": NaN, "n_layers": 2, "n_heads": 8}')
    one_error(
        run("convert", "meta", "a", "--map", "llama-meta"), "'dim' is not a number or text (nan)"
    )
    (tmp_path / "meta" / "params.json").write_text(json.dumps({**PARAMS, "n_layers": 3}))
    one_error(
        run("convert", "meta", "a", "--map", "llama-meta"),
        "count('layers.{i}.attention_norm.weight') == n_layers",
    )
    assert sorted(os.listdir(tmp_path)) == ["meta"]


def test_expressions_that_cannot_be_computed_are_one_error(tmp_path, run):
    make_meta(tmp_path / "meta", 2, "3")
    for expr in ("get()", "shape('x')", "8 if 'a' < 1 else 8"):
        pack_with(tmp_path, "n_heads = \"get('n_heads')\"", f'n_heads = "{expr}"')
        one_error(run("inspect", "meta", "--map", "m.toml"), "cannot be computed")
    one_error(
        run("inspect", "meta", "--map", "llama-meta", "--set", "x='a'<1"), "cannot be computed"
    )


def test_ops_refuse_sizes_no_checkpoint_has_before_reading(tmp_path, run):
    """Zero-size tensors with enormous dims cut into enormous counts, or padded a thousandfold:
    refused from the headers, never attempted."""
    save_file(
        {"x": torch.empty(0, 4), "u": torch.empty(300_000_000, 0), "w": torch.ones(4, 2)},
        tmp_path / "zero.safetensors",
    )
    base = 'from = "a"\nto = "b"\n'
    cases = {
        'from = "x"\nto = ["x0", "x1"]\nops = ["split(dim=0, parts=300000000)"]': "more than 65536 parts",
        'from = "u"\nto = "u.{e}"\nops = ["unstack(over=e)"]': "unstacks 300000000 tensors",
        'from = "w"\nto = "w2"\nops = ["pad(dim=0, size=4, full=200000000)"]': "padding, not a new tensor",
    }
    for rule, needle in cases.items():
        others = [
            r
            for r in ('from = "x"\nto = "x"', 'from = "u"\nto = "u"', 'from = "w"\nto = "w"')
            if r.split("\n")[0] != rule.split("\n")[0]
        ]
        (tmp_path / "m.toml").write_text(
            base + "".join(f"[[rules]]\n{r}\n" for r in [rule, *others])
        )
        one_error(run("inspect", "zero.safetensors", "--map", "m.toml"), needle)


def test_an_existing_folders_config_is_replaced_only_with_force(tmp_path, run):
    make_meta(tmp_path / "meta", 2, "3")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"mine": 1}')
    one_error(
        run("convert", "meta", "hf", "--map", "llama-meta"), "config.json exists; pass --force"
    )
    assert (tmp_path / "hf" / "config.json").read_text() == '{"mine": 1}'
    result = run("convert", "meta", "hf", "--map", "llama-meta", "--force")
    assert result.exit_code == 0 and "Made     config.json from the mapping" in result.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_size"] == PARAMS["dim"]
    assert sorted(load_file(tmp_path / "hf" / "model.safetensors"))[0] == "lm_head.weight"
