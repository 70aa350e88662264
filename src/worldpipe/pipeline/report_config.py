"""Which pipeline config a report renders: the one the last successful Snakemake run used.

A report is made from the outputs of the DAG Snakemake plans, and that DAG comes from the config. Asking for
``snakemake --report`` after ``snakemake --configfile X`` would plan the default config's DAG, whose outputs do
not exist. So every successful run of the pipeline records its whole resolved config (the ``pipeline_config`` path of
conf/paths), and an invocation that only renders a report and names no config of its own renders that one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worldpipe.core.atomic import write_text_atomic
from worldpipe.core.errors import UsageError


class ReportConfigError(UsageError, ValueError):
    """The recorded config cannot be read; the message names the file."""


def record(config: dict[str, Any], path: str | Path) -> None:
    """Durably record the resolved pipeline config of a successful run (replacing the previous record).

    Keys keep their order (not canonical JSON): a sweep's grid order names its points and picks the plot's x axis.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(config, indent=1) + "\n")


def built_the_pipeline(targets: Sequence[str] | None) -> bool:
    """True when a run's targets were the pipeline's (none given: the default target `all`), not e.g. benchmarks.

    Only such a run's config is recorded: a bare report renders `all`, so its config must be one `all` ran with.
    """
    return not targets or "all" in targets


def renders_only_a_report(argv: Sequence[str]) -> bool:
    """True when a Snakemake command line renders a report without running jobs (no --report-after-run)."""
    flags = [arg.split("=", 1)[0] for arg in argv[1:]]
    return "--report" in flags and "--report-after-run" not in flags


def config_to_render(argv: Sequence[str], names_a_config: bool, path: str | Path) -> dict[str, Any] | None:
    """The recorded config when ``argv`` only renders a report and names no config (--configfile/--config).

    None means: use the config Snakemake loaded (a run, a command naming its config, or nothing recorded yet).
    """
    if names_a_config or not renders_only_a_report(argv) or not Path(path).is_file():
        return None
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ReportConfigError(f"{path}: cannot read the last run's pipeline config ({err}); "
                                "give the run's --configfile to the report") from None
    if not isinstance(config, dict):
        raise ReportConfigError(f"{path}: not a pipeline config (a JSON object); give the run's --configfile")
    return config
