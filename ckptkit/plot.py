"""Training curves of one or more runs side by side: loss, accuracy and learning rate per step,
from each run folder's ``steps.jsonl`` (rank 0, every ``--log-every`` steps) and
``metrics.jsonl`` (validation at each epoch's end). Needs matplotlib (``ckptkit[plot]``).

:func:`build_figure` makes the figure and draws nothing to disk, so what it shows (labels,
line styles, scales, where the legend is) can be read back; :func:`plot_runs` writes it as a
PNG, atomically.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptkit.engine.runlog import METRICS_LOG, STEPS_LOG, records
from ckptkit.errors import CkptkitError, FormatError, MissingFileError, OutputError, UsageError
from ckptkit.storage.location import Location, absolute_parts, is_remote, listable, location

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "Curves",
    "read_curves",
    "run_names",
    "loss_scale",
    "build_figure",
    "plot_runs",
]

PANELS = (("loss", "loss"), ("accuracy", "accuracy"), ("lr", "learning rate"))
X_LABEL = "optimizer step"
VAL_LABEL = "validation (hollow, at each epoch's end)"
LOG_DECADES = 2  # a loss spanning more than this many decades gets a log axis by default
# Each run gets its own dash pattern, marker and width (the first is the widest and drawn
# underneath), so that two runs on top of each other (a single and a DDP run of the same
# config) both stay visible.
LINE_STYLES: tuple[Literal["-", "--", "-.", ":"], ...] = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
MARKS_PER_LINE = 8
WIDTH, HEIGHT, DPI = 12.0, 4.0, 100  # a 1200 x 400 image, a legend row or two below the panels
LEGEND_COLUMNS = 4


@dataclass
class Curves:
    """One run's points: per step (train) and per epoch end (validation), and how it ran."""

    name: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    mode: str | None = None  # single, dp, ddp or fsdp: from the run's latest checkpoint
    world_size: int | None = None  # from the checkpoint, else from metrics.jsonl

    @property
    def label(self) -> str:
        """The name, with how the run ran when it recorded that: ``a/run (ddp x2)``."""
        if self.mode and self.world_size:
            return f"{self.name} ({self.mode} x{self.world_size})"
        if self.mode:
            return f"{self.name} ({self.mode})"
        if self.world_size:
            return f"{self.name} (x{self.world_size})"
        return self.name

    def points(self, key: str) -> list[tuple[float, float]]:
        """(step, value) per logged step; a run without ``steps.jsonl`` gives its epochs'."""
        return _points(self.steps or self.epochs, key)

    def val_points(self, key: str) -> list[tuple[float, float]]:
        """(step, validation value) at the epochs' ends that validated."""
        return _points(self.epochs, f"val_{key}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _points(lines: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    out = []
    for line in lines:
        step, value = _number(line.get("step")), _number(line.get(key))
        if step is not None and value is not None:
            out.append((step, value))
    return out


def run_names(runs: Sequence[str | Path]) -> list[str]:
    """Each run's shortest path suffix that no other run shares: ``a/run`` and ``b/run`` for
    those two, ``x`` and ``y`` for ``runs/x`` and ``runs/y``, the folder's name for one run.
    Paths are made absolute first (``.`` is the current folder's name); a URL is named by its
    path (``s3://bucket/runs/x``: ``x``, then ``runs/x``); a folder given twice is named ``#2``
    the second time."""
    absolute = [_parts(run) for run in runs]
    unique = list(dict.fromkeys(absolute))

    def suffix(parts: tuple[str, ...], count: int) -> tuple[str, ...]:
        return parts[-count:]

    names: dict[tuple[str, ...], str] = {}
    for parts in unique:
        count = 1
        while count < len(parts) and any(
            suffix(other, count) == suffix(parts, count) for other in unique if other != parts
        ):
            count += 1
        names[parts] = _joined(suffix(parts, count))
    seen: dict[tuple[str, ...], int] = {}
    out = []
    for parts in absolute:
        seen[parts] = seen.get(parts, 0) + 1
        out.append(names[parts] + (f" #{seen[parts]}" if seen[parts] > 1 else ""))
    return out


def _parts(run: str | Path) -> tuple[str, ...]:
    """A run's absolute path as parts (a URL's first one its scheme and bucket)."""
    return absolute_parts(location(run))


def _joined(parts: tuple[str, ...]) -> str:
    return "/".join(parts) if "://" in parts[0] else Path(*parts).as_posix()


def _how_it_ran(folder: Location, epochs: list[dict[str, Any]]) -> tuple[str | None, int | None]:
    """The run's mode and world size: recorded in its checkpoints' training metadata (read
    from the pickle's header, no tensor data), the world size also in ``metrics.jsonl``."""
    from ckptkit.formats.folders.runs import is_run_folder

    world: int | None = None
    for line in epochs:
        if isinstance(line.get("world_size"), int) and not isinstance(line["world_size"], bool):
            world = line["world_size"]
    mode = None
    if is_run_folder(folder):
        from ckptkit.formats.open import open_source
        from ckptkit.meta import training_of

        try:  # the latest checkpoint's headers: no tensor, no scan of the other files
            with open_source(folder, check_safety=False) as source:
                training = training_of(source.extras, source.metadata)
        except (CkptkitError, OSError):  # a damaged checkpoint: the curves are still worth it
            training = {}
        if isinstance(training.get("mode"), str):
            mode = training["mode"]
        if isinstance(training.get("world_size"), int):
            world = training["world_size"]
    return mode, world


def read_curves(run: str | Path, name: str | None = None) -> Curves:
    """A run folder's logged points, named ``name`` (default: the folder's name).

    Raises:
        FormatError: the folder does not exist, is a file, or holds no ``steps.jsonl`` nor
            ``metrics.jsonl``.
    """
    folder = location(run)
    if not listable(folder):
        raise UsageError(
            f"{folder} is a folder at an http(s) URL, which cannot be listed",
            "give its s3:// (or other listable) URL, or download the run folder",
        )
    if not folder.exists():
        raise MissingFileError(folder, "give the run folder that `ckptkit train --out` wrote")
    if not folder.is_dir():
        raise FormatError(
            f"{folder} is a file, not a run folder",
            f"give the run folder that holds it ({folder.parent})",
        )
    steps, epochs = folder / STEPS_LOG, folder / METRICS_LOG
    if not steps.is_file() and not epochs.is_file():
        raise FormatError(
            f"{folder} holds no steps.jsonl or metrics.jsonl",
            "give a run folder of `ckptkit train` (its --out)",
        )
    per_epoch = records(epochs) if epochs.is_file() else []
    mode, world = _how_it_ran(folder, per_epoch)
    return Curves(
        name or folder.name or str(folder),
        records(steps) if steps.is_file() else [],
        per_epoch,
        mode,
        world,
    )


def loss_scale(curves: Sequence[Curves], log_y: bool | None = None) -> str:
    """``"log"`` or ``"linear"``: ``log_y`` when given, else log when the losses (train and
    validation) are all positive and span more than two decades. A forced log axis needs a
    positive loss to show."""
    values = [
        value
        for curve in curves
        for _, value in curve.points("loss") + curve.val_points("loss")
        if math.isfinite(value)
    ]
    positive = [value for value in values if value > 0]
    if log_y is not None:
        return "log" if log_y and positive else "linear"
    if not positive or len(positive) < len(values):
        return "linear"
    return "log" if max(positive) > min(positive) * 10**LOG_DECADES else "linear"


def build_figure(curves: Sequence[Curves], *, log_y: bool | None = None) -> Figure:
    """The figure of the runs' curves: a panel per quantity, the runs in each, each run with its
    own color, dash pattern and marker; a legend below the panels, outside the data.

    Raises:
        UsageError: matplotlib is not installed, or no run is given.
    """
    if not curves:
        raise UsageError("give at least one run folder")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError:
        raise UsageError("ckptkit plot needs matplotlib", "pip install matplotlib") from None

    has_val = any(curve.epochs and curve.val_points(key) for curve in curves for key, _ in PANELS)
    entries = len(curves) + has_val
    rows = math.ceil(entries / LEGEND_COLUMNS)
    figure = Figure(figsize=(WIDTH, HEIGHT + 0.25 * (rows - 1)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)  # files only, no display: the Agg backend, global state untouched
    axes = figure.subplots(1, len(PANELS))
    colors = [f"C{i % 10}" for i in range(len(curves))]
    handles: list[Any] = []
    for i, curve in enumerate(curves):
        handles.append(
            Line2D(
                [],
                [],
                color=colors[i],
                linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                linewidth=_width(i),
                marker=MARKERS[i % len(MARKERS)],
                label=curve.label,
            )
        )
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        _draw_panel(ax, key, title, curves, handles)
        if key == "loss":
            ax.set_yscale(loss_scale(curves, log_y))
    if has_val:
        handles.append(
            Line2D(
                [],
                [],
                linestyle="none",
                marker="o",
                markersize=8,
                markerfacecolor="none",
                color="0.35",
                label=VAL_LABEL,
            )
        )
    figure.legend(
        handles=handles,
        loc="outside lower center",
        ncols=min(entries, LEGEND_COLUMNS),
        fontsize="small",
        frameon=False,
    )
    return figure


def _draw_panel(
    ax: Any, key: str, title: str, curves: Sequence[Curves], handles: list[Any]
) -> None:
    """One quantity's panel: each run's line in its own style, its validation points hollow."""
    for i, (curve, handle) in enumerate(zip(curves, handles, strict=True)):
        points = curve.points(key)
        if points:
            every = max(1, len(points) // MARKS_PER_LINE)
            ax.plot(
                *zip(*points, strict=True),
                color=handle.get_color(),
                linestyle=handle.get_linestyle(),
                linewidth=handle.get_linewidth(),
                marker=handle.get_marker(),
                markersize=5,
                markevery=(i * every // len(curves), every),  # the runs' marks interleave
                alpha=0.85,
                label=curve.label,
                zorder=2 + i,
            )
        val = curve.val_points(key)
        if val:
            ax.plot(
                *zip(*val, strict=True),
                linestyle="none",
                marker=handle.get_marker(),
                markersize=8,
                markerfacecolor="none",
                markeredgewidth=1.5,
                color=handle.get_color(),
                label=f"{curve.label} val",
                zorder=10 + i,
            )
    ax.set_title(title)
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(title)
    ax.grid(True, which="major", alpha=0.3)
    if key == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if not ax.lines:
        where = {"ha": "center", "va": "center", "transform": ax.transAxes, "color": "0.5"}
        ax.text(0.5, 0.5, f"no {title} logged", **where)


def _width(index: int) -> float:
    return max(1.2, 2.8 - 0.6 * index)


def plot_runs(
    runs: Sequence[str | Path],
    out: str | Path,
    *,
    force: bool = False,
    log_y: bool | None = None,
) -> Path:
    """Draw the runs' curves into one PNG, a panel per quantity, the runs in each, each named by
    its shortest distinct path suffix (:func:`run_names`) and how it ran.

    Args:
        log_y: a log (True) or linear (False) loss axis; None: log when the loss spans more
            than two decades.

    Returns:
        The image's path.

    Raises:
        UsageError: matplotlib is not installed, or no run is given.
        FormatError: a run folder does not exist or holds no logs.
        OutputError: ``out`` exists (without ``force``).
    """
    if not runs:
        raise UsageError("give at least one run folder")
    from ckptkit.storage.atomic import atomic_output, check_output

    if is_remote(str(out)):
        raise UsageError(f"plot writes a local image, not {out}", "give a local path to -o")
    out = Path(out)
    check_output(out, force=force)  # before any run is read
    curves = [read_curves(run, name) for run, name in zip(runs, run_names(runs), strict=True)]
    figure = build_figure(curves, log_y=log_y)
    with atomic_output(out, force=force) as tmp:
        with open(tmp, "wb") as f:
            figure.savefig(f, format="png")
    if not out.is_file():
        raise OutputError(f"{out} was not written")
    return out
