"""The transformer and linear-SSM world models: the rollout state reproduces the training forward pass."""

import pytest
import torch

from worldpipe.models import build_model, state_nbytes

CONFIGS = {
    "transformer": {"_target_": "worldpipe.models.transformer.CausalTransformer", "width": 16, "heads": 2,
                    "layers": 2},
    "ssm": {"_target_": "worldpipe.models.ssm.LinearSSM", "width": 16, "state": 8, "layers": 2},
}


def _batch(steps: int = 7):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, steps, 3, generator=gen), torch.randn(3, steps, 1, generator=gen)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_imagined_step_equals_the_teacher_forced_forward(name):
    # The head output at token t of the full causal pass must equal an imagined step from the state that
    # observed 0..t (KV cache or recurrent state): the rollout path is the training path, cached.
    torch.manual_seed(0)
    model = build_model(CONFIGS[name], 3, 1).double().eval()
    obs, action = (x.double() for x in _batch())
    with torch.no_grad():
        output, _ = model._run(model.embed(obs, action))
        for t in range(obs.shape[1]):
            state = model.observe_context(obs[:, :t + 1], action[:, :t + 1])
            predicted, reward, _ = model.imagine_step(state, action[:, t])
            assert torch.allclose(predicted, obs[:, t] + output[:, t, :-1], atol=1e-10)
            assert torch.allclose(reward, output[:, t, -1], atol=1e-10)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollout_state_growth_matches_the_declaration(name):
    torch.manual_seed(0)
    model = build_model(CONFIGS[name], 3, 1)
    obs, action = _batch()
    state = model.observe_context(obs[:, :3], action[:, :3])
    sizes = [state_nbytes(state)]
    for t in range(3, 6):
        _, _, state = model.imagine_step(state, action[:, t])
        sizes.append(state_nbytes(state))
    grows = all(b > a for a, b in zip(sizes, sizes[1:], strict=False))
    assert grows == model.state_grows
    assert grows or len(set(sizes)) == 1


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_is_a_sum_over_valid_steps(name):
    # Doubling the batch with a copy doubles every term; masking a window out removes it exactly.
    torch.manual_seed(0)
    model = build_model(CONFIGS[name], 3, 1).double()
    obs, action = (x.double() for x in _batch())
    reward, mask = torch.randn(3, obs.shape[1], dtype=torch.float64), torch.ones(3, obs.shape[1], dtype=torch.float64)
    one = model(obs, action, reward, mask, None)
    two = model(torch.cat([obs, obs]), torch.cat([action, action]), torch.cat([reward, reward]),
                torch.cat([mask, mask]), None)
    for term in model.loss_terms:
        assert torch.allclose(two[term], 2 * one[term])
    mask[1] = 0
    masked = model(obs, action, reward, mask, None)
    alone = model(obs[[0, 2]], action[[0, 2]], reward[[0, 2]], mask[[0, 2]], None)
    assert torch.allclose(masked["total"], alone["total"])
