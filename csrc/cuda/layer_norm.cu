// CUDA LayerNorm(x + residual) over the last dim, and its backward.
//
// Forward: one warp per row, a block of one warp (the variants that were slower are listed
// at the kernels; their timings are in benchmarks/ops/NOTES-kernels.md).  16-bit rows of H <= 1024 on the vector path (BERT's sizes): ln_fwd_packed,
// which issues every load first and keeps the 16-bit words, re-deriving h in each pass;
// others: ln_fwd_rows, which holds h in fp32.
// Rows of H <= 2048 with H % 8 == 0 (16-bit) or H % 4 == 0 (fp32) and 16-byte aligned
// tensors sit in registers, read with 16-byte loads (the exact fit NVEC = H / (32 * VEC)
// vectors per lane, so 768 and 1024 waste no lanes); other rows up to 1024 use scalar
// accesses; longer ones a block per row.  The sum h = x + residual is never written: the
// forward moves read x, residual, write y (the minimum; ln_fwd_packed stores y evict-first); mean and
// the variance (second pass over registers, not E[h^2] - mean^2) in fp32, saved as fp32
// mean/rstd (not by layer_norm_inference, which stores no statistics).  The mean is
// taken of the row shifted by its first element, so a constant row has exactly its value as
// mean and gives y = bias exactly even with eps = 1e-12 (sum * (1 / H) alone is off by an ulp,
// which rstd = 1e6 turns into errors of 0.1).  The backward rounds g * w once and takes
// mean(g * w) by a correctly rounded division, so a constant g * w cancels to dx = 0 exactly.
//
// Backward, two stages.  Stage 1 for rows of 33..384 16-byte vectors (16-bit H 264..3072,
// fp32 H 132..1536; BERT's 768 and 1024): ln_bwd_groups, a persistent grid of 384-thread
// blocks split into groups of one row's width, one vector per thread, so each thread keeps
// its columns' fp32 partial sums of dy * xhat (dweight) and dy (dbias) in
// registers across the rows its group visits and prefetches the next row; about twice the
// resident warps of a warp per row, so more loads are in flight.  Other rows: ln_bwd_rows, 8-warp blocks (two per SM, capped at 128 registers; 4-warp
// blocks for H > 768 in 16-bit), one warp per row at a time, per-lane partials added across
// warps in shared memory.  Both recompute h from x and residual and write
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w; each block writes one
// (2, H) partial in a fixed order.  Stage 2 (column_sum) adds the blocks' partials.
// Deterministic: no atomics.
//
// Weight and bias: fp32, or the input's 16-bit dtype (read as is on the vector
// path, converted to fp32 on the host for the others); dweight/dbias are
// returned in the weight's dtype.
// Precision: fp32 throughout, output rounded once; eps as small as 1e-12 is fine
// (rsqrt of var + eps in fp32).
#include "../common.h"
#include "cuda_util.cuh"
#include "layer_norm_backward.cuh"

namespace bertctl::cuda {
namespace {

// One warp per block: a block's slot frees as soon as its row is done, where a 4-warp block
// waits for its slowest row (NOTES-kernels.md, run 13).
constexpr int kFwdThreads = kWarp;
// Backward blocks: 8 warps capped at 128 registers (two blocks per SM) while a lane's
// partial sums fit (up to 3 vectors per lane: H = 768 in 16-bit); 4 uncapped warps beyond.
constexpr int bwd_threads(int nvec) { return nvec <= 3 ? 256 : 128; }
constexpr int bwd_min_blocks(int nvec) { return nvec <= 3 ? 2 : 1; }

// One warp per row.  Slower or no faster at BERT shapes, each because it cost resident warps
// or added traffic (NOTES-kernels.md, runs 2, 12 and 13): a persistent warp prefetching or
// pipelining rows ahead, a block per row with shared-memory sums, weight and bias loaded before
// the reductions, two rows per warp or a half-warp per row, streaming or L1-bypassing loads, an
// L1 prefetch of weight and bias, and a single shifted pass for mean and variance.
template <typename T, typename W, int VEC, int NVEC>
__global__ void __launch_bounds__(kFwdThreads) ln_fwd_rows(const T* __restrict__ x, const T* __restrict__ res,
                                                           const W* __restrict__ w, const W* __restrict__ b,
                                                           T* __restrict__ y, float* __restrict__ mean_out,
                                                           float* __restrict__ rstd_out, int64_t rows, int cols,
                                                           float inv_cols, float eps) {
  pdl_wait();
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kFwdThreads + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;  // whole warps: a warp's lanes share one row
  float h[NVEC][VEC];
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * kWarp + lane) * VEC;
    if (col < cols) {
      load_float<VEC>(x + row * cols + col, h[i]);
      if (res != nullptr) {
        float r[VEC];
        load_float<VEC>(res + row * cols + col, r);
#pragma unroll
        for (int k = 0; k < VEC; ++k) h[i][k] += r[k];
      }
    }
  }
  warp_row_layer_norm<VEC, NVEC>(h, lane, cols, inv_cols, eps, w, b, y + row * cols,
                                 mean_out == nullptr ? nullptr : mean_out + row,
                                 mean_out == nullptr ? nullptr : rstd_out + row);
}

// One warp per row for 16-bit rows on the vector path: every load is issued first (x, the
// residual and, when they are 16-bit too and a lane holds at most 4 vectors, weight and bias)
// and kept as loaded, and h = x + residual is re-derived in fp32 from those words in each of
// the three passes (sum, squared deviations, output) rather than held in fp32 registers.
// Same arithmetic in the same order as ln_fwd_rows, so the results are bitwise the same.
// Holding 16-bit words instead of fp32 copies leaves room for enough resident warps to reach
// torch.compile's kernel, which ln_fwd_rows does not (NOTES-kernels.md, run 17; ops-h100.json).
template <typename T, typename W, int VEC, int NVEC, bool HasRes>
__global__ void __launch_bounds__(kFwdThreads) ln_fwd_packed(const T* __restrict__ x, const T* __restrict__ res,
                                                             const W* __restrict__ w, const W* __restrict__ b,
                                                             T* __restrict__ y, float* __restrict__ mean_out,
                                                             float* __restrict__ rstd_out, int64_t rows, int cols,
                                                             float inv_cols, float eps) {
  static_assert(kFwdThreads == kWarp, "one row per block");
  constexpr bool kEarly = std::is_same_v<T, W> && NVEC <= 4;
  pdl_wait();
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x;
  if (row >= rows) return;
  Pack<T, VEC> xr[NVEC], rr[HasRes ? NVEC : 1];
  Pack<W, VEC> wr[kEarly ? NVEC : 1], br[kEarly ? NVEC : 1];
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * kWarp + lane) * VEC;
    if (col < cols) {
      xr[i] = load_pack<VEC>(x + row * cols + col);
      if constexpr (HasRes) rr[i] = load_pack<VEC>(res + row * cols + col);
    }
  }
  if constexpr (kEarly) {
#pragma unroll
    for (int i = 0; i < NVEC; ++i) {
      const int col = (i * kWarp + lane) * VEC;
      if (col < cols) {
        wr[i] = load_pack<VEC>(w + col);
        br[i] = load_pack<VEC>(b + col);
      }
    }
  }
  auto h_of = [&](int i, float (&h)[VEC]) {
    unpack_float<VEC>(xr[i], h);
    if constexpr (HasRes) {
      float r[VEC];
      unpack_float<VEC>(rr[i], r);
#pragma unroll
      for (int k = 0; k < VEC; ++k) h[k] += r[k];
    }
  };
  float h0;  // the row's first element (lane 0 holds it)
  {
    float h[VEC];
    h_of(0, h);
    h0 = __shfl_sync(0xffffffffu, h[0], 0);
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    if ((i * kWarp + lane) * VEC < cols) {
      float h[VEC];
      h_of(i, h);
#pragma unroll
      for (int k = 0; k < VEC; ++k) sum += h[k] - h0;
    }
  }
  const float mean = h0 + group_sum<kWarp>(sum) * inv_cols;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    if ((i * kWarp + lane) * VEC < cols) {
      float h[VEC];
      h_of(i, h);
#pragma unroll
      for (int k = 0; k < VEC; ++k) sq += (h[k] - mean) * (h[k] - mean);
    }
  }
  const float rstd = rsqrtf(group_sum<kWarp>(sq) * inv_cols + eps);
  if (lane == 0 && mean_out != nullptr) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * kWarp + lane) * VEC;
    if (col < cols) {
      float h[VEC], wv[VEC], bv[VEC], o[VEC];
      h_of(i, h);
      if constexpr (kEarly) {
        unpack_float<VEC>(wr[i], wv);
        unpack_float<VEC>(br[i], bv);
      } else {
        load_float<VEC>(w + col, wv);
        load_float<VEC>(b + col, bv);
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = fmaf((h[k] - mean) * rstd, wv[k], bv[k]);
      store_float<VEC, true>(y + row * cols + col, o);
    }
  }
}

// Block-per-row forward for rows too long for registers: three passes through L1/L2.
template <typename T>
__global__ void __launch_bounds__(256) ln_fwd_long(const T* __restrict__ x, const T* __restrict__ res,
                                                   const float* __restrict__ w, const float* __restrict__ b,
                                                   T* __restrict__ y, float* __restrict__ mean_out,
                                                   float* __restrict__ rstd_out, int cols, float eps) {
  pdl_wait();
  __shared__ float smem[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * cols;
  auto h = [&](int c) {
    float v = static_cast<float>(x[base + c]);
    return res != nullptr ? v + static_cast<float>(res[base + c]) : v;
  };
  const float h0 = h(0);
  float s = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += h(c) - h0;
  const float mean = h0 + block_sum(s, smem) / cols;
  float q = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) q += (h(c) - mean) * (h(c) - mean);
  const float rstd = rsqrtf(block_sum(q, smem) / cols + eps);
  if (threadIdx.x == 0 && mean_out != nullptr) {
    mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
  for (int c = threadIdx.x; c < cols; c += blockDim.x) y[base + c] = static_cast<T>(fmaf((h(c) - mean) * rstd, w[c], b[c]));
}

template <typename T, typename W, int VEC, int NVEC>
__global__ void __launch_bounds__(bwd_threads(NVEC), bwd_min_blocks(NVEC)) ln_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x,
                                                           const T* __restrict__ res, const W* __restrict__ w,
                                                           const float* __restrict__ mean,
                                                           const float* __restrict__ rstd, T* __restrict__ dx,
                                                           float* __restrict__ part, int64_t rows, int cols) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ float acc[];  // (2, cols): dweight then dbias partials of this block
  constexpr int kBwdThreads = bwd_threads(NVEC), kWarps = kBwdThreads / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  // Only the dweight/dbias partials live in registers across rows (the weight is re-read
  // from L1 each row): at most 128 registers, two 8-warp blocks per SM.
  float dw[NVEC][VEC], db[NVEC][VEC];
#pragma unroll
  for (int i = 0; i < NVEC; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dw[i][k] = db[i][k] = 0.f;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    float h[NVEC][VEC], g[NVEC][VEC];
    const float mu = mean[row], rs = rstd[row];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < NVEC; ++i) {
      const int col = (i * kWarp + lane) * VEC;
      if (col < cols) {
        float wv[VEC];
        load_float<VEC>(x + row * cols + col, h[i]);
        load_float<VEC>(dy + row * cols + col, g[i]);
        load_float<VEC>(w + col, wv);
        if (res != nullptr) {
          float r[VEC];
          load_float<VEC>(res + row * cols + col, r);
#pragma unroll
          for (int k = 0; k < VEC; ++k) h[i][k] += r[k];
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = (h[i][k] - mu) * rs, gw = __fmul_rn(g[i][k], wv[k]);  // never fused into an FMA
          dw[i][k] = fmaf(g[i][k], xh, dw[i][k]);
          db[i][k] += g[i][k];
          h[i][k] = xh;
          g[i][k] = gw;  // dx reuses the rounded g * w that entered the sums
          s1 += gw;
          s2 = fmaf(gw, xh, s2);
        }
      }
    }
    // c1 correctly rounded (not fast-math's approximate division): a constant g * w cancels exactly.
    const float c1 = __fdiv_rn(group_sum<kWarp>(s1), cols), c2 = group_sum<kWarp>(s2) / cols;
#pragma unroll
    for (int i = 0; i < NVEC; ++i) {
      const int col = (i * kWarp + lane) * VEC;
      if (col < cols) {
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = rs * (g[i][k] - c1 - h[i][k] * c2);
        store_float<VEC>(dx + row * cols + col, o);
      }
    }
  }
  for (int c = threadIdx.x; c < 2 * cols; c += kBwdThreads) acc[c] = 0.f;
  __syncthreads();
  for (int k = 0; k < kWarps; ++k) {  // warps add in a fixed order: deterministic
    if (warp == k) {
#pragma unroll
      for (int i = 0; i < NVEC; ++i) {
        const int col = (i * kWarp + lane) * VEC;
        if (col < cols)
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            acc[col + j] += dw[i][j];
            acc[cols + col + j] += db[i][j];
          }
      }
    }
    __syncthreads();
  }
  float* out = part + static_cast<int64_t>(blockIdx.x) * 2 * cols;
  for (int c = threadIdx.x; c < 2 * cols; c += kBwdThreads) out[c] = acc[c];
}

// Backward for rows too long for registers: one block walks rows; thread t owns
// columns t, t + 256, ... so its dweight/dbias partials in `part` need no atomics.
template <typename T>
__global__ void __launch_bounds__(256) ln_bwd_long(const T* __restrict__ dy, const T* __restrict__ x,
                                                   const T* __restrict__ res, const float* __restrict__ w,
                                                   const float* __restrict__ mean, const float* __restrict__ rstd,
                                                   T* __restrict__ dx, float* __restrict__ part, int64_t rows,
                                                   int cols) {
  pdl_wait();
  pdl_trigger();
  __shared__ float smem[32];
  float* pw = part + static_cast<int64_t>(blockIdx.x) * 2 * cols;
  float* pb = pw + cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) pw[c] = pb[c] = 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    const float mu = mean[row], rs = rstd[row];
    auto xhat = [&](int c) {
      float v = static_cast<float>(x[base + c]);
      if (res != nullptr) v += static_cast<float>(res[base + c]);
      return (v - mu) * rs;
    };
    float s1 = 0.f, s2 = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float g = static_cast<float>(dy[base + c]), xh = xhat(c), gw = __fmul_rn(g, w[c]);
      s1 += gw;
      s2 += gw * xh;
      pw[c] += g * xh;
      pb[c] += g;
    }
    const float c1 = __fdiv_rn(block_sum(s1, smem), cols), c2 = block_sum(s2, smem) / cols;  // as in ln_bwd_rows
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float gw = __fmul_rn(static_cast<float>(dy[base + c]), w[c]);
      dx[base + c] = static_cast<T>(rs * (gw - c1 - xhat(c) * c2));
    }
  }
}

// Calls f(integral_constant<VEC>, integral_constant<NVEC>) for a row of `cols`; false if none fits.
template <int V, bool scalar_ok = true, typename F>
bool with_row_layout(int cols, bool wide, F&& f) {
  using std::integral_constant;
  if (wide && cols % V == 0) {
    const int nvec = (cols / V + kWarp - 1) / kWarp;  // vectors per lane
    // Exact fits for BERT's sizes (768: 3 bf16 / 6 fp32 vectors per lane; 1024: 4 / 8).
    if (nvec <= 1) { f(integral_constant<int, V>{}, integral_constant<int, 1>{}); return true; }
    if (nvec <= 2) { f(integral_constant<int, V>{}, integral_constant<int, 2>{}); return true; }
    if (nvec <= 3) { f(integral_constant<int, V>{}, integral_constant<int, 3>{}); return true; }
    if (nvec <= 4) { f(integral_constant<int, V>{}, integral_constant<int, 4>{}); return true; }
    if (nvec <= 6) { f(integral_constant<int, V>{}, integral_constant<int, 6>{}); return true; }
    if (nvec <= 8) { f(integral_constant<int, V>{}, integral_constant<int, 8>{}); return true; }
    if constexpr (V == 4) {  // fp32 rows up to 2048
      if (nvec <= 16) { f(integral_constant<int, V>{}, integral_constant<int, 16>{}); return true; }
    }
  }
  if (!scalar_ok) return false;
  const int n = (cols + kWarp - 1) / kWarp;  // scalar values per lane
  if (n <= 1) { f(integral_constant<int, 1>{}, integral_constant<int, 1>{}); return true; }
  if (n <= 2) { f(integral_constant<int, 1>{}, integral_constant<int, 2>{}); return true; }
  if (n <= 4) { f(integral_constant<int, 1>{}, integral_constant<int, 4>{}); return true; }
  if (n <= 8) { f(integral_constant<int, 1>{}, integral_constant<int, 8>{}); return true; }
  if (n <= 16) { f(integral_constant<int, 1>{}, integral_constant<int, 16>{}); return true; }
  if (n <= 32) { f(integral_constant<int, 1>{}, integral_constant<int, 32>{}); return true; }
  return false;
}

at::Tensor as_float_param(const at::Tensor& p) { return p.scalar_type() == at::kFloat ? p.contiguous() : p.to(at::kFloat).contiguous(); }

// y, and with stats the fp32 mean and rstd (undefined without: the kernels store none).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(const at::Tensor& x,
                                                                  const c10::optional<at::Tensor>& residual,
                                                                  const at::Tensor& weight, const at::Tensor& bias,
                                                                  double eps, bool stats, const char* op) {
  TORCH_CHECK(x.dim() >= 1, op, ": input must have at least one dimension");
  check_param(x, weight, op, "weight");
  check_param(x, bias, op, "bias");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    check_same(x, *residual, op, "residual");
    res = residual->contiguous();
  }
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  at::Tensor mean, rstd;
  if (stats) mean = stats_like(x), rstd = stats_like(x);
  const int64_t rows = rows_of(x), cols64 = last_dim(x);
  if (rows == 0 || cols64 == 0) return {y, mean, rstd};
  TORCH_CHECK(cols64 <= INT32_MAX, op, ": rows longer than 2^31 are not supported");
  TORCH_CHECK(rows <= INT32_MAX, op, ": more than 2^31 rows are not supported (a block per row)");
  const int cols = static_cast<int>(cols64);
  const auto stream = at::cuda::getCurrentCUDAStream();
  BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_layer_norm_cuda", [&] {
    using T = scalar_t;
    const T* xp = xc.data_ptr<T>();
    const T* rp = res.defined() ? res.data_ptr<T>() : nullptr;
    T* yp = y.data_ptr<T>();
    float* mp = stats ? mean.data_ptr<float>() : nullptr;
    float* sp = stats ? rstd.data_ptr<float>() : nullptr;
    const bool wide = aligned16(xp) && (rp == nullptr || aligned16(rp)) && aligned16(yp);
    const auto dispatch = [&](auto* wp, auto* bp) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
      constexpr int V = 16 / sizeof(T);
      return with_row_layout<V, std::is_same_v<W, float>>(
          cols, wide && aligned16(wp) && aligned16(bp), [&](auto vec, auto nvec) {
            constexpr int V = decltype(vec)::value, NV = decltype(nvec)::value;
            const int64_t blocks = ceil_div(rows, kFwdThreads / kWarp);
            const float inv = 1.f / cols, epsf = static_cast<float>(eps);
            if constexpr (sizeof(T) == 2 && V * sizeof(T) == 16 && NV <= 4) {  // 16-bit vector rows, H <= 1024
              if (rp != nullptr)
                launch(ln_fwd_packed<T, W, V, NV, true>, blocks, kFwdThreads, 0, stream, xp, rp, wp, bp, yp, mp, sp,
                       rows, cols, inv, epsf);
              else
                launch(ln_fwd_packed<T, W, V, NV, false>, blocks, kFwdThreads, 0, stream, xp, rp, wp, bp, yp, mp, sp,
                       rows, cols, inv, epsf);
            } else {
              launch(ln_fwd_rows<T, W, V, NV>, blocks, kFwdThreads, 0, stream, xp, rp, wp, bp, yp, mp, sp, rows, cols,
                     inv, epsf);
            }
          });
    };
    // 16-bit parameters of the input's dtype are read as they are on the vector path.
    bool fits = false;
    if constexpr (!std::is_same_v<T, float>) {
      if (weight.scalar_type() == x.scalar_type()) {
        auto wc = weight.contiguous(), bc = bias.contiguous();
        fits = dispatch(wc.data_ptr<T>(), bc.data_ptr<T>());
      }
    }
    if (!fits) {
      auto w = as_float_param(weight), b = as_float_param(bias);
      fits = dispatch(w.data_ptr<float>(), b.data_ptr<float>());
      if (!fits) {
        launch(ln_fwd_long<T>, rows, 256, 0, stream, xp, rp, w.data_ptr<float>(), b.data_ptr<float>(), yp, mp, sp,
               cols, static_cast<float>(eps));
      }
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cuda(const at::Tensor& x,
                                                               const c10::optional<at::Tensor>& residual,
                                                               const at::Tensor& weight, const at::Tensor& bias,
                                                               double eps) {
  return layer_norm_forward(x, residual, weight, bias, eps, true, "bertctl::layer_norm");
}

at::Tensor layer_norm_inference_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                     const at::Tensor& weight, const at::Tensor& bias, double eps) {
  return std::get<0>(layer_norm_forward(x, residual, weight, bias, eps, false, "bertctl::layer_norm_inference"));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(
    const at::Tensor& grad_y, const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd) {
  const char* op = "bertctl::layer_norm_backward";
  check_same(x, grad_y, op, "grad_y");
  check_param(x, weight, op, "weight");
  TORCH_CHECK(mean.numel() == rows_of(x) && rstd.numel() == rows_of(x), op, ": mean/rstd must have ", rows_of(x),
              " elements");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    check_same(x, *residual, op, "residual");
    res = residual->contiguous();
  }
  auto xc = x.contiguous(), dyc = grad_y.contiguous();
  auto mc = mean.to(at::kFloat).contiguous(), rc = rstd.to(at::kFloat).contiguous();
  auto dx = at::empty_like(xc);
  const int64_t rows = rows_of(x), cols64 = last_dim(x);
  if (rows == 0 || cols64 == 0) {
    return {dx, at::zeros_like(weight), at::zeros_like(weight)};
  }
  TORCH_CHECK(cols64 <= INT32_MAX, op, ": rows longer than 2^31 are not supported");
  const int cols = static_cast<int>(cols64);
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor part;
  int64_t nb = 0;
  BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_layer_norm_backward_cuda", [&] {
    using T = scalar_t;
    const T* gp = dyc.data_ptr<T>();
    const T* xp = xc.data_ptr<T>();
    const T* rp = res.defined() ? res.data_ptr<T>() : nullptr;
    T* op_ = dx.data_ptr<T>();
    const bool wide = aligned16(gp) && aligned16(xp) && (rp == nullptr || aligned16(rp)) && aligned16(op_);
    const size_t smem = 2 * cols * sizeof(float);
    const auto dispatch = [&](auto* wp) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
      constexpr int V = 16 / sizeof(T);
      if (const int gt = block_group_threads<V>(cols, wide && aligned16(wp)); gt > 0 && gt <= kGroupThreads) {
        const int groups = kGroupThreads / gt;
        const size_t gsmem = ln_bwd_groups_smem(cols, groups, false);
        if (gsmem <= 48 * 1024) {
          auto kernel = ln_bwd_groups<T, W, V, false>;
          nb = resident_blocks(kernel, groups * gt, gsmem, ceil_div(rows, groups));
          part = at::empty({nb, 2 * cols}, x.options().dtype(at::kFloat));
          launch(kernel, nb, groups * gt, gsmem, stream, gp, xp, rp, static_cast<const float*>(nullptr), wp,
                 Drop{nullptr, 0u, 1.f}, mc.data_ptr<float>(), rc.data_ptr<float>(), op_, static_cast<T*>(nullptr),
                 part.data_ptr<float>(), static_cast<float*>(nullptr), rows, cols, 1.f / cols, gt);
          return true;
        }
      }
      return smem <= 48 * 1024 && with_row_layout<V, std::is_same_v<W, float>>(
          cols, wide && aligned16(wp), [&](auto vec, auto nvec) {
            constexpr int V = decltype(vec)::value, NV = decltype(nvec)::value;
            auto kernel = ln_bwd_rows<T, W, V, NV>;
            constexpr int threads = bwd_threads(NV);
            nb = resident_blocks(kernel, threads, smem, ceil_div(rows, threads / kWarp));
            part = at::empty({nb, 2 * cols}, x.options().dtype(at::kFloat));
            launch(kernel, nb, threads, smem, stream, gp, xp, rp, wp, mc.data_ptr<float>(), rc.data_ptr<float>(),
                   op_, part.data_ptr<float>(), rows, cols);
          });
    };
    bool fits = false;
    if constexpr (!std::is_same_v<T, float>) {
      if (weight.scalar_type() == x.scalar_type()) {
        auto wc = weight.contiguous();
        fits = dispatch(wc.data_ptr<T>());
      }
    }
    if (!fits) {
      auto w = as_float_param(weight);
      fits = dispatch(w.data_ptr<float>());
      if (!fits) {
        nb = std::min<int64_t>(rows, 4 * sm_count());
        part = at::empty({nb, 2 * cols}, x.options().dtype(at::kFloat));
        launch(ln_bwd_long<T>, nb, 256, 0, stream, gp, xp, rp, w.data_ptr<float>(), mc.data_ptr<float>(),
               rc.data_ptr<float>(), op_, part.data_ptr<float>(), rows, cols);
      }
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Each partial row is (dweight | dbias): one launch sums both.
  auto sums = column_sums(part, nb, cols, 2, weight.scalar_type(), stream);
  return {dx, sums[0], sums[1]};
}

}  // namespace
}  // namespace bertctl::cuda

TORCH_LIBRARY_IMPL(bertctl, CUDA, m) {
  m.impl("layer_norm", &bertctl::cuda::layer_norm_cuda);
  m.impl("layer_norm_inference", &bertctl::cuda::layer_norm_inference_cuda);
  m.impl("layer_norm_backward", &bertctl::cuda::layer_norm_backward_cuda);
}
