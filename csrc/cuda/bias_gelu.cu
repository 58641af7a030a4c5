// CUDA GELU(x + bias) (exact erf form, or the tanh approximation) and its
// backward dx = dy * GELU'(x + bias), dbias = sum over rows of dx.
//
// Grid: blockIdx.x * 128 + threadIdx.x picks a 16-byte column vector (8 fp16/bf16 or 4
// fp32 values; scalar when H is not a multiple or a tensor is not 16-byte aligned), whose
// bias stays in registers.  Forward: one block per chunk of two rows (blockIdx.y, and
// blockIdx.z past 65535 chunks), both rows' loads in flight before the math, no loop; it
// reads x and writes y once (the minimum: 4 bytes per element for 16-bit types).  No loop:
// the same body inside a grid-stride loop, or one wave of resident blocks walking four-row
// chunks, keeps fewer loads in flight (benchmarks/ops/NOTES-kernels.md, runs 12 to 15).
// Backward: blockIdx.y picks a band of rows, walked two rows at a time; it reads dy
// and x, writes dx, and keeps each thread's fp32 column sums of dx over its band; each
// band writes one (H,) partial row and column_sums adds the bands (two stages, no atomics:
// deterministic).  The band height is chosen so that the blocks make one wave of resident blocks.
//
// Bias: fp32 or the input's 16-bit dtype (read as is on the vector path;
// converted to fp32 on the host for the scalar path); dbias is returned in the
// bias dtype.  Precision: fp32 math; Phi(v) from a branch-free erfc with
// relative error < 1.2e-7 for fp32 outputs, < 8.4e-6 for fp16 and < 2.1e-4 for bf16 (plus
// the fast exp2's few ulp), the tanh form through a sigmoid; output rounded once.
#include <algorithm>

#include "../common.h"
#include "cuda_util.cuh"

namespace bertctl::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kFwdRows = 2;  // rows per forward block
// Backward: rows in flight per step, and blocks an SM (64 registers a thread, 1024 threads): two rows
// at 64 registers keep 8 blocks an SM, where 4 rows at 94 registers kept 5 (side E-gelu of
// benchmarks/results/model-step-changes-ab-h200-b401318.json).
constexpr int kUnroll = 2;
constexpr int kBwdBlocks = 8;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kTanhC = 0.044715f;
constexpr float kSqrt1_8 = 0.35355339059327376220f;  // 1 / (2 sqrt 2)
constexpr float kLog2e = 1.4426950408889634f;

// Phi(-|v|) = erfc(|v| / sqrt 2) / 2 for the tails of the normal CDF, through erfc(z) =
// t exp(-z^2 + P(t)), t = 1 / (1 + z / 2): branch-free, one reciprocal and one exp2, and
// accurate relative to the (tiny) tail value, so GELU keeps its relative accuracy for
// negative inputs.  The log2(e) of the exp and the factor 1/2 (-1 in the exponent) are
// folded into the constants.  The degree of P follows the output's precision (least-squares
// fits of P on t in (0, 1], z in [0, 12], except degree 9):
//   9 (fp32): Numerical Recipes' erfcc, relative error < 1.2e-7;
//   5 (fp16, half an ulp = 4.9e-4 relative): < 8.4e-6;
//   4 (bf16, half an ulp = 3.9e-3 relative): < 2.1e-4.
template <typename T>
constexpr int kTailDegree = std::is_same_v<T, float> ? 9 : std::is_same_v<T, at::Half> ? 5 : 4;

template <int DEG>
__device__ __forceinline__ float normal_tail(float v) {
  const float t = __fdividef(1.f, fmaf(fabsf(v), kSqrt1_8, 1.f));
  float p;
  if constexpr (DEG == 9) {
    p = 0.17087277f * kLog2e;
    p = fmaf(p, t, -0.82215223f * kLog2e);
    p = fmaf(p, t, 1.48851587f * kLog2e);
    p = fmaf(p, t, -1.13520398f * kLog2e);
    p = fmaf(p, t, 0.27886807f * kLog2e);
    p = fmaf(p, t, -0.18628806f * kLog2e);
    p = fmaf(p, t, 0.09678418f * kLog2e);
    p = fmaf(p, t, 0.37409196f * kLog2e);
    p = fmaf(p, t, 1.00002368f * kLog2e);
    p = fmaf(p, t, -1.26551223f * kLog2e - 1.f);
  } else if constexpr (DEG == 5) {
    p = 0.22720116f * kLog2e;
    p = fmaf(p, t, -0.70465046f * kLog2e);
    p = fmaf(p, t, 0.46959347f * kLog2e);
    p = fmaf(p, t, 0.25691316f * kLog2e);
    p = fmaf(p, t, 1.01743913f * kLog2e);
    p = fmaf(p, t, -1.26649308f * kLog2e - 1.f);
  } else {
    static_assert(DEG == 4, "erfc fits of degree 4, 5 and 9 only");
    p = -0.055271365f * kLog2e;
    p = fmaf(p, t, -0.22105069f * kLog2e);
    p = fmaf(p, t, 0.59252822f * kLog2e);
    p = fmaf(p, t, 0.94454336f * kLog2e);
    p = fmaf(p, t, -1.26095605f * kLog2e - 1.f);
  }
  return t * exp2f(fmaf(v * (-0.5f * kLog2e), v, p));
}

// GELU(v) = v * Phi(v) = max(v, 0) - |v| Phi(-|v|) (no cancellation in either tail, two
// instructions after the tail); the tanh form is 0.5 v (1 + tanh(u)) = v * sigmoid(2u),
// u = sqrt(2/pi) (v + 0.044715 v^3), written with the sigmoid so that no 1 + tanh cancels.
template <bool TANH, int DEG>
__device__ __forceinline__ float gelu(float v) {
  if constexpr (TANH) {
    const float u = kSqrt2OverPi * fmaf(kTanhC * v, v * v, v);
    return __fdividef(v, 1.f + __expf(-2.f * u));
  } else {
    return fmaf(-fabsf(v), normal_tail<DEG>(v), fmaxf(v, 0.f));
  }
}

template <bool TANH, int DEG>
__device__ __forceinline__ float gelu_grad(float v) {
  if constexpr (TANH) {
    const float u = kSqrt2OverPi * fmaf(kTanhC * v, v * v, v);
    const float s = __fdividef(1.f, 1.f + __expf(-2.f * u));  // sigmoid(2u) = (1 + tanh u) / 2
    const float du = kSqrt2OverPi * fmaf(3.f * kTanhC, v * v, 1.f);
    return s + 2.f * v * s * (1.f - s) * du;
  } else {
    const float tail = normal_tail<DEG>(v);
    return (v < 0.f ? tail : 1.f - tail) + v * kInvSqrt2Pi * __expf(-0.5f * v * v);
  }
}

template <typename T, typename W, int VEC, bool TANH>
__global__ void __launch_bounds__(kThreads) bias_gelu_fwd(const T* __restrict__ x, const W* __restrict__ bias,
                                                          T* __restrict__ y, int64_t rows, int cols) {
  pdl_wait();
  const int col = (blockIdx.x * kThreads + threadIdx.x) * VEC;
  if (col >= cols) return;
  float b[VEC];
  load_float<VEC>(bias + col, b);
  const int64_t r = (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * kFwdRows;
  if (r >= rows) return;
  float v[kFwdRows][VEC];
#pragma unroll
  for (int u = 0; u < kFwdRows; ++u)
    if (r + u < rows) load_float<VEC>(x + (r + u) * cols + col, v[u]);
#pragma unroll
  for (int u = 0; u < kFwdRows; ++u) {
    if (r + u < rows) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[u][k] = gelu<TANH, kTailDegree<T>>(v[u][k] + b[k]);
      store_float<VEC>(y + (r + u) * cols + col, v[u]);
    }
  }
}

template <typename T, typename W, int VEC, bool TANH>
__global__ void __launch_bounds__(kThreads, kBwdBlocks) bias_gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                                          const W* __restrict__ bias, T* __restrict__ dx,
                                                          float* __restrict__ part, int64_t rows, int cols, int band) {
  pdl_wait();
  pdl_trigger();
  const int col = (blockIdx.x * kThreads + threadIdx.x) * VEC;
  if (col >= cols) return;
  float b[VEC], db[VEC];
  load_float<VEC>(bias + col, b);
#pragma unroll
  for (int k = 0; k < VEC; ++k) db[k] = 0.f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * band;
  const int64_t r1 = r0 + band < rows ? r0 + band : rows;
  for (int64_t r = r0; r < r1; r += kUnroll) {
    // The rows' loads in flight together, held as loaded (16-bit values: half the registers of fp32)
    // and widened one row at a time.
    Pack<T, VEC> pv[kUnroll], pg[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u < r1) {
        pv[u] = load_pack<VEC>(x + (r + u) * cols + col);
        pg[u] = load_pack<VEC>(dy + (r + u) * cols + col);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u < r1) {
        float v[VEC], g[VEC];
        unpack_float<VEC>(pv[u], v);
        unpack_float<VEC>(pg[u], g);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          g[k] *= gelu_grad<TANH, kTailDegree<T>>(v[k] + b[k]);
          db[k] += g[k];
        }
        store_float<VEC>(dx + (r + u) * cols + col, g);
      }
    }
  }
  float* out = part + static_cast<int64_t>(blockIdx.y) * cols + col;
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = db[k];
}

// Runs f(bias pointer, integral_constant<VEC>, integral_constant<bool TANH>): 16-byte
// vectors when `wide`, with a bias of the input's 16-bit dtype read as it is; otherwise
// scalar accesses and an fp32 copy of the bias.
template <typename T, typename F>
void with_vec(const at::Tensor& bias, bool wide, bool tanh_form, F&& f) {
  using std::integral_constant;
  constexpr int V = 16 / sizeof(T);
  auto run = [&](auto* bp, auto vec) {
    if (tanh_form) f(bp, vec, std::true_type{});
    else f(bp, vec, std::false_type{});
  };
  if (wide && bias.scalar_type() == c10::CppTypeToScalarType<T>::value) {
    auto bc = bias.contiguous();
    if (aligned16(bc.data_ptr())) return run(bc.data_ptr<T>(), integral_constant<int, V>{});
  }
  auto b = bias.scalar_type() == at::kFloat ? bias.contiguous() : bias.to(at::kFloat).contiguous();
  if (wide && aligned16(b.data_ptr())) return run(b.data_ptr<float>(), integral_constant<int, V>{});
  run(b.data_ptr<float>(), integral_constant<int, 1>{});
}

at::Tensor bias_gelu_cuda(const at::Tensor& x, const at::Tensor& bias, std::string approximate) {
  const char* op = "bertctl::bias_gelu";
  TORCH_CHECK(x.dim() >= 1, op, ": input must have at least one dimension");
  check_param(x, bias, op, "bias");
  const bool tanh_form = gelu_tanh(approximate);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  const int64_t rows = rows_of(x), cols64 = last_dim(x);
  if (rows == 0 || cols64 == 0) return y;
  TORCH_CHECK(cols64 <= INT32_MAX, op, ": rows longer than 2^31 are not supported");
  const int cols = static_cast<int>(cols64);
  const auto stream = at::cuda::getCurrentCUDAStream();
  BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_bias_gelu_cuda", [&] {
    using T = scalar_t;
    const T* xp = xc.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const bool wide = cols % (16 / sizeof(T)) == 0 && aligned16(xp) && aligned16(yp);
    with_vec<T>(bias, wide, tanh_form, [&](auto* bp, auto vec, auto tanh_c) {
      using W = std::remove_pointer_t<decltype(bp)>;
      constexpr int V = decltype(vec)::value;
      auto kernel = bias_gelu_fwd<T, W, V, decltype(tanh_c)::value>;
      const int64_t bx = ceil_div(cols / V, kThreads);
      const int64_t chunks = ceil_div(rows, kFwdRows);
      const int64_t by = std::min<int64_t>(chunks, 65535), bz = ceil_div(chunks, by);
      TORCH_CHECK(bz <= 65535, op, ": too many rows (", rows, ")");
      const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(by), static_cast<unsigned>(bz));
      launch(kernel, grid, kThreads, 0, stream, xp, bp, yp, rows, cols);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                           const at::Tensor& bias, std::string approximate) {
  const char* op = "bertctl::bias_gelu_backward";
  check_same(x, grad_y, op, "grad_y");
  check_param(x, bias, op, "bias");
  const bool tanh_form = gelu_tanh(approximate);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  auto xc = x.contiguous(), dyc = grad_y.contiguous();
  auto dx = at::empty_like(xc);
  const int64_t rows = rows_of(x), cols64 = last_dim(x);
  if (rows == 0 || cols64 == 0) return {dx, at::zeros_like(bias)};
  TORCH_CHECK(cols64 <= INT32_MAX, op, ": rows longer than 2^31 are not supported");
  const int cols = static_cast<int>(cols64);
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor part;
  int64_t nb = 0;
  BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_bias_gelu_backward_cuda", [&] {
    using T = scalar_t;
    const T* gp = dyc.data_ptr<T>();
    const T* xp = xc.data_ptr<T>();
    T* op_ = dx.data_ptr<T>();
    const bool wide = cols % (16 / sizeof(T)) == 0 && aligned16(gp) && aligned16(xp) && aligned16(op_);
    with_vec<T>(bias, wide, tanh_form, [&](auto* bp, auto vec, auto tanh_c) {
      using W = std::remove_pointer_t<decltype(bp)>;
      constexpr int V = decltype(vec)::value;
      const int64_t bx = ceil_div(cols / V, kThreads);
      auto kernel = bias_gelu_bwd<T, W, V, decltype(tanh_c)::value>;
      // One wave of resident blocks (8 an SM at 64 registers); bands a multiple of the unroll.
      int per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
      const int64_t by_target = std::max<int64_t>(1, std::clamp(per_sm, 1, 8) * sm_count() / bx);
      int64_t band = ceil_div(ceil_div(rows, by_target), kUnroll) * kUnroll;
      band = std::max<int64_t>(band, ceil_div(rows, 65535));
      nb = ceil_div(rows, band);
      part = at::empty({nb, cols}, x.options().dtype(at::kFloat));
      const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(nb));
      launch(kernel, grid, kThreads, 0, stream, gp, xp, bp, op_, part.data_ptr<float>(), rows, cols,
             static_cast<int>(band));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, column_sums(part, nb, cols, 1, bias.scalar_type(), stream)[0]};
}

}  // namespace
}  // namespace bertctl::cuda

TORCH_LIBRARY_IMPL(bertctl, CUDA, m) {
  m.impl("bias_gelu", &bertctl::cuda::bias_gelu_cuda);
  m.impl("bias_gelu_backward", &bertctl::cuda::bias_gelu_backward_cuda);
}
