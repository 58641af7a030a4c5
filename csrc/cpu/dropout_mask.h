// The CPU dropout mask, shared by the dropout kernel (dropout.cpp) and the fused
// bias + dropout + residual + LayerNorm (layer_norm.cpp), so that one (p, seed) gives one mask
// in both: element i (row-major index of the tensor) of a call with key k is kept when
// lowbias32(i * 0x9E3779B9 + k) >= p * 2^32.  Nothing is stored: a backward recomputes the mask
// from (p, seed).  The plain-PyTorch twin is bertctl.ops.reference.dropout_forward.  At most
// 2^32 elements (the index is 32 bits).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace bertctl::cpu {

// Chris Wellons' lowbias32: a 32-bit mixing function (bias 0.17 in his avalanche measure).
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

struct DropoutMask {
  uint32_t key = 0;        // lowbias32(low 32 bits of the seed) ^ its high 32 bits
  uint32_t threshold = 0;  // p * 2^32: 0 keeps everything

  DropoutMask() = default;  // keeps everything (p = 0)

  // seed: one int64 on the CPU, drawn from torch's CPU generator by bertctl.ops.
  DropoutMask(double p, const at::Tensor& seed, const char* op) {
    TORCH_CHECK(p >= 0 && p < 1, op, ": p must be in [0, 1), got ", p);
    TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(), op,
                ": seed must be one int64 on the CPU");
    const uint64_t s = static_cast<uint64_t>(seed.item<int64_t>());
    key = lowbias32(static_cast<uint32_t>(s)) ^ static_cast<uint32_t>(s >> 32);
    threshold = static_cast<uint32_t>(p * 4294967296.0);
  }

  // Whether element i is kept (branch-free: loops over it vectorise under `omp simd`).
  bool keep(int64_t i) const { return lowbias32(static_cast<uint32_t>(i) * 0x9E3779B9u + key) >= threshold; }
};

}  // namespace bertctl::cpu
