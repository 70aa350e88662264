"""Names of everything a checkpoint store contains: directories, files and state keys.

A store root (``checkpoints/``) holds::

    step-000100/                 one published checkpoint per step (never modified after publication)
      MANIFEST.json              written last: every file's relative path, size, sha256; step; identity
      model.pt                   state["model"]       torch.load(weights_only=True)-loadable
      optimizer.pt               state["optimizer"]   (absent when None)
      scheduler.pt               state["scheduler"]   (absent when None)
      scaler.pt                  state["scaler"]      (absent when None)
      ema.pt                     state["ema"]         (absent when None)
      train_state.json           {"progress": state["progress"], "sampler": state["sampler"]}
      identity.json              state["identity"]
      rng/rank-00000.pt          state["rng"][0]: authoritative, weights_only-loadable
      rng/rank-00000.json        readable view of the same (never read back)
    latest                       one line: the directory name of the newest published step
    .step-000200.partial-<nonce>/  a save in progress or crashed (POSIX only; removed by the next save)
    .step-000050.deleting-<nonce>/ retention in progress (removed by the next save)
    .latest.tmp-<nonce>          a `latest` replacement in progress
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple

from worldpipe.config.paths import checkpoints_dir
from worldpipe.core.locations import read_bytes

MANIFEST_NAME = "MANIFEST.json"
LATEST_NAME = "latest"
LOCK_NAME = ".writer.lock"

# State keys (see worldpipe.checkpoint.state).
MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
EMA = "ema"
PROGRESS = "progress"
SAMPLER = "sampler"
RNG = "rng"
IDENTITY = "identity"

STATE_KEYS = (MODEL, OPTIMIZER, SCHEDULER, SCALER, EMA, PROGRESS, SAMPLER, RNG, IDENTITY)
TENSOR_KEYS = (MODEL, OPTIMIZER, SCHEDULER, SCALER, EMA)  # stored with torch serialization, one file each
OPTIONAL_KEYS = (OPTIMIZER, SCHEDULER, SCALER, EMA)  # None -> no file
PROGRESS_FIELDS = ("step", "epoch", "samples_seen", "tokens_seen")

TENSOR_FILES = {key: f"{key}.pt" for key in TENSOR_KEYS}
TRAIN_STATE_FILE = "train_state.json"
IDENTITY_FILE = "identity.json"
RNG_DIR = "rng"

_STEP_DIR_RE = re.compile(r"^step-(\d{6,})$")
_LEFTOVER_RE = re.compile(r"^\.(step-\d{6,}\.(partial|deleting|replaced)-[0-9a-f]+|latest\.tmp-[0-9a-f]+)$")


def step_dir_name(step: int) -> str:
    """``step-NNNNNN`` for ``step`` (validated: a non-negative int)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    return f"step-{step:06d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a published step directory name, or None for anything else (partials, files, ...)."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


class Location(NamedTuple):
    """Where a command reads checkpoints: the store (``checkpoints/``) and one step in it, or None for the step
    training would resume from (the newest loadable)."""

    root: str
    step: int | None

    @property
    def path(self) -> str:
        """The location as one path again: the store, or its step folder."""
        return self.root if self.step is None else f"{self.root.rstrip('/')}/{step_dir_name(self.step)}"


def resolve_location(path: str | os.PathLike) -> Location:
    """The one meaning of a checkpoint location a user names (``RUN`` of every command that reads checkpoints):
    a run directory (its ``checkpoints/``), a checkpoint store itself, or one ``step-NNNNNN`` folder in a store.

    Local paths or URLs; a run directory is recognised by its ``checkpoints/`` folder, so only a local one (a URL
    names a store or a step). Nothing is checked for existence here: each command says what is missing.
    """
    text = os.fspath(path)
    trimmed = text.rstrip("/") or text
    head, _, name = trimmed.rpartition("/")
    step = parse_step_dir(name)
    if step is not None:
        return Location(head or ".", step)
    store = checkpoints_dir(trimmed)
    if "://" not in trimmed and os.path.isdir(store):
        return Location(store, None)
    return Location(trimmed, None)


def temp_name(step: int, kind: str, nonce: str) -> str:
    """Hidden sibling name of a step directory being written (``partial``) or removed (``deleting``)."""
    return f".{step_dir_name(step)}.{kind}-{nonce}"  # anything starting with "." is never a checkpoint


def is_leftover(name: str) -> bool:
    """True for names this library creates transiently and a later save may remove."""
    return bool(_LEFTOVER_RE.match(name))


def rng_file(rank: int) -> str:
    """Relative path of rank ``rank``'s authoritative RNG file."""
    return f"{RNG_DIR}/rank-{rank:05d}.pt"


def rng_view_file(rank: int) -> str:
    """Relative path of rank ``rank``'s readable RNG JSON view."""
    return f"{RNG_DIR}/rank-{rank:05d}.json"


def read_manifest_bytes(root: str, step: int) -> bytes | None:
    """Raw MANIFEST.json of a published step under ``root`` (local path or fsspec URL); None if unreadable."""
    try:
        return read_bytes(f"{str(root).rstrip('/')}/{step_dir_name(step)}/{MANIFEST_NAME}")
    except OSError:
        return None


def latest_identity(root: str) -> dict:
    """The run identity in the manifest of the step ``latest`` names under ``root`` ({} when there is none)."""
    try:
        step = parse_step_dir(read_bytes(f"{str(root).rstrip('/')}/{LATEST_NAME}").decode().strip())
    except (OSError, UnicodeDecodeError):
        return {}
    return step_identity(root, step) if step is not None else {}


def step_identity(root: str, step: int) -> dict:
    """The run identity in the manifest of ``step`` under ``root`` ({} when it has none)."""
    raw = read_manifest_bytes(root, step)
    try:
        return dict(json.loads(raw)["identity"]) if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}
