"""Hostile files built from the public advisories and the techniques ckptkit's scanner must see
through. Every payload only creates a file named ``pwned`` in the current folder, so a test can
prove it is live (the loader runs it) and that ckptkit never does.

``CASES`` maps a name to (builder, loader): the builder returns the file's bytes, the loader
says who runs the payload: ``torch`` (``torch.load(weights_only=False)``), ``pickle``
(``pickle.load`` of the file), ``pickle-stream`` (``pickle.load`` of a stream without ``peek``,
as torch.load's zip path reads ``data.pkl``), ``pickle.loads`` (of the bytes), ``zipfile`` (a
tool that reads the zip another way) or ``none`` (not code execution, but a file no benign
writer makes: it must still not be called safe).
"""

from __future__ import annotations

import io
import pickle
import struct
import tarfile
import zipfile

TOUCH = "open('pwned', 'w').close()"
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def p0_reduce() -> bytes:
    return b"cbuiltins\nexec\n(V" + TOUCH.encode() + b"\ntR."


def p1_reduce() -> bytes:
    # Protocol 1: BINUNICODE and a GLOBAL, no PROTO opcode.
    text = TOUCH.encode()
    return b"cbuiltins\nexec\n(X" + struct.pack("<I", len(text)) + text + b"tR."


def inst_opcode() -> bytes:
    return b"(V" + TOUCH.encode() + b"\nibuiltins\nexec\n."


def obj_opcode() -> bytes:
    return b"(cbuiltins\nexec\nV" + TOUCH.encode() + b"\no."


def builtin_eval() -> bytes:
    # Python 2's module name, mapped to builtins by every Python 3 unpickler.
    return b"c__builtin__\neval\n(V" + b"exec(" + repr(TOUCH).encode() + b")" + b"\ntR."


def no_proto() -> bytes:
    return p2_reduce()[2:]


def p2_reduce() -> bytes:
    text = TOUCH.encode()
    return (
        b"\x80\x02cbuiltins\nexec\nq\x00X"
        + struct.pack("<I", len(text))
        + text
        + b"q\x01\x85q\x02Rq\x03."
    )


def import_getattr() -> bytes:
    # getattr(__import__('builtins'), 'exec')(TOUCH): no dangerous name but the chain.
    return (
        b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vbuiltins\ntRVexec\ntR(V"
        + TOUCH.encode()
        + b"\ntR."
    )


def frame_short() -> bytes:
    # A protocol-4 pickle whose FRAME says 3 bytes; the opcodes read far more. CPython's C
    # unpickler ignores frame lengths, the pure-Python one rejects the file.
    body = _p4_body()
    return b"\x80\x04\x95" + struct.pack("<Q", 3) + body


def frame_nested() -> bytes:
    body = _p4_body()
    half = body.index(b"\x93") + 1  # at an opcode boundary
    return (
        b"\x80\x04\x95"
        + struct.pack("<Q", len(body) + 9)
        + body[:half]
        + b"\x95"
        + struct.pack("<Q", len(body) - half)
        + body[half:]
    )


def _p4_body() -> bytes:
    text = TOUCH.encode()
    return b"\x8c\x08builtins\x8c\x04exec\x93\x8c" + bytes([len(text)]) + text + b"\x85R."


def frame_split() -> bytes:
    """Benign to ``pickle.loads`` and any bytes-based scanner (a string, then 75), hostile to
    ``torch.load`` and ``pickle.load``: reading a file, the C unpickler drops the byte left in
    the 3-byte frame, so every later opcode shifts by one and the payload runs."""
    text = b"x" * 6
    payload = p0_reduce()
    return (
        b"\x80\x04\x95"
        + struct.pack("<Q", 3)
        + b"\x8c"
        + bytes([len(text)])
        + b"X"
        + text[:-1]
        + b"KK."
        + payload
    )


def frame_in_zip() -> bytes:
    return torch_zip(frame_split())


def torch_zip(data_pkl: bytes, extra: dict[str, bytes] | None = None) -> bytes:
    """A zip laid out as torch.save writes it, with the given data.pkl."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/version", b"3\n")
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return out.getvalue()


def hidden_member() -> bytes:
    return torch_zip(pickle.dumps({"a": 1}, protocol=2), {"archive/extra.pkl": p2_reduce()})


def legacy_tar(first_name: bytes = b"storages") -> bytes:
    """torch < 0.1.10's tar format: torch.load tries it before anything else."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        members = [
            ("storages", pickle.dumps(0, protocol=2) + pickle.dumps([], protocol=2)),
            ("tensors", pickle.dumps(0, protocol=2)),
            ("pickle", p2_reduce()),
        ]
        if first_name != b"storages":
            members.insert(0, (first_name.decode("latin1"), b""))
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def tar_pickle_polyglot() -> bytes:
    # The tar's first header starts with a benign pickle (BININT1 1, STOP): pickle.load reads 1,
    # torch.load reads the tar and runs its 'pickle' member.
    return legacy_tar(b"K\x01.")


def legacy_tar_polyglot() -> bytes:
    # The first header starts with torch's legacy magic-number pickle.
    return legacy_tar(pickle.dumps(LEGACY_MAGIC, protocol=2)[:-1] + b".")


def safetensors_lookalike() -> bytes:
    # The first 8 bytes read as a header length (0x564e) and byte 8 is '{'; torch.load reads
    # NONE, a text line, POP, and the payload.
    head = b"NV" + b"\x00" * 6 + b'{"__metadata__":{}}\n' + b"0" + p0_reduce()
    return head + b" " * (0x564E + 8 - len(head) + 16)


def zip_at_end() -> bytes:
    # torch.load and pickle.load read the benign pickle at byte 0; zipfile finds the zip.
    return pickle.dumps({"a": 1}, protocol=2) + torch_zip(p2_reduce())


def build_poison() -> bytes:
    # Names only safe globals, then BUILDs on the storage class itself: an unpickler that hands
    # out shared stand-ins would have them rewritten for every later file.
    return (
        b"\x80\x02ctorch\nFloatStorage\nq\x00}q\x01X\x05\x00\x00\x00dtypeq\x02X\x05\x00\x00\x00"
        b"int32q\x03sb0N."
    )


def computed_global() -> bytes:
    # STACK_GLOBAL of names returned by calls made while loading.
    return (
        b"\x80\x04cbuiltins\nstr\n\x8c\x08builtins\x85R\x8c\x04exec\x93\x8c"
        + bytes([len(TOUCH)])
        + TOUCH.encode()
        + b"\x85R."
    )


def extension_code() -> bytes:
    return b"\x80\x02\x82\x01)R."


def dunder_walk() -> bytes:
    # Protocol 4 resolves dotted names by walking attributes.
    return b"\x80\x04" + _short(b"collections") + _short(b"OrderedDict.__init__.__doc__") + b"\x93."


def _short(text: bytes) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text


def nested_loads() -> bytes:
    inner = p2_reduce()
    return b"\x80\x02cpickle\nloads\nC" + bytes([len(inner)]) + inner + b"\x85R."


CASES = {
    "p0_reduce": (p0_reduce, "pickle"),
    "p1_reduce": (p1_reduce, "pickle"),
    "p2_reduce": (p2_reduce, "pickle"),
    "inst_opcode": (inst_opcode, "pickle"),
    "obj_opcode": (obj_opcode, "pickle"),
    "builtin_eval": (builtin_eval, "pickle"),
    "no_proto": (no_proto, "pickle"),
    "import_getattr": (import_getattr, "pickle"),
    "frame_short": (frame_short, "pickle.loads"),
    "frame_split": (frame_split, "pickle-stream"),
    "frame_nested": (frame_nested, "pickle"),
    "frame_in_zip": (frame_in_zip, "torch"),
    "legacy_tar": (legacy_tar, "torch"),
    "tar_pickle_polyglot": (tar_pickle_polyglot, "torch"),
    "legacy_tar_polyglot": (legacy_tar_polyglot, "torch"),
    "safetensors_lookalike": (safetensors_lookalike, "torch"),
    "zip_at_end": (zip_at_end, "zipfile"),
    "hidden_member": (hidden_member, "zipfile"),
    "computed_global": (computed_global, "pickle"),
    "nested_loads": (nested_loads, "pickle"),
    "build_poison": (build_poison, "none"),
    "extension_code": (extension_code, "none"),
    "dunder_walk": (dunder_walk, "none"),
}
