// CPU dropout with a counter-based mask (dropout_mask.h): element i of a call with key (a, b) is kept when
// lowbias32((i * 0x9E3779B9 + a) ^ b) >= p * 2^32 (a 32-bit integer hash, 16 lanes to an AVX-512 vector),
// so no mask is stored and the backward recomputes it from (p, seed); the plain-PyTorch twin is
// bertctl.ops.reference.dropout_forward. Elements are split into chunks of 32,768 over the threads;
// the mask depends only on the index, not on the threads. Arithmetic in float (double for fp64).
// At most 2^32 elements (the index is 32 bits). PyTorch's CPU dropout draws each element from a
// Mersenne Twister (bernoulli_), many times the cost of this hash (the pretraining step with each:
// benchmarks/results/cpu-step-494a53f.json). There is no CUDA kernel: PyTorch's CUDA dropout already
// draws from a counter-based generator (Philox) at memory speed.
#include "../common.h"
#include "cpu_util.h"
#include "dropout_mask.h"

namespace bertctl::cpu {
namespace {

// y = x * scale where the mask keeps the element, else 0; in acc_t (float, double for fp64).
template <typename scalar_t>
void dropout_elements(const scalar_t* x, scalar_t* y, int64_t n, const DropoutMask& mask, double p) {
  using acc_t = acc_type<scalar_t>;
  const acc_t scale = static_cast<acc_t>(1.0 / (1.0 - p));
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    // Local copies, and x read for every element: a load under the condition, through the lambda's
    // captured pointer, kept GCC 12 from vectorising the loop, which then ran many times slower
    // (benchmarks/ops/NOTES-kernels.md, "CPU bias + dropout + residual + LayerNorm").
    const DropoutMask m = mask;
    const scalar_t* xp = x;
    scalar_t* yp = y;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const acc_t v = static_cast<acc_t>(xp[i]) * scale;
      yp[i] = static_cast<scalar_t>(m.keep(i) ? v : acc_t(0));
    }
  });
}

// x * mask / (1 - p); the same call on the gradient is the backward (the op is linear in x).
at::Tensor dropout_cpu(const at::Tensor& x, double p, const at::Tensor& seed) {
  const char* op = "bertctl::dropout";
  const DropoutMask mask(p, seed, op);
  TORCH_CHECK(x.numel() < (int64_t(1) << 32), op, ": at most 2^32 elements");
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bertctl_dropout_cpu", [&] {
    dropout_elements<scalar_t>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), xc.numel(), mask, p);
  });
  return y;
}

}  // namespace
}  // namespace bertctl::cpu

TORCH_LIBRARY_IMPL(bertctl, CPU, m) { m.impl("dropout", &bertctl::cpu::dropout_cpu); }
