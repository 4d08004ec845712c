"""Progress bars for long library calls: tqdm, imported only when a bar is shown."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


def progress_bar(total: int, desc: str) -> Any:
    """A byte-counting bar that disappears when done (tqdm's import costs 30 ms: only here)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, leave=False, desc=desc)
