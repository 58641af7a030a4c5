// CUDA softmax(scale * x + mask) over the last dim, and its backward
// dx = scale * y * (dy - sum(dy * y)).
//
// Parallelised over rows.  Rows of at most 64 values per lane (Sk <= 2048 with
// Sk % 8 == 0 for 16-bit types or Sk % 4 == 0 for fp32, Sk <= 512 otherwise)
// take the register path: a group of LANES lanes (a whole warp, or
// 4..16 lanes for short rows, so several rows share a warp) holds one row in
// registers, reads it once with 16-byte loads, reduces max and sum with
// shuffles and writes it once: 2 bytes moved per element for 16-bit types (read
// + write), the minimum.  Longer or unaligned rows take a block-per-row path that
// reads the row three times (max, sum, write) through L1/L2.
//
// Mask: (B, Sk) bool (true = attend) or float32 additive, one mask row for the
// heads * Sq rows of a batch element.  A row whose every value is -inf (fully
// masked) is written as exact zeros, and its gradient is zero.
//
// Precision: inputs converted to fp32, max/sum/dot in fp32; the logits are scaled
// by log2(e) with the softmax scale (one multiply) so each exp is a single hardware
// exp2 (ex2.approx, ~2 ulp in fp32); output rounded once.
// Limits: rows up to 2^63; indexes in int64.
#include "../common.h"
#include "cuda_util.cuh"

namespace bertctl::cuda {
namespace {

constexpr int kThreads = 128;

// row / rows_per_batch: the batch element of a row (the mask row it reads).  A 64-bit
// division is a long software routine and a 32-bit one about twenty instructions, once per
// thread: with short rows (Sk = 128, eight values per lane) that is a few instructions per
// element.  For n, d < 2^31 the quotient is a multiply-high and a shift (Granlund and
// Montgomery, "Division by invariant integers using multiplication", 1994):
// l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1, n / d = (umulhi(n, m) + n) >> l.
struct FastDiv {
  int64_t d = 1;
  uint32_t mul = 0, shift = 0;
  bool ok = false;  // d < 2^31
  explicit FastDiv(int64_t divisor) : d(divisor) {
    if (divisor <= 0 || divisor >= (int64_t{1} << 31)) return;
    while ((int64_t{1} << shift) < divisor) ++shift;
    mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
    ok = true;
  }
  __device__ __forceinline__ int64_t operator()(int64_t n) const {
    if (ok && (n >> 31) == 0) {
      const uint32_t u = static_cast<uint32_t>(n);
      return (__umulhi(u, mul) + u) >> shift;
    }
    return n / d;
  }
};

constexpr float kLog2e = 1.4426950408889634f;

// v = (scale * x + mask) * log2(e) for VEC columns, with scale2 = scale * log2(e): the
// softmax is then exp2(v - max v) / sum, one ex2 per value.  A false bool-mask entry
// gives -inf (an exact zero after the exp); MK is a template argument so each mask kind
// compiles to straight-line code.
template <MaskKind MK, int VEC>
__device__ __forceinline__ void scaled_logits(const float (&xv)[VEC], const void* mask, int64_t offset,
                                              float scale2, float (&v)[VEC]) {
  if constexpr (MK == MaskKind::kBool) {
    const Pack<bool, VEC> pk = *reinterpret_cast<const Pack<bool, VEC>*>(static_cast<const bool*>(mask) + offset);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = pk.v[k] ? xv[k] * scale2 : -INFINITY;
  } else if constexpr (MK == MaskKind::kFloat) {
    float m[VEC];
    load_float<VEC>(static_cast<const float*>(mask) + offset, m);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = fmaf(xv[k], scale2, m[k] * kLog2e);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = xv[k] * scale2;
  }
}

template <typename T, MaskKind MK, int VEC, int NVEC, int LANES>
__global__ void __launch_bounds__(kThreads) softmax_fwd_rows(const T* __restrict__ x, const void* __restrict__ mask,
                                                             T* __restrict__ y, int64_t rows, int cols,
                                                             FastDiv batch_of, float scale2) {
  pdl_wait();
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / LANES;
  const int lane = threadIdx.x % LANES;
  const bool live = row < rows;  // dead groups still join the shuffles
  const T* xr = x + row * cols;
  int64_t mrow = 0;
  if constexpr (MK != MaskKind::kNone) mrow = live ? batch_of(row) * cols : 0;
  float v[NVEC][VEC];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * LANES + lane) * VEC;
    if (live && col < cols) {
      float xv[VEC];
      load_float<VEC>(xr + col, xv);
      scaled_logits<MK, VEC>(xv, mask, mrow + col, scale2, v[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) mx = fmaxf(mx, v[i][k]);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[i][k] = -INFINITY;
    }
  }
  mx = group_max<LANES>(mx);
  // A fully masked row: every exp is 0; keep the sum 0 and write zeros instead of NaN.
  const float shift = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NVEC; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[i][k] = exp2f(v[i][k] - shift);
      sum += v[i][k];
    }
  sum = group_sum<LANES>(sum);
  const float inv = sum > 0.f ? __fdividef(1.f, sum) : 0.f;
  if (!live) return;
  T* yr = y + row * cols;
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * LANES + lane) * VEC;
    if (col < cols) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[i][k] *= inv;
      store_float<VEC>(yr + col, v[i]);
    }
  }
}

template <typename T, int VEC, int NVEC, int LANES>
__global__ void __launch_bounds__(kThreads) softmax_bwd_rows(const T* __restrict__ dy, const T* __restrict__ y,
                                                             T* __restrict__ dx, int64_t rows, int cols,
                                                             float scale) {
  pdl_wait();
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / LANES;
  const int lane = threadIdx.x % LANES;
  const bool live = row < rows;
  float g[NVEC][VEC], p[NVEC][VEC];
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * LANES + lane) * VEC;
    if (live && col < cols) {
      load_float<VEC>(dy + row * cols + col, g[i]);
      load_float<VEC>(y + row * cols + col, p[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) dot = fmaf(g[i][k], p[i][k], dot);
    }
  }
  dot = group_sum<LANES>(dot);
  if (!live) return;
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * LANES + lane) * VEC;
    if (col < cols) {
      float o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = scale * p[i][k] * (g[i][k] - dot);
      store_float<VEC>(dx + row * cols + col, o);
    }
  }
}

// Block-per-row path for rows too long (or unaligned) for registers.
template <typename T, MaskKind MK>
__global__ void __launch_bounds__(256) softmax_fwd_long(const T* __restrict__ x, const void* __restrict__ mask,
                                                        T* __restrict__ y, int cols, FastDiv batch_of,
                                                        float scale2) {
  pdl_wait();
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  int64_t mrow = 0;
  if constexpr (MK != MaskKind::kNone) mrow = batch_of(row) * cols;
  auto value = [&](int c) {
    const float xv[1] = {static_cast<float>(xr[c])};
    float v[1];
    scaled_logits<MK, 1>(xv, mask, mrow + c, scale2, v);
    return v[0];
  };
  float mx = -INFINITY;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) mx = fmaxf(mx, value(c));
  mx = block_max(mx, smem);
  const float shift = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += exp2f(value(c) - shift);
  sum = block_sum(sum, smem);
  const float inv = sum > 0.f ? __fdividef(1.f, sum) : 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) y[row * cols + c] = static_cast<T>(exp2f(value(c) - shift) * inv);
}

template <typename T>
__global__ void __launch_bounds__(256) softmax_bwd_long(const T* __restrict__ dy, const T* __restrict__ y,
                                                        T* __restrict__ dx, int cols, float scale) {
  pdl_wait();
  __shared__ float smem[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * cols;
  float dot = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    dot += static_cast<float>(dy[base + c]) * static_cast<float>(y[base + c]);
  dot = block_sum(dot, smem);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float p = static_cast<float>(y[base + c]);
    dx[base + c] = static_cast<T>(scale * p * (static_cast<float>(dy[base + c]) - dot));
  }
}

// Calls f(integral_constant<NVEC>, integral_constant<LANES>) for the register layout of a
// row of `nvec` vectors; false if the row needs more than MAX_NVEC vectors per lane.  Short
// rows take fewer lanes (Sk = 128 bf16: 16 lanes, two rows per warp); a second layout with
// 4 vectors on 4 lanes was slower in the backward (benchmarks/ops/NOTES-kernels.md, run 2).
template <int MAX_NVEC, typename F>
bool with_layout(int64_t nvec, F&& f) {
  using std::integral_constant;
  if (nvec <= 4) { f(integral_constant<int, 1>{}, integral_constant<int, 4>{}); return true; }
  if (nvec <= 8) { f(integral_constant<int, 1>{}, integral_constant<int, 8>{}); return true; }
  if (nvec <= 16) { f(integral_constant<int, 1>{}, integral_constant<int, 16>{}); return true; }
  if (nvec <= 32) { f(integral_constant<int, 1>{}, integral_constant<int, 32>{}); return true; }
  if (nvec <= 64) { f(integral_constant<int, 2>{}, integral_constant<int, 32>{}); return true; }
  if (nvec <= 128) { f(integral_constant<int, 4>{}, integral_constant<int, 32>{}); return true; }
  if constexpr (MAX_NVEC >= 8) {
    if (nvec <= 256) { f(integral_constant<int, 8>{}, integral_constant<int, 32>{}); return true; }
  }
  if constexpr (MAX_NVEC >= 16) {
    if (nvec <= 512) { f(integral_constant<int, 16>{}, integral_constant<int, 32>{}); return true; }
  }
  return false;
}

// Calls f(integral_constant<MaskKind, kind>).
template <typename F>
void with_mask_kind(MaskKind kind, F&& f) {
  using std::integral_constant;
  switch (kind) {
    case MaskKind::kBool: f(integral_constant<MaskKind, MaskKind::kBool>{}); break;
    case MaskKind::kFloat: f(integral_constant<MaskKind, MaskKind::kFloat>{}); break;
    default: f(integral_constant<MaskKind, MaskKind::kNone>{}); break;
  }
}

// At most 64 fp32 values per lane: 16-bit types 8 x 8, fp32 16 x 4, scalar 16 x 1.
template <typename T> constexpr int vec_of() { return 16 / sizeof(T); }
template <typename T> constexpr int max_nvec_of() { return vec_of<T>() == 8 ? 8 : 16; }

at::Tensor softmax_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& mask, double scale) {
  auto a = softmax_args(x, mask);
  const c10::cuda::OptionalCUDAGuard guard(a.x.device());
  auto y = at::empty_like(a.x);
  if (a.rows == 0 || a.cols == 0) return y;
  TORCH_CHECK(a.cols <= INT32_MAX, "bertctl::softmax: rows longer than 2^31 are not supported");
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int cols = static_cast<int>(a.cols);
  const void* mp = a.mask.defined() ? a.mask.data_ptr() : nullptr;
  BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_softmax_cuda", [&] {
    using T = scalar_t;
    const T* xp = a.x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    constexpr int V = vec_of<T>(), MAXN = max_nvec_of<T>();
    const FastDiv batch_of(a.rows_per_batch);
    const float scale2 = static_cast<float>(scale) * kLog2e;
    with_mask_kind(a.kind, [&](auto mk) {
      constexpr MaskKind MK = decltype(mk)::value;
      bool done = false;
      auto dispatch = [&](auto vec, auto nvec, auto lanes) {
        constexpr int VV = decltype(vec)::value, NV = decltype(nvec)::value, L = decltype(lanes)::value;
        const int64_t blocks = ceil_div(a.rows * L, kThreads);
        launch(softmax_fwd_rows<T, MK, VV, NV, L>, blocks, kThreads, 0, stream, xp, mp, yp, a.rows, cols,
               batch_of, scale2);
        done = true;
      };
      const bool wide = cols % V == 0 && aligned16(xp) && aligned16(yp) && (mp == nullptr || aligned16(mp));
      if (wide) {
        with_layout<MAXN>(cols / V, [&](auto nv, auto l) { dispatch(std::integral_constant<int, V>{}, nv, l); });
      } else if (cols <= 512) {
        with_layout<16>(cols, [&](auto nv, auto l) { dispatch(std::integral_constant<int, 1>{}, nv, l); });
      }
      if (!done) launch(softmax_fwd_long<T, MK>, a.rows, 256, 0, stream, xp, mp, yp, cols, batch_of, scale2);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor softmax_backward_cuda(const at::Tensor& grad_y, const at::Tensor& y, double scale) {
  check_same(y, grad_y, "bertctl::softmax_backward", "grad_y");
  const c10::cuda::OptionalCUDAGuard guard(y.device());
  auto dyc = grad_y.contiguous(), yc = y.contiguous();
  auto dx = at::empty_like(yc);
  const int64_t rows = rows_of(y), cols64 = last_dim(y);
  if (rows == 0 || cols64 == 0) return dx;
  TORCH_CHECK(cols64 <= INT32_MAX, "bertctl::softmax_backward: rows longer than 2^31 are not supported");
  const int cols = static_cast<int>(cols64);
  const auto stream = at::cuda::getCurrentCUDAStream();
  BERTCTL_DISPATCH_CUDA(y.scalar_type(), "bertctl_softmax_backward_cuda", [&] {
    using T = scalar_t;
    const T* gp = dyc.data_ptr<T>();
    const T* pp = yc.data_ptr<T>();
    T* op = dx.data_ptr<T>();
    constexpr int V = vec_of<T>(), MAXN = max_nvec_of<T>();
    bool done = false;
    auto dispatch = [&](auto vec, auto nvec, auto lanes) {
      constexpr int VV = decltype(vec)::value, NV = decltype(nvec)::value, L = decltype(lanes)::value;
      const int64_t blocks = ceil_div(rows * L, kThreads);
      launch(softmax_bwd_rows<T, VV, NV, L>, blocks, kThreads, 0, stream, gp, pp, op, rows, cols,
             static_cast<float>(scale));
      done = true;
    };
    const bool wide = cols % V == 0 && aligned16(gp) && aligned16(pp) && aligned16(op);
    if (wide) {
      with_layout<MAXN>(cols / V, [&](auto nv, auto l) { dispatch(std::integral_constant<int, V>{}, nv, l); });
    } else if (cols <= 512) {
      with_layout<16>(cols, [&](auto nv, auto l) { dispatch(std::integral_constant<int, 1>{}, nv, l); });
    }
    if (!done) launch(softmax_bwd_long<T>, rows, 256, 0, stream, gp, pp, op, cols, static_cast<float>(scale));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

}  // namespace
}  // namespace bertctl::cuda

TORCH_LIBRARY_IMPL(bertctl, CUDA, m) {
  m.impl("softmax", &bertctl::cuda::softmax_cuda);
  m.impl("softmax_backward", &bertctl::cuda::softmax_backward_cuda);
}
