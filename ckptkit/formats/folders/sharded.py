"""Sharded checkpoints: an ``*.index.json`` whose ``weight_map`` names the shard of every key.

This is the layout the Hugging Face ecosystem reads (``model.safetensors.index.json`` or
``pytorch_model.bin.index.json`` beside ``model-00001-of-0000N.*``). Each shard is opened as its
own Source, headers first; tensors are read from their shard when asked for.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.storage.location import Location, by_name
from ckptkit.storage.small import read_json

if TYPE_CHECKING:
    import torch

__all__ = ["ShardedSource", "find_index", "read_index"]


def find_index(folder: Location) -> Location | None:
    """The index file of a sharded checkpoint folder (safetensors preferred), or None."""
    indexes = by_name(folder.glob("*.safetensors.index.json")) or by_name(
        folder.glob("*.index.json")
    )
    if len(indexes) > 1:
        names = ", ".join(p.name for p in indexes)
        raise FormatError(f"{folder} holds several indexes ({names})", "give the one to read")
    return indexes[0] if indexes else None


def read_index(index: Location) -> tuple[dict[str, str], dict[str, Any]]:
    """Read an index: (key -> shard file name, the index's metadata). Its size and nesting are
    bounded before anything walks it (``read_json``), local or at a URL."""
    try:
        data = read_json(index, "shard index")
    except OSError as exc:
        raise FormatError(f"cannot read {index} ({exc.strerror or exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if weight_map is None:
        raise FormatError(f"{index} is not a shard index (no weight_map)")
    if not isinstance(weight_map, dict):
        raise FormatError(f"{index} is not a shard index (weight_map is not a mapping)")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise FormatError(
            f"{index} is not a shard index (its metadata is a {type(metadata).__name__}, "
            "not a mapping)",
            "check that it is the index its shards were saved with",
        )
    return {str(k): str(v) for k, v in weight_map.items()}, dict(metadata)


class ShardedSource(Source):
    """Several shard files read as one state dict."""

    def __init__(
        self, index: Location, *, opener: Any, allow_globals: Iterable[str] | None = None
    ) -> None:
        """``opener`` opens each shard (``open_source``, or one with the caller's options bound:
        then ``allow_globals`` is None and the opener's own are kept)."""
        weight_map, index_meta = read_index(index)
        super().__init__(
            path=index,
            format="sharded",
            metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in index_meta.items()},
        )
        self.selected_reason = "a sharded checkpoint's weight_map"
        self.shards: dict[str, Source] = {}
        self._where: dict[str, Source] = {}
        self._entries: list[tuple[str, TensorInfo]] | None = None
        try:
            names = sorted(set(weight_map.values()))  # model-00001-of-... first
            for name in names:
                if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                    raise FormatError(f"{index} names a shard outside its folder: {name!r}")
                shard_path = index.parent / name
                if isinstance(shard_path, Path) and not shard_path.exists():  # a URL: when read
                    raise FormatError(f"shard {name} named by {index} is missing", "copy it there")
            self._open_shards(index, names, opener, allow_globals)
            # Each shard's keys once, as a set: a lookup per index key, not a list per lookup.
            held = {name: set(shard.keys()) for name, shard in self.shards.items()}
            for key, name in weight_map.items():
                if key not in held[name]:
                    raise FormatError(f"{index} puts '{key}' in {name}, which does not hold it")
                self._where[key] = self.shards[name]
            del held
            for shard in self.shards.values():  # ties a shard records beside what it stores
                for alias, target in shard.aliases().items():
                    if alias not in self._where and self._where.get(target) is shard:
                        self._where[alias] = shard
        except BaseException:
            self.close()
            raise
        self.shard_format = next(iter(self.shards.values())).format if self.shards else "empty"
        self.globals = sorted({g for shard in self.shards.values() for g in shard.globals})

    def _open_shards(
        self, index: Location, names: list[str], opener: Any, allow_globals: Iterable[str] | None
    ) -> None:
        """Each shard opened (its header read); at a URL, several at once (a request or two
        each, mostly waiting)."""
        given = {} if allow_globals is None else {"allow_globals": allow_globals}
        if isinstance(index, Path):
            for name in names:
                self.shards[name] = opener(index.parent / name, **given)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8, thread_name_prefix="ckptkit-open") as pool:
            # each in the caller's context: its requests count in the command's counter
            futures = [
                pool.submit(_in_context(opener), index.parent / name, **given) for name in names
            ]
            failure: BaseException | None = None
            for name, future in zip(names, futures, strict=True):
                try:
                    self.shards[name] = future.result()
                except BaseException as exc:  # the first failure is raised; the rest closed
                    failure = failure or exc
            if failure is not None:
                raise failure

    def entries(self) -> list[tuple[str, TensorInfo]]:
        if self._entries is None:  # made once: inspect, convert and diff each ask several times
            out = []
            where = self._where
            for name, shard in self.shards.items():
                for key, info in shard.entries():
                    if where.get(key) is shard:
                        if info.storage is not None:  # storages are per shard: name them so
                            info = replace(info, storage=f"{name}:{info.storage}")
                        out.append((key, info))
            self._entries = out
        return list(self._entries)

    def aliases(self) -> dict[str, str]:
        # Ties are only ever kept within one shard.
        return {a: b for shard in self.shards.values() for a, b in shard.aliases().items()}

    def load(self, key: str) -> torch.Tensor:
        return self._where[key].load(key)

    def byte_span(self, key: str) -> tuple[Location, int, int] | None:
        return self._where[key].byte_span(key)

    def byte_pieces(self, key: str) -> list[tuple[Location, int, int]] | None:
        return self._where[key].byte_pieces(key)

    def expected_crc(self, key: str) -> int | None:
        return self._where[key].expected_crc(key)

    def stream(self, key: str, piece: int) -> Iterator[bytearray] | None:
        return self._where[key].stream(key, piece)

    def files(self) -> list[Location]:
        return [self.path] + [f for shard in self.shards.values() for f in shard.files()]

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()


def _in_context(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` run in the caller's context (in a pool's thread): what it opens counts its
    requests in the caller's command (``storage.backends.base.counting``)."""
    context = contextvars.copy_context()
    return lambda *args, **kwargs: context.run(call, *args, **kwargs)
