"""What a path is, and every way a loader would read its bytes.

``detect_format`` names the one format ckptkit reads a file as. ``readings`` lists every reading
another loader could make of the same bytes, the way each would make it:

- ``torch.load`` takes a file that starts with a zip signature as a zip (its ``data.pkl``);
  otherwise it first tries the legacy tar format, and failing that unpickles the file from byte
  0, pickle after pickle (the legacy format's magic number, protocol, system info, main pickle
  and storage keys);
- ``pickle.load`` unpickles from byte 0; Python's ``zipfile`` finds a zip at the end of a file;
- safetensors loaders read an 8-byte header length and a JSON header.

A file that more than one of them can read is a polyglot: what one loader checks is not what
another runs. Stdlib only.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
import struct
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.errors import FormatError, MissingFileError
from ckptkit.formats.files.torchzip import ZipDamage, ZipIndex
from ckptkit.formats.pickles.machine import PickleRun
from ckptkit.formats.pickles.unpickler import PickleScan
from ckptkit.formats.pickles.verdicts import PickleFindings, scan_pickle
from ckptkit.storage.small import file_kind

__all__ = [
    "WEIGHT_SUFFIXES",
    "detect_format",
    "regular_file",
    "readings",
    "starts_as_pickle",
    "Reading",
    "LEGACY_MAGIC",
    "ZIP_MAGIC",
]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
ZIP_MAGIC = b"PK\x03\x04"
# A member or pickle read into memory for a scan: more is a bomb, not a checkpoint's pickle.
MAX_MEMBER = 64 * 1024 * 1024
_MAX_PICKLES = 64  # pickles one after another in a plain file

# Formats people mistake for checkpoints ckptkit reads, by their first bytes.
_FOREIGN_MAGIC = (
    (b"\x89HDF", "an HDF5 file (Keras / h5py)"),
    (b"\x93NUMPY", "a NumPy .npy file"),
    (b"\x08\x01\x12", "an ONNX model"),
    (b"\x1f\x8b", "a gzip archive"),
)
_READS = "ckptkit reads PyTorch files (torch.save: .pt .pth .bin .ckpt) and safetensors"
_STORAGE_MEMBER_PARTS = 2  # ".../data/<n>"


# The files a loader reads weights from (torch.save's usual names, safetensors): a folder's
# weights, the files scan lists in a folder at a URL, an output named as a file.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_CHECKPOINT_SUFFIXES = (*WEIGHT_SUFFIXES, ".tar", ".pkl", ".gguf")


def _checkpoint_files(folder: Path, limit: int = 8) -> list[str]:
    """The files in a folder that may be checkpoints, by their suffix (skorch's params.pt...)."""
    try:
        names = sorted(p.name for p in folder.iterdir() if p.name.endswith(_CHECKPOINT_SUFFIXES))
    except OSError:
        return []
    return names[:limit] + ([f"{len(names) - limit} more"] if len(names) > limit else [])


def regular_file(path: Path) -> int:
    """Check that ``path`` is a readable regular file (symlinks followed); return its size.

    Raises:
        FormatError: missing, a folder, a FIFO, a device, a symlink loop, unreadable.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        raise MissingFileError(path) from None
    except OSError as exc:
        raise FormatError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        inside = _checkpoint_files(path)
        raise FormatError(
            # The folder layouts open_source knows (folders/layouts.py names the files).
            f"{path} is a folder with no sharded index, model.safetensors, pytorch_model.bin, "
            "diffusers, PEFT, DeepSpeed or DCP checkpoint",
            f"give the checkpoint file inside it ({', '.join(inside)})"
            if inside
            else "give a checkpoint file; it holds none ckptkit knows by its name",
        )
    if not stat.S_ISREG(info.st_mode):
        raise FormatError(
            f"{path} is a {file_kind(info.st_mode)}, not a regular file", "give a checkpoint file"
        )
    if not os.access(path, os.R_OK):
        raise FormatError(f"cannot read {path}: permission denied")
    return info.st_size


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 2 <= length <= size - 8 and head[8:9] == b"{"


def _open_tar(raw: io.BufferedReader) -> tarfile.TarFile | None:
    """The tar archive torch's legacy loader would find, or None (as torch, any TarError)."""
    raw.seek(0)
    try:
        return tarfile.open(fileobj=raw, mode="r:", format=tarfile.PAX_FORMAT)
    except (tarfile.TarError, EOFError, ValueError, UnicodeDecodeError, OverflowError):
        return None
    finally:
        raw.seek(0)


def detect_format(path: str | Path) -> str:
    """Tell a file's format from its content: ``torch-zip``, ``torch-legacy``, ``safetensors``
    or ``gguf`` (llama.cpp's, described but not converted).

    Raises:
        FormatError: a folder, a missing, empty or foreign file, TorchScript, a legacy tar
            checkpoint, or random bytes.
    """
    path = Path(path)
    size = regular_file(path)
    if size == 0:
        raise FormatError(
            f"{path} is empty (0 bytes)", "the save was interrupted; use an earlier copy"
        )
    with open(path, "rb") as f:
        head = f.read(16)
        if head.startswith(ZIP_MAGIC):
            return _zip_kind(path)
        tar = _open_tar(f)
        names = _tar_names(tar) if tar is not None else set()
    if tar is not None:
        if names & {"model_config.yaml", "model_weights.ckpt", "model_weights"}:
            raise FormatError(
                f"{path} is a NeMo 1 archive (.nemo: model_config.yaml and the weights in a "
                "tar), which ckptkit does not read yet",
                "convert a NeMo 2 checkpoint folder (context/ and weights/) instead; NeMo's "
                "own tools save one",
            )
        raise FormatError(
            f"{path} is a legacy tar checkpoint (torch < 0.1.10), which only a full unpickle reads",
            "if you trust it, load it with --trust; check it first with 'ckptkit scan'",
        )
    if head.startswith(b"GGUF"):
        return "gguf"
    # Before the pickle test: a header length such as 0x280 also starts with b"\x80\x02".
    if _looks_like_safetensors(head, size):
        return "safetensors"
    if starts_as_pickle(head):
        return "torch-legacy"
    for magic, what in _FOREIGN_MAGIC:
        if head.startswith(magic):
            raise FormatError(f"{path} is {what}, not a checkpoint ckptkit reads", _READS)
    raise FormatError(f"{path} is not a recognised checkpoint", _READS)


def _zip_kind(path: Path) -> str:
    try:  # the compact directory parse (zipfile's builds 100,000 ZipInfo objects)
        with open(path, "rb") as raw:
            names = ZipIndex(raw).other_names()  # all but numbered storages: enough here
    except (ZipDamage, OSError, ValueError, EOFError, struct.error) as exc:
        raise FormatError(f"{path} is a truncated or damaged zip file", "copy it again") from exc
    if any(n.endswith("constants.pkl") or "/code/" in n for n in names):
        raise FormatError(
            f"{path} is a TorchScript archive (torch.jit.save), not a state-dict checkpoint",
            "load it with torch.jit.load and save model.state_dict() with torch.save",
        )
    if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        raise FormatError(f"{path} is a zip archive but not a PyTorch checkpoint", _READS)
    return "torch-zip"


@dataclass
class Reading:
    """One way a loader reads the file: its name, who reads it so, and the pickles it runs."""

    kind: str
    reader: str
    pickles: list[PickleFindings] = field(default_factory=list)
    damaged: str | None = None  # the container itself (zip, tar) could not be read whole


def _did_something(run: PickleRun) -> bool:
    """A pickle run counts as a reading when it ended, or named anything before failing."""
    return run.damaged is None or bool(run.globals) or bool(run.problems)


def readings(path: str | Path) -> list[Reading]:
    """Every reading loaders would make of a file, the way each would make it.

    Returns:
        The readings in the order ``torch.load`` tries them, then the others; empty when no
        loader would read the file at all.

    Raises:
        FormatError: not a regular file, or unreadable.
    """
    path = Path(path)
    size = regular_file(path)
    found: list[Reading] = []
    with open(path, "rb") as raw:
        head = raw.read(16)
        if head.startswith(ZIP_MAGIC):
            return [_zip_reading(raw, "torch-zip", "torch.load")]
        tar = _open_tar(raw)
        if tar is not None:
            found.append(_tar_reading(tar))
        if size:
            # Mapped, not read: a legacy checkpoint's storages may be gigabytes after its pickles.
            with mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as data:
                stream = _pickle_stream(data)
            if stream is not None:
                found.append(stream)
    if _looks_like_safetensors(head, size):
        found.append(Reading("safetensors", "safetensors loaders"))
    if head.startswith(b"GGUF"):
        found.append(Reading("gguf", "llama.cpp's GGUF loaders"))
    if size and zipfile.is_zipfile(path):
        with open(path, "rb") as raw:
            found.append(_zip_reading(raw, "zip", "Python's zipfile (at the end)"))
    return found


# A zip's end: its end-of-directory records and, in most checkpoints, the whole directory
# and the small members torch writes last (``version``), fetched in the first request.
REMOTE_TAIL = 256 * 1024


def remote_readings(path: object, raw: Any) -> list[Reading]:
    """The readings of a file at a URL, through ``raw`` (a RangeFile): a torch zip's (its
    directory and pickles, a few ranged requests), or a safetensors or GGUF file's.

    Raises:
        FormatError: any other kind of file: a legacy torch file or a plain pickle is read
            whole by its loader (and mapped by ckptkit), so it must be downloaded first.
    """
    kind = remote_kind(path, raw)
    if kind == "torch-zip":
        raw.prefetch_tail(REMOTE_TAIL)
        return [_zip_reading(raw, "torch-zip", "torch.load")]
    if kind == "safetensors":
        return [Reading("safetensors", "safetensors loaders")]
    return [Reading("gguf", "llama.cpp's GGUF loaders")]


def remote_kind(path: object, raw: Any) -> str:
    """A file at a URL by its first bytes: ``torch-zip``, ``safetensors`` or ``gguf``.

    Raises:
        FormatError: empty, or another kind (see :func:`remote_readings`).
    """
    head = raw.pread(0, 16)
    size = raw.remote.size
    if head.startswith(ZIP_MAGIC):
        return "torch-zip"
    if _looks_like_safetensors(head, size):
        return "safetensors"
    if head.startswith(b"GGUF"):
        return "gguf"
    if size == 0:
        raise FormatError(
            f"{path} is empty (0 bytes)", "the save was interrupted; use an earlier copy"
        )
    raise FormatError(
        f"{path} is not a torch zip, safetensors or GGUF file, the kinds ckptkit reads at a URL",
        "download it and give the local copy (a legacy torch file or a pickle is read whole)",
    )


def starts_as_pickle(head: bytes) -> bool:
    """Bytes that open with a PROTO opcode, as every pickle of protocol 2 or later does."""
    return head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")


def _pickle_stream(data: mmap.mmap) -> Reading | None:
    """The pickles ``torch.load``'s legacy path and ``pickle.load`` run from byte 0."""
    first = scan_pickle(data, "pickle 1")
    if not _did_something(first.run) and not starts_as_pickle(data[:2]):
        return None
    legacy = first.run.root == LEGACY_MAGIC
    reading = Reading("torch-legacy" if legacy else "pickle", "torch.load and pickle.load")
    labels = ["magic number", "protocol", "system info", "main pickle", "storage keys"]
    if legacy:
        first.label = labels[0]
    reading.pickles.append(first)
    pos = first.run.end
    while first.run.damaged is None and pos < len(data) and len(reading.pickles) < _MAX_PICKLES:
        n = len(reading.pickles)
        if legacy and n == 5:
            break  # a legacy file's storages follow its five pickles
        found = scan_pickle(data, labels[n] if legacy else f"pickle {n + 1}", pos, legacy=n == 3)
        if not legacy and not _did_something(found.run):
            break  # trailing bytes that are no pickle: pickle.load never reads them
        reading.pickles.append(found)
        if found.run.damaged:
            break
        pos = found.run.end
    return reading


def _zip_reading(raw: io.BufferedReader, kind: str, reader: str) -> Reading:
    reading = Reading(kind, reader)
    try:
        raw.seek(0)
        with zipfile.ZipFile(raw) as zf:
            seen: set[str] = set()
            for info in zf.infolist():
                parts = info.filename.split("/")
                if info.is_dir() or (
                    len(parts) >= _STORAGE_MEMBER_PARTS
                    and parts[-2] == "data"
                    and parts[-1].isdigit()
                ):
                    continue
                if info.filename in seen:
                    reading.pickles.append(_problem(info.filename, "a second member by this name"))
                seen.add(info.filename)
                if info.file_size > MAX_MEMBER:
                    reading.damaged = f"member '{info.filename}' declares {info.file_size} bytes"
                    continue
                with zf.open(info) as member:
                    data = member.read(MAX_MEMBER + 1)
                found = scan_pickle(data, info.filename)
                # A member is a pickle by name, by its PROTO opcode, or by reading whole as one
                # (a TorchScript archive's source files name "globals" before they fail).
                if (
                    info.filename.endswith((".pkl", ".debug_pkl"))
                    or starts_as_pickle(data[:2])
                    or found.run.damaged is None
                ):
                    reading.pickles.append(found)
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        NotImplementedError,
        EOFError,
        OSError,
        ValueError,
        OverflowError,
        RuntimeError,
        UnicodeDecodeError,
        struct.error,
    ) as exc:
        reading.damaged = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # zlib.error, bz2/lzma errors: still a damaged archive
        reading.damaged = f"{type(exc).__name__}: {exc}"
    _mark_hidden(reading)
    return reading


def _mark_hidden(reading: Reading) -> None:
    """torch.load reads the first ``*/data.pkl`` only: any other pickle is hidden from it."""
    main = next((p for p in reading.pickles if p.label.endswith("data.pkl")), None)
    torchscript = any(p.label.endswith("constants.pkl") for p in reading.pickles)
    if torchscript and reading.kind == "torch-zip":
        reading.kind = "torchscript"
    for found in reading.pickles:
        if found is main or (torchscript and found.label.endswith((".pkl", ".debug_pkl"))):
            continue
        found.extra_problems.append(
            f"nested pickle in zip member '{found.label}' (torch.load skips it; others may not)"
        )


def _problem(label: str, text: str) -> PickleFindings:
    return PickleFindings(label, PickleScan(None, PickleRun()), extra_problems=[text])


def _tar_names(tar: tarfile.TarFile, most: int = 10_000) -> set[str]:
    """The first members' names of a tar (``./`` dropped, the top folder only), closed after;
    bounded, for a hostile archive of countless headers."""
    names: set[str] = set()
    try:
        with tar:
            for _ in range(most):
                info = tar.next()
                if info is None:
                    break
                names.add(info.name.removeprefix("./").split("/", 1)[0])
    except (tarfile.TarError, EOFError, OSError, ValueError):
        pass
    return names


def _tar_reading(tar: tarfile.TarFile) -> Reading:
    """A legacy tar checkpoint: torch unpickles its 'storages', 'tensors' and 'pickle' members;
    every member's pickles are scanned, following the storage records between them."""
    reading = Reading("legacy-tar", "torch.load")
    try:
        with tar:
            for info in tar.getmembers():
                if not info.isfile():
                    continue
                if info.size > MAX_MEMBER:
                    reading.damaged = f"member '{info.name}' declares {info.size} bytes"
                    continue
                member = tar.extractfile(info)
                data = member.read() if member else b""
                reading.pickles.extend(_tar_member_pickles(info.name, data))
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        reading.damaged = f"{type(exc).__name__}: {exc}"
    return reading


def _tar_member_pickles(name: str, data: bytes) -> list[PickleFindings]:
    """A member's pickles: one count, then (for storages and tensors) a record pickle followed
    by raw bytes whose length the record gives."""
    from ckptkit.formats.base.dtypes import DTYPES
    from ckptkit.formats.pickles.unpickler import storage_dtype

    first = scan_pickle(data, f"{name}: pickle 1")
    out = [first]
    count = first.run.root
    if name not in ("storages", "tensors") or first.run.damaged or type(count) is not int:
        return out
    pos = first.run.end
    for i in range(min(count, 1 << 20)):
        found = scan_pickle(data, f"{name}: record {i + 1}", pos)
        out.append(found)
        if found.run.damaged:
            return out
        pos = found.run.end
        record = found.run.root
        try:
            if name == "storages":
                itemsize = DTYPES[storage_dtype(record[2]) or "uint8"].itemsize
                (numel,) = struct.unpack_from("<q", data, pos)
                pos += 8 + numel * itemsize
            else:
                (ndim,) = struct.unpack_from("<i", data, pos)
                pos += 8 + 16 * ndim + 8
        except (struct.error, TypeError, IndexError, KeyError):
            found.run.damaged = f"record {i + 1} of '{name}' is cut short"
            return out
        if pos > len(data) or pos < 0:
            found.run.damaged = f"record {i + 1} of '{name}' runs past the member"
            return out
    if name == "storages" and pos < len(data):
        out.append(scan_pickle(data, f"{name}: storage views", pos))
    return out
