"""Damaged inputs, generated from a seed: truncations, bit flips, broken zip fields, pickle bombs,
huge or negative declared sizes, strict-safetensors violations, and paths that are no file.

``corpus(folder, seed)`` writes them and returns ``{name: path}``; ``must_fail`` names the ones
no command may accept (a bit flip in tensor bytes is a valid file, so not every case is there).
"""

from __future__ import annotations

import json
import os
import random
import struct
import zipfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _zip_with(data_pkl: bytes, *, compress: int = zipfile.ZIP_STORED) -> bytes:
    import io

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compress) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/data/0", b"\0" * 16)
    return out.getvalue()


def _tensor_pickle(numel: int, shape: tuple, offset: int = 0) -> bytes:
    """A torch data.pkl for {'w': tensor} with the given storage size, shape and offset."""
    import pickle

    dims = b"".join(b"J" + struct.pack("<i", d) for d in shape)
    tup = b"(" + dims + b"t"
    return (
        b"\x80\x02}X\x01\x00\x00\x00w"
        + b"ctorch._utils\n_rebuild_tensor_v2\n("
        + b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu"
        + pickle.dumps(numel, 2)[2:-1]
        + b"tQ"
        + b"J"
        + struct.pack("<i", offset)
        + tup
        + tup
        + b"\x89ccollections\nOrderedDict\n)RtRs."
    )


def _zip_fields(base: bytes) -> dict[str, bytes]:
    """Variants of a torch zip with one header field broken."""
    out = {}
    cd = base.rfind(b"PK\x01\x02")  # the last central-directory entry
    first_cd = base.find(b"PK\x01\x02")
    eocd = base.rfind(b"PK\x05\x06")

    def patch(data: bytes, at: int, value: bytes) -> bytes:
        return data[:at] + value + data[at + len(value) :]

    # Unknown compression method (99) in the first entry's local and central headers.
    out["zip_compression"] = patch(patch(base, 8, b"\x63\x00"), first_cd + 10, b"\x63\x00")
    out["zip_bad_crc"] = patch(base, first_cd + 16, b"\xde\xad\xbe\xef")
    out["zip_offset_past_end"] = patch(base, cd + 42, struct.pack("<I", len(base) + 4096))
    out["zip_local_name"] = patch(base, 30, b"Z")  # the local header names another file
    name_len = struct.unpack_from("<H", base, first_cd + 28)[0]
    bad_name = b"\xff\xfe" + b"x" * (name_len - 2)
    flagged = patch(base, first_cd + 8, struct.pack("<H", 0x800))  # "names are UTF-8"
    out["zip_non_utf8_name"] = patch(flagged, first_cd + 46, bad_name)
    out["zip_huge_size"] = patch(base, first_cd + 24, struct.pack("<I", 0xFFFFFFF0))
    out["zip_eocd_count"] = patch(base, eocd + 10, struct.pack("<H", 0xFFFF))
    out["zip_cd_offset"] = patch(base, eocd + 16, struct.pack("<I", 0xFFFFFFF0))
    return out


def _pickle_bombs() -> dict[str, bytes]:
    memo = b"\x80\x02K\x01r\xff\xff\xff\xff0]."  # a memo index of 4G: one entry, not 4G of them
    lists = b"\x80\x02(" + b"]" * 20_000_000 + b"l."  # 20M lists from 20 MB
    # A list that holds itself, appended to itself a million times.
    cycle = b"\x80\x02]q\x00" + b"h\x00a" * 1_000_000 + b"."
    # 100 levels, each a list of the previous twice: 2**100 paths, 200 objects.
    dag = b"\x80\x02]q\x00" + b"".join(b"(h\x00h\x00lq\x00" for _ in range(100)) + b"."
    deep = b"\x80\x02" + b"]" * 200_000 + b"a" * 199_999 + b"."
    return {
        "pickle_memo_bomb": memo,
        "pickle_list_bomb": lists,
        "pickle_cycle": cycle,
        "pickle_dag": dag,
        "pickle_deep": deep,
    }


def _safetensors_variants() -> dict[str, bytes]:
    raw = (FIXTURES / "single.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    first = next(k for k in header if k != "__metadata__")

    def build(mutate) -> bytes:
        h = json.loads(json.dumps(header))
        mutate(h)
        text = json.dumps(h).encode()
        return struct.pack("<Q", len(text)) + text + data

    return {
        "st_negative_offset": build(lambda h: h[first].update(data_offsets=[-16, 8])),
        "st_negative_shape": build(lambda h: h[first].update(shape=[-1, 4])),
        "st_float_shape": build(lambda h: h[first].update(shape=[2.5])),
        "st_metadata_int": build(lambda h: h.setdefault("__metadata__", {}).update(x=1)),
        "st_overlap": build(lambda h: h[first].update(data_offsets=[0, 0])),
        "st_unknown_dtype": build(lambda h: h[first].update(dtype="F33")),
        "st_header_too_long": struct.pack("<Q", 2**40) + raw[8:],
        "st_trailing": raw + b"\0" * 8,
    }


def corpus(folder: Path, seed: int = 0) -> dict[str, Path]:
    """Write every damaged input into ``folder``; return {name: path}."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for base_name in ("single.pt", "legacy_dp.pt", "single.safetensors", "training.pt"):
        base = (FIXTURES / base_name).read_bytes()
        stem = base_name.replace(".", "_")
        for i in range(6):
            files[f"{stem}_cut{i}"] = base[: rng.randrange(1, len(base))]
        for i in range(6):
            flipped = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            files[f"{stem}_flip{i}"] = bytes(flipped)
    files.update(_zip_fields((FIXTURES / "single.pt").read_bytes()))
    for name, data in _pickle_bombs().items():
        files[name] = data
        files[name + "_in_zip"] = _zip_with(data)
    files["zip_bomb"] = _zip_with(
        b"\x80\x02(" + b"]" * (100 * 1024 * 1024) + b"l.", compress=zipfile.ZIP_DEFLATED
    )
    files["huge_storage"] = _zip_with(_tensor_pickle(2**60, (4,)))
    files["huge_shape"] = _zip_with(_tensor_pickle(4, (2**31 - 1, 2**31 - 1)))
    files["negative_shape"] = _zip_with(_tensor_pickle(4, (-4,)))
    files["negative_offset"] = _zip_with(_tensor_pickle(4, (4,), offset=-8))
    files["past_storage"] = _zip_with(_tensor_pickle(4, (4,), offset=3))
    files.update(_safetensors_variants())
    files["empty"] = b""
    files["random"] = bytes(rng.randrange(256) for _ in range(4096))
    out = {}
    for name, data in files.items():
        path = folder / f"{name}.bin"
        path.write_bytes(data)
        out[name] = path
    fifo = folder / "fifo.pt"
    os.mkfifo(fifo)
    out["fifo"] = fifo
    loop = folder / "loop.pt"
    os.symlink(loop, loop)
    out["symlink_loop"] = loop
    dangling = folder / "dangling.pt"
    os.symlink(folder / "nothing-here", dangling)
    out["symlink_dangling"] = dangling
    out["dev_zero"] = Path("/dev/zero")
    out["folder"] = folder / "a-folder"
    out["folder"].mkdir()
    return out


def must_fail(name: str) -> bool:
    """Inputs that are damaged wherever they are read (flips may land in tensor bytes)."""
    tolerated = (
        "pickle_memo_bomb",
        "pickle_dag",
        "pickle_cycle",
        "pickle_deep",
        # torch loads these too: the data is intact, only a count or offset is odd.
        "zip_eocd_count",
        "zip_cd_offset",
    )
    return "_flip" not in name and name not in tolerated
