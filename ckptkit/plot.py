"""Training curves of one or more runs side by side: loss, accuracy and learning rate per step,
from each run folder's ``steps.jsonl`` (rank 0, every ``--log-every`` steps) and
``metrics.jsonl`` (validation at each epoch's end). Needs matplotlib (``ckptkit[plot]``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkit.engine.runlog import METRICS_LOG, STEPS_LOG, records
from ckptkit.errors import FormatError, OutputError, UsageError

__all__ = ["Curves", "read_curves", "plot_runs"]

PANELS = (("loss", "loss"), ("accuracy", "accuracy"), ("lr", "learning rate"))


@dataclass
class Curves:
    """One run's points: per step (train) and per epoch end (validation)."""

    name: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)


def read_curves(run: str | Path) -> Curves:
    """A run folder's logged points.

    Raises:
        FormatError: the folder holds no ``steps.jsonl`` nor ``metrics.jsonl``.
    """
    folder = Path(run)
    steps, epochs = folder / STEPS_LOG, folder / METRICS_LOG
    if not steps.is_file() and not epochs.is_file():
        raise FormatError(
            f"{folder} holds no steps.jsonl or metrics.jsonl",
            "give a run folder of `ckptkit train` (its --out)",
        )
    return Curves(
        folder.name or str(folder),
        records(steps) if steps.is_file() else [],
        records(epochs) if epochs.is_file() else [],
    )


def plot_runs(runs: list[str | Path], out: str | Path, *, force: bool = False) -> Path:
    """Draw the runs' curves into one PNG, a panel per quantity, the runs in each.

    Returns:
        The image's path.

    Raises:
        UsageError: matplotlib is not installed, or no run is given.
        OutputError: ``out`` exists (without ``force``).
    """
    if not runs:
        raise UsageError("give at least one run folder")
    try:
        import matplotlib
    except ImportError:
        raise UsageError("ckptkit plot needs matplotlib", "pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    from ckptkit.formats.io.atomic import atomic_output

    curves = [read_curves(run) for run in runs]
    out = Path(out)
    figure, axes = plt.subplots(1, len(PANELS), figsize=(12, 4), dpi=100)
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for curve in curves:
            points = [(p["step"], p[key]) for p in curve.steps if p.get(key) is not None]
            if points:
                (line,) = ax.plot(*zip(*points, strict=True), label=curve.name)
                val = [
                    (p["step"], p[f"val_{key}"])
                    for p in curve.epochs
                    if p.get(f"val_{key}") is not None
                ]
                if val:
                    ax.plot(
                        *zip(*val, strict=True),
                        "o--",
                        color=line.get_color(),
                        label=f"{curve.name} (val)",
                    )
        ax.set_title(title)
        ax.set_xlabel("step")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if ax.lines:
            ax.legend(fontsize="small")
    figure.tight_layout()
    with atomic_output(out, force=force) as tmp:
        with open(tmp, "wb") as f:
            figure.savefig(f, format="png")
    plt.close(figure)
    if not out.is_file():
        raise OutputError(f"{out} was not written")
    return out
