"""`worldpipe bench NAME [options]`: run a benchmark from benchmarks/ (ratios against same-run baselines)."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Mapping

from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.provenance import PROJECT_ROOT

BENCHMARKS = {"loader": "bench_loader.py", "checkpoint": "bench_checkpoint.py", "comm": "bench_comm.py",
              "rollout": "bench_rollout.py", "startup": "bench_startup.py", "loop": "bench_loop.py",
              "step": "bench_step.py", "compile": "bench_compile.py"}


def register(sub) -> None:
    # No help flag of its own: `worldpipe bench NAME --help` is the benchmark's help (its options), passed on.
    bench = sub.add_parser("bench", help=f"benchmarks; writes JSON and plots under {BENCH_DIR}/", add_help=False,
                           usage="worldpipe bench NAME [--help | the benchmark's options]")
    bench.add_argument("name", nargs="?", choices=sorted(BENCHMARKS),
                       help="the benchmark; `worldpipe bench NAME --help` lists its options")
    bench.set_defaults(handler=lambda args: _bench(args, bench), accepts_overrides=True, overrides=[])


def cli_options(settings: Mapping[str, object]) -> list[str]:
    """Command-line options of a benchmark from its settings (the pipeline config's `bench.NAME` section).

    A key is the option's name with underscores for dashes (``max_mb: 64`` -> ``--max-mb 64``); ``true`` is a
    bare flag and ``false`` leaves the flag out.
    """
    argv: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


def _bench(args, parser) -> int:
    if args.name is None:
        parser.print_help()
        return 0 if {"-h", "--help"} & set(args.overrides) else 2
    script = PROJECT_ROOT / "benchmarks" / BENCHMARKS[args.name]
    sys.argv = [str(script), *args.overrides]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        if isinstance(done.code, str):  # a benchmark's one-line error: say it (the CLI would not)
            print(done.code, file=sys.stderr)
            return 1
        return int(done.code or 0)
    return 0
