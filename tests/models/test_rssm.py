"""The RSSM: shapes, masking, determinism, and that it can learn."""

import copy
import functools

import pytest
import torch

from worldpipe.models.rssm import RSSM, RSSMConfig

CFG = RSSMConfig(embed=8, deter=8, stoch=4, hidden=16)


def _batch(b=3, t=6, o=3, a=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, o, generator=g), torch.randn(b, t, a, generator=g), torch.randn(b, t, generator=g),
            torch.ones(b, t), torch.randn(b, t, CFG.stoch, generator=g))


def test_observe_shapes():
    model = RSSM.from_config(3, 1, CFG)
    obs, action, _, _, noise = _batch()
    states = model.observe(obs, action, noise)
    assert states["h"].shape == (3, 6, CFG.deter)
    assert states["z"].shape == (3, 6, CFG.stoch)
    assert (states["prior_std"] >= CFG.min_std).all()


def test_masked_steps_do_not_contribute():
    torch.manual_seed(0)
    model = RSSM.from_config(3, 1, CFG)
    obs, action, reward, mask, noise = _batch()
    mask[:, 4:] = 0
    base = model(obs, action, reward, mask, noise)
    obs2 = obs.clone()
    obs2[:, 4:] += 100.0  # garbage beyond the valid length (future steps cannot affect the past: causal)
    changed = model(obs2, action, reward, mask, noise)
    for key in base:
        torch.testing.assert_close(base[key], changed[key])


def test_loss_is_a_sum_over_valid_steps():
    torch.manual_seed(0)
    model = RSSM.from_config(3, 1, CFG)
    obs, action, reward, mask, noise = _batch(b=4)
    whole = model(obs, action, reward, mask, noise)
    halves = [model(obs[s], action[s], reward[s], mask[s], noise[s]) for s in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(whole["total"], halves[0]["total"] + halves[1]["total"])


def test_same_seed_same_output_and_noise_matters():
    obs, action, reward, mask, noise = _batch()
    torch.manual_seed(1)
    a = RSSM.from_config(3, 1, CFG)(obs, action, reward, mask, noise)["total"]
    torch.manual_seed(1)
    model = RSSM.from_config(3, 1, CFG)
    b = model(obs, action, reward, mask, noise)["total"]
    assert torch.equal(a, b)
    assert not torch.equal(b, model(obs, action, reward, mask, noise + 1)["total"])


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_learns_a_linear_system_better_than_repeating():
    torch.manual_seed(0)
    steps, batch = 12, 32
    action = torch.randn(batch, steps, 1) * 0.5
    obs = torch.zeros(batch, steps, 2)
    obs[:, 0] = torch.randn(batch, 2)
    for t in range(1, steps):
        obs[:, t, 0] = obs[:, t - 1, 0] + 0.3 * obs[:, t - 1, 1]
        obs[:, t, 1] = 0.9 * obs[:, t - 1, 1] + action[:, t - 1, 0]
    model = RSSM.from_config(2, 1, RSSMConfig(embed=16, deter=32, stoch=4, hidden=64, free_nats=0.0))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    mask = torch.ones(batch, steps)
    for _ in range(300):
        loss = model(obs, action, torch.zeros(batch, steps), mask, torch.randn(batch, steps, 4))["total"]
        optimizer.zero_grad()
        (loss / mask.sum()).backward()
        optimizer.step()
    predicted = model.predict_open_loop(obs, action, context=6)
    model_err = (predicted[:, 0] - obs[:, 6]).pow(2).mean()
    baseline_err = (obs[:, 5] - obs[:, 6]).pow(2).mean()
    assert model_err < 0.5 * baseline_err


def _filter_by_modules(model, embed, action, noise):
    """The filter as the RSSM's modules define it, one module call per step, recorded by autograd op by op: the
    oracle the fused core (its forward and its hand-written backward through time) is held to."""
    h, z = model.initial_state(embed)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("h", "z", "post_mean", "post_std")}
    for t in range(embed.shape[1]):
        if t > 0:
            h = model.transition(h, z, action[:, t - 1])
        mean, std = model._gaussian(model.posterior_head(torch.cat([h, embed[:, t]], dim=-1)))
        z = mean + std * noise[:, t]
        for key, value in zip(out, (h, z, mean, std), strict=True):
            out[key].append(value)
    return {key: torch.stack(values, dim=1) for key, values in out.items()}


def _loss_and_grads(model, batch, by_modules: bool):
    """Loss terms and parameter gradients, the core run by the fused function or by the modules (the oracle)."""
    if by_modules:
        model._filter = functools.partial(_filter_by_modules, model)
    try:
        model.zero_grad(set_to_none=True)
        sums = model(*batch)
        (sums["total"] + 0.3 * sums["kl"]).backward()
    finally:
        model.__dict__.pop("_filter", None)
    return ({k: v.detach() for k, v in sums.items()},
            {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()})


def test_fused_core_matches_the_layer_by_layer_recurrence_and_its_gradients():
    # float64, so any difference beyond rounding is a wrong term in the hand-written backward through time;
    # T=1 (no transition), T=2 and a longer window with a masked tail.
    for steps in (1, 2, 7):
        torch.manual_seed(steps)
        model = RSSM.from_config(3, 2, RSSMConfig(embed=8, deter=6, stoch=4, hidden=10, free_nats=0.1)).double()
        g = torch.Generator().manual_seed(steps)
        obs, action, reward = (torch.randn(4, steps, d, generator=g, dtype=torch.float64) for d in (3, 2, 1))
        mask = torch.ones(4, steps, dtype=torch.float64)
        mask[0, steps // 2:] = 0
        batch = (obs, action, reward.squeeze(-1), mask, torch.randn(4, steps, 4, generator=g, dtype=torch.float64))
        fused, fused_grads = _loss_and_grads(model, batch, by_modules=False)
        reference, reference_grads = _loss_and_grads(model, batch, by_modules=True)
        for key in reference:
            torch.testing.assert_close(fused[key], reference[key], rtol=1e-10, atol=1e-12)
        for name in reference_grads:
            torch.testing.assert_close(fused_grads[name], reference_grads[name], rtol=1e-9, atol=1e-12, msg=name)
        assert any(g.abs().sum() > 0 for g in fused_grads.values())


def test_fused_core_is_bit_identical_to_itself():
    torch.manual_seed(0)
    model = RSSM.from_config(3, 1, CFG)
    batch = _batch(b=5, t=9)
    first = _loss_and_grads(model, batch, by_modules=False)
    second = _loss_and_grads(model, batch, by_modules=False)
    for a, b in zip(first, second, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


# (batch, hidden, deter, stoch): odd widths, whose element-wise work falls in scalar tails; the default model's,
# whose runs are whole vectors (softplus on 16 float32 values per row is scalar, on 16 float64 vector); and sizes
# of 1, whose products the compiled core leaves to ATen's matmuls (BLAS leading dimensions differ there).
CORE_SIZES = ((5, 12, 6, 4), (16, 128, 64, 16), (1, 8, 5, 1))


def _core_inputs(steps: int, dtype: torch.dtype, seed: int = 0, sizes: tuple[int, int, int, int] = CORE_SIZES[0]):
    """Random inputs of the filter core (act part, embed part, noise, weights) with gradients recorded."""
    from worldpipe.models.rssm_filter import CoreWeights

    g = torch.Generator().manual_seed(seed)
    batch, hidden, deter, stoch = sizes

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    weights = CoreWeights(rand(hidden, stoch), rand(3 * deter, hidden), rand(3 * deter), rand(3 * deter, deter),
                          rand(3 * deter), rand(hidden, deter), rand(hidden, hidden), rand(hidden),
                          rand(2 * stoch, hidden), rand(2 * stoch))
    return rand(steps - 1, batch, hidden), rand(steps, batch, hidden), torch.randn(steps, batch, stoch, generator=g,
                                                                                      dtype=dtype), weights


@pytest.mark.parametrize("sizes", CORE_SIZES, ids=("odd", "default", "ones"))
def test_compiled_core_is_built_and_gives_the_python_references_bits(sizes):
    # The compiled loops compute what the Python reference's operators compute: the same outputs and gradients
    # to the bit, in float32 and float64, with no transition (T=1), one, and many. make test builds the
    # extension; a machine where it did not build fails here rather than silently running the slow loops.
    from worldpipe.models.rssm_filter import filter_core, native_filter_core

    assert native_filter_core() is not None
    for dtype in (torch.float32, torch.float64):
        for steps in (1, 2, 9):
            results = []
            for compiled in (True, False):
                act, embed, noise, weights = _core_inputs(steps, dtype, sizes=sizes)
                outs = filter_core(act, embed, noise, weights, 0.1, compiled=compiled)
                g = torch.Generator().manual_seed(1)
                loss = sum((o * torch.randn(o.shape, generator=g, dtype=dtype)).sum() for o in outs)
                inputs = (act, embed, *weights.tensors())
                grads = torch.autograd.grad(loss, inputs, allow_unused=True)
                results.append((outs, grads))
            (outs_c, grads_c), (outs_p, grads_p) = results
            assert all(torch.equal(a, b) for a, b in zip(outs_c, outs_p, strict=True)), (dtype, steps)
            for i, (a, b) in enumerate(zip(grads_c, grads_p, strict=True)):
                assert torch.equal(a, b), (dtype, steps, i)
            assert any(g.abs().sum() > 0 for g in grads_c)


_LOSS_SCRIPT = """
import torch
from worldpipe.models.rssm import RSSM, RSSMConfig
torch.manual_seed(0)
model = RSSM.from_config(3, 1, RSSMConfig(embed=8, deter=8, stoch=4, hidden=16))
g = torch.Generator().manual_seed(0)
sums = model(torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 1, generator=g), torch.randn(2, 5, generator=g),
             torch.ones(2, 5), torch.randn(2, 5, 4, generator=g))
sums["total"].backward()
print(sums["total"].item().hex(), model.cell.weight_hh.grad.sum().item().hex())
"""


def test_without_a_compiler_one_warning_line_and_the_same_bits(tmp_path):
    # A machine that cannot build the extension runs the Python reference: one line says so, nothing
    # half-built is left where a later process would import it, and the loss and gradients are the same bits.
    import os
    import subprocess
    import sys

    from worldpipe.models.native import EXTENSIONS_DIR_ENV

    def run(**env):
        return subprocess.run([sys.executable, "-c", _LOSS_SCRIPT], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env})

    built = run()
    without = run(**{EXTENSIONS_DIR_ENV: str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")})
    assert built.returncode == 0 and without.returncode == 0, without.stderr
    assert built.stderr == "" and without.stdout == built.stdout
    warning = without.stderr.strip().splitlines()
    assert len(warning) == 1 and "compiled filter_core is unavailable" in warning[0], without.stderr
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_under_fsdp2_the_fused_filter_runs_on_whole_weights_to_the_same_bits(one_rank_group):
    # The filter's layers stay in the root's unit (RSSM.whole_in_forward), so FSDP2 trains the one fused path:
    # on one rank, the same loss and gradients as the plain model, bit for bit.
    from worldpipe.parallel.fsdp_units import fully_shard_units

    torch.manual_seed(0)
    plain = RSSM.from_config(3, 1, CFG)
    sharded = fully_shard_units(copy.deepcopy(plain), None)
    batch = _batch(b=4, t=7)
    losses = []
    for model in (plain, sharded):
        sums = model(*batch)
        (sums["total"] + 0.3 * sums["kl"]).backward()
        losses.append(sums["total"].detach())
    assert torch.equal(*losses)
    for (name, a), b in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad.full_tensor()), name
