"""The world-model interface: everything the trainer, evaluator, checkpointer and rollout service may ask of a model.

A model is a plugin: ``conf/model/*.yaml`` names its class with ``_target_`` and :func:`build_model` instantiates
it with the dataset's observation and action sizes. Nothing outside ``worldpipe.models`` branches on a model's
name; it asks the model instead (docs/architecture.md, "World models are plugins").

Shapes: B = sequences in the batch, T = time steps, O/A = observation/action size.

* Training: ``forward(obs, action, reward, mask, noise)`` returns per-term loss *sums* over valid steps
  (``mask`` 1 for valid steps). The trainer divides by the global count of valid steps, so unequal per-rank
  slices still give the global-mean gradient. ``noise`` is drawn *outside* the module, keyed by seed and global
  sample index (:func:`worldpipe.models.noise.sample_noise`), with the per-sample shape the model declares in
  :meth:`WorldModel.noise_shape` (None: the model needs no noise and gets ``None``).
* Evaluation: ``predict_open_loop(obs, action, context)`` filters ``context`` observed steps, then imagines the
  rest from the actions alone; by default it is built from the rollout primitives below.
* Rollouts: :meth:`WorldModel.observe_context` turns an observed history into a :class:`RolloutState` (a dict of
  batch-first tensors the caller owns: it can clone, slice and concatenate it), and
  :meth:`WorldModel.imagine_step` advances it by one action. ``rollout_noise_shape`` is the per-sample noise of
  one imagined step (None: deterministic). The state has a fixed size (recurrent models) or grows with the
  horizon (a KV cache): :attr:`WorldModel.state_grows` says which.
* Partitioning: :attr:`WorldModel.parallel` says which axes the model supports (batch always; tensor-parallel
  when it provides a plan; time only where the temporal dependency allows a valid cut).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

# A rollout state: named, batch-first tensors (dim 0 = sequence in the batch).
RolloutState = dict[str, torch.Tensor]

TIME_PARTITIONS = (None, "ring_attention", "scan")


@dataclass(frozen=True)
class ParallelSupport:
    """Which partitioning axes a model admits.

    ``time_partition``: None when the sequence cannot be cut in time (a nonlinear recurrence needs every
    previous state), ``"ring_attention"`` (causal attention: key/value blocks can circulate between ranks),
    ``"scan"`` (an affine recurrence: chunk-local scans plus exchanged boundary states).
    """

    batch: bool = True
    tensor_parallel: bool = False
    time_partition: str | None = None
    max_tensor_parallel: int | None = None  # e.g. the number of attention heads
    # Pipeline parallelism: how many blocks the model can be cut between (None: no stage boundaries). A pipeline
    # of P stages needs P <= pipeline_blocks; the model builds its stages (:meth:`WorldModel.pipeline_stage`).
    pipeline_blocks: int | None = None
    # Activation recomputation: the model can run its blocks under torch.utils.checkpoint (keep only each block's
    # input for backward, recompute the rest), see :meth:`WorldModel.enable_recompute`.
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.time_partition not in TIME_PARTITIONS:
            raise ValueError(f"time_partition must be one of {TIME_PARTITIONS}, got {self.time_partition!r}")


class WorldModel(nn.Module):
    """Base class of world models over vector observations (see the module docstring for the contract)."""

    #: Loss terms ``forward`` returns, "total" first (the one that is optimized).
    loss_terms: ClassVar[tuple[str, ...]] = ("total",)
    #: Partitioning axes the model admits.
    parallel: ClassVar[ParallelSupport] = ParallelSupport()
    #: Children whose weights the model's own ``forward`` reads outside their forward (a fused kernel takes them):
    #: FSDP2 leaves them in the root's unit (``parallel.fsdp_units``), so they are whole while ``forward`` runs.
    whole_in_forward: ClassVar[tuple[str, ...]] = ()
    #: True when the rollout state grows with the horizon (a KV cache), False for a fixed-size state.
    state_grows: ClassVar[bool] = False
    #: Constructor parameters that are sizes or counts (layer widths, latent sizes, heads, layers): each must be
    #: a positive integer, checked with the config before any process starts (``check_model_config``).
    dimensions: ClassVar[tuple[str, ...]] = ()
    #: Constructor parameters that hold the config of another model (a wrapper's inner model), checked the same.
    submodels: ClassVar[tuple[str, ...]] = ()
    #: The stored array the model observes: "obs" (state vectors) or "pixels" (frames, flattened per step by
    #: :func:`flat_observations`; the model's obs_dim is then H*W*3).
    observation_key: ClassVar[str] = "obs"

    def __init__(self, obs_dim: int, act_dim: int) -> None:
        super().__init__()
        self.obs_dim, self.act_dim = int(obs_dim), int(act_dim)
        # Normalization statistics of the training data travel with the weights, so evaluation and imagination
        # never need the dataset to interpret the model's outputs.
        self.register_buffer("obs_mean", torch.zeros(self.obs_dim))
        self.register_buffer("obs_std", torch.ones(self.obs_dim))

    def set_normalization(self, obs_mean: Any, obs_std: Any) -> None:
        """Record the observation statistics the model is trained in."""
        self.obs_mean.copy_(torch.as_tensor(obs_mean, dtype=self.obs_mean.dtype))
        self.obs_std.copy_(torch.as_tensor(obs_std, dtype=self.obs_std.dtype))

    # ---- training ----
    def noise_shape(self, steps: int) -> tuple[int, ...] | None:
        """Per-sample shape of the training noise for a window of ``steps`` (None: no noise)."""
        return None

    def forward(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, mask: torch.Tensor,
                noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Per-term loss sums over valid steps (scalars), keyed by :attr:`loss_terms`."""
        raise NotImplementedError

    # ---- rollouts ----
    def rollout_noise_shape(self) -> tuple[int, ...] | None:
        """Per-sample shape of the noise one imagined step draws (None: deterministic)."""
        return None

    def observe_context(self, obs: torch.Tensor, action: torch.Tensor) -> RolloutState:
        """Filter an observed history obs [B,C,O] (normalized), action [B,C,A] into a rollout state.

        The state is positioned after observation C-1; ``action[:, C-1]`` is the first action the next
        :meth:`imagine_step` consumes, so only ``action[:, :C-1]`` is read here.
        """
        raise NotImplementedError

    def imagine_step(self, state: RolloutState, action: torch.Tensor,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, RolloutState]:
        """Take ``action`` [B,A] from ``state``: predicted (normalized) observation [B,O], reward [B], new state.

        ``noise`` [B,*rollout_noise_shape] draws a stochastic sample; None takes the mean (no sampling).
        The input state is never modified: forks may share it.
        """
        raise NotImplementedError

    @torch.no_grad()
    def predict_open_loop(self, obs: torch.Tensor, action: torch.Tensor, context: int,
                          noise: torch.Tensor | None = None) -> torch.Tensor:
        """Filter ``context`` observed steps, then imagine the rest: with means, or sampled with ``noise``
        [B,T-context,*rollout_noise_shape] (standard normal; ignored by a deterministic model).

        obs [B,T,O] (normalized), action [B,T,A]; returns predicted observations for steps context..T-1:
        [B,T-context,O].
        """
        state = self.observe_context(obs[:, :context], action[:, :context])
        predictions = []
        for t in range(context, obs.shape[1]):
            step_noise = None if noise is None else noise[:, t - context]
            predicted, _, state = self.imagine_step(state, action[:, t - 1], step_noise)
            predictions.append(predicted)
        return torch.stack(predictions, dim=1)

    # ---- partitioning ----
    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, Any] | None:
        """Module path -> DTensor parallel style, for ``parallelize_module`` (None: not tensor-parallel).

        ``sequence_parallel``: the plan that also keeps the norm regions on sequence shards (Megatron's).
        """
        return None

    @classmethod
    def parallel_support(cls, **model_kwargs: Any) -> ParallelSupport:
        """The axes a model built with these config keys admits, known before it is built (layout checks)."""
        return cls.parallel

    def enable_recompute(self) -> None:
        """Recompute each block's activations in backward instead of keeping them (``parallel.recompute``).

        Only models whose ``parallel.recompute`` is set implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} declares no blocks to recompute")

    def pipeline_stage(self, stage: int, stages: int) -> nn.Module:
        """Keep only the modules of pipeline stage ``stage`` of ``stages`` (the rest are dropped, so the state
        dict names only this stage's tensors, under their full-model names) and return the stage's module.

        The first stage's module takes (obs, action) [B,T,O], [B,T,A]; every later one the previous stage's
        output; the last returns what :meth:`pipeline_loss` takes. Only models whose
        ``parallel.pipeline_blocks`` is set implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} declares no pipeline stage boundaries")

    def pipeline_loss(self, output: torch.Tensor, obs: torch.Tensor, reward: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-term loss sums (as :meth:`forward`) from the last pipeline stage's output on these windows."""
        raise NotImplementedError(f"{type(self).__name__} declares no pipeline stage boundaries")

    def bind_time_partition(self, partition: Any) -> None:
        """Make ``forward`` run on this rank's chunk of time (a ``worldpipe.parallel.TimePartition``).

        Only models whose ``parallel.time_partition`` is set implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} has no valid time partition")


def has_dtensor_parameters(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (sharded by FSDP2 or tensor parallelism).

    Asked without importing ``torch.distributed.tensor`` (about a second of start-up, paid by the launcher and at
    every Snakefile parse for nothing): a DTensor cannot exist before that module is imported.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in module.parameters())


def flat_observations(arrays: dict[str, Any], key: str) -> Any:
    """The observations a model with ``observation_key`` ``key`` reads from stored arrays, in raw units.

    "obs": the state vectors as they are; "pixels": uint8 frames [..., H, W, 3] as float32 vectors
    [..., H*W*3] (channel last), so frame models share every vector-observation path (open loop, rollouts).
    Works on NumPy arrays and torch tensors alike.
    """
    value = arrays[key]
    if key == "obs":
        return value
    flat = value.reshape(*value.shape[:-3], -1)
    return flat.float() if isinstance(flat, torch.Tensor) else flat.astype("float32")


def state_nbytes(state: RolloutState) -> int:
    """Bytes held by a rollout state's tensors."""
    return sum(t.numel() * t.element_size() for t in state.values())
