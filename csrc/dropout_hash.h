// The dropout mask's hash, one definition for the CPU kernels (cpu/dropout_mask.h) and the CUDA
// ones (cuda/bias_dropout_add_layer_norm.cu), so that one (p, seed) drops the same elements on
// both: element i (row-major index of the tensor) of a call with key (a, b) is kept when
// lowbias32((i * 0x9E3779B9 + a) ^ b) >= p * 2^32, where a = lowbias32(lo) ^ hi and
// b = lowbias32(hi ^ a) for the seed's low and high 32 bits.  The plain-PyTorch twin is
// bertctl.ops.reference.dropout_forward.
//
// Why b: with a alone, lowbias32(i * 0x9E3779B9 + a), every call's mask is a window of one sequence
// of period 2^32 (a only moves the start), so calls whose windows overlap drop the same pattern
// shifted; BERT-Base pretraining (32,768 tokens x 768 x 24 sub-layers a step) draws 2^32 mask
// elements every 7 steps.  XOR-ing b in before the hash gives every call its own sequence: where
// call 2's window would have been call 1's moved by d, its inputs are call 1's XOR b1 ^ b2, which
// the hash's avalanche makes unrelated.  A second lowbias32 round keyed by b does the same at more
// cost (benchmarks/results/dropout-hash-cpu-a1b71e4.json); the XOR costs one instruction.
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

// The two key words of a call, from its int64 seed.
struct DropoutKey {
  uint32_t a = 0, b = 0;
};

BERTCTL_HOST_DEVICE DropoutKey dropout_key(uint64_t seed) {
  const uint32_t lo = static_cast<uint32_t>(seed), hi = static_cast<uint32_t>(seed >> 32);
  DropoutKey k;
  k.a = lowbias32(lo) ^ hi;
  k.b = lowbias32(hi ^ k.a);
  return k;
}

// p * 2^32 (0 keeps everything), as the mask compares it.
inline uint32_t dropout_threshold(double p) { return static_cast<uint32_t>(p * 4294967296.0); }

BERTCTL_HOST_DEVICE bool dropout_keep(DropoutKey key, uint32_t threshold, int64_t i) {
  return lowbias32((static_cast<uint32_t>(i) * 0x9E3779B9u + key.a) ^ key.b) >= threshold;
}

}  // namespace bertctl
