"""Each URL scheme's back-end and what it can do, as data (httpx's scheme -> transport
table): read by the back-ends, the folder listing, the uploads and the error that names the
extra to install."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backend", "SCHEMES", "backend"]


@dataclass(frozen=True)
class Backend:
    """What a scheme is read with and can do."""

    reader: str  # "http" (the standard library's client) or "fsspec"
    listable: bool = True  # folders can be listed (HTTP has no listing)
    writable: bool = True  # outputs can be written there
    deferred_commit: bool = True  # an upload appears only when committed (fsspec autocommit)
    extra: str | None = None  # the pip extra that installs its fsspec back-end


_HTTP = Backend("http", listable=False, writable=False, deferred_commit=False)
_FSSPEC = Backend("fsspec")
SCHEMES: dict[str, Backend] = {
    "http": _HTTP,
    "https": _HTTP,
    "s3": Backend("fsspec", extra="s3"),
    "s3a": Backend("fsspec", extra="s3"),
    "gs": Backend("fsspec", extra="gcs"),
    "gcs": Backend("fsspec", extra="gcs"),
    "az": Backend("fsspec", extra="azure"),
    "abfs": Backend("fsspec", extra="azure"),
    "abfss": Backend("fsspec", extra="azure"),
    "adl": Backend("fsspec", extra="azure"),
    "hf": Backend("fsspec", extra="hf"),
    # fsspec's memory:// stores a file when it is opened (autocommit=False is ignored)
    "memory": Backend("fsspec", deferred_commit=False),
}


def backend(url: object) -> Backend:
    """The back-end of ``url``'s scheme (fsspec, for a scheme not in the table)."""
    return SCHEMES.get(str(url).split("://", 1)[0].lower(), _FSSPEC)
