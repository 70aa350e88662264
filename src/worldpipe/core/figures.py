"""Plots written like every other artefact: whole or not at all (the report never shows a half-drawn PNG)."""

from __future__ import annotations

import io
import os
from typing import Any

from worldpipe.core.atomic import write_atomic


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 100, **savefig_kwargs: Any) -> None:
    """Render a matplotlib figure to PNG in memory, publish it at `path` atomically, and close the figure."""
    import matplotlib.pyplot as plt  # matplotlib: loaded by whoever drew the figure, not by importing core

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi, **savefig_kwargs)
    finally:
        plt.close(fig)
    write_atomic(path, buffer.getvalue())
