"""Readable log axes for the report's plots: several labelled ticks in plain numbers, whatever the range.

Matplotlib's default log axis labels only powers of ten, so data spanning less than a decade gets one label (or
none), and its default legend sits wherever it fits, often over the data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def _subs(span: float) -> tuple[float, ...]:
    """Tick multiples per decade: fewer as the range widens, so the labels never crowd."""
    if span >= 1e3:
        return (1.0,)
    if span >= 10:
        return (1.0, 2.0, 5.0)
    return tuple(float(m) for m in range(1, 10))


def readable_log_axis(ax: Any, which: str, values: Iterable[float], ticks_at_values: bool = False) -> bool:
    """Put the ``which`` ('x' or 'y') axis of ``ax`` on a log scale with plain-number tick labels.

    Returns False, leaving the axis linear, when the values are not all positive.

    ``ticks_at_values``: label exactly the given values (a sweep's grid) instead of 1-2-5 multiples.
    """
    # Function-level: matplotlib stays out of the start-up path of every module that imports core.
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    finite = [float(v) for v in values if math.isfinite(float(v))]
    if not finite or min(finite) <= 0:
        return False
    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    label = FuncFormatter(lambda value, _pos: f"{value:g}")
    if ticks_at_values:
        axis.set_major_locator(FixedLocator(sorted(set(finite))))
    else:
        axis.set_major_locator(LogLocator(base=10, subs=_subs(max(finite) / min(finite)), numticks=12))
    axis.set_major_formatter(label)
    axis.set_minor_formatter(NullFormatter())
    return True


def legend_outside(ax: Any) -> None:
    """The legend right of the axes, so it never covers a curve (save with bbox_inches='tight')."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize="small")
