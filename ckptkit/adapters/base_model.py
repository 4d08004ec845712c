"""Where the base model an adapter names lives on this machine: a local path, or a model already
in the Hugging Face cache. Nothing is ever downloaded. Stdlib only."""

from __future__ import annotations

import os
from pathlib import Path

from ckptkit.errors import FormatError
from ckptkit.storage.location import Location, is_local

__all__ = ["hf_cache", "find_base", "how_found"]


def hf_cache() -> Path:
    """The Hugging Face hub cache, where ``huggingface_hub`` keeps it (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def _cached(repo_id: str, revision: str | None) -> Path | None:
    """The snapshot folder of ``repo_id`` in the cache (``revision``, else ``main``, else the
    only snapshot there is), or None."""
    repo = hf_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    if revision and (revision.startswith("/") or ".." in revision.split("/")):
        raise FormatError(
            f"the adapter's revision '{revision[:80]}' climbs out of the Hugging Face cache",
            "name the base with --base PATH",
        )
    for ref in [revision, "main"] if revision else ["main"]:
        ref_file = repo / "refs" / str(ref)
        if ref_file.is_file():
            with open(ref_file, "rb") as f:  # a ref holds a commit hash: 40 hex digits
                commit = f.read(256).decode("utf-8", "replace").strip()
            if (snapshots / commit).is_dir():
                return snapshots / commit
        if ref and (snapshots / ref).is_dir():  # a commit hash given as the revision
            return snapshots / ref
    found = [p for p in snapshots.iterdir() if p.is_dir()]
    return found[0] if len(found) == 1 else None


def find_base(name: str | None, adapter: Location, revision: str | None = None) -> Location:
    """The local base model an adapter's ``base_model_name_or_path`` names: a path as given
    (relative to the current folder), then next to the adapter, then a model in the Hugging
    Face cache.

    Raises:
        FormatError: it names nothing found here, naming ``--base``.
    """
    if not name:
        raise FormatError(f"{adapter} does not name its base model", "name it with --base PATH")
    for candidate in (Path(name).expanduser(), adapter.parent / name):
        # is_dir first: an adapter at a URL finds a folder beside it by its listing (asking a
        # folder URL for its size is refused as "a folder").
        if candidate.is_dir() or candidate.exists():
            return candidate
    if name.count("/") <= 1 and not name.startswith(("/", ".")):
        cached = _cached(name, revision)
        if cached is not None:
            return cached
    raise FormatError(
        f"{adapter} names base model '{name}', which is neither a local path nor in the "
        f"Hugging Face cache ({hf_cache()}); ckptkit never downloads",
        "name the base with --base PATH (download it first with `huggingface-cli download`)",
    )


def how_found(name: str, adapter: Location, found: Location) -> str:
    """How a base found from an adapter's ``base_model_name_or_path`` was found, for the
    report: the name, where it led, and a word when it leads out of the adapter's folder (an
    absolute path elsewhere, or ``..`` climbing out), which a downloaded adapter could use to
    point at any file on this machine."""
    shown = f"the adapter's base_model_name_or_path '{name}'"
    cache = hf_cache()
    if _inside(found, cache):
        return f"{shown}, in the Hugging Face cache"
    named = Path(name).expanduser()
    folder = adapter if adapter.is_dir() else adapter.parent
    if named.is_absolute() or ".." in named.parts:
        if not _inside(found, folder):
            return f"{shown}, outside the adapter's folder (followed as named)"
    return shown


def _inside(path: Location, folder: Location) -> bool:
    """Whether a local ``path`` lies in ``folder`` (symlinks resolved); a URL (no local
    path) is in no local folder."""
    if not (is_local(path) and is_local(folder)):
        return False
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    except (OSError, ValueError, TypeError):
        return False
