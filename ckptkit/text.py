"""Text from a file made safe to print: ``escape``, the one function every view goes through.

Keys, global names, metadata, member names and the messages that quote them come from the file.
Printed raw, a name holding ``ESC [2K CR`` could erase the line that says ``dangerous`` and write
another, and bytes that are not UTF-8 make output no terminal or JSON parser reads. Stdlib only.
"""

from __future__ import annotations

import re

__all__ = ["Escaped", "escape"]

# A backslash, C0 controls (ESC, CR, LF, NUL, BEL, TAB...), DEL, C1 controls, the characters
# that reorder or break a line (bidi overrides and isolates, line and paragraph separators) and
# surrogates (bytes that were not UTF-8, under surrogateescape, or a lone \ud800 from JSON).
_UNSAFE = re.compile(
    r"[\\\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if char == "\\":
        return "\\\\"
    if code < 0x80:  # C0 controls and DEL
        return f"\\x{code:02x}"
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"  # C1 controls, bidi and separators, other lone surrogates


class Escaped(str):
    """Text ``escape`` returned: escaping it again gives it back as it is, so a line escaped
    where it was made (a report's view) and again where it is printed is escaped once."""

    __slots__ = ()


def escape(text: str) -> Escaped:
    """``text`` with nothing a terminal acts on: printable text (``é``, ``中文``) kept as it is.

    Control characters (C0 such as ESC, CR, LF, NUL; DEL) become ``\\xNN``; a byte that was not
    UTF-8 (a surrogate-escaped ``\\udcNN``) becomes ``\\xNN``, its value; C1 controls, bidi
    controls, line separators and other lone surrogates become ``\\uNNNN``; a backslash is
    doubled, so the escaped form is unambiguous (no two strings escape alike) and valid UTF-8.
    An ``Escaped`` text is returned as it is.
    """
    if isinstance(text, Escaped):
        return text
    if text.isprintable() and "\\" not in text:  # the common case, at C speed
        return Escaped(text)
    return Escaped(_UNSAFE.sub(_escaped, text))
