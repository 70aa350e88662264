"""The shared model-free contenders (`worldpipe control references`) are taken only by a run they were played for:
the same closed-loop settings and the same run seed (tests/control/test_control_cli.py: the record they make is the
full evaluation's, episode for episode)."""

from __future__ import annotations

import pytest

from worldpipe.control.dynamics import ControlError
from worldpipe.control.evaluation import ControlSettings, check_references, settings_record

SETTINGS = ControlSettings("Pendulum-v1", "noisy_controller", 20, 2, 5000, 8, {"_target_": "mppi", "samples": 16},
                           ceiling={"_target_": "mppi", "samples": 32})


def _references(settings: ControlSettings = SETTINGS, run_seed: int = 0) -> dict:
    return {"settings": settings_record(settings), "run_seed": run_seed, "contenders": {}}


def test_references_of_the_same_settings_and_seed_are_taken():
    check_references(_references(), SETTINGS, 0)


@pytest.mark.parametrize(("references", "run_seed", "named"), [
    (_references(run_seed=1), 0, "run seed 1, the run's seed is 0"),
    (_references(ControlSettings("Pendulum-v1", "noisy_controller", 20, 3, 5000, 8, SETTINGS.planner,
                                 ceiling=SETTINGS.ceiling)), 0, "episodes"),
    (_references(ControlSettings("Pendulum-v1", "noisy_controller", 20, 2, 5000, 8, SETTINGS.planner,
                                 ceiling={"_target_": "mppi", "samples": 64})), 0, "ceiling"),
    (_references(ControlSettings("Pendulum-v1", "random", 20, 2, 5000, 8, SETTINGS.planner,
                                 ceiling=SETTINGS.ceiling)), 0, "behaviour_policy"),
])
def test_references_of_other_settings_or_another_seed_are_refused_naming_what_differs(references, run_seed, named):
    with pytest.raises(ControlError, match=named):
        check_references(references, SETTINGS, run_seed)
