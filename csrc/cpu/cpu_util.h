// CPU helpers: rows are converted to the accumulation type (float for
// fp32/fp16/bf16, double for fp64) and processed with at::vec::Vectorized.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
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

// A row-sized scratch buffer aligned to 64 bytes (a cache line and an AVX-512 vector), so that
// vector loads and stores on it never straddle two lines.
template <typename acc_t>
struct RowBuffer {
  explicit RowBuffer(int64_t n) : storage(n + 64 / sizeof(acc_t)) {}
  acc_t* get(int64_t offset = 0) {
    auto* p = storage.data();
    return p + to_boundary(p, 64) + offset;
  }
  std::vector<acc_t> storage;
};

// Runs body(j, load, store) over the vectors of a row of n columns; load(p, j) reads the vector
// at column j of row p, store(v, p, j) writes one.  Full vectors, then one zero-padded partial
// vector for the tail.  With Stream, stores are streaming and the vectors are laid on the
// boundaries of `out` (the row stores write): a partial head vector runs up to its first
// boundary, so that every full vector stored is aligned.
template <bool Stream, typename acc_t, typename Body>
inline void for_each_vector(const acc_t* out, int64_t n, Body&& body) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  auto full_load = [](const acc_t* p, int64_t j) { return Vec::loadu(p + j); };
  auto full_store = [](const Vec& v, acc_t* p, int64_t j) {
    if constexpr (Stream) {
      stream_store(v, p + j);
    } else {
      v.store(p + j);
    }
  };
  auto part = [&](int64_t j, int64_t count) {
    body(j, [count](const acc_t* p, int64_t k) { return Vec::loadu(p + k, count); },
         [count](const Vec& v, acc_t* p, int64_t k) { v.store(p + k, count); });
  };
  int64_t j = 0;
  if constexpr (Stream) {
    j = std::min(n, to_vector_boundary(out));
    if (j > 0) part(0, j);
  }
  for (; j + W <= n; j += W) body(j, full_load, full_store);
  if (j < n) part(j, n - j);
}

// Column sums of per-chunk partials: out[j] = sum over c of part[c * stride + j], added in chunk
// order in double and rounded once into out (a 1-D tensor of cols elements of any floating
// dtype: the parameter's), so that the result does not depend on scheduling.
template <typename acc_t>
void sum_partials(const acc_t* part, int64_t chunks, int64_t stride, at::Tensor& out) {
  const int64_t cols = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "bertctl_sum_partials", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t j = 0; j < cols; ++j) {
      double s = 0;
      for (int64_t c = 0; c < chunks; ++c) s += static_cast<double>(part[c * stride + j]);
      o[j] = static_cast<scalar_t>(s);
    }
  });
}

inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace bertctl::cpu
