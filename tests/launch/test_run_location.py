"""One name and one meaning for a checkpoint location: every command that reads checkpoints takes RUN (a run
directory, its checkpoints/ folder, or one step-NNNNNN folder), resolved by one function the same way."""

from __future__ import annotations

import json

import pytest

from worldpipe.checkpoint.layout import Location, resolve_location
from worldpipe.cli import main
from worldpipe.commands import RUN_HELP
from worldpipe.rollout.demo import publish_demo_checkpoint

# Every command that reads checkpoints (the others read none).
TAKE_RUN = [["ckpt", "list"], ["ckpt", "verify"], ["ckpt", "digest"], ["serve"], ["rollout"], ["evaluate"],
            ["control", "evaluate"], ["control", "rerun"]]
REQUEST = {"context": {"obs": [[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]], "action": [[0.5], [-0.5]]},
           "actions": [[1.0], [0.0]], "rng": {"seed": 3, "stream": "cli"}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    for step in (1, 2):
        publish_demo_checkpoint(run / "checkpoints", step=step, seed=step)
    return run


def forms(run) -> dict[str, str]:
    return {"run": str(run), "checkpoints": str(run / "checkpoints"), "step": str(run / "checkpoints/step-000001")}


def test_one_resolver_for_every_form(run):
    store = str(run / "checkpoints")
    assert resolve_location(run) == Location(store, None)
    assert resolve_location(f"{store}/") == Location(store, None)
    assert resolve_location(f"{store}/step-000001") == Location(store, 1)
    assert resolve_location(f"{store}/step-000001").path == f"{store}/step-000001"
    assert resolve_location("s3://bucket/run/checkpoints/step-000007") == Location("s3://bucket/run/checkpoints", 7)


@pytest.mark.parametrize("path", TAKE_RUN, ids=" ".join)
def test_every_checkpoint_command_names_it_run_with_one_help_text(path, capsys):
    assert main([*path, "--help"]) == 0
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert "RUN" in usage and "CHECKPOINT" not in out and "RUN_DIR" not in out, usage
    assert RUN_HELP in " ".join(out.split()), out


def test_digest_and_list_take_a_run_its_checkpoints_or_a_step(run, capsys):
    digests = {}
    for name, path in forms(run).items():
        assert main(["ckpt", "digest", path]) == 0
        digests[name] = capsys.readouterr().out.strip()
    assert digests["run"] == digests["checkpoints"] != digests["step"]  # newest loadable (2) vs the step named (1)
    assert main(["ckpt", "digest", str(run), "--step", "1"]) == 0
    assert capsys.readouterr().out.strip() == digests["step"]
    assert main(["ckpt", "list", forms(run)["step"]]) == 0
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["1"]
    assert main(["ckpt", "verify", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == ["step 1: ok", "step 2: ok"]


def test_rollout_and_serve_take_the_same_forms(run, tmp_path, capsys):
    from worldpipe.rollout.registry import ModelRegistry

    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST))
    results = {}
    for name, path in forms(run).items():
        assert main(["rollout", path, "--request", str(request)]) == 0, capsys.readouterr().err
        results[name] = {k: v for k, v in json.loads(capsys.readouterr().out).items() if k != "timing"}
    assert results["run"] == results["checkpoints"] and results["run"]["checkpoint_step"] == 2
    assert results["step"]["checkpoint_step"] == 1
    registry = ModelRegistry(run)  # what `worldpipe serve RUN` serves
    assert (registry.root, registry.fixed_step) == ((run / "checkpoints").resolve(), None)


@pytest.mark.parametrize(("argv", "message", "code"), [
    (["evaluate"], "error: worldpipe evaluate: missing RUN (a run directory, its checkpoints/ folder", 2),
    (["evaluate", "{run}", "--checkpoints", "{run}"], "error: worldpipe evaluate: give RUN once", 2),
    (["control", "evaluate", "{run}/nowhere"], "error: {run}/nowhere: no such directory (RUN: ", 2),
    (["ckpt", "digest", "{run}/checkpoints/step-000001", "--step", "2"],
     "error: worldpipe ckpt digest: RUN {run}/checkpoints/step-000001 is step 1, --step says 2", 2),
])
def test_a_wrong_run_is_one_line(argv, message, code, run, tmp_path, capsys):
    rest = {"evaluate": ["--store", "s", "--manifest", "m", "--out", str(tmp_path / "o.json")],
            "control": ["--env-id", "Pendulum-v1", "--behaviour-policy", "random", "--out", str(tmp_path / "o.json")],
            "ckpt": []}[argv[0]]
    assert main([a.format(run=run) for a in argv] + rest) == code
    err = capsys.readouterr().err
    assert err.startswith(message.format(run=run)) and err.count("\n") == 1, err
