"""`worldpipe control evaluate` and `rerun` on a real trained checkpoint: a closed-loop evaluation in the real
Pendulum-v1 environment repeats bit for bit from its record, and a tampered record is caught."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

# A 10-step training and two closed loops: ~25 s quiet, so in the slow tier; the default tier holds the same
# promise in-process (tests/control/test_control_planners.py: the same stream gives the same actions).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Context 8: windows of 5 to 7 steps are where a server thread left on every core changed the last bits.
TINY = ["--episodes", "2", "--max-steps", "12", "--context", "8", "--set", "horizon=4", "--set", "samples=8",
        "--set", "iterations=2", "--ceiling-set", "samples=16", "--http-episodes", "1"]


def _worldpipe(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["worldpipe", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, smoke_dataset, env_with_venv):
    root = tmp_path_factory.mktemp("control")
    env = dict(env_with_venv, OMP_NUM_THREADS="1")
    store, manifest = smoke_dataset
    run_dir = root / "run"
    trained = _worldpipe(["train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
                          f"data.manifest={manifest}", "tracking=none", "parallel.nproc_per_node=1",
                          "trainer.steps=10", "trainer.progress_bar=false"], env, root)
    assert trained.returncode == 0, trained.stderr[-3000:]
    checkpoints = str(run_dir / "checkpoints")
    proc = _worldpipe(["control", "evaluate", "--checkpoints", checkpoints, "--env-id", "Pendulum-v1",
                       "--behaviour-policy", "noisy_controller", *TINY, "--out", str(root / "control.json"),
                       "--plot", str(root / "returns.png"), "--loop-plot", str(root / "loop.png"), "--no-tracking"],
                      env, root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {"root": root, "env": env, "checkpoints": checkpoints, "proc": proc,
            "record": json.loads((root / "control.json").read_text())}


def test_the_record_holds_every_contender_on_the_same_seeds_with_its_loop_split(evaluated):
    record = evaluated["record"]
    assert set(record["contenders"]) == {"random", "behaviour", "planner", "ceiling"}
    for contender in record["contenders"].values():
        assert len(contender["returns"]) == len(contender["actions_sha256"]) == 2
        low, high = contender["ci95"]
        assert low <= contender["mean"] <= high
        loop = contender["control_loop"]
        assert loop["steps"] == 24 and loop["period_ms"] == 50.0
        assert set(loop["parts"]) == {"capture", "prepare", "transport", "model", "output", "decision", "actuation"}
    assert record["contenders"]["random"]["score"] == 0.0 and record["contenders"]["ceiling"]["score"] == 1.0
    assert record["score"] == record["contenders"]["planner"]["score"] and record["ceiling_score"] == 1.0
    assert record["behaviour_score"] == record["contenders"]["behaviour"]["score"]
    assert record["settings"]["ceiling"]["samples"] == 16 and record["settings"]["ceiling"]["horizon"] == 4
    assert record["yardstick"]["ceiling_budget"] == {"samples": 16, "iterations": 2, "horizon": 4}
    assert record["yardstick"]["best_known"]["return"] == -150.0
    # Over HTTP: a latency probe of one episode that takes exactly the in-process planner's actions.
    probe = record["http_probe"]
    assert probe["episodes"] == 1 and probe["control_loop"]["steps"] == 12
    assert record["http_takes_the_in_process_actions"] is True, (probe["returns"], record["contenders"]["planner"])
    assert probe["control_loop"]["parts"]["transport"]["p50_ms"] > 0
    assert record["contenders"]["planner"]["control_loop"]["parts"]["model"]["p50_ms"] > 0
    assert record["settings"]["planner"]["_target_"].endswith("MPPI") and record["settings"]["planner"]["horizon"] == 4
    assert len(record["checkpoint_digest"]) == 64 and record["checkpoint_step"] == 10
    out = evaluated["proc"].stdout
    assert "planner decision p50" in out and "best known return of Pendulum-v1: -150" in out
    assert "over HTTP (a latency probe, 1 episode) the planner takes the in-process actions: True" in out
    assert (evaluated["root"] / "returns.png").stat().st_size > 0 and (evaluated["root"] / "loop.png").stat().st_size > 0


def test_a_rerun_from_the_record_is_bit_identical(evaluated):
    proc = _worldpipe(["control", "rerun", str(evaluated["root"] / "control.json"), "--checkpoints",
                       evaluated["checkpoints"], "--out", str(evaluated["root"] / "again.json")],
                      evaluated["env"], evaluated["root"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-identical" in proc.stdout
    again = json.loads((evaluated["root"] / "again.json").read_text())
    for name, contender in evaluated["record"]["contenders"].items():
        assert again["contenders"][name]["returns"] == contender["returns"]
        assert again["contenders"][name]["actions_sha256"] == contender["actions_sha256"]


def test_a_record_that_does_not_match_what_reruns_is_named(evaluated):
    from worldpipe.control.evaluation import record_differences

    record = json.loads(json.dumps(evaluated["record"]))
    assert record_differences(evaluated["record"], record) == []
    record["contenders"]["planner"]["actions_sha256"][1] = "0" * 64
    record["contenders"]["ceiling"]["returns"][0] += 1e-9
    record["checkpoint_digest"] = "f" * 64
    differences = record_differences(record, evaluated["record"])
    assert differences[0].startswith("checkpoint digest: recorded ffffffffffffffff")
    assert any(line.startswith("planner episode 1: actions differ") for line in differences)
    assert "ceiling: returns differ" in differences


def test_references_played_once_give_the_same_record(evaluated):
    """The model-free contenders from `control references` (the pipeline's shared job) make the record the full
    evaluation makes, episode for episode; references of another run seed are refused in one line."""
    root, env, checkpoints = evaluated["root"], evaluated["env"], evaluated["checkpoints"]
    settings = ["--env-id", "Pendulum-v1", "--behaviour-policy", "noisy_controller", *TINY]
    for seed in (0, 1):
        made = _worldpipe(["control", "references", *settings, "--run-seed", str(seed), "--out",
                           str(root / f"references-{seed}.json")], env, root)
        assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    references = json.loads((root / "references-0.json").read_text())
    assert set(references["contenders"]) == {"random", "behaviour", "ceiling"}
    proc = _worldpipe(["control", "evaluate", "--checkpoints", checkpoints, *settings, "--references",
                       str(root / "references-0.json"), "--out", str(root / "with-references.json"), "--no-tracking"],
                      env, root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with_references, full = json.loads((root / "with-references.json").read_text()), evaluated["record"]
    for name, contender in full["contenders"].items():
        taken = with_references["contenders"][name]
        assert (taken["returns"], taken["actions_sha256"]) == (contender["returns"], contender["actions_sha256"]), name
        assert taken["score"] == contender["score"], name
    # the smoke run trains with seed 0: references for seed 1 are another run's
    refused = _worldpipe(["control", "evaluate", "--checkpoints", checkpoints, *settings, "--references",
                          str(root / "references-1.json"), "--out", str(root / "refused.json"), "--no-tracking"],
                         env, root)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert "references-1.json" in lines[0] and "run seed 1" in lines[0] and "seed is 0" in lines[0], lines[0]
    assert not (root / "refused.json").exists()
