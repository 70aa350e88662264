"""Batched imagination: a row's bits do not depend on its batch; prefixes continue exactly; state sizes."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_models import BatchCoupled, ElementwiseRecurrent, TinyKV
from worldpipe.models import build_model, state_nbytes
from worldpipe.models.rssm import RSSM
from worldpipe.rollout.demo import model_config
from worldpipe.rollout.engine import RolloutJob, Sampling, run_jobs
from worldpipe.rollout.padding import probe_batch_invariance
from worldpipe.rollout.registry import ServedModel
from worldpipe.rollout.streams import StreamId, fresh_stream, step_noise


def served(model, version: str) -> ServedModel:
    model.eval()
    invariant = probe_batch_invariance(model, model.obs_dim, model.act_dim)
    return ServedModel(version, 1, model, model.obs_dim, model.act_dim, {}, batch_invariant=invariant)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    transformer = build_model({**model_config("transformer"), "width": 16, "heads": 2, "layers": 1}, 3, 1)
    return [served(RSSM(3, 1, embed=16, deter=16, stoch=4, hidden=32), "rssm-small"), served(TinyKV(3, 1), "kv"),
            served(transformer, "transformer"), served(ElementwiseRecurrent(3, 1), "elementwise"),
            served(BatchCoupled(3, 1), "coupled")]


def make_job(model: ServedModel, i: int) -> RolloutJob:
    g = torch.Generator().manual_seed(i)
    context, horizon = 1 + i % 4, 1 + (i * 7) % 11
    sampling = Sampling("mean") if i % 5 == 0 else Sampling("sample", 0.5 + (i % 3) * 0.5)
    stream = None if sampling.mode == "mean" else StreamId(i % 2, f"s{i}")
    return RolloutJob(model, torch.rand(horizon, 1, generator=g) * 2 - 1, sampling, stream,
                      torch.randn(context, 3, generator=g), torch.randn(context, 1, generator=g))


def fresh(job: RolloutJob) -> RolloutJob:
    return RolloutJob(job.served, job.actions, job.sampling, job.stream, job.context_obs, job.context_action)


def test_batch_composition_never_changes_a_result(models):
    # Whether the probe lets the RSSM, TinyKV and the transformer share batches depends on this machine's BLAS
    # (MKL on AVX-512 rounds odd and even rows of the RSSM decoder's 32x3 product differently): either way their
    # results must equal single runs. The element-wise model is batched on every machine, the coupled one never.
    by_name = {m.version: m for m in models}
    assert by_name["elementwise"].batch_invariant and not by_name["coupled"].batch_invariant
    jobs = [make_job(models[i % len(models)], i) for i in range(40)]
    alone = [run_jobs([fresh(job)])[0] for job in jobs]
    shuffle = random.Random(0)
    for size in (3, 9, 40):
        picked = shuffle.sample(range(len(jobs)), size)
        for i, result in zip(picked, run_jobs([fresh(jobs[i]) for i in picked]), strict=True):
            assert torch.equal(result.obs, alone[i].obs) and torch.equal(result.reward, alone[i].reward)
            for key, value in result.state.items():
                assert torch.equal(value, alone[i].state[key])


def test_prefix_then_continuation_equals_whole(models):
    for model in models:
        job = make_job(model, 1)
        whole = run_jobs([fresh(job)])[0]
        head = run_jobs([RolloutJob(model, job.actions[:4], job.sampling, job.stream, job.context_obs,
                                    job.context_action)])[0]
        tail = run_jobs([RolloutJob(model, job.actions[4:], job.sampling, job.stream, start=head.state,
                                    first_step=4)])[0]
        assert torch.equal(torch.cat([head.obs, tail.obs]), whole.obs)


def test_streams_are_reproducible_and_distinct():
    g = torch.Generator()
    a, b = StreamId(0, "a"), StreamId(0, "b")
    assert torch.equal(step_noise(a, 3, (4,), g), step_noise(a, 3, (4,), g))
    assert not torch.equal(step_noise(a, 3, (4,), g), step_noise(b, 3, (4,), g))
    assert not torch.equal(step_noise(a, 3, (4,), g), step_noise(a, 4, (4,), g))
    assert not torch.equal(step_noise(a, 0, (4,), g), step_noise(StreamId(1, "a"), 0, (4,), g))
    assert fresh_stream(0) != fresh_stream(0)


def test_kv_state_grows_with_horizon_and_recurrent_state_does_not(models):
    sizes = {}
    for model in models:
        job = make_job(model, 2)
        sizes[model.version] = [state_nbytes(run_jobs([RolloutJob(model, job.actions[:0].new_zeros(h, 1),
                                                                  Sampling("mean"), None, job.context_obs,
                                                                  job.context_action)])[0].state)
                                for h in (0, 1, 5)]
    assert sizes["rssm-small"][0] == sizes["rssm-small"][1] == sizes["rssm-small"][2]
    for name in ("kv", "transformer"):  # a KV cache: one more key/value per imagined step
        kv = sizes[name]
        assert kv[1] - kv[0] > 0 and kv[2] - kv[0] == 5 * (kv[1] - kv[0])
