"""Matrix products whose every row is computed alone: a row's bits do not depend on the rows beside it.

A BLAS gemm picks its kernel by the shape of the whole product and computes rows in register blocks, so a row's
bits can depend on how many rows share the product and where in it the row sits (MKL on AVX-512 computes the odd
rows of an 8x32 @ 32x3 product differently from the even ones). Served rollouts batch unrelated requests, and a
request's result must not depend on its neighbours, so serving computes every 2-D product ``x @ w`` as a batch of
one-row products (``bmm`` of [M,1,K] by [M,K,N]), which this module's dispatch mode does for every ``mm`` and
``addmm`` the model issues, also those inside composite ops (``linear``, ``gru_cell``). Training never runs under
it: it changes the order of no sum inside a row, but a different kernel may round differently.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_active = threading.local()


def _rows_alone(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = a.shape[0]
    left, right = a.unsqueeze(1), b.unsqueeze(0).expand(rows, *b.shape)
    if bias is None:
        return torch.bmm(left, right).squeeze(1)
    return torch.baddbmm(bias.expand(rows, b.shape[1]).unsqueeze(1), left, right).squeeze(1)


class _RowIndependentMatmul(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default and not kwargs:
            return _rows_alone(args[0], args[1], None)
        if func is aten.addmm.default and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
            return _rows_alone(args[1], args[2], args[0])
        return func(*args, **kwargs)


@contextmanager
def row_independent_products():
    """Within this block (this thread), every matrix product computes each of its rows as a product of its own."""
    depth = getattr(_active, "depth", 0)
    _active.depth = depth + 1
    try:
        with _RowIndependentMatmul():
            yield
    finally:
        _active.depth = depth


def products_row_independent() -> bool:
    """True inside :func:`row_independent_products` (kernels that call BLAS themselves must step aside)."""
    return getattr(_active, "depth", 0) > 0
