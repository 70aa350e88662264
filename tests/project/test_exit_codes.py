"""Issue 51: one exit-code convention across every `worldpipe` command (docs/troubleshooting.md#exit-statuses).

Every command of the CLI tree, run as a real subprocess with input it must refuse, ends with exit status 2 and one
line on stderr that names the problem: no traceback, no "unexpected". The table holds one refusal per command, and
a test fails when a command is added to the CLI without one. Statuses 1 (a check that ran and failed) and 3
(equivalent on another numerics environment) are asserted where those verdicts are reached (the docs name the
tests).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import pytest

from worldpipe.cli import build_cli
from worldpipe.core.errors import EXIT_USAGE

pytestmark = [pytest.mark.adversarial, pytest.mark.integration]

# command path -> (arguments after it, with {tmp} for a fresh directory; words the one line must hold)
REFUSALS: dict[str, tuple[list[str], list[str]]] = {
    "train": (["experiment=nope"], ["config group 'experiment'", "no option 'nope'", "available:"]),
    "evaluate": (["{tmp}/none", "--store", "{tmp}/s", "--manifest", "{tmp}/m.json", "--out", "{tmp}/o.json"],
                 ["{tmp}/none", "no such directory"]),
    "control evaluate": (["{tmp}/none", "--out", "{tmp}/o.json"], ["{tmp}/none", "no such directory"]),
    "control yardstick": (["--env-id", "Bogus-v9", "--out", "{tmp}/o.json"],
                          ["--env-id Bogus-v9", "true simulator"]),
    "control references": (["--env-id", "Bogus-v9", "--behaviour-policy", "random", "--run-seed", "0", "--out",
                            "{tmp}/o.json"], ["--env-id Bogus-v9", "no such Gymnasium environment"]),
    "control rerun": (["{tmp}/none.json", "{tmp}"], ["{tmp}/none.json", "not a readable control evaluation record"]),
    "data init": (["--spec", "{{bad", "--store", "{tmp}/s"], ["--spec", "not a dataset spec"]),
    "data write": (["--spec", "{{}}", "--store", "{tmp}/s", "--shards", "0:1"], ["--spec", "not a dataset spec"]),
    "data seal": (["--store", "{tmp}/none", "--manifest", "{tmp}/m.json"], ["{tmp}/none"]),
    "data verify": (["{tmp}/none"], ["{tmp}/none"]),
    "data info": (["{tmp}/none"], ["{tmp}/none", "no trajectory store"]),
    "rounds summarize": (["--rounds-json", "{{bad", "--name", "n", "--id", "i", "--out", "{tmp}/o.json", "--plot",
                          "{tmp}/p.png", "--tracking-uri", ""], ["--rounds-json", "not JSON"]),
    "rounds time-to-quality": (["{tmp}/none.json", "--id", "i", "--out", "{tmp}/o.json", "--plot", "{tmp}/p.png",
                                "--tracking-uri", ""], ["{tmp}/none.json", "not a loop's summary"]),
    "ckpt list": (["{tmp}/none"], ["{tmp}/none", "no such directory"]),
    "ckpt verify": (["{tmp}"], ["{tmp}", "no checkpoints"]),
    "ckpt digest": (["{tmp}/none"], ["{tmp}/none", "no such directory"]),
    "tracking sync": (["{tmp}"], ["journal.jsonl", "does not exist"]),
    "tracking status": (["{tmp}/none"], ["journal.jsonl", "does not exist"]),
    "tracking server": (["--backend-store-uri", "bogus://x", "--print-command"], ["--backend-store-uri"]),
    "compare": (["--json", "--csv", "x"], ["--json and --csv"]),
    # An unknown run id: tests/reproduce/test_rerun_cli.py (MLflow's start-up is seconds)
    "rerun": (["0123abcd", "--rtol", "-1"], ["--rtol", "-1"]),
    "resume": (["0123abcd", "--step", "-1"], ["--step", "-1"]),
    "runs list": (["--runs-dir", "{tmp}/none"], ["{tmp}/none"]),
    "runs status": (["{tmp}"], ["no progress record", "{tmp}"]),
    "runs begin": (["{tmp}/none", "--dataset-spec-hash", "x", "experiment=nope"], ["no option 'nope'"]),
    "runs end": (["{tmp}/none", "--exit-code", "0"], ["{tmp}/none", "no run record"]),
    "serve": (["{tmp}/none"], ["{tmp}/none", "no such directory"]),
    "rollout": (["{tmp}/none", "--request", "{tmp}/r.json"], ["--request {tmp}/r.json", "cannot read"]),
    "sweep points": (["{tmp}/none.yaml"], ["{tmp}/none.yaml"]),
    "sweep open": (["--sweep-json", "{{bad", "--out", "{tmp}/o.json"],
                   ["--sweep-json", "not JSON"]),
    "sweep summarize": (["--parent", "{tmp}/none.json"], ["--parent {tmp}/none.json", "sweep open"]),
    "sweep link": (["--parent", "{tmp}/none.json", "--done", "{tmp}/d.json", "--point", "p", "--values-json", "{{}}"],
                   ["{tmp}/none.json"]),
    "plan": (["experiment=smoke"], ["world_size", "required"]),
    "bench": (["nope"], ["nope"]),
    "figures": (["--configfile", "{tmp}/none.yaml", "--out", "{tmp}/figures"],
                ["--configfile {tmp}/none.yaml: cannot read it"]),
}


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> set[str]:
    found = set()
    for name, command in group.commands.items():
        if isinstance(command, click.Group) and name != "bench":  # bench NAME: benchmarks, one refusal for all
            found |= _commands(command, (*prefix, name))
        else:
            found.add(" ".join((*prefix, name)))
    return found


def test_every_command_has_a_refusal_in_the_table():
    assert _commands(build_cli()) == set(REFUSALS)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a refusal prints on stderr (its exit status checked by the caller)."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "unexpected" not in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def refused(tmp_path_factory, env_with_venv) -> dict[str, tuple[subprocess.CompletedProcess, dict[str, str]]]:
    """Every refusal of the table, each in a fresh directory, four processes at a time (most of each is start-up)."""
    root = tmp_path_factory.mktemp("refusals")

    def run(command: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
        tmp = root / command.replace(" ", "-")
        tmp.mkdir()
        fill = {"tmp": str(tmp)}
        args = [a.format(**fill) for a in REFUSALS[command][0]]
        return subprocess.run(["worldpipe", *command.split(), *args], env=env_with_venv, cwd=tmp,
                              capture_output=True, text=True, timeout=300), fill

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(sorted(REFUSALS), pool.map(run, sorted(REFUSALS)), strict=True))


@pytest.mark.parametrize("command", sorted(REFUSALS))
def test_a_refusal_is_exit_2_and_one_line(command, refused):
    proc, fill = refused[command]
    line = one_error_line(proc)
    assert proc.returncode == EXIT_USAGE, (proc.returncode, line)
    assert all(needle.format(**fill) in line for needle in REFUSALS[command][1]), line


def test_control_rerun_of_a_record_without_a_step_is_bad_input(tmp_path, env_with_venv):
    record = tmp_path / "control.json"
    record.write_text(json.dumps({"contenders": {}}))
    proc = subprocess.run(["worldpipe", "control", "rerun", str(record), str(tmp_path)], env=env_with_venv,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE and "no checkpoint_step" in one_error_line(proc)


def test_the_convention_is_written_once_and_linked(repo: Path):
    docs = {path.name: path.read_text() for path in (repo / "docs").glob("*.md")}
    assert "## Exit statuses" in docs["troubleshooting.md"]
    for page in ("reproducibility.md", "numerics.md", "control.md"):
        assert "troubleshooting.md#exit-statuses" in docs[page], page


def test_a_step_or_window_that_is_not_there_is_bad_input(tmp_path, smoke_dataset, capsys):
    """In-process (the same code as the CLI): a RUN's step that does not exist, and context + horizon longer than
    every held-out episode, are refusals naming what to change, not a failed check or a bug."""
    from worldpipe.cli import main
    from worldpipe.rollout.demo import publish_demo_checkpoint

    publish_demo_checkpoint(tmp_path / "run" / "checkpoints", step=1)
    store, manifest = smoke_dataset
    for argv, needles in (
        *((["ckpt", command, str(tmp_path / "run"), "--step", "99"], ["no checkpoint step 99", "(steps: 1)"])
          for command in ("digest", "list", "verify")),
        (["evaluate", str(tmp_path / "run"), "--store", str(store), "--manifest", str(manifest), "--horizon", "1000",
          "--out", str(tmp_path / "o.json"), "--no-tracking"], ["1008 valid steps", "--context/--horizon"]),
    ):
        assert main(argv) == EXIT_USAGE, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "unexpected" not in lines[0] and all(n in lines[0] for n in needles), lines
    assert not (tmp_path / "o.json").exists()
