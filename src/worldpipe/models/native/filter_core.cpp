// The RSSM's sequential core (worldpipe/models/rssm_filter.py) with its loops over time in C++.
//
// The same ATen operators in the same order as the Python reference, so results are bitwise equal to it; what
// goes is the interpreter between operators (argument parsing, tensor wrapping, list and dict bookkeeping,
// views), which is most of a step on B = 16 rows. Per-step values are written into time-major buffers
// ([T, B, ...]) instead of lists stacked afterwards. Called inside an autograd Function: no graph is recorded.
#include <torch/extension.h>

#include <vector>

namespace {

using at::Tensor;

// Weights in CoreWeights order: z_in, w_ih, b_ih, w_hh, b_hh, h_in, w2, b2, w3, b3.
struct Weights {
  Tensor z_in, w_ih, b_ih, w_hh, b_hh, h_in, w2, b2, w3, b3;
  explicit Weights(const std::vector<Tensor>& w)
      : z_in(w.at(0)), w_ih(w.at(1)), b_ih(w.at(2)), w_hh(w.at(3)), b_hh(w.at(4)), h_in(w.at(5)), w2(w.at(6)),
        b2(w.at(7)), w3(w.at(8)), b3(w.at(9)) {}
};

// A [steps, rows, cols] buffer whose every step starts 64-byte aligned, like the fresh tensor the Python
// reference allocates per step: MKL's small GEMMs take a different path (and sum in another order) for an
// unaligned operand or output. Where rows * cols fills whole 64-byte lines the buffer is plainly contiguous.
Tensor steps_buffer(int64_t steps, int64_t rows, int64_t cols, const at::TensorOptions& opts) {
  const int64_t line = 64 / static_cast<int64_t>(c10::elementSize(opts.dtype().toScalarType()));
  const int64_t per_step = rows * cols, padded = (per_step + line - 1) / line * line;
  return at::empty({steps, padded}, opts).narrow(1, 0, per_step).view({steps, rows, cols});
}

}  // namespace

// Outputs h, z, mean, std ([T,B,D|S]) and the saved intermediates x, ru, n, gh_n ([T-1,B,...]), a1, a2, raw.
std::vector<Tensor> filter_forward(const Tensor& act_part, const Tensor& embed_part, const Tensor& noise,
                                   const std::vector<Tensor>& weights, double min_std) {
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Weights w(weights);
  const int64_t steps = embed_part.size(0), batch = embed_part.size(1);
  const int64_t deter = w.w_hh.size(1), stoch = w.z_in.size(1), hidden = w.w2.size(0);
  const auto z_in_t = w.z_in.t(), w_ih_t = w.w_ih.t(), w_hh_t = w.w_hh.t(), h_in_t = w.h_in.t(),
             w2_t = w.w2.t(), w3_t = w.w3.t();
  const auto opts = embed_part.options();
  auto h_all = steps_buffer(steps, batch, deter, opts), z_all = steps_buffer(steps, batch, stoch, opts);
  auto mean_all = steps_buffer(steps, batch, stoch, opts), std_all = steps_buffer(steps, batch, stoch, opts);
  auto x_all = steps_buffer(steps - 1, batch, hidden, opts), ru_all = steps_buffer(steps - 1, batch, 2 * deter, opts);
  auto n_all = steps_buffer(steps - 1, batch, deter, opts), ghn_all = steps_buffer(steps - 1, batch, deter, opts);
  auto a1_all = steps_buffer(steps, batch, hidden, opts), a2_all = steps_buffer(steps, batch, hidden, opts);
  auto stats_all = steps_buffer(steps, batch, 2 * stoch, opts);
  Tensor h = at::zeros({batch, deter}, opts), z = at::zeros({batch, stoch}, opts);
  for (int64_t t = 0; t < steps; ++t) {
    if (t > 0) {
      const int64_t k = t - 1;
      auto x = x_all[k];
      at::addmm_out(x, act_part[k], z, z_in_t);
      at::elu_(x);
      auto gi = at::addmm(w.b_ih, x, w_ih_t);
      auto gh = at::addmm(w.b_hh, h, w_hh_t);
      auto ru = ru_all[k];
      at::add_out(ru, gi.narrow(1, 0, 2 * deter), gh.narrow(1, 0, 2 * deter));
      ru.sigmoid_();
      auto r = ru.narrow(1, 0, deter), u = ru.narrow(1, deter, deter);
      auto gh_n = gh.narrow(1, 2 * deter, deter);
      ghn_all[k].copy_(gh_n);
      auto n = n_all[k];
      at::addcmul_out(n, gi.narrow(1, 2 * deter, deter), r, gh_n);
      n.tanh_();
      h = h_all[t];
      at::addcmul_out(h, n, u, at::sub(h_all[k], n));
    } else {
      h_all[0].zero_();
      h = h_all[0];
    }
    auto a1 = a1_all[t];
    at::addmm_out(a1, embed_part[t], h, h_in_t);
    at::elu_(a1);
    auto a2 = a2_all[t];
    at::addmm_out(a2, w.b2, a1, w2_t);
    at::elu_(a2);
    auto stats = stats_all[t];
    at::addmm_out(stats, w.b3, a2, w3_t);
    auto mean = stats.narrow(1, 0, stoch), raw = stats.narrow(1, stoch, stoch);
    auto sd = std_all[t];
    at::softplus_out(sd, raw, 1.0, 20.0);
    sd.add_(min_std);
    mean_all[t].copy_(mean);
    z = z_all[t];
    at::addcmul_out(z, mean, sd, noise[t]);
  }
  // The outputs contiguous, as the reference's stacked ones (a copy only where steps were padded apart); the
  // saved intermediates keep their aligned steps for the backward's per-step matmuls.
  return {h_all.contiguous(), z_all.contiguous(), mean_all.contiguous(), std_all.contiguous(),
          x_all, ru_all, n_all, ghn_all, a1_all, a2_all, stats_all};
}

namespace {

// Sum over steps and rows of grad^T inputs: a weight's gradient as one matmul over all T*B rows.
// (Both reshaped from contiguous tensors: the reference's stacked steps.)
Tensor weight_grad(const Tensor& grad, const Tensor& inputs) {
  return at::mm(grad.contiguous().reshape({-1, grad.size(-1)}).t(),
                inputs.contiguous().reshape({-1, inputs.size(-1)}));
}

Tensor bias_grad(const Tensor& grad) { return at::sum(grad.contiguous(), {0, 1}); }

Tensor or_zeros(const Tensor& grad, const Tensor& like) { return grad.defined() ? grad : at::zeros_like(like); }

}  // namespace

// Gradients of act_part, embed_part and the weights (CoreWeights order) from the outputs' gradients.
std::vector<Tensor> filter_backward(const Tensor& g_h_in, const Tensor& g_z_in, const Tensor& g_mean_in,
                                    const Tensor& g_std_in, const Tensor& noise, const Tensor& h_all,
                                    const Tensor& z_all, const std::vector<Tensor>& saved,
                                    const std::vector<Tensor>& weights) {
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Weights w(weights);
  const Tensor &x_all = saved.at(0), &ru_all = saved.at(1), &n_all = saved.at(2), &ghn_all = saved.at(3),
               &a1_all = saved.at(4), &a2_all = saved.at(5), &stats_all = saved.at(6);
  const auto g_h = or_zeros(g_h_in, h_all), g_z = or_zeros(g_z_in, noise), g_mean = or_zeros(g_mean_in, noise),
             g_std = or_zeros(g_std_in, noise);
  const int64_t steps = noise.size(0), batch = noise.size(1), deter = h_all.size(2), stoch = noise.size(2);
  const int64_t hidden = w.w2.size(0);
  const auto opts = noise.options();
  auto d_stats = steps_buffer(steps, batch, 2 * stoch, opts), d_p2 = steps_buffer(steps, batch, hidden, opts);
  auto d_p1 = steps_buffer(steps, batch, hidden, opts), d_gi = steps_buffer(steps - 1, batch, 3 * deter, opts);
  auto d_gh = steps_buffer(steps - 1, batch, 3 * deter, opts), d_c = steps_buffer(steps - 1, batch, hidden, opts);
  Tensor dh = at::zeros({batch, deter}, opts), dz = at::zeros({batch, stoch}, opts);
  for (int64_t t = steps - 1; t >= 0; --t) {
    // Back through z_t = mean + std * noise and the posterior head.
    const auto dzt = at::add(g_z[t], dz);
    const auto d_raw = at::softplus_backward(at::addcmul(g_std[t], dzt, noise[t]), stats_all[t].narrow(1, stoch, stoch), 1.0, 20.0);
    auto stats_t = d_stats[t];
    at::cat_out(stats_t, {at::add(g_mean[t], dzt), d_raw}, -1);
    auto p2_t = d_p2[t];
    at::elu_backward_out(p2_t, at::mm(stats_t, w.w3), 1.0, 1.0, 1.0, true, a2_all[t]);
    auto p1_t = d_p1[t];
    at::elu_backward_out(p1_t, at::mm(p2_t, w.w2), 1.0, 1.0, 1.0, true, a1_all[t]);
    dh = at::addmm(at::add(g_h[t], dh), p1_t, w.h_in);
    if (t == 0) break;
    // Back through the GRU and the cell input of the transition into step t.
    const int64_t k = t - 1;
    const auto ru = ru_all[k], n = n_all[k];
    const auto r = ru.narrow(1, 0, deter), u = ru.narrow(1, deter, deter);
    const auto dh_u = at::mul(dh, u);
    const auto d_pre_n = at::tanh_backward(at::sub(dh, dh_u), n);
    const auto d_pre_ru =
        at::sigmoid_backward(at::cat({at::mul(d_pre_n, ghn_all[k]), at::mul(dh, at::sub(h_all[k], n))}, -1), ru);
    auto gi_k = d_gi[k], gh_k = d_gh[k], c_k = d_c[k];
    at::cat_out(gi_k, {d_pre_ru, d_pre_n}, -1);
    at::cat_out(gh_k, {d_pre_ru, at::mul(d_pre_n, r)}, -1);
    at::elu_backward_out(c_k, at::mm(gi_k, w.w_ih), 1.0, 1.0, 1.0, true, x_all[k]);
    dh = at::addmm(dh_u, gh_k, w.w_hh);
    dz = at::mm(c_k, w.z_in);
  }
  const auto prev = [](const Tensor& all) { return all.narrow(0, 0, all.size(0) - 1); };
  return {d_c.contiguous(), d_p1.contiguous(),
          weight_grad(d_c, prev(z_all)), weight_grad(d_gi, x_all), bias_grad(d_gi),
          weight_grad(d_gh, prev(h_all)), bias_grad(d_gh),
          weight_grad(d_p1, h_all), weight_grad(d_p2, a1_all), bias_grad(d_p2),
          weight_grad(d_stats, a2_all), bias_grad(d_stats)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("filter_forward", &filter_forward, "The filter's forward through time");
  m.def("filter_backward", &filter_backward, "The filter's backward through time");
}
