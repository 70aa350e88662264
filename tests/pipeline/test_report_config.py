"""A bare `snakemake --report` renders the config of the last successful pipeline run (worldpipe.pipeline.report_config)."""

import pytest

from worldpipe.pipeline.report_config import (
    ReportConfigError,
    built_the_pipeline,
    config_to_render,
    record,
)


def test_only_a_report_that_names_no_config_renders_the_recorded_one(tmp_path):
    path = tmp_path / "results/pipeline_config.json"
    config = {"experiments": ["smoke"], "train": {"overrides": []},
              "sweep": {"grid": {"trainer.lr": [1e-3], "model.stoch": [4]}}}  # grid order names the points
    record(config, path)
    report = ["snakemake", "--report", "results/report.html"]
    assert config_to_render(report, False, path) == config
    assert list(config_to_render(report, False, path)["sweep"]["grid"]) == ["trainer.lr", "model.stoch"]
    assert config_to_render(["snakemake", "--report=results/r.html"], False, path) == config
    assert config_to_render(report, True, path) is None  # --configfile/--config given: that one
    assert config_to_render(["snakemake", "--cores", "2"], False, path) is None  # a run: its own config
    assert config_to_render([*report, "--report-after-run"], False, path) is None  # a run, then its report
    assert config_to_render(report, False, tmp_path / "none.json") is None  # nothing recorded yet


def test_only_runs_of_the_pipeline_are_recorded():
    assert built_the_pipeline(set()) and built_the_pipeline(None) and built_the_pipeline({"all"})
    assert not built_the_pipeline({"collect_benchmarks"})


def test_an_unreadable_record_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "pipeline_config.json"
    path.write_text("{not json")
    with pytest.raises(ReportConfigError, match="pipeline_config.json: cannot read") as err:
        config_to_render(["snakemake", "--report", "r.html"], False, path)
    assert "\n" not in str(err.value)
