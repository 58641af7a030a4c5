// Device helpers shared by the bertctl CUDA kernels: 16-byte vector packs,
// float conversion, warp/sub-warp reductions, the launch context (device guard,
// current stream) and the second stage of the column reductions (dweight, dbias).
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

namespace bertctl::cuda {

constexpr int kWarp = 32;

// Programmatic dependent launch (sm_90): every bertctl kernel is launched with programmatic
// stream serialisation, so the GPU may set up and schedule it while the kernel before it in
// the stream drains, instead of after a launch gap between back-to-back kernels.
// The first statement of every kernel is pdl_wait(): it waits for the previous grid to
// complete and its memory to be visible (griddepcontrol.wait) before any global access.
// Kernels of one wave of resident blocks (the backward passes and the column sums) then call
// pdl_trigger(), which lets the next programmatically launched grid be scheduled once all of
// their blocks have started; kernels of many short blocks leave the trigger to their exit
// (a trigger in each of thousands of one-warp blocks costs more than the overlap gains).
// Kernels not launched that way (ATen's, cuBLAS's) are unaffected: a grid that follows them
// waits for their completion as usual.  Off before sm_90 and with BERTCTL_PDL=0 (the A/B:
// benchmarks/results/ops-h200-bf16-fused-pdl-off.json against ops-h200-bf16-fused-pdl-on.json).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

inline bool pdl_enabled() {
  static const bool allowed = [] {
    const char* v = std::getenv("BERTCTL_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return allowed && at::cuda::getCurrentDeviceProperties()->major >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent launch where enabled.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl_enabled()) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// N elements of T loaded or stored as one (or, past 16 bytes, several) 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Pack {
  T v[N];
};

// 16-bit types convert in pairs: one instruction per two values (cvt.rn.bf16x2.f32 /
// cvt.rn.f16x2.f32 on the way out) instead of a conversion plus a byte permute per value.
// Same rounding (to nearest even) as the scalar casts.
template <typename T> struct Pair { static constexpr bool kPaired = false; };
template <> struct Pair<at::BFloat16> {
  static constexpr bool kPaired = true;
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <> struct Pair<at::Half> {
  static constexpr bool kPaired = true;
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};

// The N values of a pack (as loaded) in fp32.  Bits = true: bf16 by a shift and a mask of each
// 32-bit word (exact, the same values); ptxas allocates the two forms differently: with the
// intrinsic the LayerNorm backward spilled at its 80-register cap, while the LayerNorm forward
// that re-converts its packed row three times is faster with it (NOTES-kernels.md, run 18).
template <int N, bool Bits = false, typename T>
__device__ __forceinline__ void unpack_float(const Pack<T, N>& pk, float (&out)[N]) {
  if constexpr (Bits && std::is_same_v<T, at::BFloat16> && N % 2 == 0) {
    const auto& words = reinterpret_cast<const Pack<uint32_t, N / 2>&>(pk);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(words.v[i] << 16);
      out[2 * i + 1] = __uint_as_float(words.v[i] & 0xffff0000u);
    }
  } else if constexpr (Pair<T>::kPaired && N % 2 == 0) {
    using P = Pair<T>;
    const auto& pairs = reinterpret_cast<const Pack<typename P::type, N / 2>&>(pk);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = P::to_float2(pairs.v[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = static_cast<float>(pk.v[i]);
  }
}

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void load_float(const T* p, float (&out)[N]) {
  unpack_float<N>(load_pack<N>(p), out);
}

// Streaming = true: a 16-byte pack is stored with the evict-first hint (st.global.cs), for an
// output that this kernel will not read again: the LayerNorm forward gets faster and a GEMM reading
// its output next no slower (NOTES-kernels.md, runs 23 and 24).  Smaller packs store plainly.
template <int N, bool Streaming = false, typename T>
__device__ __forceinline__ void store_float(T* p, const float (&in)[N]) {
  auto put = [p](const auto& pk) {
    if constexpr (Streaming && sizeof(pk) == 16)
      __stcs(reinterpret_cast<uint4*>(p), reinterpret_cast<const uint4&>(pk));
    else
      *reinterpret_cast<std::remove_cv_t<std::remove_reference_t<decltype(pk)>>*>(p) = pk;
  };
  if constexpr (Pair<T>::kPaired && N % 2 == 0) {
    // Words, not __nv_bfloat162 / __half2 (whose user-defined assignment splits the store
    // into 4-byte pieces): one 16-byte store.
    using P = Pair<T>;
    Pack<uint32_t, N / 2> pk;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const typename P::type two = P::from_floats(in[2 * i], in[2 * i + 1]);
      pk.v[i] = *reinterpret_cast<const uint32_t*>(&two);
    }
    put(pk);
  } else {
    Pack<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = static_cast<T>(in[i]);
    put(pk);
  }
}

// Butterfly reductions within groups of WIDTH consecutive lanes (WIDTH a power of two <= 32).
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o, WIDTH);
  return v;
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, WIDTH));
  return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result.  smem: 32 floats.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = (blockDim.x + kWarp - 1) / kWarp;
  v = group_sum<kWarp>(v);
  __syncthreads();  // smem may still be read from a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : 0.f;
  return group_sum<kWarp>(v);
}

__device__ __forceinline__ float block_max(float v, float* smem) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = (blockDim.x + kWarp - 1) / kWarp;
  v = group_max<kWarp>(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : -INFINITY;
  return group_max<kWarp>(v);
}

// Dispatch over the dtypes the CUDA kernels take (fp32, fp16, bf16); fp64 stays on
// the plain-PyTorch path (see bertctl/ops gates).
#define BERTCTL_DISPATCH_CUDA(TYPE, NAME, ...)                                          \
  [&] {                                                                                 \
    switch (TYPE) {                                                                     \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }                 \
      case at::kHalf: { using scalar_t = at::Half; return __VA_ARGS__(); }               \
      case at::kBFloat16: { using scalar_t = at::BFloat16; return __VA_ARGS__(); }       \
      default: TORCH_CHECK(false, NAME, ": unsupported dtype ", TYPE);                   \
    }                                                                                   \
  }()

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// LayerNorm of one row that a warp holds in registers, h[i][k] being column (i * 32 + lane) * VEC + k:
// the mean of the row shifted by its first element (so a constant row has exactly its value as mean
// and gives y = b even with eps = 1e-12), the variance from a second pass, fp32 throughout;
// y = (h - mean) * rstd * w + b written once (Streaming: with the evict-first hint), the statistics
// by lane 0 where mean_out is not null.  Every lane of the warp must call it.
template <int VEC, int NVEC, bool Streaming = false, typename T, typename W>
__device__ __forceinline__ void warp_row_layer_norm(const float (&h)[NVEC][VEC], int lane, int cols, float inv_cols,
                                                    float eps, const W* __restrict__ w, const W* __restrict__ b,
                                                    T* __restrict__ y_row, float* mean_out, float* rstd_out) {
  const float h0 = __shfl_sync(0xffffffffu, h[0][0], 0);  // the row's first element (lane 0 holds it)
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NVEC; ++i)
    if ((i * kWarp + lane) * VEC < cols)
#pragma unroll
      for (int k = 0; k < VEC; ++k) sum += h[i][k] - h0;
  const float mean = h0 + group_sum<kWarp>(sum) * inv_cols;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < NVEC; ++i)
    if ((i * kWarp + lane) * VEC < cols)
#pragma unroll
      for (int k = 0; k < VEC; ++k) sq += (h[i][k] - mean) * (h[i][k] - mean);
  const float rstd = rsqrtf(group_sum<kWarp>(sq) * inv_cols + eps);
  if (lane == 0 && mean_out != nullptr) {
    *mean_out = mean;
    *rstd_out = rstd;
  }
#pragma unroll
  for (int i = 0; i < NVEC; ++i) {
    const int col = (i * kWarp + lane) * VEC;
    if (col < cols) {
      float wv[VEC], bv[VEC], o[VEC];
      load_float<VEC>(w + col, wv);
      load_float<VEC>(b + col, bv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = fmaf((h[i][k] - mean) * rstd, wv[k], bv[k]);
      store_float<VEC, Streaming>(y_row + col, o);
    }
  }
}

// Sum over the warps of a thread group (group_warps whole warps, the first being warp
// group_warp0 of the block): each warp reduces with shuffles, lane 0 stores to red[warp], and after a block
// barrier every thread adds its group's warp sums in a fixed order (deterministic, equal in
// all threads).  Every thread of the block must call it (it holds a __syncthreads).
template <int N>
__device__ __forceinline__ void group_sums(float (&v)[N], float* red, int group_warp0, int group_warps) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = group_sum<kWarp>(v[k]);
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < N; ++k) red[warp * N + k] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float t = 0.f;
    for (int i = 0; i < group_warps; ++i) t += red[(group_warp0 + i) * N + k];
    v[k] = t;
  }
}

// Blocks for a grid-stride kernel: as many as fit on the GPU at once, at most `needed`.
template <typename K>
int64_t resident_blocks(K kernel, int threads, size_t smem, int64_t needed) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return std::max<int64_t>(1, std::min<int64_t>(needed, static_cast<int64_t>(std::max(per_sm, 1)) * sm_count()));
}

// Threads per row for the group-per-row backward kernels (cols / V rounded up to whole warps), or 0 where the
// warp-per-row kernel serves (rows of a single warp's width or less) or the row is not made
// of aligned 16-byte vectors.
template <int V>
int block_group_threads(int cols, bool wide) {
  if (!wide || cols % V != 0) return 0;
  const int vecs = cols / V;
  if (vecs <= kWarp || vecs > 1024) return 0;
  return static_cast<int>(ceil_div(vecs, kWarp) * kWarp);
}

// Second stage of a column reduction: the column sums of part (nb, cols) fp32,
// written in OutT; columns c < split go to out0[c], the rest to out1[c - split]
// (so one launch finishes dweight and dbias stored side by side).  Block = 32
// columns x 32 row groups; each thread's loads are unrolled by 8 so that they are in
// flight together (a rolled loop waits one memory latency per partial row), and the 32 partial sums of a column
// are added in a fixed order, so the result is deterministic.
template <typename OutT>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* __restrict__ part, int64_t nb, int64_t cols,
                                                          int64_t split, OutT* __restrict__ out0,
                                                          OutT* __restrict__ out1) {
  pdl_wait();
  pdl_trigger();
  __shared__ float tile[32][33];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (c < cols) {
#pragma unroll 8
    for (int64_t b = threadIdx.y; b < nb; b += 32) s += part[b * cols + c];
  }
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) t += tile[i][threadIdx.x];
    if (c < split) out0[c] = static_cast<OutT>(t);
    else out1[c - split] = static_cast<OutT>(t);
  }
}

// Column sums of part (nb, n * width) fp32 as n tensors of `width` elements in `dtype`.
inline std::vector<at::Tensor> column_sums(const at::Tensor& part, int64_t nb, int64_t width, int n,
                                           at::ScalarType dtype, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(n == 1 || n == 2);
  std::vector<at::Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(at::empty({width}, part.options().dtype(dtype)));
  if (width == 0) return out;
  const int64_t cols = n * width;
  const dim3 block(32, 32), grid(static_cast<unsigned>(ceil_div(cols, 32)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "bertctl_column_sum", [&] {
    launch(column_sum_kernel<scalar_t>, grid, block, 0, stream, part.data_ptr<float>(), nb, cols, width,
           out[0].data_ptr<scalar_t>(), out[n - 1].data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace bertctl::cuda
