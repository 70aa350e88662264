"""Shared fixtures: the repository root, the venv's executables, small real datasets."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-skips", action="store_true",
                     help="a test that would skip fails instead: every tier selected must really run (make test)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under --no-skips a skip (a cluster, server or tool that could not be brought up) is a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.config.getoption("--no-skips") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under --no-skips (this tier must run here): {reason}"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def env_with_venv() -> dict[str, str]:
    """Environment whose PATH starts with this interpreter's bin (worldpipe, torchrun, snakemake)."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env["SDL_VIDEODRIVER"] = "dummy"
    return env


@pytest.fixture(scope="session")
def smoke_dataset(tmp_path_factory, env_with_venv) -> tuple[Path, Path]:
    """A real 24-episode Pendulum store + manifest, built once per session through the CLI."""
    from datasets import build_dataset

    return build_dataset(tmp_path_factory.mktemp("smoke_data"), env_with_venv)


@pytest.fixture(scope="session")
def smoke_runs(tmp_path_factory, smoke_dataset, env_with_venv):
    """Smoke trainings (tests/smoke_runs.py), each run once per session on first request and shared: read them,
    or copy one (``smoke_runs.copy``) to go on from it."""
    from smoke_runs import SmokeRuns

    return SmokeRuns(tmp_path_factory.mktemp("smoke_runs"), smoke_dataset, env_with_venv)


@pytest.fixture(scope="session")
def readme_pipelines(tmp_path_factory, env_with_venv) -> tuple[Path, dict[str, str]]:
    """A fresh copy of the project after the docs' smoke and sweep pipelines ran in it, exactly as the docs say
    (docs/getting-started.md, docs/sweeps.md).

    Run once per session: the pipeline tests read these results and the docs commands test then works on them.
    Readers must not change them; the one test that does asks for ``readme_pipelines_last_reader``.
    """
    from readme_support import project_env, run_readme_pipelines

    project, env = project_env(tmp_path_factory.mktemp("readme"), env_with_venv)
    run_readme_pipelines(project, env)
    return project, env


@pytest.fixture(scope="session")
def readme_pipelines_last_reader(readme_pipelines) -> tuple[Path, dict[str, str]]:
    """The shared docs pipelines' results for a test that changes them (ordered after every other reader)."""
    return readme_pipelines


# Under `pytest -n N --dist loadgroup` (make test) a group runs whole on one worker, in collection order. A
# module is a group, so its module-scoped fixtures (a pipeline, a server, a cluster) are built once; the SLURM
# tests share one cluster's system daemons, the modules that read the docs pipelines share one session
# fixture and those that start from the shared smoke runs another, so each of those is one group. The longest
# groups (by the durations `make test` prints) go first so that no worker idles at the end.
# xdist's own loadgroup reads `xdist_group` marks by rewriting node ids, which pytest 9 no longer allows; the
# scheduler below groups by node id instead (the controller has no items, only their ids).
FIRST_GROUPS = ("slurm", "readme", "smoke_runs", "tests/launch/test_run_identity.py",
                "tests/measure/test_bench_report.py", "tests/pipeline/test_default_pipeline.py",
                "tests/pipeline/test_from_scratch_pipeline.py", "tests/launch/test_interrupted_force.py")
SHARED_FIXTURES = {"readme_pipelines": "readme", "smoke_runs": "smoke_runs"}  # session fixture -> its group


@functools.cache
def _module_group(module: str) -> str:
    if module.startswith("tests/slurm/"):
        return "slurm"
    try:
        source = (REPO / module).read_text()
    except OSError:
        return module
    return next((group for fixture, group in SHARED_FIXTURES.items() if fixture in source), module)


def xdist_group(nodeid: str) -> str:
    """The group a test runs in under `--dist loadgroup`: its module's, or a shared one (slurm, readme,
    smoke_runs)."""
    return _module_group(nodeid.split("::", 1)[0])


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `--dist loadgroup`, schedule whole groups (see xdist_group) on one worker each."""
    if config.getvalue("dist") != "loadgroup":
        return None
    # Groups go out in collection order (the longest first, see pytest_collection_modifyitems), not by their
    # number of tests: the SLURM group has few tests and the longest wall time.
    config.option.loadscopereorder = False
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest groups first; the test that changes the docs pipelines' results after their readers."""
    rank = {group: index for index, group in enumerate(FIRST_GROUPS)}
    last = {item for item in items if "readme_pipelines_last_reader" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: (rank.get(xdist_group(item.nodeid), len(rank)), item in last))


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group (FSDP2 and DCP need one), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def moto_endpoint() -> str:
    """URL of a real S3-compatible server (moto's server mode) on 127.0.0.1, for s3fs-based tests."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] not installed")
    pytest.importorskip("s3fs", reason="s3fs not installed")
    try:
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    except OSError as exc:  # pragma: no cover - environment dependent
        pytest.skip(f"cannot start a moto S3 server on 127.0.0.1: {exc}")
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
