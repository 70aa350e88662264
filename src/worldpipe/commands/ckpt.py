"""`worldpipe ckpt ...`: list, verify and digest the checkpoints of a run."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from worldpipe.commands import command, group


def register(cli: click.Group) -> None:
    ckpt = group("ckpt", "checkpoints")
    run_dir = "RUN_DIR: run directory (holding checkpoints/) or the checkpoints directory."
    for name, handler, text in (
        ("list", _list, "steps, sizes, intact or not, which is latest"),
        ("verify", _verify, "each step loadable: sha256 of every file, paths, weights-only loads, shapes"),
        ("digest", _digest, "SHA-256 of the canonical state (layout- and rank-count-independent)"),
    ):
        params: list[click.Parameter] = [click.Argument(["run_dir"])]
        if name != "list":
            step = "only this step (default: every step)" if name == "verify" else "this step (default: the latest loadable)"
            params.append(click.Option(["--step"], type=int, help=step))
        if name == "verify":
            params.append(click.Option(["--rng"], is_flag=True,
                                       help="also check the RNG files: one per rank, per-rank streams distinct"))
        ckpt.add_command(command(name, handler, f"{text[0].upper()}{text[1:]}.\n\n{run_dir}", params, short=text))
    cli.add_command(ckpt)


def _root(run_dir: str) -> str:
    """A run directory's checkpoint store, or the path itself when it is a store already."""
    from worldpipe.config.paths import checkpoints_dir

    store = checkpoints_dir(run_dir)
    return store if Path(store).is_dir() else run_dir


def _list(args) -> int:
    from worldpipe.checkpoint import CheckpointManager

    infos = CheckpointManager(_root(args.run_dir)).list()
    for info in infos:
        state = "intact" if info.intact else f"BROKEN ({info.problem})"
        print(f"step {info.step:>8}  {info.size_bytes / 2**20:9.2f} MiB  {state}{'  <- latest' if info.is_latest else ''}")
    if not infos:
        print("no checkpoints")
    return 0


def _verify(args) -> int:
    from worldpipe.checkpoint import CheckpointManager
    from worldpipe.checkpoint.loadable import step_problems

    root = _root(args.run_dir)
    if not Path(root).is_dir() and "://" not in root:
        print(f"error: {args.run_dir}: no such directory", file=sys.stderr)
        return 1
    # sha256 of every file, every time: verify is the command that looks at every byte.
    manager = CheckpointManager(root, verify="sha256")
    steps = [args.step] if args.step is not None else sorted(manager.store.step_names())
    if not steps:
        print(f"error: {root}: no checkpoints (no step-NNNNNN directory)", file=sys.stderr)
        return 1
    failed = 0
    for step in steps:
        problems, _ = step_problems(manager, step)  # loadable: hashes, paths, weights-only loads, shapes
        if args.rng and not problems:
            from worldpipe.checkpoint.rng_audit import check_rng_files
            from worldpipe.trainer.seeding import PER_RANK_STREAMS

            problems = check_rng_files(manager, step, PER_RANK_STREAMS)
        print(f"step {step}: {'ok' if not problems else 'FAILED'}")
        for problem in problems:
            print(f"  {problem}")
        failed += bool(problems)
    return 1 if failed else 0


def _digest(args) -> int:
    from worldpipe.checkpoint import checkpoint_digest

    # The step training would resume from: a newer step that would not load is skipped, with one line saying why.
    print(checkpoint_digest(_root(args.run_dir), args.step))
    return 0
