// Host-side argument checks and shape bookkeeping shared by the CPU and CUDA
// implementations.  Every op views its input as (rows, cols) with cols = the
// last dimension; non-contiguous inputs are made contiguous here once.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <string>

namespace bertctl {

inline int64_t last_dim(const at::Tensor& x) { return x.dim() == 0 ? 1 : x.size(-1); }

inline int64_t rows_of(const at::Tensor& x) {
  const int64_t cols = last_dim(x);
  return cols == 0 ? 0 : x.numel() / cols;
}

// How the softmax key-padding mask is stored.
enum class MaskKind : int { kNone = 0, kBool = 1, kFloat = 2 };

struct SoftmaxArgs {
  at::Tensor x;     // contiguous scores
  at::Tensor mask;  // contiguous (B, Sk) or undefined
  MaskKind kind = MaskKind::kNone;
  int64_t rows = 0, cols = 0;
  int64_t rows_per_batch = 1;  // heads * Sq: rows that share one mask row
};

inline SoftmaxArgs softmax_args(const at::Tensor& x, const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(x.dim() >= 1, "bertctl::softmax: scores must have at least one dimension");
  SoftmaxArgs a;
  a.x = x.contiguous();
  a.cols = last_dim(x);
  a.rows = rows_of(x);
  if (mask.has_value() && mask->defined()) {
    const auto& m = *mask;
    TORCH_CHECK(x.dim() == 4, "bertctl::softmax: a mask needs scores of shape (B, heads, Sq, Sk), got ", x.sizes());
    TORCH_CHECK(m.dim() == 2 && m.size(0) == x.size(0) && m.size(1) == x.size(3),
                "bertctl::softmax: mask must have shape (B, Sk) = (", x.size(0), ", ", x.size(3), "), got ", m.sizes());
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat,
                "bertctl::softmax: mask must be bool or float32, got ", m.scalar_type());
    TORCH_CHECK(m.device() == x.device(), "bertctl::softmax: mask is on ", m.device(), ", scores on ", x.device());
    a.mask = m.contiguous();
    a.kind = m.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kFloat;
    a.rows_per_batch = x.size(1) * x.size(2);
  }
  return a;
}

inline void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, const char* what) {
  TORCH_CHECK(a.sizes() == b.sizes(), op, ": ", what, " shape ", b.sizes(), " differs from ", a.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", what, " dtype ", b.scalar_type(), " differs from ",
              a.scalar_type());
  TORCH_CHECK(a.device() == b.device(), op, ": ", what, " is on ", b.device(), ", expected ", a.device());
}

// Per-feature parameters (LayerNorm weight/bias, GELU bias): 1-D of size cols,
// dtype equal to the input's or float32 (mixed precision keeps fp32 params).
inline void check_param(const at::Tensor& x, const at::Tensor& p, const char* op, const char* what) {
  TORCH_CHECK(p.dim() == 1 && p.size(0) == last_dim(x), op, ": ", what, " must have shape (", last_dim(x), "), got ",
              p.sizes());
  TORCH_CHECK(p.scalar_type() == x.scalar_type() || p.scalar_type() == at::kFloat, op, ": ", what, " dtype ",
              p.scalar_type(), " must be ", x.scalar_type(), " or float32");
  TORCH_CHECK(p.device() == x.device(), op, ": ", what, " is on ", p.device(), ", expected ", x.device());
}

// Only the two GELU forms BERT implementations use.
// The checks bias_dropout_add_layer_norm (and its backward) make on every device.
inline void check_bias_dropout_add_layer_norm(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                                              const at::Tensor& weight, double p,
                                              const c10::optional<at::Tensor>& seed, const char* op) {
  TORCH_CHECK(x.dim() >= 1, op, ": input must have at least one dimension");
  check_param(x, bias, op, "bias");
  check_same(x, residual, op, "residual");
  check_param(x, weight, op, "weight");
  TORCH_CHECK(x.numel() < (int64_t(1) << 32), op, ": at most 2^32 elements");
  TORCH_CHECK(p >= 0 && p < 1, op, ": p must be in [0, 1), got ", p);
  TORCH_CHECK(p == 0 || (seed.has_value() && seed->defined()), op, ": p > 0 needs a seed");
}

inline bool gelu_tanh(const std::string& approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh",
              "bertctl::bias_gelu: approximate must be \"none\" or \"tanh\", got \"", approximate, "\"");
  return approximate == "tanh";
}

// The checks cross_entropy (and its backward) make on every device: logits (N, V) with unit column
// stride (rows may be strided: a view of a wider, aligned buffer), labels (N,) int64 on the same device.
inline void check_cross_entropy(const at::Tensor& logits, const at::Tensor& labels, const char* op) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be 2-D (rows, classes), got ", logits.sizes());
  TORCH_CHECK(logits.size(1) > 0, op, ": logits need at least one class");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 31), op, ": at most 2^31 - 1 classes");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0), op, ": labels must have shape (",
              logits.size(0), "), got ", labels.sizes());
  TORCH_CHECK(labels.scalar_type() == at::kLong, op, ": labels must be int64, got ", labels.scalar_type());
  TORCH_CHECK(labels.device() == logits.device(), op, ": labels are on ", labels.device(), ", logits on ",
              logits.device());
}

// ... and cross_entropy_backward's: grad_loss (N,), lse (N,) in the accumulation type (float64 for double
// logits, else float32).
inline void check_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                         const at::Tensor& labels, const at::Tensor& lse, const char* op) {
  check_cross_entropy(logits, labels, op);
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == logits.size(0), op, ": grad_loss must have shape (",
              logits.size(0), "), got ", grad_loss.sizes());
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.sizes() == grad_loss.sizes() && lse.scalar_type() == acc, op, ": lse must be ", acc,
              " of shape (", logits.size(0), ")");
}

// The checks concat_column_sums makes on every device: one or more 2-D blocks with the same rows, dtype
// and device, each of unit column stride or made so (rows_unit_stride).
inline void check_concat_column_sums(at::TensorList blocks, const char* op) {
  TORCH_CHECK(!blocks.empty(), op, ": needs at least one block");
  const at::Tensor& first = blocks[0];
  for (size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor& b = blocks[i];
    TORCH_CHECK(b.dim() == 2, op, ": block ", i, " must be 2-D (rows, columns), got ", b.sizes());
    TORCH_CHECK(b.size(0) == first.size(0), op, ": block ", i, " has ", b.size(0), " rows, block 0 has ",
                first.size(0));
    TORCH_CHECK(b.scalar_type() == first.scalar_type() && b.device() == first.device(), op, ": block ", i, " is ",
                b.scalar_type(), " on ", b.device(), ", block 0 ", first.scalar_type(), " on ", first.device());
  }
}

// Logits as the kernels read them: rows of unit column stride, each row starting stride(0) elements
// after the previous one (a copy only when the columns are not contiguous).
inline at::Tensor rows_unit_stride(const at::Tensor& x) {
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

// mean and rstd of LayerNorm, shape x.shape[:-1]: float32 (float64 for double
// inputs, so that fp64 gradient checks see fp64 statistics).
inline at::ScalarType stats_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline at::Tensor stats_like(const at::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return at::empty(sizes, x.options().dtype(stats_dtype(x)));
}

}  // namespace bertctl
