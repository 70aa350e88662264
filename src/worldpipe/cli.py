"""`worldpipe` command line: one sub-command group per concern, each registered by its own module."""

from __future__ import annotations

import logging
import os
import sys

import click

from worldpipe.commands import (
    CONTEXT,
    bench,
    ckpt,
    control,
    data,
    figures,
    guarded,
    plan,
    rerun,
    rounds,
    run,
    run_click,
    runs,
    serve,
    sweep,
    tracking,
    train,
)
from worldpipe.core.errors import DEBUG_ENV
from worldpipe.core.process_exit import exit_process

# MLflow prints "View run NAME at: URL" whenever a run ends on a server; that URL opens the UI's GenAI layout.
# Every command prints its own links instead (worldpipe.tracking.links: the Model training view).
QUIET_MLFLOW_LINKS = ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
GROUPS = (run, control, data, rounds, ckpt, tracking, rerun, runs, bench, serve, sweep, plan, figures)
PROG = "worldpipe"


def _set_debug(_ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        os.environ[DEBUG_ENV] = "1"  # inherited by torchrun's workers too
    return value


def build_cli() -> click.Group:
    """The whole command tree (each command module adds its commands)."""
    cli = click.Group(PROG, help=__doc__, context_settings=CONTEXT, params=[
        click.Option(["--debug"], is_flag=True, expose_value=False, callback=_set_debug,
                     help=f"show full tracebacks (same as {DEBUG_ENV}=1); errors are one line otherwise")])
    for group in GROUPS:
        group.register(cli)
    return cli


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `worldpipe` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault(*QUIET_MLFLOW_LINKS)  # inherited by torchrun's workers and every job they start
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-sc"], ["--shell-completion"]):  # the Hydra completion script asks `worldpipe -sc ...`
        return guarded(lambda: train.complete(argv, build_cli().commands))
    debug = [a for a in argv[:2] if a == "--debug"]
    rest = [a for a in argv[:2] if a != "--debug"] + argv[2:]
    if rest[:1] == ["train"]:  # the Hydra app: every argument is Hydra's (its flags, overrides), not click's
        if debug or "--debug" in rest:
            os.environ[DEBUG_ENV] = "1"
        return guarded(lambda: train.main([a for a in rest[1:] if a != "--debug"]))
    return guarded(lambda: _click_main(argv))


def _click_main(argv: list[str]) -> int:
    """Run the click tree; its usage errors end as one line (exit 2), its --help and completion exit 0."""
    return run_click(build_cli(), argv, PROG)


def run() -> None:
    """The `worldpipe` console script: :func:`main`, then the process ends without the interpreter's teardown
    of the modules it imported (:mod:`worldpipe.core.process_exit`; torch's alone is half a second)."""
    try:
        status = main()
    except SystemExit as done:
        status = done.code
    exit_process(status)


if __name__ == "__main__":
    run()
