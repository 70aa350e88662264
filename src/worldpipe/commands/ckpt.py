"""`worldpipe ckpt ...`: list, verify and digest the checkpoints of a run."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="checkpoints").add_subparsers(dest="ckpt_command", required=True)
    for name, handler, text in (
        ("list", _list, "steps, sizes, intact or not, which is latest"),
        ("verify", _verify, "full sha256 verification; non-zero exit on any problem"),
        ("digest", _digest, "SHA-256 of the canonical state (layout- and rank-count-independent)"),
    ):
        parser = ckpt.add_parser(name, help=text)
        parser.add_argument("run_dir", help="run directory (holding checkpoints/) or the checkpoints directory")
        if name != "list":
            parser.add_argument("--step", type=int)
        if name == "verify":
            parser.add_argument("--rng", action="store_true",
                                help="also check the RNG files: one per rank, per-rank streams distinct")
        parser.set_defaults(handler=handler)


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

    manager = CheckpointManager(_root(args.run_dir))
    steps = [args.step] if args.step is not None else [info.step for info in manager.list()]
    failed = 0
    for step in steps:
        problems = manager.verify(step, full=True)
        if args.rng and not problems:
            from worldpipe.checkpoint.rng_audit import check_rng_files
            from worldpipe.trainer.seeding import PER_RANK_STREAMS

            problems = check_rng_files(manager, step, PER_RANK_STREAMS)
        print(f"step {step}: {'ok' if not problems else 'FAILED'}")
        for problem in problems:
            print(f"  {problem}")
        failed += bool(problems)
    return 1 if failed or not steps else 0


def _digest(args) -> int:
    from worldpipe.checkpoint import checkpoint_digest

    print(checkpoint_digest(_root(args.run_dir), args.step))
    return 0
