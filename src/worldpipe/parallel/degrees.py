"""What a parallel config says about its model axes (tensor, context, pipeline degrees) with their defaults,
read in one place by the layout checks and the layout builder."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def model_degrees(p: Mapping[str, Any]) -> tuple[int, int]:
    """(tensor_parallel, context_parallel) of ``cfg.parallel`` (1 where unset)."""
    return int(p.get("tensor_parallel", 1)), int(p.get("context_parallel", 1))


def pipeline_degree(p: Mapping[str, Any]) -> int:
    """``parallel.pipeline_parallel``: the pipeline's stages (1 where unset: no pipeline)."""
    return int(p.get("pipeline_parallel", 1))
