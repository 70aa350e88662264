"""The rollout service as a Python API: stateless rollouts (cached) and sessions, over one batcher.

The HTTP app (:mod:`worldpipe.rollout.http.app`) and ``worldpipe rollout`` both call this; inputs are checked here
against the served model, so every caller rejects the same bad input with an error naming the field.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass

import torch

from worldpipe.measure.memory import process_rss_bytes
from worldpipe.rollout.batcher import Batcher, BatchPolicy
from worldpipe.rollout.cache import CachedDraw, DrawKey, ResultCache, prefix_hashes, tensor_hash
from worldpipe.rollout.engine import LIVE_STATE_TENSORS, JobResult, RolloutJob, Sampling, imagine_sequences
from worldpipe.rollout.registry import ModelRegistry, ServedModel, UnknownModelVersion
from worldpipe.rollout.sessions import Session, SessionStore
from worldpipe.rollout.streams import StreamId, fresh_stream

log = logging.getLogger("worldpipe.rollout")


class InputError(ValueError):
    """Bad request content; ``loc`` names the field (e.g. ("context", "obs"))."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(f"{'.'.join(map(str, loc))}: {message}")
        self.loc, self.message = loc, message


@dataclass(frozen=True)
class Limits:
    """Request limits (also enforced by the HTTP schema)."""

    max_horizon: int = 256
    max_context: int = 256
    max_request_bytes: int = 1 << 20
    max_candidates: int = 4096  # action sequences one /imagine/candidates request may score


@dataclass(frozen=True)
class ServiceConfig:
    """Everything that shapes a service besides the checkpoint."""

    policy: BatchPolicy = BatchPolicy()
    limits: Limits = Limits()
    cache_entries: int = 4096
    cache_bytes: int = 64 << 20
    session_budget_bytes: int = 64 << 20
    session_idle_s: float = 600.0
    poll_s: float = 0.0  # > 0: look for a newer step of the same run this often; 0: serve one version until reload


# How often idle sessions are looked for when no checkpoint polling sets the pace.
SESSION_SWEEP_S = 2.0


def _check_matrix(t: torch.Tensor, loc: tuple[str, ...], width: int, max_rows: int, min_rows: int = 1) -> None:
    if t.dim() != 2 or t.shape[1] != width:
        raise InputError(loc, f"expected shape [n, {width}], got {list(t.shape)}")
    if not min_rows <= t.shape[0] <= max_rows:
        raise InputError(loc, f"has {t.shape[0]} rows; allowed {min_rows}..{max_rows}")
    if not bool(torch.isfinite(t).all()):
        raise InputError(loc, "contains NaN or infinity")


def _name_odd_candidate(candidates, act_dim: int) -> None:
    """InputError at ``candidates.I`` for the first candidate that is empty, has a step of another width than
    ``act_dim``, or another number of steps than candidate 0 (the rows as JSON nests them)."""
    horizon = len(candidates[0])
    for i, rows in enumerate(candidates):
        loc = ("candidates", i)
        if len(rows) == 0:
            raise InputError(loc, f"candidate {i} is empty: each candidate is [H, {act_dim}] with H >= 1")
        for j, row in enumerate(rows):
            if len(row) != act_dim:
                raise InputError(loc, f"candidate {i} step {j} has {len(row)} values; the model acts with "
                                      f"{act_dim} per step")
        if len(rows) != horizon:
            raise InputError(loc, f"candidate {i} has {len(rows)} steps, candidate 0 has {horizon}: every candidate "
                                  "has the same horizon")


def resolve_stream(sampling: Sampling, seed: int, stream: str | None) -> StreamId | None:
    """The noise stream of a request: None for means, a new one when no stream is named (fresh sample)."""
    if not sampling.draws_noise:
        return None
    return fresh_stream(seed) if stream is None else StreamId(seed, stream)


class RolloutService:
    """Model registry + batcher + result cache + session store, with the rules that tie them together."""

    def __init__(self, checkpoint_path: str, config: ServiceConfig = ServiceConfig(), device: str = "cpu") -> None:
        self.config = config
        # The intra-op thread count of the thread that builds the service (`worldpipe serve --threads`). It is per
        # OS thread (OpenMP, MKL): a request computed on a web worker thread would otherwise run every core.
        self.threads = torch.get_num_threads()
        self._thread_state = threading.local()
        self.registry = ModelRegistry(checkpoint_path, device)
        self.registry.refresh()
        self.cache = ResultCache(config.cache_entries, config.cache_bytes)
        self.sessions = SessionStore(config.session_budget_bytes, config.session_idle_s,
                                     on_release=lambda s: self.registry.unpin(s.served))
        self.batcher = Batcher(config.policy)
        self._warm_up()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="checkpoint-watcher", daemon=True)
        self._watcher.start()

    def _warm_up(self) -> None:
        # One tiny job through the worker thread, so the first request does not pay its lazy initialization.
        served = self.registry.latest()
        zeros = torch.zeros(1, served.obs_dim), torch.zeros(1, served.act_dim)
        self.batcher.submit(RolloutJob(served, zeros[1], Sampling(), resolve_stream(Sampling(), 0, None),
                                       *zeros), alone=True).result()

    def close(self) -> None:
        """Finish queued work and stop the background threads."""
        self._stop.set()
        self._watcher.join()
        self.batcher.close()

    def _watch(self) -> None:
        while not self._stop.wait(self.config.poll_s or SESSION_SWEEP_S):
            if self.config.poll_s > 0:
                self.reload()
            self.sessions.sweep()

    def reload(self) -> bool:
        """Serve the newest intact step of the same run if it is newer (POST /reload); True when it changed.

        A checkpoint that fails to load leaves the current version served (warning logged)."""
        try:
            return self.registry.refresh()
        except Exception as exc:  # noqa: BLE001 - a bad new checkpoint must not stop serving the current one
            log.warning("checkpoint refresh failed, still serving %s: %s", self.registry.latest().version, exc)
            return False

    def _check_context(self, served: ServedModel, obs: torch.Tensor, action: torch.Tensor) -> None:
        limit = self.config.limits.max_context
        _check_matrix(obs, ("context", "obs"), served.obs_dim, limit)
        _check_matrix(action, ("context", "action"), served.act_dim, limit)
        if obs.shape[0] != action.shape[0]:
            raise InputError(("context", "action"), f"has {action.shape[0]} rows, context.obs has {obs.shape[0]}")

    def _check_actions(self, served: ServedModel, actions: torch.Tensor, min_rows: int = 1) -> None:
        _check_matrix(actions, ("actions",), served.act_dim, self.config.limits.max_horizon, min_rows)

    def _model(self, version: str | None) -> ServedModel:
        try:
            return self.registry.get(version)
        except UnknownModelVersion as err:
            raise InputError(("model_version",), str(err)) from None

    def rollout(self, context_obs: torch.Tensor, context_action: torch.Tensor, actions: torch.Tensor,
                sampling: Sampling, seed: int = 0, stream: str | None = None,
                model_version: str | None = None) -> dict:
        """Imagine ``actions`` [H,A] after the context; a named stream is reproducible (and cached)."""
        served = self._model(model_version)
        self._check_context(served, context_obs, context_action)
        self._check_actions(served, actions)
        stream_id = resolve_stream(sampling, seed, stream)
        reproducible = stream_id is None or stream is not None  # a fresh sample never reads or fills the cache
        key = DrawKey(served.version, tensor_hash(context_obs, context_action), sampling.key(),
                      stream_id.key() if stream_id is not None else "mean")
        hashes = prefix_hashes(actions)
        hit = self.cache.longest_prefix(key, hashes) if reproducible else None
        reused = 0 if hit is None else hit[0]
        if hit is not None and reused == actions.shape[0]:
            obs, reward, timing = hit[1].obs, hit[1].reward, {"queue_s": 0.0, "model_s": 0.0, "batch": 0}
        else:
            job = RolloutJob(served, actions[reused:], sampling, stream_id, context_obs, context_action,
                             start=hit[1].state if hit else None, first_step=reused)
            result: JobResult = self.batcher.submit(job).result()
            obs, reward, timing = result.obs, result.reward, result.timing
            if hit is not None:
                obs, reward = torch.cat([hit[1].obs, obs]), torch.cat([hit[1].reward, reward])
            if reproducible:
                self.cache.put(key, hashes[-1], CachedDraw(obs, reward, result.state))
        return {"model_version": served.version, "checkpoint_step": served.step, "observations": obs,
                "frames": served.frames(obs), "rewards": reward, "stream": _stream_doc(stream_id), "cached_steps": reused,
                "cache_hit": reused == actions.shape[0], "timing": timing}

    def imagine_candidates(self, context_obs: torch.Tensor, context_action: torch.Tensor,
                           candidates: torch.Tensor | list, model_version: str | None = None) -> dict:
        """Rewards [N,H] of N candidate action sequences [N,H,A] (a tensor, or nested lists as JSON has them)
        imagined with means from one context: what a planner asks for in one decision iteration (one batched model
        pass, no cache: candidates never repeat). A candidate that is not [H, act_dim], with the first one's H, is
        an InputError naming it."""
        served = self._model(model_version)
        self._check_context(served, context_obs, context_action)
        candidates = self._candidates(served, candidates)
        self._own_threads()
        started = time.perf_counter()
        model = served.model
        with torch.no_grad():
            state = model.observe_context(((context_obs - model.obs_mean) / model.obs_std).unsqueeze(0),
                                          context_action.unsqueeze(0))
            _, rewards = imagine_sequences(model, state, candidates)
        return {"model_version": served.version, "checkpoint_step": served.step, "rewards": rewards,
                "timing": {"model_s": time.perf_counter() - started}}

    def _candidates(self, served: ServedModel, candidates: torch.Tensor | list) -> torch.Tensor:
        limits = self.config.limits
        if not 1 <= len(candidates) <= limits.max_candidates:
            raise InputError(("candidates",), f"has {len(candidates)} candidates; allowed 1..{limits.max_candidates}")
        try:
            tensor = torch.as_tensor(candidates, dtype=torch.float32)
        except (ValueError, RuntimeError, TypeError):  # ragged: the candidate that differs is named below
            tensor = None
        if tensor is None or tensor.dim() != 3 or tensor.shape[2] != served.act_dim:
            _name_odd_candidate(candidates, served.act_dim)
            got = "rows of unequal lengths" if tensor is None else list(tensor.shape)
            raise InputError(("candidates",), f"must be [N, H, {served.act_dim}], got {got}")
        if not 1 <= tensor.shape[1] <= limits.max_horizon:
            raise InputError(("candidates",), f"have {tensor.shape[1]} steps each; allowed 1..{limits.max_horizon}")
        if not bool(torch.isfinite(tensor).all()):
            raise InputError(("candidates",), "contain NaN or infinity")
        return tensor

    def _own_threads(self) -> None:
        """Give the calling thread the service's intra-op thread count, once per thread.

        Model work done on the caller's thread (not the batcher's) must use the same kernels as everywhere else:
        with MKL on as many threads as cores, a small matrix product splits differently and its last bits
        change, so a planner's candidates scored here would differ from the same scores in-process.
        """
        if getattr(self._thread_state, "threads", None) != self.threads:
            torch.set_num_threads(self.threads)
            self._thread_state.threads = self.threads

    # ---- sessions ----
    def open_session(self, context_obs: torch.Tensor, context_action: torch.Tensor, sampling: Sampling,
                     seed: int = 0, stream: str | None = None, model_version: str | None = None) -> dict:
        """A new session positioned after the context; returns its id and owner token."""
        served = self._model(model_version)
        self._check_context(served, context_obs, context_action)
        stream_id = resolve_stream(sampling, seed, stream)
        empty = context_action.new_zeros(0, served.act_dim)
        result = self.batcher.submit(RolloutJob(served, empty, sampling, stream_id, context_obs,
                                                context_action)).result()
        self.registry.pin(served)
        session = self.sessions.add(served, sampling, stream_id, context_obs, context_action, empty, result.state)
        return {**_session_doc(session), "token": session.token}

    def extend(self, session_id: str, token: str | None, actions: torch.Tensor) -> dict:
        """Imagine ``actions`` from the session's current state and advance it."""
        session = self.sessions.acquire(session_id, token)
        try:
            self._check_actions(session.served, actions)
            job = RolloutJob(session.served, actions, session.sampling, session.stream, start=session.state,
                             first_step=session.step)
            result = self.batcher.submit(job).result()
        except BaseException:
            self.sessions.release_busy(session)
            raise
        self.sessions.release_busy(session, result.state, torch.cat([session.actions, actions]))
        return {**_session_doc(session), "observations": result.obs, "frames": session.served.frames(result.obs),
                "rewards": result.reward,
                "timing": result.timing}

    def fork(self, session_id: str, token: str | None, step: int | None = None) -> dict:
        """A new session equal to this one after ``step`` actions (default: now); the parent is untouched."""
        parent = self.sessions.acquire(session_id, token)
        try:
            step = parent.step if step is None else step
            if not 0 <= step <= parent.step:
                raise InputError(("step",), f"must be in 0..{parent.step} (the session's step), got {step}")
            if step == parent.step:
                state = {k: v.clone() for k, v in parent.state.items()}
            else:  # replay: the noise of step k depends only on the stream and k, so this is exact
                job = RolloutJob(parent.served, parent.actions[:step], parent.sampling, parent.stream,
                                 parent.context_obs, parent.context_action)
                state = self.batcher.submit(job).result().state
        finally:
            self.sessions.release_busy(parent)
        self.registry.pin(parent.served)
        child = self.sessions.add(parent.served, parent.sampling, parent.stream, parent.context_obs,
                                  parent.context_action, parent.actions[:step].clone(), state)
        return {**_session_doc(child), "token": child.token, "parent": session_id}

    def close_session(self, session_id: str, token: str | None) -> dict:
        """Release a session and its memory."""
        self.sessions.close(session_id, token)
        return {"session_id": session_id, "closed": True}

    def stats(self) -> dict:
        """Memory by category, cache and batcher counters."""
        loaded = self.registry.loaded()
        sessions = self.sessions.stats()
        cache = self.cache.stats()
        parameters = sum(m.parameter_bytes for m in loaded)
        gc.collect()  # so the leak counter sees only states something still references
        rss = process_rss_bytes()
        accounted = parameters + sessions["held_bytes"] + cache["bytes"]
        return {
            "models": [{"version": m.version, "step": m.step, "pins": m.pins} for m in loaded],
            # session_held: all the sessions hold (their state and history tensors included), as budgeted.
            "memory": {"parameters": parameters, "session_state": sessions["state_bytes"],
                       "session_history": sessions["history_bytes"], "session_held": sessions["held_bytes"],
                       "result_cache": cache["bytes"], "process_rss": rss,
                       "runtime_overhead": None if rss is None else rss - accounted},
            "rollout_state_tensors_alive": len(LIVE_STATE_TENSORS),
            "sessions": sessions, "cache": cache,
            "batcher": {"batches": self.batcher.batches, "jobs": self.batcher.jobs,
                        "rows_computed": self.batcher.rows_computed},
        }


def _stream_doc(stream: StreamId | None) -> dict | None:
    return None if stream is None else {"seed": stream.seed, "stream": stream.stream}


def _session_doc(session: Session) -> dict:
    return {"session_id": session.id, "step": session.step, "model_version": session.served.version,
            "stream": _stream_doc(session.stream), "state_bytes": session.state_bytes,
            "held_bytes": session.held_bytes}
