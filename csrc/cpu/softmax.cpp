// CPU softmax(scale * x + mask) over the last dim and its backward.
// Parallel over rows (at::parallel_for); each row is vectorised with
// at::vec::Vectorized in the accumulation type (fp32, or fp64 for double).
#include <limits>

#include "../common.h"
#include "cpu_util.h"

namespace bertctl::cpu {
namespace {

template <typename scalar_t>
void softmax_rows(const SoftmaxArgs& a, double scale_d, at::Tensor& y) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t rows = a.rows, cols = a.cols;
  const acc_t scale = static_cast<acc_t>(scale_d);
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  // The mask as additive values in acc_t: (B, Sk), or empty.
  std::vector<acc_t> mask;
  if (a.kind == MaskKind::kBool) {
    const bool* m = a.mask.data_ptr<bool>();
    mask.resize(a.mask.numel());
    for (int64_t i = 0; i < a.mask.numel(); ++i) mask[i] = m[i] ? acc_t(0) : ninf;
  } else if (a.kind == MaskKind::kFloat) {
    const float* m = a.mask.data_ptr<float>();
    mask.assign(m, m + a.mask.numel());
  }
  const scalar_t* x = a.x.data_ptr<scalar_t>();
  scalar_t* out = y.data_ptr<scalar_t>();
  const int64_t W = Vec::size();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> in_buf(cols), out_buf(cols);
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* xr = load_row<acc_t>(x + r * cols, in_buf.data(), cols);
      acc_t* v = out_row<acc_t>(out + r * cols, out_buf.data());
      const acc_t* m = mask.empty() ? nullptr : mask.data() + (r / a.rows_per_batch) * cols;
      // v = scale * x + mask, and its max.
      const Vec vs(scale);
      auto vmax = [](const Vec& p, const Vec& q) { return at::vec::maximum(p, q); };
      const acc_t mx = reduce_row<acc_t>(
          cols, ninf,
          [&](int64_t j) {
            Vec t = Vec::loadu(xr + j) * vs;
            if (m) t = t + Vec::loadu(m + j);
            t.store(v + j);
            return t;
          },
          [&](int64_t j) { return v[j] = xr[j] * scale + (m ? m[j] : acc_t(0)); }, vmax, scalar_max<acc_t>);
      if (mx == ninf) {  // fully masked row: exact zeros, not NaN
        std::fill(v, v + cols, acc_t(0));
      } else {
        const Vec vmx(mx);
        const acc_t sum = reduce_row<acc_t>(
            cols, acc_t(0),
            [&](int64_t j) {
              Vec t = fast_exp<acc_t>(Vec::loadu(v + j) - vmx);
              t.store(v + j);
              return t;
            },
            [&](int64_t j) { return v[j] = std::exp(v[j] - mx); },
            [](const Vec& p, const Vec& q) { return p + q; }, scalar_add<acc_t>);
        const acc_t inv = acc_t(1) / sum;
        int64_t j = 0;
        for (; j + W <= cols; j += W) (Vec::loadu(v + j) * Vec(inv)).store(v + j);
        for (; j < cols; ++j) v[j] *= inv;
      }
      store_row<acc_t>(v, out + r * cols, cols);
    }
  });
}

template <typename scalar_t>
void softmax_backward_rows(const at::Tensor& dy_, const at::Tensor& y_, double scale_d, at::Tensor& dx_) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t cols = last_dim(y_), rows = rows_of(y_);
  const acc_t scale = static_cast<acc_t>(scale_d);
  const scalar_t* dy = dy_.data_ptr<scalar_t>();
  const scalar_t* y = y_.data_ptr<scalar_t>();
  scalar_t* dx = dx_.data_ptr<scalar_t>();
  const int64_t W = Vec::size();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> dy_buf(cols), y_buf(cols), out_buf(cols);
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* g = load_row<acc_t>(dy + r * cols, dy_buf.data(), cols);
      const acc_t* p = load_row<acc_t>(y + r * cols, y_buf.data(), cols);
      acc_t* o = out_row<acc_t>(dx + r * cols, out_buf.data());
      const acc_t dot = reduce_row<acc_t>(
          cols, acc_t(0), [&](int64_t j) { return Vec::loadu(g + j) * Vec::loadu(p + j); },
          [&](int64_t j) { return g[j] * p[j]; }, [](const Vec& a, const Vec& b) { return a + b; },
          scalar_add<acc_t>);
      int64_t j = 0;
      for (; j + W <= cols; j += W)
        (Vec::loadu(p + j) * (Vec::loadu(g + j) - Vec(dot)) * Vec(scale)).store(o + j);
      for (; j < cols; ++j) o[j] = p[j] * (g[j] - dot) * scale;
      store_row<acc_t>(o, dx + r * cols, cols);
    }
  });
}

at::Tensor softmax_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& mask, double scale) {
  auto a = softmax_args(x, mask);
  auto y = at::empty_like(a.x);
  if (a.rows == 0 || a.cols == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_softmax_cpu",
                                  [&] { softmax_rows<scalar_t>(a, scale, y); });
  return y;
}

at::Tensor softmax_backward_cpu(const at::Tensor& grad_y, const at::Tensor& y, double scale) {
  check_same(y, grad_y, "bertctl::softmax_backward", "grad_y");
  auto dy_c = grad_y.contiguous(), y_c = y.contiguous();
  auto dx = at::empty_like(y_c);
  if (y.numel() == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "bertctl_softmax_backward_cpu",
                                  [&] { softmax_backward_rows<scalar_t>(dy_c, y_c, scale, dx); });
  return dx;
}

}  // namespace
}  // namespace bertctl::cpu

TORCH_LIBRARY_IMPL(bertctl, CPU, m) {
  m.impl("softmax", &bertctl::cpu::softmax_cpu);
  m.impl("softmax_backward", &bertctl::cpu::softmax_backward_cpu);
}
