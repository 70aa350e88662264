"""Request and response schemas of the HTTP service (pydantic; NaN and infinity rejected at parse time)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Finite = Annotated[float, Field(allow_inf_nan=False)]
Matrix = list[list[Finite]]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContextIn(Strict):
    """Observed history: C observations (raw units) and the C actions taken after each."""

    obs: Matrix = Field(description="[C, obs_dim] observations, oldest first (frame models: each frame "
                                    "flattened, height x width x 3 values 0..255)")
    action: Matrix = Field(description="[C, act_dim] actions; action[C-1] is unused (imagination starts there)")


class SamplingIn(Strict):
    """How latents are drawn: 'sample' (noise from the RNG stream, scaled) or 'mean' (deterministic)."""

    mode: Literal["sample", "mean"] = "sample"
    noise_scale: Annotated[float, Field(ge=0.0, le=10.0, allow_inf_nan=False)] = 1.0


class RngIn(Strict):
    """The RNG stream: a named stream is reproducible (cacheable); no stream asks for a fresh sample."""

    seed: Annotated[int, Field(ge=0, lt=2**63)] = 0
    stream: Annotated[str, Field(min_length=1, max_length=128)] | None = None


class RolloutIn(Strict):
    context: ContextIn
    actions: Matrix = Field(description="[H, act_dim] actions to imagine")
    sampling: SamplingIn = SamplingIn()
    rng: RngIn = RngIn()
    model_version: str | None = Field(None, description="pin a model version (default: the newest served)")


class Float32Array(Strict):
    """An array as the base64 of its little-endian float32 bytes, row-major: exact, and a fraction of the cost of
    writing and reading the same numbers as JSON text."""

    shape: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1, max_length=4)]
    data: str = Field(description="base64 of prod(shape) little-endian float32 values")


class CandidatesIn(Strict):
    context: ContextIn
    candidates: list[Matrix] | None = Field(
        None, description="[N, H, act_dim] action sequences to score (a planner's candidates); or candidates_f32")
    candidates_f32: Float32Array | None = Field(
        None, description="the same [N, H, act_dim] as float32 bytes; the answer's rewards then come as rewards_f32")
    model_version: str | None = Field(None, description="pin a model version (default: the newest served)")

    @model_validator(mode="after")
    def _one_form(self) -> CandidatesIn:
        if (self.candidates is None) == (self.candidates_f32 is None):
            raise ValueError("give the candidates once: candidates (JSON numbers) or candidates_f32 (float32 bytes)")
        return self


class CandidatesOut(BaseModel):
    model_version: str
    checkpoint_step: int
    rewards: Matrix | None = Field(None, description="[N, H] predicted rewards of each candidate, imagined with means "
                                                     "(for JSON candidates)")
    rewards_f32: Float32Array | None = Field(None, description="the same [N, H] as float32 bytes (for candidates_f32)")
    timing: dict[str, float]


class SessionOpenIn(Strict):
    context: ContextIn
    sampling: SamplingIn = SamplingIn()
    rng: RngIn = RngIn()
    model_version: str | None = None


class ExtendIn(Strict):
    actions: Matrix


class ForkIn(Strict):
    step: Annotated[int, Field(ge=0)] | None = Field(None, description="fork after this many actions (default: now)")


class StreamOut(BaseModel):
    seed: int
    stream: str


class RolloutOut(BaseModel):
    model_version: str
    checkpoint_step: int
    observations: list[list[float]]
    frames: list[list[list[list[int]]]] | None = Field(None, description="frame models: the imagined observations "
                                                       "as uint8 frames [H, 3, height, width], channels first (else null)")
    rewards: list[float]
    stream: StreamOut | None
    cached_steps: int = Field(description="leading steps served from the cache (a cached prefix state)")
    cache_hit: bool
    timing: dict


class SessionOut(BaseModel):
    session_id: str
    step: int
    model_version: str
    stream: StreamOut | None
    state_bytes: int = Field(description="bytes of the rollout state's tensors (recurrent state or KV cache)")
    held_bytes: int = Field(description="all the session holds in the server (tensor overheads and Python objects "
                                        "included): what counts against --session-budget-mb")
    token: str | None = None
    parent: str | None = None
    observations: list[list[float]] | None = None
    frames: list[list[list[list[int]]]] | None = Field(None, description="frame models, extend: the imagined "
                                                       "frames as uint8 [H, 3, height, width], channels first")
    rewards: list[float] | None = None
    timing: dict | None = None


class ContextsQuery(Strict):
    """GET /contexts: which held-out windows to list."""

    model: str | None = Field(None, description="model version the context is for (default: the newest served)")
    length: Annotated[int, Field(ge=1)] = Field(8, description="steps per context window")
    start: Annotated[int, Field(ge=0)] = Field(0, description="index of the first window")
    count: Annotated[int, Field(ge=1, le=64)] = Field(16, description="how many windows")
