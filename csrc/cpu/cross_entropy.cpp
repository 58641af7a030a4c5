// CPU softmax cross-entropy over the rows of logits (N, V) and its backward
// dlogits = g * (softmax(logits) - onehot(label)); see csrc/cuda/cross_entropy.cu.
// Parallel over rows; each row converted once to the accumulation type (fp32, fp64 for double)
// and reduced with at::vec (its max, then the sum of exp(x - max)).  The loss and the log-sum-exp
// are in the accumulation type; a label outside [0, V) other than ignore_index is an error.
#include <cmath>
#include <limits>

#include "../common.h"
#include "cpu_util.h"

namespace bertctl::cpu {
namespace {

void check_labels(const at::Tensor& labels, int64_t V, int64_t ignore_index, const char* op) {
  const int64_t* lab = labels.data_ptr<int64_t>();
  for (int64_t r = 0; r < labels.numel(); ++r)
    TORCH_CHECK(lab[r] == ignore_index || (lab[r] >= 0 && lab[r] < V), op, ": label ", lab[r], " of row ", r,
                " is outside [0, ", V, ") and is not ignore_index ", ignore_index);
}

// The first index of a row whose value equals v (v in the row), a vector of lanes compared at a time.
template <typename acc_t>
int64_t first_equal(const acc_t* row, int64_t n, acc_t v) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec vv(v);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const int equal = (Vec::loadu(row + j) != vv).zero_mask();  // lanes that compared equal
    if (equal) return j + __builtin_ctz(static_cast<unsigned>(equal));
  }
  for (; j < n; ++j)
    if (row[j] == v) return j;
  return 0;
}

// The first NaN of a row (torch.argmax's answer for a row holding one).
template <typename acc_t>
int64_t first_nan(const acc_t* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (std::isnan(row[j])) return j;
  return 0;
}

template <typename scalar_t>
void cross_entropy_rows(const at::Tensor& x_, const int64_t* lab, int64_t ignore_index, at::Tensor& loss_,
                        at::Tensor& lse_, at::Tensor& argmax_) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t N = x_.size(0), V = x_.size(1), ld = N > 1 ? x_.stride(0) : V;
  const scalar_t* x = x_.data_ptr<scalar_t>();
  acc_t* loss = loss_.data_ptr<acc_t>();
  acc_t* lse = lse_.data_ptr<acc_t>();
  int64_t* argmax = argmax_.data_ptr<int64_t>();
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, N, grain_rows(V), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(V);
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* v = load_row<acc_t>(x + r * ld, buf.data(), V);
      const acc_t mx = reduce_row<acc_t>(
          V, ninf, [&](int64_t j) { return Vec::loadu(v + j); }, [&](int64_t j) { return v[j]; },
          [](const Vec& p, const Vec& q) { return at::vec::maximum(p, q); }, scalar_max<acc_t>);
      const bool nan = std::isnan(mx);
      const int64_t best = nan ? first_nan(v, V) : first_equal(v, V, mx);
      acc_t l = mx;
      if (mx != ninf && !nan) {
        const Vec vmx(mx);
        const acc_t sum = reduce_row<acc_t>(
            V, acc_t(0), [&](int64_t j) { return fast_exp<acc_t>(Vec::loadu(v + j) - vmx); },
            [&](int64_t j) { return std::exp(v[j] - mx); }, [](const Vec& p, const Vec& q) { return p + q; },
            scalar_add<acc_t>);
        l = mx + std::log(sum);
      }
      lse[r] = l;
      loss[r] = lab[r] == ignore_index ? acc_t(0) : l - v[lab[r]];
      argmax[r] = best;
    }
  });
}

template <typename scalar_t>
void cross_entropy_backward_rows(const at::Tensor& g_, const at::Tensor& x_, const int64_t* lab, int64_t ignore_index,
                                 const at::Tensor& lse_, at::Tensor& dx_) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t N = x_.size(0), V = x_.size(1), ld = N > 1 ? x_.stride(0) : V;
  const scalar_t* x = x_.data_ptr<scalar_t>();
  const acc_t* g = g_.data_ptr<acc_t>();
  const acc_t* lse = lse_.data_ptr<acc_t>();
  scalar_t* dx = dx_.data_ptr<scalar_t>();
  const int64_t W = Vec::size();
  at::parallel_for(0, N, grain_rows(V), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> in_buf(V), out_buf(V);
    for (int64_t r = begin; r < end; ++r) {
      acc_t* o = out_row<acc_t>(dx + r * V, out_buf.data());
      if (lab[r] == ignore_index) {
        std::fill(o, o + V, acc_t(0));
      } else {
        const acc_t* v = load_row<acc_t>(x + r * ld, in_buf.data(), V);
        const acc_t gr = g[r], l = lse[r];
        const Vec vg(gr), vl(l);
        int64_t j = 0;
        for (; j + W <= V; j += W) (vg * fast_exp<acc_t>(Vec::loadu(v + j) - vl)).store(o + j);
        for (; j < V; ++j) o[j] = gr * std::exp(v[j] - l);
        o[lab[r]] -= gr;
      }
      store_row<acc_t>(o, dx + r * V, V);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_cpu(const at::Tensor& logits, const at::Tensor& labels,
                                                                 int64_t ignore_index) {
  const char* op = "bertctl::cross_entropy";
  check_cross_entropy(logits, labels, op);
  const auto x = rows_unit_stride(logits);
  const auto lab = labels.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  check_labels(lab, V, ignore_index, op);
  auto opt = x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  auto loss = at::empty({N}, opt), lse = at::empty({N}, opt);
  auto argmax = at::empty({N}, x.options().dtype(at::kLong));
  if (N == 0) return {loss, lse, argmax};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_cross_entropy_cpu", [&] {
    cross_entropy_rows<scalar_t>(x, lab.data_ptr<int64_t>(), ignore_index, loss, lse, argmax);
  });
  return {loss, lse, argmax};
}

at::Tensor cross_entropy_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                                      const at::Tensor& lse, int64_t ignore_index) {
  const char* op = "bertctl::cross_entropy_backward";
  check_cross_entropy_backward(grad_loss, logits, labels, lse, op);
  const auto acc = lse.scalar_type();
  const auto x = rows_unit_stride(logits);
  const auto lab = labels.contiguous(), l = lse.contiguous();
  const auto g = grad_loss.to(acc).contiguous();
  check_labels(lab, x.size(1), ignore_index, op);
  auto dx = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.size(0) == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_cross_entropy_backward_cpu", [&] {
    cross_entropy_backward_rows<scalar_t>(g, x, lab.data_ptr<int64_t>(), ignore_index, l, dx);
  });
  return dx;
}

}  // namespace
}  // namespace bertctl::cpu

TORCH_LIBRARY_IMPL(bertctl, CPU, m) {
  m.impl("cross_entropy", &bertctl::cpu::cross_entropy_cpu);
  m.impl("cross_entropy_backward", &bertctl::cpu::cross_entropy_backward_cpu);
}
