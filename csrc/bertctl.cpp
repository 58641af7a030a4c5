// Operator schemas for the bertctl namespace.  Implementations register per
// device in csrc/cpu/*.cpp and csrc/cuda/*.cu with TORCH_LIBRARY_IMPL, autograd
// in csrc/autograd.cpp; the Python side (bertctl/ops) adds register_fake.
//
// Every forward and every backward is its own op, so torch.compile keeps both
// in the graph as opaque kernels.
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
  // y = softmax(scale * x + mask) over the last dim.  mask: None, or (B, Sk) bool
  // (True = attend) or float32 additive, for x of shape (B, heads, Sq, Sk).
  m.def("softmax(Tensor x, Tensor? mask, float scale) -> Tensor");
  // dx = scale * y * (dy - sum(dy * y)).
  m.def("softmax_backward(Tensor grad_y, Tensor y, float scale) -> Tensor");
  // (y, mean, rstd) of LayerNorm(x + residual) over the last dim; mean and rstd
  // are float32 of shape x.shape[:-1].
  m.def("layer_norm(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  // y alone, for inference: no statistics are computed into memory, and it has no backward
  // (bertctl.ops.layer_norm calls it when no input requires grad or grad mode is off).
  m.def("layer_norm_inference(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps) -> Tensor");
  // (dx, dweight, dbias); dx is also the gradient of the residual.
  m.def("layer_norm_backward(Tensor grad_y, Tensor x, Tensor? residual, Tensor weight, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)");
  // y = GELU(x + bias); approximate is "none" (erf, BERT's) or "tanh".
  m.def("bias_gelu(Tensor x, Tensor bias, str approximate) -> Tensor");
  // (dx, dbias).
  m.def("bias_gelu_backward(Tensor grad_y, Tensor x, Tensor bias, str approximate) -> (Tensor, Tensor)");
}
