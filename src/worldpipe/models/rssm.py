"""A Dreamer-style recurrent state-space model (RSSM) small enough for two CPU cores.

State at time t is (h_t, z_t): h_t is the deterministic GRU state, z_t a Gaussian stochastic latent drawn by
reparameterization. Shapes use B = windows in the batch, T = window length, O/A = observation/action size,
D = deterministic size, S = stochastic size.

    h_0 = 0                                   h_t = GRU(h_{t-1}, [z_{t-1}, a_{t-1}])   (t >= 1)
    prior     p(z_t | h_t)                    posterior q(z_t | h_t, enc(o_t))
    decoder   o_t ~ N(dec(h_t, z_t), 1)        reward    r_{t-1} ~ N(rew(h_t, z_t), 1)

The sampling noise is an input, not drawn inside the module: the trainer derives it from the global sample
index, so a resume on another world size draws exactly the same latents.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worldpipe.models.base import ParallelSupport, RolloutState, WorldModel
from worldpipe.models.rssm_filter import CoreWeights, filter_core


@dataclass(frozen=True)
class RSSMConfig:
    """Sizes and loss weights of the RSSM (mirrors `conf/model/rssm.yaml`)."""

    embed: int = 64
    deter: int = 64
    stoch: int = 16
    hidden: int = 128
    min_std: float = 0.1
    kl_scale: float = 1.0
    free_nats: float = 0.5
    reward_scale: float = 1.0
    kl_balance: float | None = None


def _mlp(inp: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inp, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(), nn.Linear(hidden, out))


class RSSM(WorldModel):
    """Recurrent state-space world model over vector observations.

    Batch-parallel only: the GRU transition is a nonlinear recurrence, so step t needs step t-1's state and
    the sequence has no valid cut in time (docs/architecture.md, "Which model supports which axis").
    """

    loss_terms = ("total", "recon", "reward", "kl")
    parallel = ParallelSupport(batch=True, tensor_parallel=False, time_partition=None)
    dimensions = ("embed", "deter", "stoch", "hidden")
    # The filter's loops through time run compiled where the extension is built (the same bits either way).
    compiled_core = True
    # The filter reads these layers' weights (split by input block) outside their forward: FSDP2 keeps them in
    # the root's unit, whole while forward runs.
    whole_in_forward = ("cell_input", "cell", "posterior_head")

    def __init__(self, obs_dim: int, act_dim: int, embed: int = 64, deter: int = 64, stoch: int = 16,
                 hidden: int = 128, min_std: float = 0.1, kl_scale: float = 1.0, free_nats: float = 0.5,
                 reward_scale: float = 1.0, kl_balance: float | None = None):
        super().__init__(obs_dim, act_dim)
        if kl_balance is not None and not 0.0 <= kl_balance <= 1.0:
            raise ValueError(f"kl_balance must be in [0, 1] or null, got {kl_balance}")
        cfg = RSSMConfig(embed, deter, stoch, hidden, min_std, kl_scale, free_nats, reward_scale, kl_balance)
        self.cfg = cfg
        self.encoder = _mlp(obs_dim, cfg.hidden, cfg.embed)
        self.cell_input = nn.Sequential(nn.Linear(cfg.stoch + act_dim, cfg.hidden), nn.ELU())
        self.cell = nn.GRUCell(cfg.hidden, cfg.deter)
        self.prior_head = _mlp(cfg.deter, cfg.hidden, 2 * cfg.stoch)
        self.posterior_head = _mlp(cfg.deter + cfg.embed, cfg.hidden, 2 * cfg.stoch)
        self.decoder = _mlp(cfg.deter + cfg.stoch, cfg.hidden, obs_dim)
        self.reward_head = _mlp(cfg.deter + cfg.stoch, cfg.hidden, 1)

    @classmethod
    def from_config(cls, obs_dim: int, act_dim: int, cfg: RSSMConfig) -> RSSM:
        """An RSSM of these sizes from an :class:`RSSMConfig`."""
        return cls(obs_dim, act_dim, **asdict(cfg))

    def noise_shape(self, steps: int) -> tuple[int, ...]:
        """One standard-normal draw per step for the posterior sample: [T, S]."""
        return (steps, self.cfg.stoch)

    def rollout_noise_shape(self) -> tuple[int, ...]:
        """One draw per imagined step for the prior sample: [S]."""
        return (self.cfg.stoch,)

    def _gaussian(self, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, raw_std = stats.chunk(2, dim=-1)
        return mean, F.softplus(raw_std) + self.cfg.min_std

    def initial_state(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero (h, z) ([B, D], [B, S]) with the batch size, dtype and device of `like` [B, ...].

        Built from the input, not from a parameter: under FSDP2 parameters are sharded DTensors.
        """
        batch = like.shape[0]
        return like.new_zeros(batch, self.cfg.deter), like.new_zeros(batch, self.cfg.stoch)

    def transition(self, h: torch.Tensor, z: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """h_{t+1} from (h_t [B,D], z_t [B,S], a_t [B,A])."""
        return self.cell(self.cell_input(torch.cat([z, action], dim=-1)), h)

    def observe(self, obs: torch.Tensor, action: torch.Tensor, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        """Filter a window with the posterior.

        obs [B,T,O], action [B,T,A], noise [B,T,S] standard normal. Returns h, z [B,T,D|S] and the prior and
        posterior Gaussians (mean, std) [B,T,S]. Only the recurrence (:meth:`_filter`) steps through time; the
        encoder before it and the prior head after it run once over all B*T steps.
        """
        embed = self.encoder(obs)  # [B,T,E]
        states = self._filter(embed, action, noise)
        states["prior_mean"], states["prior_std"] = self._gaussian(self.prior_head(states["h"]))
        return states

    def _filter(self, embed: torch.Tensor, action: torch.Tensor, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        """The sequential core: h_t = GRU(h_{t-1}, [z_{t-1}, a_{t-1}]), z_t ~ q(z_t | h_t, e_t); [B,T,...] each.

        One autograd function steps through time forward and backward (:mod:`worldpipe.models.rssm_filter`),
        on the layers' weights: under FSDP2 they are whole here (:attr:`whole_in_forward`). Under torch.compile it
        runs eagerly, a graph break: its loops are compiled C++ already, and T unrolled steps would only cost
        compile time. (Wrapped here, not where it is defined: ``torch.compiler.disable`` imports dynamo, seconds
        that a process which never compiles must not pay.)
        """
        if torch.compiler.is_compiling():
            return torch.compiler.disable(self._fused_filter)(embed, action, noise)
        return self._fused_filter(embed, action, noise)

    def _fused_filter(self, embed: torch.Tensor, action: torch.Tensor, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        stoch, deter = self.cfg.stoch, self.cfg.deter
        cell_in, post = self.cell_input[0], self.posterior_head
        # The first layers of the cell input ([z, a]) and of the posterior head ([h, e]) are split by input
        # block: the action and embedding blocks do not depend on the state, so they are applied to all steps
        # at once (time-major, so a step's slice is contiguous); the core adds the state's block per step.
        act_part = F.linear(action.transpose(0, 1)[:-1], cell_in.weight[:, stoch:], cell_in.bias)  # [T-1,B,H]
        embed_part = F.linear(embed.transpose(0, 1), post[0].weight[:, deter:], post[0].bias)  # [T,B,H]
        weights = CoreWeights(cell_in.weight[:, :stoch], self.cell.weight_ih, self.cell.bias_ih, self.cell.weight_hh,
                              self.cell.bias_hh, post[0].weight[:, :deter], post[2].weight, post[2].bias,
                              post[4].weight, post[4].bias)
        states = filter_core(act_part, embed_part, noise.transpose(0, 1).contiguous(), weights, self.cfg.min_std,
                             self.compiled_core)
        return {key: value.transpose(0, 1) for key, value in zip(("h", "z", "post_mean", "post_std"), states,
                                                                  strict=True)}

    def decode(self, h: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted observation [...,O] and reward [...] from the latent state."""
        feat = torch.cat([h, z], dim=-1)
        return self.decoder(feat), self.reward_head(feat).squeeze(-1)

    def forward(self, obs, action, reward, mask, noise) -> dict[str, torch.Tensor]:
        """Per-term loss *sums* over valid steps of this rank's windows (scalars).

        The trainer divides by the number of valid steps of the whole global batch, so ranks holding unequal
        slices still produce the global-mean gradient. obs [B,T,O], action [B,T,A], reward/mask [B,T].
        """
        states = self.observe(obs, action, noise)
        obs_pred, reward_pred = self.decode(states["h"], states["z"])
        recon = 0.5 * (obs_pred - obs).pow(2).sum(-1)  # [B,T]
        # reward r_{t-1} is the consequence of a_{t-1}, so it is predicted from the state at t.
        reward_err = 0.5 * (reward_pred[:, 1:] - reward[:, :-1]).pow(2)  # [B,T-1]
        kl = _gaussian_kl(states["post_mean"], states["post_std"], states["prior_mean"], states["prior_std"])  # [B,T]
        kl_loss = self._kl_loss(kl, states)
        sums = {
            "recon": (recon * mask).sum(),
            "reward": (reward_err * mask[:, 1:]).sum(),
            "kl": (kl * mask).sum(),
        }
        sums["total"] = (
            sums["recon"] + self.cfg.reward_scale * sums["reward"] + self.cfg.kl_scale * (kl_loss * mask).sum()
        )
        return sums

    def _kl_loss(self, kl: torch.Tensor, states: dict[str, torch.Tensor]) -> torch.Tensor:
        """The KL term optimised, per step [B,T], floored at ``free_nats``.

        ``kl_balance`` None: the plain KL, whose gradient moves prior and posterior alike. A number a (DreamerV2's
        KL balancing): a * KL(sg(q) || p) + (1 - a) * KL(q || sg(p)) — the same value, but the prior is pulled
        towards the posterior with weight a, so the prior (what imagination runs on) learns the dynamics instead
        of the posterior forgetting the observation.
        """
        balance = self.cfg.kl_balance
        if balance is None:
            return torch.clamp(kl, min=self.cfg.free_nats)
        post = (states["post_mean"], states["post_std"])
        prior = (states["prior_mean"], states["prior_std"])
        train_prior = _gaussian_kl(post[0].detach(), post[1].detach(), *prior)
        train_post = _gaussian_kl(*post, prior[0].detach(), prior[1].detach())
        return (balance * torch.clamp(train_prior, min=self.cfg.free_nats)
                + (1 - balance) * torch.clamp(train_post, min=self.cfg.free_nats))

    def observe_context(self, obs: torch.Tensor, action: torch.Tensor) -> RolloutState:
        """Filter the history with posterior means; the state (h, z) after its last observation."""
        noise = obs.new_zeros(obs.shape[0], obs.shape[1], self.cfg.stoch)  # posterior means
        states = self.observe(obs, action, noise)
        return {"h": states["h"][:, -1], "z": states["z"][:, -1]}

    def imagine_step(self, state: RolloutState, action: torch.Tensor,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, RolloutState]:
        """h' = GRU(h, [z, a]); z' from the prior (its mean, or mean + std * noise); decode (h', z')."""
        h = self.transition(state["h"], state["z"], action)
        mean, std = self._gaussian(self.prior_head(h))
        z = mean if noise is None else mean + std * noise
        obs_pred, reward_pred = self.decode(h, z)
        return obs_pred, reward_pred, {"h": h, "z": z}


def _gaussian_kl(mean_q, std_q, mean_p, std_p) -> torch.Tensor:
    """KL(q || p) of diagonal Gaussians, summed over the last dim."""
    var_ratio = (std_q / std_p).pow(2)
    mean_term = ((mean_q - mean_p) / std_p).pow(2)
    return 0.5 * (var_ratio + mean_term - 1.0 - var_ratio.log()).sum(-1)
