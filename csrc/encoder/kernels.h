// The kernels of bertctl._encoder: a BERT encoder's inference forward pass on packed (unpadded) tokens,
// without torch.  Every launcher takes the element type of its activations as a DType; LayerNorm's
// parameters and the pooled output are float32, the attention's and LayerNorm's arithmetic float32.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace encoder {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };
enum class Act : int { gelu = 0, gelu_tanh = 1, relu = 2 };
// sentence-transformers' Pooling modes, in bertctl.inference.pooling's order.
enum class Pool : int { cls = 0, mean = 1, max = 2, mean_sqrt_len = 3, weighted_mean = 4, last = 5 };

constexpr int kMaxHidden = 1024;  // one warp a LayerNorm row, 32 values a lane

size_t element_size(DType dtype);
bool attention_supported(int head_dim);

// out[t] = LayerNorm(word[ids[t]] + position[positions[t]] + type), rows of `hidden`.
void embed_layer_norm(DType dtype, const int32_t* ids, const int32_t* positions, const void* word,
                      const void* position, const void* type, const float* gamma, const float* beta, void* out,
                      int tokens, int hidden, float eps, cudaStream_t stream);
// residual = LayerNorm(x + residual), in place.
void add_layer_norm(DType dtype, const void* x, void* residual, const float* gamma, const float* beta, int tokens,
                    int hidden, float eps, cudaStream_t stream);
void activation(DType dtype, Act act, void* x, int64_t n, cudaStream_t stream);
// dst[i] = src[i], n elements, from one type to another (rounded to nearest even).
void convert(DType from, const void* src, DType to, void* dst, int64_t n, cudaStream_t stream);
// Self-attention over each sequence of a packed batch: qkv (tokens, 3 * heads * head_dim) holds the
// query, key and value projections side by side; out (tokens, heads * head_dim).
void attention(DType dtype, const void* qkv, const int32_t* cu_seqlens, void* out, int sequences, int max_len,
               int heads, int head_dim, cudaStream_t stream);
// sum (+)= x, float32, n elements.
void accumulate(DType dtype, const void* x, float* sum, int64_t n, bool first, cudaStream_t stream);
// out[rows[b], column + j] (rows null: out[b, ...]) = the `mode` pooling of x's rows cu_seqlens[b] ..
// cu_seqlens[b + 1] at feature j.
void pool(DType dtype, const void* x, const int32_t* cu_seqlens, const int32_t* rows, float* out, int sequences,
          int hidden, int out_stride, int column, Pool mode, cudaStream_t stream);
// Each of the rows of x (rows, width) divided by its L2 norm, at least 1e-12.
void normalize(float* x, int64_t rows, int width, cudaStream_t stream);

}  // namespace encoder
