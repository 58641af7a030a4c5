// CUDA LayerNorm(dropout(x + bias) + residual) over the last dim, and its backward: BERT's two
// sub-layer outputs after their matmul (run without its bias), one kernel each way.
//
// The mask is the CPU kernels' (../dropout_hash.h): element i of the tensor is kept when
// lowbias32((i * 0x9E3779B9 + a) ^ b) >= p * 2^32, the key (a, b) derived from an int64 seed.  The seed is a
// one-element tensor on the GPU (bertctl.ops draws it from the CUDA generator), read by the kernel
// at run time, so a CUDA graph replays the op with the seed its replay drew, and the backward
// recomputes the mask from the same tensor: nothing of the mask is stored.  One seed drops the same
// elements on the CPU and the GPU.
//
// Traffic, against the ops apart (torch's dropout, then LayerNorm(x + residual)): the forward reads
// x and the residual and writes y (the ops apart: read x, write the dropped-out tensor and a byte
// mask, read both tensors, write y); the backward reads dy, x and the residual and writes dresidual
// and dx, with the bias's gradient taken from dx on the way (the ops apart: LayerNorm's backward
// reads three and writes one, dropout's reads two and writes one, the matmul's bias gradient reads
// dx again).  The dropped-out sum is never stored, in either direction.
//
// Layouts: the forward runs one warp per row with the row in registers, 16-byte vectors where the row
// is a whole number of them and the tensors are aligned (bf16/fp16 H up to 2048, fp32 up to 1024),
// single elements for other rows of up to 1024; a block per row beyond.  The backward runs such rows
// of 33..1024 vectors (BERT's) in groups of threads one row wide (layer_norm_backward.cuh's ln_bwd_groups, shared with layer_norm.cu), other rows a
// warp per row, or a block per row beyond; each keeps its columns' partial sums of dy * xhat, dy (the
// LayerNorm's weight and bias) and dx (the sub-layer's bias) in registers across the rows of a
// persistent grid; a block adds its threads' partials in a fixed order, and the column sums of the
// blocks' partials (cuda_util.cuh) finish them: deterministic, no atomics.  Arithmetic as layer_norm.cu: fp32 statistics, the mean of the row
// shifted by its first element, the variance from a second pass, g * w rounded once.  Parameters
// (the bias, the LayerNorm's weight and bias) are read in fp32.
#include "../common.h"
#include "../dropout_hash.h"
#include "cuda_util.cuh"
#include "layer_norm_backward.cuh"

namespace bertctl::cuda {
namespace {

constexpr int kBwdThreads = 256;    // bdaln_bwd_rows: 8 warps a block, one row a warp at a time
constexpr int kLongThreads = 256;   // the block-per-row kernels

// h = dropout(x + bias) + residual for VEC elements from column col of row `row`, into h (fp32).
template <int VEC, typename T>
__device__ __forceinline__ void sum_of(const T* x, const T* res, const float* bias, const Drop& d, DropoutKey key,
                                       int64_t row, int cols, int col, float (&h)[VEC]) {
  float r[VEC], b[VEC];
  load_float<VEC>(x + row * cols + col, h);
  load_float<VEC>(res + row * cols + col, r);
  load_float<VEC>(bias + col, b);
  const int64_t i0 = row * cols + col;
#pragma unroll
  for (int k = 0; k < VEC; ++k) h[k] = (h[k] + b[k]) * d.factor(key, i0 + k) + r[k];
}

template <typename T, int VEC, int NVEC>
__global__ void __launch_bounds__(kWarp) bdaln_fwd_rows(const T* __restrict__ x, const T* __restrict__ res,
                                                        const float* __restrict__ bias, const float* __restrict__ w,
                                                        const float* __restrict__ b, Drop d, T* __restrict__ y,
                                                        float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                                        int64_t rows, int cols, float inv_cols, float eps) {
  pdl_wait();
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x;
  if (row >= rows) return;
  const DropoutKey key = d.key();
  float h[NVEC][VEC];
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * kWarp + lane) * VEC;
    if (col < cols) sum_of<VEC>(x, res, bias, d, key, row, cols, col, h[i]);
  }
  warp_row_layer_norm<VEC, NVEC, true>(h, lane, cols, inv_cols, eps, w, b, y + row * cols,
                                       mean_out == nullptr ? nullptr : mean_out + row,
                                       mean_out == nullptr ? nullptr : rstd_out + row);
}

// Rows too long for registers: a block per row, h re-derived from memory in each pass.
template <typename T>
__global__ void __launch_bounds__(kLongThreads) bdaln_fwd_long(const T* __restrict__ x, const T* __restrict__ res,
                                                               const float* __restrict__ bias,
                                                               const float* __restrict__ w,
                                                               const float* __restrict__ b, Drop d, T* __restrict__ y,
                                                               float* __restrict__ mean_out,
                                                               float* __restrict__ rstd_out, int cols, float eps) {
  pdl_wait();
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  const DropoutKey key = d.key();
  auto h = [&](int c) {
    float v[1];
    sum_of<1>(x, res, bias, d, key, row, cols, c, v);
    return v[0];
  };
  const float h0 = h(0);
  float s = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += h(c) - h0;
  const float mean = h0 + block_sum(s, smem) / cols;
  float q = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) q += (h(c) - mean) * (h(c) - mean);
  const float rstd = rsqrtf(block_sum(q, smem) / cols + eps);
  if (threadIdx.x == 0 && mean_out != nullptr) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    y[row * cols + c] = static_cast<T>(fmaf((h(c) - mean) * rstd, w[c], b[c]));
}

// Backward, one warp per row of a persistent grid.  Per row: h and xhat again, g = dy * w rounded
// once, dh = rstd * (g - mean(g) - xhat * mean(g * xhat)) written as dresidual, dx = dh * factor
// (with dropout); the lane's columns collect dy * xhat, dy and dx.  A block's partials, fp32:
// (dweight | dln_bias) in row blockIdx of part_ln (blocks, 2 * cols), dbias in part_b's (blocks, cols).
template <typename T, int VEC, int NVEC>
__global__ void __launch_bounds__(kBwdThreads) bdaln_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x,
                                                              const T* __restrict__ res,
                                                              const float* __restrict__ bias,
                                                              const float* __restrict__ w, Drop d,
                                                              const float* __restrict__ mean,
                                                              const float* __restrict__ rstd, T* __restrict__ dres,
                                                              T* __restrict__ dx, float* __restrict__ part_ln,
                                                              float* __restrict__ part_b, int64_t rows, int cols) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ float acc[];  // (3, cols): dweight, dln_bias, dbias
  constexpr int kWarps = kBwdThreads / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const DropoutKey key = d.key();
  float pw[NVEC][VEC], pb[NVEC][VEC], px[NVEC][VEC];
#pragma unroll
  for (int i = 0; i < NVEC; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) pw[i][k] = pb[i][k] = px[i][k] = 0.f;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const float mu = mean[row], rs = rstd[row];
    float xh[NVEC][VEC], g[NVEC][VEC];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < NVEC; ++i) {
      const int col = (i * kWarp + lane) * VEC;
      if (col < cols) {
        float dyv[VEC], wv[VEC];
        sum_of<VEC>(x, res, bias, d, key, row, cols, col, xh[i]);
        load_float<VEC>(dy + row * cols + col, dyv);
        load_float<VEC>(w + col, wv);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          xh[i][k] = (xh[i][k] - mu) * rs;
          g[i][k] = __fmul_rn(dyv[k], wv[k]);  // never fused into an FMA
          pw[i][k] = fmaf(dyv[k], xh[i][k], pw[i][k]);
          pb[i][k] += dyv[k];
          s1 += g[i][k];
          s2 = fmaf(g[i][k], xh[i][k], s2);
        }
      }
    }
    const float c1 = __fdiv_rn(group_sum<kWarp>(s1), cols), c2 = group_sum<kWarp>(s2) / cols;
#pragma unroll
    for (int i = 0; i < NVEC; ++i) {
      const int col = (i * kWarp + lane) * VEC;
      if (col < cols) {
        float dh[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) dh[k] = rs * (g[i][k] - c1 - xh[i][k] * c2);
        store_float<VEC>(dres + row * cols + col, dh);
        if (dx != nullptr) {
          const int64_t i0 = row * cols + col;
#pragma unroll
          for (int k = 0; k < VEC; ++k) dh[k] *= d.factor(key, i0 + k);
          store_float<VEC>(dx + row * cols + col, dh);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) px[i][k] += dh[k];
      }
    }
  }
  // The warps' partials, added in warp order.
  for (int wi = 0; wi < kWarps; ++wi) {
    if (warp == wi) {
#pragma unroll
      for (int i = 0; i < NVEC; ++i) {
        const int col = (i * kWarp + lane) * VEC;
        if (col < cols)
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            float* a = acc + col + k;
            a[0] = wi == 0 ? pw[i][k] : a[0] + pw[i][k];
            a[cols] = wi == 0 ? pb[i][k] : a[cols] + pb[i][k];
            a[2 * cols] = wi == 0 ? px[i][k] : a[2 * cols] + px[i][k];
          }
      }
    }
    __syncthreads();
  }
  float* out_ln = part_ln + static_cast<int64_t>(blockIdx.x) * 2 * cols;
  float* out_b = part_b + static_cast<int64_t>(blockIdx.x) * cols;
  for (int c = threadIdx.x; c < 2 * cols; c += blockDim.x) out_ln[c] = acc[c];
  for (int c = threadIdx.x; c < cols; c += blockDim.x) out_b[c] = acc[2 * cols + c];
}

// Backward for rows too long for registers: one block walks rows; thread t owns columns t,
// t + 256, ... of its block's partials (no atomics).
template <typename T>
__global__ void __launch_bounds__(kLongThreads) bdaln_bwd_long(const T* __restrict__ dy, const T* __restrict__ x,
                                                               const T* __restrict__ res,
                                                               const float* __restrict__ bias,
                                                               const float* __restrict__ w, Drop d,
                                                               const float* __restrict__ mean,
                                                               const float* __restrict__ rstd, T* __restrict__ dres,
                                                               T* __restrict__ dx, float* __restrict__ part_ln,
                                                               float* __restrict__ part_b, int64_t rows, int cols) {
  pdl_wait();
  pdl_trigger();
  __shared__ float smem[32];
  const DropoutKey key = d.key();
  float* pw = part_ln + static_cast<int64_t>(blockIdx.x) * 2 * cols;
  float* pb = pw + cols;
  float* px = part_b + static_cast<int64_t>(blockIdx.x) * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) pw[c] = pb[c] = px[c] = 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    const float mu = mean[row], rs = rstd[row];
    auto xhat = [&](int c) {
      float v[1];
      sum_of<1>(x, res, bias, d, key, row, cols, c, v);
      return (v[0] - mu) * rs;
    };
    float s1 = 0.f, s2 = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float g = static_cast<float>(dy[base + c]), xh = xhat(c), gw = __fmul_rn(g, w[c]);
      s1 += gw;
      s2 = fmaf(gw, xh, s2);
      pw[c] = fmaf(g, xh, pw[c]);
      pb[c] += g;
    }
    const float c1 = __fdiv_rn(block_sum(s1, smem), cols), c2 = block_sum(s2, smem) / cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float gw = __fmul_rn(static_cast<float>(dy[base + c]), w[c]);
      float dh = rs * (gw - c1 - xhat(c) * c2);
      dres[base + c] = static_cast<T>(dh);
      if (dx != nullptr) {
        dh *= d.factor(key, base + c);
        dx[base + c] = static_cast<T>(dh);
      }
      px[c] += dh;
    }
  }
}

// Calls f(VEC, NVEC) for a warp-per-row layout of `cols`, or returns false (the block-per-row kernels).
template <int V, typename F>
bool with_row_layout(int cols, bool wide, F&& f) {
  using std::integral_constant;
  if (wide && cols % V == 0) {
    const int nvec = (cols / V + kWarp - 1) / kWarp;  // vectors per lane: 768 is 3 bf16 vectors, 1024 4
    if (nvec <= 1) { f(integral_constant<int, V>{}, integral_constant<int, 1>{}); return true; }
    if (nvec <= 2) { f(integral_constant<int, V>{}, integral_constant<int, 2>{}); return true; }
    if (nvec <= 3) { f(integral_constant<int, V>{}, integral_constant<int, 3>{}); return true; }
    if (nvec <= 4) { f(integral_constant<int, V>{}, integral_constant<int, 4>{}); return true; }
    if (nvec <= 6) { f(integral_constant<int, V>{}, integral_constant<int, 6>{}); return true; }
    if (nvec <= 8) { f(integral_constant<int, V>{}, integral_constant<int, 8>{}); return true; }
  }
  const int n = (cols + kWarp - 1) / kWarp;  // single elements per lane
  if (n <= 1) { f(integral_constant<int, 1>{}, integral_constant<int, 1>{}); return true; }
  if (n <= 2) { f(integral_constant<int, 1>{}, integral_constant<int, 2>{}); return true; }
  if (n <= 4) { f(integral_constant<int, 1>{}, integral_constant<int, 4>{}); return true; }
  if (n <= 8) { f(integral_constant<int, 1>{}, integral_constant<int, 8>{}); return true; }
  if (n <= 16) { f(integral_constant<int, 1>{}, integral_constant<int, 16>{}); return true; }
  if (n <= 32) { f(integral_constant<int, 1>{}, integral_constant<int, 32>{}); return true; }
  return false;
}

at::Tensor as_float(const at::Tensor& p) {
  return p.scalar_type() == at::kFloat ? p.contiguous() : p.to(at::kFloat).contiguous();
}

// Checks shared by both directions; the dropout parameters for the kernels.
Drop check_and_drop(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual, const at::Tensor& weight,
                    double p, const c10::optional<at::Tensor>& seed, const char* op) {
  check_bias_dropout_add_layer_norm(x, bias, residual, weight, p, seed, op);
  TORCH_CHECK(last_dim(x) <= INT32_MAX, op, ": rows longer than 2^31 are not supported");
  Drop d{nullptr, 0u, 1.f};
  if (p > 0) {
    TORCH_CHECK(seed->numel() == 1 && seed->scalar_type() == at::kLong && seed->device() == x.device(), op,
                ": seed must be one int64 on ", x.device(), " (bertctl.ops draws it from the CUDA generator)");
    d.seed = seed->data_ptr<int64_t>();
    d.threshold = dropout_threshold(p);
    d.scale = static_cast<float>(1.0 / (1.0 - p));
  }
  return d;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_cuda(
    const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual, const at::Tensor& weight,
    const at::Tensor& ln_bias, double eps, double p, const c10::optional<at::Tensor>& seed) {
  const char* op = "bertctl::bias_dropout_add_layer_norm";
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const Drop d = check_and_drop(x, bias, residual, weight, p, seed, op);
  check_param(x, ln_bias, op, "ln_bias");
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto bf = as_float(bias), wf = as_float(weight), lbf = as_float(ln_bias);
  auto y = at::empty_like(xc);
  auto mean = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  auto rstd = at::empty_like(mean);
  const int64_t rows = rows_of(x);
  const int cols = static_cast<int>(last_dim(x));
  if (rows == 0 || cols == 0) return {y, mean, rstd};
  TORCH_CHECK(rows <= INT32_MAX, op, ": more than 2^31 rows are not supported (a block per row)");
  const auto stream = at::cuda::getCurrentCUDAStream();
  BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_bdaln_cuda", [&] {
    using T = scalar_t;
    const T* xp = xc.data_ptr<T>();
    const T* rp = rc.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const float *bp = bf.data_ptr<float>(), *wp = wf.data_ptr<float>(), *lp = lbf.data_ptr<float>();
    const bool wide = aligned16(xp) && aligned16(rp) && aligned16(yp) && aligned16(bp) && aligned16(wp) &&
                      aligned16(lp);
    const float inv = 1.f / cols, epsf = static_cast<float>(eps);
    constexpr int V = 16 / sizeof(T);
    const bool fits = with_row_layout<V>(cols, wide, [&](auto vec, auto nvec) {
      constexpr int VV = decltype(vec)::value, NV = decltype(nvec)::value;
      launch(bdaln_fwd_rows<T, VV, NV>, rows, kWarp, 0, stream, xp, rp, bp, wp, lp, d, yp,
             mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, cols, inv, epsf);
    });
    if (!fits)
      launch(bdaln_fwd_long<T>, rows, kLongThreads, 0, stream, xp, rp, bp, wp, lp, d, yp, mean.data_ptr<float>(),
             rstd.data_ptr<float>(), cols, epsf);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, mean, rstd};
}

// (dx, dbias, dresidual, dweight, dln_bias); dx has 0 elements when p = 0 (it is dresidual), dbias
// has the bias's dtype, dweight and dln_bias the weight's.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_backward_cuda(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double p,
    const c10::optional<at::Tensor>& seed) {
  const char* op = "bertctl::bias_dropout_add_layer_norm_backward";
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const Drop d = check_and_drop(x, bias, residual, weight, p, seed, op);
  check_same(x, grad_y, op, "grad_y");
  TORCH_CHECK(mean.numel() == rows_of(x) && rstd.numel() == rows_of(x), op, ": mean/rstd must have ", rows_of(x),
              " elements");
  auto xc = x.contiguous(), rc = residual.contiguous(), dyc = grad_y.contiguous();
  auto mc = mean.to(at::kFloat).contiguous(), sc = rstd.to(at::kFloat).contiguous();
  auto bf = as_float(bias), wf = as_float(weight);
  auto dres = at::empty_like(xc);
  auto dx = p > 0 ? at::empty_like(xc) : at::empty({0}, x.options());
  const int64_t rows = rows_of(x);
  const int cols = static_cast<int>(last_dim(x));
  if (rows == 0 || cols == 0) {
    return {dx, at::zeros_like(bias), dres, at::zeros_like(weight), at::zeros_like(weight)};
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor part_ln, part_b;
  int64_t nb = 0;
  const auto parts = [&] {
    part_ln = at::empty({nb, 2 * cols}, x.options().dtype(at::kFloat));
    part_b = at::empty({nb, cols}, x.options().dtype(at::kFloat));
  };
  BERTCTL_DISPATCH_CUDA(x.scalar_type(), "bertctl_bdaln_backward_cuda", [&] {
    using T = scalar_t;
    const T* gp = dyc.data_ptr<T>();
    const T* xp = xc.data_ptr<T>();
    const T* rp = rc.data_ptr<T>();
    T* dresp = dres.data_ptr<T>();
    T* dxp = p > 0 ? dx.data_ptr<T>() : nullptr;
    const float *bp = bf.data_ptr<float>(), *wp = wf.data_ptr<float>();
    const float *mp = mc.data_ptr<float>(), *sp = sc.data_ptr<float>();
    const bool wide = aligned16(gp) && aligned16(xp) && aligned16(rp) && aligned16(dresp) &&
                      (dxp == nullptr || aligned16(dxp)) && aligned16(bp) && aligned16(wp);
    const size_t smem = 3 * static_cast<size_t>(cols) * sizeof(float);
    constexpr int V = 16 / sizeof(T);
    if (const int gt = block_group_threads<V>(cols, wide); gt > 0 && gt <= kGroupThreads) {
      // One group a block: a group waits at its row's barrier for itself alone.  Four groups a block
      // (BERT-Base's 96-thread rows in blocks of 384) waited for the slowest of the four at every row
      // (side E-ln of benchmarks/results/model-step-changes-ab-h200-b401318.json).
      const int groups = 1;
      const size_t gsmem = ln_bwd_groups_smem(cols, groups, true);
      if (gsmem <= 48 * 1024) {
        auto kernel = ln_bwd_groups<T, float, V, true>;
        nb = resident_blocks(kernel, groups * gt, gsmem, ceil_div(rows, groups));
        parts();
        launch(kernel, nb, groups * gt, gsmem, stream, gp, xp, rp, bp, wp, d, mp, sp, dresp, dxp,
               part_ln.data_ptr<float>(), part_b.data_ptr<float>(), rows, cols, 1.f / cols, gt);
        return;
      }
    }
    const bool fits = smem <= 48 * 1024 && with_row_layout<V>(cols, wide, [&](auto vec, auto nvec) {
      constexpr int VV = decltype(vec)::value, NV = decltype(nvec)::value;
      auto kernel = bdaln_bwd_rows<T, VV, NV>;
      nb = resident_blocks(kernel, kBwdThreads, smem, ceil_div(rows, kBwdThreads / kWarp));
      parts();
      launch(kernel, nb, kBwdThreads, smem, stream, gp, xp, rp, bp, wp, d, mp, sp, dresp, dxp,
             part_ln.data_ptr<float>(), part_b.data_ptr<float>(), rows, cols);
    });
    if (!fits) {
      nb = std::min<int64_t>(rows, 4 * sm_count());
      parts();
      launch(bdaln_bwd_long<T>, nb, kLongThreads, 0, stream, gp, xp, rp, bp, wp, d, mp, sp, dresp, dxp,
             part_ln.data_ptr<float>(), part_b.data_ptr<float>(), rows, cols);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // dweight and dln_bias in the weight's dtype (one launch), dbias in the bias's.
  auto ln = column_sums(part_ln, nb, cols, 2, weight.scalar_type(), stream);
  auto db = column_sums(part_b, nb, cols, 1, bias.scalar_type(), stream);
  return {dx, db[0], dres, ln[0], ln[1]};
}

}  // namespace
}  // namespace bertctl::cuda

TORCH_LIBRARY_IMPL(bertctl, CUDA, m) {
  m.impl("bias_dropout_add_layer_norm", &bertctl::cuda::bias_dropout_add_layer_norm_cuda);
  m.impl("bias_dropout_add_layer_norm_backward", &bertctl::cuda::bias_dropout_add_layer_norm_backward_cuda);
}
