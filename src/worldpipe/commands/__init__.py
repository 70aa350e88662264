"""Sub-command groups of the `worldpipe` CLI (click); each module exposes `register(cli)`.

Every `worldpipe` invocation builds the whole command tree, so these modules import the rooms they call inside
each handler: `worldpipe runs list` must not pay for torch, zarr or MLflow it never uses.
"""

from __future__ import annotations

import os
import sys
from argparse import Namespace
from collections.abc import Callable

import click

from worldpipe.core.errors import ERROR_PREFIX, EXIT_USAGE, report

# Commands whose trailing arguments are passed on (Hydra overrides, mlflow's options).
PASS_ON = {"ignore_unknown_options": True, "allow_extra_args": False}
# Every command's help shows its defaults; -h is --help, as it was under argparse.
CONTEXT = {"show_default": True, "help_option_names": ["-h", "--help"], "max_content_width": 100}


def handled(handler: Callable[[Namespace], int]) -> Callable[..., int]:
    """A click callback that hands its parameters to ``handler`` as one namespace (tuples as lists).

    ``--debug`` among passed-on arguments (``worldpipe plan --debug ...``) is worldpipe's, as after the command name.
    """
    def callback(**params) -> int:
        for name, value in params.items():
            if isinstance(value, tuple):
                params[name] = [v for v in value if v != "--debug"]
                if "--debug" in value:
                    from worldpipe.core.errors import DEBUG_ENV

                    os.environ[DEBUG_ENV] = "1"
        return handler(Namespace(**params))

    return callback


def overrides(metavar: str = "[OVERRIDES]...") -> click.Argument:
    """The trailing arguments of a command, any number (``key=value`` overrides, or options passed on)."""
    return click.Argument(["overrides"], nargs=-1, metavar=metavar, type=click.UNPROCESSED)


def command(name: str, handler: Callable[[Namespace], int], help_text: str, params: list[click.Parameter],
            *, pass_on: bool = False, short: str | None = None, plumbing: bool = False) -> click.Command:
    """A command whose ``handler`` gets the parsed ``params``; ``pass_on`` leaves unknown options to its
    trailing arguments (see :func:`overrides`). ``plumbing``: called by the pipeline's rules, not by people; left
    out of its group's help listing (its own ``--help`` still works)."""
    return click.Command(name, callback=handled(handler), params=params, help=help_text,
                         short_help=short or _short(help_text), hidden=plumbing,
                         context_settings=PASS_ON if pass_on else None)


# A checkpoint location: one name (RUN) and one meaning in every command that reads checkpoints
# (worldpipe.checkpoint.layout.resolve_location).
RUN_HELP = "a run directory, its checkpoints/ folder, or one step-NNNNNN folder in it"
RUN_TEXT = f"RUN: {RUN_HELP} (without a step: the newest loadable step, the one training would resume from)."


def run_argument(required: bool = True) -> click.Argument:
    """The RUN argument of a command that reads checkpoints (its help text: :data:`RUN_TEXT`)."""
    return click.Argument(["run"], metavar="RUN" if required else "[RUN]", required=required)


def checkpoints_option() -> click.Option:
    """``--checkpoints RUN``: RUN as an option, the spelling the pipeline's rules use (either one, not both)."""
    return click.Option(["--checkpoints"], metavar="RUN", help="the same as RUN (as the pipeline's rules give it)")


def locate(args: Namespace, step: int | None = None):
    """The checkpoint location a command was given (``RUN`` or ``--checkpoints RUN``) as a
    :class:`~worldpipe.checkpoint.layout.Location`; ``step``: a ``--step`` option, which a step folder named in
    RUN must agree with. A local location that does not exist is a one-line error (CheckpointNotFoundError)."""
    from worldpipe.checkpoint.layout import Location, resolve_location

    given = [v for v in (getattr(args, "run", None), getattr(args, "checkpoints", None)) if v]
    ctx = click.get_current_context(silent=True)
    if len(given) != 1:
        raise click.UsageError(f"give RUN once ({RUN_HELP}): as an argument or as --checkpoints RUN" if given
                               else f"missing RUN ({RUN_HELP})", ctx)
    where = resolve_location(given[0])
    if "://" not in where.root and not os.path.isdir(where.root):
        from worldpipe.checkpoint.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"{given[0]}: no such directory (RUN: {RUN_HELP})")
    if step is not None and where.step is not None and step != where.step:
        raise click.UsageError(f"RUN {given[0]} is step {where.step}, --step says {step}: give one of them", ctx)
    return Location(where.root, where.step if step is None else step)


def recorded_identity(where) -> dict:
    """The run identity recorded with the checkpoint at ``where`` (a resolved location: its step, else the
    newest; {} when there is none), read from its manifest without loading the state."""
    from worldpipe.checkpoint.layout import latest_identity, step_identity

    return latest_identity(where.root) if where.step is None else step_identity(where.root, where.step)


def pin_recorded_numerics(where) -> None:
    """Pin the numerics config recorded with the checkpoint at ``where`` (:func:`recorded_identity`) in this
    process, so a portable run is evaluated or served on its own code paths (:mod:`worldpipe.core.numerics`)."""
    from worldpipe.core import numerics

    numerics.pin(recorded_identity(where).get("config", {}).get("numerics"))


def group(name: str, help_text: str) -> click.Group:
    """A command group of the CLI (its own help; a missing sub-command is a one-line usage error)."""
    return click.Group(name, help=f"{help_text[:1].upper()}{help_text[1:]}.", short_help=help_text)


def _short(help_text: str) -> str:
    """The one-line summary `worldpipe GROUP --help` lists: the help's first paragraph, as a phrase."""
    first = help_text.split("\n\n", 1)[0].rstrip(".")
    return first[:1].lower() + first[1:]


def run_click(command: click.Command, argv: list[str], prog: str) -> int:
    """Run a click command (the whole tree, or one benchmark as a script); its usage errors end as one line
    (exit 2), its --help exits 0, and the handler's exit status comes back. Click's own refusals are mapped here;
    every other error's status is its class's (errors.classify, via :func:`guarded`): the one convention of
    :mod:`worldpipe.core.errors`."""
    try:
        # Not standalone: the handler's exit status comes back, and errors reach guarded / errors.report.
        return command.main(argv, prog_name=prog, standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as err:
        listed = err.ctx.command.list_commands(err.ctx) if isinstance(err.ctx.command, click.Group) else []
        print(f"{ERROR_PREFIX}{err.ctx.command_path}: missing command ({', '.join(sorted(listed))}); "
              f"see `{err.ctx.command_path} --help`", file=sys.stderr)
        return EXIT_USAGE
    except click.UsageError as err:
        where = f"{err.ctx.command_path}: " if err.ctx is not None else ""
        print(f"{ERROR_PREFIX}{where}{' '.join(err.format_message().split())}", file=sys.stderr)
        return EXIT_USAGE
    except click.exceptions.Exit as done:  # --help
        return done.exit_code


def guarded(handler: Callable[[], int | None]) -> int:
    """``handler()``'s exit status; any error it raises ends as one line (errors.report), never a traceback."""
    try:
        return int(handler() or 0)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - every error ends as one line (errors.report), never a traceback
        return report(err, getattr(err, "log_file", None))
