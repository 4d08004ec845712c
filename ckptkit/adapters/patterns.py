"""Regular expressions from an adapter's config, matched in linear time.

``adapter_config.json`` holds patterns that peft matches with Python's ``re`` (``rank_pattern``
and ``alpha_pattern`` keys, a string ``target_modules``, ``trainable_token_indices`` keys). A
backtracking matcher takes exponential time on patterns such as ``(a+)+$``, so a hostile config
would hang ``inspect`` and ``convert`` for good. Here a pattern is parsed with Python's own
parser (the same syntax, the same quirks) and run as a Thompson NFA: the set of states the
pattern can be in is carried along the text one character at a time, so a match costs at most
``len(text) + 1`` passes over the pattern's states. Sets already seen are remembered (a lazy
DFA), so a real pattern costs a dict lookup per character.

Supported: literals, classes, ``.``, alternation, groups, greedy and lazy repeats (bounded ones
expanded, the total of states capped), the anchors ``^ $ \\A \\Z \\b \\B`` and the flags
``i m s x a u``. Refused, naming the pattern: backreferences, lookarounds, conditionals, atomic
groups and possessive repeats (their meaning is the backtracking itself). Only whether a pattern
matches is asked, so lazy and greedy repeats are the same here. Stdlib only.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

try:  # Python's own regex parser: re._parser from 3.11, sre_parse before (the same code)
    C: Any = importlib.import_module("re._constants")
    _parser: Any = importlib.import_module("re._parser")
except ImportError:
    C = importlib.import_module("sre_constants")
    _parser = importlib.import_module("sre_parse")

__all__ = ["PatternError", "Pattern", "KeyTable", "MAX_STATES", "peft_key_pattern", "full_pattern"]

# A real pattern has tens of states; this bounds the work per character of a hostile one
# (``a{1000}{1000}`` would expand to a million).
MAX_STATES = 4096
# Remembered steps of the lazy DFA, cleared when full: bounds memory, not time.
_CACHE_LIMIT = 1 << 14

_CHAR, _SPLIT, _ASSERT, _MATCH = range(4)
_UNSUPPORTED = {
    C.GROUPREF: "a backreference",
    C.GROUPREF_EXISTS: "a conditional group",
    C.ASSERT: "a lookahead or lookbehind",
    C.ASSERT_NOT: "a negative lookahead or lookbehind",
    C.ATOMIC_GROUP: "an atomic group",
    C.POSSESSIVE_REPEAT: "a possessive repeat",
}


class PatternError(ValueError):
    """A pattern that does not parse, or that needs backtracking to mean what it says."""


def _is_word(c: str | None, ascii_only: bool) -> bool:
    if c is None:
        return False
    if ascii_only:
        return c.isascii() and (c.isalnum() or c == "_")
    return c.isalnum() or c == "_"


def _category(name: object, flags: int) -> Callable[[str], bool]:
    """``\\d \\s \\w`` and their negations, as SRE tests them (Unicode unless ``a``)."""
    ascii_only = bool(flags & re.ASCII)
    tests: dict[object, Callable[[str], bool]] = {
        C.CATEGORY_DIGIT: (lambda c: "0" <= c <= "9") if ascii_only else (lambda c: c.isdecimal()),
        C.CATEGORY_SPACE: (lambda c: c in " \t\n\r\f\v") if ascii_only else (lambda c: c.isspace()),
        C.CATEGORY_WORD: lambda c: _is_word(c, ascii_only),
        C.CATEGORY_LINEBREAK: lambda c: c == "\n",
    }
    negated = {
        C.CATEGORY_NOT_DIGIT: C.CATEGORY_DIGIT,
        C.CATEGORY_NOT_SPACE: C.CATEGORY_SPACE,
        C.CATEGORY_NOT_WORD: C.CATEGORY_WORD,
        C.CATEGORY_NOT_LINEBREAK: C.CATEGORY_LINEBREAK,
    }
    if name in negated:
        test = tests[negated[name]]
        return lambda c: not test(c)
    return tests[name]


def _variants(c: str, flags: int) -> tuple[str, ...]:
    """The characters ``c`` stands for under ``flags`` (its simple case forms with ``i``)."""
    if not flags & re.IGNORECASE:
        return (c,)
    forms = {c, c.lower(), c.upper()}
    return tuple(f for f in forms if len(f) == 1)


def _in_range(lo: int, hi: int) -> Callable[[str], bool]:
    return lambda c: lo <= ord(c) <= hi


def _set_test(items: list[tuple[Any, Any]], flags: int) -> Callable[[str], bool]:
    """A character class (``[...]``, ``\\d`` at the top level) as a test of one character."""
    negate = False
    tests: list[Callable[[str], bool]] = []
    chars: set[str] = set()
    for op, arg in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            chars.update(_variants(chr(arg), flags))
        elif op is C.RANGE:
            tests.append(_in_range(*arg))
        elif op is C.CATEGORY:
            tests.append(_category(arg, flags))
        else:
            raise PatternError(f"a class item ckptkit does not read ({op})")

    def member(c: str) -> bool:
        for form in _variants(c, flags):
            if form in chars or any(test(form) for test in tests):
                return True
        return False

    return (lambda c: not member(c)) if negate else member


class _Builder:
    """Parsed pattern -> NFA nodes, built back to front (each piece is compiled knowing the
    state that follows it)."""

    def __init__(self) -> None:
        self.kind: list[int] = []
        self.arg: list[Any] = []
        self.out: list[list[int]] = []

    def node(self, kind: int, arg: Any, out: list[int]) -> int:
        if len(self.kind) >= MAX_STATES:
            raise PatternError(f"it expands to more than {MAX_STATES} states")
        self.kind.append(kind)
        self.arg.append(arg)
        self.out.append(out)
        return len(self.kind) - 1

    def sequence(self, items: list[tuple[Any, Any]], flags: int, after: int) -> int:
        for op, arg in reversed(items):
            after = self.item(op, arg, flags, after)
        return after

    def item(self, op: Any, arg: Any, flags: int, after: int) -> int:
        if op in _UNSUPPORTED:
            raise PatternError(f"it uses {_UNSUPPORTED[op]}, which needs backtracking")
        if op is C.LITERAL:
            forms = set(_variants(chr(arg), flags))
            return self.node(_CHAR, forms.__contains__, [after])
        if op is C.NOT_LITERAL:
            forms = set(_variants(chr(arg), flags))
            return self.node(
                _CHAR, lambda c: not any(f in forms for f in _variants(c, flags)), [after]
            )
        if op is C.ANY:
            test = (lambda c: True) if flags & re.DOTALL else (lambda c: c != "\n")
            return self.node(_CHAR, test, [after])
        if op is C.IN:
            return self.node(_CHAR, _set_test(arg, flags), [after])
        if op is C.AT:
            return self.node(_ASSERT, (arg, flags), [after])
        if op is C.BRANCH:
            _, branches = arg
            starts = [self.sequence(list(b), flags, after) for b in branches]
            return self.node(_SPLIT, None, starts)
        if op is C.SUBPATTERN:
            _, add, remove, body = arg
            return self.sequence(list(body), (flags | add) & ~remove, after)
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            low, high, body = arg
            return self.repeat(list(body), low, high, flags, after)
        raise PatternError(f"it uses {op}, which ckptkit does not read")

    def repeat(
        self, body: list[tuple[Any, Any]], low: int, high: int, flags: int, after: int
    ) -> int:
        if high == C.MAXREPEAT:  # body*: a loop, then ``low`` copies before it
            loop = self.node(_SPLIT, None, [])
            self.out[loop] += [self.sequence(body, flags, loop), after]
            start = loop
        else:  # up to high - low optional copies, each one a choice of body or the rest
            start = after
            for _ in range(high - low):
                start = self.node(_SPLIT, None, [self.sequence(body, flags, start), after])
        for _ in range(low):
            start = self.sequence(body, flags, start)
        return start


class Pattern:
    """A compiled pattern: ``matches(text)`` says whether ``re.match(source, text)`` (or
    ``re.fullmatch`` with ``full=True``) would find a match, in time linear in ``text``.

    Raises:
        PatternError: the pattern does not parse, is too large, or needs backtracking.
    """

    def __init__(self, source: str, *, full: bool = False) -> None:
        try:
            parsed = _parser.parse(source)
        except RecursionError:
            raise PatternError("it nests too deep") from None
        except (re.error, OverflowError) as exc:
            raise PatternError(f"it is not a regular expression ({exc})") from None
        self.source, self.full = source, full
        builder = _Builder()
        accept = builder.node(_MATCH, None, [])
        try:
            self.start = builder.sequence(list(parsed), parsed.state.flags, accept)
        except RecursionError:
            raise PatternError("it nests too deep") from None
        self.kind, self.arg, self.out = builder.kind, builder.arg, builder.out
        # Whether an anchor looks at the character before a position (else only at whether
        # there is one): \b, \B, or ^ under the multiline flag.
        self._looks_back = any(
            kind == _ASSERT
            and (arg[0] in (C.AT_BOUNDARY, C.AT_NON_BOUNDARY) or (arg[1] & re.MULTILINE))
            for kind, arg in zip(self.kind, self.arg, strict=True)
        )
        self._steps: dict[tuple[object, ...], tuple[frozenset[int], bool]] = {}
        self.work = 0  # nodes visited, all matches together: the bound the tests check

    @property
    def states(self) -> int:
        return len(self.kind)

    def _holds(self, at: Any, flags: int, prev: str | None, nxt: str | None, last: bool) -> bool:
        """An anchor at a position between ``prev`` and ``nxt`` (None: the text's ends);
        ``last``: ``nxt`` is the text's last character."""
        multiline = flags & re.MULTILINE
        if at in (C.AT_BEGINNING, C.AT_BEGINNING_LINE):
            return prev is None or bool(multiline and prev == "\n")
        if at is C.AT_BEGINNING_STRING:
            return prev is None
        if at in (C.AT_END, C.AT_END_LINE):
            return nxt is None or (nxt == "\n" and (last or bool(multiline)))
        if at is C.AT_END_STRING:
            return nxt is None
        ascii_only = bool(flags & re.ASCII)
        boundary = _is_word(prev, ascii_only) != _is_word(nxt, ascii_only)
        if at is C.AT_BOUNDARY:
            return boundary
        if at is C.AT_NON_BOUNDARY:  # SRE: never in the empty text
            return not boundary and not (prev is None and nxt is None)
        raise PatternError(f"it uses the anchor {at}, which ckptkit does not read")

    def _closure(
        self, states: frozenset[int], prev: str | None, nxt: str | None, last: bool
    ) -> tuple[list[int], bool]:
        """The character-reading states reachable without reading, and whether the match
        state is among them."""
        seen: set[int] = set()
        stack = list(states)
        readers: list[int] = []
        matched = False
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            kind = self.kind[node]
            if kind == _CHAR:
                readers.append(node)
            elif kind == _MATCH:
                matched = True
            elif kind == _SPLIT:
                stack.extend(self.out[node])
            elif self._holds(self.arg[node][0], self.arg[node][1], prev, nxt, last):
                stack.extend(self.out[node])
        self.work += len(seen)
        return readers, matched

    def _step(
        self, states: frozenset[int], prev: str | None, c: str, last: bool
    ) -> tuple[frozenset[int], bool]:
        """From ``states`` (before their closure) over ``c``: the next states, and whether the
        match state was reached before ``c``."""
        readers, matched = self._closure(states, prev, c, last)
        arg, out = self.arg, self.out
        return frozenset(out[n][0] for n in readers if arg[n](c)), matched

    def matches(self, text: str) -> bool:
        """Whether the pattern matches ``text`` (see the class)."""
        steps, full, looks_back = self._steps, self.full, self._looks_back
        states = frozenset([self.start])
        prev: str | None = None
        end = len(text) - 1
        for i, c in enumerate(text):
            # A step depends on the states and c, and on the text around it only where an
            # anchor looks: the character before (\b, multiline ^) or whether c ends the text.
            key = (states, c, prev if looks_back else i == 0, c == "\n" and i == end)
            found = steps.get(key)
            if found is None:
                found = self._step(states, prev, c, i == end)
                if len(steps) >= _CACHE_LIMIT:
                    steps.clear()
                steps[key] = found
            states, matched = found
            if matched and not full:
                return True
            if not states:
                return False
            prev = c
        at_end = (states, "", prev if looks_back else end < 0, True)  # "": no character
        if at_end not in steps:
            steps[at_end] = (states, self._closure(states, prev, None, False)[1])
        return steps[at_end][1]


def peft_key_pattern(key: str) -> Pattern:
    """A ``rank_pattern`` / ``alpha_pattern`` key as peft's ``get_pattern_key`` matches it:
    ``re.match(rf"(.*\\.)?({key})$", module)``, the key spliced in as peft splices it."""
    return Pattern(rf"(.*\.)?({key})$")


def full_pattern(pattern: str) -> Pattern:
    """A string ``target_modules`` as peft matches it: ``re.fullmatch(pattern, module)``."""
    return Pattern(pattern, full=True)


_DOT = re.compile(r"\.")
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class KeyTable:
    """``rank_pattern`` / ``alpha_pattern`` keys in their order: which one comes first to match
    a module, as peft's ``get_pattern_key`` tries them one after the other.

    An adapter may list every module by name (12,000 keys for 12,000 modules): tried one by one
    that is quadratic. A plain key (letters, digits, ``_ - .``: a module path) matches where a
    dot-separated tail of the module has its length and its characters, each ``.`` of the key
    matching any character, as the regex does; such keys are looked up in a dict per length and
    dot positions, the others matched as patterns, in order.

    Args:
        keys: the keys, in the config's order.
        compile: a key -> its Pattern (the caller's, which names the field in its errors).
    """

    def __init__(self, keys: list[str], compile: Callable[[str], Pattern]) -> None:
        self.keys, self._compile = keys, compile
        self._others: list[tuple[int, Pattern]] = []
        # length -> [(the key's dot positions, key -> its first index)]
        self._plain: dict[int, dict[tuple[int, ...], dict[str, int]]] = {}
        self._compiled: dict[int, Pattern] = {}
        for index, key in enumerate(keys):
            if key and _PLAIN.issuperset(key):
                dots = tuple(m.start() for m in _DOT.finditer(key))
                self._plain.setdefault(len(key), {}).setdefault(dots, {}).setdefault(key, index)
            else:
                self._others.append((index, compile(key)))

    def first(self, module: str) -> int | None:
        """The index of the first key that matches ``module``, or None."""
        best = self._first_plain(module)
        for index, pattern in self._others:
            if best is not None and index > best:
                break
            if pattern.matches(module):
                return index
        return best

    def _first_plain(self, module: str) -> int | None:
        if "\n" in module:  # `.` and `$` treat a newline apart: match such a name as a regex
            return next((i for i, k in enumerate(self.keys) if self._plain_key(i, k, module)), None)
        best: int | None = None
        starts = [0] + [m.end() for m in _DOT.finditer(module)]
        for start in starts:
            tail = module[start:]
            for dots, table in self._plain.get(len(tail), {}).items():
                if dots:
                    chars = list(tail)
                    for i in dots:
                        chars[i] = "."
                    found = table.get("".join(chars))
                else:
                    found = table.get(tail)
                if found is not None and (best is None or found < best):
                    best = found
        return best

    def _plain_key(self, index: int, key: str, module: str) -> bool:
        if not (key and _PLAIN.issuperset(key)):
            return False
        if index not in self._compiled:
            self._compiled[index] = self._compile(key)
        return self._compiled[index].matches(module)
