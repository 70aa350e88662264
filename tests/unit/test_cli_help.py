"""Every `worldpipe` command's own help (usage line, defaults shown), one-line usage errors, shell completion."""

from __future__ import annotations

import sys

import click
import pytest

from worldpipe.cli import build_cli, main

# Every command and group below `worldpipe` (train's --help is Hydra's, checked by the docs commands test).
COMMANDS = ["bench", "ckpt", "ckpt digest", "ckpt list", "ckpt verify", "compare", "data", "data info", "data init",
            "data seal", "data verify", "data write", "evaluate", "plan", "rerun", "resume", "rollout", "runs",
            "runs begin", "runs end", "runs list", "runs status", "serve", "sweep", "sweep link", "sweep open",
            "sweep points", "sweep summarize", "tracking", "tracking server", "tracking status", "tracking sync"]
# The commands with defaulted options (numbers, names): their help shows each default.
DEFAULTED = {"evaluate", "plan", "rerun", "runs status", "serve", "tracking server"}


def _tree(command: click.Command, path: tuple[str, ...] = ()) -> dict[str, click.Command]:
    found = {" ".join(path): command} if path else {}
    for name, sub in getattr(command, "commands", {}).items():
        found.update(_tree(sub, (*path, name)))
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


def test_bench_name_help_is_the_benchmarks_own(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the benchmark runs in this process with its own argv
    # Passed on to benchmarks/bench_startup.py (its argparse options), not the help of `worldpipe bench`.
    assert main(["bench", "startup", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: worldpipe bench startup ") and "--repeats" in out, out


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


def test_plumbing_the_rules_call_is_left_out_of_users_help(capsys):
    for group, hidden, shown in (("runs", ("begin", "end"), ("list", "status")), ("sweep", ("link", "open"),
                                                                                  ("points", "summarize"))):
        assert main([group, "--help"]) == 0
        listing = capsys.readouterr().out.split("Commands:")[1]
        names = {line.split()[0] for line in listing.splitlines() if line.strip()}
        assert not names & set(hidden) and set(shown) <= names, (group, names)
