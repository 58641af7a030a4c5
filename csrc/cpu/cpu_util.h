// CPU helpers: rows are converted to the accumulation type (float for
// fp32/fp16/bf16, double for fp64) and processed with at::vec::Vectorized.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

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

// Rows split into at most one chunk per thread, each of at least 16384 elements (the forwards'
// grain: a smaller input runs on one thread rather than waking the others); column sums
// (dweight, dbias) are accumulated per chunk and added at the end in chunk order, so results
// do not depend on scheduling.
inline int64_t num_chunks(int64_t rows, int64_t cols) {
  const int64_t by_size = rows * std::max<int64_t>(cols, 1) / 16384;
  return std::max<int64_t>(1, std::min<int64_t>({rows, by_size, static_cast<int64_t>(at::get_num_threads())}));
}

// exp for the softmax / GELU rows: at::vec's 20-ulp exp for fp32 (several times faster
// than the 1-ulp SLEEF call, and far below fp32 output tolerance), the exact one for fp64.
template <typename acc_t>
inline at::vec::Vectorized<acc_t> fast_exp(const at::vec::Vectorized<acc_t>& v) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return v.exp_u20();
  } else {
    return v.exp();
  }
}

// 1 / v for fp32 vectors without the (slow, unpipelined) divider: the hardware reciprocal
// estimate and one Newton step, r (2 - v r): ~22 correct bits (AVX2) or ~28 (AVX-512).
template <typename acc_t>
inline at::vec::Vectorized<acc_t> fast_reciprocal(const at::vec::Vectorized<acc_t>& v) {
  using Vec = at::vec::Vectorized<acc_t>;
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    const Vec r(_mm512_rcp14_ps(v));
    return r * (Vec(2.f) - v * r);
#elif defined(CPU_CAPABILITY_AVX2)
    const Vec r(_mm256_rcp_ps(v));
    return r * (Vec(2.f) - v * r);
#endif
  }
  return Vec(acc_t(1)) / v;
}

// Row reductions with four independent vector accumulators, so successive adds do not
// wait on each other's latency.  f(j) returns the Vec to accumulate for columns [j, j+W);
// tail(j) the scalar for column j; op combines Vecs, sop scalars.
template <typename acc_t, typename F, typename G, typename Op, typename SOp>
inline acc_t reduce_row(int64_t n, acc_t init, F&& f, G&& tail, Op&& op, SOp&& sop) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  Vec a0(init), a1(init), a2(init), a3(init);
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    a0 = op(a0, f(j));
    a1 = op(a1, f(j + W));
    a2 = op(a2, f(j + 2 * W));
    a3 = op(a3, f(j + 3 * W));
  }
  for (; j + W <= n; j += W) a0 = op(a0, f(j));
  Vec all = op(op(a0, a1), op(a2, a3));
  acc_t buf[W];
  all.store(buf);
  acc_t r = init;
  for (int64_t k = 0; k < W; ++k) r = sop(r, buf[k]);
  for (; j < n; ++j) r = sop(r, tail(j));
  return r;
}

template <typename acc_t>
inline acc_t scalar_add(acc_t a, acc_t b) { return a + b; }
template <typename acc_t>
inline acc_t scalar_max(acc_t a, acc_t b) { return std::max(a, b); }

// Software prefetch for row loops that make two passes over a row (statistics, then output):
// the second pass runs from L1, so that is where the next row is fetched, line by line:
// called once per vector of the row loop, with the loop's column j (a vector of fp32 or fp64 is
// one 64-byte line; 16-bit rows get each line twice, which costs nothing).  next may be null.
template <typename T>
inline void prefetch(const T* next, int64_t j) {
  if (next) __builtin_prefetch(next + j);
}

// The same into L2 only (prefetcht1), for rows fetched further ahead: fetched into L1 they
// would evict the rows being worked on.
template <typename T>
inline void prefetch_l2(const T* ahead, int64_t j) {
  if (ahead) __builtin_prefetch(ahead + j, 0, 2);
}

template <typename T>
inline void prefetch_for_write(T* p, int64_t j) {
  __builtin_prefetch(p + j, 1);
}

// Non-temporal ("streaming") stores of whole vectors, for outputs too large to stay cached: a
// store that misses the cache first reads the line from memory (read-for-ownership); a streaming
// store writes it through write-combining buffers without that read.  p must be aligned to the
// vector size (64 bytes with AVX-512, 32 with AVX2).  Without AVX2/AVX-512 it is an ordinary
// store.  A thread that streamed must call stream_fence() before others read the data (end of
// its parallel chunk).
template <typename acc_t>
inline void stream_store(const at::vec::Vectorized<acc_t>& v, acc_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    _mm512_stream_ps(p, v);
  } else {
    _mm512_stream_pd(p, v);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    _mm256_stream_ps(p, v);
  } else {
    _mm256_stream_pd(p, v);
  }
#else
  v.store(p);
#endif
}

inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// Elements from p (aligned to its element type, as tensor data is) to the next address that is a
// multiple of `bytes`: 0 when p is on one.
template <typename T>
inline int64_t to_boundary(const T* p, uintptr_t bytes) {
  return static_cast<int64_t>((bytes - reinterpret_cast<uintptr_t>(p) % bytes) % bytes / sizeof(T));
}

// ... to the next vector-aligned address.
template <typename acc_t>
inline int64_t to_vector_boundary(const acc_t* p) {
  return to_boundary(p, at::vec::Vectorized<acc_t>::size() * sizeof(acc_t));
}

inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace bertctl::cpu
