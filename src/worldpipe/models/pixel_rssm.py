"""An RSSM that learns from rendered frames: a conv encoder and decoder around a discrete-latent recurrent core.

In the style of DreamerV3 where it matters on small frames: the stochastic state is ``stoch`` categoricals of
``classes`` classes each, sampled with straight-through gradients (a 1 % uniform mix keeps every class
reachable); the KL is balanced (dynamics and representation terms, each with free bits); the reward head
predicts symlog targets; every hidden layer is normalized (LayerNorm over features, or over the channels of each
pixel in the conv stacks). The reconstruction loss is summed over a frame's H*W*3 values, so it outweighs the
whole latent's KL. Shapes: B windows, T steps, H = W = ``image_size``, D = deter, Z = stoch * classes.

The model observes the stored ``pixels`` array, flattened to one vector of H*W*3 values per step, so every
caller that handles vector observations (open-loop evaluation, the rollout engine, the logged model) handles
frames too; its normalization is fixed (value - 127.5) / 127.5, not the dataset's state statistics.

Only the transition steps through time; the encoder, the prior head, the decoder and the reward head run once
over all B*T steps (as the state RSSM does, :mod:`worldpipe.models.rssm`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worldpipe.models.base import ParallelSupport, RolloutState, WorldModel

_PIXEL_CENTER = 127.5


def symlog(x: torch.Tensor) -> torch.Tensor:
    """sign(x) log(1 + |x|): compresses large targets, identity near 0."""
    return torch.sign(x) * torch.log1p(x.abs())


def symexp(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`symlog`."""
    return torch.sign(x) * torch.expm1(x.abs())


def gumbel_from_normal(noise: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) draws from standard-normal ones (normal CDF, then -log(-log u)).

    The trainer hands every model standard-normal noise keyed by sample index; transforming it keeps the
    categorical draws a function of (seed, sample) too. Zero noise maps to one constant, so argmax(logits + g)
    is the mode: the "mean" path of observe_context and imagine_step.
    """
    u = (0.5 * (1.0 + torch.erf(noise / math.sqrt(2.0)))).clamp(1e-6, 1.0 - 1e-6)
    return -torch.log(-torch.log(u))


class PixelRSSM(WorldModel):
    """Recurrent state-space model over 64x64 (``image_size``) RGB frames with categorical latents.

    Batch-parallel only: the GRU transition is a nonlinear recurrence (no valid cut in time).
    """

    loss_terms = ("total", "image", "reward", "kl_dyn", "kl_rep")
    parallel = ParallelSupport(batch=True, tensor_parallel=False, time_partition=None)
    dimensions = ("image_size", "depth", "embed", "deter", "stoch", "classes", "hidden")
    observation_key = "pixels"

    def __init__(self, obs_dim: int, act_dim: int, image_size: int = 64, depth: int = 16, embed: int = 128,
                 deter: int = 128, stoch: int = 8, classes: int = 8, hidden: int = 128, unimix: float = 0.01,
                 free_nats: float = 1.0, dyn_scale: float = 0.5, rep_scale: float = 0.1,
                 reward_scale: float = 1.0):
        if image_size % 16 or obs_dim != image_size * image_size * 3:
            raise ValueError(f"image_size {image_size} must be a multiple of 16 and match the observed frames "
                             f"(obs_dim {obs_dim} = image_size * image_size * 3)")
        super().__init__(obs_dim, act_dim)
        self.obs_mean.fill_(_PIXEL_CENTER)
        self.obs_std.fill_(_PIXEL_CENTER)
        self.image_size, self.deter, self.stoch, self.classes = image_size, deter, stoch, classes
        self.unimix, self.free_nats = unimix, free_nats
        self.dyn_scale, self.rep_scale, self.reward_scale = dyn_scale, rep_scale, reward_scale
        chans = (depth, 2 * depth, 4 * depth, 4 * depth)
        self._flat = chans[-1] * (image_size // 16) ** 2
        layers, inp = [], 3
        for out in chans:  # each halves the side: 64 -> 32 -> 16 -> 8 -> 4
            layers += [nn.Conv2d(inp, out, 4, 2, 1, bias=False), _ChannelNorm(out), nn.SiLU()]
            inp = out
        self.encoder = nn.Sequential(*layers, nn.Flatten(), _dense(self._flat, embed))
        latent = stoch * classes
        self.cell_input = _dense(latent + act_dim, hidden)
        self.cell = nn.GRUCell(hidden, deter)
        self.posterior_head = nn.Sequential(_dense(deter + embed, hidden), nn.Linear(hidden, latent))
        self.prior_head = nn.Sequential(_dense(deter, hidden), nn.Linear(hidden, latent))
        self.decoder_in = _dense(deter + latent, self._flat)
        ups = []
        for inp, out in zip(chans[:0:-1], chans[-2::-1], strict=True):  # 4 -> 8 -> 16 -> 32
            ups += [nn.ConvTranspose2d(inp, out, 4, 2, 1, bias=False), _ChannelNorm(out), nn.SiLU()]
        # The last layer (32 -> 64) is linear: normalized pixel values, any sign.
        self.decoder = nn.Sequential(*ups, nn.ConvTranspose2d(chans[0], 3, 4, 2, 1))
        self.reward_head = nn.Sequential(_dense(deter + latent, hidden), nn.Linear(hidden, 1))

    def set_normalization(self, obs_mean, obs_std) -> None:
        """Pixels keep their fixed normalization; the dataset's statistics describe its state vectors."""

    def noise_shape(self, steps: int) -> tuple[int, ...]:
        """One standard-normal draw per step and latent class (turned into Gumbel noise): [T, Z]."""
        return (steps, self.stoch * self.classes)

    def rollout_noise_shape(self) -> tuple[int, ...]:
        """One draw per imagined step and latent class: [Z]."""
        return (self.stoch * self.classes,)

    # ---- pieces ----
    def _frames(self, obs: torch.Tensor) -> torch.Tensor:
        """Normalized flat frames [..., H*W*3] (channel last, as stored) -> [N, 3, H, W]."""
        size = self.image_size
        return obs.reshape(-1, size, size, 3).permute(0, 3, 1, 2)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Class probabilities [..., stoch, classes] with the uniform mix."""
        probs = logits.reshape(*logits.shape[:-1], self.stoch, self.classes).softmax(-1)
        return (1.0 - self.unimix) * probs + self.unimix / self.classes

    def _sample(self, probs: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """One-hot draw (Gumbel-max; the mode without noise) with straight-through gradients: [..., Z]."""
        score = probs.log()
        if noise is not None:
            score = score + gumbel_from_normal(noise.reshape(probs.shape))
        one_hot = F.one_hot(score.argmax(-1), self.classes).to(probs.dtype)
        return (one_hot + probs - probs.detach()).flatten(-2)

    def transition(self, h: torch.Tensor, z: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """h_{t+1} from (h_t [B,D], z_t [B,Z], a_t [B,A])."""
        return self.cell(self.cell_input(torch.cat([z, action], dim=-1)), h)

    def decode(self, h: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized flat frames [..., H*W*3] and rewards [...] from latent states [..., D], [..., Z]."""
        frames, reward = self._heads(torch.cat([h, z], dim=-1))
        return frames, symexp(reward)

    def _heads(self, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder and reward head over all leading positions at once: frames [..., H*W*3], symlog reward [...]."""
        lead, side = feat.shape[:-1], self.image_size // 16
        x = self.decoder_in(feat.reshape(-1, feat.shape[-1])).reshape(-1, self._flat // side**2, side, side)
        frames = self.decoder(x).permute(0, 2, 3, 1).reshape(*lead, -1)
        return frames, self.reward_head(feat).squeeze(-1)

    def observe(self, obs: torch.Tensor, action: torch.Tensor, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        """Filter a window: h, z [B,T,D|Z] and posterior/prior probabilities [B,T,stoch,classes]."""
        batch, steps = obs.shape[:2]
        embed = self.encoder(self._frames(obs)).reshape(batch, steps, -1)  # all B*T frames at once
        h = obs.new_zeros(batch, self.deter)
        z = obs.new_zeros(batch, self.stoch * self.classes)
        hs, zs, posts = [], [], []
        for t in range(steps):  # the only sequential part
            if t > 0:
                h = self.transition(h, z, action[:, t - 1])
            post = self._probs(self.posterior_head(torch.cat([h, embed[:, t]], dim=-1)))
            z = self._sample(post, noise[:, t])
            hs.append(h)
            zs.append(z)
            posts.append(post)
        states = {"h": torch.stack(hs, 1), "z": torch.stack(zs, 1), "post": torch.stack(posts, 1)}
        states["prior"] = self._probs(self.prior_head(states["h"]))
        return states

    # ---- training ----
    def forward(self, obs, action, reward, mask, noise) -> dict[str, torch.Tensor]:
        """Per-term loss sums over valid steps: image MSE, symlog reward, balanced KL with free bits."""
        states = self.observe(obs, action, noise)
        frames, reward_pred = self._heads(torch.cat([states["h"], states["z"]], dim=-1))
        image = 0.5 * (frames - obs).pow(2).sum(-1)  # [B,T]
        # reward r_{t-1} is the consequence of a_{t-1}, so it is predicted from the state at t.
        reward_err = 0.5 * (reward_pred[:, 1:] - symlog(reward[:, :-1])).pow(2)  # [B,T-1]
        post, prior = states["post"], states["prior"]
        kl_dyn = _categorical_kl(post.detach(), prior)  # trains the prior towards the posterior
        kl_rep = _categorical_kl(post, prior.detach())  # keeps the posterior predictable
        sums = {
            "image": (image * mask).sum(),
            "reward": (reward_err * mask[:, 1:]).sum(),
            "kl_dyn": (kl_dyn * mask).sum(),
            "kl_rep": (kl_rep * mask).sum(),
        }
        kl_loss = (self.dyn_scale * kl_dyn.clamp(min=self.free_nats)
                   + self.rep_scale * kl_rep.clamp(min=self.free_nats))
        sums["total"] = sums["image"] + self.reward_scale * sums["reward"] + (kl_loss * mask).sum()
        return sums

    # ---- rollouts ----
    def observe_context(self, obs: torch.Tensor, action: torch.Tensor) -> RolloutState:
        """Filter the history with posterior modes; the state (h, z) after its last frame."""
        noise = obs.new_zeros(obs.shape[0], obs.shape[1], self.stoch * self.classes)
        states = self.observe(obs, action, noise)
        return {"h": states["h"][:, -1], "z": states["z"][:, -1]}

    def imagine_step(self, state: RolloutState, action: torch.Tensor,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, RolloutState]:
        """h' = GRU(h, [z, a]); z' from the prior (its mode, or a Gumbel-max sample); decode (h', z')."""
        h = self.transition(state["h"], state["z"], action)
        z = self._sample(self._probs(self.prior_head(h)), noise)
        frames, reward = self.decode(h, z)
        return frames, reward, {"h": h, "z": z}


def _categorical_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of independent categoricals [..., stoch, classes], summed over the latents: [...]."""
    return (p * (p.log() - q.log())).sum((-2, -1))


def _dense(inp: int, out: int) -> nn.Sequential:
    """Linear -> LayerNorm -> SiLU: the normalization keeps logits and features in range while the summed
    reconstruction loss sends large gradients (without it the categorical heads saturate early and stop learning)."""
    return nn.Sequential(nn.Linear(inp, out, bias=False), nn.LayerNorm(out), nn.SiLU())


class _ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channels of each pixel of a [N, C, H, W] feature map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
