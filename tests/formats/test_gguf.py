"""GGUF files written by llama.cpp's own ``gguf`` writer: described from their header (tensor
names, shapes, ggml types, metadata), scanned as data, diffed, never converted."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ckptkit

gguf = pytest.importorskip("gguf")


def write(path, *, scale: float = 1.0) -> dict[str, np.ndarray]:
    """A small llama-style GGUF file: f32 and f16 tensors and a Q8_0 one, with metadata."""
    rng = np.random.default_rng(0)
    plain = {
        "token_embd.weight": (rng.standard_normal((8, 4)) * scale).astype(np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((4, 4)).astype(np.float16),
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_token_list([f"tok{i}" for i in range(20)])
    for name, array in plain.items():
        writer.add_tensor(name, array)
    quantized = gguf.quantize(
        rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor(
        "blk.0.ffn_up.weight",
        quantized,
        raw_shape=quantized.shape,
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return plain


def test_inspect_reads_the_header(tmp_path, run):
    plain = write(tmp_path / "m.gguf")
    doc = json.loads(run("inspect", tmp_path / "m.gguf", "--json").stdout)
    assert doc["format"] == "gguf"
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["token_embd.weight"]["shape"] == [8, 4]
    assert tensors["token_embd.weight"]["dtype"] == "float32"
    assert tensors["blk.0.attn_q.weight"]["dtype"] == "float16"
    q8 = tensors["blk.0.ffn_up.weight"]
    assert q8["shape"] == [4, 64] and q8["kind"] == "quantized" and q8["detail"] == "ggml Q8_0"
    assert q8["bytes"] == 4 * 64 // 32 * 34  # 34-byte blocks of 32 values
    assert doc["metadata"]["general.architecture"] == "llama"
    assert doc["metadata"]["llama.context_length"] == "128"
    assert doc["metadata"]["tokenizer.ggml.tokens"].endswith("... (20 items)]")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))  # the producer's own reader agrees
    assert {t.name for t in reader.tensors} == set(tensors)
    with ckptkit.open_source(tmp_path / "m.gguf") as source:
        for name, array in plain.items():
            assert torch.equal(source.load(name), torch.from_numpy(array))


def test_scan_says_safe_and_convert_refuses(tmp_path, run):
    write(tmp_path / "m.gguf")
    scanned = run("scan", tmp_path / "m.gguf")
    assert scanned.exit_code == 0 and scanned.stdout.startswith(
        f"{tmp_path / 'm.gguf'}: safe (gguf)"
    )
    result = run("convert", tmp_path / "m.gguf", "out.safetensors")
    assert result.exit_code != 0
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "GGUF" in line and "does not convert" in line
    assert not (tmp_path / "out.safetensors").exists()


def test_diff_compares_values_and_quantized_bytes(tmp_path, run):
    write(tmp_path / "a.gguf")
    write(tmp_path / "b.gguf", scale=2.0)
    same = run("diff", tmp_path / "a.gguf", tmp_path / "a.gguf")
    assert same.exit_code == 0 and same.stdout.splitlines()[-1] == "equal"
    changed = json.loads(run("diff", tmp_path / "a.gguf", tmp_path / "b.gguf", "--json").stdout)
    assert not changed["equal"]
    different = {t["key"] for t in changed["tensors"] if t["status"] != "equal"}
    assert different == {"token_embd.weight"}


def test_a_cut_gguf_file_is_one_error(tmp_path, run):
    write(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    for command in ("inspect", "scan"):
        result = run(command, tmp_path / "cut.gguf")
        assert result.exit_code != 0
        assert "damaged GGUF" in result.output or "cut" in result.output, result.output


def _nested(depth: int) -> bytes:
    """A GGUF v3 header with no tensors and one key whose value is an array of an array of ...
    ``depth`` deep (llama.cpp writes arrays of scalars and strings only)."""
    import struct

    key = b"general.nested"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    head += struct.pack("<I", 9)  # the value: an array
    head += struct.pack("<IQ", 9, 1) * (depth - 1)  # ... of one array, of one array ...
    return head + struct.pack("<IQ", 0, 1) + b"\x07"  # ... of one uint8


@pytest.mark.parametrize("command", ["inspect", "scan", "diff", "inspect --stats"])
def test_deeply_nested_metadata_arrays_are_one_error(tmp_path, run, command):
    (tmp_path / "deep.gguf").write_bytes(_nested(50_000))
    (tmp_path / "shallow.gguf").write_bytes(_nested(2))
    words = command.split()
    other = [tmp_path / "shallow.gguf"] if command == "diff" else []
    result = run(words[0], tmp_path / "deep.gguf", *other, *words[1:])
    assert result.exit_code != 0 and "Traceback" not in result.output
    if command == "scan":  # a verdict, as for any damaged file
        assert "damaged GGUF file (arrays nested over 4 deep)" in result.output
        return
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "deep.gguf" in line and "nested" in line, line


def test_a_huge_metadata_array_is_shown_by_its_first_items(tmp_path, run):
    """A million-entry token list is described, not kept whole."""
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"t{i}" for i in range(100_000)])
    writer.add_array("test.scores", list(range(1_000_000)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shown = json.loads(run("inspect", path, "--json").output)["metadata"]
    assert shown["tokenizer.ggml.tokens"] == "[t0, t1, t2, t3, t4, t5, t6, t7, ... (100000 items)]"
    assert shown["test.scores"] == "[0, 1, 2, 3, 4, 5, 6, 7, ... (1000000 items)]"
