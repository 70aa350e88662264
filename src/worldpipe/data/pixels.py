"""Deterministic image downscaling for rendered frames."""

from __future__ import annotations

import numpy as np


def downscale(frame: np.ndarray, size: int) -> np.ndarray:
    """Area-average an ``[H, W, 3]`` uint8 frame to ``[size, size, 3]`` uint8.

    Pure integer arithmetic (sum, then round-half-up division) so the result is bit-identical on every
    machine, unlike interpolating resizers whose output depends on the library build.
    """
    if frame.ndim != 3 or frame.dtype != np.uint8:
        raise ValueError(f"expected a uint8 [H, W, C] frame, got {frame.dtype} {frame.shape}")
    height, width = frame.shape[:2]
    if height < size or width < size:
        raise ValueError(f"frame {height}x{width} is smaller than the target size {size}")
    row_edges = (np.arange(size) * height) // size
    col_edges = (np.arange(size) * width) // size
    sums = np.add.reduceat(frame.astype(np.uint32), row_edges, axis=0)
    sums = np.add.reduceat(sums, col_edges, axis=1)
    rows = np.diff(np.append(row_edges, height))
    cols = np.diff(np.append(col_edges, width))
    counts = (rows[:, None] * cols[None, :])[:, :, None].astype(np.uint32)
    return ((sums + counts // 2) // counts).astype(np.uint8)
