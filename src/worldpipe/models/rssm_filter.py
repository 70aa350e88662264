"""The RSSM's sequential core as one autograd function: the forward steps through time, the backward through time.

Of an RSSM training step only the recurrence is sequential: h_t = GRU(h_{t-1}, x_t) with
x_t = elu(W_z z_{t-1} + a_part_{t-1}), then the posterior head on (h_t, e_t) and the sample
z_t = mean_t + std_t * noise_t. Recorded op by op, each of T steps leaves ~30 small autograd nodes on B rows, and
the backward computes every weight gradient T times on B rows. Here the forward runs without recording, keeping
what the backward needs (inputs of each layer, gate values); the backward carries only the state gradients
(dh, dz) through time and computes each weight gradient once, as one matmul over all B*T rows.

On CPU torch has no fused GRU cell kernel (its ``gru_cell`` is a composite of the same element-wise ops), so
the gates are written out here (gate order r, u, n as in ``torch.nn.GRUCell``) and their values kept for the
backward. Tensors are time-major ([T, B, ...]): one step's slice is contiguous.

The loops here are the reference; what runs is their C++ version (:mod:`worldpipe.models.native`,
``filter_core.cpp``): the same arithmetic to the bit (its products call the BLAS routine ATen's matmuls call, its
element-wise loops compute what ATen's kernels compute), without the interpreter, dispatch and per-operator
set-up between ~45 small operators a step (on B = 16 rows that is most of the core's time). This Python runs only
where the extension cannot be built, and in the test that holds the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worldpipe.models.native import load_extension


@dataclass(frozen=True)
class CoreWeights:
    """Weights of the sequential core (views of the RSSM's parameters; the rest run batched outside)."""

    z_in: torch.Tensor    # [H, S]: the z block of cell_input's Linear
    w_ih: torch.Tensor    # [3D, H]
    b_ih: torch.Tensor    # [3D]
    w_hh: torch.Tensor    # [3D, D]
    b_hh: torch.Tensor    # [3D]
    h_in: torch.Tensor    # [H, D]: the h block of posterior_head's first Linear
    w2: torch.Tensor      # [H, H]
    b2: torch.Tensor      # [H]
    w3: torch.Tensor      # [2S, H]
    b3: torch.Tensor      # [2S]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The weights in field order."""
        return (self.z_in, self.w_ih, self.b_ih, self.w_hh, self.b_hh, self.h_in, self.w2, self.b2, self.w3, self.b3)


def filter_core(act_part: torch.Tensor, embed_part: torch.Tensor, noise: torch.Tensor, weights: CoreWeights,
                min_std: float, compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T,B,D], z, post mean, post std [T,B,S] of the recurrence (see the module docstring).

    act_part [T-1,B,H]: cell_input's action block applied to a_0..a_{T-2}, plus its bias; embed_part [T,B,H]:
    posterior_head's embedding block applied to e_0..e_{T-1}, plus its bias; noise [T,B,S]; h_0 = z_{-1} = 0.
    ``compiled=False`` runs the Python reference even where the extension is built (tests, benchmarks).
    """
    core = chosen_core(act_part, compiled)
    return core.apply(act_part, embed_part, noise, min_std, *weights.tensors())


def chosen_core(example: torch.Tensor, compiled: bool = True) -> type[torch.autograd.Function]:
    """The implementation that runs for tensors like ``example``: the compiled core only for CPU tensors (its C++
    reads tensor memory from the host), the reference elsewhere (CUDA, meta) and where the core is not built."""
    if compiled and example.device.type == "cpu" and native_filter_core() is not None:
        return _NativeFilterCore
    return _FilterCore


def native_filter_core():
    """The compiled core (``filter_core.cpp``), or None where it cannot be built."""
    return load_extension("filter_core")


class _NativeFilterCore(torch.autograd.Function):
    """:class:`_FilterCore` with both loops through time in the compiled extension (the same bits)."""

    @staticmethod
    def forward(ctx, act_part, embed_part, noise, min_std, *weights):
        h, z, mean, std, *saved = native_filter_core().filter_forward(act_part, embed_part, noise, list(weights),
                                                                      min_std)
        ctx.save_for_backward(noise, h, z, *saved, *weights)
        ctx.saved_count = len(saved)
        return h, z, mean, std

    @staticmethod
    def backward(ctx, g_h, g_z, g_mean, g_std):
        noise, h, z, *rest = ctx.saved_tensors
        saved, weights = rest[:ctx.saved_count], rest[ctx.saved_count:]
        d_act, d_embed, *d_weights = native_filter_core().filter_backward(g_h, g_z, g_mean, g_std, noise, h, z,
                                                                          saved, weights)
        return (d_act, d_embed, None, None, *d_weights)


# The element-wise backward kernels autograd itself uses: one op each, from the saved outputs.
_ATEN = torch.ops.aten


def _elu_back(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """grad * elu'(x), from y = elu(x)."""
    return _ATEN.elu_backward(grad, 1.0, 1.0, 1.0, True, out)


def _forward_step(t, h, z, parts, w: CoreWeights, wt: dict, min_std, saved):
    """One step of the recurrence (no graph); appends what the backward needs to ``saved``; returns (h, z, mean, std).

    ``parts``: this step's (action part or None, embedding part, noise); ``wt``: transposed weights.
    """
    deter = h.shape[1]
    act_part, embed_part, noise = parts
    if t > 0:  # in place where nothing else reads the input: no graph is recorded here
        x = F.elu_(torch.addmm(act_part, z, wt["z_in"]))
        gi = torch.addmm(w.b_ih, x, wt["w_ih"])
        gh = torch.addmm(w.b_hh, h, wt["w_hh"])
        ru = torch.add(gi[:, :2 * deter], gh[:, :2 * deter]).sigmoid_()
        r, u = ru[:, :deter], ru[:, deter:]
        gh_n = gh[:, 2 * deter:]
        n = torch.addcmul(gi[:, 2 * deter:], r, gh_n).tanh_()
        h = torch.addcmul(n, u, h - n)
        for key, value in (("x", x), ("ru", ru), ("n", n), ("gh_n", gh_n)):
            saved[key].append(value)
    a1 = F.elu_(torch.addmm(embed_part, h, wt["h_in"]))
    a2 = F.elu_(torch.addmm(w.b2, a1, wt["w2"]))
    mean, raw = torch.addmm(w.b3, a2, wt["w3"]).chunk(2, dim=-1)
    std = F.softplus(raw).add_(min_std)
    for key, value in (("a1", a1), ("a2", a2), ("raw", raw)):
        saved[key].append(value)
    return h, torch.addcmul(mean, std, noise), mean, std


_SAVED = ("x", "ru", "n", "gh_n", "a1", "a2", "raw")
_GRADS = ("stats", "p2", "p1", "gi", "gh", "c")


class _FilterCore(torch.autograd.Function):
    """Forward and backward through time of :func:`filter_core` (inputs: the parts, noise, min_std, weights)."""

    @staticmethod
    def forward(ctx, act_part, embed_part, noise, min_std, *weights):
        w = CoreWeights(*weights)
        wt = {k: getattr(w, k).t() for k in ("z_in", "w_ih", "w_hh", "h_in", "w2", "w3")}
        steps, batch = embed_part.shape[:2]
        h = embed_part.new_zeros(batch, w.w_hh.shape[1])
        z = embed_part.new_zeros(batch, w.z_in.shape[1])
        saved: dict[str, list[torch.Tensor]] = {k: [] for k in _SAVED}
        outs: list[tuple[torch.Tensor, ...]] = []
        for t, parts in enumerate(zip([None, *act_part.unbind(0)], embed_part.unbind(0), noise.unbind(0), strict=True)):
            h, z, mean, std = _forward_step(t, h, z, parts, w, wt, min_std, saved)
            outs.append((h, z, mean, std))
        result = tuple(torch.stack(column) for column in zip(*outs, strict=True))
        ctx.save_for_backward(noise, result[0], result[1], *weights)
        ctx.steps_saved = saved  # intermediates, per step (lists: the backward reads them one step at a time)
        return result

    @staticmethod
    def backward(ctx, g_h, g_z, g_mean, g_std):
        noise, h_all, z_all, *weights = ctx.saved_tensors
        w, s = CoreWeights(*weights), ctx.steps_saved
        h_steps = h_all.unbind(0)
        g_h, g_z, g_mean, g_std = ((torch.zeros_like(ref) if g is None else g).unbind(0)
                                   for g, ref in ((g_h, h_all), (g_z, noise), (g_mean, noise), (g_std, noise)))
        noise_steps = noise.unbind(0)
        grads: dict[str, list[torch.Tensor]] = {k: [] for k in _GRADS}
        dh, dz = torch.zeros_like(h_steps[0]), torch.zeros_like(noise_steps[0])
        for t in reversed(range(noise.shape[0])):
            step = (g_h[t], g_z[t] + dz, g_mean[t], g_std[t], noise_steps[t], s["raw"][t], s["a1"][t], s["a2"][t])
            dh = _head_backward(dh, *step, w, grads)
            if t > 0:
                k = t - 1
                dh, dz = _gru_backward(dh, h_steps[k], s["ru"][k], s["n"][k], s["gh_n"][k], s["x"][k], w, grads)
        d = {k: torch.stack(v[::-1]) if v else None for k, v in grads.items()}  # time order again
        d_act = d["p1"].new_zeros(0, *d["p1"].shape[1:]) if d["c"] is None else d["c"]
        return (d_act, d["p1"], None, None, *_weight_grads(d, h_all, z_all, s, w))


def _head_backward(dh, g_h, dz, g_mean, g_std, noise, raw, a1, a2, w: CoreWeights, grads) -> torch.Tensor:
    """Back through z_t = mean + std * noise and the posterior head at one step; the gradient of h_t."""
    d_raw = _ATEN.softplus_backward(torch.addcmul(g_std, dz, noise), raw, 1.0, 20.0)
    d_stats = torch.cat([g_mean + dz, d_raw], dim=-1)
    d_p2 = _elu_back(d_stats @ w.w3, a2)
    d_p1 = _elu_back(d_p2 @ w.w2, a1)
    grads["stats"].append(d_stats)
    grads["p2"].append(d_p2)
    grads["p1"].append(d_p1)
    return torch.addmm(g_h + dh, d_p1, w.h_in)


def _gru_backward(dh, h_prev, ru, n, gh_n, x, w: CoreWeights, grads) -> tuple[torch.Tensor, torch.Tensor]:
    """Back through the GRU and the cell input of one transition; gradients of the previous h and z."""
    deter = dh.shape[1]
    r, u = ru[:, :deter], ru[:, deter:]
    dh_u = dh * u
    d_pre_n = _ATEN.tanh_backward(dh - dh_u, n)  # h = n + u (h_prev - n); n = tanh(gi_n + r gh_n)
    d_pre_ru = _ATEN.sigmoid_backward(torch.cat([d_pre_n * gh_n, dh * (h_prev - n)], dim=-1), ru)
    d_gi = torch.cat([d_pre_ru, d_pre_n], dim=-1)
    d_gh = torch.cat([d_pre_ru, d_pre_n * r], dim=-1)
    d_c = _elu_back(d_gi @ w.w_ih, x)
    grads["gi"].append(d_gi)
    grads["gh"].append(d_gh)
    grads["c"].append(d_c)
    return torch.addmm(dh_u, d_gh, w.w_hh), d_c @ w.z_in


def _weight_grads(d: dict[str, torch.Tensor | None], h_all, z_all, s, w: CoreWeights) -> tuple[torch.Tensor, ...]:
    """Each weight's gradient as one matmul over all B*T rows (CoreWeights order)."""
    def outer(grad, inputs, like):  # sum over steps and rows of grad^T inputs
        if grad is None:
            return torch.zeros_like(like)
        inputs = torch.stack(inputs) if isinstance(inputs, list) else inputs
        return grad.reshape(-1, grad.shape[-1]).t() @ inputs.reshape(-1, inputs.shape[-1])

    def total(grad, like):
        return torch.zeros_like(like) if grad is None else grad.sum((0, 1))

    return (outer(d["c"], z_all[:-1], w.z_in), outer(d["gi"], s["x"], w.w_ih), total(d["gi"], w.b_ih),
            outer(d["gh"], h_all[:-1], w.w_hh), total(d["gh"], w.b_hh),
            outer(d["p1"], h_all, w.h_in), outer(d["p2"], s["a1"], w.w2), total(d["p2"], w.b2),
            outer(d["stats"], s["a2"], w.w3), total(d["stats"], w.b3))
