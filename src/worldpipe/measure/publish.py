"""How every benchmark publishes what it measured: its plot, then its JSON (the Snakemake output) last."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worldpipe.core.atomic import write_text_atomic


def publish_result(result: dict[str, Any], out: str | Path, plot: Callable[[dict, Path], None]) -> Path:
    """Draw `result` to OUT.png and write it to OUT (JSON), each atomically; the JSON names its plot.

    The JSON goes last: a pipeline that sees it finds the plot beside it.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    result["plot"] = str(png)
    plot(result, png)
    write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} and {png}")
    return png
