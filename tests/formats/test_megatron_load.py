"""The legacy Megatron saves ckptkit writes, loaded by megatron-core itself: each rank of
``fixtures/make_megatron.py --load`` (``make_megatron_moe.py --load`` for the mixture of experts,
with expert parallelism) builds the GPTModel at the save's layout, ``torch.load``s its own rank
file and ``load_state_dict(..., strict=True)`` as Megatron-LM's load_checkpoint does, and the
last stage's logits are megatron-core's TP=1 reference logits (max |diff| <= 1e-5), the zero
padding rows' columns exactly 0.0. Needs megatron-core 0.16.1 (the test extra)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FIXTURE_DIR, ROOT

import ckptkit

pytestmark = pytest.mark.slow

MEGATRON = FIXTURE_DIR / "megatron"
CHECKER = ROOT / "fixtures" / "make_megatron.py"
MOE_CHECKER = ROOT / "fixtures" / "make_megatron_moe.py"  # its one shape: moe-swiglu
TIMEOUT = 300  # seconds, each subprocess


@functools.cache
def megatron_core_error() -> str | None:
    """Why ``import megatron.core`` fails in this interpreter (None when it does not). Tried in
    a subprocess: importing it here takes seconds, thousands of modules and warnings that the
    suite's filterwarnings turns into errors; the checks run it in subprocesses anyway."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", "import megatron.core"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]


def need_megatron_core() -> None:
    error = megatron_core_error()
    if error is not None:
        pytest.skip(f"megatron-core is not importable ({error}); pip install megatron-core==0.16.1")


def load_in_megatron(save: Path, shape: str, *flags: str) -> subprocess.CompletedProcess:
    """``make_megatron.py --load SAVE --shape SHAPE``: TP x PP torchrun ranks on the CPU
    (``make_megatron_moe.py --load SAVE`` for moe-swiglu: TP x PP x EP ranks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if shape == "moe-swiglu":
        cmd = [sys.executable, str(MOE_CHECKER), "--load", str(save), *flags]
    else:
        cmd = [sys.executable, str(CHECKER), "--load", str(save), "--shape", shape, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)


def output_of(done: subprocess.CompletedProcess) -> str:
    return f"--- stdout\n{done.stdout}\n--- stderr (tail)\n{done.stderr[-8000:]}"


# (source: a fixture save or a name made before in tmp_path, output name, ckptkit.convert keywords)
TO_HF = dict(mapping="megatron-llama")
FROM_HF = dict(
    mapping="megatron-llama", reverse=True, to="megatron", tensor_parallel=2, sets={"divisible": 64}
)
TO_HF_MOE = dict(mapping="megatron-mixtral")
FROM_HF_MOE = dict(
    mapping="megatron-mixtral",
    reverse=True,
    to="megatron",
    expert_parallel=2,
    sets={"divisible": 64},
)
CASES = {
    "mha-gelu-tp2-to-tp4": (
        "mha-gelu",
        [(MEGATRON / "mha-gelu/tp2/legacy", "mg", dict(to="megatron", tensor_parallel=4))],
        [],
        ["logits[..., :128] max|diff|", "columns 128..255 (zero rows): all 0.0"],
    ),
    "mha-gelu-tp2-to-tp2-pp2-tied": (
        "mha-gelu",
        [
            (
                MEGATRON / "mha-gelu/tp2/legacy",
                "mg",
                dict(to="megatron", tensor_parallel=2, pipeline_parallel=2),
            )
        ],
        [],
        ["logits[..., :128] max|diff|", "mp_rank_01_001: load_state_dict(strict=True) ok"],
    ),
    "gqa-swiglu-torch-dist-tp1-to-tp2-pp2": (
        "gqa-swiglu",
        [
            (
                MEGATRON / "gqa-swiglu/tp1/torch_dist",
                "mg",
                dict(to="megatron", tensor_parallel=2, pipeline_parallel=2),
            )
        ],
        [],
        ["logits[..., :128] max|diff|", "mp_rank_01_001: load_state_dict(strict=True) ok"],
    ),
    "gqa-swiglu-hugging-face-to-tp2": (
        "gqa-swiglu",
        [(MEGATRON / "gqa-swiglu/tp2/legacy", "hf", TO_HF), ("hf", "mg", FROM_HF)],
        # a Hugging Face model has no padding rows: ckptkit pads with zeros, so the reference's
        # columns 100..127 (its random padding rows) are 0.0 here, and only 100 are compared
        ["--zero-padding"],
        ["logits[..., :100] max|diff|", "columns 100..127 (zero rows): all 0.0"],
    ),
    "moe-swiglu-tp1-to-tp2-ep2": (  # 4 processes, rank folders mp_rank_TT_EEE
        "moe-swiglu",
        [
            (
                MEGATRON / "moe-swiglu/tp1/legacy",
                "mg",
                dict(to="megatron", tensor_parallel=2, expert_parallel=2),
            )
        ],
        [],
        [
            "logits[..., :128] max|diff|",
            "mp_rank_01_001: load_state_dict(strict=True) ok",
            "[load rank 2 ep 1] logits",  # the second dense replica checked too
        ],
    ),
    "moe-swiglu-torch-dist-tp2ep2-to-ep2-pp2": (  # 4 processes, mp_rank_TT_PPP_EEE
        "moe-swiglu",
        [
            (
                MEGATRON / "moe-swiglu/tp2ep2/torch_dist",
                "mg",
                dict(to="megatron", expert_parallel=2, pipeline_parallel=2),
            )
        ],
        [],
        ["logits[..., :128] max|diff|", "mp_rank_00_001_001: load_state_dict(strict=True) ok"],
    ),
    "gqa-swiglu-tp2-to-torch-dist-loaded-at-tp2-pp2": (  # dist_checkpointing.load reshards
        "gqa-swiglu",
        [(MEGATRON / "gqa-swiglu/tp2/legacy", "mg", dict(to="megatron-dist"))],
        ["--at", "2", "2"],
        ["logits[..., :128] max|diff|", "[load rank 3] mg: load_state_dict(strict=True) ok"],
    ),
    "mha-gelu-hugging-face-to-torch-dist-loaded-at-tp2": (
        "mha-gelu",
        [
            (MEGATRON / "mha-gelu/tp2/legacy", "hf", dict(mapping="megatron-gpt2")),
            (
                "hf",
                "mg",
                dict(
                    mapping="megatron-gpt2",
                    reverse=True,
                    to="megatron-dist",
                    sets={"divisible": 64},
                ),
            ),  # fmt: skip
        ],
        ["--zero-padding", "--at", "2", "1"],
        ["logits[..., :100] max|diff|", "columns 100..127 (zero rows): all 0.0"],
    ),
    "moe-swiglu-hugging-face-to-ep2": (
        "moe-swiglu",
        [(MEGATRON / "moe-swiglu/ep2/legacy", "hf", TO_HF_MOE), ("hf", "mg", FROM_HF_MOE)],
        ["--zero-padding"],
        ["logits[..., :100] max|diff|", "columns 100..127 (zero rows): all 0.0"],
    ),
}


def make(tmp_path: Path, steps) -> Path:
    for src, dst, options in steps:
        source = src if isinstance(src, Path) else tmp_path / src
        ckptkit.convert(source, tmp_path / dst, **options)
    return tmp_path / dst


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_core_loads_what_ckptkit_wrote(tmp_path, case):
    need_megatron_core()
    shape, steps, flags, said = CASES[case]
    done = load_in_megatron(make(tmp_path, steps), shape, *flags)
    assert done.returncode == 0, output_of(done)
    for line in said:
        assert line in done.stdout, output_of(done)
    diffs = [float(d) for d in re.findall(r"max\|diff\| vs the reference: (\S+)", done.stdout)]
    assert diffs and max(diffs) <= 1e-5, output_of(done)


def test_a_wrong_tensor_on_the_last_stage_fails_the_load_check(tmp_path):
    """The check can fail: the tied embedding's copy on the last stage (output_layer.weight,
    which megatron-core's last stage computes the logits with) changed in one element."""
    need_megatron_core()
    save = make(tmp_path, CASES["mha-gelu-tp2-to-tp2-pp2-tied"][1])
    file = save / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(file, weights_only=False)
    state["model"]["output_layer.weight"][3, 5] += 0.5
    torch.save(state, file)
    done = load_in_megatron(save, "mha-gelu")
    assert done.returncode != 0, output_of(done)
    assert "logits max|diff|" in done.stderr and "> 1e-5" in done.stderr, output_of(done)
