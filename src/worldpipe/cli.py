"""`worldpipe` command line: one sub-command group per concern, each registered by its own module."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from worldpipe.commands import bench, ckpt, data, plan, rerun, run, runs, serve, sweep, tracking, train
from worldpipe.core.errors import DEBUG_ENV, report

GROUPS = (run, data, ckpt, tracking, rerun, runs, bench, serve, sweep, plan)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (each command module adds its sub-commands)."""
    parser = argparse.ArgumentParser(prog="worldpipe", description=__doc__)
    parser.add_argument("--debug", action="store_true",
                        help=f"show full tracebacks (same as {DEBUG_ENV}=1); errors are one line otherwise")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `worldpipe` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-sc"], ["--shell-completion"]):  # the Hydra completion script asks `worldpipe -sc ...`
        return _guarded(lambda: train.complete(argv, build_parser()._subparsers._group_actions[0].choices))  # noqa: SLF001
    debug = [a for a in argv[:2] if a == "--debug"]
    rest = [a for a in argv[:2] if a != "--debug"] + argv[2:]
    if rest[:1] == ["train"]:  # the Hydra app: every argument is Hydra's (its flags, overrides), not argparse's
        if debug or "--debug" in rest:
            os.environ[DEBUG_ENV] = "1"
        return _guarded(lambda: train.main([a for a in rest[1:] if a != "--debug"]))
    args, extra = build_parser().parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    if "--debug" in extra:  # also accepted after the sub-command (`worldpipe train --debug ...`)
        extra = [e for e in extra if e != "--debug"]
        args.debug = True
    if getattr(args, "accepts_overrides", False):
        args.overrides = list(getattr(args, "overrides", [])) + extra
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # inherited by torchrun's workers too
    return _guarded(lambda: args.handler(args))


def _guarded(handler) -> int:
    try:
        return int(handler() or 0)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - every error ends as one line (errors.report), never a traceback
        return report(err, getattr(err, "log_file", None))


if __name__ == "__main__":
    sys.exit(main())
