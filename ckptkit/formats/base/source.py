"""The ``Source`` every reader returns: a checkpoint's tensors by key, headers first, data later."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ckptkit.errors import FormatError
from ckptkit.formats.base import dtypes
from ckptkit.formats.base.laid import Laid
from ckptkit.formats.base.layout import Layout
from ckptkit.formats.base.tree import Candidate, DroppedPart, Selection
from ckptkit.storage.location import Location
from ckptkit.storage.rangefile import RangeFile

if TYPE_CHECKING:
    import torch

__all__ = ["TensorInfo", "Source", "KINDS", "KEPT_IN_TORCH"]

# What a tensor that is not a plain dense one is, for messages (``TensorInfo.kind``).
KINDS = {
    "placeholder": "an empty placeholder (DeepSpeed ZeRO-3 keeps the weights in the optimizer "
    "states)",
    "sparse": "a sparse tensor",
    "quantized": "a quantized tensor",
    "meta": "a meta tensor, which holds no data",
    "nested": "a nested tensor",
    "tensor subclass": "a tensor subclass",
    "DTensor": "one rank's shard of a DTensor (its full shape shown)",
    "packed params": "a quantized module's packed weight and bias",
    "value": "a value a quantized module keeps in its state dict",
}
# Kinds a ``.pt`` output keeps as they are (torch.save holds them; safetensors cannot).
KEPT_IN_TORCH = frozenset({"sparse", "quantized", "packed params", "value", "tensor subclass"})


@dataclass(frozen=True, slots=True)  # slots: 100 bytes less each, for 100,000 tensors
class TensorInfo:
    """What a header says about one tensor: enough to plan a conversion without its data.

    ``storage`` identifies the buffer the tensor lives in (None when it owns its bytes, as in
    safetensors) and ``byte_range`` is the part of that buffer it covers, so aliasing can be seen.
    """

    dtype: str
    shape: tuple[int, ...]
    storage: str | None = None
    byte_range: tuple[int, int] = (0, 0)
    contiguous: bool = True
    kind: str = "dense"  # or a key of KINDS
    detail: str = ""  # what a tensor of another kind is ("COO, 7 stored values")
    stored: int | None = None  # bytes, where a block format stores it otherwise (GGUF's Q8_0)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return dtypes.nbytes(self.dtype, self.shape) if self.stored is None else self.stored

    def to_dict(self) -> dict[str, Any]:
        out = {"dtype": self.dtype, "shape": list(self.shape), "bytes": self.nbytes}
        return out if self.kind == "dense" else {**out, "kind": self.kind, "detail": self.detail}


@dataclass
class Source(ABC):
    """An opened checkpoint. Use as a context manager, or call :meth:`close`."""

    path: Location
    format: str
    metadata: dict[str, str] = field(default_factory=dict)
    selected: str = ""
    selected_reason: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    dropped: list[DroppedPart] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)  # every tensor map that could be it
    globals: list[str] = field(default_factory=list)
    # Files read from outside the folder given (a shard symlinked elsewhere): "name -> target".
    followed: list[str] = field(default_factory=list)
    # The model folder the weights came from (save_pretrained's), whose other files (config,
    # tokenizer) a folder output copies.
    folder: Location | None = None
    # A model folder whose other files (config, tokenizer) a folder output copies, though the
    # weights come from elsewhere (a mapping's --config-from); ``folder`` takes precedence.
    config_folder: Location | None = None
    # The weights file name a folder output takes, as the source's library names it
    # (diffusers' diffusion_pytorch_model.safetensors); None: transformers' model.safetensors.
    weights_name: str | None = None
    # The tensors are a diffusers EMAModel's shadow_params, a list keyed here by position
    # ("0", "1", ...): names come from the model (open_source's names_from).
    unnamed: bool = False
    # Files a model folder output writes beside the weights, made rather than copied: name ->
    # text (the config.json a mapping writes from the source's params.json).
    documents: dict[str, str] = field(default_factory=dict)
    # Its tensors made through torch are checked by the CRC-32 of the bytes as they were
    # written, not made again from the files (a mapping reads each source byte once).
    made_once: ClassVar[bool] = False
    # A file at a URL: the byte file its reader reads through (its first read gave the size);
    # None on a local disk, where readers map or kernel-copy the file itself.
    remote_file: RangeFile | None = field(default=None, init=False, repr=False)
    _infos: dict[str, TensorInfo] | None = field(default=None, init=False, repr=False)

    @abstractmethod
    def entries(self) -> list[tuple[str, TensorInfo]]:
        """Every tensor of the selected state dict, in file order, from headers alone."""

    @abstractmethod
    def load(self, key: str) -> torch.Tensor:
        """One tensor, on the CPU, memory-mapped where the format allows."""

    def adopt(self, selection: Selection) -> Mapping[str, Any]:
        """Take a training checkpoint's selection: where the state dict was and why, and the
        rest of the checkpoint. Returns the state dict."""
        self.selected, self.selected_reason = selection.path, selection.reason
        self.extras, self.dropped = selection.extras, selection.dropped
        self.candidates = selection.candidates
        self.unnamed = selection.unnamed
        return selection.state_dict

    def value(self, key: str) -> Any:
        """What the state dict holds under ``key``: :meth:`load`'s tensor, or for a sparse or
        quantized tensor or packed parameters, :meth:`load_value`'s."""
        return self.load(key)

    def module_versions(self, mapping: Mapping[str, str | None]) -> dict[str, Any] | None:
        """The per-module version records torch keeps in a state dict's ``_metadata`` (quantized
        modules need them to load), for the keys renamed by ``mapping``; None when there are
        none to keep (only files with sparse, quantized or packed entries carry them over)."""
        return None

    def load_value(self, key: str) -> Any:
        """An entry that is not a plain dense tensor (sparse, quantized, packed parameters),
        as torch's own safe loader (``weights_only=True``) gives it."""
        raise FormatError(f"'{key}' in {self.path} is not a plain tensor, which this reader keeps")

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        """Where a tensor's bytes lie in a file, ready to copy as they are: (file, offset,
        length), or None when they must go through torch (strided, compressed, ...)."""
        return None

    def local_span(self, key: str) -> tuple[Location, int, int] | None:
        """:meth:`byte_span` when its file is on a local disk (mapped, compared in place);
        None for a file at a URL, whose bytes come through :meth:`load`."""
        span = self.byte_span(key)
        return span if span is not None and isinstance(span[0], Path) else None

    def byte_pieces(self, key: str) -> list[tuple[Location, int, int]] | None:
        """A tensor's bytes as ranges of files whose concatenation is the tensor (a sharded
        layout such as DeepSpeed's partitions), or None as for :meth:`byte_span`."""
        span = self.byte_span(key)
        return None if span is None else [span]

    def made_pieces(self, key: str) -> list[memoryview] | None:
        """A tensor made by moving bytes of the source's files (a mapping's rank slices joined,
        rows permuted, a sharded save's column chunks): views whose concatenation is its
        bytes; None for any other (its byte pieces are copied, or it goes through torch)."""
        return None

    def laid_out(self, key: str) -> Laid | None:
        """The tensor as ranges of local files and a layout over them (what a mapping composes
        its ops on); by default its byte pieces end to end. None where its bytes do not lie in
        local files as they are (a URL, compression, a cast)."""
        pieces = self.byte_pieces(key)
        spans = []
        for path, offset, length in pieces or ():
            if not isinstance(path, Path):
                return None
            spans.append((path, offset, length))
        info = self.info(key)
        if pieces is None or sum(s[2] for s in spans) != info.nbytes or info.kind != "dense":
            return None
        itemsize = dtypes.DTYPES[info.dtype].itemsize
        return Laid(
            spans, Layout(info.shape, itemsize, [(i, 0, s[2]) for i, s in enumerate(spans)])
        )

    def info(self, key: str) -> TensorInfo:
        """One tensor's :class:`TensorInfo` (:meth:`entries` read once)."""
        if self._infos is None:
            self._infos = dict(self.entries())
        return self._infos[key]

    def expected_crc(self, key: str) -> int | None:
        """The CRC-32 a file records for exactly this tensor's bytes (a torch zip's member that
        holds the whole tensor), to check bytes fetched from a URL against; None when none."""
        return None

    def stream(self, key: str, piece: int) -> Iterator[bytearray] | None:
        """A tensor that can only be read by decompressing it (a deflated zip member), as its
        bytes in order, ``piece`` bytes at a time (the last one shorter), so memory holds a
        piece, not the tensor; None for any other tensor (:meth:`load` it)."""
        return None

    def files(self) -> list[Location]:
        """Every file this Source reads."""
        return [self.path]

    def keys(self) -> list[str]:
        return [key for key, _ in self.entries()]

    def aliases(self) -> dict[str, str]:
        """Keys that are the very same tensor as an earlier key (tied weights): alias -> first."""
        first: dict[tuple[Any, ...], str] = {}
        aliases: dict[str, str] = {}
        for key, info in self.entries():
            if info.storage is None or info.numel == 0:
                continue
            ident = (info.storage, info.byte_range, info.dtype, info.shape, info.contiguous)
            if ident in first:
                aliases[key] = first[ident]
            else:
                first[ident] = key
        return aliases

    def close(self) -> None:  # noqa: B027 - readers without handles need not override it
        """Release file handles and mappings (tensors already loaded stay valid)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def url_prefetcher(source: Source, keys: Iterable[str], files: Any, workers: int = 4) -> Any:
    """For a source at a URL: the bytes of ``keys`` (those laid out as byte ranges, in the
    order they will be read) fetched ahead, ``workers`` requests at a time, through
    ``files``' connections (a RangeReader); None for a local source or nothing to fetch."""
    from ckptkit.storage.fetch import Prefetcher

    spans = []
    for key in keys:
        span = source.byte_span(key)
        if span is None:
            continue
        remote = files.remote(span[0])
        if remote is not None:  # a range of a file at a URL
            spans.append((key, remote, span[1], span[2]))
    return Prefetcher(spans, workers=workers) if spans else None
