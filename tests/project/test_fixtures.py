"""The checked-in fixtures are what make_fixtures.py writes (so they can be regenerated)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import FIXTURE_DIR, FIXTURES

import ckptkit
from ckptkit.formats.base.tensors import bit_equal


def opts(fx):
    # A malicious fixture's global cannot be admitted; it is compared read without the check.
    return {"check_safety": False} if fx.bad else {"allow_globals": fx.allow}


@pytest.mark.slow  # 3-4 s: every fixture made again
def test_make_fixtures_reproduces_the_checked_in_files(tmp_path):
    subprocess.run(
        [sys.executable, str(FIXTURE_DIR / "make_fixtures.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    assert not (tmp_path / "ckptkit_pwned").exists()
    for fx in FIXTURES:
        with (
            ckptkit.open_source(FIXTURE_DIR / fx.name, **opts(fx)) as old,
            ckptkit.open_source(tmp_path / fx.name, **opts(fx)) as new,
        ):
            assert old.keys() == new.keys(), fx.name
            assert old.extras == new.extras, fx.name
            for key in old.keys():
                assert bit_equal(old.load(key), new.load(key)), (fx.name, key)
    assert (tmp_path / "torchscript.pt").exists()


@pytest.mark.slow
def test_make_adapters_reproduces_the_checked_in_adapters(tmp_path):
    """peft, transformers and the script together write the committed adapter fixtures byte
    for byte (their README.md is written by hand)."""
    subprocess.run(
        [sys.executable, str(FIXTURE_DIR / "make_adapters.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    committed = FIXTURE_DIR / "adapters"
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    kept = [p.relative_to(committed) for p in committed.rglob("*") if p.is_file()]
    assert made == sorted(p for p in kept if str(p) != "README.md")
    for name in made:
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name
