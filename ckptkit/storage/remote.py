"""Checkpoints at URLs: a :class:`RemotePath` stands where a :class:`pathlib.Path` would,
reading byte ranges through a back-end (:mod:`ckptkit.storage.backends`), never the whole
object. ``is_url`` tells a URL (``s3://``, ``gs://``, ``az://``, ``hf://``, ``http(s)://``,
``memory://``...) from a local path.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any

from ckptkit.errors import MissingFileError
from ckptkit.storage.backends import open_remote
from ckptkit.storage.backends.base import Remote, RemoteError, _Folder, byte_count, counter
from ckptkit.storage.backends.fs import _failure, filesystem
from ckptkit.storage.backends.schemes import backend
from ckptkit.storage.rangefile import RangeFile

__all__ = ["RemotePath", "is_url"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path; ``file://`` is
    a URL too (fsspec reads it)."""
    return isinstance(path, str | RemotePath) and bool(_URL.match(str(path)))


class _Tree:
    """What was learnt of one tree of URLs (a folder, its sub-folders and files) while it is
    read, shared by the RemotePaths made from one another (``/``, ``parent``): each folder's
    listing, made once; small files read whole; files' first bytes read for a layout's check,
    and the files they were read through, handed on to their reader. A RemotePath made anew
    from a string starts a new tree: nothing learnt before is trusted. (Requests are counted
    by the command, where each remote is opened: see ``backends.base.counting``.)"""

    __slots__ = ("lock", "listings", "contents", "heads", "probes", "sized")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.listings: dict[str, dict[str, int | None]] = {}
        self.contents: dict[str, bytes] = {}
        self.heads: dict[str, tuple[bytes, int]] = {}  # url -> (first bytes, how many asked)
        self.probes: dict[str, Any] = {}  # url -> the RangeFile its head was read through
        self.sized: dict[str, Remote] = {}  # url -> the Remote its size was asked through


# Small files a layout reads whole (DeepSpeed's latest, model_index.json), kept for a second look.
_KEPT_CONTENT = 1024 * 1024


class RemotePath:
    """A URL where a :class:`pathlib.Path` would be: ``name``, ``suffix``, ``parent``, ``/``
    and ``str`` as a path gives them. No ``__fspath__``: nothing can open it as a local file by
    mistake.

    A folder (a prefix) answers as a local folder does, for the layouts' checks: ``is_dir``,
    ``iterdir``, ``glob``, and ``is_file``, ``exists`` and ``size`` of what it holds, all from
    one listing per folder, made when first asked and kept by every RemotePath of the same tree
    (made from one another). http(s) has no listing: there ``is_dir`` is False, ``iterdir`` and
    ``glob`` refuse, and ``is_file`` asks (a request)."""

    __slots__ = ("url", "_tree")

    def __init__(self, url: str | RemotePath, *, _tree: _Tree | None = None) -> None:
        self.url = str(url).rstrip("/") if str(url).count("/") > 3 else str(url)
        self._tree = _tree if _tree is not None else _Tree()

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # what it has learnt stays behind
        return (RemotePath, (self.url,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __lt__(self, other: RemotePath) -> bool:  # sorted() as paths are
        return self.url < other.url

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
        if "://" in head and not head.endswith(":/"):
            return RemotePath(head, _tree=self._tree)
        return self

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", _tree=self._tree)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        """The part of this URL under ``other`` (a folder's file as ``tag/name``)."""
        base = str(other).rstrip("/") + "/"
        if not self.url.startswith(base):
            raise ValueError(f"{self.url} is not under {other}")
        return PurePosixPath(self.url[len(base) :])

    @property
    def listable(self) -> bool:
        """Whether its scheme lists folders (http(s) does not)."""
        return backend(self.url).listable

    # ------------------------------------------------------------------ objects

    def read_bytes(self) -> bytes:
        """A small object's bytes (an index, DCP's ``.metadata``), in one or two requests.
        In a folder listed to find its layout (its size came with the listing): one request,
        counted with that listing's, and a small one read once per tree."""
        with self._tree.lock:
            kept = self._tree.contents.get(self.url)
        if kept is not None:
            return kept
        size = self.listed_size()
        with self._tree.lock:
            remote = self._tree.sized.pop(self.url, None)
        if remote is None:
            remote = open_remote(self, size=size)
        try:
            data = remote.read(0, remote.size)
        finally:
            remote.close()
        if size is not None and size <= _KEPT_CONTENT:  # in a listed folder: read once
            with self._tree.lock:
                self._tree.contents[self.url] = data
        return data

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def is_file(self) -> bool:
        """Whether an object is there: from its folder's listing where that was made, else a
        request (its size asked). One that cannot be read (a 403 where listing is not allowed)
        counts as not there: a probe, not a read."""
        entry = self._entry()
        if entry is not None:
            return entry[0] and entry[1] is not None
        with self._tree.lock:
            if self._tree.listings.get(self.url):  # a folder, listed
                return False
        remote = open_remote(self)
        try:
            remote.size  # noqa: B018 - asked for its request
            return True
        except (MissingFileError, RemoteError, _Folder):
            return False
        finally:
            remote.close()

    def size(self) -> int:
        """The object's size: from its folder's listing where that was made, else a request
        (kept, with what it brought, for :meth:`read_bytes`: a small object's size asked
        before its bytes, to bound them, costs one request in all)."""
        listed = self.listed_size()
        if listed is not None:
            return listed
        remote = open_remote(self)
        try:
            size = remote.size
        finally:
            remote.close()  # its connections: a read that follows opens one if it needs it
        with self._tree.lock:
            self._tree.sized[self.url] = remote
        return size

    def listed_size(self) -> int | None:
        """Its size where its folder's listing (made already) gave it, else None."""
        entry = self._entry()
        return entry[1] if entry is not None and entry[0] else None

    def open_range(self) -> RangeFile:
        """The object as a :class:`~ckptkit.storage.rangefile.RangeFile`, owned by the
        caller: the one :meth:`head` read through where there is one (what it fetched is not
        fetched again), else one made now (its size from the listing where known)."""
        with self._tree.lock:
            raw = self._tree.probes.pop(self.url, None)
        if raw is None:
            raw = RangeFile(open_remote(self, size=self.listed_size()))
        return raw

    def head(self, count: int) -> bytes:
        """The object's first ``count`` bytes (fewer in a smaller object), for a layout's check
        (a safetensors header's): read through a RangeFile kept for :meth:`open_range` to hand
        on (one ranged request of at least its read-ahead), and kept: asked again, even once
        the file was handed on, they cost nothing."""
        with self._tree.lock:
            kept = self._tree.heads.get(self.url)
        if kept is not None and kept[1] >= count:
            return kept[0][:count]
        size = self.listed_size()
        with self._tree.lock:
            raw = self._tree.probes.get(self.url)
            if raw is None:
                remote = open_remote(self, size=size)
                raw = self._tree.probes[self.url] = RangeFile(remote)
        data = raw.pread(0, count)
        with self._tree.lock:
            self._tree.heads[self.url] = (data, count)
        return data

    # ------------------------------------------------------------------ folders

    def names(self) -> list[str] | None:
        """The names in the folder (the prefix) this URL names, listed now: empty when it is
        no folder; None for http(s), which has no listing."""
        return list(self._list()) if self.listable else None

    def listing(self) -> dict[str, int | None] | None:
        """:meth:`names` with each one's size (None for a sub-folder): the listing made for
        this tree (the layouts' checks), else one made now and kept; None for http(s)."""
        return self.listed()

    def listed(self) -> dict[str, int | None] | None:
        """:meth:`listing`, made once per tree (the folder checks' answers come from it);
        None for http(s)."""
        if not self.listable:
            return None
        with self._tree.lock:
            kept = self._tree.listings.get(self.url)
        if kept is None:
            found = self._list()
            with self._tree.lock:
                kept = self._tree.listings.setdefault(self.url, found)
        return dict(kept)

    def _list(self) -> dict[str, int | None]:
        """The folder listed now (one request, counted), fsspec's cached listing dropped first."""
        fs, path = filesystem(self.url)
        fs.invalidate_cache(path)  # fsspec caches listings: what was written since must show
        try:
            found = fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            found = []
        except Exception as exc:  # the back-end's own: said, as a read's would be
            raise _failure(self.url, exc) from None
        finally:
            counter().add(0)
        listed = {
            str(info["name"]).rstrip("/").rsplit("/", 1)[-1]: (
                byte_count(info.get("size"), f"{self.url}: the listing's size of {info['name']}")
                if info.get("type") != "directory"
                else None
            )
            for info in found
        }
        return {} if list(listed) == [self.name] else listed  # a file lists itself

    def _entry(self) -> tuple[bool, int | None] | None:
        """This URL in its folder's listing, where that was made: (there, its size, None for
        a sub-folder); None when its folder was not listed."""
        parent = self.parent
        if parent.url == self.url:
            return None
        with self._tree.lock:
            listed = self._tree.listings.get(parent.url)
        if listed is None:
            return None
        return (self.name in listed, listed.get(self.name))

    def is_dir(self) -> bool:
        """Whether it is a folder (a prefix holding objects): from its folder's listing where
        that was made, else from its own (made now, and kept). Never over http(s)."""
        entry = self._entry()
        if entry is not None:
            return entry[0] and entry[1] is None
        return bool(self.listed())

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def iterdir(self) -> Iterator[RemotePath]:
        """What the folder holds, from its listing.

        Raises:
            RemoteError: over http(s), which has no listing.
        """
        return iter([self / name for name in self.listed_or_refused()])

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """What the folder holds by a pattern of one name (``*.index.json``), from its
        listing; not recursive.

        Raises:
            RemoteError: over http(s), which has no listing.
        """
        if "/" in pattern:
            raise ValueError(f"a folder at a URL is globbed one level at a time, not {pattern!r}")
        listed = self.listed_or_refused()
        return iter([self / name for name in listed if fnmatch.fnmatchcase(name, pattern)])

    def listed_or_refused(self) -> dict[str, int | None]:
        listed = self.listed()
        if listed is None:
            raise RemoteError(
                f"{self} is a folder, and a folder cannot be listed over HTTP",
                "give its s3:// (or other listable) URL, or download it and give the local copy",
            )
        return listed

    def tree_size(self) -> int:
        """The bytes of every object under this folder (one recursive listing, counted)."""
        fs, root = filesystem(self.url)
        counter().add(0)
        return int(fs.du(root))
