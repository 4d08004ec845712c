"""Typed errors: every failure ckptkit expects says what went wrong and how to fix it.

The library raises these; ``cli.main`` turns them into one ``Error: <what>; <fix>`` line with the
error's exit code. Stdlib only, importable from anywhere.
"""

from __future__ import annotations

__all__ = [
    "python_words",
    "CkptkitError",
    "UsageError",
    "FormatError",
    "MissingFileError",
    "UnsafeCheckpointError",
    "SelectError",
    "KeyTransformError",
    "KeyMatchError",
    "MappingError",
    "OutputError",
    "CastError",
    "VerificationError",
]


# The command line's flags and what library callers pass instead: hints are written once, for
# the CLI, and read in Python's words by library callers (longest flags first).
_FLAG_TO_PARAMETER = (
    ("--allow-global NAME", "allow_globals=[NAME]"),
    ("--select DOTTED.PATH", "select='DOTTED.PATH'"),
    ("--keep-dtype GLOB", "keep_dtype=[GLOB]"),
    ("--strip-wrappers", "strip_wrappers=True"),
    ("--max-shard-size", "max_shard_size="),
    ("--allow-overflow", "allow_overflow=True"),
    ("--strip-module", "strip_module=True"),
    ("--allow-global", "allow_globals="),
    ("--dry-run", "dry_run=True"),
    ("--select", "select="),
    ("--force", "force=True"),
    ("--trust", "trust=True"),
    ("--dtype", "dtype="),
)


def python_words(hint: str) -> str:
    """A CLI hint with each flag named as the library's parameter."""
    for flag, parameter in _FLAG_TO_PARAMETER:
        hint = hint.replace(flag, parameter)
    return hint


class CkptkitError(Exception):
    """Base class of the errors ckptkit expects.

    Args:
        message: what went wrong, naming the file or key concerned.
        hint: how to fix it, in the command line's words (flags), or None when the message says
            it all.
        api_hint: the same fix in Python's words, when more than naming each flag as its
            parameter (:func:`python_words`) is needed; ``str(error)`` gives the Python words,
            the CLI prints ``cli_text``.
    """

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, *, api_hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.api_hint = api_hint

    def __str__(self) -> str:
        hint = self.api_hint or (python_words(self.hint) if self.hint else None)
        return f"{self.message}; {hint}" if hint else self.message

    @property
    def cli_text(self) -> str:
        """The message with the command line's hint."""
        return f"{self.message}; {self.hint}" if self.hint else self.message


class UsageError(CkptkitError):
    """Options that cannot go together, or a value of the wrong form."""

    exit_code = 2


class FormatError(CkptkitError):
    """A file that is not a checkpoint ckptkit reads, or one that is damaged."""


class MissingFileError(FormatError, FileNotFoundError):
    """A checkpoint path that does not exist: a ``FileNotFoundError`` too, so ``except
    FileNotFoundError`` and ``except FormatError`` both catch it."""

    def __init__(self, path: object, hint: str | None = "check the path"):
        super().__init__(f"{path} does not exist", hint)
        self.errno = 2  # ENOENT, as FileNotFoundError carries it
        self.strerror = "No such file or directory"
        self.filename = str(path)

    def __str__(self) -> str:  # OSError's own would print "[Errno 2] ..."
        return CkptkitError.__str__(self)


class UnsafeCheckpointError(CkptkitError):
    """A pickle that names globals outside the safe set."""

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        *,
        globals_: tuple[str, ...] = (),
        api_hint: str | None = None,
    ):
        super().__init__(message, hint, api_hint=api_hint)
        self.globals = globals_


class SelectError(CkptkitError):
    """The state dict cannot be found, or ``--select`` names nothing usable."""


class KeyTransformError(CkptkitError):
    """A key rewrite that does nothing, or that maps two keys onto one."""


class KeyMatchError(CkptkitError):
    """Checkpoint keys that do not fit a model or a reference checkpoint."""


class MappingError(CkptkitError):
    """A mapping file that cannot be read, or a checkpoint it does not fit (naming the rule
    and the key)."""


class OutputError(CkptkitError):
    """An output that exists, equals the input, or cannot be written."""


class CastError(CkptkitError):
    """A dtype cast that would turn finite values into infinities."""


class VerificationError(CkptkitError):
    """What was written does not read back identical to the source."""


class HungRankError(CkptkitError):
    """A rank that never reached a collective the others waited in (named by a monitored
    barrier)."""


class Preempted(CkptkitError):
    """The run was asked to stop (SIGTERM) and saved a checkpoint at the next step."""

    exit_code = 143  # 128 + SIGTERM, as schedulers expect
