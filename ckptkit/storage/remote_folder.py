"""A folder at a URL that a writer keeps, not only reads: a run mirrored to object storage.

:class:`RemoteFolder` is every operation such a writer performs there, each one request or a
few, so that nothing above ``storage/`` calls fsspec: its names listed now, whether a name is
there (past fsspec's listing cache), a small object read or written whole, files and
sub-folders downloaded, a probe written and removed, names removed, and its staged uploads
(:class:`~ckptkit.storage.upload.Uploads`, committed in order, as a URL ``Destination``'s are).
What it holds is also a :class:`~ckptkit.storage.location.Location` (:meth:`location`) for the
readers, and its URL (:attr:`url`) for a writer that takes one (torch's ``FsspecWriter``).
``name`` below is a name in the folder, a sub-folder's too; None is the folder itself.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

from ckptkit.storage.backends.fs import filesystem
from ckptkit.storage.remote import RemotePath
from ckptkit.storage.upload import Uploads

__all__ = ["RemoteFolder"]


class RemoteFolder:
    """A folder at ``url`` (see the module's docstring). Its back-end is found when first
    asked: a :class:`~ckptkit.errors.UsageError` then names a scheme that is unknown, or whose
    back-end is not installed (naming the extra)."""

    def __init__(self, url: str) -> None:
        self._where = RemotePath(url)

    @functools.cached_property
    def _backend(self) -> tuple[Any, str]:
        return filesystem(str(self._where))

    @property
    def url(self) -> str:
        """The folder's URL, as given (its trailing slash dropped)."""
        return str(self._where)

    def __str__(self) -> str:
        return self.url

    def child(self, name: str) -> str:
        """The URL of ``name`` in the folder."""
        return str(self._where / name)

    def location(self, name: str | None = None) -> RemotePath:
        """The folder (or ``name`` in it) as a Location, for the readers."""
        return self._where if name is None else self._where / name

    @property
    def _fs(self) -> Any:
        """fsspec's filesystem of the folder."""
        return self._backend[0]

    def _at(self, name: str | None) -> str:
        """The path of ``name`` (None: the folder) inside :attr:`_fs`."""
        path = self._backend[1]
        return path if name is None else f"{path.rstrip('/')}/{name}"

    def names(self) -> list[str]:
        """The names in the folder, listed now (empty: no folder, or HTTP, which has none)."""
        return self._where.names() or []

    def uploads(self) -> Uploads:
        """Uploads into the folder, replacing what is there, committed in the order added.

        Raises:
            UsageError: an HTTP URL, which ckptkit cannot write to.
        """
        return Uploads(self._where, force=True)

    def exists(self, name: str, *, fresh: bool = False) -> bool:
        """Whether ``name`` is there; ``fresh``: asked anew, not from a listing cached earlier
        (one made before a save ended must not hide it)."""
        if fresh:
            self._fs.invalidate_cache(self._at(None))
        return bool(self._fs.exists(self._at(name)))

    def is_folder(self, name: str | None = None) -> bool:
        return bool(self._fs.isdir(self._at(name)))

    def read(self, name: str) -> bytes:
        """A small object's bytes (a pointer).

        Raises:
            FileNotFoundError: there is none.
        """
        return bytes(self._fs.cat_file(self._at(name)))

    def write(self, name: str, data: bytes) -> None:
        """A small object written whole as ``name`` (visible at once)."""
        self._fs.pipe_file(self._at(name), data)

    def download(self, name: str | None, local: Path) -> None:
        """A file downloaded to ``local``.

        Raises:
            FileNotFoundError: there is none.
        """
        self._fs.get_file(self._at(name), str(local))

    def download_folder(self, name: str, local: Path) -> None:
        """A folder's files downloaded into ``local``, sub-folders too."""
        self._fs.get(f"{self._at(name)}/", str(local) + "/", recursive=True)

    def write_and_remove(self, name: str) -> None:
        """An empty object written as ``name``, then removed: can this folder be written?"""
        self._fs.pipe_file(self._at(name), b"")
        self._fs.rm(self._at(name))

    def remove(self, name: str | None = None) -> None:
        """``name`` removed (None: the folder itself), a folder with all it holds.

        Raises:
            FileNotFoundError: it is not there (some back-ends).
        """
        self._fs.rm(self._at(name), recursive=True)

    def clear(self) -> None:
        """The folder removed with all it holds, if it is there."""
        with contextlib.suppress(FileNotFoundError):
            self.remove()
