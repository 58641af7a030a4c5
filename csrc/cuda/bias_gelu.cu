// CUDA GELU(x + bias) (exact erf form, or the tanh approximation) and its
// backward dx = dy * GELU'(x + bias), dbias = sum over rows of dx.
//
// 2-D grid: blockIdx.x * 128 + threadIdx.x picks a 16-byte column vector
// (8 fp16/bf16 or 4 fp32 values; scalar when H is not a multiple or a tensor is
// not 16-byte aligned), whose bias stays in registers; blockIdx.y picks a band
// of rows, walked four rows at a time so four independent loads are in flight.
// The forward reads x and writes y once (the minimum: 4 bytes per element for
// 16-bit types).  The backward reads dy and x, writes dx, and keeps each
// thread's fp32 column sums of dx over its band; each band writes one (H,)
// partial row and column_sums adds the bands (two stages, no atomics:
// deterministic).  The band height is chosen so that about 8 blocks per SM run.
//
// Bias: fp32 or the input's 16-bit dtype (read as is on the vector path;
// converted to fp32 on the host for the scalar path); dbias is returned in the
// bias dtype.  Precision: fp32 math; Phi(v) from a branch-free erfc with
// relative error < 1.2e-7 (plus the fast exp's few ulp), the tanh form through
// a sigmoid; output rounded once.
#include "../common.h"
#include "cuda_util.cuh"

namespace bertctl::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kUnroll = 4;
constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kTanhC = 0.044715f;

// erfc(z) for z >= 0 as t * exp(-z^2 + P(t)), t = 1 / (1 + z / 2) (Numerical Recipes'
// erfcc, Chebyshev fit): relative error below 1.2e-7 everywhere, so the tail of GELU keeps
// its relative accuracy; branch-free, one reciprocal and one exp (CUDA's erff branches
// on |z| and costs about twice as much).
__device__ __forceinline__ float erfc_nonneg(float z) {
  const float t = __fdividef(1.f, fmaf(0.5f, z, 1.f));
  float p = 0.17087277f;
  p = fmaf(p, t, -0.82215223f);
  p = fmaf(p, t, 1.48851587f);
  p = fmaf(p, t, -1.13520398f);
  p = fmaf(p, t, 0.27886807f);
  p = fmaf(p, t, -0.18628806f);
  p = fmaf(p, t, 0.09678418f);
  p = fmaf(p, t, 0.37409196f);
  p = fmaf(p, t, 1.00002368f);
  p = fmaf(p, t, -1.26551223f);
  return t * __expf(fmaf(-z, z, p));
}

// Standard normal CDF Phi(v) = erfc(-v / sqrt 2) / 2, accurate in both tails.
__device__ __forceinline__ float normal_cdf(float v) {
  const float half_tail = 0.5f * erfc_nonneg(fabsf(v) * kSqrt1_2);
  return v < 0.f ? half_tail : 1.f - half_tail;
}

// GELU(v) = v * Phi(v); the tanh form is 0.5 v (1 + tanh(u)) = v * sigmoid(2u),
// u = sqrt(2/pi) (v + 0.044715 v^3), written with the sigmoid so that no 1 + tanh cancels.
template <bool TANH>
__device__ __forceinline__ float gelu(float v) {
  if constexpr (TANH) {
    const float u = kSqrt2OverPi * fmaf(kTanhC * v, v * v, v);
    return __fdividef(v, 1.f + __expf(-2.f * u));
  } else {
    return v * normal_cdf(v);
  }
}

template <bool TANH>
__device__ __forceinline__ float gelu_grad(float v) {
  if constexpr (TANH) {
    const float u = kSqrt2OverPi * fmaf(kTanhC * v, v * v, v);
    const float s = __fdividef(1.f, 1.f + __expf(-2.f * u));  // sigmoid(2u) = (1 + tanh u) / 2
    const float du = kSqrt2OverPi * fmaf(3.f * kTanhC, v * v, 1.f);
    return s + 2.f * v * s * (1.f - s) * du;
  } else {
    return normal_cdf(v) + v * kInvSqrt2Pi * __expf(-0.5f * v * v);
  }
}

template <typename T, typename W, int VEC, bool TANH>
__global__ void __launch_bounds__(kThreads) bias_gelu_fwd(const T* __restrict__ x, const W* __restrict__ bias,
                                                          T* __restrict__ y, int64_t rows, int cols, int band) {
  const int col = (blockIdx.x * kThreads + threadIdx.x) * VEC;
  if (col >= cols) return;
  float b[VEC];
  load_float<VEC>(bias + col, b);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * band;
  const int64_t r1 = r0 + band < rows ? r0 + band : rows;
  for (int64_t r = r0; r < r1; r += kUnroll) {
    float v[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r + u < r1) load_float<VEC>(x + (r + u) * cols + col, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u < r1) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[u][k] = gelu<TANH>(v[u][k] + b[k]);
        store_float<VEC>(y + (r + u) * cols + col, v[u]);
      }
    }
  }
}

template <typename T, typename W, int VEC, bool TANH>
__global__ void __launch_bounds__(kThreads) bias_gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                                          const W* __restrict__ bias, T* __restrict__ dx,
                                                          float* __restrict__ part, int64_t rows, int cols, int band) {
  const int col = (blockIdx.x * kThreads + threadIdx.x) * VEC;
  if (col >= cols) return;
  float b[VEC], db[VEC];
  load_float<VEC>(bias + col, b);
#pragma unroll
  for (int k = 0; k < VEC; ++k) db[k] = 0.f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * band;
  const int64_t r1 = r0 + band < rows ? r0 + band : rows;
  for (int64_t r = r0; r < r1; r += kUnroll) {
    float v[kUnroll][VEC], g[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u < r1) {
        load_float<VEC>(x + (r + u) * cols + col, v[u]);
        load_float<VEC>(dy + (r + u) * cols + col, g[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u < r1) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          g[u][k] *= gelu_grad<TANH>(v[u][k] + b[k]);
          db[k] += g[u][k];
        }
        store_float<VEC>(dx + (r + u) * cols + col, g[u]);
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
      const int band = static_cast<int>(std::max<int64_t>(2 * kUnroll, ceil_div(rows, 65535)));
      const dim3 grid(static_cast<unsigned>(ceil_div(cols / V, kThreads)), static_cast<unsigned>(ceil_div(rows, band)));
      bias_gelu_fwd<T, W, V, decltype(tanh_c)::value><<<grid, kThreads, 0, stream>>>(xp, bp, yp, rows, cols, band);
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
      // About 8 blocks per SM in all; bands a multiple of the unroll.
      const int64_t by_target = std::max<int64_t>(1, 8 * sm_count() / bx);
      int64_t band = ceil_div(ceil_div(rows, by_target), kUnroll) * kUnroll;
      band = std::max<int64_t>(band, ceil_div(rows, 65535));
      nb = ceil_div(rows, band);
      part = at::empty({nb, cols}, x.options().dtype(at::kFloat));
      const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(nb));
      bias_gelu_bwd<T, W, V, decltype(tanh_c)::value><<<grid, kThreads, 0, stream>>>(
          gp, xp, bp, op_, part.data_ptr<float>(), rows, cols, static_cast<int>(band));
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
