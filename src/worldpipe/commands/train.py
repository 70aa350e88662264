"""`worldpipe train`: the Hydra application that launches training (preflight, run lock, torchrun).

Plain overrides (``worldpipe train experiment=smoke trainer.lr=3e-4``) go straight to the launcher; Hydra's own
flags (``--cfg job``, ``--help``, ``--hydra-help``, ``--info``, ``-m``/``--multirun``, ``--shell-completion``)
run the same launch as a ``@hydra.main`` task, so they behave as in any Hydra app. A multirun (basic sweeper,
jobs one after the other on this machine) trains each job into its own directory below ``hydra.sweep.dir``
unless the overrides name a ``run_dir``.

Without ``data.store``/``data.manifest`` the dataset is found by spec, as the pipeline finds it
(:func:`worldpipe.pipeline.plan.locate_dataset`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

PROG = "worldpipe train"
# Hydra's flags (hydra._internal.utils.get_args_parser); anything else is an override.
HYDRA_FLAGS = frozenset({"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package",
                         "-p", "--run", "-r", "--multirun", "-m", "--shell-completion", "-sc", "--config-path",
                         "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun", "--info",
                         "-i"})
# conf/ directories that are not training config: the pipeline's configs (Snakemake's, not Hydra's).
NOT_TRAINING_GROUPS = frozenset({"pipeline"})
HELP_GROUPS_RESOLVER = "worldpipe_train_groups"
# A multi-node run started by hand: every node's `worldpipe train` joins this rendezvous.
RDZV_ENDPOINT_ENV, RDZV_ID_ENV = "WORLDPIPE_RDZV_ENDPOINT", "WORLDPIPE_RDZV_ID"


def own_options(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """worldpipe's own options of `worldpipe train` (pipeline and multi-node runs), and the rest (Hydra's)."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    parser.add_argument("--dataset-spec-hash", help="(pipeline) the run directory must be named by the hash of "
                        "this config and this dataset spec; the attempt and how it ended go into its run.json")
    parser.add_argument("--rdzv-endpoint", default=os.environ.get(RDZV_ENDPOINT_ENV) or None,
                        help=f"HOST:PORT of the nodes' c10d rendezvous (multi-node; default ${RDZV_ENDPOINT_ENV})")
    parser.add_argument("--rdzv-id", default=os.environ.get(RDZV_ID_ENV) or None,
                        help=f"id the nodes of one run share (default ${RDZV_ID_ENV}, else 'worldpipe')")
    parser.add_argument("--snakemake-rule", help="tag the MLflow run with the Snakemake rule that started it")
    parser.add_argument("--snakemake-job", help="tag the MLflow run with the Snakemake job (experiment, point)")
    options, rest = parser.parse_known_args(list(argv))
    return options, rest


def wants_hydra(argv: Sequence[str]) -> bool:
    """True when the command line holds one of Hydra's flags (not only overrides)."""
    return any(arg.split("=", 1)[0] in HYDRA_FLAGS for arg in argv)


def main(argv: Sequence[str]) -> int:
    """`worldpipe train ARGS`: launch the overrides, or run Hydra's app when a Hydra flag is given."""
    options, rest = own_options(argv)
    from worldpipe.tracking.records import JOB_ENV, RULE_ENV

    # Read by the trainer's tracking records, in this process and in its workers.
    for name, value in ((RULE_ENV, options.snakemake_rule), (JOB_ENV, options.snakemake_job)):
        if value:
            os.environ[name] = value
    if wants_hydra(rest):
        return _hydra_app(rest)
    return launch(rest, options)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def with_dataset(start) -> None:
    """Set data.store/data.manifest of ``start`` to the dataset found by spec, when neither is given."""
    from omegaconf import OmegaConf

    data = start.cfg.data
    missing = [key for key in ("store", "manifest") if OmegaConf.is_missing(data, key)]
    if not missing:
        return
    start.validate()  # a bad value is named before a missing dataset
    if len(missing) == 1:
        from worldpipe.core.errors import UsageError

        raise UsageError(f"config key 'data.{missing[0]}': missing; pass data.store and data.manifest together "
                         "(or neither: the dataset is then found by spec)")
    from worldpipe.config import paths
    from worldpipe.pipeline.plan import locate_dataset

    experiment = next((o.split("=", 1)[1] for o in start.overrides if _key(o) == "experiment" and "=" in o), None)
    dataset = locate_dataset(str(data.name), experiment)
    print(f"data: {dataset.dir} (dataset {dataset.name!r}, found by spec)", file=sys.stderr)
    start.set("data.store", f"{dataset.dir}/{paths.STORE_NAME}")
    start.set("data.manifest", f"{dataset.dir}/{paths.MANIFEST_NAME}")


def launch(overrides: list[str], options: argparse.Namespace | None = None) -> int:
    """Compose the config once, find the dataset if needed, preflight and train
    (:func:`worldpipe.launch.launcher.start_training`; with ``--dataset-spec-hash``, or addressed by its config, as
    an attempt recorded in the run's run.json), then one line naming the run directory and the MLflow run's page
    (in the UI's Model training view)."""
    from worldpipe.launch.launcher import compose_start, start_training

    options = options if options is not None else own_options([])[0]
    start = compose_start(overrides)  # the one composition: addressing, launch and closing line share it
    try:
        with_dataset(start)
        spec_hash = options.dataset_spec_hash
        if spec_hash is None and "run_dir" not in {_key(o) for o in overrides if "=" in o}:
            spec_hash, finished = config_addressed(start)
            if finished is not None:  # as Snakemake's "Nothing to be done": its results stay as they are
                print(_finished_line(*finished), file=sys.stderr)
                print(closing_line(start.cfg), flush=True)
                return 0
        if spec_hash is None:
            code = start_training(start, options.rdzv_endpoint, options.rdzv_id)
        else:
            code = _pipeline_attempt(start, options, spec_hash)
    finally:
        start.release()
    if code == 0:
        print(closing_line(start.cfg), flush=True)
    return code


def config_addressed(start) -> tuple[str | None, tuple[str, int, int] | None]:
    """Address a hand run as the pipeline addresses its runs: ``start``'s run_dir set to the folder of this
    resolved config and dataset spec (``results/runs/<experiment>/<run-hash>``); returns the dataset's spec hash,
    and (that folder, its final step, ``trainer.steps``) when it holds this config's run finished at or past its
    ``trainer.steps`` already (else None).

    So the same config resumes in its folder, a changed value trains into a new one, and ``<experiment>/latest``
    follows the newest. Where the manifest cannot be read, ``start`` stays as it is (spec hash None): the
    launcher's checks then name the problem in one line.
    """
    import json
    from pathlib import Path

    from worldpipe.config import paths
    from worldpipe.config.identity import config_hash
    from worldpipe.data.manifest import load_manifest
    from worldpipe.data.spec import spec_hash
    from worldpipe.pipeline.plan import run_hash

    cfg = start.cfg
    try:
        dataset = spec_hash(load_manifest(str(cfg.data.manifest))["spec"])
        address = paths.run_dir(str(cfg.experiment_name), run_hash(config_hash(cfg), dataset))
    except Exception:  # noqa: BLE001 - reported by name by the launcher's checks
        return None, None
    start.set("run_dir", str(address))
    try:
        done = json.loads((Path(address) / paths.COMPLETION_RECORD).read_text())
        final, target = int(done["final_step"]), int(cfg.trainer.steps)
        finished = (address, final, target) if final >= target else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        finished = None
    return dataset, finished


def _finished_line(address: str, final: int, target: int) -> str:
    """What a hand run of a config whose run has finished already is told (trainer.steps is resume-safe, so a
    smaller value addresses the same, longer run)."""
    if final == target:
        return (f"{address}: this config's run, finished already; nothing to train (a changed value trains a new "
                "run, a larger trainer.steps continues this one)")
    return (f"{address}: this config's run is at step {final}, past trainer.steps={target}; nothing to train, its "
            f"{final} steps stay (a shorter run is a new run: pass run_dir=DIR)")


def _pipeline_attempt(start, options: argparse.Namespace, spec_hash: str) -> int:
    """An attempt at a config-addressed run (a pipeline job's, or a hand run's): the run directory checked against
    the config's hash, begin and end recorded."""
    from worldpipe.core.errors import EXIT_FAILURE, classify
    from worldpipe.launch.launcher import start_training
    from worldpipe.pipeline.run_index import begin, end

    start.validate()  # a refused config records no attempt
    run_dir = start.cfg.run_dir
    record = begin(run_dir, spec_hash, start.overrides, start.cfg)
    print(f"run {record['experiment']}/{record['run_hash']}: attempt {len(record['attempts'])}", flush=True)
    code = EXIT_FAILURE
    try:
        code = start_training(start, options.rdzv_endpoint, options.rdzv_id)
    except Exception as err:
        code = classify(err) or EXIT_FAILURE
        raise
    finally:
        end(run_dir, code)
    return code


def closing_line(cfg) -> str:
    """`run directory: R; MLflow run: URL` for the finished run of ``cfg``."""
    import json
    from pathlib import Path

    from worldpipe.config import paths

    run_dir = Path(str(cfg.run_dir))
    try:
        record = json.loads((run_dir / paths.COMPLETION_RECORD).read_text())
    except FileNotFoundError:
        record = {}
    except (OSError, ValueError) as err:  # the run finished; only its name for the MLflow run is lost
        return f"run directory: {run_dir}; MLflow run: unknown ({paths.COMPLETION_RECORD} unreadable: {err})"
    run_id = record.get("mlflow_run_id")
    link = _run_link(cfg, run_id, record) if run_id else "none (tracking off)"
    return f"run directory: {run_dir}; MLflow run: {link}"


def _run_link(cfg, run_id: str, record: dict) -> str:
    """The run's page; its experiment from the completion record, else asked of MLflow (an older record)."""
    from worldpipe.tracking.links import MLFLOW_EXPERIMENT_KEY, run_url
    from worldpipe.tracking.recorder import resolve_tracking_uri

    uri = resolve_tracking_uri(cfg.tracking.uri)
    if record.get(MLFLOW_EXPERIMENT_KEY):  # no MLflow import, no request: seconds at the end of every run
        return run_url(uri, str(record[MLFLOW_EXPERIMENT_KEY]), run_id)
    from worldpipe.tracking.connection import client_for

    try:
        experiment_id = client_for(uri).get_run(run_id).info.experiment_id
    except Exception as err:  # noqa: BLE001 - an unreachable server still gets the run named
        return f"{run_id} (at {uri}; not reachable now: {type(err).__name__})"
    return run_url(uri, experiment_id, run_id)


def training_groups() -> str:
    """The training config groups and their options, one line each (what `worldpipe train --help` lists)."""
    from worldpipe.config.paths import CONF_DIR
    from worldpipe.config.schema import SCHEMA_NAME

    lines = []
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in NOT_TRAINING_GROUPS):
        options = sorted(f.stem for f in group.glob("*.yaml") if f.stem != SCHEMA_NAME)
        lines.append(f"{group.name}: {', '.join(options)}")
    return "\n".join(lines)


def _hydra_app(argv: list[str]) -> int:
    import hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from worldpipe.config.paths import CONF_DIR
    from worldpipe.config.schema import register_schemas
    from worldpipe.core.errors import report

    register_schemas()
    if not OmegaConf.has_resolver(HELP_GROUPS_RESOLVER):
        OmegaConf.register_new_resolver(HELP_GROUPS_RESOLVER, training_groups)
    codes: list[int] = []

    def task(_cfg) -> None:
        hydra_cfg = HydraConfig.get()
        overrides = list(hydra_cfg.overrides.task)
        if hydra_cfg.mode == RunMode.MULTIRUN and "run_dir" not in {_key(o) for o in overrides}:
            overrides.append(f"run_dir={hydra_cfg.runtime.output_dir}")  # one run directory per job
        hydra_state = GlobalHydra.instance().hydra  # the launcher composes with Hydra's compose API, which needs
        GlobalHydra.instance().clear()             # it uninitialized; the sweep needs it back for the next job
        try:
            codes.append(launch(overrides))
        except Exception as err:  # noqa: BLE001 - one line per failed job (errors.report); the sweep goes on
            codes.append(report(err, getattr(err, "log_file", None)))
        finally:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(hydra_state)

    # Hydra parses sys.argv; its help names the command, and its completion script the executable it binds to
    # (the script then calls `worldpipe -sc query=bash`, see worldpipe.cli).
    completion = any(a.split("=", 1)[0] in ("-sc", "--shell-completion") for a in argv)
    if not completion and not any(a in ("-m", "--multirun", "-h", "--help", "--hydra-help") for a in argv):
        from worldpipe.config.compose import compose_config

        # Hydra would print its own multi-line refusal (with its search path): the same one line as a launch.
        compose_config([a for a in argv if "=" in a and not a.startswith("-")])
    sys.argv = ["worldpipe" if completion else PROG, *argv]
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(task)()
    return max(codes, default=0)


def complete(argv: list[str], commands: Sequence[str]) -> int:
    """`worldpipe -sc query=bash`, as the completion script calls it: `worldpipe train`'s overrides (Hydra's
    completion of groups, options and keys), or the names of the ``commands``."""
    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    if len(words) >= 2 and words[1] == "train" and (len(words) > 2 or line.endswith(" ")):
        import contextlib
        import io

        from worldpipe.config.schema import SCHEMA_NAME

        os.environ["COMP_LINE"] = " ".join([words[0], *words[2:]]) + (" " if line.endswith(" ") else "")
        answer = io.StringIO()
        with contextlib.redirect_stdout(answer):
            code = _hydra_app(argv)
        # A group's schema is what its options extend, never an option (config.compose refuses it too).
        print(" ".join(w for w in answer.getvalue().split() if w.rpartition("=")[2] != SCHEMA_NAME))
        return code
    print(" ".join(sorted(commands)))
    return 0
