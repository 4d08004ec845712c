"""Remote back-ends, one module each, as httpx has transports: :mod:`.base` (what they share:
retries, errors, the request counter), :mod:`.http` (the standard library's client, for
``http(s)://``) and :mod:`.fs` (fsspec, for every other scheme); :func:`open_remote` picks one
by the URL's scheme.

HTTP(S) goes through a small client of its own: the first ranged answer carries the object's
size in its ``Content-Range``, so a safetensors header costs one or two requests and no
``HEAD``.
"""

from __future__ import annotations

from ckptkit.storage.backends.base import Remote, Traffic
from ckptkit.storage.backends.fs import FsspecRemote
from ckptkit.storage.backends.http import HttpRemote

__all__ = ["open_remote"]


def open_remote(url: object, *, traffic: Traffic | None = None, size: int | None = None) -> Remote:
    """The remote object at ``url``, its requests counted in ``traffic`` (its own by
    default); ``size`` when a listing gave it.

    Raises:
        UsageError: a scheme whose fsspec back-end is not installed (naming the extra).
        MissingFileError: no object at the URL.
    """
    url = str(url)
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        return HttpRemote(url, traffic, size)
    return FsspecRemote(url, traffic, size)
