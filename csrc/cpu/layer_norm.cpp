// CPU LayerNorm(x + residual) over the last dim and its backward.
// Forward: parallel over rows; per row one pass forms h = x + residual with the
// sums of d = h - h[0] and d^2 (mean and variance of shifted data), a second
// writes y = (h - mean) * rstd * w + b.  Backward: rows split into one chunk per
// thread; dweight/dbias partial sums per chunk are added in chunk order.
#include <cmath>

#include "../common.h"
#include "cpu_util.h"

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

template <typename scalar_t>
void layer_norm_rows(const at::Tensor& x_, const at::Tensor& res_, const at::Tensor& w_, const at::Tensor& b_,
                     double eps, at::Tensor& y_, at::Tensor& mean_, at::Tensor& rstd_) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t cols = last_dim(x_), rows = rows_of(x_);
  const auto w = param_acc<acc_t>(w_), b = param_acc<acc_t>(b_);
  const scalar_t* x = x_.data_ptr<scalar_t>();
  const scalar_t* res = res_.defined() ? res_.data_ptr<scalar_t>() : nullptr;
  scalar_t* y = y_.data_ptr<scalar_t>();
  acc_t* mean_out = mean_.data_ptr<acc_t>();
  acc_t* rstd_out = rstd_.data_ptr<acc_t>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(cols), buf2(cols), out_buf(cols);
    for (int64_t r = begin; r < end; ++r) {
      acc_t mean, var;
      const acc_t* h = moments_row<acc_t>(x + r * cols, res ? res + r * cols : nullptr, buf.data(), buf2.data(),
                                          cols, mean, var);
      const acc_t rstd = acc_t(1) / std::sqrt(var + static_cast<acc_t>(eps));
      mean_out[r] = mean;
      rstd_out[r] = rstd;
      acc_t* o = out_row<acc_t>(y + r * cols, out_buf.data());
      int64_t j = 0;
      // The next row is prefetched while this one is written (see prefetch in cpu_util.h).
      const scalar_t* nx = r + 1 < end ? x + (r + 1) * cols : nullptr;
      const scalar_t* nr = r + 1 < end && res ? res + (r + 1) * cols : nullptr;
      for (; j + Vec::size() <= cols; j += Vec::size()) {
        prefetch(nx, j);
        prefetch(nr, j);
        at::vec::fmadd((Vec::loadu(h + j) - Vec(mean)) * Vec(rstd), Vec::loadu(w.data() + j), Vec::loadu(b.data() + j))
            .store(o + j);
      }
      for (; j < cols; ++j) o[j] = (h[j] - mean) * rstd * w[j] + b[j];
      store_row<acc_t>(o, y + r * cols, cols);
    }
  });
}

// Backward of one row, in acc_t: x, res (HasRes) and g (grad_y) are the tensors' own rows for
// fp32/fp64 and converted copies for 16-bit inputs; dx receives the row's dx.
// Pass 1: xhat = (x + res - mean) * rstd in registers; g*w feeds the row sums of g*w and
// g*w*xhat, and the chunk's dweight/dbias partials (dwp, dbp: L1-resident rows) are updated.
// Pass 2 re-reads x, res and g*w from L1 and writes dx = rstd (g*w - mean(g*w) - xhat mean(g*w*xhat)),
// while prefetching the next row (next_x/next_res/next_g, or null), so that its pass 1 does not
// wait on memory: without it this loop ran at ~60% of the forward's bandwidth.
template <bool HasRes, typename acc_t, typename scalar_t>
inline void layer_norm_backward_row(const acc_t* x, const acc_t* res, const acc_t* g, acc_t* dx, acc_t mean,
                                    acc_t rstd, const acc_t* w, acc_t* dwp, acc_t* dbp, int64_t n,
                                    const scalar_t* next_x, const scalar_t* next_res, const scalar_t* next_g) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  // g*w is kept in the dx row between the passes (in L1), so the sums and dx see identically
  // rounded values (held in registers the compiler may contract g*w into the sum's FMA): with a
  // constant row (rstd = 1/sqrt(eps)) g*w - mean(g*w) must cancel exactly.  The last partial
  // vector goes through the same code with zero-padded loads (a zero g adds nothing to the sums).
  // Each pass is a body(j, load, store) run over the full vectors, then once over the tail.
  const int64_t n_full = n - n % W;
  auto full_load = [](const acc_t* p, int64_t j) { return Vec::loadu(p + j); };
  auto full_store = [](const Vec& v, acc_t* p, int64_t j) { v.store(p + j); };
  auto tail_load = [n](const acc_t* p, int64_t j) { return Vec::loadu(p + j, n - j); };
  auto tail_store = [n](const Vec& v, acc_t* p, int64_t j) { v.store(p + j, n - j); };
  auto xhat = [&](int64_t j, auto load) {
    Vec h = load(x, j);
    if constexpr (HasRes) h = h + load(res, j);
    return (h - Vec(mean)) * Vec(rstd);
  };
  Vec s1(0), s2(0);
  auto pass1 = [&](int64_t j, auto load, auto store) {
    const Vec xh = xhat(j, load);
    const Vec gv = load(g, j);
    const Vec gw = gv * load(w, j);
    store(gw, dx, j);
    s1 = s1 + gw;
    s2 = at::vec::fmadd(gw, xh, s2);
    store(at::vec::fmadd(gv, xh, load(dwp, j)), dwp, j);
    store(load(dbp, j) + gv, dbp, j);
  };
  for (int64_t j = 0; j < n_full; j += W) pass1(j, full_load, full_store);
  if (n_full < n) pass1(n_full, tail_load, tail_store);
  auto add = [](Vec& p, Vec& q) { return p + q; };
  const Vec m1(at::vec::vec_reduce_all<acc_t>(add, s1) / n), m2(at::vec::vec_reduce_all<acc_t>(add, s2) / n);
  auto pass2 = [&](int64_t j, auto load, auto store) {
    prefetch(next_x, j);
    if constexpr (HasRes) prefetch(next_res, j);
    prefetch(next_g, j);
    store(Vec(rstd) * (load(dx, j) - m1 - xhat(j, load) * m2), dx, j);
  };
  for (int64_t j = 0; j < n_full; j += W) pass2(j, full_load, full_store);
  if (n_full < n) pass2(n_full, tail_load, tail_store);
}

template <typename scalar_t>
void layer_norm_backward_rows(const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& res_,
                              const at::Tensor& w_, const at::Tensor& mean_, const at::Tensor& rstd_, at::Tensor& dx_,
                              double* dw_sum, double* db_sum) {
  using acc_t = acc_type<scalar_t>;
  const int64_t cols = last_dim(x_), rows = rows_of(x_);
  const auto w = param_acc<acc_t>(w_);
  const scalar_t* dy = dy_.data_ptr<scalar_t>();
  const scalar_t* x = x_.data_ptr<scalar_t>();
  const scalar_t* res = res_.defined() ? res_.data_ptr<scalar_t>() : nullptr;
  const acc_t* mean = mean_.data_ptr<acc_t>();
  const acc_t* rstd = rstd_.data_ptr<acc_t>();
  scalar_t* dx = dx_.data_ptr<scalar_t>();
  const int64_t chunks = num_chunks(rows);
  // Per-chunk column sums in acc_t, then added in chunk order.
  std::vector<acc_t> dw_part(chunks * cols, acc_t(0)), db_part(chunks * cols, acc_t(0));
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    // 16-bit inputs: the row of x, res, dy and dx converted to / from acc_t.
    constexpr bool kDirect = std::is_same_v<acc_t, scalar_t>;
    std::vector<acc_t> buf(kDirect ? 0 : 4 * cols);
    for (int64_t c = cb; c < ce; ++c) {
      acc_t* dwp = dw_part.data() + c * cols;
      acc_t* dbp = db_part.data() + c * cols;
      const int64_t r_end = (c + 1) * rows / chunks;
      for (int64_t r = c * rows / chunks; r < r_end; ++r) {
        const int64_t off = r * cols, next = r + 1 < r_end ? off + cols : -1;
        const acc_t* xr = load_row<acc_t>(x + off, buf.data(), cols);
        const acc_t* rr = res ? load_row<acc_t>(res + off, buf.data() + cols, cols) : nullptr;
        const acc_t* gr = load_row<acc_t>(dy + off, buf.data() + 2 * cols, cols);
        acc_t* o = out_row<acc_t>(dx + off, buf.data() + 3 * cols);
        const scalar_t* nx = next >= 0 ? x + next : nullptr;
        const scalar_t* nr = next >= 0 && res ? res + next : nullptr;
        const scalar_t* ng = next >= 0 ? dy + next : nullptr;
        if (res)
          layer_norm_backward_row<true>(xr, rr, gr, o, mean[r], rstd[r], w.data(), dwp, dbp, cols, nx, nr, ng);
        else
          layer_norm_backward_row<false>(xr, rr, gr, o, mean[r], rstd[r], w.data(), dwp, dbp, cols, nx, nr, ng);
        store_row<acc_t>(o, dx + off, cols);
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t j = 0; j < cols; ++j) {
      dw_sum[j] += dw_part[c * cols + j];
      db_sum[j] += db_part[c * cols + j];
    }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cpu(const at::Tensor& x,
                                                              const c10::optional<at::Tensor>& residual,
                                                              const at::Tensor& weight, const at::Tensor& bias,
                                                              double eps) {
  const char* op = "bertctl::layer_norm";
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
  auto mean = stats_like(x), rstd = stats_like(x);
  if (x.numel() == 0) return {y, mean, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_layer_norm_cpu",
                                  [&] { layer_norm_rows<scalar_t>(xc, res, weight, bias, eps, y, mean, rstd); });
  return {y, mean, rstd};
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
  auto dw = at::zeros({cols}, x.options().dtype(at::kDouble)), db = at::zeros({cols}, x.options().dtype(at::kDouble));
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_layer_norm_backward_cpu", [&] {
      layer_norm_backward_rows<scalar_t>(dyc, xc, res, weight, mc, rc, dx, dw.data_ptr<double>(), db.data_ptr<double>());
    });
  }
  return {dx, dw.to(weight.scalar_type()), db.to(weight.scalar_type())};
}

}  // namespace
}  // namespace bertctl::cpu

TORCH_LIBRARY_IMPL(bertctl, CPU, m) {
  m.impl("layer_norm", &bertctl::cpu::layer_norm_cpu);
  m.impl("layer_norm_backward", &bertctl::cpu::layer_norm_backward_cpu);
}
