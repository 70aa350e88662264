"""The SLURM decisions of `worldpipe train` (worldpipe.launch.slurm): the allocation read from scontrol's answer,
the training job step's srun command line, the nodes' rendezvous, and the refusals. tests/slurm runs them on a
real cluster; these pin each decision on scontrol output as a real controller prints it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worldpipe.launch import slurm

# `scontrol show job --oneliner 4242` of a two-node job with GPUs (slurm-wlm 23.11, trimmed in the middle).
JOB = ("JobId=4242 JobName=rule_train_model UserId=ci(1000) GroupId=ci(1000) MCS_label=N/A Priority=1 "
       "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
       "ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu[07-08] BatchHost=gpu07 NumNodes=2 NumCPUs=64 "
       "NumTasks=2 CPUs/Task=32 ReqB:S:C:T=0:0:*:* TRES=cpu=64,mem=128000M,node=2,gres/gpu=8 "
       "MinCPUsNode=32 Features=(null) TresPerNode=gres/gpu:4 Command=(null) WorkDir=/scratch/ci "
       "Comment=rule_train_model_wildcards_smoke")
NODE = ("NodeName=gpu07 Arch=x86_64 CoresPerSocket=16 CPUAlloc=32 CPUTot=64 NodeAddr=10.1.0.7 "
        "NodeHostName=gpu07 Version=23.11.4 OS=Linux State=MIXED")


def test_oneliner_fields_first_value_wins_and_similar_keys_stay_apart():
    fields = slurm.parse_oneliner(JOB + " NodeList=other")
    assert fields["NodeList"] == "gpu[07-08]"  # not ReqNodeList's, not the repeated one
    assert fields["ReqNodeList"] == "(null)"
    assert fields["TRES"] == "cpu=64,mem=128000M,node=2,gres/gpu=8"


def test_allocation_of_a_two_node_gpu_job():
    alloc = slurm.allocation("4242", slurm.parse_oneliner(JOB))
    assert alloc == slurm.Allocation("4242", nodes=2, cpus_per_task=32, gres="gpu:4", node_list="gpu[07-08]")


@pytest.mark.parametrize(("fields", "nodes", "cpus", "gres"), [
    ({"NumNodes": "1-2", "CPUs/Task": "N/A"}, 1, None, None),  # a pending range counts its minimum
    ({"NumNodes": "1", "CPUs/Task": "2", "TresPerNode": "gres:gpu:2"}, 1, 2, "gpu:2"),
    ({"NumNodes": "1", "TresPerNode": "gres/shard:2"}, 1, None, None),  # no GPUs: no --gres
])
def test_allocation_fields(fields, nodes, cpus, gres):
    alloc = slurm.allocation("7", fields)
    assert (alloc.nodes, alloc.cpus_per_task, alloc.gres) == (nodes, cpus, gres)


def test_allocation_without_a_node_count_is_refused():
    with pytest.raises(slurm.SlurmRefused, match="job 7: scontrol reports NumNodes=''"):
        slurm.allocation("7", {})


def test_training_step_command_line():
    alloc = slurm.allocation("4242", slurm.parse_oneliner(JOB))
    assert slurm.step_argv(2, alloc, ["python", "-m", "worldpipe.cli", "train", "a=1"]) == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=32",
        "--gres=gpu:4", "python", "-m", "worldpipe.cli", "train", "a=1"]
    bare = slurm.Allocation("5", 1, None, None, "wp1")
    assert slurm.step_argv(1, bare, ["x"]) == ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
                                                "--kill-on-bad-exit=1", "x"]


def test_rendezvous_at_the_first_nodes_address():
    addr = slurm.parse_oneliner(NODE)["NodeAddr"]
    assert slurm.rendezvous("4242", "gpu07", addr, {}) == ("10.1.0.7:24242", "slurm-4242")
    assert slurm.rendezvous("64242", "gpu07", None, {}) == ("gpu07:24242", "slurm-64242")  # port wraps
    assert slurm.rendezvous("4242", "gpu07", addr, {slurm.RDZV_PORT_ENV: "29400"})[0] == "10.1.0.7:29400"


def test_placement():
    assert slurm.placement({}) == slurm.WORKSTATION
    assert slurm.placement({"SLURM_JOB_ID": "3"}) == slurm.BATCH_STEP
    assert slurm.placement({"SLURM_JOB_ID": "3", "SLURM_STEP_ID": "0"}) == slurm.JOB_STEP


def test_refusals():
    step = {"SLURM_JOB_ID": "3", "SLURM_STEP_ID": "0"}
    with pytest.raises(slurm.SlurmRefused, match=r"parallel.nnodes=2 but already inside job step 3\.0"):
        slurm.check_nodes(slurm.JOB_STEP, 2, None, step)
    slurm.check_nodes(slurm.JOB_STEP, 2, None, step, rdzv_endpoint="gpu07:24242")  # a node of the step we started
    slurm.check_nodes(slurm.JOB_STEP, 1, None, step)
    alloc = slurm.Allocation("3", 1, 2, None, "wp1")
    with pytest.raises(slurm.SlurmRefused, match="parallel.nnodes=2 but job 3 has 1 node"):
        slurm.check_nodes(slurm.BATCH_STEP, 2, alloc, {})
    slurm.check_nodes(slurm.BATCH_STEP, 1, alloc, {})


def test_training_job_resources():
    merged = {"mem_mb": 2000, "runtime": 20, "gpus_per_node": 4, "preempt_signal_s": 60, "slurm_extra": "--qos=hi"}
    assert slurm.training_job_resources(merged, 2) == {
        "mem_mb": 2000, "runtime": 20, "nodes": 2, "tasks": 2, "mpi": "",
        "slurm_extra": "--ntasks-per-node=1 --signal=USR1@60 --gpus-per-node=4 --qos=hi"}
    assert slurm.training_job_resources({"mem_mb": 1, "preempt_signal_s": 0}, 1)["slurm_extra"] == \
        "--ntasks-per-node=1"


def test_multi_node_training_inside_a_job_step_is_one_line_and_writes_nothing(tmp_path, env_with_venv):
    # A plugin that wraps the rule in `srun -n1`: SLURM_STEP_ID is set, and two nodes cannot be had from there.
    env = {**env_with_venv, "SLURM_JOB_ID": "3", "SLURM_STEP_ID": "0"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "worldpipe.cli", "train", "experiment=smoke", "parallel.nnodes=2",
                           "parallel.nproc_per_node=1", f"run_dir={run_dir}",
                           # a dataset is named, so the node count is what is refused (not a missing dataset)
                           f"data.store={tmp_path}/store.zarr", f"data.manifest={tmp_path}/manifest.json"],
                          env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: parallel.nnodes=2 but already inside job step 3.0; run the rule in the batch step "
        "(train_model's mpi resource)"]
    assert not run_dir.exists()
