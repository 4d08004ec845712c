"""The pytest fixtures shared by the test files. Constants, functions and strategies live in
tests/support/helpers.py (``from helpers import ...``; tests/support is on pytest's pythonpath)."""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner
from helpers import FIXTURE_DIR

from ckptkit.cli import cli

# gcsfs reads this once, when it is imported (see servers.GcsServer): off before any test file
# imports it, or each gs:// bucket costs 60 s of gRPC retries against the emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def pytest_configure(config):
    """Under pytest-xdist each worker is one of as many processes as there are cores: torch's
    intra-op pool of one thread per core in every worker oversubscribes them (its OpenMP threads
    spin while they wait), which made in-process training ten times slower than alone. One
    thread per worker, as torchrun gives each rank."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``-n``, ``--dist loadgroup``), the tests of a file that share a fixture
    made once per module (a training run, a corpus written out) all run on one worker, so that it
    is made once rather than once on each worker. Without xdist the mark does nothing."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope == "module" for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture
def fixture_copy(tmp_path):
    """Copy a checked-in fixture into tmp_path, so tests never write beside the originals."""

    def copy(name: str):
        dst = tmp_path / name
        shutil.copy(FIXTURE_DIR / name, dst)
        return dst

    return copy


@pytest.fixture
def run(tmp_path, monkeypatch):
    """Run ``ckptkit ARGS`` in-process through CliRunner, in tmp_path; stderr kept apart."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTKIT_DEBUG", raising=False)

    def invoke(*args):
        return CliRunner().invoke(cli, [str(a) for a in args], prog_name="ckptkit")

    return invoke


@pytest.fixture
def corrupt_head_bias_copy(monkeypatch):
    """The byte copier flips the last byte of head.bias (the fixtures' one 12-byte tensor) as
    it writes it: what only verification can catch."""
    import ckptkit.formats.output.copier as transfer_module

    real = transfer_module.copy_range

    def corrupting(src_fd, offset, count, dst_fd):
        real(src_fd, offset, count, dst_fd)
        if count == 12:  # head.bias: 3 float32
            os.pwrite(dst_fd, b"\xff", os.lseek(dst_fd, 0, os.SEEK_CUR) - 1)

    monkeypatch.setattr(transfer_module, "copy_range", corrupting)
