"""Remote back-ends, one module each, as httpx has transports: :mod:`.base` (what they share:
retries, errors, the request counter), :mod:`.http` (the standard library's client, for
``http(s)://``) and :mod:`.fs` (fsspec, for every other scheme); :func:`open_remote` picks one
by the URL's scheme.

HTTP(S) goes through a small client of its own: the first ranged answer carries the object's
size in its ``Content-Range``, so a safetensors header costs one or two requests and no
``HEAD``.

To add a back-end: a :class:`~ckptkit.storage.backends.base.Remote` subclass in a module of its
own (``_stat`` and ``_range``; raise ``_Transient`` for what a retry may cure), and its schemes
in :data:`~ckptkit.storage.backends.schemes.SCHEMES`.
"""

from __future__ import annotations

from ckptkit.storage.backends.base import Remote
from ckptkit.storage.backends.fs import FsspecRemote
from ckptkit.storage.backends.http import HttpRemote
from ckptkit.storage.backends.schemes import Backend, backend

__all__ = ["Backend", "backend", "open_remote"]

_READERS: dict[str, type[Remote]] = {"http": HttpRemote, "fsspec": FsspecRemote}


def open_remote(url: object, *, size: int | None = None) -> Remote:
    """The remote object at ``url`` (a URL or a RemotePath), its requests counted in the
    command's counter (:func:`~ckptkit.storage.backends.base.counting`); ``size`` when a
    listing gave it.

    Raises:
        UsageError: a scheme whose fsspec back-end is not installed (naming the extra).
        MissingFileError: no object at the URL.
    """
    return _READERS[backend(url).reader](str(url), size)
