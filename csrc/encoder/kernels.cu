// Kernels of bertctl._encoder (kernels.h), for inference on packed tokens (no padding):
// - LayerNorm (after the embeddings' sum, or a residual add): a warp a row, the row in registers (32
//   values a lane: hidden sizes up to 1024), mean and variance in fp32 over two passes, BERT's eps 1e-12.
// - attention, head sizes 32, 64 and 128, online softmax in fp32: in fp16 and bf16 past 32 tokens, on the
//   tensor cores (mma.sync, a warp 16 queries, key tiles of 64 in shared memory), since its work grows
//   with the square of the length; otherwise a thread a query on CUDA cores over key tiles staged as
//   fp32, short texts (<= 32 tokens) a warp a head, four heads a block.
// - GELU (erf, or tanh for the gelu_new family) and ReLU in place, 16 bytes a thread.
// - pooling: a thread a feature of a text, fp32 sums; every mode writes its own column block of a row.
// - normalisation: a warp a row; conversion between fp32, fp16 and bf16 (round to nearest even).
// Activations are T (float, __half or __nv_bfloat16); all arithmetic is fp32.
#include "kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <stdexcept>
#include <type_traits>

namespace encoder {
namespace {

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float(float x) { return x; }
template <> __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float(float x) { return x; }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

constexpr int kWarpsPerBlock = 8;
constexpr int kPerLane = kMaxHidden / 32;

// LayerNorm of the row held in v (lane's elements lane, lane + 32, ...), two passes over registers.
template <typename T>
__device__ __forceinline__ void write_normalized(float (&v)[kPerLane], T* out, const float* gamma, const float* beta,
                                                 int hidden, float eps, int lane) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < hidden) sum += v[i];
    const float mean = warp_sum(sum) / hidden;
    float square = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < hidden) square += (v[i] - mean) * (v[i] - mean);
    const float rstd = rsqrtf(warp_sum(square) / hidden + eps);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < hidden) out[c] = from_float<T>((v[i] - mean) * rstd * gamma[c] + beta[c]);
    }
}

template <typename T>
__global__ void embed_layer_norm_kernel(const int32_t* ids, const int32_t* positions, const T* word,
                                        const T* position, const T* type, const float* gamma, const float* beta,
                                        T* out, int tokens, int hidden, float eps) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (row >= tokens) return;
    const T* w = word + static_cast<int64_t>(ids[row]) * hidden;
    const T* p = position + static_cast<int64_t>(positions[row]) * hidden;
    float v[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        v[i] = c < hidden ? to_float(w[c]) + to_float(p[c]) + to_float(type[c]) : 0.f;
    }
    write_normalized(v, out + static_cast<int64_t>(row) * hidden, gamma, beta, hidden, eps, lane);
}

template <typename T>
__global__ void add_layer_norm_kernel(const T* x, T* residual, const float* gamma, const float* beta, int tokens,
                                      int hidden, float eps) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (row >= tokens) return;
    const T* a = x + static_cast<int64_t>(row) * hidden;
    T* r = residual + static_cast<int64_t>(row) * hidden;
    float v[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        v[i] = c < hidden ? to_float(a[c]) + to_float(r[c]) : 0.f;
    }
    write_normalized(v, r, gamma, beta, hidden, eps, lane);
}

template <Act A>
__device__ __forceinline__ float activate(float v) {
    if constexpr (A == Act::gelu) {
        return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    } else if constexpr (A == Act::gelu_tanh) {
        return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    } else {
        return fmaxf(v, 0.f);
    }
}

// 16 bytes a thread at a time (8 half-precision values, 4 floats); the tail one at a time.
template <typename T, Act A>
__global__ void activation_kernel(T* x, int64_t n) {
    constexpr int V = 16 / sizeof(T);
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t vectors = n / V;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors; i += stride) {
        uint4 raw = reinterpret_cast<uint4*>(x)[i];
        T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = from_float<T>(activate<A>(to_float(v[k])));
        reinterpret_cast<uint4*>(x)[i] = raw;
    }
    for (int64_t i = vectors * V + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
        x[i] = from_float<T>(activate<A>(to_float(x[i])));
}

// One block per (sequence, HPB heads, chunk of QT queries); thread (query, head) holds its query and its
// output row in registers and runs the online softmax over key tiles of KT staged in shared memory as
// float, where the threads of a head read the same key at once (a broadcast, four values a read).
// Short sequences (the common case of sentence embedding) take one warp a head, four heads a block.
template <typename T, int D, int KT, int QT, int HPB>
__global__ void __launch_bounds__(QT * HPB, D <= 32 ? 512 / (QT * HPB) : 1) attention_kernel(const T* qkv, const int32_t* cu_seqlens, T* out,
                                                             int heads, float scale) {
    const int start = cu_seqlens[blockIdx.x];
    const int len = cu_seqlens[blockIdx.x + 1] - start;
    const int q0 = blockIdx.z * QT;
    if (q0 >= len) return;
    const int local_head = threadIdx.x / QT;
    const int head = blockIdx.y * HPB + local_head;
    const int hidden = heads * D;
    const int64_t row = 3 * static_cast<int64_t>(hidden);
    __shared__ __align__(16) float keys[HPB][KT][D];
    __shared__ __align__(16) float values[HPB][KT][D];

    const int query = q0 + threadIdx.x % QT;
    const bool active = query < len && head < heads;
    float q[D], acc[D];
    float running_max = -FLT_MAX, denominator = 0.f;
    if (active) {
        const T* src = qkv + (start + query) * row + head * D;
#pragma unroll
        for (int c = 0; c < D; ++c) {
            q[c] = to_float(src[c]) * scale;
            acc[c] = 0.f;
        }
    }
    for (int k0 = 0; k0 < len; k0 += KT) {
        const int n = min(KT, len - k0);
        __syncthreads();
        for (int e = threadIdx.x; e < HPB * n * D; e += QT * HPB) {
            const int h = e / (n * D), j = (e / D) % n, c = e % D;
            if (blockIdx.y * HPB + h >= heads) continue;
            const T* src = qkv + (start + k0 + j) * row + (blockIdx.y * HPB + h) * D + c;
            keys[h][j][c] = to_float(src[hidden]);
            values[h][j][c] = to_float(src[2 * hidden]);
        }
        __syncthreads();
        if (!active) continue;
        float s[KT];
        float tile_max = running_max;
#pragma unroll
        for (int j = 0; j < KT; ++j) {
            if (j < n) {
                const float4* k4 = reinterpret_cast<const float4*>(keys[local_head][j]);
                float part[4] = {0.f, 0.f, 0.f, 0.f};  // four chains, not one of D dependent adds
#pragma unroll
                for (int c = 0; c < D / 4; ++c) {
                    const float4 k = k4[c];
                    part[0] += q[4 * c] * k.x;
                    part[1] += q[4 * c + 1] * k.y;
                    part[2] += q[4 * c + 2] * k.z;
                    part[3] += q[4 * c + 3] * k.w;
                }
                const float dot = (part[0] + part[1]) + (part[2] + part[3]);
                s[j] = dot;
                tile_max = fmaxf(tile_max, dot);
            }
        }
        const float correction = __expf(running_max - tile_max);
        denominator *= correction;
#pragma unroll
        for (int c = 0; c < D; ++c) acc[c] *= correction;
#pragma unroll
        for (int j = 0; j < KT; ++j) {
            if (j < n) {
                const float p = __expf(s[j] - tile_max);
                denominator += p;
                const float4* v4 = reinterpret_cast<const float4*>(values[local_head][j]);
#pragma unroll
                for (int c = 0; c < D / 4; ++c) {
                    const float4 v = v4[c];
                    acc[4 * c] += p * v.x;
                    acc[4 * c + 1] += p * v.y;
                    acc[4 * c + 2] += p * v.z;
                    acc[4 * c + 3] += p * v.w;
                }
            }
        }
        running_max = tile_max;
    }
    if (active) {
        T* dst = out + (start + query) * static_cast<int64_t>(hidden) + head * D;
        const float inv = 1.f / denominator;
#pragma unroll
        for (int c = 0; c < D; ++c) dst[c] = from_float<T>(acc[c] * inv);
    }
}

// Tensor-core attention (fp16, bf16), the FlashAttention-2 scheme: one block of four warps per (sequence,
// head, 64 queries), each warp 16 queries whose fragments stay in registers; key and value tiles of 64
// rows are staged in shared memory, rows padded by 16 bytes so that ldmatrix's eight rows fall in distinct
// banks. S = Q K^T and O += P V run mma.sync m16n8k16 with fp32 accumulators; the softmax is online in
// fp32 (base 2), and P goes from S's accumulator layout to the A operand without shared memory.
template <typename T> __device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T> __device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                                uint32_t b1);
template <> __device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                              uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                                     uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <bool Transpose>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* shared) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
    if constexpr (Transpose)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

constexpr int kMmaRows = 64;  // queries a block (16 a warp) and keys a tile
constexpr int kMmaThreads = 128;

// rows (first, first + kMmaRows) of one head's D columns at column offset `column` of qkv into tile,
// zeros past `last` (so that masked keys' values are 0, not stale, and P V stays finite).
template <typename T, int D>
__device__ __forceinline__ void stage_rows(T (*tile)[D + 8], const T* qkv, int64_t row, int column, int first,
                                           int last) {
    constexpr int kVectors = D / 8;  // 16 bytes each
    for (int e = threadIdx.x; e < kMmaRows * kVectors; e += kMmaThreads) {
        const int r = e / kVectors, c = (e % kVectors) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (first + r < last) v = *reinterpret_cast<const uint4*>(qkv + (first + r) * row + column + c);
        *reinterpret_cast<uint4*>(&tile[r][c]) = v;
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(kMmaThreads) attention_mma_kernel(const T* qkv, const int32_t* cu_seqlens, T* out,
                                                                    int heads, float scale_log2) {
    const int start = cu_seqlens[blockIdx.x];
    const int end = cu_seqlens[blockIdx.x + 1];
    const int q0 = start + blockIdx.z * kMmaRows;
    if (q0 >= end) return;
    const int head = blockIdx.y, hidden = heads * D;
    const int64_t row = 3 * static_cast<int64_t>(hidden);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __shared__ __align__(16) T keys[kMmaRows][D + 8];
    __shared__ __align__(16) T values[kMmaRows][D + 8];

    // The queries pass through the key tile into registers: A fragments of 16 x 16, D / 16 of them.
    stage_rows<T, D>(keys, qkv, row, head * D, q0, end);
    __syncthreads();
    uint32_t q[D / 16][4];
#pragma unroll
    for (int k = 0; k < D / 16; ++k)
        ldmatrix_x4<false>(q[k], &keys[warp * 16 + lane % 8 + 8 * (lane / 8 % 2)][16 * k + 8 * (lane / 16)]);

    float o[D / 8][4] = {};
    float running_max[2] = {-INFINITY, -INFINITY}, denominator[2] = {0.f, 0.f};  // rows lane / 4 and + 8
    for (int k0 = start; k0 < end; k0 += kMmaRows) {
        __syncthreads();  // the last tile (or the queries) read
        stage_rows<T, D>(keys, qkv, row, hidden + head * D, k0, end);
        stage_rows<T, D>(values, qkv, row, 2 * hidden + head * D, k0, end);
        __syncthreads();

        float s[kMmaRows / 8][4] = {};  // 8 keys an accumulator tile
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
#pragma unroll
            for (int j = 0; j < kMmaRows / 8; j += 2) {
                uint32_t b[4];
                ldmatrix_x4<false>(b, &keys[8 * j + lane % 8 + 8 * (lane / 16)][16 * k + 8 * (lane / 8 % 2)]);
                mma_16816<T>(s[j], q[k], b[0], b[1]);
                mma_16816<T>(s[j + 1], q[k], b[2], b[3]);
            }
        }
        const int valid = end - k0;
        float tile_max[2] = {running_max[0], running_max[1]};
#pragma unroll
        for (int j = 0; j < kMmaRows / 8; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = 8 * j + 2 * (lane % 4) + i % 2;
                s[j][i] = key < valid ? s[j][i] * scale_log2 : -INFINITY;
                tile_max[i / 2] = fmaxf(tile_max[i / 2], s[j][i]);
            }
        }
        float correction[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // the four lanes of a row hold its 64 keys between them
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
            correction[r] = exp2f(running_max[r] - tile_max[r]);
            running_max[r] = tile_max[r];
            denominator[r] *= correction[r];
        }
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
            o[d][0] *= correction[0];
            o[d][1] *= correction[0];
            o[d][2] *= correction[1];
            o[d][3] *= correction[1];
        }
        // P in the A operand's layout: keys 16k .. 16k + 15 are accumulator tiles 2k and 2k + 1.
        uint32_t p[kMmaRows / 16][4];
#pragma unroll
        for (int j = 0; j < kMmaRows / 8; ++j) {
            const float p0 = exp2f(s[j][0] - running_max[0]), p1 = exp2f(s[j][1] - running_max[0]);
            const float p2 = exp2f(s[j][2] - running_max[1]), p3 = exp2f(s[j][3] - running_max[1]);
            denominator[0] += p0 + p1;
            denominator[1] += p2 + p3;
            p[j / 2][2 * (j % 2)] = pack_pair<T>(p0, p1);
            p[j / 2][2 * (j % 2) + 1] = pack_pair<T>(p2, p3);
        }
#pragma unroll
        for (int k = 0; k < kMmaRows / 16; ++k) {
#pragma unroll
            for (int d = 0; d < D / 8; d += 2) {
                uint32_t b[4];
                ldmatrix_x4<true>(b, &values[16 * k + lane % 8 + 8 * (lane / 8 % 2)][8 * d + 8 * (lane / 16)]);
                mma_16816<T>(o[d], p[k], b[0], b[1]);
                mma_16816<T>(o[d + 1], p[k], b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        denominator[r] += __shfl_xor_sync(0xffffffffu, denominator[r], 1);
        denominator[r] += __shfl_xor_sync(0xffffffffu, denominator[r], 2);
        denominator[r] = 1.f / denominator[r];
    }
    const int query = q0 + warp * 16 + lane / 4;
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
        T* dst = out + static_cast<int64_t>(query) * hidden + head * D + 8 * d + 2 * (lane % 4);
        if (query < end)
            *reinterpret_cast<uint32_t*>(dst) = pack_pair<T>(o[d][0] * denominator[0], o[d][1] * denominator[0]);
        if (query + 8 < end)
            *reinterpret_cast<uint32_t*>(dst + 8 * static_cast<int64_t>(hidden)) =
                pack_pair<T>(o[d][2] * denominator[1], o[d][3] * denominator[1]);
    }
}

template <typename From, typename To>
__global__ void convert_kernel(const From* src, To* dst, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        dst[i] = from_float<To>(to_float(src[i]));
}

template <typename T>
__global__ void accumulate_kernel(const T* x, float* sum, int64_t n, bool first) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        sum[i] = first ? to_float(x[i]) : sum[i] + to_float(x[i]);
}

template <typename T>
__global__ void pool_kernel(const T* x, const int32_t* cu_seqlens, const int32_t* rows, float* out, int hidden,
                            int out_stride, int column, Pool mode) {
    const int b = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= hidden) return;
    const int start = cu_seqlens[b];
    const int len = cu_seqlens[b + 1] - start;
    const T* col = x + static_cast<int64_t>(start) * hidden + j;
    float value;
    if (mode == Pool::cls) {
        value = to_float(col[0]);
    } else if (mode == Pool::last) {
        value = to_float(col[static_cast<int64_t>(len - 1) * hidden]);
    } else if (mode == Pool::max) {
        value = -INFINITY;
        for (int i = 0; i < len; ++i) value = fmaxf(value, to_float(col[static_cast<int64_t>(i) * hidden]));
    } else {
        const bool weighted = mode == Pool::weighted_mean;
        float total = 0.f, count = 0.f;
        for (int i = 0; i < len; ++i) {
            const float w = weighted ? static_cast<float>(i + 1) : 1.f;
            total += w * to_float(col[static_cast<int64_t>(i) * hidden]);
            count += w;
        }
        count = fmaxf(count, 1e-9f);
        value = total / (mode == Pool::mean_sqrt_len ? sqrtf(count) : count);
    }
    out[static_cast<int64_t>(rows ? rows[b] : b) * out_stride + column + j] = value;
}

// Each row divided by its L2 norm (at least 1e-12, as torch.nn.functional.normalize); a warp a row.
__global__ void normalize_kernel(float* x, int64_t rows, int width) {
    const int lane = threadIdx.x % 32;
    const int64_t r = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
    if (r >= rows) return;
    float* row = x + r * width;
    float square = 0.f;
    for (int c = lane; c < width; c += 32) square += row[c] * row[c];
    const float inv = 1.f / fmaxf(sqrtf(warp_sum(square)), 1e-12f);
    for (int c = lane; c < width; c += 32) row[c] *= inv;
}

int grid_for(int64_t n, int threads) {
    const int64_t blocks = (n + threads - 1) / threads;
    return static_cast<int>(blocks < 65536 * 8 ? (blocks > 0 ? blocks : 1) : 65536 * 8);
}

template <typename F>
void with_type(DType dtype, F&& f) {
    switch (dtype) {
        case DType::f32: f(float{}); break;
        case DType::f16: f(__half{}); break;
        case DType::bf16: f(__nv_bfloat16{}); break;
        default: throw std::invalid_argument("unknown dtype");
    }
}

template <typename T, int D>
void launch_attention(const T* qkv, const int32_t* cu_seqlens, T* out, int sequences, int max_len, int heads,
                      cudaStream_t stream) {
    constexpr int KT = D > 64 ? 8 : 16;
    const float scale = rsqrtf(static_cast<float>(D));
    if constexpr (!std::is_same_v<T, float>) {
        if (max_len > 32) {
            const dim3 grid(sequences, heads, (max_len + kMmaRows - 1) / kMmaRows);
            attention_mma_kernel<T, D><<<grid, kMmaThreads, 0, stream>>>(qkv, cu_seqlens, out, heads,
                                                                         scale * 1.4426950408889634f);
            return;
        }
    }
    if (max_len <= 32) {  // a warp a head, four heads a block
        constexpr int HPB = 4;
        const dim3 grid(sequences, (heads + HPB - 1) / HPB, 1);
        attention_kernel<T, D, KT, 32, HPB><<<grid, 32 * HPB, 0, stream>>>(qkv, cu_seqlens, out, heads, scale);
    } else if (max_len <= 64) {
        const dim3 grid(sequences, heads, 1);
        attention_kernel<T, D, KT, 64, 1><<<grid, 64, 0, stream>>>(qkv, cu_seqlens, out, heads, scale);
    } else {
        const dim3 grid(sequences, heads, (max_len + 127) / 128);
        attention_kernel<T, D, KT, 128, 1><<<grid, 128, 0, stream>>>(qkv, cu_seqlens, out, heads, scale);
    }
}

}  // namespace

size_t element_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

bool attention_supported(int head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128; }

void embed_layer_norm(DType dtype, const int32_t* ids, const int32_t* positions, const void* word,
                      const void* position, const void* type, const float* gamma, const float* beta, void* out,
                      int tokens, int hidden, float eps, cudaStream_t stream) {
    with_type(dtype, [&](auto zero) {
        using T = decltype(zero);
        const int blocks = (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
        embed_layer_norm_kernel<T><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
            ids, positions, static_cast<const T*>(word), static_cast<const T*>(position), static_cast<const T*>(type),
            gamma, beta, static_cast<T*>(out), tokens, hidden, eps);
    });
}

void add_layer_norm(DType dtype, const void* x, void* residual, const float* gamma, const float* beta, int tokens,
                    int hidden, float eps, cudaStream_t stream) {
    with_type(dtype, [&](auto zero) {
        using T = decltype(zero);
        const int blocks = (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
        add_layer_norm_kernel<T><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
            static_cast<const T*>(x), static_cast<T*>(residual), gamma, beta, tokens, hidden, eps);
    });
}

void activation(DType dtype, Act act, void* x, int64_t n, cudaStream_t stream) {
    with_type(dtype, [&](auto zero) {
        using T = decltype(zero);
        T* p = static_cast<T*>(x);
        const int blocks = grid_for(n / (16 / sizeof(T)) + 1, 256);  // cudaMalloc'd buffers: 16-byte aligned
        switch (act) {
            case Act::gelu: activation_kernel<T, Act::gelu><<<blocks, 256, 0, stream>>>(p, n); break;
            case Act::gelu_tanh: activation_kernel<T, Act::gelu_tanh><<<blocks, 256, 0, stream>>>(p, n); break;
            case Act::relu: activation_kernel<T, Act::relu><<<blocks, 256, 0, stream>>>(p, n); break;
        }
    });
}

void attention(DType dtype, const void* qkv, const int32_t* cu_seqlens, void* out, int sequences, int max_len,
               int heads, int head_dim, cudaStream_t stream) {
    with_type(dtype, [&](auto zero) {
        using T = decltype(zero);
        const T* in = static_cast<const T*>(qkv);
        T* o = static_cast<T*>(out);
        switch (head_dim) {
            case 32: launch_attention<T, 32>(in, cu_seqlens, o, sequences, max_len, heads, stream); break;
            case 64: launch_attention<T, 64>(in, cu_seqlens, o, sequences, max_len, heads, stream); break;
            case 128: launch_attention<T, 128>(in, cu_seqlens, o, sequences, max_len, heads, stream); break;
            default: throw std::invalid_argument("attention: head size must be 32, 64 or 128");
        }
    });
}

void convert(DType from, const void* src, DType to, void* dst, int64_t n, cudaStream_t stream) {
    with_type(from, [&](auto zero_from) {
        using From = decltype(zero_from);
        with_type(to, [&](auto zero_to) {
            using To = decltype(zero_to);
            convert_kernel<From, To><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<const From*>(src),
                                                                            static_cast<To*>(dst), n);
        });
    });
}

void accumulate(DType dtype, const void* x, float* sum, int64_t n, bool first, cudaStream_t stream) {
    with_type(dtype, [&](auto zero) {
        using T = decltype(zero);
        accumulate_kernel<T><<<grid_for(n, 256), 256, 0, stream>>>(static_cast<const T*>(x), sum, n, first);
    });
}

void normalize(float* x, int64_t rows, int width, cudaStream_t stream) {
    normalize_kernel<<<static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock), 32 * kWarpsPerBlock, 0,
                       stream>>>(x, rows, width);
}

void pool(DType dtype, const void* x, const int32_t* cu_seqlens, const int32_t* rows, float* out, int sequences,
          int hidden, int out_stride, int column, Pool mode, cudaStream_t stream) {
    with_type(dtype, [&](auto zero) {
        using T = decltype(zero);
        const int threads = hidden >= 256 ? 256 : ((hidden + 31) / 32) * 32;
        const dim3 grid(sequences, (hidden + threads - 1) / threads);
        pool_kernel<T><<<grid, threads, 0, stream>>>(static_cast<const T*>(x), cu_seqlens, rows, out, hidden,
                                                     out_stride, column, mode);
    });
}

}  // namespace encoder
