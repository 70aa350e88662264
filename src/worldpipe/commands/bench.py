"""`worldpipe bench NAME [options]`: run a benchmark from benchmarks/ (ratios against same-run baselines)."""

from __future__ import annotations

import runpy
import sys

from worldpipe.identity import PROJECT_ROOT

BENCHMARKS = {"loader": "bench_loader.py", "checkpoint": "bench_checkpoint.py", "comm": "bench_comm.py"}


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks; writes JSON under results/bench/")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.set_defaults(handler=_bench, accepts_overrides=True, overrides=[])


def _bench(args) -> int:
    script = PROJECT_ROOT / "benchmarks" / BENCHMARKS[args.name]
    sys.argv = [str(script), *args.overrides]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    return 0
