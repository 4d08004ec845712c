"""`ckptkit plot` (issue 20): each run named by its shortest distinct path suffix and how it
ran, its own line style so that overlapping runs both show, a log loss axis when the loss spans
decades, labelled axes, the legend outside the data, and a missing folder named as missing.
The figure is read back from ``build_figure``, not from the PNG's pixels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptkit.cli import cli
from ckptkit.engine import TrainConfig, train
from ckptkit.errors import FormatError
from ckptkit.plot import (
    VAL_LABEL,
    X_LABEL,
    Curves,
    build_figure,
    loss_scale,
    plot_runs,
    read_curves,
    run_names,
)

pytest.importorskip("matplotlib")


def _train(out: Path, **options) -> Path:
    train(TrainConfig(out=str(out), epochs=1, quiet=True, timeout_s=30.0, **options))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny single-process runs whose folders share their name: a/run and b/run."""
    root = tmp_path_factory.mktemp("runs")
    return _train(root / "a" / "run", val_fraction=0.2), _train(root / "b" / "run")


def _curves(runs) -> list[Curves]:
    return [read_curves(run, name) for run, name in zip(runs, run_names(runs), strict=True)]


def _legend_texts(figure) -> list[str]:
    (legend,) = figure.legends
    return [text.get_text() for text in legend.get_texts()]


def _train_lines(ax) -> list:
    """The per-step lines of a panel (validation points have no line between them)."""
    return [line for line in ax.get_lines() if line.get_linestyle() != "None"]


# --- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("paths", "names"),
    [
        (["a/run", "b/run"], ["a/run", "b/run"]),
        (["runs/x", "runs/y"], ["x", "y"]),
        (["exp/run", "exp/sweep/run"], ["exp/run", "sweep/run"]),  # one name, two depths
        (["x/a/run", "y/a/run", "b/run"], ["x/a/run", "y/a/run", "b/run"]),
        (["p/q/r", "s/q/r", "p/t/r"], ["p/q/r", "s/q/r", "t/r"]),
        (["some/deep/run"], ["run"]),
        (["runs/x/", "./runs/y"], ["x", "y"]),  # spelled loosely
        (["runs/x", "runs/x"], ["x", "x #2"]),  # the same folder twice
    ],
)
def test_runs_are_named_by_their_shortest_distinct_suffix(paths, names, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_names(paths) == names


def test_a_relative_and_a_deeper_run_of_one_name_are_told_apart(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert run_names(["run", "a/run"]) == ["work/run", "a/run"]
    assert run_names(["."]) == ["work"]


def test_the_label_says_how_the_run_ran():
    assert Curves("a/run", mode="ddp", world_size=2).label == "a/run (ddp x2)"
    assert Curves("a/run", world_size=4).label == "a/run (x4)"
    assert Curves("a/run").label == "a/run"


# --- the figure ----------------------------------------------------------------------------------


def test_two_runs_of_one_name_get_distinct_labels_and_styles(runs):
    curves = _curves(runs)
    assert [(c.mode, c.world_size) for c in curves] == [("single", 1), ("single", 1)]
    figure = build_figure(curves)
    assert _legend_texts(figure) == ["a/run (single x1)", "b/run (single x1)", VAL_LABEL]
    loss, accuracy, lr = figure.axes
    for ax in (loss, accuracy, lr):
        lines = _train_lines(ax)
        assert [line.get_label() for line in lines] == ["a/run (single x1)", "b/run (single x1)"]
        # The same config trained twice lies on one curve: each must still show.
        assert len({line.get_linestyle() for line in lines}) == 2
        assert len({line.get_marker() for line in lines}) == 2
        assert len({line.get_color() for line in lines}) == 2
        assert lines[0].get_linewidth() > lines[1].get_linewidth()  # the first one underneath
    # a/run validated at its epoch's end: hollow points in its color, none for b/run.
    val = [line for line in loss.get_lines() if line.get_linestyle() == "None"]
    assert [line.get_label() for line in val] == ["a/run (single x1) val"]
    assert val[0].get_markerfacecolor() == "none"


def test_every_panel_has_its_axis_labels(runs):
    figure = build_figure(_curves(runs))
    assert [ax.get_xlabel() for ax in figure.axes] == [X_LABEL] * 3
    assert [ax.get_ylabel() for ax in figure.axes] == ["loss", "accuracy", "learning rate"]
    assert [ax.get_title() for ax in figure.axes] == ["loss", "accuracy", "learning rate"]


def test_the_legend_is_outside_the_data(runs):
    figure = build_figure(_curves(runs))
    figure.canvas.draw()  # lays it out
    (legend,) = figure.legends
    box = legend.get_window_extent()
    for ax in figure.axes:
        data = ax.get_window_extent()
        assert not box.overlaps(data)
        assert box.y1 <= data.y0  # below the panels
    assert figure.bbox.contains(box.x0, box.y0) and figure.bbox.contains(box.x1, box.y1)
    assert [ax.get_legend() for ax in figure.axes] == [None] * 3  # no legend over a panel


def _loss_run(*losses: float) -> Curves:
    return Curves("x", [{"step": 10 * (i + 1), "loss": v} for i, v in enumerate(losses)])


def test_a_loss_spanning_decades_gets_a_log_axis():
    assert loss_scale([_loss_run(2.0, 0.5, 0.01)]) == "log"  # 200x: over two decades
    assert loss_scale([_loss_run(2.0, 0.5, 0.03)]) == "linear"  # 67x
    assert loss_scale([_loss_run(2.0), _loss_run(0.001)]) == "log"  # over the runs together
    assert loss_scale([_loss_run(2.0, 0.0, 0.001)]) == "linear"  # a zero has no log
    assert loss_scale([_loss_run(2.0, 0.5, 0.01)], log_y=False) == "linear"
    assert loss_scale([_loss_run(2.0, 1.9)], log_y=True) == "log"
    assert loss_scale([_loss_run(0.0)], log_y=True) == "linear"  # nothing a log axis could show
    # Validation losses count too.
    val = Curves("v", *[[{"step": 10, "loss": 1.0}], [{"step": 10, "val_loss": 1e-4}]])
    assert loss_scale([val]) == "log"
    # Only the loss panel changes scale.
    for log_y, scale in ((None, "log"), (True, "log"), (False, "linear")):
        figure = build_figure([_loss_run(2.0, 0.5, 0.001)], log_y=log_y)
        assert [ax.get_yscale() for ax in figure.axes] == [scale, "linear", "linear"]
    figure = build_figure([_loss_run(2.0, 1.0, 0.5)])
    assert figure.axes[0].get_yscale() == "linear"


def test_real_runs_get_the_log_axis_their_loss_calls_for(runs):
    curves = _curves(runs)
    losses = [v for c in curves for _, v in c.points("loss") + c.val_points("loss")]
    expected = "log" if max(losses) / min(losses) > 100 else "linear"
    assert build_figure(curves).axes[0].get_yscale() == expected
    assert build_figure(curves, log_y=True).axes[0].get_yscale() == "log"
    assert build_figure(curves, log_y=False).axes[0].get_yscale() == "linear"


def test_a_run_with_metrics_alone_draws_its_epochs(tmp_path):
    """No steps.jsonl and no checkpoint (an old run): the epochs' points, and the world size
    metrics.jsonl records."""
    folder = tmp_path / "old"
    folder.mkdir()
    lines = [
        {"epoch": e, "step": 25 * e, "loss": 1.0 / e, "lr": 0.1, "world_size": 2} for e in (1, 2)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    curves = read_curves(folder, "old")
    assert (curves.mode, curves.world_size, curves.label) == (None, 2, "old (x2)")
    figure = build_figure([curves])
    loss, accuracy, _ = figure.axes
    assert [list(line.get_xdata()) for line in _train_lines(loss)] == [[25.0, 50.0]]
    assert not accuracy.get_lines() and accuracy.texts[0].get_text() == "no accuracy logged"
    assert _legend_texts(figure) == ["old (x2)"]  # no validation entry without validation


def test_plot_runs_writes_a_png_of_the_figure(runs, tmp_path):
    out = plot_runs(list(runs), tmp_path / "c.png", log_y=True)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (1200, 400)
    assert [p.name for p in tmp_path.iterdir()] == ["c.png"]  # no temp file left


@pytest.mark.slow
def test_a_single_and_a_ddp_run_are_labelled_with_their_mode(runs, tmp_path):
    ddp = _train(tmp_path / "b" / "run", mode="ddp", nproc_per_node=2)
    figure = build_figure(_curves([runs[0], ddp]))
    assert _legend_texts(figure)[:2] == ["a/run (single x1)", "b/run (ddp x2)"]


# --- the command ---------------------------------------------------------------------------------


def _invoke(*args, cwd: Path, monkeypatch):
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("CKPTKIT_DEBUG", raising=False)
    return CliRunner().invoke(cli, ["plot", *map(str, args)], prog_name="ckptkit")


def test_a_missing_folder_is_named_as_missing(runs, tmp_path, monkeypatch):
    result = _invoke(runs[0], "nope", "-o", "c.png", cwd=tmp_path, monkeypatch=monkeypatch)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: nope does not exist; give the run folder that `ckptkit train --out` wrote"
    ]
    assert "steps.jsonl" not in result.stderr
    assert not (tmp_path / "c.png").exists()
    with pytest.raises(FormatError, match="nope does not exist"):
        read_curves(tmp_path / "nope")


def test_a_file_is_no_run_folder(runs, tmp_path, monkeypatch):
    result = _invoke(runs[0] / "steps.jsonl", "-o", "c.png", cwd=tmp_path, monkeypatch=monkeypatch)
    assert result.exit_code == 1
    assert "steps.jsonl is a file, not a run folder" in result.stderr
    assert f"give the run folder that holds it ({runs[0]})" in result.stderr


def test_the_command_plots_and_keeps_its_json(runs, tmp_path, monkeypatch):
    result = _invoke(*runs, "-o", "c.png", "--json", cwd=tmp_path, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc == {"schema": 1, "image": "c.png", "runs": [str(r) for r in runs]}
    assert (tmp_path / "c.png").stat().st_size > 10_000
    again = _invoke(*runs, "-o", "c.png", cwd=tmp_path, monkeypatch=monkeypatch)
    assert again.exit_code == 1 and "c.png exists" in again.stderr


def test_the_command_passes_log_y_on(runs, tmp_path, monkeypatch):
    import ckptkit.plot as plot_module

    scales = []
    real = plot_module.build_figure

    def recording(curves, *, log_y=None):
        figure = real(curves, log_y=log_y)
        scales.append(figure.axes[0].get_yscale())
        return figure

    monkeypatch.setattr(plot_module, "build_figure", recording)
    for flag, scale in (("--log-y", "log"), ("--no-log-y", "linear")):
        result = _invoke(*runs, "-o", f"{scale}.png", flag, cwd=tmp_path, monkeypatch=monkeypatch)
        assert result.exit_code == 0, result.output
        assert scales[-1] == scale
