"""Shared test helpers (constants, functions, hypothesis strategies): imported by the test files
as ``from helpers import ...`` (tests/support is on pytest's ``pythonpath``). The pytest fixtures
stay in tests/conftest.py."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_DIR = ROOT / "fixtures"
if str(FIXTURE_DIR) not in sys.path:  # the fixture makers: make_fixtures, make_dcp, ...
    sys.path.insert(0, str(FIXTURE_DIR))

from make_fixtures import FIXTURES, reference_model, sample_input  # noqa: E402

# torch's intra-op thread count in a fresh process, read before conftest gives each pytest-xdist
# worker one thread: what a ckptkit the tests start as a subprocess runs with.
FRESH_PROCESS_THREADS = torch.get_num_threads()

__all__ = [
    "FIXTURES",
    "FIXTURE_DIR",
    "NOT_IN_LEGACY",
    "ROOT",
    "TORCH_DTYPES",
    "as_in_a_fresh_process",
    "bits",
    "dcp_to_torch",
    "free_port",
    "load_with_ties",
    "no_torch_imported",
    "reference_model",
    "run_measured",
    "same_tree",
    "sample_input",
    "single_process_dcp",
    "state_dicts",
]


def bits(t: torch.Tensor) -> tuple:
    """A tensor as dtype, shape and bytes: equal only when bit for bit the same."""
    return t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).tolist()


def same_tree(a, b) -> bool:
    """Equal and of the very same types all the way down (``True`` is not ``1``, a tuple not a
    list); floats compared by their bits, so a NaN equals the same NaN and -0.0 is not 0.0.
    Sets are matched element to equal element (so they must not hold NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            same_tree(ka, kb) and same_tree(a[ka], b[kb]) for ka, kb in zip(a, b, strict=True)
        )
    if isinstance(a, set | frozenset):  # each element against the one equal to it
        return a == b and all(same_tree(x, next(y for y in b if y == x)) for x in a)
    return a == b


def one_error(result, *needles):
    """A CLI run that failed with one ``Error:`` line (no traceback) naming each needle; the
    line."""
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def single_process_dcp():
    """Around a deliberate ``dcp.save`` or ``dcp.load`` in one process without a process group:
    torch warns that it assumes so (even when told with ``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def dcp_to_torch(folder: Path, tmp: Path) -> dict:
    """What torch's own ``dcp_to_torch_save`` makes of a DCP folder, loaded."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp / "ref.pt")
    return torch.load(tmp / "ref.pt", weights_only=True)


@contextlib.contextmanager
def as_in_a_fresh_process():
    """Compute with as many threads as a fresh process: a result compared bit for bit with one a
    subprocess made (a matmul's sums are split, so rounded, by the thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(FRESH_PROCESS_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now. torchrun without ``--standalone`` listens on
    29500 unless told (``PET_MASTER_PORT`` is its ``--master-port``): tests running side by side
    on pytest-xdist's workers would meet there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_torch_imported(code: str) -> None:
    """Run ``code`` in a fresh interpreter, then check it never imported torch."""
    check = "\nimport sys; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run(
        [sys.executable, "-c", code + check], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# Every dtype a state dict may hold that safetensors can store.
TORCH_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16,
]  # fmt: skip
# ...and the ones torch's legacy (pre-1.6) format cannot hold.
NOT_IN_LEGACY = {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16}


# Runs the CLI in a child that reports its own peak resident memory: VmHWM belongs to the
# child's address space (ru_maxrss would start from this test process's size, through fork).
_MEASURED = (
    "import re, sys\n"
    "from ckptkit.cli import main\n"
    "code = 0\n"
    "try:\n    main(sys.argv[1:])\n"
    "except SystemExit as exc:\n    code = exc.code\n"
    "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
    "print('PEAK', hwm, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def run_measured(args, cwd, timeout):
    """``ckptkit ARGS`` in a child: (exit code, stdout, stderr, peak resident MB).

    Raises:
        subprocess.TimeoutExpired: the command ran past ``timeout`` seconds.
    """
    done = subprocess.run(
        [sys.executable, "-c", _MEASURED, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    said, _, peak = done.stderr.rpartition("PEAK ")
    return done.returncode, done.stdout, said, int(peak) / 1024


def load_with_ties(path):
    """A safetensors file's tensors as safetensors' ``load_file`` reads them, plus each name its
    metadata records as removed (``removed -> kept``, as ``save_model`` writes it) bound to the
    kept tensor: what a model with those ties holds after ``load_model``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = load_file(path)
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    state.update({k: state[v] for k, v in metadata.items() if k not in state and v in state})
    return state


@st.composite
def state_dicts(draw):
    """State dicts of every dtype, with 0-d, empty and strided tensors, sometimes a tie."""
    state = {}
    for i in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        dtype = draw(st.sampled_from(TORCH_DTYPES))
        raw = torch.randint(
            0,
            256,
            (
                max(1, int(torch.tensor(shape).prod()) if shape else 1)
                * torch.empty((), dtype=dtype).element_size(),
            ),
            dtype=torch.uint8,
        )
        n = int(torch.tensor(shape).prod()) if shape else 1
        tensor = raw[: n * torch.empty((), dtype=dtype).element_size()].view(dtype).reshape(shape)
        if draw(st.booleans()) and tensor.dim() == 2:
            tensor = tensor.t()  # a strided view
        state[f"layer{i}.{draw(st.sampled_from(['weight', 'bias', 'step']))}"] = tensor
    if draw(st.booleans()):
        first = next(iter(state))
        state["tied.alias"] = state[first]
    return state
