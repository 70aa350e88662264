"""`snakemake collect_benchmarks` with tiny settings, then `snakemake --report`: every benchmark's plot is in the report,
and what `bench comm` counts exactly (ring bytes, ZeRO memory) equals its closed form.

A real Snakemake run of every benchmark (comm, checkpoint, rollout, startup, loop, pipeline, activations, plan) on a copy of the project, the
report built as a zip and opened. Structure only: benchmarks measure speed, tests never assert on it.
"""

from __future__ import annotations

import json
import zipfile

import pytest

from pipeline_project import Project, planned_jobs
from worldpipe.config.compose import compose_config

# Seven benchmarks, each starting processes (torchrun ranks, servers, training runs): minutes on a busy 2-core box.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

BENCHMARK_RULES = ("run_benchmark", "measure_communication", "measure_plan")
ONE_THREAD_EACH = [f"{rule}=1" for rule in BENCHMARK_RULES]
PNG = b"\x89PNG\r\n\x1a\n"
TINY = {
    "comm": {"nproc": 2, "max_mb": 1, "rounds": 2, "repeat": 1},
    "checkpoint": {"mb": 1, "repeat": 1, "step_s": 0.05, "ranks": 2},
    "rollout": {"duration_s": 0.5, "loop_steps": 3},
    "startup": {"repeats": 1},
    "loop": {"steps": 6, "rounds": 1, "no_compile": True},
    "step": {"rounds": 1, "steps": 1, "mm_sizes": "128"},
    "compile": {"steps": 4, "window": 2},  # a 2-step unroll: its cold compile is the shortest there is
    "pipeline": {"nproc": 2, "repeat": 1},
    "activations": {"nproc": 2, "rounds": 1},
    "plan": {"nproc": "2", "layouts": "ddp,pp"},
}
# Every plot of the target, and a phrase of the caption that says how to read it.
PLOTS = {
    "comm_allreduce.png": "fitted to the points",
    "comm_ring_bytes.png": "counted at the send calls",
    "comm_bubble.png": "(P-1)/(M+P-1)",
    "comm_memory.png": "ZeRO per-parameter formulas",
    "checkpoint.png": "limit of the device, measured in the same rounds",
    "rollout.png": "the star is the knee",
    "startup.png": "a bare script plus 2 s",
    "loop.png": "where the loop wall time of each trainer run went",
    "step.png": "label: ms per step",
    "compile.png": "compiled run has caught up with eager",
    "pipeline.png": "the idle time communication does not explain",
    "activations.png": "every block keeps only its input for backward",
    "plan.png": "band is within 15%",
    "plan.html": "bytes exact",  # the predicted-vs-measured table, an HTML page of its own
}


def _ratio_fields(bench: dict) -> None:
    """Each JSON carries the ratios against its same-run baseline (values are the benchmark's business)."""
    comm = bench["comm"]
    assert {"alpha_s", "max_abs_fit_error"} <= set(comm["all_reduce_fit"])
    assert all("bytes_ratio_to_model" in row for row in comm["ring_attention"])
    assert set(comm["memory"]["measured_over_formula"]) == {"ddp", "fsdp2", "tp"}
    _comm_agrees_with_its_exact_models(comm)
    checkpoint = bench["checkpoint"]
    assert set(checkpoint["ratio_vs_raw"]) == {"ours_sync", "torch_save", "dcp"}
    for key in ("async_stall_over_sync", "async_overlap_stall_over_sync"):
        assert checkpoint[key] > 0
    assert set(checkpoint["sharded"]["ratio_vs_raw"]) == {"ours_sharded", "dcp"}
    assert checkpoint["sharded"]["ranks"] == 2 and checkpoint["sharded"]["async_stall_over_sync"] > 0
    assert "async_added_over_sync" in checkpoint and checkpoint["device_limit"]["limit_s"] > 0
    assert set(checkpoint["fraction_of_device_limit"]) == {"raw", "ours_sync", "torch_save", "dcp"}
    rollout = bench["rollout"]["summary"]
    assert {f"knee_throughput_ratio_vs_no_batching[{name}]" for name in bench["rollout"]["settings"]} <= set(rollout)
    assert bench["startup"]["torchrun_to_in_process_ratio"] > 0
    assert all("overhead_vs_bare_s" in c for c in bench["startup"]["contenders"].values())
    _startup_reports_each_contender_and_tracking_on_the_critical_path(bench["startup"])
    assert bench["loop"]["loop_ratio"] > 0 and bench["loop"]["steps"] == TINY["loop"]["steps"]
    assert "trainer, compiled" not in bench["loop"]["contenders"]  # no_compile: true reached the CLI
    assert "run_level_checkpoint_overhead" in bench["loop"] and "run_level_async_checkpoint_overhead" in bench["loop"]
    # The cadence conf/checkpoint ships (read from the composed config), not the smoke experiment's own.
    assert bench["loop"]["checkpoint_every"] == compose_config([]).checkpoint.every != 10
    pipeline = bench["pipeline"]["rows"]
    assert [r["microbatches"] for r in pipeline] == [1, 2, 4, 8]
    assert [r["idle_model"] for r in pipeline] == [1 / 2, 1 / 3, 1 / 5, 1 / 9]  # P = 2
    assert all(len(r["per_stage"]) == 2 and r["per_stage"][1]["transfers"] == 2 * r["microbatches"] for r in pipeline)
    activations = bench["activations"]
    assert set(activations["contenders"]) == {"tp", "tp_sp", "tp_sp + recompute", "ddp", "ddp + recompute"}
    # Counted, not timed: sequence shards and recomputation hold fewer bytes for backward on any machine.
    assert activations["ratios"]["tp_sp_over_tp_activations"] < 1
    assert activations["ratios"]["recompute_over_ddp_activations"] < 0.5
    plan = bench["plan"]["world_sizes"]["2"]
    assert set(plan["layouts"]) == {"ddp", "pp"} and "single" in plan["ruled_out"]
    assert all(row["comm_exact"] and all(row["comm_exact"].values()) for row in plan["layouts"].values())
    split = bench["loop"]["contenders"]["trainer + tracking + checkpoints"]["wall_split"]
    # The parts of the trainer's clock cover its loop: the kinds add up to the whole wall time.
    assert sum(split[k] for k in ("compute", "waiting_io", "waiting_ranks", "other")) == pytest.approx(1.0)
    step = bench["step"]
    assert step["fraction_of_peak"] > 0 and step["speedup_vs_per_step"] > 0
    compile_ = bench["compile"]
    assert set(compile_["contenders"]) == {"eager", "compiled, cold", "compiled, warm"}
    assert compile_["warm_over_cold_first_step"] > 0 and set(compile_["break_even_steps"]) == {"cold", "warm"}


STARTUP_CONTENDERS = {"bare script", "torchrun", "in-process", "in-process, resume", "in-process, tracking off"}


def _startup_reports_each_contender_and_tracking_on_the_critical_path(report: dict) -> None:
    # One round each; the MLflow run opened by the courier is an event after the first step, off the critical path.
    contenders = report["contenders"]
    assert set(contenders) == STARTUP_CONTENDERS
    assert len(report["machine"]["load_average"]) == 3
    for name, c in contenders.items():
        assert len(c["all_runs_s"]) == 1 and c["first_step_s"] == c["all_runs_s"][0], name
        # The breakdown's spans add up to the time to the first step of the run it describes.
        assert sum(c["breakdown_s"].values()) == pytest.approx(c["first_step_s"]), name
    assert contenders["in-process"]["mlflow_on_critical_path_s"] is not None
    assert "mlflow_run_opened" in contenders["in-process"]["courier_events_s"]
    assert "mlflow_run_opened" not in contenders["in-process, tracking off"]["courier_events_s"]
    assert report["tracking_on_critical_path_s"] == contenders["in-process"]["mlflow_on_critical_path_s"]
    assert report["tracking_off_saves_s"] == pytest.approx(
        contenders["in-process"]["first_step_s"] - contenders["in-process, tracking off"]["first_step_s"])


def _comm_agrees_with_its_exact_models(comm: dict) -> None:
    # Not speed: quantities the benchmark counts exactly, which must equal their closed forms on any machine.
    assert [r["bytes"] for r in comm["all_reduce"]] == [1024 * 2**k for k in range(11)]  # 1 KB .. 1 MB, x2
    assert all("fit_error" in r for r in comm["all_reduce"])
    # The fitted time of a size is the mean of its samples (what a run pays per call), one sample per round.
    rounds = TINY["comm"]["rounds"]
    assert all(len(r["samples_s"]) == rounds and r["seconds"] == pytest.approx(sum(r["samples_s"]) / rounds)
               for r in comm["all_reduce"])
    # Counted bytes are what the ring sends: exactly the model (N-1)·S·d_kv/N on every rank.
    assert all(r["bytes_sent"] == r["model_bytes"] for r in comm["ring_attention"])
    # Parameters, gradients and Adam state per rank follow the ZeRO formulas (FSDP2 pads uneven shards: 5%).
    for layout, ratios in comm["memory"]["measured_over_formula"].items():
        for category, ratio in ratios.items():
            assert abs(ratio - 1) <= 0.05, (layout, category, ratio)
    assert comm["memory"]["measured"]["fsdp2"]["parameters"] < comm["memory"]["measured"]["ddp"]["parameters"]
    bubble = comm["pipeline_bubble"]
    assert [r["idle_model"] for r in bubble] == sorted((r["idle_model"] for r in bubble), reverse=True)


@pytest.fixture(scope="module")
def benchmarked(repo, env_with_venv, tmp_path_factory):
    project = Project(repo, tmp_path_factory.mktemp("bench-report"), env_with_venv)
    project.write_config({"experiments": [], "bench": TINY})  # over conf/pipeline/default.yaml
    # A benchmark job takes every core so that no two time each other; this test checks structure, not speed,
    # so two run at once (most of their time is process start-up and waiting on peers).
    proc = project.snakemake("collect_benchmarks", "--set-threads", *ONE_THREAD_EACH, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return project


def test_every_benchmark_plot_is_in_the_report(benchmarked):
    project = benchmarked
    report = project.work / "report.zip"
    proc = project.snakemake("collect_benchmarks", "--report", str(report), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench_dir = project.work / "results" / "bench"
    with zipfile.ZipFile(report) as archive:
        names = archive.namelist()
        html = archive.read(next(n for n in names if n.endswith("report.html"))).decode()
        for plot, caption in PLOTS.items():
            entries = [n for n in names if n.endswith("/" + plot)]
            assert len(entries) == 1, (plot, [n for n in names if n.endswith(".png")])
            data = archive.read(entries[0])
            assert data == (bench_dir / plot).read_bytes() and (data[:8] == PNG or b"<table>" in data), plot
            assert caption in html, caption
    _ratio_fields({name: json.loads((bench_dir / f"{name}.json").read_text()) for name in TINY})


def test_changed_settings_rerun_that_benchmark_only(benchmarked):
    project = benchmarked
    proc = project.snakemake("collect_benchmarks", "-n", timeout=300)
    assert proc.returncode == 0 and "Nothing to be done" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    config = project.config()
    config["bench"]["checkpoint"]["repeat"] = 2
    project.write_config(config)
    proc = project.snakemake("collect_benchmarks", "-n", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert {rule for rule, _ in jobs} == {"run_benchmark", "collect_benchmarks"}, jobs
    assert "wildcards: name=checkpoint" in proc.stdout + proc.stderr
    assert proc.stdout.count("rule run_benchmark:") + proc.stderr.count("rule run_benchmark:") == 1


def test_a_bad_bench_setting_is_refused_naming_the_key(repo, env_with_venv, tmp_path):
    project = Project(repo, tmp_path, env_with_venv)
    project.write_config({"experiments": [], "bench": {**TINY, "loop": {**TINY["loop"], "steps": "many"}}})
    proc = project.snakemake("collect_benchmarks", "-n", timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2  # bad input (docs/troubleshooting.md#exit-statuses): one line naming the key path
    assert "bench.loop.steps: 'many' is not of type integer" in output and "Traceback" not in output, output[-3000:]
    assert not (project.work / "results").exists()


def test_benchmarks_stay_out_of_the_default_target(repo, env_with_venv, tmp_path):
    project = Project(repo, tmp_path, env_with_venv)
    project.write_config({"experiments": [], "bench": TINY})
    proc = project.snakemake("-n", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rules = {rule for rule, _ in planned_jobs(proc.stdout + proc.stderr)}
    benchmark_rules = {"measure_communication", "measure_plan", "run_benchmark", "collect_benchmarks"}
    assert not rules & benchmark_rules, rules
    proc = project.snakemake("collect_benchmarks", "-n", timeout=300)
    rules = {rule for rule, _ in planned_jobs(proc.stdout + proc.stderr)}
    assert rules == benchmark_rules, rules
