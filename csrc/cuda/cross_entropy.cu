// CUDA softmax cross-entropy over the rows of logits (N, V) in their own dtype, and its backward
// dlogits = g * (softmax(logits) - onehot(label)).
//
// The masked-LM loss is the one cross-entropy that costs: its logits are (masked tokens, 30,522),
// 312 MB in bf16 for a BERT-Base step at batch 256.  Upcasting them to fp32 and running
// log_softmax, nll_loss and argmax over the copy moves about 8 bytes per logit forward and
// 10 backward.  Here the forward reads each logit once (2 bytes for 16-bit types) and keeps per
// row only the log-sum-exp; the backward reads the logits once and writes their gradient once.
//
// Forward: one block per row.  Each thread walks its 16-byte vectors keeping a running maximum,
// the sum of exp(x - maximum) rescaled when the maximum grows (one pass: Milakov and Gimelshein,
// "Online normalizer calculation for softmax", 2018) and the first index of the maximum; the
// block merges the threads' triples in shuffles and shared memory.  Thread 0 writes
// loss = lse - x[label], lse and the argmax (the first maximal index, as torch.argmax).
// Backward: one block per row, each thread its vectors of exp(x - lse) * g, minus g at the label.
//
// Rows labelled ignore_index get loss 0 and a zero gradient; a label outside [0, V) gives a NaN
// loss (no host synchronisation to check it).  Rows may be strided (a view of a wider buffer whose
// rows start on 16-byte boundaries, as the vocabulary projection's are); the gradient is written
// into rows of the same alignment and returned as a view of the first V columns.
// Precision: fp32 throughout; exp by the hardware exp2 (ex2.approx, ~2 ulp), log by logf.
#include "../common.h"
#include "cuda_util.cuh"

#include <climits>

namespace bertctl::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float exp_(float v) { return exp2f(v * kLog2e); }

// (m, s, i) with s = sum exp(x - m) over the elements seen and i the first index of m.
struct Online {
  float m = -INFINITY, s = 0.f;
  int i = INT_MAX;

  __device__ __forceinline__ void merge(float om, float os, int oi) {
    const float M = fmaxf(m, om);
    const float a = m == -INFINITY ? 0.f : s * exp_(m - M);
    const float b = om == -INFINITY ? 0.f : os * exp_(om - M);
    if (om > m || (om == m && oi < i)) i = oi;
    m = M;
    s = a + b;
  }

  // n values at columns [col, col + n), col increasing from call to call within a thread.
  template <int N>
  __device__ __forceinline__ void add(const float (&v)[N], int col) {
    float lm = v[0];
    int li = 0;
#pragma unroll
    for (int k = 1; k < N; ++k)
      if (v[k] > lm) lm = v[k], li = k;
    if (lm > m) {
      s = m == -INFINITY ? 0.f : s * exp_(m - lm);
      m = lm;
      i = col + li;
    }
    if (m == -INFINITY) return;  // every value so far -inf: nothing to add
#pragma unroll
    for (int k = 0; k < N; ++k) s += exp_(v[k] - m);
  }
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) ce_fwd(const T* __restrict__ logits, int64_t ld, int V,
                                                   const int64_t* __restrict__ labels, int64_t ignore_index,
                                                   float* __restrict__ loss, float* __restrict__ lse,
                                                   int64_t* __restrict__ argmax) {
  pdl_wait();
  __shared__ float sm[kThreads / kWarp], ss[kThreads / kWarp];
  __shared__ int si[kThreads / kWarp];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * ld;
  Online o;
  const int nvec = V / VEC;
  for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
    float v[VEC];
    load_float<VEC>(x + static_cast<int64_t>(j) * VEC, v);
    o.add(v, j * VEC);
  }
  for (int c = nvec * VEC + threadIdx.x; c < V; c += blockDim.x) {
    const float v[1] = {static_cast<float>(x[c])};
    o.add(v, c);
  }
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) {
    const float om = __shfl_xor_sync(0xffffffffu, o.m, off);
    const float os = __shfl_xor_sync(0xffffffffu, o.s, off);
    const int oi = __shfl_xor_sync(0xffffffffu, o.i, off);
    o.merge(om, os, oi);
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  if (lane == 0) sm[warp] = o.m, ss[warp] = o.s, si[warp] = o.i;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < warps; ++w) o.merge(sm[w], ss[w], si[w]);
  const float l = o.m + logf(o.s);
  const int64_t label = labels[row];
  float r = 0.f;
  if (label != ignore_index) r = label >= 0 && label < V ? l - static_cast<float>(x[label]) : NAN;
  loss[row] = r;
  lse[row] = l;
  argmax[row] = o.i == INT_MAX ? 0 : o.i;  // INT_MAX: every value NaN
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) ce_bwd(const float* __restrict__ grad_loss, const T* __restrict__ logits,
                                                   int64_t ld, int V, const int64_t* __restrict__ labels,
                                                   int64_t ignore_index, const float* __restrict__ lse,
                                                   T* __restrict__ dx, int64_t ldx) {
  pdl_wait();
  const int64_t row = blockIdx.x;
  const int64_t label = labels[row];
  const bool ignored = label == ignore_index;
  const float g = ignored ? 0.f : grad_loss[row];
  const float l = lse[row];
  const T* x = logits + row * ld;
  T* d = dx + row * ldx;
  const int nvec = V / VEC;
  for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
    float v[VEC];
    const int64_t c = static_cast<int64_t>(j) * VEC;
    load_float<VEC>(x + c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = ignored ? 0.f : g * exp_(v[k] - l) - (c + k == label ? g : 0.f);
    store_float<VEC, true>(d + c, v);
  }
  for (int c = nvec * VEC + threadIdx.x; c < V; c += blockDim.x) {
    const float v = static_cast<float>(x[c]);
    d[c] = static_cast<T>(ignored ? 0.f : g * exp_(v - l) - (c == label ? g : 0.f));
  }
}

// Threads per row: whole warps, no more than the row's vectors need.
int threads_for(int V, int vec) {
  const int need = static_cast<int>(ceil_div(ceil_div(V, vec), kWarp) * kWarp);
  return std::min(kThreads, std::max(kWarp, need));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_cuda(const at::Tensor& logits, const at::Tensor& labels,
                                                                  int64_t ignore_index) {
  const char* op = "bertctl::cross_entropy";
  check_cross_entropy(logits, labels, op);
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  const auto x = rows_unit_stride(logits);
  const auto lab = labels.contiguous();
  const int64_t N = x.size(0);
  const int V = static_cast<int>(x.size(1));
  auto fopt = x.options().dtype(at::kFloat);
  auto loss = at::empty({N}, fopt), lse = at::empty({N}, fopt);
  auto argmax = at::empty({N}, x.options().dtype(at::kLong));
  if (N == 0) return {loss, lse, argmax};
  const int64_t ld = N > 1 ? x.stride(0) : V;
  const auto stream = at::cuda::getCurrentCUDAStream();
  BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_cross_entropy_cuda", [&] {
    using T = scalar_t;
    constexpr int V16 = 16 / sizeof(T);
    const T* xp = x.data_ptr<T>();
    auto run = [&](auto vec) {
      constexpr int W = decltype(vec)::value;
      launch(ce_fwd<T, W>, dim3(static_cast<unsigned>(N)), threads_for(V, W), 0, stream, xp, ld, V,
             lab.data_ptr<int64_t>(), ignore_index, loss.data_ptr<float>(), lse.data_ptr<float>(),
             argmax.data_ptr<int64_t>());
    };
    if (aligned16(xp) && ld % V16 == 0) run(std::integral_constant<int, V16>{});
    else run(std::integral_constant<int, 1>{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {loss, lse, argmax};
}

at::Tensor cross_entropy_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                                       const at::Tensor& lse, int64_t ignore_index) {
  check_cross_entropy_backward(grad_loss, logits, labels, lse, "bertctl::cross_entropy_backward");
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  const auto x = rows_unit_stride(logits);
  const auto lab = labels.contiguous(), l = lse.contiguous();
  const auto g = grad_loss.to(at::kFloat).contiguous();
  const int64_t N = x.size(0);
  const int V = static_cast<int>(x.size(1));
  const int64_t ld = N > 1 ? x.stride(0) : V;
  const int64_t V16 = 16 / x.element_size();
  const int64_t ldx = ceil_div(V, V16) * V16;  // rows of the gradient on 16-byte boundaries
  auto dx = at::empty({N, ldx}, x.options());
  if (N > 0) {
    const auto stream = at::cuda::getCurrentCUDAStream();
    BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_cross_entropy_backward_cuda", [&] {
      using T = scalar_t;
      constexpr int W16 = 16 / sizeof(T);
      const T* xp = x.data_ptr<T>();
      T* dp = dx.data_ptr<T>();
      auto run = [&](auto vec) {
        constexpr int W = decltype(vec)::value;
        launch(ce_bwd<T, W>, dim3(static_cast<unsigned>(N)), threads_for(V, W), 0, stream, g.data_ptr<float>(),
               xp, ld, V, lab.data_ptr<int64_t>(), ignore_index, l.data_ptr<float>(), dp, ldx);
      };
      if (aligned16(xp) && ld % W16 == 0 && aligned16(dp)) run(std::integral_constant<int, W16>{});
      else run(std::integral_constant<int, 1>{});
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return dx.narrow(1, 0, V);
}

}  // namespace
}  // namespace bertctl::cuda

TORCH_LIBRARY_IMPL(bertctl, CUDA, m) {
  m.impl("cross_entropy", &bertctl::cuda::cross_entropy_cuda);
  m.impl("cross_entropy_backward", &bertctl::cuda::cross_entropy_backward_cuda);
}
