"""Rollout sessions with explicit ownership: who holds which state, and when its memory is released.

A session owns the rollout state of one imagined trajectory (a recurrent state, or a KV cache that grows with
every step), the context it started from and the actions taken so far. The store owns the sessions: a client
reaches one only with the token it got at open, one request at a time. Memory is released when the session
is closed, when it idles past the timeout, or when the store evicts the least recently used sessions to stay
within its memory budget. A released session leaves a tombstone, so later requests get a clear "closed" /
"expired" / "evicted" error instead of a generic one, and never another session's state.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from worldpipe.measure.footprint import footprint_bytes
from worldpipe.models import RolloutState, state_nbytes
from worldpipe.rollout.engine import Sampling
from worldpipe.rollout.registry import ServedModel
from worldpipe.rollout.streams import StreamId

MAX_TOMBSTONES = 100_000
_SLOT_BYTES = 104  # an OrderedDict entry of the live table: hash slot, entry and linked-list node (CPython 3.11)


class SessionError(Exception):
    """A session request that cannot be served; ``status`` is the HTTP status to answer with."""

    status = 400


class SessionNotFound(SessionError):
    status = 404


class SessionGone(SessionError):
    """The session existed and was released (closed, expired or evicted)."""

    status = 410


class SessionForbidden(SessionError):
    status = 403


class SessionBusy(SessionError):
    status = 409


@dataclass
class Session:
    """One imagined trajectory and the state after its last step."""

    id: str
    token: str
    served: ServedModel
    sampling: Sampling
    stream: StreamId | None
    context_obs: torch.Tensor
    context_action: torch.Tensor
    actions: torch.Tensor  # [step, A] taken so far
    state: RolloutState | None
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False
    held_bytes: int = 0  # what this session holds in the process, as counted against the budget

    def measure(self) -> int:
        """Bytes this session really holds: its tensors with their per-tensor overhead, its Python objects
        and its place in the store (the served model is shared, not counted)."""
        watched = len(self.state or {})  # the engine's leak detector holds a weak reference to each state tensor
        return footprint_bytes(self, shared=(self.served,)) + _SLOT_BYTES + watched * _WATCH_BYTES

    @property
    def step(self) -> int:
        return int(self.actions.shape[0])

    @property
    def state_bytes(self) -> int:
        return state_nbytes(self.state) if self.state is not None else 0

    @property
    def history_bytes(self) -> int:
        tensors = (self.context_obs, self.context_action, self.actions)
        return sum(t.numel() * t.element_size() for t in tensors)


_WATCH_BYTES = sys.getsizeof(weakref.ref(Session)) + 32  # a WeakSet member: its weakref and its set slot


class SessionStore:
    """Live sessions, their tombstones, and the rules that release them."""

    def __init__(self, memory_budget_bytes: int, idle_timeout_s: float,
                 on_release: Callable[[Session], None] = lambda s: None) -> None:
        self.memory_budget_bytes = memory_budget_bytes
        self.idle_timeout_s = idle_timeout_s
        self._on_release = on_release
        self._live: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._held = 0  # sum of the live sessions' held_bytes
        self.released = {"closed": 0, "expired": 0, "evicted": 0}

    def add(self, served: ServedModel, sampling: Sampling, stream: StreamId | None, context_obs: torch.Tensor,
            context_action: torch.Tensor, actions: torch.Tensor, state: RolloutState) -> Session:
        """Register a new session owning ``state``; returns it (its token is the only way back in)."""
        # Own copies: a view would keep the request's whole parsed tensor (and a second tensor object) alive.
        session = Session(secrets.token_hex(16), secrets.token_urlsafe(24), served, sampling, stream,
                          context_obs.clone(), context_action.clone(), actions.clone(), state)
        session.held_bytes = session.measure()  # outside the lock: it walks the session's objects
        with self._lock:
            self._expire_idle()
            self._live[session.id] = session
            self._held += session.held_bytes
            self._enforce_budget(keep=session.id)
        return session

    def acquire(self, session_id: str, token: str | None) -> Session:
        """The session, marked busy for one request; raises a SessionError naming why not."""
        with self._lock:
            self._expire_idle()
            session = self._lookup(session_id, token)
            if session.busy:
                raise SessionBusy(f"session {session_id}: another request on it is in flight")
            session.busy = True
            self._live.move_to_end(session_id)
            return session

    def release_busy(self, session: Session, state: RolloutState | None = None,
                     actions: torch.Tensor | None = None) -> None:
        """End a request on ``session``, committing its new state; SessionGone if it was closed meanwhile."""
        with self._lock:
            session.busy = False
            session.last_used = time.monotonic()
            if self._live.get(session.id) is not session:
                reason = self._tombstones.get(session.id, "released")
                raise SessionGone(f"session {session.id}: {reason} while the request was running; result dropped")
            if state is not None:
                session.state, session.actions = state, actions
                held = session.measure()
                self._held += held - session.held_bytes
                session.held_bytes = held
            self._enforce_budget(keep=session.id)

    def close(self, session_id: str, token: str | None) -> None:
        """Release a session now (allowed while a request on it runs: that request's result is dropped)."""
        with self._lock:
            session = self._lookup(session_id, token)
            self._release(session, "closed")

    def sweep(self) -> None:
        """Release sessions idle past the timeout (also done on every store access)."""
        with self._lock:
            self._expire_idle()

    def _lookup(self, session_id: str, token: str | None) -> Session:
        session = self._live.get(session_id)
        if session is None:
            reason = self._tombstones.get(session_id)
            if reason is not None:
                raise SessionGone(f"session {session_id}: {reason}")
            raise SessionNotFound(f"session {session_id}: no such session")
        if token is None or not secrets.compare_digest(token, session.token):
            raise SessionForbidden(f"session {session_id}: wrong or missing X-Session-Token")
        return session

    def _release(self, session: Session, reason: str) -> None:
        del self._live[session.id]
        self._held -= session.held_bytes
        session.state = None  # drop the only reference the store holds
        self._tombstones[session.id] = sys.intern(reason)  # thousands of tombstones share a few reasons
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        self.released[reason.split()[0]] += 1
        self._on_release(session)

    def _expire_idle(self) -> None:
        now = time.monotonic()
        for session in [s for s in self._live.values() if not s.busy and now - s.last_used > self.idle_timeout_s]:
            self._release(session, f"expired (idle more than {self.idle_timeout_s:g} s)")

    def _enforce_budget(self, keep: str) -> None:
        # Least recently used first; the budget counts what sessions really hold (Session.measure), not nbytes.
        for session in list(self._live.values()):
            if self._held <= self.memory_budget_bytes:
                break
            if session.busy or session.id == keep:
                continue
            self._release(session, f"evicted (session memory budget {self.memory_budget_bytes} bytes)")

    def stats(self) -> dict:
        """Live sessions, the bytes of their state and history tensors, and all they hold (``held_bytes``)."""
        with self._lock:
            live = list(self._live.values())
            held = self._held
        return {"live": len(live), "state_bytes": sum(s.state_bytes for s in live),
                "history_bytes": sum(s.history_bytes for s in live), "held_bytes": held,
                "released": dict(self.released)}
