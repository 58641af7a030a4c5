// The CPU dropout mask, shared by the dropout kernel (dropout.cpp) and the fused
// bias + dropout + residual + LayerNorm (layer_norm.cpp), so that one (p, seed) gives one mask
// in both (the hash is ../dropout_hash.h's, which the CUDA kernel uses too).  Nothing is stored:
// a backward recomputes the mask from (p, seed).  At most 2^32 elements (the index is 32 bits).
#pragma once
#include <ATen/core/Tensor.h>

#include "../dropout_hash.h"

#include <cstdint>

namespace bertctl::cpu {

struct DropoutMask {
  DropoutKey key;          // from the seed (dropout_hash.h)
  uint32_t threshold = 0;  // p * 2^32: 0 keeps everything

  DropoutMask() = default;  // keeps everything (p = 0)

  // seed: one int64 on the CPU, drawn from torch's CPU generator by bertctl.ops.
  DropoutMask(double p, const at::Tensor& seed, const char* op) {
    TORCH_CHECK(p >= 0 && p < 1, op, ": p must be in [0, 1), got ", p);
    TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(), op,
                ": seed must be one int64 on the CPU");
    const uint64_t s = static_cast<uint64_t>(seed.item<int64_t>());
    key = dropout_key(s);
    threshold = dropout_threshold(p);
  }

  // Whether element i is kept (branch-free: loops over it vectorise under `omp simd`).
  bool keep(int64_t i) const { return dropout_keep(key, threshold, i); }
};

}  // namespace bertctl::cpu
