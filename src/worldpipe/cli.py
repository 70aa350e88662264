"""`worldpipe` command line: one sub-command group per concern, each registered by its own module."""

from __future__ import annotations

import logging
import os
import sys

import click

from worldpipe.commands import bench, ckpt, data, plan, rerun, run, runs, serve, sweep, tracking, train
from worldpipe.core.errors import DEBUG_ENV, ERROR_PREFIX, EXIT_USAGE, report
from worldpipe.core.process_exit import exit_process

# MLflow prints "View run NAME at: URL" whenever a run ends on a server; that URL opens the UI's GenAI layout.
# Every command prints its own links instead (worldpipe.tracking.links: the Model training view).
QUIET_MLFLOW_LINKS = ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
GROUPS = (run, data, ckpt, tracking, rerun, runs, bench, serve, sweep, plan)
PROG = "worldpipe"
# Every command's help shows its defaults; -h is --help, as it was under argparse.
CONTEXT = {"show_default": True, "help_option_names": ["-h", "--help"], "max_content_width": 100}


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
        return _guarded(lambda: train.complete(argv, build_cli().commands))
    debug = [a for a in argv[:2] if a == "--debug"]
    rest = [a for a in argv[:2] if a != "--debug"] + argv[2:]
    if rest[:1] == ["train"]:  # the Hydra app: every argument is Hydra's (its flags, overrides), not click's
        if debug or "--debug" in rest:
            os.environ[DEBUG_ENV] = "1"
        return _guarded(lambda: train.main([a for a in rest[1:] if a != "--debug"]))
    return _guarded(lambda: _click_main(argv))


def _click_main(argv: list[str]) -> int:
    """Run the click tree; its usage errors end as one line (exit 2), its --help and completion exit 0."""
    try:
        # Not standalone: the handler's exit status comes back, and errors reach _guarded / errors.report.
        return build_cli().main(argv, prog_name=PROG, standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as err:
        commands = ", ".join(sorted(getattr(err.ctx.command, "commands", {})))
        print(f"{ERROR_PREFIX}{err.ctx.command_path}: missing command ({commands}); "
              f"see `{err.ctx.command_path} --help`", file=sys.stderr)
        return EXIT_USAGE
    except click.UsageError as err:
        where = f"{err.ctx.command_path}: " if err.ctx is not None else ""
        print(f"{ERROR_PREFIX}{where}{' '.join(err.format_message().split())}", file=sys.stderr)
        return EXIT_USAGE
    except click.exceptions.Exit as done:  # --help
        return done.exit_code


def _guarded(handler) -> int:
    try:
        return int(handler() or 0)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - every error ends as one line (errors.report), never a traceback
        return report(err, getattr(err, "log_file", None))


def run() -> None:
    """The `worldpipe` console script: :func:`main`, then the interpreter's exit without its final collections
    over every object the command made (:mod:`worldpipe.core.process_exit`)."""
    try:
        status = main()
    except SystemExit as done:
        status = done.code
    exit_process(status)


if __name__ == "__main__":
    run()
