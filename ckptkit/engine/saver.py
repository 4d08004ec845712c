"""Saving in the background (``--async-save``): the training state is copied to CPU memory
(staged), then one thread writes it by the usual commit protocol while training goes on. At
most one save is in flight: the next waits for it, and so does the end of the run. A save that
fails raises at the next save or at the end, never silently."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ckptkit.formats.tree import map_leaves

__all__ = ["BackgroundSaver", "staged"]


def staged(value: Any) -> Any:
    """A copy of ``value`` whose tensors are copies in CPU memory (the same tensor twice, a
    tie, stays one copy), so training may change the originals while it is written."""
    memo: dict[int, torch.Tensor] = {}

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in memo:
            memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
        return memo[id(tensor)]

    return map_leaves(value, torch.is_tensor, copy)


class BackgroundSaver:
    """One save at a time, on a thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], Any]) -> None:
        """Wait for the save in flight (raising its error), then start ``write``."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self._error = exc

        self._thread = threading.Thread(target=run, name="ckptkit-save")
        self._thread.start()

    def wait(self) -> None:
        """Wait for the save in flight; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
