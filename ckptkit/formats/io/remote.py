"""Checkpoints at URLs: bytes read with range requests, never the whole object.

``is_url`` tells a URL (``s3://``, ``gs://``, ``az://``, ``hf://``, ``http(s)://``,
``memory://``...) from a local path; ``open_remote`` gives a :class:`Remote`, which reads byte
ranges and counts what it asked for. HTTP(S) goes through a small client of its own (the
standard library's ``http.client``): the first ranged answer carries the object's size in its
``Content-Range``, so a safetensors header costs one or two requests and no ``HEAD``. Every
other scheme goes through fsspec, its back-end installed as an extra (``torch-ckptkit[s3]``).

Transient failures (timeouts, dropped connections, 5xx, 429) are retried with exponential
backoff; a range that comes back short is a failure too. What still fails after the last try is
one :class:`RemoteError` naming the URL.
"""

from __future__ import annotations

import os
import re
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ckptkit.errors import CkptkitError, MissingFileError, UsageError

__all__ = [
    "Remote",
    "RemoteError",
    "RemotePath",
    "as_path",
    "is_url",
    "open_remote",
    "TRIES",
]

# The extra that installs each scheme's fsspec back-end.
EXTRAS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "adl": "azure",
    "hf": "hf",
}
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _setting(name: str, default: float) -> float:
    """A number from the environment, or its default when unset or not a number."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


TRIES = max(1, int(_setting("CKPTKIT_REMOTE_TRIES", 5)))
BACKOFF_S = max(0.0, _setting("CKPTKIT_REMOTE_BACKOFF", 0.2))
TIMEOUT_S = max(0.1, _setting("CKPTKIT_REMOTE_TIMEOUT", 60))


class RemoteError(CkptkitError):
    """A remote object that could not be read (after retries), or a URL that cannot be used."""


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path; ``file://`` is
    a URL too (fsspec reads it)."""
    return isinstance(path, str | RemotePath) and bool(_URL.match(str(path)))


def as_path(path: str | os.PathLike[str]) -> Path:
    """A local path as a :class:`~pathlib.Path`; a URL as a :class:`RemotePath` standing where
    a Path would (typed as one: code that must tell them apart asks :func:`is_url`)."""
    return cast(Path, RemotePath(str(path))) if is_url(str(path)) else Path(path)


class RemotePath:
    """A URL where a :class:`pathlib.Path` would be: ``name``, ``suffix``, ``parent``, ``/``
    and ``str`` as a path gives them. No ``__fspath__``: nothing can open it as a local file by
    mistake."""

    __slots__ = ("url",)

    def __init__(self, url: str | RemotePath) -> None:
        self.url = str(url).rstrip("/") if str(url).count("/") > 3 else str(url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0].lower()

    @property
    def name(self) -> str:
        rest = self.url.split("://", 1)[1]
        return rest.rsplit("/", 1)[-1] if "/" in rest else ""

    @property
    def suffix(self) -> str:
        name = self.name
        dot = name.rfind(".")
        return name[dot:] if 0 < dot < len(name) - 1 else ""

    @property
    def parent(self) -> RemotePath:
        head, _, _ = self.url.rpartition("/")
        return RemotePath(head) if "://" in head and not head.endswith(":/") else self

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}")

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def read_bytes(self) -> bytes:
        """A small object's bytes (an index, DCP's ``.metadata``), in one or two requests."""
        remote = open_remote(self)
        try:
            return remote.read(0, remote.size)
        finally:
            remote.close()

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def is_file(self) -> bool:
        """Whether an object is there (a request; its size asked). One that cannot be read
        (a 403 where listing is not allowed) counts as not there: a probe, not a read."""
        remote = open_remote(self)
        try:
            remote.size  # noqa: B018 - asked for its request
            return True
        except (MissingFileError, RemoteError):
            return False
        finally:
            remote.close()

    def size(self) -> int:
        """The object's size (a request)."""
        remote = open_remote(self)
        try:
            return remote.size
        finally:
            remote.close()

    def names(self) -> list[str] | None:
        """The names in the folder (the prefix) this URL names: empty when it is no folder;
        None for http(s), which has no listing."""
        listed = self.listing()
        return None if listed is None else list(listed)

    def listing(self, traffic: Traffic | None = None) -> dict[str, int | None] | None:
        """:meth:`names` with each one's size (None for a sub-folder), in one request, counted
        in ``traffic`` when given."""
        if self.scheme in ("http", "https"):
            return None
        fs, path = filesystem(self.url)
        fs.invalidate_cache(path)  # fsspec caches listings: what was written since must show
        try:
            found = fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            found = []
        except Exception as exc:  # the back-end's own: said, as a read's would be
            raise _failure(self.url, exc) from None
        finally:
            if traffic is not None:
                traffic.add(0)
        listed = {
            str(info["name"]).rstrip("/").rsplit("/", 1)[-1]: (
                int(info["size"]) if info.get("type") != "directory" else None
            )
            for info in found
        }
        return {} if list(listed) == [self.name] else listed  # a file lists itself

    def is_dir(self) -> bool:
        return False  # a URL names objects; a "folder" is a prefix, never opened as one


@dataclass
class Traffic:
    """What a :class:`Remote` asked for: requests made (tries included) and bytes received."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        """A request made, and the bytes it brought (0 for one that failed)."""
        with self.lock:
            self.requests += 1
            self.bytes += nbytes

    def retried(self) -> None:
        with self.lock:
            self.retries += 1


class Remote(ABC):
    """One remote object: its size and ranged reads, retried, counted in ``traffic``."""

    def __init__(self, url: str, traffic: Traffic | None = None, size: int | None = None) -> None:
        self.url = url
        self.traffic = traffic or Traffic()  # one Traffic may count a whole folder's requests
        self._size = size  # known from a listing: no request asks for it

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = self._retried(self._stat, "read the size of")
        return self._size

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` (clipped to the object), in one request (retried)."""
        end = min(end, self.size) if self._size is not None else end
        if end <= start:
            return b""
        return self._retried(lambda: self._checked(start, end), f"read bytes {start}-{end} of")

    def tail(self, count: int) -> tuple[int, bytes]:
        """The last ``count`` bytes (fewer when the object is smaller) and where they start."""
        start = max(0, self.size - count)
        return start, self.read(start, self.size)

    def _checked(self, start: int, end: int) -> bytes:
        data = self._range(start, end)
        want = min(end, self.size) - start
        if len(data) != want:  # a dropped connection or a server that cut the body short
            raise _Transient(f"{len(data)} of {want} bytes came back")
        return data

    def _retried(self, call: Any, what: str) -> Any:
        delay = BACKOFF_S
        for attempt in range(TRIES):
            try:
                return call()
            except _Transient as exc:
                if attempt == TRIES - 1:
                    raise RemoteError(
                        f"could not {what} {self.url} after {TRIES} tries ({exc})",
                        "check the URL and the network, then run it again",
                    ) from None
                self.traffic.retried()
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    @abstractmethod
    def _stat(self) -> int:
        """The object's size (raises _Transient on a failure worth retrying)."""

    @abstractmethod
    def _range(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` in one request (raises _Transient to retry)."""

    def close(self) -> None:  # noqa: B027 - back-ends without connections need not override it
        """Release connections."""


class _Transient(Exception):
    """A failure a retry may cure: a timeout, a dropped connection, a 5xx or a short body."""


def open_remote(
    url: str | RemotePath, *, traffic: Traffic | None = None, size: int | None = None
) -> Remote:
    """The remote object at ``url``, its requests counted in ``traffic`` (its own by
    default); ``size`` when a listing gave it.

    Raises:
        UsageError: a scheme whose fsspec back-end is not installed (naming the extra).
        MissingFileError: no object at the URL.
    """
    url = str(url)
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        from ckptkit.formats.io.http import HttpRemote

        return HttpRemote(url, traffic, size)
    return FsspecRemote(url, traffic, size)


class FsspecRemote(Remote):
    """Any fsspec URL: ``fs.size`` once, ``fs.cat_file(path, start, end)`` for each range."""

    def __init__(self, url: str, traffic: Traffic | None = None, size: int | None = None) -> None:
        super().__init__(url, traffic, size)
        self.fs, self.path = filesystem(url)

    def _stat(self) -> int:
        info = self._call(self.fs.info, self.path)
        self.traffic.add(0)
        if info.get("type") == "directory":
            raise UsageError(f"{self.url} is a folder", "give the checkpoint file inside it")
        return int(info["size"])

    def _range(self, start: int, end: int) -> bytes:
        data = bytes(self._call(self.fs.cat_file, self.path, start=start, end=end))
        self.traffic.add(len(data))
        return data

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """A back-end call, its exceptions as ckptkit's: missing, denied, or (``_failure``)
        one to retry or to say; a failed request is counted."""
        try:
            return method(*args, **kwargs)
        except FileNotFoundError:
            self.traffic.add(0)
            raise MissingFileError(self.url) from None
        except PermissionError as exc:
            self.traffic.add(0)
            raise RemoteError(
                f"{self.url}: access denied ({exc})", "check the credentials"
            ) from None
        except Exception as exc:  # the back-end's own: retried when it may pass, else said
            self.traffic.add(0)
            raise _failure(self.url, exc) from None


# What fsspec back-ends raise for a failure worth retrying: timeouts and connection errors
# (OSError covers both, and s3fs maps 5xx answers to OSError subclasses), and the back-ends'
# own classes for them (aiohttp's, httpx's, botocore's), told by name: ckptkit imports none.
_TRANSIENT: tuple[type[BaseException], ...] = (OSError, TimeoutError)
_TRANSIENT_NAMES = re.compile(r"Connect|Timeout|Temporar|Throttl|SlowDown|Unavailable|Payload")


def _failure(url: str, exc: Exception) -> Exception:
    """A back-end's exception as a retryable failure, or as the error that names it."""
    name = type(exc).__name__
    if isinstance(exc, _TRANSIENT) or _TRANSIENT_NAMES.search(name):
        return _Transient(f"{name}: {exc}")
    return RemoteError(
        f"cannot read {url} ({name}: {exc})", "check the URL, the credentials and the network"
    )


def filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem for ``url`` and the path inside it.

    Raises:
        UsageError: the scheme is unknown, or its back-end is not installed (naming the extra).
    """
    import fsspec  # type: ignore[import-untyped]

    scheme = url.split("://", 1)[0].lower()
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        extra = EXTRAS.get(scheme)
        hint = (
            f"pip install 'torch-ckptkit[{extra}]'"
            if extra
            else f"install the fsspec back-end for {scheme}:// ({exc})"
        )
        raise UsageError(f"{url}: reading {scheme}:// URLs needs a package", hint) from None
    except ValueError as exc:  # "Protocol not known"
        raise UsageError(f"{url}: {exc}", "give a local path or a URL fsspec knows") from None
