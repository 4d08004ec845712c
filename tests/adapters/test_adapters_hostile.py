"""Adapters built to break ckptkit: configs whose numbers and patterns are wrong or hostile,
factors and alphas of the wrong shape, NaN-making merges, FIFOs, and adapters with tens of
thousands of modules. Each ends in one ``Error:`` line naming the file, the field and the value,
or in a bounded amount of work; nothing hangs and nothing is written."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import servers
import torch
from helpers import FIXTURE_DIR, ROOT, one_error
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.adapters import AdapterOptions, open_merged
from ckptkit.errors import FormatError, UsageError

ADAPTERS = FIXTURE_DIR / "adapters"
BERT_BASE = ADAPTERS / "bert_base"
KOHYA_BASE = ADAPTERS / "kohya_base.safetensors"
KOHYA_LORA = ADAPTERS / "kohya_lora.safetensors"
PREFIX = "base_model.model."
QUERY = "bert.encoder.layer.0.attention.self.query"


def peft_copy(tmp_path: Path, config_text: str | None = None, **config) -> Path:
    """bert_lora copied into tmp_path, its adapter_config.json updated with ``config`` (written
    by Python's json, so NaN and Infinity stay as they are) or replaced by ``config_text``."""
    folder = tmp_path / "lora"
    shutil.copytree(ADAPTERS / "bert_lora", folder)
    path = folder / "adapter_config.json"
    if config_text is None:
        config_text = json.dumps({**json.loads(path.read_text()), **config})
    path.write_text(config_text)
    return folder


def peft_folder(tmp_path: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """A PEFT folder in tmp_path holding ``tensors`` (under peft's prefix) and a config."""
    folder = tmp_path / "made"
    folder.mkdir()
    save_file({PREFIX + k: v for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def header_only(path: Path, tensors: dict[str, list[int]]) -> Path:
    """A safetensors file of fp32 zeros: ``key -> shape``, written without torch (fast for
    tens of thousands of tensors)."""
    header, offset = {}, 0
    for key, shape in tensors.items():
        size = 4 * int(torch.Size(shape).numel())
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))
    return path


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ----------------------------------------------------------------------------- config numbers

NAN, INF = float("nan"), float("inf")
# field, value, what the one line must show of it
CONFIG_CASES = {
    "r_nan": ({"r": NAN}, ["r=NaN"]),
    "r_inf": ({"r": INF}, ["r=Infinity"]),
    "r_zero": ({"r": 0}, ["r=0"]),
    "r_null": ({"r": None}, ["r=null"]),
    "r_string": ({"r": "4"}, ['r="4"']),
    "r_list": ({"r": [4]}, ["r=[4]"]),
    "r_huge": ({"r": 10**40}, ["r=" + str(10**40)]),
    "r_fraction": ({"r": 4.5}, ["r=4.5"]),
    "alpha_nan": ({"lora_alpha": NAN}, ["lora_alpha=NaN"]),
    "alpha_inf": ({"lora_alpha": -INF}, ["lora_alpha=-Infinity"]),
    "alpha_null": ({"lora_alpha": None}, ["lora_alpha=null"]),
    "alpha_string": ({"lora_alpha": "8"}, ["lora_alpha"]),
    "alpha_huge_int": ({"lora_alpha": 10**400}, ["lora_alpha"]),
    "rank_pattern_list": ({"rank_pattern": [4]}, ["rank_pattern"]),
    "rank_pattern_nan": ({"rank_pattern": {"query": NAN}}, ["rank_pattern['query']=NaN"]),
    "rank_pattern_zero": ({"rank_pattern": {"query": 0}}, ["rank_pattern['query']=0"]),
    "alpha_pattern_inf": ({"alpha_pattern": {"value": INF}}, ["alpha_pattern['value']=Infinity"]),
    "alpha_pattern_string": ({"alpha_pattern": {"value": "x"}}, ["alpha_pattern['value']"]),
    "pattern_unparsable": ({"rank_pattern": {"(query": 4}}, ["rank_pattern", "'(query'"]),
    "pattern_backref": ({"alpha_pattern": {"(q)\\1": 4}}, ["alpha_pattern", "backreference"]),
    "target_modules_number": ({"target_modules": 5}, ["target_modules=5"]),
    "target_modules_lookahead": ({"target_modules": "(?=q).*"}, ["target_modules", "lookahead"]),
    "tokens_string": ({"trainable_token_indices": "1,2"}, ["trainable_token_indices"]),
    "tokens_negative": ({"trainable_token_indices": {"emb": [-1]}}, ["trainable_token_indices"]),
    "base_name_number": ({"base_model_name_or_path": 3}, ["base_model_name_or_path=3"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_config_values_refused_in_one_line(run, tmp_path, case, command):
    """Each bad number or pattern: one line naming the config file, the field and the value,
    from inspect and from convert (which writes nothing)."""
    config, words = CONFIG_CASES[case]
    folder = peft_copy(tmp_path, **config)
    args = [folder] if command == "inspect" else [folder, "out.safetensors", "--base", BERT_BASE]
    result = run(command, *args)
    one_error(result, "adapter_config.json", *words)
    assert not (tmp_path / "out.safetensors").exists()


def test_deeply_nested_config_refused(run, tmp_path):
    folder = peft_copy(tmp_path, config_text='{"r": 4, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_error(run("inspect", folder), "adapter_config.json", "deep")
    one_error(run("convert", folder, "out.safetensors", "--base", BERT_BASE), "deep")


def test_nan_alpha_option_refused(run, tmp_path):
    """``--lora-alpha nan`` (click reads it as a float) is refused like a NaN in a config."""
    state = load_file(BERT_BASE / "model.safetensors")
    peft_full = tmp_path / "full.safetensors"
    module = QUERY
    state[f"{PREFIX}{module}.base_layer.weight"] = state.pop(f"{module}.weight")
    state[f"{PREFIX}{module}.lora_A.default.weight"] = torch.ones(4, 16)
    state[f"{PREFIX}{module}.lora_B.default.weight"] = torch.ones(16, 4)
    save_file(state, peft_full)
    result = run("convert", peft_full, "out.safetensors", "--lora-alpha", "nan")
    one_error(result, "--lora-alpha nan", "finite")
    assert not (tmp_path / "out.safetensors").exists()
    with pytest.raises(UsageError, match="lora_alpha=nan: give a finite"):
        ckptkit.convert(peft_full, tmp_path / "out.safetensors", lora_alpha=float("nan"))


def test_library_convert_takes_the_peft_model_state_options(tmp_path):
    """``ckptkit.convert()`` takes drop_adapters, lora_alpha and adapter_config as the CLI
    does, and its refusal names them in Python's words, not as flags."""
    state = load_file(BERT_BASE / "model.safetensors")
    full = tmp_path / "full.safetensors"
    state[f"{PREFIX}{QUERY}.base_layer.weight"] = state.pop(f"{QUERY}.weight")
    state[f"{PREFIX}{QUERY}.lora_A.default.weight"] = torch.ones(4, 16)
    state[f"{PREFIX}{QUERY}.lora_B.default.weight"] = torch.ones(16, 4)
    save_file(state, full)
    with pytest.raises(FormatError) as refused:
        ckptkit.convert(full, tmp_path / "x.safetensors")
    assert "drop_adapters=True" in str(refused.value) and "--" not in str(refused.value)
    ckptkit.convert(full, tmp_path / "base.safetensors", drop_adapters=True)
    assert f"{QUERY}.weight" in load_file(tmp_path / "base.safetensors")
    ckptkit.convert(full, tmp_path / "merged.safetensors", lora_alpha=4)
    merged = load_file(tmp_path / "merged.safetensors")[f"{QUERY}.weight"]
    assert torch.allclose(merged, state[f"{PREFIX}{QUERY}.base_layer.weight"] + 4)
    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4}))
    ckptkit.convert(full, tmp_path / "same.safetensors", adapter_config=config)
    assert torch.equal(load_file(tmp_path / "same.safetensors")[f"{QUERY}.weight"], merged)


# ----------------------------------------------------------------------------- factors, alphas


def _pair(a: list[int], b: list[int]) -> dict[str, torch.Tensor]:
    return {f"{QUERY}.lora_A.weight": torch.ones(a), f"{QUERY}.lora_B.weight": torch.ones(b)}


FACTOR_CASES = {
    "zero_dim_a": ([], [16, 4]),
    "rank_zero": ([0, 16], [16, 0]),
    "dims_differ": ([4, 16], [16, 4, 1, 1]),
    "b_kernel": ([4, 16, 3, 3], [16, 4, 3, 3]),
}


@pytest.mark.parametrize("case", list(FACTOR_CASES))
def test_factors_that_do_not_fit_each_other(run, tmp_path, case):
    a, b = FACTOR_CASES[case]
    folder = peft_folder(tmp_path, _pair(a, b))
    for args in ([folder], [folder, "out.safetensors", "--base", BERT_BASE]):
        line = one_error(run(args and ("inspect" if len(args) == 1 else "convert"), *args))
        assert "adapter_model.safetensors" in line or str(folder) in line, line
        assert f"{QUERY}.lora_A.weight {a}" in line and "factors" in line, line
    assert not (tmp_path / "out.safetensors").exists()


def kohya_copy(tmp_path: Path, **replace: torch.Tensor) -> Path:
    """kohya_lora's tensors in tmp_path with ``replace``'s (key -> tensor) in their place
    (``__`` in a keyword stands for the key's dots)."""
    state = load_file(KOHYA_LORA)
    state.update({k.replace("__", "."): v for k, v in replace.items()})
    path = tmp_path / "kohya.safetensors"
    save_file(state, path)
    return path


Q_KEY = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
KOHYA_ALPHAS = {
    "empty": torch.ones(0),
    "several": torch.ones(3),
    "huge": torch.ones(1 << 16),
    "nan": torch.tensor(float("nan")),
    "inf": torch.tensor(float("inf")),
    "complex": torch.tensor(1 + 1j),
}


@pytest.mark.parametrize("case", list(KOHYA_ALPHAS))
def test_kohya_alpha_that_is_not_one_finite_number(run, tmp_path, case):
    lora = kohya_copy(tmp_path, **{f"{Q_KEY}__alpha": KOHYA_ALPHAS[case]})
    one_error(run("inspect", lora), f"{Q_KEY}.alpha", "kohya.safetensors")
    result = run("convert", KOHYA_BASE, "out.safetensors", "--adapter", lora)
    one_error(result, f"{Q_KEY}.alpha")
    assert not (tmp_path / "out.safetensors").exists()


def test_kohya_zero_dim_lora_down(run, tmp_path):
    lora = kohya_copy(tmp_path, **{f"{Q_KEY}__lora_down__weight": torch.tensor(1.0)})
    one_error(run("inspect", lora), f"{Q_KEY}.lora_down.weight []", "factors")


# ----------------------------------------------------------------------------- NaN and inf merges


def test_merge_that_overflows_is_refused_naming_the_tensor(run, tmp_path):
    """A finite alpha so large that B @ A * scale overflows: refused, naming the tensor, with
    nothing written (the principle behind the NaN-alpha checks). NaN the base already had is
    the base's: it merges."""
    folder = peft_copy(tmp_path, lora_alpha=1e300)
    before = listing(tmp_path)
    result = run("convert", folder, "out.safetensors", "--base", BERT_BASE)
    one_error(result, f"{QUERY}.weight", "finite")
    assert listing(tmp_path) == before
    state = load_file(BERT_BASE / "model.safetensors")
    state[f"{QUERY}.weight"][0, 0] = float("nan")
    base = tmp_path / "nan_base.safetensors"
    save_file(state, base)
    result = run("convert", ADAPTERS / "bert_lora", "out.safetensors", "--base", base)
    assert result.exit_code == 0, result.output
    assert torch.isnan(load_file(tmp_path / "out.safetensors")[f"{QUERY}.weight"][0, 0])


def test_fp16_base_overflowing_when_rounded_is_refused(run, tmp_path):
    """The merged fp32 value is finite but beyond fp16's range: the rounded one is inf."""
    state = load_file(BERT_BASE / "model.safetensors")
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    base = tmp_path / "half.safetensors"
    save_file(half, base)
    folder = peft_copy(tmp_path, lora_alpha=1e7)
    one_error(run("convert", folder, "out.safetensors", "--base", base), "weight", "finite")


# ----------------------------------------------------------------------------- patterns

HOSTILE = "(x+x+)+y"  # exponential for a backtracking matcher on "xxxx...x"


def test_hostile_pattern_is_matched_in_linear_work():
    """``(x+x+)+y`` against 5,000 x's: a backtracking matcher takes 2^5000 steps; the NFA
    visits at most (characters + 1) x states nodes, whatever the text."""
    from ckptkit.adapters.patterns import full_pattern, peft_key_pattern

    for make in (peft_key_pattern, full_pattern):
        pattern = make(HOSTILE)
        text = "m." + "x" * 5000
        assert not pattern.matches(text)
        assert pattern.work <= (len(text) + 1) * pattern.states


@pytest.mark.slow  # seconds: 12k-16k modules, or a subprocess
def test_hostile_pattern_in_a_config_does_not_hang(tmp_path):
    """inspect and convert of an adapter whose rank_pattern backtracks catastrophically on
    its module names end (a real process, with a deadline only as the test's guard)."""
    module = "m." + "x" * 60
    tensors = {
        f"{module}.lora_A.weight": torch.ones(2, 4),
        f"{module}.lora_B.weight": torch.ones(4, 2),
    }
    folder = peft_folder(
        tmp_path, tensors, r=2, rank_pattern={HOSTILE: 3}, alpha_pattern={HOSTILE: 1}
    )
    save_file({f"{module}.weight": torch.ones(4, 4)}, tmp_path / "base.safetensors")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (
        ["inspect", str(folder)],
        [
            "convert",
            str(folder),
            str(tmp_path / "out.safetensors"),
            "--base",
            str(tmp_path / "base.safetensors"),
        ],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "ckptkit", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.safetensors").exists()


# patterns.py is imported inside the tests that use it, so the rest run on code without it.


# Patterns from a small grammar over the letters of module names, and texts over them.
_ATOMS = st.sampled_from(
    ["a", "b", ".", r"\.", "[ab]", "[^a]", r"\d", r"\w", "_", "1", "(a|b)", "(?:ab)"]
)


def _regex(depth: int = 2):
    atom = (
        _ATOMS
        if depth == 0
        else st.one_of(_ATOMS, st.builds(lambda p: f"({p})", _regex(depth - 1)))
    )
    piece = st.builds(
        lambda a, q: a + q,
        atom,
        st.sampled_from(["", "*", "+", "?", "*?", "{2}", "{1,3}", "{0,2}?"]),
    )
    seq = st.lists(piece, min_size=1, max_size=4).map("".join)
    return st.lists(seq, min_size=1, max_size=3).map("|".join).map(lambda p: p if depth else p)


# Nesting and text length kept small: the reference is Python's backtracking `re`, which a
# pattern such as (((a|a)+)+)+ keeps busy for seconds on 12 characters (minutes on 14).
PATTERNS = st.one_of(
    _regex(1),
    _regex(1).map(lambda p: "^" + p),
    _regex(1).map(lambda p: p + "$"),
    _regex(1).map(lambda p: r"\b" + p + r"\B"),
    _regex(1).map(lambda p: "(?i)" + p.upper()),
)
TEXTS = st.text(alphabet="ab._1A\n", max_size=8)


@settings(max_examples=200, deadline=None)
@given(PATTERNS, TEXTS)
def test_patterns_match_as_peft_and_re_do(pattern, text):
    """The NFA says what peft's own expressions say: ``get_pattern_key``'s
    ``re.match(rf"(.*\\.)?({key})$", module)`` and ``target_modules``' ``re.fullmatch``."""
    from ckptkit.adapters.patterns import PatternError, full_pattern, peft_key_pattern

    try:
        want = re.match(rf"(.*\.)?({pattern})$", text) is not None
        want_full = re.fullmatch(pattern, text) is not None
    except re.error:
        with pytest.raises(PatternError):
            peft_key_pattern(pattern)
        return
    assert peft_key_pattern(pattern).matches(text) == want
    assert full_pattern(pattern).matches(text) == want_full


@pytest.mark.slow
def test_patterns_match_as_peft_itself():
    """peft's own functions on module names of the fixtures' kind."""
    from peft.utils.other import get_pattern_key

    from ckptkit.adapters.patterns import peft_key_pattern

    keys = ["query", r"layer\.0\..*", "value", "layer.1.attention.self.query", "(?:qu|va)[a-z]+"]
    modules = [
        "bert.encoder.layer.0.attention.self.query",
        "bert.encoder.layer.1.attention.self.query",
        "bert.encoder.layer.1.attention.self.value",
        "bert.encoder.layer.10.output.dense",
    ]
    for module in modules:
        want = get_pattern_key(keys, module)
        got = next((k for k in keys if peft_key_pattern(k).matches(module)), module)
        assert got == want, module


def test_refused_pattern_features():
    """What only a backtracking matcher can mean, and patterns too large: PatternError."""
    from ckptkit.adapters.patterns import Pattern, PatternError

    for pattern, word in [
        (r"(a)\1", "backreference"),
        ("(?<=a)b", "lookahead or lookbehind"),
        ("(?!a)b", "lookahead"),
        ("a*+", "possessive"),
        ("(?>a)", "atomic"),
        ("(?:a{1000}){1000}", "states"),
        ("(" * 10_000 + ")" * 10_000, "deep"),
    ]:
        with pytest.raises(PatternError, match=word):
            Pattern(pattern)


# ----------------------------------------------------------------------------- FIFOs


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize("name", ["adapter_config.json"])
def test_fifo_in_an_adapter_folder_does_not_block(tmp_path, name):
    """A FIFO where the config should be: an error, never a read that waits for a writer (a
    real process: a blocked open cannot be interrupted in-process). A FIFO in place of
    adapter_model.safetensors still blocks in formats/ (the folder's DCP check opens every
    *.safetensors with open()): not the adapter layer's to mend."""
    folder = peft_copy(tmp_path)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["inspect", str(folder)], ["convert", str(folder), "out.safetensors"]):
        done = subprocess.run(
            [sys.executable, "-m", "ckptkit", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
        lines = done.stderr.splitlines()
        assert done.returncode != 0 and lines[-1].startswith("Error: "), done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.safetensors").exists()


# ----------------------------------------------------------------------------- many modules


class LineBudget:
    """Counts the lines run in the adapter package (``sys.settrace``) and fails as soon as
    they pass ``limit``: a bound on the work, not on the clock, that a quadratic match breaks
    within a second. patterns.py is left out: its work per character is bounded on its own
    (``Pattern.work``, test_hostile_pattern_is_matched_in_linear_work)."""

    def __init__(self, limit: int, *, patterns: bool = False) -> None:
        self.limit, self.lines = limit, 0
        self.folder = str(Path(ckptkit.__file__).parent / "adapters")
        self.patterns = "" if patterns else str(Path(self.folder) / "patterns.py")

    def _global(self, frame, event, arg):
        name = frame.f_code.co_filename
        return self._local if name.startswith(self.folder) and name != self.patterns else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines > self.limit:
                raise AssertionError(f"more than {self.limit:,} lines run in ckptkit/adapters")
        return self._local

    def __enter__(self):
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)


MANY = 16_000


def _modules(n: int) -> list[str]:
    return [f"model.layers.{i // 4}.block.proj_{i % 4}" for i in range(n)]


@pytest.mark.slow  # seconds: 12k-16k modules, or a subprocess
def test_kohya_with_many_modules_binds_in_linear_work(tmp_path):
    """16,000 kohya modules against a base whose names carry a prefix the LoRA's lack (the
    suffix match): the lines run grow with the modules, not with modules x base keys."""
    modules = _modules(MANY)
    base = header_only(tmp_path / "base.safetensors", {m + ".weight": [2, 2] for m in modules})
    lora = {}
    for m in modules:
        name = "lora_unet_" + m.removeprefix("model.").replace(".", "_")
        lora[name + ".lora_down.weight"] = [1, 2]
        lora[name + ".lora_up.weight"] = [2, 1]
    lora_path = header_only(tmp_path / "lora.safetensors", lora)
    with LineBudget(200 * MANY) as budget:
        merged = open_merged(base, AdapterOptions(((str(lora_path), 1.0),)))
    assert len(merged.changes) == MANY  # type: ignore[attr-defined]
    merged.close()
    assert budget.lines > MANY  # the budget saw the work


@pytest.mark.slow  # seconds: 12k-16k modules, or a subprocess
def test_rank_pattern_naming_every_module_is_matched_in_linear_work(tmp_path):
    """A rank_pattern and an alpha_pattern listing each of 12,000 modules by name (what some
    tools write): tried key after key that is 144 million matches; looked up, the lines run
    grow with the modules."""
    n = 12_000
    modules = _modules(n)
    base = header_only(tmp_path / "base.safetensors", {m + ".weight": [2, 2] for m in modules})
    folder = tmp_path / "peft"
    folder.mkdir()
    tensors = {}
    for m in modules:
        tensors[f"{PREFIX}{m}.lora_A.weight"] = [2, 2]
        tensors[f"{PREFIX}{m}.lora_B.weight"] = [2, 2]
    header_only(folder / "adapter_model.safetensors", tensors)
    config = {
        "peft_type": "LORA",
        "r": 1,
        "rank_pattern": {m: 2 for m in modules},
        "alpha_pattern": {m.removeprefix("model."): i % 7 + 1 for i, m in enumerate(modules)},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with LineBudget(400 * n, patterns=True):  # about 250 a module
        merged = open_merged(folder, AdapterOptions(base=str(base)))
    targets = merged.adapters[0].targets  # type: ignore[attr-defined]
    assert [t.alpha for t in targets[:8]] == [1, 2, 3, 4, 5, 6, 7, 1]
    merged.close()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet="ab.1", min_size=1, max_size=5), st.sampled_from(["a|b", "b+", r"\d"])
        ),
        max_size=6,
    ),
    st.text(alphabet="ab.1\n", max_size=8),
)
def test_key_table_finds_the_first_key_as_peft_does(keys, module):
    """The dict lookup of plain keys and the patterns between them give the first key peft's
    ``get_pattern_key`` would (its ``re.match``, key after key)."""
    from ckptkit.adapters.patterns import KeyTable, peft_key_pattern

    want = next((i for i, k in enumerate(keys) if re.match(rf"(.*\.)?({k})$", module)), None)
    assert KeyTable(keys, peft_key_pattern).first(module) == want


# ----------------------------------------------------------------------------- pipelines

PIPELINE = FIXTURE_DIR / "diffusers" / "pipeline"
UNET_Q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
UNET_CONV = "down_blocks.0.resnets.0.conv1"
TE_Q = "encoder.layers.0.self_attn.q_proj"  # transformers 5: no text_model. prefix


def _kohya_for_pipeline(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An sd-scripts LoRA of the fixture pipeline: two UNet modules (a linear, a 3x3 conv)
    and one text-encoder module under sd-scripts' ``text_model_`` name."""
    gen = torch.Generator().manual_seed(0)
    lora = {}
    for name, down, up in [
        ("lora_unet_" + UNET_Q.replace(".", "_"), [2, 4], [4, 2]),
        ("lora_unet_" + UNET_CONV.replace(".", "_"), [2, 4, 3, 3], [4, 2, 1, 1]),
        ("lora_te_text_model_" + TE_Q.replace(".", "_"), [2, 8], [8, 2]),
    ]:
        lora[f"{name}.lora_down.weight"] = torch.randn(down, generator=gen)
        lora[f"{name}.lora_up.weight"] = torch.randn(up, generator=gen)
        lora[f"{name}.alpha"] = torch.tensor(1.0)
    path = tmp_path / "sd_lora.safetensors"
    save_file(lora, path)
    return path, lora


def test_kohya_lora_merges_into_each_pipeline_component(run, tmp_path):
    """A kohya LoRA with UNet and text-encoder parts, merged into a pipeline one component at
    a time: each takes its own part (the text encoder's names without ``text_model.``), the
    other part is reported as left out, and a component it does not change is refused."""
    lora_path, lora = _kohya_for_pipeline(tmp_path)
    for component, module, name in [
        ("unet", UNET_Q, "lora_unet_" + UNET_Q.replace(".", "_")),
        ("text_encoder", TE_Q, "lora_te_text_model_" + TE_Q.replace(".", "_")),
    ]:
        out = tmp_path / f"{component}.safetensors"
        args = ["convert", PIPELINE, out, "--select", component, "--adapter", lora_path, "--json"]
        result = run(*args)
        assert result.exit_code == 0, result.output
        (merged,) = json.loads(result.stdout)["adapters"]
        other = "text_encoder" if component == "unet" else "unet"
        assert merged["left_out"] == {other: 2 if other == "unet" else 1}
        files = {"unet": "diffusion_pytorch_model.safetensors", "text_encoder": "model.safetensors"}
        base = load_file(PIPELINE / component / files[component])
        want = base[f"{module}.weight"] + 0.5 * (
            lora[f"{name}.lora_up.weight"] @ lora[f"{name}.lora_down.weight"]
        )
        got = load_file(out)[f"{module}.weight"]
        assert torch.allclose(got, want, atol=1e-6)
    conv = load_file(tmp_path / "unet.safetensors")[f"{UNET_CONV}.weight"]
    assert not torch.equal(
        conv, load_file(PIPELINE / "unet" / files["unet"])[f"{UNET_CONV}.weight"]
    )
    result = run("convert", PIPELINE, "vae.safetensors", "--select", "vae", "--adapter", lora_path)
    one_error(result, "sd_lora.safetensors", "'vae'", "text_encoder, unet")


# ----------------------------------------------------------------------------- which base


def test_report_says_which_base_and_how_it_was_found(run, tmp_path):
    """Text and JSON name the base; the JSON says how it was found: from the adapter's
    config, or given with --base."""
    result = run("convert", ADAPTERS / "bert_lora", "a.safetensors")
    assert result.exit_code == 0, result.output
    assert f"into {BERT_BASE}" in result.stdout
    result = run("convert", ADAPTERS / "bert_lora", "b.safetensors", "--json")
    (adapter,) = json.loads(result.stdout)["adapters"]
    assert adapter["base"] == str(BERT_BASE)
    assert adapter["base_from"] == "the adapter's base_model_name_or_path 'bert_base'"
    args = ["--base", BERT_BASE, "--json"]
    result = run("convert", ADAPTERS / "bert_lora", "c.safetensors", *args)
    assert json.loads(result.stdout)["adapters"][0]["base_from"] == "given with --base"


@pytest.mark.parametrize("how", ["climbs", "absolute"])
def test_base_named_outside_the_adapter_folder_is_said(run, tmp_path, how):
    """``../`` climbing out of the adapter's folder, or an absolute path elsewhere, is
    followed only with a word saying so."""
    shutil.copytree(BERT_BASE, tmp_path / "elsewhere" / "base")
    name = "../elsewhere/base" if how == "climbs" else str(tmp_path / "elsewhere" / "base")
    (tmp_path / "downloads").mkdir()
    folder = peft_copy(tmp_path / "downloads", base_model_name_or_path=name)
    result = run("convert", folder, "out.safetensors")
    assert result.exit_code == 0, result.output
    assert f"'{name}', outside the adapter's folder (followed as named)" in result.stdout


def test_trust_follows_no_base_the_adapter_names(run, tmp_path):
    one_error(run("convert", ADAPTERS / "bert_lora", "out.safetensors", "--trust"), "--base PATH")
    args = ["--trust", "--base", BERT_BASE]
    assert run("convert", ADAPTERS / "bert_lora", "out.safetensors", *args).exit_code == 0


# ----------------------------------------------------------------------------- adapters at a URL

s3_server = servers.s3_server
s3 = servers.s3
s3_env = servers.s3_env


def test_adapter_at_s3_finds_its_base_beside_it(s3_env, tmp_path, run):
    """An adapter folder at an s3:// URL naming its base (``bert_base``, beside it) merges as
    it does with --base at the same URL, and the report says which base it took."""
    s3_env.bucket("repo")
    for name in ("bert_lora", "bert_base"):
        s3_env.fs.put(str(ADAPTERS / name) + "/", f"repo/adapters/{name}/", recursive=True)
    s3_env.fs.invalidate_cache()
    result = run("convert", "s3://repo/adapters/bert_lora", "found.safetensors", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    base = ["--base", "s3://repo/adapters/bert_base"]
    result = run("convert", "s3://repo/adapters/bert_lora", "given.safetensors", *base)
    assert result.exit_code == 0, result.output
    assert found["verified"] and found["adapters"][0]["base"] == "s3://repo/adapters/bert_base"
    assert found["adapters"][0]["base_from"] == "the adapter's base_model_name_or_path 'bert_base'"
    a, b = load_file(tmp_path / "found.safetensors"), load_file(tmp_path / "given.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- and the rest


def test_nan_adapter_weight_refused(run, tmp_path):
    result = run("convert", KOHYA_BASE, "out.safetensors", "--adapter", f"{KOHYA_LORA}:nan")
    one_error(result, "kohya_lora.safetensors", "weight nan", "finite")
    assert not (tmp_path / "out.safetensors").exists()


def test_peft_model_state_with_two_tensors_for_one_base_name(run, tmp_path):
    """``x.base_layer.weight`` and ``x.weight`` both become ``x.weight`` in the base view:
    refused, not one silently dropped."""
    state = load_file(BERT_BASE / "model.safetensors")
    state = {PREFIX + k: v for k, v in state.items()}
    state[f"{PREFIX}{QUERY}.base_layer.weight"] = torch.zeros(16, 16)
    state[f"{PREFIX}{QUERY}.lora_A.default.weight"] = torch.ones(4, 16)
    state[f"{PREFIX}{QUERY}.lora_B.default.weight"] = torch.ones(16, 4)
    save_file(state, tmp_path / "full.safetensors")
    result = run("convert", "full.safetensors", "out.safetensors", "--drop-adapters")
    one_error(result, f"'{QUERY}.weight'", "base_layer")


def test_revision_climbing_out_of_the_hf_cache_refused(run, tmp_path, monkeypatch):
    """A ``revision`` of ``../../../elsewhere`` would take a folder outside the cache as the
    base: refused."""
    snapshots = tmp_path / "hub" / "models--org--tiny" / "snapshots"
    (snapshots / ("a" * 40)).mkdir(parents=True)
    shutil.copytree(BERT_BASE, tmp_path / "elsewhere")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = peft_copy(tmp_path, base_model_name_or_path="org/tiny", revision="../../../elsewhere")
    one_error(run("convert", folder, "out.safetensors"), "revision", "--base")


def test_kohya_lora_merges_into_a_whole_pipeline_in_one_command(run, tmp_path):
    """`convert PIPELINE OUT --adapter kohya.safetensors`: each part merged into its own
    component (the UNet's and the text encoder's), the other components converted as they
    are; each equals that component's merge on its own."""
    lora_path, _ = _kohya_for_pipeline(tmp_path)
    out = tmp_path / "merged"
    result = run("convert", PIPELINE, out, "--adapter", lora_path)
    assert result.exit_code == 0, result.output
    files = {"unet": "diffusion_pytorch_model.safetensors", "text_encoder": "model.safetensors"}
    for component, name in files.items():
        alone = tmp_path / f"{component}.safetensors"
        args = ["convert", PIPELINE, alone, "--select", component, "--adapter", lora_path]
        assert run(*args).exit_code == 0
        merged = load_file(out / component / name)
        assert merged.keys() == load_file(alone).keys()
        assert all(torch.equal(merged[k], v) for k, v in load_file(alone).items())
        assert not all(
            torch.equal(merged[k], v) for k, v in load_file(PIPELINE / component / name).items()
        )
    vae = "diffusion_pytorch_model.safetensors"
    assert load_file(out / "vae" / vae).keys() == load_file(PIPELINE / "vae" / vae).keys()
    assert (out / "model_index.json").read_bytes() == (PIPELINE / "model_index.json").read_bytes()


def test_a_whole_pipeline_takes_no_adapter_it_cannot_place(run, tmp_path):
    one_error(
        run("convert", PIPELINE, tmp_path / "o", "--adapter", ADAPTERS / "bert_lora"),
        "bert_lora is a PEFT LoRA",
        "--select",
    )
    lora = {
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": torch.ones(2, 8),
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": torch.ones(8, 2),
    }
    save_file(lora, tmp_path / "sdxl_lora.safetensors")
    one_error(
        run("convert", PIPELINE, tmp_path / "o", "--adapter", tmp_path / "sdxl_lora.safetensors"),
        "changes text_encoder_2, which the pipeline",
    )
    assert not (tmp_path / "o").exists()
