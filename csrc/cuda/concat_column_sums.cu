// CUDA concat_column_sums: blocks (N, w_i) joined along the columns into out (N, sum w_i), and out's
// column sums, in one pass.  In the training step this is the QKV projection's backward: the
// attention kernels hand back dQ, dK and dV apart, the weight's and the input's gradients want them
// as one (N, 3H) matrix (one wide GEMM each), and the bias's gradient is that matrix's column sum.
// Joined by torch.cat and summed by ATen's reduction, the (N, 3H) gradient is written once and read
// again; here the sums are taken from the values on their way through registers, saving the second
// pass (side B of benchmarks/results/model-step-changes-ab-h200-b401318.json).
//
// Layout: thread t of the x-grid owns one 16-byte column vector of out (8 bf16/fp16 or 4 fp32
// values; single elements when a block's width or row stride is not a whole number of vectors or a
// pointer is not 16-byte aligned), hence one source block; blockIdx.y picks a band of rows, walked
// kUnroll rows at a time with their loads in flight together.  Each thread keeps its columns' fp32
// sums over its band and writes them as one partial row; column_sums (cuda_util.cuh) adds the bands
// in a fixed order: deterministic, no atomics.  The bands are sized for one wave of resident blocks.
// The copy is exact; the sums are fp32, rounded once to the blocks' dtype.  At most kMaxBlocks
// blocks; rows of any stride >= width (a view of wider rows), unit column stride.
#include "../common.h"
#include "cuda_util.cuh"

namespace bertctl::cuda {
namespace {

constexpr int kMaxBlocks = 4;
constexpr int kUnroll = 4;
constexpr int kMaxThreads = 128;

template <typename T>
struct Sources {
  const T* ptr[kMaxBlocks];
  int64_t ld[kMaxBlocks];      // row stride, elements
  int first[kMaxBlocks + 1];   // the first column vector of out each block fills; first[n] = all
  int n;
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) concat_sums(Sources<T> src, T* __restrict__ out,
                                                           float* __restrict__ part, int64_t rows, int band) {
  pdl_wait();
  pdl_trigger();
  const int v = blockIdx.x * blockDim.x + threadIdx.x;  // column vector of out
  const int nvec = src.first[src.n];
  if (v >= nvec) return;
  int k = 0;
#pragma unroll
  for (int i = 1; i < kMaxBlocks; ++i)
    if (i < src.n && v >= src.first[i]) k = i;
  const T* in = src.ptr[k] + static_cast<int64_t>(v - src.first[k]) * VEC;
  const int64_t ld = src.ld[k], width = static_cast<int64_t>(nvec) * VEC;
  T* o = out + static_cast<int64_t>(v) * VEC;
  float sum[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) sum[j] = 0.f;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * band;
  const int64_t r1 = r0 + band < rows ? r0 + band : rows;
  for (int64_t r = r0; r < r1; r += kUnroll) {
    Pack<T, VEC> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r + u < r1) p[u] = load_pack<VEC>(in + (r + u) * ld);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u < r1) {
        *reinterpret_cast<Pack<T, VEC>*>(o + (r + u) * width) = p[u];
        float f[VEC];
        unpack_float<VEC>(p[u], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum[j] += f[j];
      }
    }
  }
  float* dst = part + static_cast<int64_t>(blockIdx.y) * width + static_cast<int64_t>(v) * VEC;
#pragma unroll
  for (int j = 0; j < VEC; ++j) dst[j] = sum[j];
}

std::tuple<at::Tensor, at::Tensor> concat_column_sums_cuda(at::TensorList blocks) {
  const char* op = "bertctl::concat_column_sums";
  check_concat_column_sums(blocks, op);
  TORCH_CHECK(blocks.size() <= kMaxBlocks, op, ": at most ", kMaxBlocks, " blocks on CUDA, got ", blocks.size());
  const at::Tensor& first = blocks[0];
  const c10::cuda::OptionalCUDAGuard guard(first.device());
  const int64_t rows = first.size(0);
  int64_t width = 0;
  for (const auto& b : blocks) width += b.size(1);
  TORCH_CHECK(width <= INT32_MAX, op, ": rows wider than 2^31 are not supported");
  auto out = at::empty({rows, width}, first.options());
  if (rows == 0 || width == 0) return {out, at::zeros({width}, first.options())};
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor part;
  int64_t nb = 0;
  BERTCTL_DISPATCH_CUDA(first.scalar_type(), "bertctl_concat_column_sums_cuda", [&] {
    using T = scalar_t;
    constexpr int V16 = 16 / sizeof(T);
    std::vector<at::Tensor> rows_unit(blocks.size());
    bool wide = aligned16(out.data_ptr());
    for (size_t i = 0; i < blocks.size(); ++i) {
      rows_unit[i] = rows_unit_stride(blocks[i]);
      const int64_t ld = rows > 1 ? rows_unit[i].stride(0) : rows_unit[i].size(1);
      wide = wide && rows_unit[i].size(1) % V16 == 0 && ld % V16 == 0 && aligned16(rows_unit[i].data_ptr());
    }
    auto run = [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      Sources<T> s{};
      s.n = static_cast<int>(blocks.size());
      int at_vec = 0;
      for (int i = 0; i < s.n; ++i) {
        s.ptr[i] = rows_unit[i].data_ptr<T>();
        s.ld[i] = rows > 1 ? rows_unit[i].stride(0) : rows_unit[i].size(1);
        s.first[i] = at_vec;
        at_vec += static_cast<int>(rows_unit[i].size(1) / VEC);
      }
      s.first[s.n] = at_vec;
      // Whole warps, at most kMaxThreads a block, as few idle threads as that allows.
      const int64_t warps = ceil_div(at_vec, kWarp);
      const int64_t bx = ceil_div(warps, kMaxThreads / kWarp);
      const int threads = static_cast<int>(ceil_div(warps, bx) * kWarp);
      auto kernel = concat_sums<T, VEC>;
      int per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
      // One wave; each thread's kUnroll loads of 16 bytes keep enough bytes in flight at 8 blocks
      // of 96 threads an SM, and fewer bands mean fewer partial rows to add.
      const int64_t bands = std::max<int64_t>(1, std::min<int64_t>(per_sm, 8) * sm_count() / bx);
      int64_t band = ceil_div(ceil_div(rows, bands), kUnroll) * kUnroll;
      band = std::max<int64_t>(band, ceil_div(rows, 65535));
      nb = ceil_div(rows, band);
      part = at::empty({nb, width}, first.options().dtype(at::kFloat));
      launch(kernel, dim3(static_cast<unsigned>(bx), static_cast<unsigned>(nb)), threads, 0, stream, s,
             out.data_ptr<T>(), part.data_ptr<float>(), rows, static_cast<int>(band));
    };
    if (wide) run(std::integral_constant<int, V16>{});
    else run(std::integral_constant<int, 1>{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, column_sums(part, nb, width, 1, first.scalar_type(), stream)[0]};
}

}  // namespace
}  // namespace bertctl::cuda

TORCH_LIBRARY_IMPL(bertctl, CUDA, m) { m.impl("concat_column_sums", &bertctl::cuda::concat_column_sums_cuda); }
