"""Where a checkpoint is: a local path or a URL, behind one small protocol.

:func:`location` is the one place a string becomes local (a :class:`pathlib.Path`) or remote
(a :class:`~ckptkit.storage.remote.RemotePath`). Both answer :class:`Location`: the readers and
layouts above ask it for names, parents, children, listings and small files without knowing
which it is. What differs between the two (a size, a file's first bytes, the byte file a
reader reads through) is asked of this module, which knows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol, TypeGuard, runtime_checkable

from ckptkit.storage.rangefile import RangeFile
from ckptkit.storage.remote import RemotePath, is_url
from ckptkit.storage.small import open_regular

__all__ = [
    "Location",
    "location",
    "by_name",
    "is_remote",
    "holds_file",
    "is_local",
    "listable",
    "absolute_parts",
    "may_be_folder",
    "size",
    "head",
    "url_file",
    "tree_size",
    "local_path",
    "listing",
    "fresh_names",
]


@runtime_checkable
class Location(Protocol):
    """What a local path and a URL both are: a name, a parent, children, and what a folder's
    checks and a small file's read need. ``pathlib.Path`` and ``RemotePath`` answer it."""

    @property
    def name(self) -> str: ...

    @property
    def suffix(self) -> str: ...

    @property
    def parent(self) -> Location: ...

    def __truediv__(self, name: str) -> Location: ...

    def is_file(self) -> bool: ...

    def is_dir(self) -> bool: ...

    def exists(self) -> bool: ...

    def iterdir(self) -> Iterator[Location]: ...

    def glob(self, pattern: str) -> Iterator[Location]: ...

    def read_bytes(self) -> bytes: ...


def by_name(locations: Iterable[Location]) -> list[Location]:
    """Locations of one folder, sorted by name (as sorted paths of one folder are)."""
    return sorted(locations, key=lambda where: where.name)


def location(path: str | os.PathLike[str] | Location) -> Location:
    """A local path as a :class:`~pathlib.Path`, a URL (``scheme://...``) as a
    :class:`~ckptkit.storage.remote.RemotePath`; a Location given stays as it is (a RemotePath
    keeps what was learnt of its folder)."""
    if isinstance(path, RemotePath | Path):
        return path
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return RemotePath(text) if is_url(text) else Path(text)


def is_remote(where: object) -> bool:
    """Whether ``where`` (a string or a Location) names an object at a URL: for the few
    choices that are about the network itself (what a command reports it fetched, a staging
    folder for an upload), not for reading, which asks the Location."""
    return isinstance(where, RemotePath) or (isinstance(where, str) and is_url(where))


def may_be_folder(where: Location) -> bool:
    """False where a folder is not worth a request to rule out: a URL whose name has a suffix
    or starts with a dot (DCP's ``.metadata``) names a file (or a glob); anything else may be
    a folder (a local one is asked)."""
    return not (isinstance(where, RemotePath) and (where.suffix or where.name.startswith(".")))


def is_local(where: Location) -> TypeGuard[Path]:
    """Whether ``where`` is on the local disk: for what only a local folder offers (its other
    files described one by one, symlinks followed and said)."""
    return isinstance(where, Path)


def holds_file(where: Location) -> bool:
    """Whether a file is there: at a URL an object (from its folder's listing where that was
    made); on a local disk anything but a folder, so that a FIFO or a device is refused by its
    reader, by name, rather than passed over."""
    if isinstance(where, RemotePath):
        return where.is_file()
    return where.exists() and not where.is_dir()


def listable(where: Location) -> bool:
    """Whether a folder there can be listed (a local one can; HTTP(S) has no listing)."""
    return where.listable if isinstance(where, RemotePath) else True


def absolute_parts(where: Location) -> tuple[str, ...]:
    """The location's absolute path as parts, for naming it among others: a URL's first part
    is its scheme and bucket (``s3://bucket``), never made a local path."""
    if isinstance(where, RemotePath):
        scheme, _, rest = str(where).partition("://")
        bucket, *names = [name for name in rest.split("/") if name] or [""]
        return (f"{scheme}://{bucket}", *names)
    return Path(os.path.abspath(str(where))).parts


def size(where: Location) -> int:
    """The file's size in bytes: ``stat`` on a local disk; at a URL from its folder's listing
    where that was made, else a request."""
    if isinstance(where, RemotePath):
        return where.size()
    return os.path.getsize(str(where))


def head(where: Location, count: int) -> bytes:
    """The file's first ``count`` bytes (fewer in a smaller one), for a layout's check. A
    local file that is not a regular one (a FIFO) is refused before it is opened; at a URL the
    bytes are read through the file that its reader later takes over (:func:`url_file`)."""
    if isinstance(where, RemotePath):
        return where.head(count)
    with open_regular(str(where)) as f:
        return bytes(f.read(count))


def url_file(where: Location) -> RangeFile | None:
    """The file a reader reads an object at a URL through (a RangeFile, owned by the caller:
    the one its layout's check read through where there was one); None for a local file,
    which its reader opens itself (memory-mapped, or copied file to file by the kernel)."""
    return where.open_range() if isinstance(where, RemotePath) else None


def local_path(where: Location) -> Path:
    """A local file's path, for what only a local file allows (memory-mapping it, torch's own
    loader); a URL here is a bug of the caller, which reads it through :func:`url_file`."""
    if not isinstance(where, Path):
        raise TypeError(f"{where} is not on the local disk")
    return where


def tree_size(folder: Location) -> int:
    """The bytes of every file under a folder (at a URL: one recursive listing)."""
    if isinstance(folder, RemotePath):
        return folder.tree_size()
    return sum(p.stat().st_size for p in Path(str(folder)).rglob("*") if p.is_file())


def listing(folder: Location) -> dict[str, int | None]:
    """The names in a folder with each one's size (None for a sub-folder): at a URL the
    listing its layout's checks made (one request, kept); on a local disk, read now.

    Raises:
        RemoteError: a folder over HTTP(S), which has no listing.
    """
    if isinstance(folder, RemotePath):
        return dict(folder.listed_or_refused())
    return {
        child.name: (child.stat().st_size if child.is_file() else None)
        for child in Path(str(folder)).iterdir()
    }


def fresh_names(folder: Location) -> list[str] | None:
    """The names in a folder, listed now (what was written since shows): at a URL one request,
    None over HTTP(S), which has no listing; on a local disk, read now (None for no folder)."""
    if isinstance(folder, RemotePath):
        return folder.names()
    path = Path(str(folder))
    return sorted(child.name for child in path.iterdir()) if path.is_dir() else None
