"""Ring attention's schedule and block arithmetic, simulated for N virtual ranks in one process.

Exactness is checked in float64 against PyTorch's dense causal attention (forward) and its autograd
(backward): the tolerance 1e-10 is many orders above float64 rounding and far below any real error.
"""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from worldpipe.parallel.ring_attention import simulate_ring_attention

TOL = 1e-10


def _dense(q, k, v, d_out):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    (out * d_out).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(1, 5), chunk=st.integers(1, 6), block=st.one_of(st.none(), st.integers(1, 6)),
       heads=st.integers(1, 3), dim=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_ring_equals_dense_causal_attention_forward_and_backward(ranks, chunk, block, heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(2, heads, ranks * chunk, dim, generator=gen, dtype=torch.float64) for _ in range(4))
    ref_out, ref_grads = _dense(q, k, v, d_out)
    out, grads, _ = simulate_ring_attention(q, k, v, ranks, block, d_out=d_out)
    assert torch.allclose(out, ref_out, atol=TOL, rtol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, atol=TOL, rtol=0)


@given(ranks=st.integers(1, 6), chunk=st.integers(1, 4))
@settings(max_examples=20, deadline=None)
def test_fully_masked_blocks_are_skipped_and_counted(ranks, chunk):
    # Whole-chunk blocks: rank r needs the blocks of ranks 0..r and skips the N-1-r later ones.
    q = torch.randn(1, 1, ranks * chunk, 2, dtype=torch.float64)
    _, _, stats = simulate_ring_attention(q, q, q, ranks, block_size=None)
    assert [s.blocks_skipped for s in stats] == [ranks - 1 - r for r in range(ranks)]
    assert [s.blocks_computed for s in stats] == [r + 1 for r in range(ranks)]
    assert sum(s.blocks_skipped for s in stats) == ranks * (ranks - 1) // 2


def test_a_wrong_mask_would_be_caught():
    # The check has teeth: non-causal attention differs from the ring's result.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    out, _, _ = simulate_ring_attention(q, k, v, 4)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-3)
