"""Which shipped pack maps a checkpoint, from its keys and file names alone: what ``inspect``
says of a checkpoint in a model family's own names (``tok_embeddings.weight``,
``layers.0.attention.wq.weight``) or layout (Meta's ``consolidated.NN.pth`` rank files)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptkit.errors import MappingError
from ckptkit.formats.folders.layouts import model_parallel_files
from ckptkit.mapping.patterns import Pattern
from ckptkit.mapping.spec import load_mapping, packs
from ckptkit.storage.location import Location

__all__ = ["Recognised", "packs_for", "model_parallel"]


def packs_for(
    keys: Iterable[str], name: str, fits: Callable[[str], bool] | None = None
) -> list[str]:
    """The shipped packs whose source side reads these keys (every key is some rule's) from a
    checkpoint called ``name``. A side that names its files (Meta's ``consolidated.NN.pth``)
    is a candidate only for a file so named, and such packs, where any fits, are the answer
    alone: the file's name says which family wrote it. Where several remain, those that
    ``fits`` (the whole mapping plans on the checkpoint) are kept, if any."""
    keys = list(keys)
    if not keys:
        return []
    named, unnamed = [], []
    for pack in packs():
        mapping = load_mapping(pack)
        patterns = [p for rule in mapping.rules for p in rule.sources]
        if not all(any(_matches(p, key) for p in patterns) for key in keys):
            continue
        side = mapping.source
        if side.file is None and side.files is None:
            unnamed.append(pack)
        elif side.file == name or (side.files is not None and _matches(side.files, name)):
            named.append(pack)
    found = named or unnamed
    if fits is not None and len(found) > 1:
        return [pack for pack in found if fits(pack)] or found
    return found


def _matches(pattern: Pattern, key: str) -> bool:
    try:
        return pattern.match(key, {}) is not None
    except MappingError:  # a shifted capture ({i + offset}) needs the mapping's variables
        return False


@dataclass(frozen=True)
class Recognised:
    """A model family's rank files (or its one file) in a folder, and the pack that maps them."""

    family: str
    pack: str
    files: list[str]

    def said(self, where: Location) -> str:
        """What inspect says before showing the pack's plan."""
        if len(self.files) == 1:
            what = f"a {self.family} checkpoint ({self.files[0]})"
        else:
            what = f"a {self.family} checkpoint in {len(self.files)} model-parallel files"
        return f"{where} is {what}: shown as --map {self.pack} maps it to Hugging Face"

    def one_of(self, name: str) -> str | None:
        """For one of several rank files: that it is a slice of every weight, not the model."""
        if name not in self.files or len(self.files) < 2:
            return None
        return (
            f"one of {len(self.files)} model-parallel files of a {self.family} checkpoint: a "
            f"slice of every weight, not the model; inspect or convert their folder with "
            f"--map {self.pack}"
        )


def model_parallel(folder: Location) -> Recognised | None:
    """The model family's own files in ``folder`` (see ``layouts.MODEL_PARALLEL``), if any."""
    found = model_parallel_files(folder)
    if found is None:
        return None
    names, family, pack = found
    return Recognised(family, pack, names)
