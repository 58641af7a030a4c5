// The dropout mask's hash, one definition for the CPU kernels (cpu/dropout_mask.h) and the CUDA
// ones (cuda/bias_dropout_add_layer_norm.cu), so that one (p, seed) drops the same elements on
// both: element i (row-major index of the tensor) of a call with key k is kept when
// lowbias32(i * 0x9E3779B9 + k) >= p * 2^32, k = lowbias32(low 32 bits of the seed) ^ its high 32
// bits.  The plain-PyTorch twin is bertctl.ops.reference.dropout_forward.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define BERTCTL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define BERTCTL_HOST_DEVICE inline
#endif

namespace bertctl {

// Chris Wellons' lowbias32: a 32-bit mixing function (bias 0.17 in his avalanche measure).
BERTCTL_HOST_DEVICE uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

BERTCTL_HOST_DEVICE uint32_t dropout_key(uint64_t seed) {
  return lowbias32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32);
}

// p * 2^32 (0 keeps everything), as the mask compares it.
inline uint32_t dropout_threshold(double p) { return static_cast<uint32_t>(p * 4294967296.0); }

BERTCTL_HOST_DEVICE bool dropout_keep(uint32_t key, uint32_t threshold, int64_t i) {
  return lowbias32(static_cast<uint32_t>(i) * 0x9E3779B9u + key) >= threshold;
}

}  // namespace bertctl
