// CPU concat_column_sums (see csrc/cuda/concat_column_sums.cu): ATen's concatenation, then its column
// sums over the rows (accumulated in fp32 for 16-bit types, fp64 for double, as at::sum does).  On
// the CPU the backward that calls it is bound by its GEMMs, not by this pass.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common.h"

namespace bertctl::cpu {
namespace {

std::tuple<at::Tensor, at::Tensor> concat_column_sums_cpu(at::TensorList blocks) {
  check_concat_column_sums(blocks, "bertctl::concat_column_sums");
  auto out = at::cat(blocks, 1);
  return {out, out.sum(0)};
}

}  // namespace
}  // namespace bertctl::cpu

TORCH_LIBRARY_IMPL(bertctl, CPU, m) { m.impl("concat_column_sums", &bertctl::cpu::concat_column_sums_cpu); }
