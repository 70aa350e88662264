"""Sub-command groups of the `worldpipe` CLI (click); each module exposes `register(cli)`.

Every `worldpipe` invocation builds the whole command tree, so these modules import the rooms they call inside
each handler: `worldpipe runs list` must not pay for torch, zarr or MLflow it never uses.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Callable

import click

# Commands whose trailing arguments are passed on (Hydra overrides, a benchmark's or mlflow's options).
PASS_ON = {"ignore_unknown_options": True, "allow_extra_args": False}


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


def pin_recorded_numerics(checkpoints: str) -> None:
    """Pin the numerics config recorded with the newest checkpoint under ``checkpoints`` in this process, so a
    portable run is evaluated or served on its own code paths (:mod:`worldpipe.core.numerics`)."""
    from worldpipe.checkpoint.layout import latest_identity
    from worldpipe.core import numerics

    numerics.pin(latest_identity(checkpoints).get("config", {}).get("numerics"))


def group(name: str, help_text: str) -> click.Group:
    """A command group of the CLI (its own help; a missing sub-command is a one-line usage error)."""
    return click.Group(name, help=f"{help_text[:1].upper()}{help_text[1:]}.", short_help=help_text)


def _short(help_text: str) -> str:
    """The one-line summary `worldpipe GROUP --help` lists: the help's first paragraph, as a phrase."""
    first = help_text.split("\n\n", 1)[0].rstrip(".")
    return first[:1].lower() + first[1:]
