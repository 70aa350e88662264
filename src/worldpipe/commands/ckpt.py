"""`worldpipe ckpt ...`: list, verify and digest the checkpoints of a run."""

from __future__ import annotations

import click

from worldpipe.commands import RUN_HELP, command, group, locate, run_argument


def register(cli: click.Group) -> None:
    ckpt = group("ckpt", "checkpoints")
    run = f"RUN: {RUN_HELP} (a step folder: that step only, as --step)."
    for name, handler, text in (
        ("list", _list, "steps, sizes, intact or not, which is latest"),
        ("verify", _verify, "each step loadable: sha256 of every file, paths, weights-only loads, shapes"),
        ("digest", _digest, "SHA-256 of the canonical state (layout- and rank-count-independent)"),
    ):
        params: list[click.Parameter] = [run_argument()]
        step = {"list": "only this step (default: every step)", "verify": "only this step (default: every step)",
                "digest": "this step (default: the newest loadable)"}[name]
        params.append(click.Option(["--step"], type=int, help=step))
        if name == "verify":
            params.append(click.Option(["--rng"], is_flag=True,
                                       help="also check the RNG files: one per rank, per-rank streams distinct"))
        ckpt.add_command(command(name, handler, f"{text[0].upper()}{text[1:]}.\n\n{run}", params, short=text))
    cli.add_command(ckpt)


def _list(args) -> int:
    from worldpipe.checkpoint import CheckpointManager
    from worldpipe.checkpoint.manager import require_step

    where = locate(args, args.step)
    manager = CheckpointManager(where.root)
    if where.step is not None:
        require_step(manager, where.step)
    infos = [i for i in manager.list() if where.step is None or i.step == where.step]
    for info in infos:
        state = "intact" if info.intact else f"BROKEN ({info.problem})"
        print(f"step {info.step:>8}  {info.size_bytes / 2**20:9.2f} MiB  {state}{'  <- latest' if info.is_latest else ''}")
    if not infos:
        print("no checkpoints")
    return 0


def _verify(args) -> int:
    from worldpipe.checkpoint import CheckpointManager
    from worldpipe.checkpoint.loadable import step_problems
    from worldpipe.checkpoint.manager import require_step

    root, only = locate(args, args.step)
    # sha256 of every file, every time: verify is the command that looks at every byte.
    manager = CheckpointManager(root, verify="sha256")
    if only is not None:
        require_step(manager, only)
    steps = [only] if only is not None else sorted(manager.store.step_names())
    if not steps:
        from worldpipe.checkpoint.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"{root}: no checkpoints (no step-NNNNNN directory)")
    failed = 0
    for step in steps:
        problems, _ = step_problems(manager, step)  # loadable: hashes, paths, weights-only loads, shapes
        if args.rng and not problems:
            from worldpipe.checkpoint.state import check_rng_files
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
    print(checkpoint_digest(*locate(args, args.step)))
    return 0
