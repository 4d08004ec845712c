"""One static reading of a pickle: the object tree it describes and everything it would import or
call, without importing or calling anything.

The machine runs every opcode of protocols 0 to 5 the way CPython's C unpickler (what
``pickle.load`` and ``torch.load(weights_only=False)`` use) would, but a global is only a
:class:`Global` record and a call is only interpreted through a caller-given table of pure
handlers (``calls``) or recorded as an :class:`Opaque` object. Nothing a pickle names can reach a
module-level object, so nothing one file does survives into the next.

Both the safety scan and the readers use this one parse, so the verdict and the data read can
never disagree. Bounded: the memo is a dict (a huge memo index costs nothing), the objects built
are budgeted in proportion to the bytes read (a pickle bomb stops with :class:`PickleDamaged` as
soon as what it builds outgrows its size, while a state dict of 100,000 tensors reads whole), and
nothing here recurses. Memo entries no later opcode can read are counted but not kept, so what a
pickle builds and drops (the argument tuples of each tensor torch rebuilds) is freed at once.
Stdlib only.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import mmap
import re
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Global",
    "Opaque",
    "build_state",
    "fields",
    "PickleDamaged",
    "PickleRun",
    "run_pickle",
    "python3_name",
    "BASE_OBJECT_BYTES",
    "OBJECT_BYTES_PER_BYTE",
    "FRAME_PROBLEM",
    "PickleData",
]

#: What the objects a pickle builds may cost, estimated, before it counts as a bomb: this much,
#: plus OBJECT_BYTES_PER_BYTE for every byte of the pickle read so far. The estimate of a torch
#: state dict's pickle is 8 to 14 bytes a byte (short keys: the most); a list of empty lists
#: ("]]]]...") costs 56 a byte and stops within BASE_OBJECT_BYTES / 32 bytes, and a bomb of a few
#: bytes (a memo index of 4G, a list appended to itself) never gets past the base.
BASE_OBJECT_BYTES = 32 * 1024 * 1024
OBJECT_BYTES_PER_BYTE = 24
_HIGHEST_PROTOCOL = 5


class PickleDamaged(Exception):
    """The pickle cannot be read to its STOP: what is wrong and at which byte."""

    def __init__(self, reason: str, pos: int) -> None:
        super().__init__(f"{reason} at byte {pos}")
        self.reason, self.pos = reason, pos


class Global:
    """A global the pickle names: only its dotted name, immutable."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("Global is immutable")

    def __repr__(self) -> str:
        return f"<global {self.name}>"


def build_state(state: Any) -> Any:
    """BUILD's state as one dict when it is a ``(dict_state, slot_state)`` pair (a plain
    ``__dict__``, the common case, and any other state are returned as they are)."""
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], (dict, type(None))):
        return {**(state[0] or {}), **(state[1] if isinstance(state[1], dict) else {})}
    return state


def fields(value: Any) -> dict[str, Any]:
    """A recorded object's fields, as BUILD gave them (``{}`` for anything else)."""
    return value.to_dict() if isinstance(value, Opaque) else {}


class Opaque:
    """What calling a global outside the handled set would have made: a record of the call."""

    def __init__(self, global_name: str, args: tuple[Any, ...] = (), kwargs: Any = None) -> None:
        self.global_name = global_name
        self.args, self.kwargs = args, kwargs or {}
        self.state: Any = None
        self.items: list[Any] = []
        self.mapping: dict[Any, Any] = {}

    def __repr__(self) -> str:
        return f"<{self.global_name}>"

    def to_dict(self) -> dict[str, Any]:
        """What the pickle gave this object, for metadata and display."""
        out: dict[str, Any] = {"__class__": self.global_name}
        state = build_state(self.state)
        if isinstance(state, dict):
            out.update({str(k): v for k, v in state.items()})
        elif state is not None:
            out["state"] = state
        if self.args:
            out["args"] = list(self.args)
        if self.items:
            out["items"] = self.items
        if self.mapping:
            out["mapping"] = self.mapping
        return out


@dataclass
class PickleRun:
    """What one pickle describes and would do.

    ``globals`` and ``calls`` count names (calls: every call of a global outside ``handled``);
    ``problems`` are findings a benign pickler never produces (a computed global, a call of a
    value made at load time, a BUILD on a class, frames that disagree with the opcodes). When the
    pickle is damaged, ``damaged`` says why and everything before the damage is still recorded:
    a real unpickler runs those opcodes before it fails.
    """

    root: Any = None
    globals: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    damaged: str | None = None
    opcodes: int = 0
    protocol: int = 0
    end: int = 0

    def problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)

    def merge(self, other: PickleRun) -> None:
        """Add what another reading of the same bytes would import and call."""
        for name, count in other.globals.items():
            self.globals.setdefault(name, count)
        for name, count in other.calls.items():
            self.calls.setdefault(name, count)
        for text in other.problems:
            self.problem(text)


def python3_name(module: str, name: str) -> str:
    """``module.name`` as Python 3 knows it: protocol 0-2 pickles may say ``__builtin__.exec``."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


FRAME_PROBLEM = "frame boundaries disagree with the opcodes (file and bytes readers differ)"
_MARK = object()
Handler = Callable[..., Any]
#: What the machine reads from: anything indexable and sliceable as bytes (a memory map too).
PickleData = bytes | bytearray | memoryview | mmap.mmap


def _attribute_of_global(target: Global, args: tuple[Any, ...], kwargs: Any) -> str | None:
    """``C.Name`` for ``builtins.getattr(C, "Name")`` on a named global ``C`` (how torch pickles
    a nested class, e.g. ``ShardedTensor.ProcessGroupState``), else None.

    Naming ``C.Name`` is exactly what that call reaches, so it is recorded as a global in its
    own right and judged as one; ``builtins.getattr`` stays recorded too (a safety verdict
    still sees it), and a dunder or a value made at load time is never resolved."""
    if target.name != "builtins.getattr" or kwargs or len(args) != 2:
        return None
    owner, attribute = args
    if not isinstance(owner, Global) or not isinstance(attribute, str):
        return None
    if not attribute.isidentifier() or attribute.startswith("__"):
        return None
    return f"{owner.name}.{attribute}"


class _FullMemo(Exception):  # noqa: N818 - a signal, not an error
    """An opcode read a memo entry that was counted but not kept: run again, keeping all."""


# Memo indices below this are kept always (BINPUT's one-byte indices, read by BINGET); above it,
# only those a LONG_BINGET or GET somewhere ahead may read (see ``_Machine.search``).
_ALWAYS_KEPT = 256
_U32 = struct.Struct("<I")
# Where a LONG_BINGET or GET may start (every byte that could be one: overlapping matches).
_LONG_GET = re.compile(rb"j(?=(.{4}))", re.DOTALL)
_TEXT_GET = re.compile(rb"g(?=([^\n]{1,64})\n)")
_LOOK_AHEAD = 8 * 1024 * 1024  # bytes searched past an index for its readers, at the least
_MAX_READERS = 1 << 18  # more candidate readers than this (crafted bytes): keep every entry
_BITMAP_LIMIT = 1 << 26  # counted indices below this in a bitmap (8 MB at most), above in a set


class _Machine:
    def __init__(
        self,
        data: PickleData,
        pos: int,
        calls: Mapping[str, Handler],
        persistent_load: Callable[[Any], Any] | None,
        budget: int,
        file_mode: bool,
        per_byte: int = OBJECT_BYTES_PER_BYTE,
        keep_all: bool = False,
    ) -> None:
        # Read through find() and slices that give bytes: bytes and memory maps do; a memoryview
        # or bytearray is copied once to bytes.
        self.data: bytes | mmap.mmap = data if isinstance(data, (bytes, mmap.mmap)) else bytes(data)
        self.pos, self.size = pos, len(data)
        self.start = pos
        self.file_mode = file_mode
        self.calls, self.persistent_load = calls, persistent_load
        self.budget, self.per_byte = budget, per_byte
        self.spent = 0
        self.allowed = budget  # what may be spent at the last check; it grows with self.pos
        self.run = PickleRun()
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.frame_end = -1
        # Memo entries no reader can reach are counted (MEMOIZE numbers entries by their count)
        # but not kept; reading one anyway (an index found nowhere ahead) runs the pickle again
        # with every entry kept, so the result is always the one a full memo gives.
        self.keep_all = keep_all
        self.memo_len = 0
        self.counted = bytearray()  # bit per index: counted, not kept
        self.counted_high: set[int] = set()
        self.readers: set[int] = set()  # indices a LONG_BINGET or GET ahead may read
        self.searched = pos  # readers are known for the bytes before this

    # -- reading --------------------------------------------------------------------------
    def fail(self, reason: str) -> PickleDamaged:
        return PickleDamaged(reason, self.pos)

    def read(self, n: int) -> bytes:
        start = self.pos
        if 0 <= self.frame_end and start < self.frame_end < start + n:  # crosses a frame's end
            self.run.problem(FRAME_PROBLEM)
            if self.file_mode:
                # Reading a file, CPython's C unpickler drops what is left of the frame and
                # reads the argument afresh after it; reading bytes, it reads straight on.
                start = self.frame_end
            self.frame_end = -1
        end = start + n
        if n < 0 or end > self.size:
            raise self.fail("pickle data was truncated")
        self.pos = end
        return self.data[start:end]

    def byte(self) -> int:
        """One byte of argument (``read(1)[0]``, without a slice where no frame is near)."""
        pos = self.pos
        if self.frame_end < 0 and pos < self.size:
            self.pos = pos + 1
            return self.data[pos]
        return self.read(1)[0]

    def u32(self) -> int:
        """A 4-byte little-endian argument (LONG_BINPUT's, BINUNICODE's length...)."""
        pos = self.pos
        if self.frame_end < 0 and pos + 4 <= self.size:
            self.pos = pos + 4
            return int(_U32.unpack_from(self.data, pos)[0])
        return int.from_bytes(self.read(4), "little")

    def readline(self) -> bytes:
        # find() on the buffer itself: copying a window per line would be quadratic.
        end = self.data.find(b"\n", self.pos, self.pos + 65536)
        if end < 0:
            if self.pos + 65536 < self.size:
                raise self.fail("text argument longer than 64 KiB")
            raise self.fail("pickle data was truncated")
        return self.read(end + 1 - self.pos)[:-1]

    def cost(self, nbytes: int) -> None:
        self.spent += nbytes
        if self.spent > self.allowed:
            self.over_budget()

    def over_budget(self) -> None:
        """What was spent passed the allowance last computed: compute it for the bytes read by
        now, and stop the pickle if it is still past it."""
        read = self.pos - self.start
        self.allowed = self.budget + self.per_byte * read
        if self.spent > self.allowed:
            raise self.fail(
                f"the objects it builds outgrow its size (an estimated {self.spent >> 20} MiB "
                f"from {read} bytes; {self.budget >> 20} MiB and {self.per_byte} bytes a byte "
                "are allowed; a pickle bomb?)"
            )

    # -- the stack ------------------------------------------------------------------------
    def push(self, value: Any, nbytes: int = 32) -> None:
        self.spent += nbytes  # cost(), inlined: this is the hottest call
        if self.spent > self.allowed:
            self.over_budget()
        self.stack.append(value)

    def pop(self) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.fail("unpickling stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.fail("unpickling stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise self.fail("could not find MARK")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    # -- the memo -------------------------------------------------------------------------
    def search(self, end: int) -> None:
        """Note the memo indices LONG_BINGET and GET arguments in ``data[searched:end]`` name:
        a memo entry past the first ``_ALWAYS_KEPT`` is kept when one of them, in the next
        ``_LOOK_AHEAD`` bytes or more, names it (a superset of its readers: such bytes count
        inside strings too)."""
        begin = max(self.start, self.searched - 70)  # an argument cut by the last boundary
        readers = self.readers
        for match in _LONG_GET.finditer(self.data, begin, end):
            readers.add(int.from_bytes(match[1], "little"))
            if len(readers) > _MAX_READERS:
                return self.keep_everything()
        for match in _TEXT_GET.finditer(self.data, begin, end):
            try:
                readers.add(int(match[1], 0))
            except ValueError:
                continue
            if len(readers) > _MAX_READERS:
                return self.keep_everything()
        self.searched = end

    def keep_everything(self) -> None:
        """Bytes made to look like a multitude of readers: the memo keeps every entry from now
        on (each one budgeted), and the candidates are dropped."""
        self.keep_all = True
        self.readers = set()
        self.searched = self.size

    def put(self, index: int) -> None:
        stack = self.stack
        if len(stack) <= (self.marks[-1] if self.marks else 0) or index < 0:
            raise self.fail("negative PUT argument" if index < 0 else "unpickling stack underflow")
        if index >= _ALWAYS_KEPT and not self.keep_all:
            if self.pos + _LOOK_AHEAD > self.searched and self.searched < self.size:
                self.search(min(self.pos + 2 * _LOOK_AHEAD, self.size))
            if index not in self.readers:  # no reader ahead: counted, not kept
                self.count(index)
                return
        self.spent += 72
        if self.spent > self.allowed:
            self.over_budget()
        memo = self.memo
        if index not in memo and (index < _ALWAYS_KEPT or not self.is_counted(index)):
            self.memo_len += 1
        memo[index] = stack[-1]

    def count(self, index: int) -> None:
        """A memo entry no reader can reach: counted once (what MEMOIZE numbers by), not kept."""
        if index < _BITMAP_LIMIT:
            byte, bit = index >> 3, 1 << (index & 7)
            counted = self.counted
            if byte >= len(counted):
                counted.extend(bytes(byte + 1 - len(counted) + 4096))
            elif counted[byte] & bit:
                return
            counted[byte] |= bit
            self.spent += 8
        elif index in self.counted_high:
            return
        else:
            self.counted_high.add(index)
            self.spent += 72
        if self.spent > self.allowed:
            self.over_budget()
        self.memo_len += 1

    def is_counted(self, index: int) -> bool:
        if index < _BITMAP_LIMIT:
            byte = index >> 3
            return byte < len(self.counted) and bool(self.counted[byte] >> (index & 7) & 1)
        return index in self.counted_high

    def get(self, index: int) -> None:
        memo = self.memo
        if index in memo:
            self.push(memo[index], 8)
        elif self.is_counted(index):
            raise _FullMemo
        else:
            raise self.fail(f"memo value not found at index {index}")

    # -- globals and calls ----------------------------------------------------------------
    def name_global(self, module: str, name: str) -> Global:
        full = python3_name(module, name) if self.run.protocol < 3 else f"{module}.{name}"
        self.run.globals[full] = self.run.globals.get(full, 0) + 1
        return Global(full)

    def call(self, target: Any, args: tuple[Any, ...], kwargs: Any = None) -> Any:
        if not isinstance(target, Global):
            self.run.problem("call of a value made at load time (not a named global)")
            return Opaque("<computed>", args, kwargs)
        name = _attribute_of_global(target, args, kwargs)
        if name is not None:  # getattr(<global>, "Name"): the global <global>.Name, as named
            self.run.globals[name] = self.run.globals.get(name, 0) + 1
            return Global(name)
        handler = self.calls.get(target.name)
        if handler is None:
            self.run.calls[target.name] = self.run.calls.get(target.name, 0) + 1
            return Opaque(target.name, args, kwargs)
        try:
            return handler(*args, **(kwargs or {}))
        except PickleDamaged:
            raise
        except Exception as exc:  # a handler refusing its arguments: the pickle is malformed
            raise self.fail(f"{target.name} with bad arguments ({exc})") from exc

    def build(self, inst: Any, state: Any) -> None:
        if isinstance(inst, Opaque):
            inst.state = state
        elif isinstance(inst, Global):
            # Real unpicklers would set attributes on the class or function itself.
            self.run.problem(f"BUILD on {inst.name} itself (it would change the global)")
        elif type(inst) in (dict, OrderedDict) and isinstance(state, dict):
            pass  # an OrderedDict's _metadata: kept by torch, irrelevant to the weights
        elif hasattr(inst, "__pickle_build__"):
            inst.__pickle_build__(state)
        else:
            raise self.fail(f"BUILD on a {type(inst).__name__}")

    # -- the loop -------------------------------------------------------------------------
    def execute(self) -> Any:
        ops = _OP_TABLE
        data, size = self.data, self.size
        count = 0
        try:
            while True:
                pos = self.pos
                if pos >= size:
                    raise self.fail("pickle exhausted before seeing STOP")
                code = data[pos]
                if pos == self.frame_end:
                    self.frame_end = -1
                self.pos = pos + 1
                op = ops[code]
                if op is None:
                    raise self.fail(f"invalid opcode {code:#04x}")
                count += 1
                if op is _stop:
                    value = self.pop()
                    self.run.end = self.pos
                    return value
                op(self)
        finally:
            self.run.opcodes += count


def _int_of(text: bytes, m: _Machine) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise m.fail("bad integer literal") from None


# Each opcode as a function of the machine. Names follow pickletools.
def _stop(m: _Machine) -> None:  # handled in the loop
    pass


def _mark(m: _Machine) -> None:
    m.marks.append(len(m.stack))


def _pop(m: _Machine) -> None:
    if len(m.stack) > (m.marks[-1] if m.marks else 0):
        m.stack.pop()
    else:
        m.pop_mark()


def _pop_mark(m: _Machine) -> None:
    m.pop_mark()


def _dup(m: _Machine) -> None:
    m.push(m.top(), 8)


def _proto(m: _Machine) -> None:
    proto = m.read(1)[0]
    if proto > _HIGHEST_PROTOCOL:
        raise m.fail(f"unsupported pickle protocol {proto}")
    m.run.protocol = proto


def _frame(m: _Machine) -> None:
    (length,) = struct.unpack("<Q", m.read(8))
    if m.frame_end >= 0 and m.pos < m.frame_end:
        m.run.problem("a frame starts inside another (pickle readers differ)")
    if length > m.size - m.pos:
        raise m.fail("pickle data was truncated (frame longer than the data)")
    m.frame_end = m.pos + length


def _int(m: _Machine) -> None:
    text = m.readline()
    if text == b"00":
        m.push(False)
    elif text == b"01":
        m.push(True)
    else:
        m.push(_int_of(text, m))


def _long(m: _Machine) -> None:
    text = m.readline()
    m.push(_int_of(text[:-1] if text.endswith(b"L") else text, m))


def _binint(m: _Machine) -> None:
    m.push(struct.unpack("<i", m.read(4))[0])


def _binint1(m: _Machine) -> None:
    pos = m.pos
    if m.frame_end < 0 and pos < m.size:
        m.pos = pos + 1
        m.push(m.data[pos])
    else:
        m.push(m.read(1)[0])


def _binint2(m: _Machine) -> None:
    m.push(int.from_bytes(m.read(2), "little"))


def _long1(m: _Machine) -> None:
    n = m.read(1)[0]
    m.push(int.from_bytes(m.read(n), "little", signed=True), 32 + n)


def _long4(m: _Machine) -> None:
    (n,) = struct.unpack("<i", m.read(4))
    if n < 0:
        raise m.fail("LONG pickle has negative byte count")
    m.push(int.from_bytes(m.read(n), "little", signed=True), 32 + n)


def _float(m: _Machine) -> None:
    try:
        m.push(float(m.readline()))
    except ValueError:
        raise m.fail("bad float literal") from None


def _binfloat(m: _Machine) -> None:
    m.push(struct.unpack(">d", m.read(8))[0])


def _none(m: _Machine) -> None:
    m.push(None, 8)


def _newtrue(m: _Machine) -> None:
    m.push(True, 8)


def _newfalse(m: _Machine) -> None:
    m.push(False, 8)


def _text(m: _Machine, raw: bytes) -> None:
    # Protocol 0-2 strings: unpicklers called with encoding="latin1" (as torch's are) give str.
    m.push(raw.decode("latin1"), 56 + len(raw))


def _string(m: _Machine) -> None:
    line = m.readline()
    if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b"'", b'"'):
        raise m.fail("the STRING opcode argument must be quoted")
    try:
        raw = codecs.escape_decode(line[1:-1])[0]
    except ValueError:
        raise m.fail("bad escape in STRING") from None
    _text(m, raw)


def _binstring(m: _Machine) -> None:
    (n,) = struct.unpack("<i", m.read(4))
    if n < 0:
        raise m.fail("BINSTRING pickle has negative byte count")
    _text(m, m.read(n))


def _short_binstring(m: _Machine) -> None:
    _text(m, m.read(m.read(1)[0]))


def _unicode_of(m: _Machine, raw: bytes, encoding: str) -> None:
    try:
        m.push(raw.decode(encoding, "surrogatepass"), 56 + len(raw))
    except UnicodeDecodeError:
        raise m.fail("undecodable text") from None


def _unicode(m: _Machine) -> None:
    _unicode_of(m, m.readline(), "raw-unicode-escape")


def _binunicode(m: _Machine) -> None:
    _unicode_of(m, m.read(m.u32()), "utf-8")


def _short_binunicode(m: _Machine) -> None:
    _unicode_of(m, m.read(m.byte()), "utf-8")


def _binunicode8(m: _Machine) -> None:
    (n,) = struct.unpack("<Q", m.read(8))
    if n > sys.maxsize:
        raise m.fail("BINUNICODE8 exceeds system's maximum size")
    _unicode_of(m, m.read(n), "utf-8")


def _bytes_n(m: _Machine, n: int, kind: type = bytes) -> None:
    raw = m.read(n)
    m.push(kind(raw), 40 + n)


def _binbytes(m: _Machine) -> None:
    _bytes_n(m, struct.unpack("<I", m.read(4))[0])


def _short_binbytes(m: _Machine) -> None:
    _bytes_n(m, m.read(1)[0])


def _binbytes8(m: _Machine) -> None:
    _bytes_n(m, struct.unpack("<Q", m.read(8))[0])


def _bytearray8(m: _Machine) -> None:
    _bytes_n(m, struct.unpack("<Q", m.read(8))[0], bytearray)


def _next_buffer(m: _Machine) -> None:
    raise m.fail("out-of-band buffer (NEXT_BUFFER) with no buffers given")


def _readonly_buffer(m: _Machine) -> None:
    m.top()


def _empty_list(m: _Machine) -> None:
    m.push([], 56)


def _empty_tuple(m: _Machine) -> None:
    m.push((), 8)


def _empty_dict(m: _Machine) -> None:
    m.push({}, 64)


def _empty_set(m: _Machine) -> None:
    m.push(set(), 216)


def _list(m: _Machine) -> None:
    items = m.pop_mark()
    m.push(items, 56 + 8 * len(items))


def _tuple(m: _Machine) -> None:
    items = m.pop_mark()
    m.push(tuple(items), 40 + 8 * len(items))


def _tuple_n(n: int) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        stack = m.stack
        if len(stack) - n < (m.marks[-1] if m.marks else 0):
            raise m.fail("unpickling stack underflow")
        items = tuple(stack[-n:])
        del stack[-n:]
        m.push(items, 40 + 8 * n)

    return op


def _hashable(m: _Machine, key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise m.fail(f"unhashable {type(key).__name__} as a key") from None
    return key


def _dict(m: _Machine) -> None:
    items = m.pop_mark()
    if len(items) % 2:
        raise m.fail("odd number of items for DICT")
    m.push(
        {_hashable(m, k): v for k, v in zip(items[::2], items[1::2], strict=True)},
        64 + 50 * len(items),
    )


def _frozenset(m: _Machine) -> None:
    items = m.pop_mark()
    m.push(frozenset(_hashable(m, i) for i in items), 216 + 40 * len(items))


def _append_to(m: _Machine, target: Any, items: list[Any]) -> None:
    m.cost(8 * len(items))
    if type(target) is list:
        target.extend(items)
    elif isinstance(target, Opaque):
        target.items.extend(items)
    else:
        raise m.fail(f"APPEND to a {type(target).__name__}")


def _append(m: _Machine) -> None:
    value = m.pop()
    _append_to(m, m.top(), [value])


def _appends(m: _Machine) -> None:
    items = m.pop_mark()
    _append_to(m, m.top(), items)


def _set_items(m: _Machine, target: Any, items: list[Any]) -> None:
    m.cost(50 * len(items))
    for key, value in zip(items[::2], items[1::2], strict=True):
        if isinstance(target, dict):
            target[_hashable(m, key)] = value
        elif isinstance(target, Opaque):
            target.mapping[_hashable(m, key)] = value
        elif type(target) is list and type(key) is int and -len(target) <= key < len(target):
            target[key] = value
        else:
            raise m.fail(f"SETITEM on a {type(target).__name__}")


def _setitem(m: _Machine) -> None:
    value, key = m.pop(), m.pop()
    _set_items(m, m.top(), [key, value])


def _setitems(m: _Machine) -> None:
    items = m.pop_mark()
    if len(items) % 2:
        raise m.fail("odd number of items for SETITEMS")
    _set_items(m, m.top(), items)


def _additems(m: _Machine) -> None:
    items = m.pop_mark()
    target = m.top()
    m.cost(40 * len(items))
    if type(target) is set:
        target.update(_hashable(m, i) for i in items)
    elif isinstance(target, Opaque):
        target.items.extend(items)
    else:
        raise m.fail(f"ADDITEMS to a {type(target).__name__}")


def _global(m: _Machine) -> None:
    try:
        module = m.readline().decode("utf-8")
        name = m.readline().decode("utf-8")
    except UnicodeDecodeError:
        raise m.fail("undecodable GLOBAL name") from None
    m.push(m.name_global(module, name), 64)


def _stack_global(m: _Machine) -> None:
    name, module = m.pop(), m.pop()
    if isinstance(name, Opaque) or isinstance(module, Opaque):
        # A name a call returned: the real unpickler imports whatever it turns out to be.
        m.run.problem("computed global: STACK_GLOBAL with a name built at load time")
        m.push(Global("<computed>"), 64)
    elif type(name) is not str or type(module) is not str:
        raise m.fail("STACK_GLOBAL requires str")
    else:
        m.push(m.name_global(module, name), 64)


def _inst(m: _Machine) -> None:
    cls = _global_from_lines(m)
    args = m.pop_mark()
    m.push(m.call(cls, tuple(args)), 64)


def _global_from_lines(m: _Machine) -> Global:
    try:
        module = m.readline().decode("ascii")
        name = m.readline().decode("ascii")
    except UnicodeDecodeError:
        raise m.fail("undecodable INST name") from None
    return m.name_global(module, name)


def _obj(m: _Machine) -> None:
    items = m.pop_mark()
    if not items:
        raise m.fail("OBJ with no class")
    m.push(m.call(items[0], tuple(items[1:])), 64)


def _reduce(m: _Machine) -> None:
    args = m.pop()
    func = m.pop()
    if type(args) is not tuple:
        raise m.fail("REDUCE arguments must be a tuple")
    m.push(m.call(func, args), 64)


def _newobj(m: _Machine) -> None:
    args = m.pop()
    cls = m.pop()
    if type(args) is not tuple:
        raise m.fail("NEWOBJ expected an arg tuple")
    m.push(m.call(cls, args), 64)


def _newobj_ex(m: _Machine) -> None:
    kwargs = m.pop()
    args = m.pop()
    cls = m.pop()
    if type(args) is not tuple or type(kwargs) is not dict:
        raise m.fail("NEWOBJ_EX expects a tuple and a dict")
    m.push(m.call(cls, args, kwargs), 64)


def _build(m: _Machine) -> None:
    state = m.pop()
    m.build(m.top(), state)


def _ext(n: int) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        code = int.from_bytes(m.read(n), "little")
        m.run.problem(f"extension code {code}: a global from copyreg's registry")
        m.push(Opaque(f"<extension {code}>"), 64)

    return op


def _persid(m: _Machine) -> None:
    try:
        pid = m.readline().decode("ascii")
    except UnicodeDecodeError:
        raise m.fail("persistent IDs in protocol 0 must be ASCII strings") from None
    _persistent(m, pid)


def _binpersid(m: _Machine) -> None:
    _persistent(m, m.pop())


def _persistent(m: _Machine, pid: Any) -> None:
    if m.persistent_load is None:
        raise m.fail("a persistent id, which plain pickle.load refuses")
    try:
        m.push(m.persistent_load(pid), 64)
    except PickleDamaged:
        raise
    except Exception as exc:
        raise m.fail(f"bad persistent id ({exc})") from exc


def _get(m: _Machine) -> None:
    m.get(_int_of(m.readline(), m))


def _binget(m: _Machine) -> None:
    m.get(m.byte())


def _long_binget(m: _Machine) -> None:
    m.get(m.u32())


def _put(m: _Machine) -> None:
    m.put(_int_of(m.readline(), m))


def _binput(m: _Machine) -> None:
    m.put(m.byte())


def _long_binput(m: _Machine) -> None:
    pos = m.pos
    if m.frame_end < 0 and pos + 4 <= m.size:
        m.pos = pos + 4
        m.put(_U32.unpack_from(m.data, pos)[0])
    else:
        m.put(int.from_bytes(m.read(4), "little"))


def _memoize(m: _Machine) -> None:
    m.put(m.memo_len)


# A table, several opcodes a line in the protocols' order (0 and 1; 2 from "\x80"; 3's "B" and
# "C"; 4 from "\x8c"; 5 from "\x96"): `fmt: skip` keeps it one.
_OPS: dict[int, Callable[[_Machine], None]] = {
    ord(code): fn
    for code, fn in {
        "(": _mark, ".": _stop, "0": _pop, "1": _pop_mark, "2": _dup, "F": _float, "I": _int,
        "J": _binint, "K": _binint1, "L": _long, "M": _binint2, "N": _none, "P": _persid,
        "Q": _binpersid, "R": _reduce, "S": _string, "T": _binstring, "U": _short_binstring,
        "V": _unicode, "X": _binunicode, "a": _append, "b": _build, "c": _global, "d": _dict,
        "}": _empty_dict, "e": _appends, "g": _get, "h": _binget, "i": _inst, "j": _long_binget,
        "l": _list, "]": _empty_list, "o": _obj, "p": _put, "q": _binput, "r": _long_binput,
        "s": _setitem, "t": _tuple, ")": _empty_tuple, "u": _setitems, "G": _binfloat,
        "\x80": _proto, "\x81": _newobj, "\x82": _ext(1), "\x83": _ext(2), "\x84": _ext(4),
        "\x85": _tuple_n(1), "\x86": _tuple_n(2), "\x87": _tuple_n(3), "\x88": _newtrue,
        "\x89": _newfalse, "\x8a": _long1, "\x8b": _long4, "B": _binbytes, "C": _short_binbytes,
        "\x8c": _short_binunicode, "\x8d": _binunicode8, "\x8e": _binbytes8, "\x8f": _empty_set,
        "\x90": _additems, "\x91": _frozenset, "\x92": _newobj_ex, "\x93": _stack_global,
        "\x94": _memoize, "\x95": _frame, "\x96": _bytearray8, "\x97": _next_buffer,
        "\x98": _readonly_buffer,
    }.items()
}  # fmt: skip
_OP_TABLE: list[Callable[[_Machine], None] | None] = [_OPS.get(code) for code in range(256)]


def run_pickle(
    data: PickleData,
    start: int = 0,
    *,
    calls: Mapping[str, Handler] | None = None,
    persistent_load: Callable[[Any], Any] | None = None,
    budget: int = BASE_OBJECT_BYTES,
    per_byte: int = OBJECT_BYTES_PER_BYTE,
    file_mode: bool = False,
) -> PickleRun:
    """Read one pickle from ``data[start:]`` statically; never raises on bad input.

    Args:
        data: the bytes holding the pickle.
        start: where it begins.
        calls: global name -> pure function standing in for it when the pickle calls it; any
            other call becomes an :class:`Opaque` record and is listed in ``calls``.
        persistent_load: interprets persistent ids (None: they make the pickle damaged, as
            they do for plain ``pickle.load``).
        budget: estimated bytes the objects built may cost whatever the pickle's size...
        per_byte: ...and how many more for each byte of the pickle read so far.
        file_mode: read as the C unpickler reads a file (``torch.load``, ``pickle.load``)
            rather than bytes (``pickle.loads``); the two differ only where an opcode crosses
            the end of a FRAME, which ``run.problems`` reports either way.

    Returns:
        The run: the root object (None when damaged), globals, calls, problems, damage, and
        where the pickle ended.
    """
    try:
        return _run(data, start, calls, persistent_load, budget, per_byte, file_mode, False)
    except _FullMemo:  # a memo entry not kept was read after all: again, keeping every one
        return _run(data, start, calls, persistent_load, budget, per_byte, file_mode, True)


def _run(
    data: PickleData,
    start: int,
    calls: Mapping[str, Handler] | None,
    persistent_load: Callable[[Any], Any] | None,
    budget: int,
    per_byte: int,
    file_mode: bool,
    keep_all: bool,
) -> PickleRun:
    machine = _Machine(
        data, start, calls or {}, persistent_load, budget, file_mode, per_byte, keep_all
    )
    try:
        machine.run.root = machine.execute()
    except PickleDamaged as exc:
        machine.run.damaged = str(exc)
        machine.run.end = machine.pos
    except RecursionError:  # a handler given absurdly nested arguments
        machine.run.damaged = f"nesting too deep at byte {machine.pos}"
        machine.run.end = machine.pos
    return machine.run
