// CPU helpers: rows are converted to the accumulation type (float for
// fp32/fp16/bf16, double for fp64) and processed with at::vec::Vectorized.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace bertctl::cpu {

template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

// A read-only view of a row in the accumulation type: the row itself when the
// types agree, otherwise converted into buf.
template <typename acc_t, typename scalar_t>
inline const acc_t* load_row(const scalar_t* src, acc_t* buf, int64_t n) {
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

// Where to compute an output row: the output itself when the types agree.
template <typename acc_t, typename scalar_t>
inline acc_t* out_row(scalar_t* dst, acc_t* buf) {
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    return dst;
  } else {
    return buf;
  }
}

template <typename acc_t, typename scalar_t>
inline void store_row(const acc_t* src, scalar_t* dst, int64_t n) {
  if constexpr (!std::is_same_v<acc_t, scalar_t>) at::vec::convert(src, dst, n);
}

// A per-feature parameter (weight or bias) in the accumulation type.
template <typename acc_t>
inline std::vector<acc_t> param_acc(const at::Tensor& p) {
  at::Tensor c = p.contiguous().to(c10::CppTypeToScalarType<acc_t>::value);
  return std::vector<acc_t>(c.data_ptr<acc_t>(), c.data_ptr<acc_t>() + c.numel());
}

// Rows split into at most one chunk per thread; column sums (dweight, dbias)
// are accumulated per chunk and added at the end in chunk order, so results do
// not depend on scheduling.
inline int64_t num_chunks(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads()));
}

inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace bertctl::cpu
