"""`worldpipe bench NAME [options]`: run a benchmark from benchmarks/ (ratios against same-run baselines).

Each benchmark is a click command (:class:`Benchmark`) its script defines as ``COMMAND``: its options with their
defaults in ``--help``, its module docstring as the help text. ``worldpipe bench`` lists them without importing
them (their docstrings are read from the files); a script is imported only to run it or show its help. A script
run directly (``python benchmarks/bench_X.py``, as torchrun starts their workers) parses the same options.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import sys
from argparse import Namespace
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path

import click

from worldpipe.commands import CONTEXT, run_click
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.errors import DEBUG_ENV
from worldpipe.core.provenance import PROJECT_ROOT

BENCHMARKS = {"loader": "bench_loader.py", "checkpoint": "bench_checkpoint.py", "comm": "bench_comm.py",
              "rollout": "bench_rollout.py", "startup": "bench_startup.py", "loop": "bench_loop.py",
              "step": "bench_step.py", "compile": "bench_compile.py", "numerics": "bench_numerics.py",
              "pipeline": "bench_pipeline.py", "activations": "bench_activations.py", "plan": "bench_plan.py"}
BENCH_SCRIPTS = PROJECT_ROOT / "benchmarks"


def register(cli: click.Group) -> None:
    cli.add_command(_Benchmarks(
        "bench", help=f"Run a benchmark; it writes JSON and plots under {BENCH_DIR}/.\n\n`worldpipe bench NAME "
                      "--help` lists a benchmark's options and their defaults.",
        short_help=f"benchmarks; writes JSON and plots under {BENCH_DIR}/", subcommand_metavar="NAME [OPTIONS]..."))


def first_paragraph(doc: str) -> str:
    """The text of ``doc`` (a docstring) up to its first blank line."""
    return inspect.cleandoc(doc).split("\n\n", 1)[0].strip()


class Benchmark(click.Command):
    """One benchmark as a click command: ``params`` (shown with their defaults), the script's docstring as its
    help (its first paragraph, as written), ``body(args)`` run with the options as one namespace (declaration order).

    ``check(args)``: a problem with the options that no single option's type catches, as one line (or None).
    ``body`` may return an exit status (anything else is 0) or end with ``SystemExit("one line")`` (exit 1).
    """

    def __init__(self, name: str, doc: str, params: list[click.Parameter], body: Callable[[Namespace], object],
                 check: Callable[[Namespace], str | None] | None = None, prog: str | None = None) -> None:
        debug = click.Option(["--debug"], is_flag=True, expose_value=False, hidden=True, callback=_set_debug)
        super().__init__(name, params=[*params, debug], help=doc, context_settings=dict(CONTEXT))
        self.body, self.check, self.prog = body, check, prog or f"worldpipe bench {name}"

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # The docstring's first paragraph, as written; the rest (how to read the numbers) is for the script's
        # readers and docs/benchmarks.md.
        formatter.write_paragraph()
        with formatter.indentation():
            for line in first_paragraph(self.help or "").splitlines():
                formatter.write(f"{'':>{formatter.current_indent}}{line}\n")
        formatter.write_paragraph()
        with formatter.indentation():
            formatter.write_text("How to read its numbers: docs/benchmarks.md.")

    def namespace(self, ctx: click.Context) -> Namespace:
        """The parsed options of ``ctx`` as one namespace, checked (a problem is a usage error naming it)."""
        args = Namespace(**{p.name: ctx.params[p.name] for p in self.params if p.expose_value})
        problem = self.check(args) if self.check else None
        if problem:
            raise click.UsageError(problem, ctx)
        return args

    def parse(self, argv: list[str] | None = None) -> Namespace:
        """The options of ``argv`` (default: this process's arguments) as :meth:`namespace` gives them."""
        with self.make_context(self.prog, list(sys.argv[1:] if argv is None else argv)) as ctx:
            return self.namespace(ctx)

    def invoke(self, ctx: click.Context) -> int:
        args = self.namespace(ctx)
        try:
            status = self.body(args)
        except SystemExit as done:
            if isinstance(done.code, str):  # a benchmark's one-line error: say it (the CLI would not)
                print(done.code, file=sys.stderr)
                return 1
            return int(done.code or 0)
        return status if type(status) is int else 0

    def script(self) -> None:
        """Run as ``python benchmarks/bench_X.py [options]``: the same options and errors as `worldpipe bench`."""
        sys.exit(run_click(self, sys.argv[1:], self.prog))


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


def load(name: str) -> Benchmark:
    """The command of benchmark ``name`` (its script imported as module ``bench_<name>``, once)."""
    script = BENCH_SCRIPTS / BENCHMARKS[name]
    module = sys.modules.get(script.stem)
    if module is None or Path(getattr(module, "__file__", "")) != script:
        spec = importlib.util.spec_from_file_location(script.stem, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[script.stem] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return module.COMMAND


@cache
def _docstring(name: str) -> str:
    """A benchmark's docstring, read without importing its script (they import torch)."""
    tree = ast.parse((BENCH_SCRIPTS / BENCHMARKS[name]).read_text())
    return ast.get_docstring(tree) or ""


def _set_debug(_ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        os.environ[DEBUG_ENV] = "1"  # `worldpipe bench NAME ... --debug`, as after `worldpipe`
    return value


class _Listed(click.Command):
    """A benchmark as `worldpipe bench --help` and completion list it; its script is imported only when the
    command is parsed (run, or its own --help)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, help=_docstring(name))

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        return load(self.name).make_context(info_name, args, parent=parent, **extra)


class _Benchmarks(click.Group):
    """`worldpipe bench`: one sub-command per benchmark of BENCHMARKS."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(BENCHMARKS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return _Listed(cmd_name) if cmd_name in BENCHMARKS else None

    def resolve_command(self, ctx: click.Context, args: list[str]):
        if args and not args[0].startswith("-") and args[0] not in BENCHMARKS:
            raise click.BadParameter(f"{args[0]!r} is not one of {', '.join(sorted(BENCHMARKS))}", ctx,
                                     param_hint="'NAME'")
        return super().resolve_command(ctx, args)
