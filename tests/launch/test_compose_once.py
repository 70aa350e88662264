"""A `worldpipe train` composes its config once and validates it once, whichever way it starts: counted in the
start-up trace (``WORLDPIPE_STARTUP_TRACE``), where every composition (``config.compose.compose_config``) and every
validation (``trainer.validation.validate_config``) writes one event, in any process of the run."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

SMOKE = ["experiment=smoke", "parallel=single", "tracking.enabled=false", "trainer.progress_bar=false"]


def traced_train(cwd: Path, env: dict, *overrides: str, launcher: str | None = None) -> tuple[Counter, str, int]:
    """(events counted, stderr, exit status) of one real `worldpipe train` run in ``cwd``."""
    trace = cwd / f"trace-{len(list(cwd.glob('trace-*')))}.jsonl"
    env = {**env, "WORLDPIPE_STARTUP_TRACE": str(trace)}
    if launcher:
        env["WORLDPIPE_LAUNCHER"] = launcher
    proc = subprocess.run(["worldpipe", "train", *SMOKE, *overrides], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    events = Counter(json.loads(line)["event"] for line in trace.read_text().splitlines()) if trace.exists() else {}
    return Counter(events), proc.stderr, proc.returncode


def test_a_refused_start_composed_and_validated_once(tmp_path, env_with_venv):
    """Refused at the data check (after validation, before any process): one composition, one validation."""
    events, stderr, code = traced_train(tmp_path, env_with_venv, f"data.store={tmp_path}/none.zarr",
                                        f"data.manifest={tmp_path}/none.json")
    assert code != 0 and "no dataset manifest" in stderr, stderr[-2000:]
    assert (events["config_composed"], events["config_validated"]) == (1, 1), events


@pytest.mark.slow
def test_a_hand_run_composes_and_validates_once(tmp_path, smoke_dataset, env_with_venv):
    """A config-addressed hand run (addressing, a recorded attempt, training, closing line), its rerun when
    finished (nothing validated), and a run in an explicit run_dir under torchrun (its worker loads the record)."""
    store, manifest = smoke_dataset
    data = (f"data.store={store}", f"data.manifest={manifest}", "trainer.steps=2", "checkpoint.every=2")
    events, stderr, code = traced_train(tmp_path, env_with_venv, *data)
    assert code == 0, stderr[-3000:]
    assert (events["config_composed"], events["config_validated"]) == (1, 1), events
    assert events["first_step_done"] == 1

    events, stderr, code = traced_train(tmp_path, env_with_venv, *data)
    assert code == 0 and "finished already" in stderr, stderr[-3000:]
    assert (events["config_composed"], events["config_validated"]) == (1, 0), events

    events, stderr, code = traced_train(tmp_path, env_with_venv, *data, f"run_dir={tmp_path / 'run'}",
                                        launcher="torchrun")
    assert code == 0, stderr[-3000:]
    assert (events["config_composed"], events["config_validated"], events["torchrun_spawned"]) == (1, 1, 1), events
