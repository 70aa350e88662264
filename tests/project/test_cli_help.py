"""Every `worldpipe` command's own help (usage line, defaults shown), one-line usage errors, shell completion."""

from __future__ import annotations

import inspect
import sys

import click
import pytest

from worldpipe.cli import build_cli, main

# Every command and group below `worldpipe` (train's --help is Hydra's, checked by the docs commands test).
BENCHMARKS = ["bench activations", "bench checkpoint", "bench comm", "bench compile", "bench loader", "bench loop",
              "bench numerics", "bench pipeline", "bench plan", "bench rollout", "bench startup", "bench step"]
COMMANDS = ["bench", *BENCHMARKS, "ckpt", "ckpt digest", "ckpt list", "ckpt verify", "compare",
            "control", "control evaluate", "control references", "control rerun", "control yardstick", "data", "data info", "data init",
            "data seal", "data verify", "data write", "evaluate", "figures", "plan", "rerun", "resume", "rollout", "rounds",
            "rounds summarize", "rounds time-to-quality", "runs",
            "runs begin", "runs end", "runs list", "runs status", "serve", "sweep", "sweep link", "sweep open",
            "sweep points", "sweep summarize", "tracking", "tracking server", "tracking status", "tracking sync"]
# The commands with defaulted options (numbers, names): their help shows each default.
# Every benchmark has defaulted options: `worldpipe bench NAME --help` shows each default.
DEFAULTED = {"control evaluate", "control references", "control yardstick", "evaluate", "figures", "plan", "rerun", "rounds summarize",
             "runs status", "serve", "tracking server", *BENCHMARKS}


def _tree(command: click.Command, path: tuple[str, ...] = ()) -> dict[str, click.Command]:
    found = {" ".join(path): command} if path else {}
    if isinstance(command, click.Group):  # `bench` lists its benchmarks without importing them
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            found.update(_tree(command.get_command(ctx, name), (*path, name)))
    return found


def test_every_command_has_its_own_help_with_defaults(capsys):
    tree = _tree(build_cli())
    assert sorted(set(tree) - {"train"}) == COMMANDS
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("Usage: worldpipe [OPTIONS] COMMAND [ARGS]...")
    for path in COMMANDS:
        assert main([*path.split(), "--help"]) == 0, path
        out = capsys.readouterr().out
        assert out.startswith(f"Usage: worldpipe {path} "), (path, out[:200])
        assert ("[default: " in out) == (path in DEFAULTED), (path, out)


def test_every_benchmark_is_a_click_command_with_its_defaults_in_help(capsys):
    """`worldpipe bench NAME --help` is the benchmark's own (a click command: usage, every option with its default
    value), with the option names and defaults the pipeline config passes (conf/pipeline/default.yaml)."""
    from worldpipe.commands.bench import BENCHMARKS, load

    for name in BENCHMARKS:
        assert main(["bench", name, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"Usage: worldpipe bench {name} [OPTIONS]\n"), out[:200]
        options = [p for p in load(name).params if isinstance(p, click.Option) and not p.hidden]
        for option in options:
            assert option.opts[0] in out, (name, option.opts)
            if option.default is not None and not option.is_flag:
                shown = option.show_default if isinstance(option.show_default, str) else option.default
                assert f"[default: {shown}" in " ".join(out.split()) or f"(default: {shown}" in out \
                    or f"[default: ({shown})]" in " ".join(out.split()), (name, option.opts, out)
        assert "python benchmarks/" not in out and "usage: " not in out, name
        # its help is the docstring's first paragraph; how to read the numbers stays in the script and the docs
        first, *rest = inspect.cleandoc(load(name).help).split("\n\n")
        assert " ".join(first.split()) in " ".join(out.split()), (name, first)
        assert not rest or rest[0].strip().splitlines()[0].strip() not in out, (name, rest[0][:80])


def test_a_benchmark_script_parses_as_its_command(monkeypatch, capsys):
    """`python benchmarks/bench_X.py` (torchrun starts the workers so) takes the same options and defaults."""
    from worldpipe.commands.bench import load

    args = load("loop").parse(["--steps", "7", "--no-compile"])
    assert (args.steps, args.no_compile, args.rounds, args.experiment) == (7, True, 3, "smoke")
    monkeypatch.setattr(sys, "argv", ["bench_loop.py", "--steps", "many"])
    with pytest.raises(SystemExit) as done:
        load("loop").script()
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: worldpipe bench loop: Invalid value for '--steps': 'many' is not a valid integer.\n"


@pytest.mark.parametrize("argv, message", [
    ([], "error: worldpipe: missing command (bench, ckpt, "),
    (["ckpt"], "error: worldpipe ckpt: missing command (digest, list, verify)"),
    (["data", "seal", "--manifest", "m.json"], "error: worldpipe data seal: Missing option '--store'"),
    (["serve", "ckpts", "--port", "eighty"], "error: worldpipe serve: Invalid value for '--port': 'eighty'"),
    (["ckpt", "list", "run", "--nosuch"], "error: worldpipe ckpt list: No such option '--nosuch'"),
    (["bench", "nosuch"], "error: worldpipe bench: Invalid value for 'NAME': 'nosuch' is not one of"),
])
def test_usage_errors_are_one_line_with_exit_2(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""


def _complete(monkeypatch, capsys, instruction: str, argv: list[str] | None = None, words: str = "") -> str:
    monkeypatch.setenv("_WORLDPIPE_COMPLETE", instruction)
    monkeypatch.setenv("COMP_WORDS", words)
    monkeypatch.setenv("COMP_CWORD", str(len(words.split()) - (0 if words.endswith(" ") else 1)))
    with pytest.raises(SystemExit) as done:
        main(argv or [])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_shell_completion_script_and_answers(monkeypatch, capsys):
    script = _complete(monkeypatch, capsys, "bash_source")
    assert "complete -o nosort -F _worldpipe_completion worldpipe" in script
    assert "plain,serve" in _complete(monkeypatch, capsys, "bash_complete", words="worldpipe se")
    options = _complete(monkeypatch, capsys, "bash_complete", words="worldpipe runs status --re")
    assert options.split() == ["plain,--recent"]
    # worldpipe train's arguments: Hydra's completion of config keys.
    keys = _complete(monkeypatch, capsys, "bash_complete", words="worldpipe train trainer.l")
    assert "plain,trainer.lr=" in keys.split()
    # A group's schema is what its options extend, never offered as one.
    options = _complete(monkeypatch, capsys, "bash_complete", words="worldpipe train numerics=").split()
    assert options == ["plain,numerics=native", "plain,numerics=portable"], options


def test_plumbing_the_rules_call_is_left_out_of_users_help(capsys):
    for group, hidden, shown in (("runs", ("begin", "end"), ("list", "status")), ("sweep", ("link", "open"),
                                                                                  ("points", "summarize"))):
        assert main([group, "--help"]) == 0
        listing = capsys.readouterr().out.split("Commands:")[1]
        names = {line.split()[0] for line in listing.splitlines() if line.strip()}
        assert not names & set(hidden) and set(shown) <= names, (group, names)
