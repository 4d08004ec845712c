"""The kinds of adapter file ckptkit reads, as a table: how each is told from an opened Source
(``detect``) and read into an :class:`~ckptkit.adapters.adapter.Adapter` (``read``).
``adapter_of`` asks each in turn; what differs between kinds after that (how targets are named
in the base, what ``inspect`` lists) is the adapter's own methods.

A PeftModel state dict (``wrapped.py``) is not in the table: it is a base model with an adapter
inside, split by ``open_merged`` with options only the caller gives (``--lora-alpha``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckptkit.adapters.adapter import Adapter
from ckptkit.adapters.kohya import is_kohya, read_kohya
from ckptkit.adapters.peft import CONFIG, WEIGHTS, adapter_from_tensors, read_config
from ckptkit.formats.base.source import Source

__all__ = ["Reader", "READERS", "adapter_of"]


@dataclass(frozen=True)
class Reader:
    """One kind of adapter file."""

    kind: str  # as reports and ``inspect`` name it
    detect: Callable[[Source], bool]
    read: Callable[[Source], Adapter]


def _is_peft_file(source: Source) -> bool:
    """A PEFT adapter's weights file: its ``save_pretrained`` name, the config beside it."""
    return source.path.name in WEIGHTS and (source.path.parent / CONFIG).is_file()


def _read_peft_file(source: Source) -> Adapter:
    folder = source.path.parent
    return adapter_from_tensors(folder, source, read_config(folder / CONFIG), kind="PEFT LoRA")


# In order: a kohya file is told by its keys alone, whatever its name.
READERS = (
    Reader("kohya LoRA", lambda source: is_kohya(source.keys()), lambda s: read_kohya(s.path, s)),
    Reader("PEFT LoRA", _is_peft_file, _read_peft_file),
)


def adapter_of(source: Source) -> Adapter | None:
    """The adapter a Source holds (a kohya file by its keys, a PEFT adapter file by the config
    beside it), or None for a model's weights."""
    for reader in READERS:
        if reader.detect(source):
            return reader.read(source)
    return None
