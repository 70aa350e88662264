"""Exceptions raised by the checkpoint library."""

from __future__ import annotations

import re

from worldpipe.core.errors import EXIT_USAGE, UserError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class CheckpointError(UserError):
    """Base class of checkpoint errors."""


class CheckpointWriteError(CheckpointError):
    """Publishing a checkpoint failed; the previous published checkpoint is untouched.

    ``step`` is the step being saved and ``path`` the file or directory the failing operation touched.
    """

    def __init__(self, step: int, path: str, cause: BaseException | str) -> None:
        self.step = step
        self.path = path
        self.cause = cause
        super().__init__(f"saving checkpoint step {step} failed at {path}: {cause}")


class CheckpointCorruptError(CheckpointError):
    """A requested checkpoint failed verification; ``problems`` name each bad file."""

    def __init__(self, step: int, problems: list[str]) -> None:
        self.step = step
        self.problems = list(problems)
        super().__init__(f"checkpoint step {step} is not intact: " + "; ".join(self.problems))


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (intact) checkpoint exists where one was requested: the location given must change (exit 2)."""

    exit_code = EXIT_USAGE


class PathEscapeError(OSError):
    """A file a step names resolves (through a symlink) outside the step's directory: never read."""


def load_error_line(exc: BaseException) -> str:
    """One line for a failed ``torch.load(weights_only=True)``: what the unpickler refused, not torch's advice."""
    text = _ANSI.sub("", str(exc))
    if "WeightsUnpickler error:" in text:
        refused = text.split("WeightsUnpickler error:", 1)[1].strip().split(". ", 1)[0].rstrip(".")
        return f"refused by the weights-only loader: {refused}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
