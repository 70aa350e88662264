"""Entry point of a torchrun worker started by `worldpipe train`: tied to its launcher, then training.

The lifeline is armed before anything heavy is imported (torch alone takes seconds): a worker whose launcher
dies while it starts up exits instead of training on as an orphan (see :mod:`worldpipe.launch.lifeline`).
"""

from __future__ import annotations

from worldpipe.launch.lifeline import bind_worker_to_launcher


def main() -> None:
    """Bind to the launcher, then run the Hydra training entry point (`worldpipe.trainer.main.main`)."""
    bind_worker_to_launcher()
    # Imported only after the lifeline is armed: training brings torch (seconds of start-up).
    from worldpipe.trainer.main import main as train_main

    train_main()


if __name__ == "__main__":
    main()
