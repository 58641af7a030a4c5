// The LayerNorm backward that both LayerNorm ops share, for rows of 33..384 aligned 16-byte vectors
// (16-bit H 264..3072, fp32 H 132..1536; BERT's 768 and 1024): ln_bwd_groups, a persistent grid of
// blocks of G groups of GT = cols / VEC threads (whole warps).  A group works on one row at a time,
// one vector per thread, so each thread owns fixed columns: its fp32 partial sums of dy * xhat and dy
// (dweight, dbias) stay in registers across rows (about 60 registers, against 128 for a warp per row,
// so about twice the resident warps).  The next row's x, residual, dy, mean and rstd are loaded
// before the current row's reductions, so their latency overlaps.  At the end the groups' partials
// are added in shared memory in group order and the block writes one partial row for column_sums:
// deterministic.
//
// kBiasDrop = false: LayerNorm(x + residual)'s backward (layer_norm.cu), h = x (+ residual), its dx
// written to dres.  kBiasDrop = true: LayerNorm(dropout(x + bias) + residual)'s
// (bias_dropout_add_layer_norm.cu), h re-derived with the mask of the seed (dropout_hash.h), dres = dh
// and dx = dh * mask / (1 - p) (when dx is not null), and a third partial, the column sums of dx
// (the sub-layer's dbias), in part_b.
#pragma once
#include "../dropout_hash.h"
#include "cuda_util.cuh"

namespace bertctl::cuda {

// ln_bwd_groups: threads per block (groups of one row's width), two blocks per SM (at most 85
// registers per thread).
constexpr int kGroupThreads = 384;

// The dropout of bias_dropout_add_layer_norm as its kernels apply it.
struct Drop {
  const int64_t* seed;  // one int64 on the device; null: no dropout
  uint32_t threshold;
  float scale;  // 1 / (1 - p)

  __device__ __forceinline__ DropoutKey key() const {
    return seed == nullptr ? DropoutKey{} : dropout_key(static_cast<uint64_t>(*seed));
  }
  // Whether element i is kept (always, without dropout).
  __device__ __forceinline__ bool keep(DropoutKey key, int64_t i) const {
    return seed == nullptr || dropout_keep(key, threshold, i);
  }
  // The factor element i is multiplied by: scale where kept, else 0 (1 without dropout).
  __device__ __forceinline__ float factor(DropoutKey key, int64_t i) const {
    if (seed == nullptr) return 1.f;
    return dropout_keep(key, threshold, i) ? scale : 0.f;
  }
  // The factor of a kept element: scale (1 without dropout).
  __device__ __forceinline__ float kept() const { return seed == nullptr ? 1.f : scale; }
};

template <typename T, typename W, int VEC, bool kBiasDrop>
__global__ void __launch_bounds__(kGroupThreads, 2) ln_bwd_groups(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ res, const float* __restrict__ bias,
    const W* __restrict__ w, Drop d, const float* __restrict__ mean, const float* __restrict__ rstd,
    T* __restrict__ dres, T* __restrict__ dx, float* __restrict__ part_ln, float* __restrict__ part_b, int64_t rows,
    int cols, float inv_cols, int group_threads) {
  constexpr int kParts = kBiasDrop ? 3 : 2;  // dweight, dbias (the LayerNorm's) [, the sub-layer's dbias]
  pdl_wait();
  pdl_trigger();
  // red: 2 x 32 warps x 2 sums; the weight and (kBiasDrop) the bias, cols each; acc: (G, kParts, cols)
  extern __shared__ float smem[];
  const int groups = blockDim.x / group_threads;
  const int grp = threadIdx.x / group_threads, t = threadIdx.x % group_threads;
  const int gwarps = group_threads / kWarp;
  const int col = t * VEC;
  const bool in = col < cols;
  float* wsm = smem + 128;  // the weight in fp32, read per row (registers are the limit here)
  float* bsm = wsm + cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    wsm[c] = static_cast<float>(w[c]);
    if constexpr (kBiasDrop) bsm[c] = bias[c];
  }
  __syncthreads();
  DropoutKey key{};
  if constexpr (kBiasDrop) key = d.key();
  float dw[VEC], db[VEC], dxb[kBiasDrop ? VEC : 1];
#pragma unroll
  for (int k = 0; k < VEC; ++k) dw[k] = db[k] = 0.f;
#pragma unroll
  for (int k = 0; k < (kBiasDrop ? VEC : 1); ++k) dxb[k] = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * groups;
  Pack<T, VEC> px{}, pr{}, pg{};
  float mu = 0.f, rs = 0.f;
  auto fetch = [&](int64_t row) {
    if (in && row < rows) {
      px = load_pack<VEC>(x + row * cols + col);
      if (res != nullptr) pr = load_pack<VEC>(res + row * cols + col);
      pg = load_pack<VEC>(dy + row * cols + col);
      mu = mean[row];
      rs = rstd[row];
    }
  };
  int64_t row = static_cast<int64_t>(blockIdx.x) * groups + grp;
  fetch(row);
  // The loop bound depends on the block only: every thread reaches every barrier.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups, it = 0; base < rows; base += stride, ++it, row += stride) {
    const bool live = in && row < rows;
    const int64_t i0 = row * cols + col;
    float h[VEC], g[VEC], sums[2] = {0.f, 0.f};
    const float mu_r = mu, rs_r = rs;
    uint32_t kept = 0;  // (kBiasDrop) bit k: element i0 + k kept; the mask is hashed once a row, used twice
    if (live) {
      unpack_float<VEC, true>(px, h);
      unpack_float<VEC, true>(pg, g);
      if constexpr (kBiasDrop) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const bool keep = d.keep(key, i0 + k);
          kept |= static_cast<uint32_t>(keep) << k;
          h[k] = (h[k] + bsm[col + k]) * (keep ? d.kept() : 0.f);
        }
      }
      if (res != nullptr) {
        float r[VEC];
        unpack_float<VEC, true>(pr, r);
#pragma unroll
        for (int k = 0; k < VEC; ++k) h[k] += r[k];
      }
    }
    fetch(row + stride);
    if (live) {
      float wv[VEC];
      *reinterpret_cast<Pack<float, VEC>*>(wv) = *reinterpret_cast<const Pack<float, VEC>*>(wsm + col);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float xh = (h[k] - mu_r) * rs_r, gw = __fmul_rn(g[k], wv[k]);  // never fused into an FMA
        dw[k] = fmaf(g[k], xh, dw[k]);
        db[k] += g[k];
        h[k] = xh;
        g[k] = gw;  // dx reuses the rounded g * w that entered the sums
        sums[0] += gw;
        sums[1] = fmaf(gw, xh, sums[1]);
      }
    }
    group_sums<2>(sums, smem + (it & 1) * 64, grp * gwarps, gwarps);  // buffers alternate: one barrier per row
    if (live) {
      // c1 correctly rounded (not fast-math's approximate division): a constant g * w cancels exactly.
      const float c1 = __fdiv_rn(sums[0], cols), c2 = sums[1] * inv_cols;
      float o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = rs_r * (g[k] - c1 - h[k] * c2);
      store_float<VEC>(dres + i0, o);
      if constexpr (kBiasDrop) {
        if (dx != nullptr) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) o[k] *= (kept >> k) & 1u ? d.kept() : 0.f;
          store_float<VEC>(dx + i0, o);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) dxb[k] += o[k];
      }
    }
  }
  float* acc = smem + 128 + (kBiasDrop ? 2 : 1) * cols;
  if (in)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc[(grp * kParts) * cols + col + k] = dw[k];
      acc[(grp * kParts + 1) * cols + col + k] = db[k];
      if constexpr (kBiasDrop) acc[(grp * kParts + 2) * cols + col + k] = dxb[k];
    }
  __syncthreads();
  for (int c = threadIdx.x; c < kParts * cols; c += blockDim.x) {
    float total = 0.f;
    for (int i = 0; i < groups; ++i) total += acc[i * kParts * cols + c];
    if (c < 2 * cols) part_ln[static_cast<int64_t>(blockIdx.x) * 2 * cols + c] = total;
    else part_b[static_cast<int64_t>(blockIdx.x) * cols + c - 2 * cols] = total;
  }
}

// Shared memory of ln_bwd_groups for `groups` groups of rows of `cols`.
inline size_t ln_bwd_groups_smem(int cols, int groups, bool bias_drop) {
  const size_t parts = bias_drop ? 3 : 2;
  return (128 + (bias_drop ? 2 : 1) * static_cast<size_t>(cols) + groups * parts * cols) * sizeof(float);
}

}  // namespace bertctl::cuda
