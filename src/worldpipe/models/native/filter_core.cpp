// The RSSM's sequential core (worldpipe/models/rssm_filter.py) with its loops over time in C++.
//
// Results are bitwise equal to the Python reference; what goes is the cost around each of its ~45 small
// operators per step on B = 16 rows (interpreter, dispatch, views, iterator set-up, the bias copy of every
// addmm). Each step's products call the BLAS gemm ATen's addmm calls, with its arguments ("Matrix products");
// the element-wise work between them (GRU gates, ELU, the posterior sample and their gradients) runs in loops
// that compute what ATen's kernels compute, element for element ("Element-wise kernels"); tanh and the weight
// gradients (one matmul each over all T*B rows) stay ATen calls. Per-step values live in time-major buffers
// ([T, B, ...]). Called inside an autograd Function: no graph is recorded.
#include <torch/extension.h>

#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Elu.h>

#include <algorithm>
#include <cmath>
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

// ---- Element-wise kernels ----
//
// Each computes what the ATen kernel it replaces computes, element for element:
// * the same formula in the same order. ATen's kernels are compiled with FMA contraction where the CPU has FMA
//   (``c + a * b`` becomes one fused multiply-add); this file is compiled without contraction
//   (-ffp-contract=off) and writes those fused multiply-adds out (``madd``);
// * the same split between the vectorized and the scalar form of a transcendental function: ATen's loops run
//   pairs of vectors over each contiguous run of elements and the remaining elements one at a time (where the
//   two forms can differ in the last bit). ``transcendental_run`` does the same over the same runs.
// The extension is built for the CPU capability ATen dispatches to (worldpipe.models.native), so the vector
// functions are ATen's own.

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
template <typename T> inline T madd(T a, T b, T c) { return std::fma(a, b, c); }
#else
template <typename T> inline T madd(T a, T b, T c) { return c + a * b; }
#endif

template <typename T> using Vec = at::vec::Vectorized<T>;

// ATen's vectorized loop over one contiguous run of n elements: vec_at(i) for each pair of whole vectors from the
// start, then scalar_at(i) for each remaining element.
template <typename T, typename VecAt, typename ScalarAt>
inline void split_run(int64_t n, const VecAt& vec_at, const ScalarAt& scalar_at) {
  constexpr int64_t width = Vec<T>::size();
  int64_t i = 0;
  for (; i <= n - 2 * width; i += 2 * width) {
    vec_at(i);
    vec_at(i + width);
  }
  for (; i < n; ++i) scalar_at(i);
}

// out[i] = f(in[i]) over one contiguous run, split as ATen splits it (out may be in).
template <typename T, typename VecF, typename ScalarF>
inline void transcendental_run(T* out, const T* in, int64_t n, const VecF& vec_f, const ScalarF& scalar_f) {
  split_run<T>(n, [&](int64_t i) { vec_f(Vec<T>::loadu(in + i)).store(out + i); },
               [&](int64_t i) { out[i] = scalar_f(in[i]); });
}

// elu (alpha = scale = input_scale = 1) in place over n contiguous values: ATen's own element functions.
template <typename T> void elu_inplace(T* values, int64_t n) {
  transcendental_run(values, values, n, at::native::get_vectorized_elu_elementwise_func<T>(T(1), T(1), T(1)),
                     at::native::get_scalar_elu_elementwise_func<T, T>(T(1), T(1), T(1)));
}

// sigmoid in place over n contiguous values (ATen's sigmoid kernel).
template <typename T> void sigmoid_inplace(T* values, int64_t n) {
  transcendental_run(
      values, values, n,
      [](Vec<T> a) { return ((Vec<T>(T(0)) - a).exp() + Vec<T>(T(1))).reciprocal(); },
      [](T a) { return T(1) / (T(1) + std::exp(-a)); });
}

// grad * elu'(x) from y = elu(x) (ATen's elu_backward with is_result), in place on grad.
template <typename T> void elu_backward_inplace(T* grad, const T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) grad[i] = out[i] <= T(0) ? grad[i] * (out[i] + T(1)) : grad[i];
}

// A step's [rows, cols] block: its first element and row stride (columns are contiguous).
template <typename T> struct Block {
  T* data;
  int64_t ld;
  T* row(int64_t r) const { return data + r * ld; }
};

// out = a + b, element-wise over [rows, cols].
template <typename T> void add_into(Block<T> out, Block<T> a, Block<T> b, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out.row(r)[c] = a.row(r)[c] + b.row(r)[c];
}

// out = src row by row over [rows, cols]: a step's product output set to what its addmm adds (a bias row, with
// src.ld 0, or the step's part computed outside the loop) just before the product, while it is in cache.
template <typename T> void fill_block(Block<T> out, Block<T> src, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::copy_n(src.row(r), cols, out.row(r));
}

// The GRU cell's gates after its two products, gi = x W_ih^T + b_ih and gh = h W_hh^T + b_hh (order r, u, n):
// ru = sigmoid(gi_ru + gh_ru), n = tanh(gi_n + r gh_n), h = n + u (h_prev - n). Keeps ru, n and gh_n
// (``n_step``: the n block as a tensor, for ATen's tanh).
template <typename T>
void gru_gates(Block<T> gi, Block<T> gh, Block<T> h_prev, Block<T> ru, Block<T> n, const Tensor& n_step,
               Block<T> ghn, Block<T> h, int64_t rows, int64_t deter) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < 2 * deter; ++c) ru.row(r)[c] = gi.row(r)[c] + gh.row(r)[c];
  sigmoid_inplace(ru.data, rows * 2 * deter);  // ru is one contiguous step: ATen runs it flat
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < deter; ++c) {
      const T gh_n = gh.row(r)[2 * deter + c];
      ghn.row(r)[c] = gh_n;
      n.row(r)[c] = madd(ru.row(r)[c], gh_n, gi.row(r)[2 * deter + c]);
    }
  }
  at::tanh_(const_cast<Tensor&>(n_step));  // ATen's tanh (MKL's vector tanh where torch has MKL)
  for (int64_t r = 0; r < rows; ++r) {
    const T* u = ru.row(r) + deter;
    for (int64_t c = 0; c < deter; ++c) h.row(r)[c] = madd(u[c], h_prev.row(r)[c] - n.row(r)[c], n.row(r)[c]);
  }
}

// softplus (beta 1, threshold 20) as ATen's kernel computes it.
template <typename T> Vec<T> softplus_vec(Vec<T> a) {
  return Vec<T>::blendv(a.exp().log1p(), a, a > Vec<T>(T(20)));
}
template <typename T> T softplus_scalar(T a) { return a > T(20) ? a : static_cast<T>(std::log1p(std::exp(a))); }

// The posterior's sample from its head's output stats = [mean, raw]: std = softplus(raw) + min_std,
// z = mean + std * noise. raw is strided (every row half of stats), so ATen runs softplus row by row.
template <typename T>
void posterior_sample(Block<T> stats, Block<T> noise, double min_std, Block<T> mean, Block<T> sd, Block<T> z,
                      int64_t rows, int64_t stoch) {
  const T floor = static_cast<T>(min_std);
  for (int64_t r = 0; r < rows; ++r) {
    transcendental_run(sd.row(r), stats.row(r) + stoch, stoch, softplus_vec<T>, softplus_scalar<T>);
    for (int64_t c = 0; c < stoch; ++c) {
      const T m = stats.row(r)[c], s = sd.row(r)[c] + floor;
      sd.row(r)[c] = s;
      mean.row(r)[c] = m;
      z.row(r)[c] = madd(s, noise.row(r)[c], m);
    }
  }
}

// grad * softplus'(raw) (ATen's softplus_backward) in place on grad over one row of n values, split as ATen does.
template <typename T> void softplus_backward_run(T* grad, const T* raw, int64_t n) {
  split_run<T>(
      n,
      [&](int64_t i) {
        const auto b = Vec<T>::loadu(raw + i), a = Vec<T>::loadu(grad + i), e = b.exp();
        Vec<T>::blendv(a * e / (e + Vec<T>(T(1))), a, b > Vec<T>(T(20))).store(grad + i);
      },
      [&](int64_t i) {
        const T e = std::exp(raw[i]);
        grad[i] = raw[i] > T(20) ? grad[i] : grad[i] * e / (e + T(1));
      });
}

// Back through z = mean + std * noise and std = softplus(raw) + min_std: d_stats = [g_mean + dz, d_raw] with
// dz = g_z + dz_next and d_raw = softplus'(raw) (g_std + dz * noise).
template <typename T>
void posterior_backward(Block<T> g_z, Block<T> dz_next, Block<T> g_std, Block<T> g_mean, Block<T> noise,
                        Block<T> stats, Block<T> d_stats, int64_t rows, int64_t stoch) {
  for (int64_t r = 0; r < rows; ++r) {
    T *d_mean = d_stats.row(r), *d_raw = d_stats.row(r) + stoch;
    for (int64_t c = 0; c < stoch; ++c) {
      const T dz = g_z.row(r)[c] + dz_next.row(r)[c];
      d_mean[c] = g_mean.row(r)[c] + dz;
      d_raw[c] = madd(dz, noise.row(r)[c], g_std.row(r)[c]);  // the gradient of std, then through softplus
    }
    softplus_backward_run(d_raw, stats.row(r) + stoch, stoch);
  }
}

// Back through h = n + u (h_prev - n), n = tanh(gi_n + r gh_n), ru = sigmoid(gi_ru + gh_ru) from dh:
// the gates' gradients d_gi = [d_r, d_u, d_n], d_gh = [d_r, d_u, d_n r] and the direct part of dh_prev, dh u.
template <typename T>
void gru_backward(Block<T> dh, Block<T> ru, Block<T> n, Block<T> ghn, Block<T> h_prev, Block<T> d_gi,
                  Block<T> d_gh, Block<T> dh_u, int64_t rows, int64_t deter) {
  for (int64_t row = 0; row < rows; ++row) {
    const T *g = dh.row(row), *r = ru.row(row), *u = ru.row(row) + deter, *nn = n.row(row);
    T *gi = d_gi.row(row), *gh = d_gh.row(row);
    for (int64_t c = 0; c < deter; ++c) {
      const T g_u = g[c] * u[c];
      const T d_n = (g[c] - g_u) * madd(-nn[c], nn[c], T(1));                      // tanh_backward
      const T d_r = d_n * ghn.row(row)[c] * (T(1) - r[c]) * r[c];                  // sigmoid_backward
      const T d_u = g[c] * (h_prev.row(row)[c] - nn[c]) * (T(1) - u[c]) * u[c];
      dh_u.row(row)[c] = g_u;
      gi[c] = gh[c] = d_r;
      gi[deter + c] = gh[deter + c] = d_u;
      gi[2 * deter + c] = d_n;
      gh[2 * deter + c] = d_n * r[c];
    }
  }
}

// ---- Matrix products ----
//
// Each step's products go straight to the BLAS gemm ATen's addmm/mm call on CPU, with the arguments ATen derives
// for these layouts (a row-major [rows, cols] result is computed as its column-major transpose), so the sums
// are the same; skipped are the per-call views, the bias copy into the output (buffers are pre-filled with
// their bias once per sequence) and the dispatch. Sizes of 1 change ATen's leading dimensions, so such shapes
// take ATen's own addmm instead (``direct`` false).

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

inline void blas_gemm(char ta, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
                      float* c, int ldc) {
  const char tb = 'n';
  const float one = 1;
  sgemm_(&ta, &tb, &m, &n, &k, &one, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void blas_gemm(char ta, int m, int n, int k, const double* a, int lda, const double* b, int ldb, double beta,
                      double* c, int ldc) {
  const char tb = 'n';
  const double one = 1;
  dgemm_(&ta, &tb, &m, &n, &k, &one, a, &lda, b, &ldb, &beta, c, &ldc);
}

// A weight as a product's right operand: ``w`` [cols, K] used as w^T (``transposed``), or [K, cols] used as is.
struct Operand {
  Tensor w;
  bool transposed;
};

// out [rows, cols] (row stride ld_out) = beta * out + act [rows, K] (row stride ld_act) @ op.
template <typename T>
void product(const T* act, int64_t ld_act, int64_t rows, const Operand& op, T beta, T* out, int64_t ld_out,
             bool direct) {
  const Tensor& w = op.w;
  const int64_t k = op.transposed ? w.size(1) : w.size(0), cols = op.transposed ? w.size(0) : w.size(1);
  if (direct) {
    blas_gemm(op.transposed ? 't' : 'n', static_cast<int>(cols), static_cast<int>(rows), static_cast<int>(k),
              w.data_ptr<T>(), static_cast<int>(w.stride(0)), act, static_cast<int>(ld_act), beta, out,
              static_cast<int>(ld_out));
    return;
  }
  const auto opts = w.options();
  const auto a = at::from_blob(const_cast<T*>(act), {rows, k}, {ld_act, 1}, opts);
  auto c = at::from_blob(out, {rows, cols}, {ld_out, 1}, opts);
  const auto b = op.transposed ? w.t() : w;
  if (beta == T(0)) {
    at::mm_out(c, a, b);
  } else {
    at::addmm_out(c, c, a, b);
  }
}

// A [steps, rows, cols] buffer (steps_buffer) addressed by step: its raw pointers, step stride and row stride.
template <typename T> struct Steps {
  T* base;
  int64_t step_stride, ld;
  explicit Steps(const Tensor& t) : base(t.data_ptr<T>()), step_stride(t.stride(0)), ld(t.stride(1)) {
    TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, "filter_core: a per-step buffer must have contiguous rows");
  }
  T* at(int64_t t) const { return base + t * step_stride; }
  Block<T> block(int64_t t) const { return {at(t), ld}; }
};

// ---- The loops through time ----

// Whether every product of the loops can go straight to BLAS: no size of 1, every weight with contiguous rows.
bool direct_products(int64_t batch, int64_t deter, int64_t stoch, int64_t hidden, const Weights& w) {
  for (const auto* m : {&w.z_in, &w.w_ih, &w.w_hh, &w.h_in, &w.w2, &w.w3})
    if (m->stride(1) != 1) return false;
  return batch > 1 && deter > 1 && stoch > 1 && hidden > 1;
}

template <typename T>
std::vector<Tensor> forward_loop(const Tensor& act_part, const Tensor& embed_part, const Tensor& noise,
                                 const Weights& w, double min_std) {
  const int64_t steps = embed_part.size(0), batch = embed_part.size(1);
  const int64_t deter = w.w_hh.size(1), stoch = w.z_in.size(1), hidden = w.w2.size(0);
  const bool direct = direct_products(batch, deter, stoch, hidden, w);
  const Operand z_in{w.z_in, true}, w_ih{w.w_ih, true}, w_hh{w.w_hh, true}, h_in{w.h_in, true}, w2{w.w2, true},
      w3{w.w3, true};
  const auto opts = embed_part.options();
  auto h_all = steps_buffer(steps, batch, deter, opts), z_all = steps_buffer(steps, batch, stoch, opts);
  auto mean_all = steps_buffer(steps, batch, stoch, opts), std_all = steps_buffer(steps, batch, stoch, opts);
  auto x_all = steps_buffer(steps - 1, batch, hidden, opts), ru_all = steps_buffer(steps - 1, batch, 2 * deter, opts);
  auto n_all = steps_buffer(steps - 1, batch, deter, opts), ghn_all = steps_buffer(steps - 1, batch, deter, opts);
  auto gi_all = steps_buffer(steps - 1, batch, 3 * deter, opts), gh_all = steps_buffer(steps - 1, batch, 3 * deter, opts);
  auto a1_all = steps_buffer(steps, batch, hidden, opts), a2_all = steps_buffer(steps, batch, hidden, opts);
  auto stats_all = steps_buffer(steps, batch, 2 * stoch, opts);
  h_all[0].zero_();
  const Steps<T> h(h_all), z(z_all), mean(mean_all), sd(std_all), x(x_all), ru(ru_all), n(n_all), ghn(ghn_all),
      gi(gi_all), gh(gh_all), a1(a1_all), a2(a2_all), stats(stats_all), eps(noise), act(act_part),
      embed(embed_part);
  // Every product's output starts as what its addmm adds: a bias row (row stride 0) or a step of the part
  // computed outside the loop (filled per step, not up front: a sequence's buffers outgrow the cache).
  const auto bias = [](const Tensor& b) { return Block<T>{b.data_ptr<T>(), 0}; };
  const Block<T> b_ih = bias(w.b_ih), b_hh = bias(w.b_hh), b2 = bias(w.b2), b3 = bias(w.b3);
  for (int64_t t = 0; t < steps; ++t) {
    if (t > 0) {
      const int64_t k = t - 1;
      fill_block<T>(x.block(k), act.block(k), batch, hidden);
      product<T>(z.at(k), z.ld, batch, z_in, T(1), x.at(k), x.ld, direct);
      elu_inplace(x.at(k), batch * hidden);
      fill_block<T>(gi.block(k), b_ih, batch, 3 * deter);
      product<T>(x.at(k), x.ld, batch, w_ih, T(1), gi.at(k), gi.ld, direct);
      fill_block<T>(gh.block(k), b_hh, batch, 3 * deter);
      product<T>(h.at(k), h.ld, batch, w_hh, T(1), gh.at(k), gh.ld, direct);
      gru_gates<T>(gi.block(k), gh.block(k), h.block(k), ru.block(k), n.block(k), n_all[k], ghn.block(k), h.block(t),
                   batch, deter);
    }
    fill_block<T>(a1.block(t), embed.block(t), batch, hidden);
    product<T>(h.at(t), h.ld, batch, h_in, T(1), a1.at(t), a1.ld, direct);
    elu_inplace(a1.at(t), batch * hidden);
    fill_block<T>(a2.block(t), b2, batch, hidden);
    product<T>(a1.at(t), a1.ld, batch, w2, T(1), a2.at(t), a2.ld, direct);
    elu_inplace(a2.at(t), batch * hidden);
    fill_block<T>(stats.block(t), b3, batch, 2 * stoch);
    product<T>(a2.at(t), a2.ld, batch, w3, T(1), stats.at(t), stats.ld, direct);
    posterior_sample<T>(stats.block(t), eps.block(t), min_std, mean.block(t), sd.block(t), z.block(t), batch, stoch);
  }
  // The outputs contiguous, as the reference's stacked ones (a copy only where steps were padded apart); the
  // saved intermediates keep their aligned steps for the backward's per-step matmuls.
  return {h_all.contiguous(), z_all.contiguous(), mean_all.contiguous(), std_all.contiguous(),
          x_all, ru_all, n_all, ghn_all, a1_all, a2_all, stats_all};
}

// Sum over steps and rows of grad^T inputs: a weight's gradient as one matmul over all T*B rows.
// (Both reshaped from contiguous tensors: the reference's stacked steps.)
Tensor weight_grad(const Tensor& grad, const Tensor& inputs) {
  return at::mm(grad.contiguous().reshape({-1, grad.size(-1)}).t(),
                inputs.contiguous().reshape({-1, inputs.size(-1)}));
}

// The dimensions as an explicit IntArrayRef: a bare braced list is ambiguous among at::sum overloads of other torch versions.
Tensor bias_grad(const Tensor& grad) { return at::sum(grad.contiguous(), at::IntArrayRef{0, 1}); }

Tensor or_zeros(const Tensor& grad, const Tensor& like) {
  return grad.defined() ? grad.contiguous() : at::zeros_like(like, at::MemoryFormat::Contiguous);
}

template <typename T>
std::vector<Tensor> backward_loop(const Tensor& g_h_in, const Tensor& g_z_in, const Tensor& g_mean_in,
                                  const Tensor& g_std_in, const Tensor& noise, const Tensor& h_all,
                                  const Tensor& z_all, const std::vector<Tensor>& saved, const Weights& w) {
  const Tensor &x_all = saved.at(0), &ru_all = saved.at(1), &n_all = saved.at(2), &ghn_all = saved.at(3),
               &a1_all = saved.at(4), &a2_all = saved.at(5), &stats_all = saved.at(6);
  const int64_t steps = noise.size(0), batch = noise.size(1), deter = h_all.size(2), stoch = noise.size(2);
  const int64_t hidden = w.w2.size(0);
  const bool direct = direct_products(batch, deter, stoch, hidden, w);
  const Operand w3{w.w3, false}, w2{w.w2, false}, h_in{w.h_in, false}, w_ih{w.w_ih, false}, w_hh{w.w_hh, false},
      z_in{w.z_in, false};
  const auto opts = noise.options();
  auto d_stats = steps_buffer(steps, batch, 2 * stoch, opts), d_p2 = steps_buffer(steps, batch, hidden, opts);
  auto d_p1 = steps_buffer(steps, batch, hidden, opts), d_gi = steps_buffer(steps - 1, batch, 3 * deter, opts);
  auto d_gh = steps_buffer(steps - 1, batch, 3 * deter, opts), d_c = steps_buffer(steps - 1, batch, hidden, opts);
  // The state gradients carried through time, each its own aligned allocation (as the reference's fresh ones).
  auto dh_t = at::zeros({batch, deter}, opts), dh_next_t = at::empty({batch, deter}, opts);
  auto dz_t = at::zeros({batch, stoch}, opts);
  const Block<T> dh{dh_t.data_ptr<T>(), deter}, dh_next{dh_next_t.data_ptr<T>(), deter};
  const Block<T> dz{dz_t.data_ptr<T>(), stoch};
  const auto g_h_all = or_zeros(g_h_in, h_all), g_z_all = or_zeros(g_z_in, noise);
  const auto g_mean_all = or_zeros(g_mean_in, noise), g_std_all = or_zeros(g_std_in, noise);
  const Steps<T> g_h(g_h_all), g_z(g_z_all), g_mean(g_mean_all), g_std(g_std_all), eps(noise), h(h_all);
  const Steps<T> x(x_all), ru(ru_all), n(n_all), ghn(ghn_all), a1(a1_all), a2(a2_all), stats(stats_all);
  const Steps<T> ds(d_stats), p2(d_p2), p1(d_p1), gi(d_gi), gh(d_gh), c(d_c);
  for (int64_t t = steps - 1; t >= 0; --t) {
    // Back through z_t = mean + std * noise and the posterior head: dh_next = g_h + dh + d_p1 h_in.
    posterior_backward<T>(g_z.block(t), dz, g_std.block(t), g_mean.block(t), eps.block(t), stats.block(t),
                          ds.block(t), batch, stoch);
    product<T>(ds.at(t), ds.ld, batch, w3, T(0), p2.at(t), p2.ld, direct);
    elu_backward_inplace(p2.at(t), a2.at(t), batch * hidden);
    product<T>(p2.at(t), p2.ld, batch, w2, T(0), p1.at(t), p1.ld, direct);
    elu_backward_inplace(p1.at(t), a1.at(t), batch * hidden);
    add_into<T>(dh_next, g_h.block(t), dh, batch, deter);
    product<T>(p1.at(t), p1.ld, batch, h_in, T(1), dh_next.data, deter, direct);
    if (t == 0) break;
    // Back through the GRU and the cell input of the transition into step t: dh = dh_next u + d_gh w_hh,
    // dz = d_c z_in.
    const int64_t k = t - 1;
    gru_backward<T>(dh_next, ru.block(k), n.block(k), ghn.block(k), h.block(k), gi.block(k), gh.block(k), dh,
                    batch, deter);
    product<T>(gi.at(k), gi.ld, batch, w_ih, T(0), c.at(k), c.ld, direct);
    elu_backward_inplace(c.at(k), x.at(k), batch * hidden);
    product<T>(gh.at(k), gh.ld, batch, w_hh, T(1), dh.data, deter, direct);
    product<T>(c.at(k), c.ld, batch, z_in, T(0), dz.data, stoch, direct);
  }
  const auto prev = [](const Tensor& all) { return all.narrow(0, 0, all.size(0) - 1); };
  return {d_c.contiguous(), d_p1.contiguous(),
          weight_grad(d_c, prev(z_all)), weight_grad(d_gi, x_all), bias_grad(d_gi),
          weight_grad(d_gh, prev(h_all)), bias_grad(d_gh),
          weight_grad(d_p1, h_all), weight_grad(d_p2, a1_all), bias_grad(d_p2),
          weight_grad(d_stats, a2_all), bias_grad(d_stats)};
}

// The loops read tensor memory from the host: a tensor on another device is refused, never dereferenced.
void require_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(!t.defined() || t.device().is_cpu(), "filter_core: ", name, " is on ", t.device(), "; the compiled core runs on CPU "
              "tensors only (worldpipe.models.rssm_filter.chosen_core picks the reference elsewhere)");
}

}  // namespace

// Outputs h, z, mean, std ([T,B,D|S]) and the saved intermediates x, ru, n, gh_n ([T-1,B,...]), a1, a2, raw.
std::vector<Tensor> filter_forward(const Tensor& act_part, const Tensor& embed_part, const Tensor& noise,
                                   const std::vector<Tensor>& weights, double min_std) {
  for (const Tensor* t : {&act_part, &embed_part, &noise}) require_cpu(*t, "an input");
  for (const Tensor& t : weights) require_cpu(t, "a weight");
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Weights w(weights);
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(embed_part.scalar_type(), "filter_forward", [&] {
    out = forward_loop<scalar_t>(act_part.contiguous(), embed_part.contiguous(), noise.contiguous(), w, min_std);
  });
  return out;
}

// Gradients of act_part, embed_part and the weights (CoreWeights order) from the outputs' gradients.
std::vector<Tensor> filter_backward(const Tensor& g_h, const Tensor& g_z, const Tensor& g_mean, const Tensor& g_std,
                                    const Tensor& noise, const Tensor& h_all, const Tensor& z_all,
                                    const std::vector<Tensor>& saved, const std::vector<Tensor>& weights) {
  for (const Tensor* t : {&g_h, &noise, &h_all, &z_all}) require_cpu(*t, "an input");
  for (const Tensor& t : weights) require_cpu(t, "a weight");
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Weights w(weights);
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(noise.scalar_type(), "filter_backward", [&] {
    out = backward_loop<scalar_t>(g_h, g_z, g_mean, g_std, noise.contiguous(), h_all, z_all, saved, w);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("filter_forward", &filter_forward, "The filter's forward through time");
  m.def("filter_backward", &filter_backward, "The filter's backward through time");
}
