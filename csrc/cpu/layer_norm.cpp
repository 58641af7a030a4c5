// CPU LayerNorm(x + residual) over the last dim and its backward.
// Forward: rows split into one contiguous chunk per thread; per row one pass forms h = x + residual
// with the sums of d = h - h[0] and d^2 (mean and variance of shifted data), a second writes
// y = (h - mean) * rstd * w + b.  Backward: one chunk of rows per thread; per row pass 1 forms
// g*w (into an L1 scratch row), its row sums and the chunk's dweight/dbias partials, pass 2 writes
// dx once; the chunks' partials are added in chunk order (deterministic for a thread count).
// Memory traffic, not arithmetic, bounds both, so:
// - Large tensors (see kStreamTraffic*) get their output through streaming stores: a store that
//   misses first reads the line from memory (read-for-ownership), which the backward's dx, and
//   the forward's y, never need.  The backward also prefetches its rows kAheadRows ahead into
//   L2, not L1, which cannot hold the next row beside the one being worked on; the two changes
//   gain together what neither gains alone (benchmarks/ops/NOTES-kernels.md, "CPU LayerNorm rework").
// - Every thread works in its own 64-byte-aligned buffer (copies of w and b, partials, scratch
//   rows; std::vector's 16-byte alignment split AVX-512 loads across lines).  dweight/dbias
//   partials in one shared allocation, updated on every row, cost much of the backward's time
//   when a line near the boundary between two threads' partials bounced between the cores (it
//   depended on where the allocation fell).
// 16-bit tensors go through converted acc_t rows and ordinary stores.
// Below the LayerNorm: bias + dropout + residual + LayerNorm in one op (see its section), whose backward
// also runs from the output y instead of x and residual.
#include <cmath>
#include <type_traits>

#include "../common.h"
#include "cpu_util.h"
#include "dropout_mask.h"

namespace bertctl::cpu {
namespace {

// h = x + residual (into buf, or x itself) with its mean and variance in one pass: sums of
// d = h - h[0] and d^2.  Shifting by a sample of the row bounds the cancellation in
// E[d^2] - E[d]^2 by the spread of the row, not its offset (Chan et al., "shifted data").
template <typename acc_t, typename scalar_t>
inline const acc_t* moments_row(const scalar_t* x, const scalar_t* res, acc_t* buf, acc_t* buf2, int64_t n,
                                acc_t& mean, acc_t& var) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const acc_t* xr = load_row<acc_t>(x, buf, n);
  const acc_t* rr = res ? load_row<acc_t>(res, buf2, n) : nullptr;
  acc_t* h = rr ? buf : const_cast<acc_t*>(xr);  // written only when a residual is added
  const acc_t k = rr ? xr[0] + rr[0] : xr[0];
  const Vec vk(k);
  Vec s0(0), s1(0), q0(0), q1(0);
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    Vec a = Vec::loadu(xr + j), b = Vec::loadu(xr + j + W);
    if (rr) {
      a = a + Vec::loadu(rr + j);
      b = b + Vec::loadu(rr + j + W);
      a.store(h + j);
      b.store(h + j + W);
    }
    const Vec da = a - vk, db = b - vk;
    s0 = s0 + da;
    s1 = s1 + db;
    q0 = at::vec::fmadd(da, da, q0);
    q1 = at::vec::fmadd(db, db, q1);
  }
  acc_t tmp[W], s = 0, q = 0;
  (s0 + s1).store(tmp);
  for (int64_t i = 0; i < W; ++i) s += tmp[i];
  (q0 + q1).store(tmp);
  for (int64_t i = 0; i < W; ++i) q += tmp[i];
  for (; j < n; ++j) {
    const acc_t v = rr ? (h[j] = xr[j] + rr[j]) : xr[j];
    s += v - k;
    q += (v - k) * (v - k);
  }
  const acc_t ds = s / n;
  mean = k + ds;
  var = std::max(q / n - ds * ds, acc_t(0));
  return h;
}

// Outputs are written with streaming stores (and, in the backward, rows are prefetched into L2
// kAheadRows ahead) once the bytes an op reads and writes reach these sizes; below them the output
// is written through the cache, where the next op finds it.  The thresholds come from timing the op
// alone and with a read of its whole output straight after, the worst case for streaming
// (benchmarks/ops/NOTES-kernels.md, "CPU LayerNorm rework"):
// - forward (reads x, res; writes y): y is streamed only once the op moves more than the L3 holds
//   (32 MiB on the 2-core Zen 4 it was tuned on: 4096 x 768 with residual, 36 MiB, streams;
//   2048 x 768 does not), since below that the next op would still have found y in L3.
// - backward (reads x, res, dy; writes dx): streaming pays from a few MiB of dx even when dx is
//   read straight after; threshold 16 MiB moved: dx of 4 MiB with a residual.
constexpr int64_t kStreamTrafficForward = int64_t(32) << 20;
constexpr int64_t kStreamTrafficBackward = int64_t(16) << 20;
constexpr int64_t kAheadRows = 2;

// The sum of a vector's lanes, in lane order.  (at::vec::vec_reduce_all does the same with
// shuffles that set off GCC 12's -Wuninitialized inside its AVX-512 headers.)
template <typename acc_t>
inline acc_t lane_sum(const at::vec::Vectorized<acc_t>& v) {
  constexpr int64_t W = at::vec::Vectorized<acc_t>::size();
  acc_t lanes[W], s = 0;
  v.store(lanes);
  for (int64_t i = 0; i < W; ++i) s += lanes[i];
  return s;
}

// fn(std::bool_constant<a>{}, std::bool_constant<b>{}): two run-time switches as template arguments.
template <typename Fn>
inline void with_bools(bool a, bool b, Fn&& fn) {
  if (a) {
    b ? fn(std::true_type{}, std::true_type{}) : fn(std::true_type{}, std::false_type{});
  } else {
    b ? fn(std::false_type{}, std::true_type{}) : fn(std::false_type{}, std::false_type{});
  }
}

// One output row: y = (h - mean) * rstd * w + b from the acc_t row h, through out_buf for 16-bit y.
// The next row's x and residual are prefetched into L1 while this one is written (see prefetch in
// cpu_util.h): here that is faster than the backward's way (two rows ahead, into L2, in pass 1).
template <bool Large, typename scalar_t, typename acc_t>
inline void normalize_row(const acc_t* h, acc_t mean, acc_t rstd, const acc_t* w, const acc_t* b, scalar_t* y,
                          acc_t* out_buf, int64_t cols, const scalar_t* next_x, const scalar_t* next_res) {
  using Vec = at::vec::Vectorized<acc_t>;
  acc_t* o = out_row<acc_t>(y, out_buf);
  for_each_vector<Large>(o, cols, [&](int64_t j, auto load, auto store) {
    prefetch(next_x, j);
    prefetch(next_res, j);
    store(at::vec::fmadd((load(h, j) - Vec(mean)) * Vec(rstd), load(w, j), load(b, j)), o, j);
  });
  store_row<acc_t>(o, y, cols);
}

template <bool Large, typename scalar_t, typename acc_t>
void layer_norm_chunk(const scalar_t* x, const scalar_t* res, const acc_t* w_in, const acc_t* b_in, acc_t eps,
                      scalar_t* y, acc_t* mean_out, acc_t* rstd_out, int64_t cols, int64_t begin, int64_t end) {
  // This thread's line-aligned copies of w and b, and rows for h and (16-bit) conversions.
  const int64_t ld = (cols + 15) / 16 * 16;
  RowBuffer<acc_t> bufs(5 * ld);
  acc_t *w = bufs.get(0), *b = bufs.get(ld), *buf = bufs.get(2 * ld), *buf2 = bufs.get(3 * ld);
  acc_t* out_buf = bufs.get(4 * ld);
  std::copy(w_in, w_in + cols, w);
  std::copy(b_in, b_in + cols, b);
  for (int64_t r = begin; r < end; ++r) {
    acc_t mean, var;
    const acc_t* h =
        moments_row<acc_t>(x + r * cols, res ? res + r * cols : nullptr, buf, buf2, cols, mean, var);
    const acc_t rstd = acc_t(1) / std::sqrt(var + eps);
    if (mean_out != nullptr) {
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
    normalize_row<Large>(h, mean, rstd, w, b, y + r * cols, out_buf, cols,
                         r + 1 < end ? x + (r + 1) * cols : nullptr,
                         r + 1 < end && res ? res + (r + 1) * cols : nullptr);
  }
  if constexpr (Large) stream_fence();
}

template <typename scalar_t>
void layer_norm_rows(const at::Tensor& x_, const at::Tensor& res_, const at::Tensor& w_, const at::Tensor& b_,
                     double eps, at::Tensor& y_, at::Tensor& mean_, at::Tensor& rstd_) {
  using acc_t = acc_type<scalar_t>;
  const int64_t cols = last_dim(x_), rows = rows_of(x_);
  const auto w = param_acc<acc_t>(w_), b = param_acc<acc_t>(b_);
  const scalar_t* x = x_.data_ptr<scalar_t>();
  const scalar_t* res = res_.defined() ? res_.data_ptr<scalar_t>() : nullptr;
  scalar_t* y = y_.data_ptr<scalar_t>();
  acc_t* mean_out = mean_.defined() ? mean_.data_ptr<acc_t>() : nullptr;  // undefined: no statistics stored
  acc_t* rstd_out = rstd_.defined() ? rstd_.data_ptr<acc_t>() : nullptr;
  // Streaming is for outputs written directly (fp32, fp64), not through a conversion buffer.
  const int64_t traffic = static_cast<int64_t>(y_.nbytes()) * (res ? 3 : 2);
  const bool large = std::is_same_v<acc_t, scalar_t> && traffic >= kStreamTrafficForward;
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    if (large)
      layer_norm_chunk<true>(x, res, w.data(), b.data(), acc_t(eps), y, mean_out, rstd_out, cols, begin, end);
    else
      layer_norm_chunk<false>(x, res, w.data(), b.data(), acc_t(eps), y, mean_out, rstd_out, cols, begin, end);
  });
}

// Backward of one row, in acc_t: x, res (HasRes) and g (grad_y) are the tensors' own rows for
// fp32/fp64 and converted copies for 16-bit inputs; dx receives the row's dx.
// Pass 1: xhat = (x + res - mean) * rstd in registers; g*w goes to gw (a scratch row in L1) and
// feeds the row sums of g*w and g*w*xhat; the chunk's dweight/dbias partials (dwp, dbp) are
// updated; with Large, the rows kAheadRows ahead (ahead_x/ahead_res/ahead_g, or null) are
// prefetched into L2.
// Pass 2 re-reads x, res (now in cache) and g*w and writes dx = rstd (g*w - mean(g*w) - xhat
// mean(g*w*xhat)), streamed with Large.  dx is touched once: before, g*w was kept in the dx row
// between the passes, which read every dx line from memory first.
template <bool HasRes, bool Large, typename acc_t, typename scalar_t>
inline void layer_norm_backward_row(const acc_t* x, const acc_t* res, const acc_t* g, acc_t* gw, acc_t* dx,
                                    acc_t mean, acc_t rstd, const acc_t* w, acc_t* dwp, acc_t* dbp, int64_t n,
                                    const scalar_t* ahead_x, const scalar_t* ahead_res, const scalar_t* ahead_g) {
  using Vec = at::vec::Vectorized<acc_t>;
  // g*w is stored between the passes, so the sums and dx see identically rounded values (held
  // in registers the compiler may contract g*w into the sum's FMA): with a constant row
  // (rstd = 1/sqrt(eps)) g*w - mean(g*w) must cancel exactly.  The last partial vector goes
  // through the same code with zero-padded loads (a zero g adds nothing to the sums).
  auto xhat = [&](int64_t j, auto load) {
    Vec h = load(x, j);
    if constexpr (HasRes) h = h + load(res, j);
    return (h - Vec(mean)) * Vec(rstd);
  };
  Vec s1(0), s2(0);
  for_each_vector<false>(gw, n, [&](int64_t j, auto load, auto store) {
    if constexpr (Large) {
      prefetch_l2(ahead_x, j);
      if constexpr (HasRes) prefetch_l2(ahead_res, j);
      prefetch_l2(ahead_g, j);
    }
    const Vec xh = xhat(j, load);
    const Vec gv = load(g, j);
    const Vec gwv = gv * load(w, j);
    store(gwv, gw, j);
    s1 = s1 + gwv;
    s2 = at::vec::fmadd(gwv, xh, s2);
    store(at::vec::fmadd(gv, xh, load(dwp, j)), dwp, j);
    store(load(dbp, j) + gv, dbp, j);
  });
  const Vec m1(lane_sum(s1) / n), m2(lane_sum(s2) / n);
  for_each_vector<Large>(dx, n, [&](int64_t j, auto load, auto store) {
    store(Vec(rstd) * (load(gw, j) - m1 - xhat(j, load) * m2), dx, j);
  });
}

// One thread's rows [r_begin, r_end): their dx, and their column sums of g*xhat and g into dw, db.
// The thread works in its own buffer (allocated here, by the thread): its copy of w, the
// dweight/dbias partials it updates every row, the g*w row and, for 16-bit inputs, the converted
// rows (see the top of the file for why).
template <bool Large, typename scalar_t, typename acc_t>
void layer_norm_backward_chunk(const scalar_t* dy, const scalar_t* x, const scalar_t* res, const acc_t* w_in,
                               const acc_t* mean, const acc_t* rstd, scalar_t* dx, acc_t* dw, acc_t* db,
                               int64_t cols, int64_t r_begin, int64_t r_end) {
  constexpr bool kDirect = std::is_same_v<acc_t, scalar_t>;
  const int64_t ld = (cols + 15) / 16 * 16;  // row stride in the buffer: whole lines
  RowBuffer<acc_t> buf((kDirect ? 4 : 8) * ld);
  acc_t *w = buf.get(0), *dwp = buf.get(ld), *dbp = buf.get(2 * ld), *gw = buf.get(3 * ld);
  auto conv = [&](int k) { return kDirect ? nullptr : buf.get((4 + k) * ld); };
  std::copy(w_in, w_in + cols, w);
  std::fill(dwp, dwp + cols, acc_t(0));
  std::fill(dbp, dbp + cols, acc_t(0));
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t off = r * cols, ahead = off + kAheadRows * cols;
    const acc_t* xr = load_row<acc_t>(x + off, conv(0), cols);
    const acc_t* rr = res ? load_row<acc_t>(res + off, conv(1), cols) : nullptr;
    const acc_t* gr = load_row<acc_t>(dy + off, conv(2), cols);
    acc_t* o = out_row<acc_t>(dx + off, conv(3));
    const bool more = r + kAheadRows < r_end;
    const scalar_t* ax = more ? x + ahead : nullptr;
    const scalar_t* ar = more && res ? res + ahead : nullptr;
    const scalar_t* ag = more ? dy + ahead : nullptr;
    if (res)
      layer_norm_backward_row<true, Large>(xr, rr, gr, gw, o, mean[r], rstd[r], w, dwp, dbp, cols, ax, ar, ag);
    else
      layer_norm_backward_row<false, Large>(xr, rr, gr, gw, o, mean[r], rstd[r], w, dwp, dbp, cols, ax, ar, ag);
    store_row<acc_t>(o, dx + off, cols);
  }
  if constexpr (Large) stream_fence();
  std::copy(dwp, dwp + cols, dw);
  std::copy(dbp, dbp + cols, db);
}

template <typename scalar_t>
void layer_norm_backward_rows(const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& res_,
                              const at::Tensor& w_, const at::Tensor& mean_, const at::Tensor& rstd_, at::Tensor& dx_,
                              at::Tensor& dw, at::Tensor& db) {
  using acc_t = acc_type<scalar_t>;
  const int64_t cols = last_dim(x_), rows = rows_of(x_);
  const auto w = param_acc<acc_t>(w_);
  const scalar_t* dy = dy_.data_ptr<scalar_t>();
  const scalar_t* x = x_.data_ptr<scalar_t>();
  const scalar_t* res = res_.defined() ? res_.data_ptr<scalar_t>() : nullptr;
  const acc_t* mean = mean_.data_ptr<acc_t>();
  const acc_t* rstd = rstd_.data_ptr<acc_t>();
  scalar_t* dx = dx_.data_ptr<scalar_t>();
  const int64_t chunks = num_chunks(rows, cols);
  const int64_t traffic = static_cast<int64_t>(dx_.nbytes()) * (res ? 4 : 3);
  const bool large = std::is_same_v<acc_t, scalar_t> && traffic >= kStreamTrafficBackward;
  // Per-chunk column sums in acc_t, then added in chunk order (dw of chunk c at 2c, db at 2c + 1).
  std::vector<acc_t> part(2 * chunks * cols);
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      acc_t *dwp = part.data() + 2 * c * cols, *dbp = dwp + cols;
      const int64_t r0 = c * rows / chunks, r1 = (c + 1) * rows / chunks;
      if (large)
        layer_norm_backward_chunk<true>(dy, x, res, w.data(), mean, rstd, dx, dwp, dbp, cols, r0, r1);
      else
        layer_norm_backward_chunk<false>(dy, x, res, w.data(), mean, rstd, dx, dwp, dbp, cols, r0, r1);
    }
  });
  sum_partials(part.data(), chunks, 2 * cols, dw);
  sum_partials(part.data() + cols, chunks, 2 * cols, db);
}

// y, and with stats the mean and rstd (undefined without).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(const at::Tensor& x,
                                                                  const c10::optional<at::Tensor>& residual,
                                                                  const at::Tensor& weight, const at::Tensor& bias,
                                                                  double eps, bool stats, const char* op) {
  TORCH_CHECK(x.dim() >= 1, op, ": input must have at least one dimension");
  check_param(x, weight, op, "weight");
  check_param(x, bias, op, "bias");
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    check_same(x, *residual, op, "residual");
    res = residual->contiguous();
  }
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  at::Tensor mean, rstd;
  if (stats) mean = stats_like(x), rstd = stats_like(x);
  if (x.numel() == 0) return {y, mean, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_layer_norm_cpu",
                                  [&] { layer_norm_rows<scalar_t>(xc, res, weight, bias, eps, y, mean, rstd); });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cpu(const at::Tensor& x,
                                                              const c10::optional<at::Tensor>& residual,
                                                              const at::Tensor& weight, const at::Tensor& bias,
                                                              double eps) {
  return layer_norm_forward(x, residual, weight, bias, eps, true, "bertctl::layer_norm");
}

at::Tensor layer_norm_inference_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                    const at::Tensor& weight, const at::Tensor& bias, double eps) {
  return std::get<0>(layer_norm_forward(x, residual, weight, bias, eps, false, "bertctl::layer_norm_inference"));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd) {
  const char* op = "bertctl::layer_norm_backward";
  check_same(x, grad_y, op, "grad_y");
  check_param(x, weight, op, "weight");
  TORCH_CHECK(mean.numel() == rows_of(x) && rstd.numel() == rows_of(x), op, ": mean/rstd must have ", rows_of(x),
              " elements");
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    check_same(x, *residual, op, "residual");
    res = residual->contiguous();
  }
  auto xc = x.contiguous(), dyc = grad_y.contiguous();
  auto mc = mean.contiguous().to(stats_dtype(x)), rc = rstd.contiguous().to(stats_dtype(x));
  auto dx = at::empty_like(xc);
  const int64_t cols = last_dim(x);
  // Both in the weight's dtype (the autograd node casts dbias to the bias's).
  auto dw = at::empty({cols}, weight.options()), db = at::empty({cols}, weight.options());
  if (x.numel() == 0) {
    dw.zero_();
    db.zero_();
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_layer_norm_backward_cpu", [&] {
      layer_norm_backward_rows<scalar_t>(dyc, xc, res, weight, mc, rc, dx, dw, db);
    });
  }
  return {dx, dw, db};
}

// --- bias + dropout + residual + LayerNorm ---------------------------------------------------
// y = LayerNorm(dropout(x + bias) + residual): BERT's post-LN sub-layer output, x the matmul's
// output without its bias.  h = dropout(x + bias) + residual exists only as a row in L1: the
// forward reads x and residual and writes y (apart: the bias add inside the matmul, dropout reading
// and writing a tensor, then LayerNorm reading two and writing y); the backward recomputes h and
// the mask from x, bias, residual and (p, seed), as layer_norm's backward re-adds x + residual,
// and writes dresidual (= dh) and dx = dh * mask / (1 - p), with dbias as dx's column sums: 5
// activation-sized tensors against the separate ops' 7 (LayerNorm's 4, dropout's 2, the matmul's
// bias gradient reading dx).  The mask is dropout_mask.h's, the same as bertctl::dropout's for one
// (p, seed).  With p = 0 (eval) it is bias + add + LayerNorm, and dx is dresidual, not written.
// The backward also runs from the output y (fp32/fp64, weights the autograd node judged well
// conditioned): xhat = (y - ln_bias) / w, with only the mask recomputed; it reads dy and y, 4 tensors
// in all with dropout, and nothing but y, which the next layer keeps anyway, need be kept for it.

// Pre-pass of a row: h = (x + bias) * k + res, k = 1 / (1 - p) where the mask keeps element
// index0 + j, else 0 (kept in ks when ks is not null, for the backward's dx); h = x + bias + res
// without dropout.  A scalar loop: `omp simd` vectorises the 32-bit hash with it.
template <bool Drop, typename acc_t>
inline void bias_dropout_add_row(const acc_t* x, const acc_t* bias, const acc_t* res, acc_t* h, acc_t* ks,
                                 int64_t n, int64_t index0, const DropoutMask& mask, acc_t scale) {
  if constexpr (Drop) {
    const DropoutMask m = mask;  // key and threshold in registers
    if (ks) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const acc_t k = m.keep(index0 + j) ? scale : acc_t(0);
        ks[j] = k;
        h[j] = (x[j] + bias[j]) * k + res[j];
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        h[j] = (x[j] + bias[j]) * (m.keep(index0 + j) ? scale : acc_t(0)) + res[j];
      }
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) h[j] = x[j] + bias[j] + res[j];
  }
}

template <bool Drop, bool Large, typename scalar_t, typename acc_t>
void bias_dropout_add_layer_norm_chunk(const scalar_t* x, const acc_t* bias_in, const scalar_t* res,
                                       const acc_t* w_in, const acc_t* b_in, acc_t eps, const DropoutMask& mask,
                                       acc_t scale, scalar_t* y, acc_t* mean_out, acc_t* rstd_out, int64_t cols,
                                       int64_t begin, int64_t end) {
  // This thread's line-aligned copies of the parameters, the h row and (16-bit) conversion rows.
  const int64_t ld = (cols + 15) / 16 * 16;
  RowBuffer<acc_t> bufs(7 * ld);
  acc_t *bias = bufs.get(0), *w = bufs.get(ld), *b = bufs.get(2 * ld), *h = bufs.get(3 * ld);
  acc_t *xbuf = bufs.get(4 * ld), *rbuf = bufs.get(5 * ld), *out_buf = bufs.get(6 * ld);
  std::copy(bias_in, bias_in + cols, bias);
  std::copy(w_in, w_in + cols, w);
  std::copy(b_in, b_in + cols, b);
  for (int64_t r = begin; r < end; ++r) {
    const acc_t* xr = load_row<acc_t>(x + r * cols, xbuf, cols);
    const acc_t* rr = load_row<acc_t>(res + r * cols, rbuf, cols);
    bias_dropout_add_row<Drop>(xr, bias, rr, h, static_cast<acc_t*>(nullptr), cols, r * cols, mask, scale);
    acc_t mean, var;
    moments_row<acc_t>(h, static_cast<const acc_t*>(nullptr), nullptr, nullptr, cols, mean, var);  // h from L1
    const acc_t rstd = acc_t(1) / std::sqrt(var + eps);
    mean_out[r] = mean;
    rstd_out[r] = rstd;
    normalize_row<Large>(h, mean, rstd, w, b, y + r * cols, out_buf, cols,
                         r + 1 < end ? x + (r + 1) * cols : nullptr, r + 1 < end ? res + (r + 1) * cols : nullptr);
  }
  if constexpr (Large) stream_fence();
}

// The per-thread parameter rows of the backward from the output y: the LayerNorm's bias b and 1/w, so
// that xhat = (y - b) * (1/w).  The autograd node takes this path only for fp32/fp64 outputs and
// weights that keep it accurate (backward_from_output in ../autograd.cpp): every |w| far from 0 and
// |b| <= 64 |w|, so that y's rounding moves xhat by at most about 2^-24 (|xhat| + 64).
template <typename acc_t>
inline void output_params(const acc_t* w, const acc_t* b_in, acc_t* b, acc_t* iw, int64_t cols) {
  std::copy(b_in, b_in + cols, b);
  for (int64_t j = 0; j < cols; ++j) iw[j] = acc_t(1) / w[j];
}

// The output is fp32 or fp64: a 16-bit y is too coarse to give xhat back (see output_params).
void check_output(const at::Tensor& y, const char* op) {
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kDouble, op,
              ": y must be float32 or float64, got ", y.scalar_type());
}

// The factors k of a row's mask (1 / (1 - p) where element index0 + j is kept, else 0) into ks.
template <typename acc_t>
inline void dropout_factor_row(acc_t* ks, int64_t n, int64_t index0, const DropoutMask& mask, acc_t scale) {
  const DropoutMask m = mask;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) ks[j] = m.keep(index0 + j) ? scale : acc_t(0);
}

// One thread's rows [r_begin, r_end) of the backward: their dresidual (= dh) and dx, and their
// column sums of g*xhat, g (dweight, dln_bias) and dx (dbias) into dwp, dbp, dxbp.  Per row: the
// pre-pass recomputes h (and the mask's factors k) into L1 rows, pass 1 is layer_norm's (g*w into
// a scratch row, its row sums, the partials), pass 2 writes dh and dx = dh * k together (both
// streamed with Large) and adds dx to the dbias partial.  Without dropout dx is dh, and only dh
// is written.  FromOutput: x is the output y, xhat comes from it, ln_b_in and 1/w (see
// output_params), and the pre-pass makes only the mask's factors; res and mean are not used.
template <bool Drop, bool Large, bool FromOutput, typename scalar_t, typename acc_t>
void bias_dropout_add_layer_norm_backward_chunk(const scalar_t* dy, const scalar_t* x, const acc_t* bias_in,
                                                const scalar_t* res, const acc_t* w_in, const acc_t* ln_b_in,
                                                const acc_t* mean, const acc_t* rstd, const DropoutMask& mask,
                                                acc_t scale, scalar_t* dres, scalar_t* dx, acc_t* dw, acc_t* db,
                                                acc_t* dbias, int64_t cols, int64_t r_begin, int64_t r_end) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr bool kDirect = std::is_same_v<acc_t, scalar_t>;
  const int64_t ld = (cols + 15) / 16 * 16;
  RowBuffer<acc_t> buf((kDirect ? 10 : 15) * ld);
  acc_t *bias = buf.get(0), *w = buf.get(ld), *dwp = buf.get(2 * ld), *dbp = buf.get(3 * ld);
  acc_t *dxbp = buf.get(4 * ld), *gw = buf.get(5 * ld), *h = buf.get(6 * ld), *ks = buf.get(7 * ld);
  acc_t *ln_b = buf.get(8 * ld), *iw = buf.get(9 * ld);
  auto conv = [&](int k) { return kDirect ? nullptr : buf.get((10 + k) * ld); };
  std::copy(bias_in, bias_in + cols, bias);
  std::copy(w_in, w_in + cols, w);
  if constexpr (FromOutput) output_params(w, ln_b_in, ln_b, iw, cols);
  std::fill(dwp, dwp + cols, acc_t(0));
  std::fill(dbp, dbp + cols, acc_t(0));
  std::fill(dxbp, dxbp + cols, acc_t(0));
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t off = r * cols, ahead = off + kAheadRows * cols;
    const acc_t* xr = load_row<acc_t>(x + off, conv(0), cols);
    const acc_t* rr = FromOutput ? nullptr : load_row<acc_t>(res + off, conv(1), cols);
    const acc_t* g = load_row<acc_t>(dy + off, conv(2), cols);
    acc_t* dh_out = out_row<acc_t>(dres + off, conv(3));
    acc_t* dx_out = Drop ? out_row<acc_t>(dx + off, conv(4)) : nullptr;
    const bool more = Large && r + kAheadRows < r_end;
    const scalar_t* ax = more ? x + ahead : nullptr;
    const scalar_t* ar = more && !FromOutput ? res + ahead : nullptr;
    const scalar_t* ag = more ? dy + ahead : nullptr;
    const Vec vmean(FromOutput ? acc_t(0) : mean[r]), vrstd(rstd[r]);
    // xhat at column j, the loads given (full or partial vectors).
    auto xhat = [&](int64_t j, auto load) {
      if constexpr (FromOutput) {
        return (load(xr, j) - load(ln_b, j)) * load(iw, j);
      } else {
        return (load(h, j) - vmean) * vrstd;
      }
    };
    if constexpr (FromOutput) {
      if constexpr (Drop) dropout_factor_row(ks, cols, off, mask, scale);
    } else {
      bias_dropout_add_row<Drop>(xr, bias, rr, h, ks, cols, off, mask, scale);
    }
    Vec s1(0), s2(0);
    for_each_vector<false>(gw, cols, [&](int64_t j, auto load, auto store) {
      if constexpr (Large) {
        prefetch_l2(ax, j);
        prefetch_l2(ar, j);
        prefetch_l2(ag, j);
      }
      const Vec xh = xhat(j, load);
      const Vec gv = load(g, j);
      const Vec gwv = gv * load(w, j);
      store(gwv, gw, j);  // rounded once, as in layer_norm_backward_row
      s1 = s1 + gwv;
      s2 = at::vec::fmadd(gwv, xh, s2);
      store(at::vec::fmadd(gv, xh, load(dwp, j)), dwp, j);
      store(load(dbp, j) + gv, dbp, j);
    });
    const Vec m1(lane_sum(s1) / cols), m2(lane_sum(s2) / cols);
    // Pass 2 over columns [j, j + count), count <= W, as for_each_vector lays them (a partial head vector up to
    // dh_out's first boundary with Large, full vectors, a partial tail), but by hand: its stores to the dbias
    // partial row are never streamed.
    auto pass2 = [&](int64_t j, int64_t count) {
      auto load = [&](const acc_t* q, int64_t k) { return count == W ? Vec::loadu(q + k) : Vec::loadu(q + k, count); };
      const Vec dh = vrstd * (load(gw, j) - m1 - xhat(j, load) * m2);
      const Vec d = Drop ? dh * load(ks, j) : dh;
      const Vec part = load(dxbp, j) + d;
      if (count < W) {
        part.store(dxbp + j, count);
        dh.store(dh_out + j, count);
        if constexpr (Drop) d.store(dx_out + j, count);
      } else if constexpr (Large) {
        part.store(dxbp + j);
        stream_store(dh, dh_out + j);
        if constexpr (Drop) stream_store(d, dx_out + j);
      } else {
        part.store(dxbp + j);
        dh.store(dh_out + j);
        if constexpr (Drop) d.store(dx_out + j);
      }
    };
    int64_t j = 0;
    if constexpr (Large) {
      j = std::min(cols, to_vector_boundary(dh_out));
      if (j > 0) pass2(0, j);
    }
    for (; j + W <= cols; j += W) pass2(j, W);
    if (j < cols) pass2(j, cols - j);
    store_row<acc_t>(dh_out, dres + off, cols);
    if constexpr (Drop) store_row<acc_t>(dx_out, dx + off, cols);
  }
  if constexpr (Large) stream_fence();
  std::copy(dwp, dwp + cols, dw);
  std::copy(dbp, dbp + cols, db);
  std::copy(dxbp, dxbp + cols, dbias);
}

// The mask of (p, seed), or one that keeps everything (p = 0: no seed needed, none read).
DropoutMask mask_of(double p, const c10::optional<at::Tensor>& seed, const char* op) {
  return p > 0 ? DropoutMask(p, *seed, op) : DropoutMask();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_cpu(
    const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual, const at::Tensor& weight,
    const at::Tensor& ln_bias, double eps, double p, const c10::optional<at::Tensor>& seed) {
  const char* op = "bertctl::bias_dropout_add_layer_norm";
  check_bias_dropout_add_layer_norm(x, bias, residual, weight, p, seed, op);
  check_param(x, ln_bias, op, "ln_bias");
  const DropoutMask mask = mask_of(p, seed, op);
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto y = at::empty_like(xc);
  auto mean = stats_like(x), rstd = stats_like(x);
  if (x.numel() == 0) return {y, mean, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_bdaln_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const int64_t cols = last_dim(x), rows = rows_of(x);
    const auto bv = param_acc<acc_t>(bias), wv = param_acc<acc_t>(weight), lbv = param_acc<acc_t>(ln_bias);
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* rp = rc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    acc_t *mp = mean.data_ptr<acc_t>(), *sp = rstd.data_ptr<acc_t>();
    const acc_t scale = static_cast<acc_t>(1.0 / (1.0 - p));
    // Streaming stores as layer_norm's forward (reads x, residual; writes y).
    const bool large = std::is_same_v<acc_t, scalar_t> &&
                       static_cast<int64_t>(y.nbytes()) * 3 >= kStreamTrafficForward;
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      with_bools(p > 0, large, [&](auto drop, auto streamed) {
        bias_dropout_add_layer_norm_chunk<decltype(drop)::value, decltype(streamed)::value>(
            xp, bv.data(), rp, wv.data(), lbv.data(), acc_t(eps), mask, scale, yp, mp, sp, cols, begin, end);
      });
    });
  });
  return {y, mean, rstd};
}

// (dx, dbias, dresidual, dweight, dln_bias); dx has 0 elements when p = 0 (it is dresidual: the
// autograd node passes that on), dbias has the bias's dtype, dweight and dln_bias the weight's.
// From the input (x, residual, mean) or, with ln_bias defined, from the output (x is y).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bdaln_backward_impl(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
    const at::Tensor& weight, const at::Tensor& ln_bias, const at::Tensor& mean, const at::Tensor& rstd, double p,
    const c10::optional<at::Tensor>& seed, const char* op) {
  check_same(x, grad_y, op, "grad_y");
  TORCH_CHECK(rstd.numel() == rows_of(x) && (!mean.defined() || mean.numel() == rows_of(x)), op,
              ": the statistics must have ", rows_of(x), " elements");
  const bool from_output = ln_bias.defined();
  const DropoutMask mask = mask_of(p, seed, op);
  auto xc = x.contiguous(), dyc = grad_y.contiguous();
  auto rc = from_output ? at::Tensor() : residual.contiguous();
  auto mc = from_output ? at::Tensor() : mean.contiguous().to(stats_dtype(x));
  auto sc = rstd.contiguous().to(stats_dtype(x));
  auto dres = at::empty_like(xc);
  auto dx = p > 0 ? at::empty_like(xc) : at::empty({0}, x.options());
  const int64_t cols = last_dim(x), rows = rows_of(x);
  auto dbias = at::empty({cols}, bias.options());
  auto dw = at::empty({cols}, weight.options()), db = at::empty({cols}, weight.options());
  if (x.numel() == 0) {
    dbias.zero_();
    dw.zero_();
    db.zero_();
    return {dx, dbias, dres, dw, db};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_bdaln_backward_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const auto bv = param_acc<acc_t>(bias), wv = param_acc<acc_t>(weight);
    const auto lbv = from_output ? param_acc<acc_t>(ln_bias) : std::vector<acc_t>();
    const scalar_t* dyp = dyc.data_ptr<scalar_t>();
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* rp = from_output ? nullptr : rc.data_ptr<scalar_t>();
    const acc_t* mp = from_output ? nullptr : mc.data_ptr<acc_t>();
    const acc_t* sp = sc.data_ptr<acc_t>();
    scalar_t* dresp = dres.data_ptr<scalar_t>();
    scalar_t* dxp = p > 0 ? dx.data_ptr<scalar_t>() : nullptr;
    const acc_t scale = static_cast<acc_t>(1.0 / (1.0 - p));
    const int64_t chunks = num_chunks(rows, cols);
    // Streaming as layer_norm's backward (reads dy and x, residual or y; writes dresidual and, with
    // dropout, dx); both outputs' vectors are laid on dresidual's boundaries, so dx must share its
    // alignment.
    const int64_t traffic = static_cast<int64_t>(dres.nbytes()) * ((p > 0 ? 5 : 4) - (from_output ? 1 : 0));
    const bool large = std::is_same_v<acc_t, scalar_t> && traffic >= kStreamTrafficBackward &&
                       (dxp == nullptr || to_vector_boundary(dxp) == to_vector_boundary(dresp));
    // Per-chunk column sums in acc_t, added in chunk order (chunk c: dweight, dln_bias, dbias at 3c..3c+2).
    std::vector<acc_t> part(3 * chunks * cols);
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        acc_t* dwp = part.data() + 3 * c * cols;
        const int64_t r0 = c * rows / chunks, r1 = (c + 1) * rows / chunks;
        with_bools(p > 0, large, [&](auto drop, auto streamed) {
          constexpr bool kDrop = decltype(drop)::value, kLarge = decltype(streamed)::value;
          if (from_output)
            bias_dropout_add_layer_norm_backward_chunk<kDrop, kLarge, true>(
                dyp, xp, bv.data(), rp, wv.data(), lbv.data(), mp, sp, mask, scale, dresp, dxp, dwp, dwp + cols,
                dwp + 2 * cols, cols, r0, r1);
          else
            bias_dropout_add_layer_norm_backward_chunk<kDrop, kLarge, false>(
                dyp, xp, bv.data(), rp, wv.data(), lbv.data(), mp, sp, mask, scale, dresp, dxp, dwp, dwp + cols,
                dwp + 2 * cols, cols, r0, r1);
        });
      }
    });
    sum_partials(part.data(), chunks, 3 * cols, dw);
    sum_partials(part.data() + cols, chunks, 3 * cols, db);
    sum_partials(part.data() + 2 * cols, chunks, 3 * cols, dbias);
  });
  return {dx, dbias, dres, dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double p,
    const c10::optional<at::Tensor>& seed) {
  const char* op = "bertctl::bias_dropout_add_layer_norm_backward";
  check_bias_dropout_add_layer_norm(x, bias, residual, weight, p, seed, op);
  return bdaln_backward_impl(grad_y, x, bias, residual, weight, at::Tensor(), mean, rstd, p, seed, op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
bias_dropout_add_layer_norm_backward_from_output_cpu(const at::Tensor& grad_y, const at::Tensor& y,
                                                     const at::Tensor& bias, const at::Tensor& weight,
                                                     const at::Tensor& ln_bias, const at::Tensor& rstd, double p,
                                                     const c10::optional<at::Tensor>& seed) {
  const char* op = "bertctl::bias_dropout_add_layer_norm_backward_from_output";
  check_output(y, op);
  check_bias_dropout_add_layer_norm(y, bias, y, weight, p, seed, op);
  check_param(y, ln_bias, op, "ln_bias");
  return bdaln_backward_impl(grad_y, y, bias, at::Tensor(), weight, ln_bias, at::Tensor(), rstd, p, seed, op);
}

}  // namespace
}  // namespace bertctl::cpu

TORCH_LIBRARY_IMPL(bertctl, CPU, m) {
  m.impl("layer_norm", &bertctl::cpu::layer_norm_cpu);
  m.impl("layer_norm_inference", &bertctl::cpu::layer_norm_inference_cpu);
  m.impl("layer_norm_backward", &bertctl::cpu::layer_norm_backward_cpu);
  m.impl("bias_dropout_add_layer_norm", &bertctl::cpu::bias_dropout_add_layer_norm_cpu);
  m.impl("bias_dropout_add_layer_norm_backward", &bertctl::cpu::bias_dropout_add_layer_norm_backward_cpu);
  m.impl("bias_dropout_add_layer_norm_backward_from_output",
         &bertctl::cpu::bias_dropout_add_layer_norm_backward_from_output_cpu);
}
