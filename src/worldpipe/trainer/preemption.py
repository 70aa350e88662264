"""Preemption: SIGTERM/SIGUSR1 end a run at a step boundary, after a checkpoint, with a requeue exit code."""

from __future__ import annotations

import signal

# Exit status of a run that stopped on SIGTERM/SIGUSR1 after publishing a checkpoint (EX_TEMPFAIL):
# a scheduler or Snakemake retry should start it again, and it resumes.
EXIT_PREEMPTED = 75
PREEMPTED_RECORD = "PREEMPTED"


class PreemptionFlag:
    """Set by SIGTERM/SIGUSR1; the loop finishes its step, checkpoints and exits with EXIT_PREEMPTED."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal = signum

    @property
    def raised(self) -> bool:
        return self.signal is not None
