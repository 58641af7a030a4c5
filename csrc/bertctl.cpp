// Operator schemas for the bertctl namespace, and the Python module bertctl._C.
// Implementations register per device in csrc/cpu/*.cpp and csrc/cuda/*.cu with
// TORCH_LIBRARY_IMPL, autograd in csrc/autograd.cpp; the Python side (bertctl/ops)
// adds register_fake.
//
// Every forward and every backward is its own op, so torch.compile keeps both
// in the graph as opaque kernels.
//
// Importing bertctl._C loads this library, whose static initialisers register the
// ops.  The module itself is plain CPython (no pybind11, no torch/extension.h): those
// two headers took longer to compile than all the kernels together.
#include <Python.h>
#include <torch/library.h>

namespace {

// build_info() -> {"cuda": bool}: how this extension was built.
PyObject* build_info(PyObject*, PyObject*) {
#ifdef BERTCTL_WITH_CUDA
  PyObject* cuda = Py_True;
#else
  PyObject* cuda = Py_False;
#endif
  return Py_BuildValue("{s:O}", "cuda", cuda);
}

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS, "How this extension was built."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "bertctl's compiled kernels (torch.ops.bertctl).", -1,
                          methods};

}  // namespace

// The module is bertctl._C (setup.py), so its init function is PyInit__C.
PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module_def); }

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
  // x * mask / (1 - p), the mask a function of (p, seed, element index) (CPU only): the op is
  // linear in x, so its backward is the same op on the gradient, and no mask is stored.
  m.def("dropout(Tensor x, float p, Tensor seed) -> Tensor");
  // (y, mean, rstd) of LayerNorm(dropout(x + bias) + residual) over the last dim (CPU and CUDA): x is
  // a matmul's output without its bias, weight and ln_bias the LayerNorm's; the mask is a hash of
  // (p, seed, element index) (dropout_hash.h; on the CPU dropout's for the same seed), recomputed in
  // the backward; the seed is one int64 on x's device; p = 0 (eval) needs no seed.
  m.def("bias_dropout_add_layer_norm(Tensor x, Tensor bias, Tensor residual, Tensor weight, Tensor ln_bias, "
        "float eps, float p, Tensor? seed) -> (Tensor, Tensor, Tensor)");
  // (dx, dbias, dresidual, dweight, dln_bias); with p = 0, dx is dresidual and comes back empty.
  m.def("bias_dropout_add_layer_norm_backward(Tensor grad_y, Tensor x, Tensor bias, Tensor residual, "
        "Tensor weight, Tensor mean, Tensor rstd, float p, Tensor? seed) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The same from the output y (float32/float64, CPU only): xhat = (y - ln_bias) / weight, so neither x nor
  // the residual need be kept.  As exact as the above only for weights far from 0 (the autograd node checks
  // them); bias gives dbias its dtype.
  m.def("bias_dropout_add_layer_norm_backward_from_output(Tensor grad_y, Tensor y, Tensor bias, Tensor weight, "
        "Tensor ln_bias, Tensor rstd, float p, Tensor? seed) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // (loss, lse, argmax) of the softmax cross-entropy of each row of logits (N, V) against labels (N,)
  // int64: loss = lse - logits[label] (0 where the label is ignore_index), lse the row's log-sum-exp,
  // both float32 (float64 for double logits); argmax the row's first maximal index.
  m.def("cross_entropy(Tensor logits, Tensor labels, int ignore_index) -> (Tensor, Tensor, Tensor)");
  // dlogits = grad_loss[:, None] * (exp(logits - lse[:, None]) - onehot(labels)), zero on ignored rows.
  m.def("cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor labels, Tensor lse, int ignore_index) -> Tensor");
  // (out, sums): blocks (N, w_i) joined along the columns into out (N, sum of w_i), and out's column sums
  // (sum of w_i,) in the blocks' dtype, accumulated in fp32 (fp64 for double): the QKV projection's
  // gradient and its bias's, one pass on CUDA.  A helper of backward passes: no autograd of its own.
  m.def("concat_column_sums(Tensor[] blocks) -> (Tensor, Tensor)");
}
