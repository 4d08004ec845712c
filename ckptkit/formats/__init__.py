"""On-disk formats: detection by content, ``open_source`` for reading, writers for output.

Importing this package does not import torch; readers import it only when a tensor is loaded.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path

from ckptkit.errors import FormatError
from ckptkit.formats.source import Source, TensorInfo

__all__ = [
    "Source",
    "TensorInfo",
    "detect_format",
    "open_source",
    "pickles_in",
    "OUTPUT_FORMATS",
    "output_format",
]

# Output format by suffix.
OUTPUT_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}

# Formats people mistake for checkpoints ckptkit reads, by their first bytes.
_FOREIGN_MAGIC = (
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x89HDF", "an HDF5 file (Keras / h5py)"),
    (b"\x93NUMPY", "a NumPy .npy file"),
    (b"\x08\x01\x12", "an ONNX model"),
    (b"\x1f\x8b", "a gzip archive"),
)

_READS = "ckptkit reads PyTorch files (torch.save: .pt .pth .bin .ckpt) and safetensors"


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 2 <= length <= size - 8 and head[8:9] == b"{"


def detect_format(path: str | Path) -> str:
    """Tell a file's format from its content: ``torch-zip``, ``torch-legacy`` or ``safetensors``.

    Raises:
        FormatError: a folder, a missing, empty or foreign file, TorchScript, or random bytes.
    """
    path = Path(path)
    if path.is_dir():
        raise FormatError(f"{path} is a folder", "give the checkpoint file inside it")
    if not path.exists():
        raise FormatError(f"{path} does not exist", "check the path")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            size = f.seek(0, 2)
    except OSError as exc:
        raise FormatError(f"cannot read {path}: {exc.strerror}") from None
    if size == 0:
        raise FormatError(
            f"{path} is empty (0 bytes)", "the save was interrupted; use an earlier copy"
        )
    if head.startswith(b"PK\x03\x04"):
        return _zip_kind(path)
    # Before the pickle test: a header length such as 0x280 also starts with b"\x80\x02".
    if _looks_like_safetensors(head, size):
        return "safetensors"
    if head.startswith(b"\x80") and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "torch-legacy"
    for magic, what in _FOREIGN_MAGIC:
        if head.startswith(magic):
            raise FormatError(f"{path} is {what}, not a checkpoint ckptkit reads", _READS)
    raise FormatError(f"{path} is not a recognised checkpoint", _READS)


def _zip_kind(path: Path) -> str:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except zipfile.BadZipFile:
        raise FormatError(f"{path} is a truncated or damaged zip file", "copy it again") from None
    if any(n.endswith("constants.pkl") or "/code/" in n for n in names):
        raise FormatError(
            f"{path} is a TorchScript archive (torch.jit.save), not a state-dict checkpoint",
            "load it with torch.jit.load and save model.state_dict() with torch.save",
        )
    if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        raise FormatError(f"{path} is a zip archive but not a PyTorch checkpoint", _READS)
    return "torch-zip"


_PICKLE_START = tuple(b"\x80" + bytes([proto]) for proto in (2, 3, 4, 5))
_STORAGE_MEMBER = re.compile(r"(.*/)?data/\d+")


def pickles_in(path: str | Path) -> tuple[str, list[tuple[str, bytes]]]:
    """Every pickle in a file, for a safety scan: ``(kind, [(label, bytes)])``.

    ``kind`` is ``torch-zip``, ``torchscript``, ``torch-legacy``, ``pickle`` or ``safetensors``
    (which holds none). In a zip, every member but the raw storages is checked, so a pickle
    hidden under another name is found too.

    Raises:
        FormatError: a missing, empty or foreign file.
    """
    path = Path(path)
    try:
        kind = detect_format(path)
    except FormatError as exc:
        if "TorchScript" not in exc.message:
            raise
        kind = "torchscript"
    if kind == "safetensors":
        return kind, []
    if kind in ("torch-zip", "torchscript"):
        found = []
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if _STORAGE_MEMBER.fullmatch(info.filename) or info.is_dir():
                    continue
                with zf.open(info) as member:
                    head = member.read(2)
                if info.filename.endswith(".pkl") or head in _PICKLE_START:
                    found.append((info.filename, zf.read(info)))
        return kind, found
    data = path.read_bytes()
    return _pickle_sequence(data)


def _pickle_sequence(data: bytes) -> tuple[str, list[tuple[str, bytes]]]:
    """A legacy torch file's five pickles, or the pickles one after another in a plain file."""
    from ckptkit.formats.static_unpickler import read_pickle
    from ckptkit.formats.torchfile import LEGACY_MAGIC

    stream = io.BytesIO(data)
    try:
        legacy = read_pickle(stream).root == LEGACY_MAGIC
    except FormatError:
        legacy = False
    labels = ["magic number", "protocol", "system info", "main pickle", "storage keys"]
    found: list[tuple[str, bytes]] = []
    start = 0
    while start < len(data):
        if len(found) == 5 if legacy else data[start : start + 2] not in _PICKLE_START:
            break  # a legacy file's storages follow its five pickles
        end = _pickle_end(data, start)
        label = labels[len(found)] if legacy else f"pickle {len(found) + 1}"
        found.append((label, data[start:end]))
        start = end
    return ("torch-legacy" if legacy else "pickle"), found


def _pickle_end(data: bytes, start: int) -> int:
    import pickletools

    stream = io.BytesIO(data)
    stream.seek(start)
    try:
        for op, _, _ in pickletools.genops(stream):
            if op.name == "STOP":
                return stream.tell()
    except Exception:  # a damaged pickle: the scan reports it; take the rest of the file
        pass
    return len(data)


def checkpoint_index(path: Path) -> Path | None:
    """The shard index a path stands for (an ``*.index.json``, or a folder holding one)."""
    from ckptkit.formats.sharded import find_index

    if path.is_dir():
        return find_index(path)
    return path if path.name.endswith(".index.json") and path.is_file() else None


def open_source(
    path: str | Path,
    *,
    select: str | None = None,
    trust: bool = False,
    allow_globals: Iterable[str] = (),
) -> Source:
    """Open a checkpoint for reading, without executing any of its code.

    Args:
        path: a torch zip or legacy file, a safetensors file, or a sharded checkpoint (its
            ``*.index.json``, or the folder holding it).
        select: dotted path of the state dict inside a training checkpoint (default: found).
        trust: load with torch's full unpickler, which can run code from the file.
        allow_globals: globals (``module.Name``) admitted beside torch's safe set; they are
            still never imported, only recorded.

    Raises:
        FormatError: the file is not a readable checkpoint.
        UnsafeCheckpointError: the pickle names globals outside the safe set.
        SelectError: no state dict found, or ``select`` names none.
    """
    path = Path(path)
    index = checkpoint_index(path)
    if index is not None:
        from ckptkit.formats.sharded import ShardedSource

        if select not in (None, ""):
            raise FormatError(f"{path} is a sharded state dict", "drop --select")
        return ShardedSource(index, opener=open_source, allow_globals=allow_globals)
    kind = detect_format(path)
    if kind == "safetensors":
        from ckptkit.formats.safetensors import SafetensorsSource

        return SafetensorsSource(path, select=select)
    from ckptkit.formats.torchfile import TorchFileSource, TrustedTorchSource

    if trust:
        return TrustedTorchSource(path, select=select)
    return TorchFileSource(path, select=select, allow_globals=allow_globals)


def output_format(path: str | Path) -> str:
    """``safetensors`` or ``torch``, from the output file's suffix.

    Raises:
        FormatError: a suffix ckptkit does not write.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in OUTPUT_FORMATS:
        raise FormatError(
            f"cannot tell the output format of {path}",
            "end the name with .safetensors or .pt",
        )
    return OUTPUT_FORMATS[suffix]
