"""Invalid layouts are refused before any process starts, and the message names the key."""

import subprocess

import pytest

from worldpipe.config.compose import compose_config
from worldpipe.config.identity import ConfigError
from worldpipe.trainer.validation import validate_config


def _cfg(*overrides):
    return compose_config(list(overrides))


@pytest.mark.parametrize(("overrides", "world", "key"), [
    (["experiment=smoke", "parallel=cp"], 2, "parallel.context_parallel"),            # RSSM: no time partition
    (["experiment=smoke_transformer", "parallel=tp", "parallel.tensor_parallel=4",
      "parallel.nproc_per_node=4"], 4, "parallel.tensor_parallel"),                    # 4 > 2 heads
    (["experiment=smoke_transformer", "parallel=dp_tp", "trainer.batch_size=9"], 3,
     "parallel.tensor_parallel"),                                                       # 2 does not divide 3
    (["experiment=smoke_ssm", "parallel=cp", "parallel.context_parallel=3", "parallel.nproc_per_node=3",
      "trainer.batch_size=9"], 3, "data.window"),                                      # 16 steps in 3 chunks
    (["experiment=smoke", "parallel=tp"], 2, "parallel.tensor_parallel"),             # RSSM: no plan
    (["experiment=smoke_transformer", "parallel=dp_cp", "parallel.strategy=none"], 4, "parallel.strategy"),
    # pipelines: the smoke transformer has 1 block (2 stages need 2); 8 windows are not 3 microbatches;
    # microbatches without a pipeline; a model without stage boundaries; fsdp2 over the stages' replicas
    (["experiment=smoke_transformer", "parallel=pp"], 2, "parallel.pipeline_parallel"),
    (["experiment=smoke_transformer", "parallel=pp", "model.layers=2", "parallel.microbatches=3"], 2,
     "parallel.microbatches"),
    (["experiment=smoke_transformer", "parallel=dp_pp", "model.layers=2", "parallel.microbatches=8"], 4,
     "parallel.microbatches"),                                                          # 4 per rank, not 8
    (["experiment=smoke_transformer", "parallel=ddp", "parallel.microbatches=2"], 2, "parallel.microbatches"),
    (["experiment=smoke_ssm", "parallel=pp"], 2, "parallel.pipeline_parallel"),
    (["experiment=smoke_transformer", "parallel=dp_pp", "model.layers=2", "parallel.strategy=fsdp2"], 4,
     "parallel.strategy"),
    (["experiment=smoke_transformer", "parallel=pp", "model.layers=2", "parallel.tensor_parallel=2",
      "parallel.nproc_per_node=4"], 4, "parallel.pipeline_parallel"),
    (["experiment=smoke_transformer", "parallel=dp_pp", "model.layers=2"], 2, "parallel.nproc_per_node"),
    # sequence parallelism: needs the tensor-parallel group, not with cp, a window of tp equal shards
    (["experiment=smoke_transformer", "parallel=ddp", "parallel.sequence_parallel=true"], 2,
     "parallel.sequence_parallel"),
    (["experiment=smoke_transformer", "parallel=tp_cp", "parallel.sequence_parallel=true"], 4,
     "parallel.sequence_parallel"),
    (["experiment=smoke_transformer", "parallel=tp_sp", "data.window=15", "data.stride=5"], 2, "data.window"),
    (["experiment=smoke", "parallel=ddp", "parallel.recompute=true"], 2, "parallel.recompute"),  # RSSM: no blocks
])
def test_invalid_layout_names_the_key(overrides, world, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}'"):
        validate_config(_cfg(*overrides), world)


@pytest.mark.parametrize("overrides", [
    ["experiment=smoke", "parallel=single"], ["experiment=smoke", "parallel=ddp"],
    ["experiment=smoke", "parallel=fsdp2"], ["experiment=smoke_transformer", "parallel=tp"],
    ["experiment=smoke_transformer", "parallel=cp"], ["experiment=smoke_ssm", "parallel=cp"],
    ["experiment=smoke_transformer", "parallel=dp_tp"], ["experiment=smoke_ssm", "parallel=dp_cp"],
    ["experiment=smoke_transformer", "parallel=tp_cp"],
    ["experiment=smoke_transformer", "parallel=pp", "model.layers=2"], ["experiment=smoke_transformer", "parallel=tp_sp"],
    ["experiment=smoke_transformer", "parallel=fsdp2", "parallel.recompute=true"],
    ["experiment=smoke_transformer", "parallel=dp_pp", "model.layers=2"],
])
def test_valid_layouts_pass(overrides):
    cfg = _cfg(*overrides)
    validate_config(cfg, int(cfg.parallel.nproc_per_node))


def test_cli_refuses_before_starting_processes(tmp_path, env_with_venv):
    proc = subprocess.run(["worldpipe", "train", "experiment=smoke", "parallel=cp", f"run_dir={tmp_path / 'run'}"],
                          env=env_with_venv, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "parallel.context_parallel" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory or any rank existed


def test_tensor_and_context_parallel_together_need_fsdp2():
    cfg = _cfg("experiment=smoke_transformer", "parallel=tp_cp", "parallel.strategy=ddp")
    with pytest.raises(ConfigError, match=r"config key 'parallel.strategy'.*tp×cp"):
        validate_config(cfg, 4)
    cfg = _cfg("experiment=smoke_ssm", "parallel=tp_cp")  # the linear SSM has no tensor-parallel plan
    with pytest.raises(ConfigError, match=r"config key 'parallel.tensor_parallel'"):
        validate_config(cfg, 4)
