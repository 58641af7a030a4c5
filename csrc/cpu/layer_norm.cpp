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

// h = x + residual (into buf; or x itself), and its sum.
template <typename acc_t, typename scalar_t>
inline const acc_t* sum_row(const scalar_t* x, const scalar_t* res, acc_t* buf, acc_t* buf2, int64_t n,
                            acc_t* sum = nullptr) {
  using Vec = at::vec::Vectorized<acc_t>;
  auto add = [](const Vec& p, const Vec& q) { return p + q; };
  const acc_t* h = load_row<acc_t>(x, buf, n);
  if (res == nullptr) {
    if (sum) *sum = reduce_row<acc_t>(n, acc_t(0), [&](int64_t j) { return Vec::loadu(h + j); },
                                      [&](int64_t j) { return h[j]; }, add, scalar_add<acc_t>);
    return h;
  }
  const acc_t* rr = load_row<acc_t>(res, buf2, n);
  const acc_t s = reduce_row<acc_t>(
      n, acc_t(0),
      [&](int64_t j) {
        Vec t = Vec::loadu(h + j) + Vec::loadu(rr + j);
        t.store(buf + j);
        return t;
      },
      [&](int64_t j) { return buf[j] = h[j] + rr[j]; }, add, scalar_add<acc_t>);
  if (sum) *sum = s;
  return buf;
}

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
      for (; j + Vec::size() <= cols; j += Vec::size())
        at::vec::fmadd((Vec::loadu(h + j) - Vec(mean)) * Vec(rstd), Vec::loadu(w.data() + j), Vec::loadu(b.data() + j))
            .store(o + j);
      for (; j < cols; ++j) o[j] = (h[j] - mean) * rstd * w[j] + b[j];
      store_row<acc_t>(o, y + r * cols, cols);
    }
  });
}

template <typename scalar_t>
void layer_norm_backward_rows(const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& res_,
                              const at::Tensor& w_, const at::Tensor& mean_, const at::Tensor& rstd_, at::Tensor& dx_,
                              double* dw_sum, double* db_sum) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
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
    std::vector<acc_t> buf(cols), buf2(cols), gbuf(cols), xhat(cols), out_buf(cols);
    for (int64_t c = cb; c < ce; ++c) {
      acc_t* dwp = dw_part.data() + c * cols;
      acc_t* dbp = db_part.data() + c * cols;
      for (int64_t r = c * rows / chunks; r < (c + 1) * rows / chunks; ++r) {
        const acc_t* h = sum_row<acc_t>(x + r * cols, res ? res + r * cols : nullptr, buf.data(), buf2.data(), cols);
        const acc_t* g = load_row<acc_t>(dy + r * cols, gbuf.data(), cols);
        const acc_t mu = mean[r], rs = rstd[r];
        // xhat, g*w (kept in the output row, so the sums and dx use the same rounded values),
        // and the two row sums of g*w and g*w*xhat.
        acc_t* o = out_row<acc_t>(dx + r * cols, out_buf.data());
        Vec s1(0), s2(0);
        int64_t j = 0;
        for (; j + Vec::size() <= cols; j += Vec::size()) {
          Vec xh = (Vec::loadu(h + j) - Vec(mu)) * Vec(rs);
          Vec gv = Vec::loadu(g + j);
          Vec gw = gv * Vec::loadu(w.data() + j);
          xh.store(xhat.data() + j);
          gw.store(o + j);
          s1 = s1 + gw;
          s2 = s2 + gw * xh;
          (Vec::loadu(dwp + j) + gv * xh).store(dwp + j);
          (Vec::loadu(dbp + j) + gv).store(dbp + j);
        }
        auto add = [](Vec& p, Vec& q) { return p + q; };
        acc_t sum1 = at::vec::vec_reduce_all<acc_t>(add, s1), sum2 = at::vec::vec_reduce_all<acc_t>(add, s2);
        for (; j < cols; ++j) {
          const acc_t xh = (h[j] - mu) * rs, gw = g[j] * w[j];
          xhat[j] = xh;
          o[j] = gw;
          sum1 += gw;
          sum2 += gw * xh;
          dwp[j] += g[j] * xh;
          dbp[j] += g[j];
        }
        // dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat))
        const acc_t c1 = sum1 / cols, c2 = sum2 / cols;
        j = 0;
        for (; j + Vec::size() <= cols; j += Vec::size())
          (Vec(rs) * (Vec::loadu(o + j) - Vec(c1) - Vec::loadu(xhat.data() + j) * Vec(c2))).store(o + j);
        for (; j < cols; ++j) o[j] = rs * (o[j] - c1 - xhat[j] * c2);
        store_row<acc_t>(o, dx + r * cols, cols);
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
