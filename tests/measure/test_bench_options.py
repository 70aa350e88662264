"""The pipeline config's `bench.NAME` settings become `worldpipe bench NAME` options, and the benchmark reads them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from worldpipe.commands.bench import BENCHMARKS, cli_options

REPO = Path(__file__).resolve().parents[2]


def test_keys_become_dashed_options_and_booleans_flags():
    assert cli_options({"max_mb": 64, "step_s": 0.5, "no_compile": True, "quiet": False}) == [
        "--max-mb", "64", "--step-s", "0.5", "--no-compile"]
    assert cli_options({}) == []


@pytest.mark.parametrize("name", ["comm", "checkpoint", "rollout", "startup", "loop", "plan"])
def test_every_default_setting_is_an_option_its_benchmark_parses(name, monkeypatch):
    """The documented defaults in conf/pipeline/default.yaml parse in the benchmark they configure."""
    settings = yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text())["bench"][name]
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / BENCHMARKS[name])
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    args = module.parse_args(cli_options(settings))
    for key, value in settings.items():
        assert getattr(args, key) == value, key
