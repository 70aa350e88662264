"""A run that fails in its setup stops the threads setup started, so the process ends with the error's status.

The loader's prefetch thread is a daemon; left running past a refusal (here: a warm start from a run that never
finished), it can be inside torch's C++ when the interpreter ends, and the process then aborts (SIGABRT, "terminate
called without an active exception") instead of exiting with the one-line refusal's status 2.
"""

from __future__ import annotations

import threading

import pytest
import torch

from worldpipe.config.compose import compose_config
from worldpipe.config.identity import ConfigError
from worldpipe.parallel.runtime import Runtime
from worldpipe.trainer.trainer import Trainer


def loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("WindowLoader")]


def test_a_refusal_after_the_loader_started_leaves_no_prefetch_thread(tmp_path, smoke_dataset):
    store, manifest = smoke_dataset
    cfg = compose_config(["experiment=smoke", "parallel=single", f"run_dir={tmp_path / 'run'}", f"data.store={store}",
                          f"data.manifest={manifest}", "tracking.enabled=false", "data.prefetch=2",
                          f"paths.runs={tmp_path / 'runs'}", f"+init_from=smoke/{'0' * 64}"])
    assert not loader_threads()
    trainer = Trainer(cfg, Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    with pytest.raises(ConfigError, match="has not finished training"):
        trainer.fit()
    assert trainer.loader.prefetch == 2  # the loader was built (and its thread started) before the refusal
    assert not loader_threads()
