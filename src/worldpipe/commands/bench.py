"""`worldpipe bench NAME [options]`: run a benchmark from benchmarks/ (ratios against same-run baselines)."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Mapping

import click

from worldpipe.commands import PASS_ON, handled, overrides
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.provenance import PROJECT_ROOT

BENCHMARKS = {"loader": "bench_loader.py", "checkpoint": "bench_checkpoint.py", "comm": "bench_comm.py",
              "rollout": "bench_rollout.py", "startup": "bench_startup.py", "loop": "bench_loop.py",
              "step": "bench_step.py", "compile": "bench_compile.py", "numerics": "bench_numerics.py",
              "pipeline": "bench_pipeline.py", "activations": "bench_activations.py", "plan": "bench_plan.py"}


def register(cli: click.Group) -> None:
    # No help option of its own: `worldpipe bench NAME --help` is the benchmark's help (its options), passed on.
    cli.add_command(click.Command(
        "bench", callback=handled(_bench), params=[overrides("NAME [--help | the benchmark's options]")],
        help=f"Run a benchmark; it writes JSON and plots under {BENCH_DIR}/.\n\nNAME: one of "
             f"{', '.join(sorted(BENCHMARKS))}. `worldpipe bench NAME --help` lists its options.",
        options_metavar="", short_help=f"benchmarks; writes JSON and plots under {BENCH_DIR}/",
        context_settings={**PASS_ON, "help_option_names": []}))


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


def _bench(args) -> int:
    name, options = (args.overrides[0], args.overrides[1:]) if args.overrides else (None, [])
    if name is None or name in ("-h", "--help"):
        click.echo(click.get_current_context().get_help())
        return 0 if name else 2
    if name not in BENCHMARKS:
        raise click.BadParameter(f"{name!r} is not one of {', '.join(sorted(BENCHMARKS))}", param_hint="'NAME'")
    script = PROJECT_ROOT / "benchmarks" / BENCHMARKS[name]
    sys.argv = [str(script), *options]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        if isinstance(done.code, str):  # a benchmark's one-line error: say it (the CLI would not)
            print(done.code, file=sys.stderr)
            return 1
        return int(done.code or 0)
    return 0
