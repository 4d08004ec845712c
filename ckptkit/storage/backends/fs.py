"""Every scheme but HTTP(S), through fsspec, its back-end installed as an extra
(``torch-ckptkit[s3]``): ``fs.size`` once, ``fs.cat_file(path, start, end)`` for each range."""

from __future__ import annotations

import re
from typing import Any

from ckptkit.errors import MissingFileError, UsageError
from ckptkit.storage.backends.base import (
    Remote,
    RemoteError,
    _Folder,
    _Transient,
    byte_count,
)
from ckptkit.storage.backends.schemes import backend

__all__ = ["FsspecRemote", "filesystem"]


class FsspecRemote(Remote):
    """Any fsspec URL: ``fs.size`` once, ``fs.cat_file(path, start, end)`` for each range."""

    def __init__(self, url: str, size: int | None = None) -> None:
        super().__init__(url, size)
        self.fs, self.path = filesystem(url)

    def _stat(self) -> int:
        info = self._call(self.fs.info, self.path)
        self.traffic.add(0)
        if info.get("type") == "directory":
            raise _Folder(f"{self.url} is a folder", "give the checkpoint file inside it")
        return byte_count(info.get("size"), f"{self.url}: its size")

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
    import fsspec

    scheme = url.split("://", 1)[0].lower()
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        extra = backend(url).extra
        hint = (
            f"pip install 'torch-ckptkit[{extra}]'"
            if extra
            else f"install the fsspec back-end for {scheme}:// ({exc})"
        )
        raise UsageError(f"{url}: reading {scheme}:// URLs needs a package", hint) from None
    except ValueError as exc:  # "Protocol not known"
        raise UsageError(f"{url}: {exc}", "give a local path or a URL fsspec knows") from None
