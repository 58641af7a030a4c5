// Operator schemas for the bertctl namespace.  Implementations register per
// device in csrc/cpu/*.cpp and csrc/cuda/*.cu with TORCH_LIBRARY_IMPL.
#include <torch/extension.h>
#include <torch/library.h>

namespace {

pybind11::dict build_info() {
  pybind11::dict d;
#ifdef BERTCTL_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_info", &build_info, "How this extension was built.");
}

TORCH_LIBRARY(bertctl, m) {
  // Schemas are added here by the kernels (softmax, layer_norm, bias_gelu).
}
