"""The affine recurrence as an associative scan, within one sequence and over chunks (virtual ranks)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldpipe.parallel.scan import apply_prefixes, associative_scan, sequential_scan, simulate_chunked_scan

TOL = 1e-10  # float64; the scan reassociates products, so it is exact only up to rounding


def _inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(2, length, 3, generator=gen, dtype=torch.float64) * 1.5  # some |a| > 1: growth is covered
    b = torch.randn(2, length, 3, generator=gen, dtype=torch.float64)
    return a, b, torch.randn(2, 3, generator=gen, dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_parallel_scan_equals_the_sequential_loop_with_gradients(length, seed):
    a, b, h0 = _inputs(length, seed)
    weight = torch.randn(2, length, 3, dtype=torch.float64)
    leaves_ref = [t.clone().requires_grad_(True) for t in (a, b, h0)]
    ref = sequential_scan(*leaves_ref)
    (ref * weight).sum().backward()
    leaves = [t.clone().requires_grad_(True) for t in (a, b, h0)]
    out = apply_prefixes(*associative_scan(leaves[0], leaves[1]), leaves[2])
    (out * weight).sum().backward()
    assert torch.allclose(out, ref, atol=TOL, rtol=TOL)
    for got, want in zip(leaves, leaves_ref, strict=True):
        assert torch.allclose(got.grad, want.grad, atol=TOL, rtol=TOL)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       with_h0=st.booleans())
def test_chunked_scan_with_boundary_states_equals_the_loop(lengths, seed, with_h0):
    a, b, h0 = _inputs(sum(lengths), seed)
    h0 = h0 if with_h0 else None
    assert torch.allclose(simulate_chunked_scan(a, b, h0, lengths), sequential_scan(a, b, h0), atol=TOL, rtol=TOL)


def test_composition_order_matters():
    # (a2*a1, a2*b1 + b2) is not symmetric: swapping the chunks' order must give a different result.
    a, b, h0 = _inputs(6, 1)
    swapped = torch.cat([b[:, 3:], b[:, :3]], dim=1)
    assert not torch.allclose(simulate_chunked_scan(a, swapped, h0, [3, 3]), sequential_scan(a, b, h0))
