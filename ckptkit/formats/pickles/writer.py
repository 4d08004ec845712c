"""A small pickle writer for the pickles ckptkit writes: torch's pickle of a state dict and
DCP's ``.metadata``.

Those pickles name torch's functions and classes (``torch._utils._rebuild_tensor_v2``,
``torch.FloatStorage``, DCP's dataclasses). Python's pickler writes a name only after importing
its module to check it, which costs a second of importing torch for a pickle of a few
kilobytes. Here a name is a :class:`Ref`, written as the ``GLOBAL`` opcode directly; the rest
is written with the opcodes ``pickle`` uses at protocol 2 for the same values, so both
``pickle.load`` and ``torch.load`` read it as they read their own.

Values: None, bool, int, float, str, tuple, list, dict, ``OrderedDict``, and
- :class:`Ref`: a global by name;
- :class:`Call`: ``func(*args)`` at load (``REDUCE``);
- :class:`New`: ``cls.__new__(cls)`` then ``BUILD`` with a state (how a dataclass pickles);
- :class:`PersistentId`: handed to the loader's ``persistent_load`` (torch's storages).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["Ref", "Call", "New", "PersistentId", "dumps"]


@dataclass(frozen=True)
class Ref:
    module: str
    name: str


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so usable as dict keys
class Call:
    func: Ref
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, eq=False)
class New:
    cls: Ref
    state: Any


@dataclass(frozen=True, eq=False)
class PersistentId:
    value: Any


_ORDERED_DICT = Ref("collections", "OrderedDict")


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.memo: dict[Ref, int] = {}

    def save(self, obj: Any) -> None:  # noqa: C901 - one branch per kind of value
        out = self.out
        if obj is None:
            out += b"N"
        elif obj is True or obj is False:
            out += b"\x88" if obj else b"\x89"
        elif type(obj) is int:
            self.save_int(obj)
        elif type(obj) is float:
            out += b"G" + struct.pack(">d", obj)
        elif type(obj) is str:
            data = obj.encode("utf-8", "surrogatepass")
            out += b"X" + struct.pack("<I", len(data)) + data
        elif type(obj) is tuple:
            self.save_tuple(obj)
        elif type(obj) is list:
            out += b"]"
            if obj:
                out += b"("
                for item in obj:
                    self.save(item)
                out += b"e"  # APPENDS
        elif isinstance(obj, OrderedDict):
            self.save(Call(_ORDERED_DICT))
            self.save_items(obj)
        elif type(obj) is dict:
            out += b"}"
            self.save_items(obj)
        elif isinstance(obj, Ref):
            self.save_ref(obj)
        elif isinstance(obj, Call):
            self.save(obj.func)
            self.save_tuple(obj.args)
            out += b"R"  # REDUCE
        elif isinstance(obj, New):
            self.save(obj.cls)
            out += b")\x81"  # EMPTY_TUPLE, NEWOBJ
            self.save(obj.state)
            out += b"b"  # BUILD
        elif isinstance(obj, PersistentId):
            self.save(obj.value)
            out += b"Q"  # BINPERSID
        else:
            raise TypeError(f"cannot pickle {type(obj).__name__}")

    def save_int(self, n: int) -> None:
        if 0 <= n < 1 << 8:
            self.out += b"K" + bytes([n])
        elif 0 <= n < 1 << 16:
            self.out += b"M" + struct.pack("<H", n)
        elif -(1 << 31) <= n < 1 << 31:
            self.out += b"J" + struct.pack("<i", n)
        else:  # LONG1: little-endian two's complement, as few bytes as hold it
            data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(data)]) + data

    def save_tuple(self, items: tuple[Any, ...]) -> None:
        if not items:
            self.out += b")"
            return
        if len(items) > 3:
            self.out += b"("
        for item in items:
            self.save(item)
        self.out += b"t" if len(items) > 3 else b"\x85\x86\x87"[len(items) - 1 : len(items)]

    def save_items(self, mapping: dict[Any, Any]) -> None:
        if not mapping:
            return
        self.out += b"("
        for key, value in mapping.items():
            self.save(key)
            self.save(value)
        self.out += b"u"  # SETITEMS

    def save_ref(self, ref: Ref) -> None:
        index = self.memo.get(ref)
        if index is not None:  # BINGET / LONG_BINGET
            self.out += b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)
            return
        self.out += b"c" + f"{ref.module}\n{ref.name}\n".encode()
        index = self.memo[ref] = len(self.memo)
        self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)


def dumps(obj: Any) -> bytes:
    """The pickle (protocol 2) of ``obj``, built from the values above."""
    writer = _Writer()
    writer.save(obj)
    writer.out += b"."
    return bytes(writer.out)
