"""Entry point of a torchrun worker started by `worldpipe train`: tied to its launcher, then training.

    python -m worldpipe.launch.worker --config RUN_DIR/hydra/config.yaml   (under torchrun, by the launcher)

The lifeline is armed before anything heavy is imported (torch alone takes seconds): a worker whose launcher
dies while it starts up exits instead of training on as an orphan (see :mod:`worldpipe.launch.lifeline`). The
config is the launcher's record of the one it composed and validated (:func:`worldpipe.launch.local_run.
record_config`), loaded, not composed again. Rank 0, the rank that records, starts its run's tracking courier
before torch loads, as a one-process run's launcher does (:func:`worldpipe.launch.local_run.start_courier_early`).
"""

from __future__ import annotations

import os
import sys

from worldpipe.core.process_exit import exit_process
from worldpipe.launch.lifeline import bind_worker_to_launcher

USAGE = "usage: python -m worldpipe.launch.worker --config RUN_DIR/hydra/config.yaml"


def main(argv: list[str] | None = None) -> None:
    """Bind to the launcher, then train the recorded config (`worldpipe.trainer.main.train_recorded`)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].startswith("--config="):
        sys.exit(USAGE)
    bind_worker_to_launcher()
    config = args[0].removeprefix("--config=")
    if os.environ.get("RANK", "0") == "0":  # the rank that records: its courier starts before torch loads
        from omegaconf import OmegaConf

        # Imported after the lifeline is armed too (a fraction of a second of start-up), but before torch.
        from worldpipe.launch.local_run import start_courier_early

        start_courier_early(OmegaConf.load(config))
    # Imported only after the lifeline is armed: training brings torch (seconds of start-up).
    from worldpipe.trainer.main import train_recorded

    train_recorded(config)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as done:  # a failure already reported as one line (worldpipe.core.errors.run_worker_main)
        exit_process(done.code)
    exit_process(0)  # without the final collections over torch's objects (worldpipe.core.process_exit)
