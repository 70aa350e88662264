"""The numerics environment record, the portable mode's pins, and the compiled core's device guard."""

from __future__ import annotations

import math
import os

import pytest
import torch

from worldpipe.core import numerics
from worldpipe.models.rssm_filter import (
    CoreWeights,
    _FilterCore,
    _NativeFilterCore,
    chosen_core,
    filter_core,
    native_filter_core,
)
from worldpipe.tracking.history import largest_relative_difference
from worldpipe.tracking.records import NUMERICS_TAG, numerics_from_tags, numerics_tags

PORTABLE = {"mode": "portable", "mkl_cbwr": "COMPATIBLE", "aten_cpu_capability": "avx2", "onednn_max_cpu_isa": "AVX2"}


def test_environment_names_every_field_that_decides_cpu_bits():
    env = numerics.environment("cpu")
    for field in ("cpu.vendor", "cpu.model", "cpu.isa", "aten.cpu_capability", "blas", "mkl.cbwr",
                  "onednn.version", "onednn.max_cpu_isa", "torch.threads", "torch.deterministic", "device"):
        assert env[field], field
    assert env["aten.cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["torch.threads"] == str(torch.get_num_threads())
    assert all(isinstance(value, str) for value in env.values())


def test_differences_name_each_differing_field_and_skip_informational_ones():
    base = {"cpu.model": "A", "mkl.cbwr": "AUTO", "cpu.count": "2"}
    assert numerics.differences(base, dict(base)) == []
    assert numerics.differences(base, {**base, "cpu.count": "16"}) == []
    assert numerics.differences(base, {**base, "mkl.cbwr": "AVX2"}) == ["mkl.cbwr: recorded 'AUTO', here 'AVX2'"]
    assert numerics.differences(base, {**base, "cuda.device": "H200"}) == [
        "cuda.device: recorded '<unrecorded>', here 'H200'"]
    assert numerics.differences(None, base) == ["numerics environment: not recorded by the original run"]


def test_native_mode_pins_nothing_and_portable_mode_pins_every_variable(monkeypatch):
    for var in numerics.PIN_VARIABLES.values():
        monkeypatch.setenv(var, "recorded")  # so that monkeypatch restores what the test sets (or its absence)
        monkeypatch.delenv(var)
    assert numerics.pin({"mode": "native", "mkl_cbwr": None}) == []
    assert numerics.pin(PORTABLE) == ["MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"]
    assert os.environ["MKL_CBWR"] == "COMPATIBLE" and os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert numerics.pin(PORTABLE) == []  # already pinned: nothing changes


def test_a_process_without_the_pins_is_refused_with_one_line(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    with pytest.raises(numerics.NumericsError, match="MKL_CBWR is 'AVX2' in this process, the config pins "
                                                     "'COMPATIBLE'"):
        numerics.check_pinned(PORTABLE)
    numerics.check_pinned({"mode": "native"})  # nothing pinned: nothing to check


def test_tags_carry_the_environment_and_every_change_and_read_back():
    env = {"mkl.cbwr": "AUTO", "cpu.model": "AMD EPYC"}
    identity = {numerics.IDENTITY_KEY: env, numerics.CHANGES_KEY: [
        {"step": 10, "fields": ["mkl.cbwr: recorded 'AUTO', here 'AVX2'", "cpu.model: recorded 'A', here 'B'"]}]}
    tags = numerics_tags(identity)
    assert tags[f"{NUMERICS_TAG}.mkl.cbwr"] == "AUTO"
    assert tags[f"{NUMERICS_TAG}.changed"] == "step 10: mkl.cbwr, cpu.model"
    assert numerics_from_tags({**tags, "worldpipe.other": "x"}) == env


def test_largest_relative_difference_finds_the_worst_value_and_missing_steps():
    a = {"loss/total": [(5, 0, 1.0), (10, 0, 2.0)], "step_time_s": [(5, 0, 9.0)]}
    b = {"loss/total": [(5, 0, 1.0), (10, 0, 2.002)], "step_time_s": [(5, 0, 1.0)]}
    worst, step, key = largest_relative_difference(a, b)
    assert (step, key) == (10, "loss/total") and worst == pytest.approx(0.002 / 2.002)
    assert largest_relative_difference(a, a) == (0.0, None, None)
    assert largest_relative_difference(a, {"loss/total": [(5, 0, 1.0)]})[0] == math.inf


def _core_inputs(device: str):
    steps, batch, hidden, deter, stoch = 3, 2, 4, 5, 3
    t = lambda *shape: torch.randn(*shape, device=device) if device != "meta" else torch.empty(*shape, device="meta")  # noqa: E731
    weights = CoreWeights(t(hidden, stoch), t(3 * deter, hidden), t(3 * deter), t(3 * deter, deter), t(3 * deter),
                          t(hidden, deter), t(hidden, hidden), t(hidden), t(2 * stoch, hidden), t(2 * stoch))
    return t(steps - 1, batch, hidden), t(steps, batch, hidden), t(steps, batch, stoch), weights


def test_the_compiled_core_runs_on_cpu_tensors_only():
    """On another device (CUDA on a GPU machine; meta here) the reference is chosen and runs; the C++ core,
    handed such tensors directly, refuses them instead of reading device memory from the host."""
    act, embed, noise, weights = _core_inputs("meta")
    assert chosen_core(embed) is _FilterCore
    h, z, mean, std = filter_core(act, embed, noise, weights, 0.1)
    assert h.device.type == "meta" and h.shape == (3, 2, 5) and z.shape == (3, 2, 3)
    native = native_filter_core()
    if native is None:
        pytest.fail("the compiled filter core is not built here (make install builds it)")
    assert chosen_core(torch.zeros(1)) is _NativeFilterCore
    with pytest.raises(RuntimeError, match="runs on CPU tensors only"):
        native.filter_forward(act, embed, noise, list(weights.tensors()), 0.1)


def test_the_portable_optimizer_is_one_fused_kernel_and_replaces_the_layouts_foreach():
    """The unfused AdamW's sqrt runs MKL's vector math, which differed between an AMD and an Intel CPU on MKL's
    compatible path; the fused step computes exact square roots (docs/architecture.md, "Numerics identity")."""
    from worldpipe.trainer.optim import build_optimizer

    model = torch.nn.Linear(3, 2)
    trainer = {"lr": 1e-3, "weight_decay": 0.0}
    fused = build_optimizer(model, trainer, True, foreach=False)
    assert fused.param_groups[0]["fused"] is True and not fused.param_groups[0]["foreach"]
    plain = build_optimizer(model, trainer, False, foreach=False)
    assert not plain.param_groups[0]["fused"] and plain.param_groups[0]["foreach"] is False
