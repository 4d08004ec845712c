"""Where outputs go: a local path, or a URL (through a local staging folder), behind one protocol.

An output is planned at a local path (:meth:`Destination.planned`: the output itself, or its
place in a staging folder), checked (:meth:`Destination.check`), then written file by file in
one :meth:`Destination.files` block: each file at :meth:`Files.path`, streamed out while it is
written where the destination can (:attr:`Files.streaming`, :meth:`Files.stream`), handed over
by :meth:`Files.done` once written and verified, and every file committed together, in the
order given, when the block ends (none of them on a failure). A folder given to
:meth:`~Destination.files` appears whole: the last file (an index, DCP's ``.metadata``: what a
reader finds the output by) last. :meth:`Destination.remove_stale` then removes an earlier
output's files this one did not write, and :meth:`Destination.shown` names a planned path where
it went. :func:`destination` picks the kind from the string: this is where a URL is told from
a local path.

- :class:`LocalDestination`: the atomic commit of ``atomic.py`` (temp files beside the outputs,
  renamed in order; a folder's temp folder, renamed whole or its owned files swapped in).
- :class:`UrlDestination`: the uploads of ``upload.py`` (each file uploaded as it is written,
  made visible together), its files staged in a local folder.

Any writer of a folder of files can use it, not only convert: stage the folder
(``planned()``, ``files(outputs, folder=...)``), write each file at ``path(out)``, ``done(out)``
in order, and the files are committed in that order, the entry (an index, ``.metadata``) last.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from ckptkit.errors import CkptkitError, OutputError, UsageError
from ckptkit.storage.atomic import (
    atomic_folder,
    atomic_outputs,
    check_folder_output,
    check_output,
)
from ckptkit.storage.remote import RemotePath, is_url
from ckptkit.storage.upload import PART, Stream, Uploads, staging_folder

__all__ = ["Destination", "Files", "LocalDestination", "UrlDestination", "destination"]

# The file names a URL output may have (a folder has none); others are refused.
URL_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


class Files(Protocol):
    """One commit's files, while they are written (see :meth:`Destination.files`)."""

    streaming: int | None  # bytes a streamed part holds; None: files go out once done

    def path(self, out: Path) -> Path:
        """Where the planned output ``out`` is written now (a temp or a staged path)."""

    def stream(self, out: Path) -> Stream | None:
        """Start sending ``out`` while it is written (None where files go out whole)."""

    def done(self, out: Path) -> None:
        """``out`` is written and verified: hand it over (it is committed with the rest)."""


class Destination(Protocol):
    """Where a conversion's outputs go (see the module's docstring for the order of calls)."""

    def planned(self) -> contextlib.AbstractContextManager[Path]:
        """The local path the output is planned at while the body runs; errors raised in it
        name the output where it goes."""

    def check(self, outputs: Sequence[Path], *, folder: Path | None = None) -> None:
        """Refuse, before anything is written, outputs that exist (without ``force``), and a
        ``folder`` written whole that exists (local) or holds anything (URL).

        Raises:
            OutputError: naming the output, with the fix in its hint.
        """

    def files(
        self,
        outputs: Sequence[Path],
        *,
        folder: Path | None = None,
        owns: Callable[[str], bool] | None = None,
    ) -> contextlib.AbstractContextManager[Files]:
        """Write ``outputs`` (planned paths, committed in this order), or a ``folder`` that
        appears whole (``owns``: the names of it that ``force`` replaces in an existing one,
        the others kept)."""

    def missing(self, outputs: Sequence[Path]) -> list[str]:
        """Of outputs other processes were to write, the names not there to be seen."""

    def names(self) -> list[str]:
        """The names already there: beside a file output, in a folder output.

        Raises:
            UsageError: a URL that cannot be listed (HTTP).
        """

    def remove_stale(self, dst: Path, stale: Callable[[list[str]], Iterable[str]]) -> None:
        """With ``force``: remove what ``stale`` picks of the names beside ``dst`` (an earlier
        output's shards and index that this one did not write)."""

    def shown(self, path: Path) -> str:
        """A planned path named where it goes."""

    def show_folder(self, folder: Path, names: Sequence[str]) -> list[str]:
        """The names a folder output is listed by in a report."""


def destination(
    where: str | os.PathLike[str],
    *,
    force: bool,
    inputs: Iterable[object] = (),
    whole: bool = False,
    parts: bool = False,
) -> Destination:
    """The destination ``where`` names: a URL or a local path. ``whole``: the output is a
    folder saved whole, which replaces another in place (DCP); ``parts``: processes write
    shares of its shards (``--part``). ``inputs`` are never overwritten.

    A URL without a file name (``s3://b/model``) is a folder: a new model folder, or, with a
    trailing slash (``s3://b/model/``), one written into.

    Raises:
        UsageError: a URL output ckptkit cannot write (a file name it does not write, shares
            of a folder); an HTTP URL is refused by :meth:`~Destination.planned`.
    """
    if not is_url(str(where)):
        return LocalDestination(Path(where), force=force, inputs=inputs)
    url = RemotePath(str(where))
    if whole and parts:
        raise UsageError(f"{url}: --part writes shards of a safetensors or .pt output")
    folder = whole or not url.suffix
    if folder and parts:
        raise UsageError(
            f"--part writes shards beside a file: name it, e.g. {url}/model.safetensors"
        )
    fill = folder and not whole and str(where).endswith("/")
    return UrlDestination(url, force=force, folder=folder, fill=fill, whole=whole)


class LocalDestination:
    """A local path: written to temp paths beside the outputs, which appear only once all are
    written (``atomic.py``)."""

    def __init__(self, where: Path, *, force: bool, inputs: Iterable[object] = ()) -> None:
        self.where, self.force, self.inputs = where, force, list(inputs)
        self._whole = False  # a folder committed whole: nothing stale can be left in it

    @contextlib.contextmanager
    def planned(self) -> Iterator[Path]:
        yield self.where

    def check(self, outputs: Sequence[Path], *, folder: Path | None = None) -> None:
        if folder is not None:
            check_folder_output(folder, force=self.force, inputs=self.inputs)
            return
        for path in outputs:
            check_output(path, force=self.force, inputs=self.inputs)

    @contextlib.contextmanager
    def files(
        self,
        outputs: Sequence[Path],
        *,
        folder: Path | None = None,
        owns: Callable[[str], bool] | None = None,
    ) -> Iterator[Files]:
        if folder is None:
            with atomic_outputs(list(outputs), force=self.force, inputs=self.inputs) as temps:
                yield _LocalFiles(dict(zip(outputs, temps, strict=True)))
            return
        self._whole = True
        entry = outputs[-1].name if outputs and owns is not None else None
        with atomic_folder(
            folder, force=self.force, inputs=self.inputs, owns=owns, entry=entry
        ) as tmp:
            yield _LocalFiles({}, folder, tmp)

    def missing(self, outputs: Sequence[Path]) -> list[str]:
        return [path.name for path in outputs if not path.is_file()]

    def names(self) -> list[str]:
        return [path.name for path in self.where.parent.iterdir()]

    def remove_stale(self, dst: Path, stale: Callable[[list[str]], Iterable[str]]) -> None:
        if self._whole:  # a folder put in place whole holds nothing older
            return
        present = list(dst.parent.iterdir())
        names = set(stale([path.name for path in present]))
        for path in present:
            if path.name in names and path.is_file():
                path.unlink()

    def shown(self, path: Path) -> str:
        return str(path)

    def show_folder(self, folder: Path, names: Sequence[str]) -> list[str]:
        return [str(folder)]  # it appears whole: named by itself


class _LocalFiles:
    streaming: int | None = None  # written in place: nothing goes out before the commit

    def __init__(self, temps: dict[Path, Path], folder: Path | None = None, tmp: Path = Path()):
        self.temps, self.folder, self.tmp = temps, folder, tmp

    def path(self, out: Path) -> Path:
        if self.folder is None:
            return self.temps[out]
        path = self.tmp / out.relative_to(self.folder)
        path.parent.mkdir(parents=True, exist_ok=True)  # a file in a subfolder (Megatron's)
        return path

    def stream(self, out: Path) -> Stream | None:
        return None

    def done(self, out: Path) -> None:
        return None  # committed when the block ends


class UrlDestination:
    """A URL: each output staged in a local folder, uploaded as it is written, made visible
    with the others (``upload.py``). A file's uploads go to the folder holding it; a folder's,
    into it."""

    def __init__(
        self, url: RemotePath, *, force: bool, folder: bool, fill: bool, whole: bool
    ) -> None:
        if not folder and url.suffix not in URL_SUFFIXES:
            raise UsageError(
                f"{url}: an output at a URL is a .safetensors or .pt file (shards and their "
                "index beside it with --max-shard-size), or a folder",
                "name the file, e.g. s3://bucket/run/model.safetensors",
            )
        self.url, self.force, self.fill, self.whole = url, force, fill, whole
        self.root = url if folder else url.parent  # the URL the files are named under
        self._stage = Path()  # the staging folder, while planned() runs
        self._earlier: list[str] = []  # a whole save's folder, as listed before it is written

    @contextlib.contextmanager
    def planned(self) -> Iterator[Path]:
        # A whole save replaces another: what it held is listed now (see check, files).
        self._earlier = (self.url.names() or []) if self.whole else []
        # Made now, so that an HTTP URL is refused before the source is read.
        self._uploads = Uploads(self.root, force=self.force or self.whole)
        with staging_folder() as stage, _named_at(self.url.parent, stage):
            self._stage = stage
            local = stage / self.url.name
            if self.fill:
                local.mkdir()
            yield local

    @property
    def _local_root(self) -> Path:
        return self._stage / self.url.name if self.root is self.url else self._stage

    def _name(self, path: Path) -> str:
        return path.relative_to(self._local_root).as_posix()

    def check(self, outputs: Sequence[Path], *, folder: Path | None = None) -> None:
        if self.whole and self._earlier and not self.force:
            raise OutputError(f"output {self.url} exists", "pass --force to replace it")
        self._uploads.check([self._name(path) for path in outputs])

    @contextlib.contextmanager
    def files(
        self,
        outputs: Sequence[Path],
        *,
        folder: Path | None = None,
        owns: Callable[[str], bool] | None = None,
    ) -> Iterator[Files]:
        if folder is not None:
            folder.mkdir(exist_ok=True)
        uploads = self._uploads
        with uploads:
            files = _UrlFiles(uploads, self._name)
            yield files
            uploads.commit(entry_first=True)
        if owns is not None:  # another save's files (other ranks'), the rest of it kept
            written = {self._name(path) for path in outputs}
            uploads.remove({name for name in self._earlier if owns(name)} - written)

    def missing(self, outputs: Sequence[Path]) -> list[str]:
        return []  # each rank uploaded its own: nothing shared to look at here

    def names(self) -> list[str]:
        names = self.root.names()
        if names is None:
            raise UsageError(
                f"{self.root}: an HTTP URL cannot be listed or written", "use s3://..."
            )
        return names

    def remove_stale(self, dst: Path, stale: Callable[[list[str]], Iterable[str]]) -> None:
        folder = RemotePath(self.shown(dst)).parent
        Uploads(folder, force=True).remove(stale(folder.names() or []))

    def shown(self, path: Path) -> str:
        if path == self._local_root:
            return str(self.root)
        return f"{self.root}/{self._name(path)}"

    def show_folder(self, folder: Path, names: Sequence[str]) -> list[str]:
        return [self.shown(folder / name) for name in names]  # objects, one by one


class _UrlFiles:
    def __init__(self, uploads: Uploads, name: Callable[[Path], str]) -> None:
        self.uploads, self.name = uploads, name
        # fsspec's memory:// stores a file when it is opened: there each goes up whole.
        self.streaming = PART if uploads.deferred else None

    def path(self, out: Path) -> Path:
        out.parent.mkdir(parents=True, exist_ok=True)  # a file in a subfolder (Megatron's)
        return out  # staged where it was planned

    def stream(self, out: Path) -> Stream | None:
        return self.uploads.stream(out, self.name(out)) if self.streaming else None

    def done(self, out: Path) -> None:
        self.uploads.add(out, self.name(out))


@contextlib.contextmanager
def _named_at(url: RemotePath, stage: Path) -> Iterator[None]:
    """Errors name the output at its URL, not in the staging folder it was made in."""
    try:
        yield
    except CkptkitError as exc:
        exc.message = exc.message.replace(str(stage), str(url))
        exc.args = (exc.message,)
        raise
