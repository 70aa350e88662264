"""Checks run by every rank of a real gloo process group; each returns its findings as a dict.

The pytest side (test_dist_parallel.py) runs them on forked ranks (tests/forked_ranks.py) and asserts on the
dicts, so a failure shows the numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from worldpipe.checkpoint import shards
from worldpipe.checkpoint.sharded_saver import local_state_dicts
from worldpipe.data.loader import WindowLoader
from worldpipe.data.sampler import GlobalWindowSampler
from worldpipe.launch.preflight import compose_config
from worldpipe.models import build_model
from worldpipe.models.noise import sample_noise
from worldpipe.parallel.layout import build_layout
from worldpipe.parallel.ring_attention import RingStats, ring_attention
from worldpipe.parallel.runtime import init_runtime
from worldpipe.parallel.scan import linear_recurrence, sequential_scan
from worldpipe.parallel.wrap import unwrap
from worldpipe.trainer.trainer import Trainer


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def check_ring(chunk: int, block_size: int, seed: int) -> dict:
    """Ring attention of this rank's chunk vs the same rows of dense causal attention, forward and backward."""
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    seq = size * chunk
    q, k, v = (torch.randn(2, 3, seq, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    d_out = torch.randn(2, 3, seq, 4, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dense = F.scaled_dot_product_attention(*full, is_causal=True)
    (dense * d_out).sum().backward()
    rows = slice(rank * chunk, (rank + 1) * chunk)
    local = [t[..., rows, :].clone().requires_grad_(True) for t in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*local, block_size=block_size or None, stats=stats)
    (out * d_out[..., rows, :]).sum().backward()
    return {
        "out": _max_diff(out.detach(), dense.detach()[..., rows, :]),
        "dq": _max_diff(local[0].grad, full[0].grad[..., rows, :]),
        "dk": _max_diff(local[1].grad, full[1].grad[..., rows, :]),
        "dv": _max_diff(local[2].grad, full[2].grad[..., rows, :]),
        "blocks_computed": stats.blocks_computed, "blocks_skipped": stats.blocks_skipped,
        "bytes_sent_forward": stats.bytes_sent_forward, "bytes_sent_backward": stats.bytes_sent_backward,
        "kv_block_bytes": 2 * local[1].numel() * local[1].element_size(),
    }


def check_scan(lengths: list[int], seed: int) -> dict:
    """Cross-rank scan of this rank's chunk (chunks of unequal length) vs the sequential loop, with gradients."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    a = torch.rand(2, total, 3, generator=gen, dtype=torch.float64)
    b = torch.randn(2, total, 3, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, total, 3, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (a, b, h0)]
    ref = sequential_scan(full[0], full[1], full[2])
    (ref * weight).sum().backward()
    start = sum(lengths[:rank])
    rows = slice(start, start + lengths[rank])
    la, lb = a[:, rows].clone().requires_grad_(True), b[:, rows].clone().requires_grad_(True)
    lh0 = h0.clone().requires_grad_(True)
    out = linear_recurrence(la, lb, lh0, group=dist.group.WORLD)
    (out * weight[:, rows]).sum().backward()
    # h0 is an input of every rank's chunk: its full gradient is the sum over ranks.
    dh0 = lh0.grad.clone()
    dist.all_reduce(dh0)
    return {"out": _max_diff(out.detach(), ref.detach()[:, rows]), "da": _max_diff(la.grad, full[0].grad[:, rows]),
            "db": _max_diff(lb.grad, full[1].grad[:, rows]), "dh0": _max_diff(dh0, full[2].grad)}


MODELS = {
    "transformer": {"_target_": "worldpipe.models.transformer.CausalTransformer", "width": 16, "heads": 4,
                    "layers": 2, "mlp_ratio": 2},
    "ssm": {"_target_": "worldpipe.models.ssm.LinearSSM", "width": 16, "state": 8, "layers": 2},
    "rssm": {"_target_": "worldpipe.models.rssm.RSSM", "embed": 8, "deter": 8, "stoch": 4, "hidden": 16},
    "pixel_rssm": {"_target_": "worldpipe.models.pixel_rssm.PixelRSSM", "image_size": 16, "depth": 4, "embed": 8,
                   "deter": 8, "stoch": 4, "classes": 4, "hidden": 16},
}
OBS_DIM, ACT_DIM = 3, 1
OBS_DIMS = {"pixel_rssm": 16 * 16 * 3}  # flat frames; every other model observes OBS_DIM-wide states


def synthetic_batch(batch: int, window: int, seed: int, noise_shape, obs_dim: int = OBS_DIM) -> dict:
    """Random windows whose valid lengths differ (some end early), as the loader pads them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(window // 2, window + 1, (batch,), generator=gen)
    mask = (torch.arange(window)[None, :] < lengths[:, None]).float()
    out = {"obs": torch.randn(batch, window, obs_dim, generator=gen) * mask[..., None],
           "action": torch.randn(batch, window, ACT_DIM, generator=gen) * mask[..., None],
           "reward": torch.randn(batch, window, generator=gen) * mask, "mask": mask,
           "noise": None if noise_shape is None else torch.randn(batch, *noise_shape, generator=gen)}
    out["global_valid"] = int(mask.sum())
    return out


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    return {name: full(p.grad).detach().clone() for name, p in unwrap(model).named_parameters()}


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in unwrap(model).named_parameters()}


def _diffs(a: dict, b: dict) -> float:
    return max(_max_diff(a[name], b[name]) for name in a)


def check_layout(model_name: str, strategy: str, tp: int, cp: int, batch_size: int, window: int,
                 micro: int, pp: int = 1, schedule: str = "gpipe", sp: bool = False) -> dict:
    """One training step of a layout vs the single-process reference on the same global batch.

    The layout's step runs ``micro`` micro-batches (gradients accumulated, each loss normalized by the valid
    steps of the whole global batch; a pipeline (``pp`` > 1) runs them inside its ``schedule``); the reference
    runs the whole batch at once.
    """
    runtime = init_runtime("gloo")
    torch.manual_seed(0)
    obs_dim = OBS_DIMS.get(model_name, OBS_DIM)
    reference = build_model(MODELS[model_name], obs_dim, ACT_DIM)
    torch.manual_seed(0)
    core = build_model(MODELS[model_name], obs_dim, ACT_DIM)
    batch = synthetic_batch(batch_size, window, 1, reference.noise_shape(window), obs_dim)
    keys = ("obs", "action", "reward", "mask", "noise")

    ref_sums = reference(*(batch[k] for k in keys))
    (ref_sums["total"] / batch["global_valid"]).backward()
    ref_grads = _full_grads(reference)
    torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1.0).step()  # eps: no sign() of tiny grads

    layout = build_layout({"strategy": strategy, "tensor_parallel": tp, "context_parallel": cp,
                           "pipeline_parallel": pp, "microbatches": micro, "pipeline_schedule": schedule,
                           "sequence_parallel": sp}, runtime)
    model = layout.wrap(core)
    accumulate = 1 if pp > 1 else micro  # a pipeline's microbatches are its schedule's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1.0, **layout.optimizer_kwargs)
    mine = {k: (v[GlobalWindowSampler.rank_slice(batch_size, layout.dp_rank, layout.dp_size)] if v is not None else None)
            for k, v in batch.items() if k in keys}
    total = torch.zeros(())
    rows = mine["obs"].shape[0]
    for index in range(accumulate):
        piece = {k: (v[index * rows // accumulate:(index + 1) * rows // accumulate] if v is not None else None)
                 for k, v in mine.items()}
        sums = layout.forward_backward(model, layout.shard_batch(piece), batch["global_valid"], core.loss_terms)
        total = total + sums["total"].detach()
    dist.all_reduce(total)
    grads = _full_grads(model)
    optimizer.step()
    return {
        "loss": float(total) * layout.metric_weight / batch["global_valid"],
        "ref_loss": float(ref_sums["total"].detach()) / batch["global_valid"],
        "grad_diff": _diffs(grads, ref_grads),
        "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
        "param_diff_after_step": _diffs(_full_params(model), _full_params(reference)),
        "layout": layout.describe, "dp_rank": layout.dp_rank, "rows": rows,
        # Sequence parallelism puts the norms' parameters on the tp mesh (plain tp leaves them whole; FSDP2
        # shards them over dp, which is not what is asked).
        "norms_on_mesh": any(isinstance(m.weight, DTensor) and "tp" in (m.weight.device_mesh.mesh_dim_names or ())
                             for m in core.modules() if isinstance(m, torch.nn.LayerNorm)),
    }


def check_layout_case(case: tuple) -> dict:
    """:func:`check_layout` of a case ``(model, strategy, tp, cp, batch, window, micro[, pp, schedule[, "sp"]])``."""
    model_name, strategy, tp, cp, batch, window, micro, *pipeline = case
    pp, schedule = (pipeline[0], pipeline[1]) if pipeline else (1, "gpipe")
    sp = len(pipeline) > 2 and pipeline[2] == "sp"
    return check_layout(model_name, strategy, tp, cp, batch, window, micro, pp, schedule, sp)


def check_trainer_step(store: str, manifest: str, run_dir: str) -> dict:
    """``Trainer.train_step`` on this rank's slice of an odd global batch (3 and 2 windows: unequal valid
    counts) against the definition computed on one process: the gradient of the loss summed over the whole
    global batch's valid steps, divided by their number. Clipping is off (a huge ``grad_clip``) so the
    gradients the step leaves behind are the ones compared.
    """
    cfg = compose_config(["experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
                          f"data.manifest={manifest}", "tracking.enabled=false", "trainer.batch_size=5",
                          "parallel.even_batches=false", "trainer.grad_clip=1e9", "data.prefetch=0"])
    trainer = Trainer(cfg, init_runtime("gloo"))
    trainer.setup()
    store_ = trainer.store
    reference = build_model(cfg.model, store_.obs_dim, store_.act_dim)
    reference.load_state_dict(trainer.core.state_dict())  # the trainer's initial parameters and statistics
    sampler = GlobalWindowSampler(store_.lengths, cfg.data.window, cfg.data.stride, cfg.trainer.batch_size, cfg.seed)
    whole = WindowLoader(store_, sampler, 0, 1, obs_stats=trainer.obs_stats, prefetch=0).next_batch()

    batch = trainer.loader.next_batch()
    _, grad_norm = trainer.train_step(batch)
    grads = {name: p.grad.detach().clone() for name, p in trainer.core.named_parameters()}

    noise = sample_noise(cfg.seed, whole["sample_index"], reference.noise_shape(whole["obs"].shape[1]),
                         torch.Generator())
    ref_sums = reference(whole["obs"], whole["action"], whole["reward"], whole["mask"], noise)
    (ref_sums["total"] / whole["global_valid"]).backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    ref_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads.values()])))
    return {"grad_diff": _diffs(grads, ref_grads), "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
            "grad_norm": float(grad_norm), "ref_grad_norm": ref_norm, "rows": int(batch["obs"].shape[0]),
            "local_valid": int(batch["mask"].sum()), "global_valid": batch["global_valid"],
            "whole_valid": whole["global_valid"], "sample_index": batch["sample_index"].tolist(),
            "whole_sample_index": whole["sample_index"].tolist()}


def check_shard_index(tp: int, cp: int, seed: int) -> dict:
    """Split a 4-rank tensor-parallel transformer's model and optimizer state (dp×tp, or cp×tp) into pieces as
    a sharded save does, and count how often each element of each logical tensor is covered (rank 0 checks
    against the full tensors).

    The modules tensor parallelism leaves whole live on a submesh (FSDP2 over "dp", or over the flattened
    dp×cp ranks): their pieces must not be written once per tp coordinate.
    """
    runtime = init_runtime("gloo")
    torch.manual_seed(seed)
    model = build_model(MODELS["transformer"], OBS_DIM, ACT_DIM)
    layout = build_layout({"strategy": "fsdp2", "tensor_parallel": tp, "context_parallel": cp}, runtime)
    model = layout.wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **layout.optimizer_kwargs)
    batch = synthetic_batch(4, 6, seed, model.noise_shape(6))
    mine = {k: batch[k] if batch[k] is None else batch[k][layout.dp_rank::layout.dp_size]
            for k in ("obs", "action", "reward", "mask", "noise")}
    (model(*layout.shard_batch(mine).values())["total"] / batch["global_valid"]).backward()
    optimizer.step()  # optimizer state (exp_avg, exp_avg_sq) is sharded like the parameters
    model_state, optim_state = local_state_dicts(model, optimizer)
    local = shards.split_state({"model": model_state, "optimizer": optim_state})
    leaves: list = []

    def collect(obj):
        if shards.is_dtensor(obj):
            leaves.append(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                collect(value)

    collect({"model": model_state, "optimizer": optim_state})  # the traversal order of split_state
    full = [leaf.full_tensor() for leaf in leaves]  # collective over each leaf's mesh
    on_submesh = sum(leaf.device_mesh._get_root_mesh() is not leaf.device_mesh for leaf in leaves)
    pieces = [None] * runtime.world_size
    dist.all_gather_object(pieces, (local.pieces, {k: v.clone() for k, v in local.local.items()}))
    result = {"tensors": len(local.tensors), "on_submesh": on_submesh,
              "pieces_per_rank": [len(p) for p, _ in pieces]}
    if runtime.rank == 0:
        index = shards.build_index(local.tensors, [p for p, _ in pieces])
        files = {shards.shard_file(r): tensors for r, (_, tensors) in enumerate(pieces)}
        counts_off, worst = 0, 0.0
        for entry, tensor in zip(index["tensors"], full, strict=True):
            count = torch.zeros(entry["shape"], dtype=torch.int64)
            for piece in entry["pieces"]:
                region = tuple(slice(o, o + s) for o, s in zip(piece["offset"], piece["shape"], strict=True))
                count[region] += 1
            counts_off += int((count != 1).sum())
            assembled = shards.read_region(entry, [0] * tensor.dim(), list(tensor.shape), files.__getitem__)
            worst = max(worst, _max_diff(assembled, tensor.detach()))
        result.update(elements_not_once=counts_off, value_diff=worst)
    return result
