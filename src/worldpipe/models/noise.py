"""Training noise keyed by *what* is sampled (seed, global sample index), never by *who* samples it.

Any world size, and any resume point, draws the same noise for the same window, while different windows draw
independent noise (docs/architecture.md, "The state contract").
"""

from __future__ import annotations

import numpy as np
import torch

_NOISE_DOMAIN = 0x6E6F697365  # "noise": separates this stream from other uses of the seed


def sample_noise(seed: int, sample_index: torch.Tensor, shape: tuple[int, ...] | None,
                 generator: torch.Generator) -> torch.Tensor | None:
    """Standard-normal noise [b, *shape], row i a function of (seed, sample_index[i]) only; None for no shape."""
    if shape is None:
        return None
    if len(sample_index) == 0:  # this rank's slice of a short last batch can be empty
        return torch.zeros(0, *shape)
    rows = []
    for index in sample_index.tolist():
        generator.manual_seed(int(np.random.SeedSequence([seed, _NOISE_DOMAIN, index]).generate_state(1, np.uint64)[0]))
        rows.append(torch.randn(*shape, generator=generator))
    return torch.stack(rows)
