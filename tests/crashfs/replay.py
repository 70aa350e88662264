"""Record once, replay to every crash state (CrashMonkey's way): run a workload on a crash-simulating mount, take
its operation log, then materialise each state a power cut could leave into a plain directory and check it with
the project's own recovery.

``sweep(recording, check, workdir)`` calls ``check(root, state)`` for each distinct state (or an evenly spaced
sample of ``sample`` of them, always including the last) and returns a :class:`Sweep` with the counts; a check
raises AssertionError naming what broke.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .model import CrashState, crash_states, persistence_points, write_image


@dataclass
class Sweep:
    """What a sweep covered: crash states checked, by kind, of how many distinct ones; persistence points."""

    states: int = 0
    checked: int = 0
    points: int = 0
    kinds: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        """One line: the counts, for a test's output and the docs' figures."""
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items()))
        return (f"{self.checked} of {self.states} distinct crash states checked ({kinds}) "
                f"over {self.points} persistence points")


def _kind(state: CrashState) -> str:
    return "torn" if state.kind.startswith("torn") else state.kind


def sweep(recording: dict, check: Callable[[Path, CrashState], None], workdir: Path,
          sample: int | None = None, subdir: str = "") -> Sweep:
    """Check every crash state of ``recording`` (or ``sample`` of them); ``subdir``: the part of the image the
    check is given (the workload's directory on the mount)."""
    states = list(crash_states(recording["initial"], recording["log"]))
    chosen = states
    if sample is not None and sample < len(states):
        step = len(states) / sample
        chosen = [states[int(i * step)] for i in range(sample - 1)] + [states[-1]]
    result = Sweep(states=len(states), points=persistence_points(recording["log"]))
    root = Path(workdir) / "crash-state"
    for state in chosen:
        shutil.rmtree(root, ignore_errors=True)
        write_image(state.image, root)
        try:
            check(root / subdir if subdir else root, state)
        except AssertionError as exc:
            raise AssertionError(f"crash state after operation {state.index} ({state.kind}, a cut before "
                                 f"operation {state.done}; op {_op_text(recording, state)}): {exc}") from exc
        result.checked += 1
        result.kinds[_kind(state)] += 1
    shutil.rmtree(root, ignore_errors=True)
    return result


def _op_text(recording: dict, state: CrashState) -> str:
    if state.index < 0:
        return "none"
    op = recording["log"][state.index]
    return repr(tuple(x if not isinstance(x, bytes) else f"<{len(x)} bytes>" for x in op))


def checkpoint_acks(log: list[tuple], checkpoints: str) -> dict[int, int]:
    """Per step, the log length at which its checkpoint became durable by the publication protocol: the first
    fsync of the checkpoints directory ``checkpoints`` (relative to the mount) after the rename to
    ``step-NNNNNN`` (the save returns later still, once ``latest`` names it)."""
    acks, renamed = {}, {}
    prefix = checkpoints.rstrip("/") + "/step-"
    for index, op in enumerate(log):
        if op[0] == "rename" and op[2].startswith(prefix) and "/" not in op[2][len(prefix):]:
            renamed[int(op[2][len(prefix):])] = index
        elif op[0] == "fsyncdir" and op[1] == checkpoints.rstrip("/"):
            for step, at in list(renamed.items()):
                if at < index:
                    acks.setdefault(step, index + 1)
                    del renamed[step]
    return acks
