"""Exceptions raised by the checkpoint library."""

from __future__ import annotations

from worldpipe.core.errors import UserError


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
    """No (intact) checkpoint exists where one was requested."""
