"""The report's plots are readable: log axes label several plain-number ticks; legends sit beside the data."""

from types import SimpleNamespace

import matplotlib
import pytest

from worldpipe.evaluate.open_loop import plot_loss_curve
from worldpipe.tracking.comparison import Comparison, plot_comparison

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen


@pytest.fixture
def last_figure(monkeypatch):
    """The figure a plot function draws (kept open: closing it is a no-op here)."""
    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    return kept


def _labels(axis) -> list[str]:
    lo, hi = sorted(axis.get_view_interval())
    return [t.get_text() for t, v in zip(axis.get_ticklabels(), axis.get_ticklocs(), strict=True)
            if t.get_text() and lo <= v <= hi]


def test_loss_curve_log_axis_labels_several_ticks_and_legend_beside_the_data(tmp_path, last_figure):
    history = {"loss/total": [(s, 3.0 - 0.05 * s) for s in range(0, 41, 5)],
               "loss/kl": [(s, 0.6 + 0.01 * s) for s in range(0, 41, 5)]}
    plot_loss_curve(history, tmp_path / "loss.png")
    fig = last_figure[-1]
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = _labels(ax.yaxis)
    assert len(labels) >= 3, labels
    assert all(any(c.isdigit() for c in label) and "$" not in label for label in labels), labels
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1, "the legend overlaps the axes"


def test_sweep_plot_puts_the_learning_rate_on_a_labelled_log_axis(tmp_path, last_figure):
    runs = [SimpleNamespace(data=SimpleNamespace(params={"trainer.lr": lr, "model.stoch": stoch},
                                                 metrics={"eval/one_step_ratio": 0.5 + float(lr) * 10 + int(stoch) / 100}))
            for lr in ("0.001", "0.003") for stoch in ("4", "8")]
    plot_comparison(Comparison(runs=runs, swept=["trainer.lr", "model.stoch"]), tmp_path / "sweep.png",
                    metric="eval/one_step_ratio")
    fig = last_figure[-1]
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    assert _labels(ax.xaxis) == ["0.001", "0.003"]
