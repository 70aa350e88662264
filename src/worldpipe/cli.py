"""`worldpipe` command line: one sub-command group per concern, each registered by its own module."""

from __future__ import annotations

import argparse
import logging
import sys

from worldpipe.commands import bench, ckpt, data, rerun, run, sweep, tracking

GROUPS = (run, data, ckpt, tracking, rerun, bench, sweep)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (each command module adds its sub-commands)."""
    parser = argparse.ArgumentParser(prog="worldpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `worldpipe` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args, extra = build_parser().parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "accepts_overrides", False):
        args.overrides = list(getattr(args, "overrides", [])) + extra
    from worldpipe.checkpoint import CheckpointError

    try:
        return int(args.handler(args) or 0)
    except (CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
