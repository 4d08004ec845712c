"""The command line: one-line errors and exit codes, nothing half-written, JSON, help."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FIXTURE_DIR, ROOT
from safetensors.torch import load_file

from ckptkit.cli import cli
from ckptkit.render import SCHEMAS


def only_inputs(tmp_path, *names):
    return sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_convert_strip_module(run, tmp_path, fixture_copy):
    fixture_copy("dp.pt")
    result = run("convert", "dp.pt", "out.safetensors", "--strip-module")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        lines[0]
        == "Read     dp.pt (torch-zip); state dict at the top level (the file is a flat state dict)"
    )
    assert lines[1].startswith("Keys     9 tensors, 468 B: strip 'module.'")
    assert lines[-2] == "Wrote    out.safetensors (safetensors), verified bit-exact"
    assert lines[-1] == "Copied   9 of 9 tensors as bytes, without torch"
    assert not any(k.startswith("module.") for k in load_file(tmp_path / "out.safetensors"))


def test_convert_json_and_quiet(run, fixture_copy):
    fixture_copy("training.pt")
    result = run("convert", "training.pt", "o.safetensors", "--strip-wrappers", "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["selected"] == "model" and report["verified"] is True
    assert report["removed_prefixes"] == ["module."]
    assert report["dropped"][0]["path"] == "optimizer"
    assert {"from": "module.head.bias", "to": "head.bias"} in report["keys"]
    quiet = run("convert", "training.pt", "q.safetensors", "--strip-module", "-q")
    assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == ""


def test_dry_run_prints_the_plan(run, tmp_path, fixture_copy):
    fixture_copy("compiled_ddp.pt")
    result = run("convert", "compiled_ddp.pt", "x.safetensors", "--strip-wrappers", "--dry-run")
    assert result.exit_code == 0
    assert "  _orig_mod.module.head.bias -> head.bias" in result.stdout.splitlines()
    assert result.stdout.splitlines()[-1] == "Dry run: nothing written"
    assert only_inputs(tmp_path, "compiled_ddp.pt")


def _random(path):
    path.write_bytes(bytes(range(256)) * 4)


def _truncated(path):
    path.write_bytes((FIXTURE_DIR / "single.pt").read_bytes()[:1500])


def _plain_pickle(path):
    import pickle

    path.write_bytes(pickle.dumps({"a": 1}, protocol=2))


BAD_INPUTS = [
    ("missing.pt", None, 1, "Error: missing.pt does not exist; check the path"),
    (
        "empty.pt",
        lambda p: p.write_bytes(b""),
        1,
        "Error: empty.pt is empty (0 bytes); the save was interrupted; use an earlier copy",
    ),
    (
        "folder.pt",
        lambda p: p.mkdir(),
        1,
        "Error: folder.pt is a folder with no sharded index, model.safetensors, pytorch_model.bin, diffusers, PEFT, DeepSpeed or DCP checkpoint; give a checkpoint file; it holds none ckptkit knows by its name",
    ),
    (
        "noise.bin",
        _random,
        1,
        "Error: noise.bin is not a recognised checkpoint; ckptkit reads PyTorch files "
        "(torch.save: .pt .pth .bin .ckpt) and safetensors",
    ),
    ("cut.pt", _truncated, 1, "Error: cut.pt is a truncated or damaged zip file; copy it again"),
    (
        "plain.pkl",
        _plain_pickle,
        1,
        "Error: plain.pkl is a plain pickle, not a PyTorch checkpoint; "
        "ckptkit reads files written by torch.save or safetensors",
    ),
    (
        "model.gguf",
        lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64),
        1,
        "Error: model.gguf is a GGUF file (llama.cpp): ckptkit describes it (inspect, diff, scan) "
        "but does not convert it; convert it with llama.cpp's tools (gguf-py)",
    ),
]


@pytest.mark.parametrize(
    ("name", "make", "code", "line"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_inputs_get_one_line(run, tmp_path, name, make, code, line):
    if make:
        make(tmp_path / name)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run("convert", name, "out.safetensors")
    assert result.exit_code == code
    assert result.stderr.splitlines() == [line]
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before


FIXTURE_ERRORS = [
    (
        "torchscript.pt",
        [],
        "Error: torchscript.pt is a TorchScript archive (torch.jit.save), not a state-dict "
        "checkpoint; load it with torch.jit.load and save model.state_dict() with torch.save",
    ),
    (
        "unsafe_global.pt",
        [],
        "Error: unsafe_global.pt names globals outside torch's safe set: "
        "fractions.Fraction; if you trust the file, admit each with --allow-global NAME (or load it fully "
        "with --trust)",
    ),
    (
        "malicious.pt",
        [],
        "Error: malicious.pt names globals that run code when loaded: builtins.exec; only a "
        "file you trust can be loaded, with --trust",
    ),
    (
        "malicious.pt",
        ["--allow-global", "builtins.exec"],
        "Error: builtins.exec cannot be admitted: a file that needs it runs code when "
        "loaded; only if you trust the file, load it with --trust",
    ),
    (
        "single.pt",
        ["--strip-prefix", "model."],
        "Error: no key starts with 'model.' (first key: 'body.0.weight'); run "
        "`ckptkit inspect` to see the key prefixes, or drop this option",
    ),
    (
        "training.pt",
        ["--select", "optimizer.state"],
        "Error: 'optimizer.state' in training.pt is not a state "
        "dict (holds: 0, 1, 2, 3, 4, 5); --select must name a mapping of names to tensors",
    ),
    (
        "single.pt",
        ["--rename", "(=x"],
        "Error: invalid regular expression '(': missing ), unterminated subpattern at position 0",
    ),
]


@pytest.mark.parametrize(
    ("name", "args", "line"), FIXTURE_ERRORS, ids=[f"{n}{a}" for n, a, _ in FIXTURE_ERRORS]
)
def test_refused_fixtures_get_one_line(run, tmp_path, fixture_copy, name, args, line):
    fixture_copy(name)
    result = run("convert", name, "out.safetensors", *args)
    assert (result.exit_code, result.stderr.splitlines()) == (
        2 if "regular" in line or "admitted" in line else 1,
        [line],
    )
    assert only_inputs(tmp_path, name)
    assert not (tmp_path / "ckptkit_pwned").exists()


def test_output_errors(run, tmp_path, fixture_copy):
    fixture_copy("single.pt")
    (tmp_path / "taken.safetensors").write_bytes(b"old")
    result = run("convert", "single.pt", "taken.safetensors")
    assert result.exit_code == 1
    assert result.stderr == "Error: taken.safetensors exists; pass --force to overwrite it\n"
    assert (tmp_path / "taken.safetensors").read_bytes() == b"old"
    assert run("convert", "single.pt", "taken.safetensors", "--force").exit_code == 0
    result = run("convert", "single.pt", "single.pt", "--force")
    assert result.stderr == "Error: output single.pt is the input file; write to a new path\n"
    result = run("convert", "single.pt", "out.onnx")
    assert (
        result.stderr
        == "Error: cannot tell the output format of out.onnx; end the name with .safetensors, or .pt (.pth, .bin, .ckpt, .pth.tar), or pass --to dcp for a DCP folder\n"
    )
    result = run("convert", "single.pt", "o.pt", "--strip-module", "--strip-wrappers")
    assert result.exit_code == 2
    assert result.stderr == "Error: --strip-module and --strip-wrappers overlap; use one of them\n"


def test_usage_errors_are_one_line_with_exit_2(run):
    result = run("convert", "only-one-arg.pt")
    assert result.exit_code == 2
    assert result.stderr == "Error: Missing argument 'DST'; see 'ckptkit convert --help'\n"
    result = run("frobnicate")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: No such command 'frobnicate'")


def test_allow_global_and_trust(run, tmp_path, fixture_copy):
    fixture_copy("unsafe_global.pt")
    result = run(
        "convert", "unsafe_global.pt", "a.safetensors", "--allow-global", "fractions.Fraction"
    )
    assert result.exit_code == 0, result.stderr
    assert "Kept     ratio in the metadata" in result.stdout
    assert run("convert", "unsafe_global.pt", "b.safetensors", "--trust").exit_code == 0


def test_every_command_has_help(run):
    result = run("--help")
    assert result.exit_code == 0
    for name in cli.commands:
        sub = run(name, "--help")
        assert sub.exit_code == 0 and "Usage: ckptkit " + name in sub.stdout


def test_version(run):
    from importlib.metadata import version

    import ckptkit

    result = run("--version")
    assert result.exit_code == 0
    # One version everywhere: pyproject.toml's, read from the installed package's metadata,
    # under the distribution name (`ckptkit` on the public index is another project).
    installed = version("torch-ckptkit")
    assert result.stdout == f"ckptkit, version {installed}\n"
    assert ckptkit.__version__ == installed
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'\nversion = "{installed}"\n' in pyproject


def test_debug_shows_the_traceback(tmp_path):
    env = {**os.environ, "CKPTKIT_DEBUG": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "convert", "missing.pt", "o.pt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().endswith("Error: missing.pt does not exist; check the path")


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_bar_on_a_terminal_unless_quiet(tmp_path, quiet):
    """stderr on a pseudo-terminal gets the tqdm bar; --quiet (or a pipe, below) gets none."""
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, and tqdm draws a bar as wide as the terminal.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    argv = [
        sys.executable,
        "-m",
        "ckptkit",
        "convert",
        str(FIXTURE_DIR / "ddp.pt"),
        str(tmp_path / "out.safetensors"),
        "--strip-module",
    ] + (["-q"] if quiet else [])
    with os.fdopen(leader, "rb", buffering=0) as terminal:
        proc = subprocess.run(
            argv, stderr=follower, stdout=subprocess.DEVNULL, cwd=ROOT, timeout=60
        )
        os.close(follower)
        shown = b""
        with contextlib.suppress(OSError):  # EIO once everything written has been read
            while chunk := terminal.read(4096):
                shown += chunk
    assert proc.returncode == 0
    assert (b"convert:" in shown and b"B/s" in shown) != quiet, shown


def test_real_process_end_to_end(tmp_path):
    """The installed console script, in a subprocess, then the result loads into a plain model."""
    src = FIXTURE_DIR / "ddp.pt"
    dst = tmp_path / "plain.safetensors"
    exe = [sys.executable, "-m", "ckptkit"]
    proc = subprocess.run(
        [*exe, "convert", str(src), str(dst), "--strip-module"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no progress bar when stderr is not a terminal
    sys.path.insert(0, str(FIXTURE_DIR))
    from make_fixtures import TinyNet

    model = TinyNet()
    model.load_state_dict(load_file(dst), strict=True)
    assert torch.equal(model.head.bias, torch.load(src, weights_only=True)["module.head.bias"])


def test_every_json_document_has_a_schema_and_errors_are_documents_too(run, fixture_copy, tmp_path):
    fixture_copy("single.pt")
    runs = {
        "inspect": run("inspect", "single.pt", "--json"),
        "scan": run("scan", "single.pt", "--json"),
        "diff": run("diff", "single.pt", "single.pt", "--json"),
        "convert": run("convert", "single.pt", "o.safetensors", "--json"),
    }
    for command, result in runs.items():
        assert result.exit_code == 0, (command, result.stderr)
        assert json.loads(result.stdout)["schema"] == SCHEMAS[command], command
    # A failure under --json: the one line on stderr, and a JSON document on stdout.
    failed = run("convert", "single.pt", "o.safetensors", "--json")
    assert failed.exit_code == 1
    assert failed.stderr == "Error: o.safetensors exists; pass --force to overwrite it\n"
    assert json.loads(failed.stdout) == {
        "schema": SCHEMAS["error"],
        "error": {
            "type": "OutputError",
            "message": "o.safetensors exists",
            "hint": "pass --force to overwrite it",
        },
        "exit_code": 1,
    }
    usage = run("inspect", "single.pt", "--flat", "--depth", "2", "--json")
    assert usage.exit_code == 2 and json.loads(usage.stdout)["error"]["type"] == "UsageError"


def test_inspect_quiet_and_defaults_in_help(run, fixture_copy):
    fixture_copy("single.pt")
    quiet = run("inspect", "single.pt", "-q")
    assert quiet.exit_code == 0 and quiet.stdout == ""
    diff_help = " ".join(run("diff", "--help").stdout.split())
    assert "bit-exact). [default: 0.0; x>=0]" in diff_help
    assert "[default: no folding]" in " ".join(run("inspect", "--help").stdout.split())


def test_strip_module_on_a_compiled_file_names_strip_wrappers(run, fixture_copy):
    fixture_copy("compiled.pt")
    result = run("convert", "compiled.pt", "o.safetensors", "--strip-module")
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: no key starts with 'module.' (first key: '_orig_mod.body.0.weight'); the keys "
        "start with '_orig_mod.': --strip-wrappers removes the whole chain\n"
    )


def test_convert_notes_wrappers_it_keeps_and_accepts_ckpt_names(run, fixture_copy):
    fixture_copy("training.pt")
    result = run("convert", "training.pt", "out.pth.tar")
    assert result.exit_code == 0, result.stderr
    assert "Note     the keys keep 'module.'; --strip-wrappers removes it" in result.stdout
    assert run("convert", "training.pt", "out.ckpt", "--strip-wrappers").exit_code == 0


def test_report_wording_follows_what_was_written(run, fixture_copy, tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "one.pt")
    one = run("convert", "one.pt", "one.safetensors")
    assert "Keys     1 tensor, 8 B: keys unchanged" in one.stdout.splitlines()
    assert "Copied   1 of 1 tensor as bytes, without torch" in one.stdout.splitlines()
    fixture_copy("tied.pt")
    tied = run("convert", "tied.pt", "tied2.pt")
    assert (
        "Tied     head.weight = embed.weight (one storage, as torch.save keeps it)" in tied.stdout
    )
    cast = run("convert", "one.pt", "half.safetensors", "--dtype", "fp16")
    assert cast.stdout.splitlines()[-1] == (
        "Wrote    half.safetensors (safetensors), verified: read back equal to the cast values"
    )


def test_load_anywhere_example_without_an_argument_prints_usage():
    done = subprocess.run(
        [sys.executable, "examples/load_anywhere.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("usage: python3 examples/load_anywhere.py CHECKPOINT")
