"""Outputs written to a URL: uploaded as soon as each is written and verified, made visible only
when every one is, the last one (a sharded output's index) last; none of them on a failure.

Each file is staged in a local folder, checked there as any output is, and streamed to the
store through fsspec with ``autocommit=False``, while it is written (:class:`Stream`): each
part once its bytes are written and checked, after which the tensor bytes in it leave the
local disk (a hole punched), so the disk holds the tensor being written, a few parts and the
file's small records (a header, a zip's), never the file. On S3 that is a multipart upload
whose parts go up at once but which is completed (the object appears, whole) only by
:meth:`Uploads.commit`; a failure before it aborts every upload, and a killed run leaves
incomplete multipart uploads, which no reader lists as objects (``aws s3api
list-multipart-uploads`` shows them; a bucket lifecycle rule removes them). The commits, one
short request a file in order with the index last, are the one moment a failure leaves part
of an output visible: shards without their index, never an index naming missing shards.
fsspec's local and other back-ends write a temporary file and move it into place on commit.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ckptkit.errors import OutputError, UsageError
from ckptkit.storage.backends.fs import filesystem
from ckptkit.storage.backends.schemes import backend
from ckptkit.storage.bytecopy import punch_hole, read_into
from ckptkit.storage.remote import RemotePath

__all__ = ["Stream", "Uploads", "staging_folder"]

PART = 16 * 1024 * 1024  # bytes an upload part (S3 wants 5 MiB at least, 10,000 parts at most)


@contextlib.contextmanager
def staging_folder() -> Iterator[Path]:
    """A local folder for outputs on their way to a URL (``CKPTKIT_STAGING``, else the
    system's temporary folder), removed afterwards."""
    with tempfile.TemporaryDirectory(
        prefix="ckptkit-stage-", dir=os.environ.get("CKPTKIT_STAGING")
    ) as folder:
        yield Path(folder)


class Uploads:
    """Files bound for the folder ``folder`` (a URL): :meth:`check` them, :meth:`add` each when
    written, then :meth:`commit` all, in order; used as a context manager, an exception
    discards every upload not committed."""

    def __init__(self, folder: RemotePath, *, force: bool) -> None:
        if not backend(folder).writable:
            raise UsageError(
                f"{folder} is an HTTP URL, which ckptkit reads but cannot write to",
                "write to object storage (s3://, gs://, az://...) or a local path",
            )
        self.folder, self.force = folder, force
        self.fs, self.root = filesystem(str(folder))
        self._open: list[tuple[Any, str]] = []  # (upload, name): uploaded, not committed
        self._streams: dict[Path, Stream] = {}  # being uploaded as they are written
        # Where an upload is stored when opened (fsspec's memory://, autocommit=False ignored),
        # an output is written whole, then uploaded, and removed again on a failure.
        self.deferred = backend(folder).deferred_commit

    def url(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def check(self, names: list[str]) -> None:
        """Refuse outputs that exist at the URL unless ``force`` (as on a local disk), then
        abort what a killed run left of uploads to these very names (S3's incomplete multipart
        uploads: invisible, but stored and billed).

        Raises:
            OutputError: naming the first that exists.
        """
        if not self.force:
            self._refuse_existing(names)
        self._abort_leftovers(names)

    def _refuse_existing(self, names: list[str]) -> None:
        for name in names:
            if self._exists(name):
                raise OutputError(
                    f"output {self.folder / name} exists", "pass --force to replace it"
                )

    def _abort_leftovers(self, names: list[str]) -> None:
        """S3 only: incomplete multipart uploads to the output's keys, left by a run that was
        killed before it committed (another run writing the same output at the same time
        would be one, and its commit then fails: two runs cannot both write one output)."""
        if self.folder.scheme not in ("s3", "s3a") or not hasattr(self.fs, "call_s3"):
            return
        bucket, _, prefix = self.root.partition("/")
        keys = {f"{prefix.rstrip('/')}/{name}".lstrip("/") for name in names}
        try:
            found = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        except Exception:  # listing may be denied: leftovers then stay, as they would
            return
        for upload in found.get("Uploads", []):
            if upload.get("Key") in keys:
                with contextlib.suppress(Exception):
                    self.fs.call_s3(
                        "abort_multipart_upload",
                        Bucket=bucket,
                        Key=upload["Key"],
                        UploadId=upload["UploadId"],
                    )

    def remove(self, names: Iterable[str]) -> None:
        """Delete these objects (or folders) of the folder; one not there is skipped."""
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.url(name), recursive=True)

    def _exists(self, name: str) -> bool:
        try:
            return bool(self.fs.exists(self.url(name)))
        except Exception as exc:  # the back-end's own (no credentials, no bucket): said
            raise self._error(exc) from None

    def _error(self, exc: Exception) -> OutputError:
        return OutputError(
            f"cannot write to {self.folder}: {type(exc).__name__}: {exc}",
            "check the bucket, the credentials and the network",
        )

    def _handle(self, name: str) -> Any:
        """An upload to ``name``, made visible only by :meth:`commit`."""
        try:
            handle = self.fs.open(self.url(name), "wb", autocommit=False, block_size=PART)
        except Exception as exc:  # the back-end's own
            raise self._error(exc) from None
        self._open.append((handle, name))
        return handle

    def stream(self, local: Path, name: str) -> Stream:
        """Start uploading ``local`` (about to be written by the caller) as ``name`` while it
        is written (see :class:`Stream`); :meth:`add` sends the rest."""
        stream = Stream(self._handle(name), local, self._error)
        self._streams[local] = stream
        return stream

    def add(self, local: Path, name: str) -> None:
        """Upload ``local`` as ``name`` (not visible yet), or the rest of it when it was being
        streamed, then delete the local copy."""
        if local in self._streams:
            self._streams[local].finish()  # closed whatever comes of it
            del self._streams[local]
            local.unlink()
            return
        handle = self._handle(name)
        try:
            with open(local, "rb") as f:
                while chunk := f.read(PART):
                    handle.write(chunk)
            handle.close()  # the last part goes up; the upload stays open until commit
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.filename == str(local):
                raise
            raise self._error(exc) from None
        except Exception as exc:  # the back-end's own
            raise self._error(exc) from None
        local.unlink()

    def commit(self, *, entry_first: bool = False) -> None:
        """Make every upload visible, in the order added (a sharded output's index last).
        With ``entry_first``, an output of several files loses its old last file first (an
        index, DCP's ``.metadata``: what a reader finds it by), so that no reader meets the
        old one naming the new files while they are committed (DCP's names byte offsets)."""
        try:
            if entry_first and len(self._open) > 1:
                self.remove([self._open[-1][1]])
            while self._open:
                self._open[0][0].commit()
                self._open.pop(0)
        except Exception as exc:
            raise self._error(exc) from None

    def discard(self) -> None:
        """Abort every upload not committed (nothing of them becomes visible)."""
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        while self._open:
            handle, name = self._open.pop()
            with contextlib.suppress(Exception):  # the first failure is the one to report
                handle.discard()
            with contextlib.suppress(Exception):  # marked closed even if the discard failed
                _closed(handle)
            if not self.deferred:  # stored when opened: removed
                with contextlib.suppress(Exception):
                    self.remove([name])

    def __enter__(self) -> Uploads:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is not None:
            self.discard()


def _closed(handle: Any) -> None:
    """A discarded upload marked closed: one still open (a stream cut short) would otherwise
    be closed when collected, which sends its buffer (s3fs) from wherever that happens."""
    if handle.closed:
        return
    try:
        handle.closed = True  # s3fs: closing would upload what the discard threw away
    except AttributeError:  # a file object whose ``closed`` is read-only: closed for real
        handle.close()


class Stream:
    """A local file uploaded while it is written, a part at a time. :meth:`settled` names
    each range of tensor bytes once it is written and checked (in the order written, so all
    bytes before it are written too); every whole part before it goes up, and the tensor
    bytes in it are freed on disk (a hole punched). What lies between tensors (a header, a
    zip's records) stays for the writer's check; :meth:`finish` sends the rest. Where holes
    cannot be punched the file stays whole on disk, as a staged file would."""

    def __init__(self, handle: Any, path: Path, error: Callable[[Exception], Exception]) -> None:
        self.handle, self.path, self._error = handle, path, error
        self._fd: int | None = None  # opened when first sent: the writer creates the file
        self._closed = False
        self._lock = threading.Lock()
        self._tensors: deque[tuple[int, int]] = deque()  # settled, not yet freed
        self.sent = 0  # bytes handed to the upload

    def settled(self, start: int, end: int) -> None:
        """Tensor bytes ``[start, end)`` are written and checked: the whole parts before
        ``end`` go up (none once the stream is closed: a failed conversion's last ranges are
        checked after it)."""
        with self._lock:  # the copier's thread sends; a failure's discard closes meanwhile
            if self._closed:
                return
            self._tensors.append((start, end))
            while end - self.sent >= PART:
                self._send(self.sent + PART)

    def finish(self) -> None:
        """The rest goes up; the upload stays open until :meth:`Uploads.commit`. The file is
        closed whatever comes of it."""
        try:
            with self._lock:
                self._send(os.fstat(self._file()).st_size)
            try:
                self.handle.close()
            except Exception as exc:  # the back-end's own
                raise self._error(exc) from None
        finally:
            self.close()

    def _file(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR)
        return self._fd

    def _send(self, end: int) -> None:
        data = bytearray(end - self.sent)
        if not read_into(self._file(), memoryview(data), self.sent):
            raise OSError(f"{self.path} ends before byte {end}")
        try:
            self.handle.write(data)
        except Exception as exc:  # the back-end's own
            raise self._error(exc) from None
        while self._tensors and self._tensors[0][0] < end:  # the tensor bytes sent: freed
            first, last = self._tensors[0]
            low, high = max(first, self.sent), min(last, end)
            if high > low:
                punch_hole(self._file(), low, high - low)
            if last > end:
                break
            self._tensors.popleft()
        self.sent = end

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
