// Autograd for the forward ops, on the Autograd dispatch key (and a refusal for
// layer_norm_inference, which has no backward).
//
// Each forward saves what its backward op needs and its node calls that op
// through the dispatcher, so the same code serves eager mode (CPU or CUDA
// kernels) and torch.compile's tracer (fake kernels, registered from Python).
// In C++ the node costs a few microseconds per call; a Python autograd.Function
// costs tens, which is most of a small LayerNorm's forward+backward on CPU.
//
// The backward ops are differentiable once: under create_graph their outputs get
// a node that raises if it is ever reached, instead of the silently missing
// second-order terms of an op without an autograd kernel.
#include <ATen/Dispatch.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The ops below autograd, looked up once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using LayerNormOut = std::tuple<Tensor, Tensor, Tensor>;

Tensor softmax_op(const Tensor& x, const std::optional<Tensor>& mask, double scale) {
  static const auto handle = op<Tensor(const Tensor&, const std::optional<Tensor>&, double)>("bertctl::softmax");
  return handle.call(x, mask, scale);
}

Tensor softmax_backward_op(const Tensor& grad_y, const Tensor& y, double scale) {
  static const auto handle = op<Tensor(const Tensor&, const Tensor&, double)>("bertctl::softmax_backward");
  return handle.call(grad_y, y, scale);
}

LayerNormOut layer_norm_op(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight,
                           const Tensor& bias, double eps) {
  static const auto handle =
      op<LayerNormOut(const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, double)>(
          "bertctl::layer_norm");
  return handle.call(x, residual, weight, bias, eps);
}

Tensor layer_norm_inference_op(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight,
                              const Tensor& bias, double eps) {
  static const auto handle =
      op<Tensor(const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, double)>(
          "bertctl::layer_norm_inference");
  return handle.call(x, residual, weight, bias, eps);
}

LayerNormOut layer_norm_backward_op(const Tensor& grad_y, const Tensor& x, const std::optional<Tensor>& residual,
                                    const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  static const auto handle = op<LayerNormOut(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                             const Tensor&, const Tensor&, const Tensor&)>(
      "bertctl::layer_norm_backward");
  return handle.call(grad_y, x, residual, weight, mean, rstd);
}

Tensor bias_gelu_op(const Tensor& x, const Tensor& bias, std::string approximate) {
  static const auto handle = op<Tensor(const Tensor&, const Tensor&, std::string)>("bertctl::bias_gelu");
  return handle.call(x, bias, approximate);
}

std::tuple<Tensor, Tensor> bias_gelu_backward_op(const Tensor& grad_y, const Tensor& x, const Tensor& bias,
                                                 std::string approximate) {
  static const auto handle =
      op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, std::string)>(
          "bertctl::bias_gelu_backward");
  return handle.call(grad_y, x, bias, approximate);
}

Tensor dropout_op(const Tensor& x, double p, const Tensor& seed) {
  static const auto handle = op<Tensor(const Tensor&, double, const Tensor&)>("bertctl::dropout");
  return handle.call(x, p, seed);
}

using BdalnOut = std::tuple<Tensor, Tensor, Tensor>;
using BdalnGrads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

BdalnOut bias_dropout_add_layer_norm_op(const Tensor& x, const Tensor& bias, const Tensor& residual,
                                        const Tensor& weight, const Tensor& ln_bias, double eps, double p,
                                        const std::optional<Tensor>& seed) {
  static const auto handle = op<BdalnOut(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                         double, double, const std::optional<Tensor>&)>(
      "bertctl::bias_dropout_add_layer_norm");
  return handle.call(x, bias, residual, weight, ln_bias, eps, p, seed);
}

BdalnGrads bias_dropout_add_layer_norm_backward_op(const Tensor& grad_y, const Tensor& x, const Tensor& bias,
                                                   const Tensor& residual, const Tensor& weight, const Tensor& mean,
                                                   const Tensor& rstd, double p, const std::optional<Tensor>& seed) {
  static const auto handle = op<BdalnGrads(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                           const Tensor&, const Tensor&, double, const std::optional<Tensor>&)>(
      "bertctl::bias_dropout_add_layer_norm_backward");
  return handle.call(grad_y, x, bias, residual, weight, mean, rstd, p, seed);
}

BdalnGrads bias_dropout_add_layer_norm_backward_from_output_op(const Tensor& grad_y, const Tensor& y,
                                                               const Tensor& bias, const Tensor& weight,
                                                               const Tensor& ln_bias, const Tensor& rstd, double p,
                                                               const std::optional<Tensor>& seed) {
  static const auto handle = op<BdalnGrads(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                           const Tensor&, double, const std::optional<Tensor>&)>(
      "bertctl::bias_dropout_add_layer_norm_backward_from_output");
  return handle.call(grad_y, y, bias, weight, ln_bias, rstd, p, seed);
}

// Whether bias+dropout+residual+LayerNorm's backward works from its output y, xhat = (y - bias) / weight,
// instead of from its input: then neither the matmul output x nor the residual need be kept for the
// backward (in BERT nothing else keeps x; y is kept anyway, by the next matmul), and the backward reads
// one tensor fewer (4 activation-sized tensors with dropout instead of 5).  Only where that gives xhat
// as accurately as the input does:
// - on the CPU (the only kernels), for fp32/fp64 y: a 16-bit y is too coarse to give xhat back;
// - for ordinary tensors: under torch.compile's tracer or a dispatch mode the weights' values are not
//   known, and the input is kept;
// - for weights with every |w| >= 2^-110 and |bias| <= 64 |w|, all finite.  xhat's error is then
//   that of y's last bit over w, about 2^-24 (|xhat| + 64) in fp32.  (A LayerNorm weight can die:
//   the last LayerNorm of all-MiniLM-L6-v2 has one w of 5e-33, with its bias 58 times that.)
bool backward_from_output(const Tensor& y, const Tensor& weight, const Tensor& bias) {
  const auto dtype = y.scalar_type();
  if (!y.device().is_cpu() || (dtype != at::kFloat && dtype != at::kDouble)) return false;
  if (weight.scalar_type() != at::kFloat && weight.scalar_type() != at::kDouble) return false;
  if (at::areAnyTensorSubclassLike({y, weight, bias})) return false;
  bool ok = true;
  AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "bertctl_backward_from_output", [&] {
    const Tensor w = weight.contiguous(), b = bias.to(weight.scalar_type()).contiguous();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.const_data_ptr<scalar_t>();
    for (int64_t j = 0; j < w.numel() && ok; ++j) {
      const double aw = std::abs(static_cast<double>(wp[j])), ab = std::abs(static_cast<double>(bp[j]));
      ok = std::isfinite(aw) && aw >= 0x1p-110 && ab <= 64 * aw;  // false for a NaN bias too
    }
  });
  return ok;
}

using CrossEntropyOut = std::tuple<Tensor, Tensor, Tensor>;

CrossEntropyOut cross_entropy_op(const Tensor& logits, const Tensor& labels, int64_t ignore_index) {
  static const auto handle =
      op<CrossEntropyOut(const Tensor&, const Tensor&, int64_t)>("bertctl::cross_entropy");
  return handle.call(logits, labels, ignore_index);
}

Tensor cross_entropy_backward_op(const Tensor& grad_loss, const Tensor& logits, const Tensor& labels,
                                 const Tensor& lse, int64_t ignore_index) {
  static const auto handle =
      op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t)>(
          "bertctl::cross_entropy_backward");
  return handle.call(grad_loss, logits, labels, lse, ignore_index);
}

// Linear in x: the backward is the same mask on the gradient, through the dispatcher, so a
// double backward works too.
class Dropout : public torch::autograd::Function<Dropout> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, double p, const Tensor& seed) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["p"] = p;
    ctx->save_for_backward({seed});
    return dropout_op(x, p, seed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor seed = ctx->get_saved_variables()[0];
    return {Dropout::apply(grads[0], ctx->saved_data["p"].toDouble(), seed), Tensor(), Tensor()};
  }
};

class Softmax : public torch::autograd::Function<Softmax> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& mask, double scale) {
    at::AutoDispatchBelowADInplaceOrView below;
    Tensor y = softmax_op(x, mask, scale);
    ctx->save_for_backward({y});
    ctx->saved_data["scale"] = scale;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor y = ctx->get_saved_variables()[0];
    return {softmax_backward_op(grads[0], y, ctx->saved_data["scale"].toDouble()), Tensor(), Tensor()};
  }
};

class LayerNorm : public torch::autograd::Function<LayerNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& residual,
                               const Tensor& weight, const Tensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, mean, rstd] = layer_norm_op(x, residual, weight, bias, eps);
    // x and residual are kept (not their sum): the backward re-adds them, which moves the same
    // bytes as reading a saved sum and saves the forward a write.  (Working from y instead, as
    // BiasDropoutAddLayerNorm does on the CPU, was slower for LayerNorm alone.)
    ctx->save_for_backward({x, residual.value_or(Tensor()), weight, mean, rstd});
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    // mean and rstd are statistics, never differentiated; with grads left unmaterialised no
    // zero gradients are made for them (two fill kernels per backward otherwise).
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) {  // only the statistics were used downstream
      return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& residual = saved[1];
    const std::optional<Tensor> residual_opt = residual.defined() ? std::optional<Tensor>(residual) : std::nullopt;
    auto [dx, dweight, dbias] = layer_norm_backward_op(grads[0], saved[0], residual_opt, saved[2], saved[3], saved[4]);
    // dx is also the residual's gradient: LayerNorm sees only their sum.
    return {dx, residual.defined() ? dx : Tensor(), dweight, dbias.to(ctx->saved_data["bias_dtype"].toScalarType()),
            Tensor()};
  }
};

class BiasGelu : public torch::autograd::Function<BiasGelu> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, std::string approximate) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({x, bias});
    ctx->saved_data["approximate"] = std::string(approximate);
    return bias_gelu_op(x, bias, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    auto [dx, dbias] = bias_gelu_backward_op(grads[0], saved[0], saved[1], approximate);
    return {dx, dbias, Tensor()};
  }
};

// Saves x, bias, residual (not their dropped-out sum: the backward recomputes it, and the mask, from
// (p, seed)), the LayerNorm weight and the statistics; or, where backward_from_output says so, the
// output y in place of x and residual (and the LayerNorm bias, to give xhat back).
class BiasDropoutAddLayerNorm : public torch::autograd::Function<BiasDropoutAddLayerNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, const Tensor& residual,
                               const Tensor& weight, const Tensor& ln_bias, double eps, double p,
                               const std::optional<Tensor>& seed) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, mean, rstd] = bias_dropout_add_layer_norm_op(x, bias, residual, weight, ln_bias, eps, p, seed);
    const bool from_output = backward_from_output(y, weight, ln_bias);
    ctx->saved_data["from_output"] = from_output;
    if (from_output) {
      ctx->save_for_backward({y, bias, ln_bias, weight, rstd, seed.value_or(Tensor())});
    } else {
      ctx->save_for_backward({x, bias, residual, weight, mean, rstd, seed.value_or(Tensor())});
    }
    ctx->saved_data["p"] = p;
    ctx->saved_data["ln_bias_dtype"] = ln_bias.scalar_type();
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) {  // only the statistics were used downstream
      return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    const variable_list saved = ctx->get_saved_variables();
    const double p = ctx->saved_data["p"].toDouble();
    const Tensor& seed_saved = saved.back();
    const std::optional<Tensor> seed = seed_saved.defined() ? std::optional<Tensor>(seed_saved) : std::nullopt;
    Tensor dx, dbias, dres, dweight, dln_bias;
    if (ctx->saved_data["from_output"].toBool()) {
      std::tie(dx, dbias, dres, dweight, dln_bias) = bias_dropout_add_layer_norm_backward_from_output_op(
          grads[0], saved[0], saved[1], saved[3], saved[2], saved[4], p, seed);
    } else {
      std::tie(dx, dbias, dres, dweight, dln_bias) = bias_dropout_add_layer_norm_backward_op(
          grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], p, seed);
    }
    // Without dropout x's gradient is the residual's (the op returns it empty).
    return {p > 0 ? dx : dres, dbias, dres, dweight,
            dln_bias.to(ctx->saved_data["ln_bias_dtype"].toScalarType()), Tensor(), Tensor(), Tensor()};
  }
};

// Saves the logits as they are (no fp32 copy) and each row's log-sum-exp; lse and argmax are not
// differentiable.
class CrossEntropy : public torch::autograd::Function<CrossEntropy> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& labels,
                               int64_t ignore_index) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, lse, argmax] = cross_entropy_op(logits, labels, ignore_index);
    ctx->save_for_backward({logits, labels, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->mark_non_differentiable({lse, argmax});
    ctx->set_materialize_grads(false);
    return {loss, lse, argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    return {cross_entropy_backward_op(grads[0], saved[0], saved[1], saved[2],
                                      ctx->saved_data["ignore_index"].toInt()),
            Tensor(), Tensor()};
  }
};

// The backward ops under create_graph=True: their outputs are differentiable, through a node that
// raises.  Without grad mode (a plain backward) they run straight below autograd.
[[noreturn]] void no_double_backward(const char* op_name) {
  TORCH_CHECK(false, op_name,
              " has no derivative of its own: no double backward through bertctl's fused ops "
              "(run the model with kernels=torch for higher-order gradients)");
}

class SoftmaxBackward : public torch::autograd::Function<SoftmaxBackward> {
 public:
  static Tensor forward(AutogradContext*, const Tensor& grad_y, const Tensor& y, double scale) {
    at::AutoDispatchBelowADInplaceOrView below;
    return softmax_backward_op(grad_y, y, scale);
  }
  static variable_list backward(AutogradContext*, variable_list) { no_double_backward("bertctl::softmax_backward"); }
};

class LayerNormBackward : public torch::autograd::Function<LayerNormBackward> {
 public:
  static variable_list forward(AutogradContext*, const Tensor& grad_y, const Tensor& x,
                               const std::optional<Tensor>& residual, const Tensor& weight, const Tensor& mean,
                               const Tensor& rstd) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [dx, dweight, dbias] = layer_norm_backward_op(grad_y, x, residual, weight, mean, rstd);
    return {dx, dweight, dbias};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    no_double_backward("bertctl::layer_norm_backward");
  }
};

class BiasGeluBackward : public torch::autograd::Function<BiasGeluBackward> {
 public:
  static variable_list forward(AutogradContext*, const Tensor& grad_y, const Tensor& x, const Tensor& bias,
                               std::string approximate) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [dx, dbias] = bias_gelu_backward_op(grad_y, x, bias, approximate);
    return {dx, dbias};
  }
  static variable_list backward(AutogradContext*, variable_list) { no_double_backward("bertctl::bias_gelu_backward"); }
};

class BiasDropoutAddLayerNormBackward : public torch::autograd::Function<BiasDropoutAddLayerNormBackward> {
 public:
  static variable_list forward(AutogradContext*, const Tensor& grad_y, const Tensor& x, const Tensor& bias,
                               const Tensor& residual, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                               double p, const std::optional<Tensor>& seed) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [dx, dbias, dres, dweight, dln_bias] =
        bias_dropout_add_layer_norm_backward_op(grad_y, x, bias, residual, weight, mean, rstd, p, seed);
    return {dx, dbias, dres, dweight, dln_bias};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    no_double_backward("bertctl::bias_dropout_add_layer_norm_backward");
  }
};

class BiasDropoutAddLayerNormBackwardFromOutput
    : public torch::autograd::Function<BiasDropoutAddLayerNormBackwardFromOutput> {
 public:
  static variable_list forward(AutogradContext*, const Tensor& grad_y, const Tensor& y, const Tensor& bias,
                               const Tensor& weight, const Tensor& ln_bias, const Tensor& rstd, double p,
                               const std::optional<Tensor>& seed) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [dx, dbias, dres, dweight, dln_bias] =
        bias_dropout_add_layer_norm_backward_from_output_op(grad_y, y, bias, weight, ln_bias, rstd, p, seed);
    return {dx, dbias, dres, dweight, dln_bias};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    no_double_backward("bertctl::bias_dropout_add_layer_norm_backward_from_output");
  }
};

class CrossEntropyBackward : public torch::autograd::Function<CrossEntropyBackward> {
 public:
  static Tensor forward(AutogradContext*, const Tensor& grad_loss, const Tensor& logits, const Tensor& labels,
                        const Tensor& lse, int64_t ignore_index) {
    at::AutoDispatchBelowADInplaceOrView below;
    return cross_entropy_backward_op(grad_loss, logits, labels, lse, ignore_index);
  }
  static variable_list backward(AutogradContext*, variable_list) {
    no_double_backward("bertctl::cross_entropy_backward");
  }
};

Tensor softmax_backward_autograd(const Tensor& grad_y, const Tensor& y, double scale) {
  if (!at::GradMode::is_enabled()) {
    at::AutoDispatchBelowADInplaceOrView below;
    return softmax_backward_op(grad_y, y, scale);
  }
  return SoftmaxBackward::apply(grad_y, y, scale);
}

LayerNormOut layer_norm_backward_autograd(const Tensor& grad_y, const Tensor& x, const std::optional<Tensor>& residual,
                                          const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  if (!at::GradMode::is_enabled()) {
    at::AutoDispatchBelowADInplaceOrView below;
    return layer_norm_backward_op(grad_y, x, residual, weight, mean, rstd);
  }
  const variable_list out = LayerNormBackward::apply(grad_y, x, residual, weight, mean, rstd);
  return {out[0], out[1], out[2]};
}

std::tuple<Tensor, Tensor> bias_gelu_backward_autograd(const Tensor& grad_y, const Tensor& x, const Tensor& bias,
                                                       std::string approximate) {
  if (!at::GradMode::is_enabled()) {
    at::AutoDispatchBelowADInplaceOrView below;
    return bias_gelu_backward_op(grad_y, x, bias, approximate);
  }
  const variable_list out = BiasGeluBackward::apply(grad_y, x, bias, approximate);
  return {out[0], out[1]};
}

BdalnGrads bias_dropout_add_layer_norm_backward_autograd(const Tensor& grad_y, const Tensor& x, const Tensor& bias,
                                                         const Tensor& residual, const Tensor& weight,
                                                         const Tensor& mean, const Tensor& rstd, double p,
                                                         const std::optional<Tensor>& seed) {
  if (!at::GradMode::is_enabled()) {
    at::AutoDispatchBelowADInplaceOrView below;
    return bias_dropout_add_layer_norm_backward_op(grad_y, x, bias, residual, weight, mean, rstd, p, seed);
  }
  const variable_list out =
      BiasDropoutAddLayerNormBackward::apply(grad_y, x, bias, residual, weight, mean, rstd, p, seed);
  return {out[0], out[1], out[2], out[3], out[4]};
}

BdalnGrads bias_dropout_add_layer_norm_backward_from_output_autograd(const Tensor& grad_y, const Tensor& y,
                                                                     const Tensor& bias, const Tensor& weight,
                                                                     const Tensor& ln_bias, const Tensor& rstd,
                                                                     double p, const std::optional<Tensor>& seed) {
  if (!at::GradMode::is_enabled()) {
    at::AutoDispatchBelowADInplaceOrView below;
    return bias_dropout_add_layer_norm_backward_from_output_op(grad_y, y, bias, weight, ln_bias, rstd, p, seed);
  }
  const variable_list out =
      BiasDropoutAddLayerNormBackwardFromOutput::apply(grad_y, y, bias, weight, ln_bias, rstd, p, seed);
  return {out[0], out[1], out[2], out[3], out[4]};
}

Tensor cross_entropy_backward_autograd(const Tensor& grad_loss, const Tensor& logits, const Tensor& labels,
                                       const Tensor& lse, int64_t ignore_index) {
  if (!at::GradMode::is_enabled()) {
    at::AutoDispatchBelowADInplaceOrView below;
    return cross_entropy_backward_op(grad_loss, logits, labels, lse, ignore_index);
  }
  return CrossEntropyBackward::apply(grad_loss, logits, labels, lse, ignore_index);
}

CrossEntropyOut cross_entropy_autograd(const Tensor& logits, const Tensor& labels, int64_t ignore_index) {
  const variable_list out = CrossEntropy::apply(logits, labels, ignore_index);
  return {out[0], out[1], out[2]};
}

Tensor softmax_autograd(const Tensor& x, const std::optional<Tensor>& mask, double scale) {
  return Softmax::apply(x, mask, scale);
}

LayerNormOut layer_norm_autograd(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight,
                                 const Tensor& bias, double eps) {
  const variable_list out = LayerNorm::apply(x, residual, weight, bias, eps);
  return {out[0], out[1], out[2]};
}

// Keeps no statistics, so it cannot be differentiated: refused where a gradient would be recorded.
Tensor layer_norm_inference_autograd(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight,
                                     const Tensor& bias, double eps) {
  const bool res_grad = residual.has_value() && residual->defined() && residual->requires_grad();
  const bool records = at::GradMode::is_enabled() &&
                       (x.requires_grad() || weight.requires_grad() || bias.requires_grad() || res_grad);
  TORCH_CHECK(!records,
              "bertctl::layer_norm_inference has no backward (it keeps no mean/rstd): use bertctl::layer_norm "
              "where gradients are needed");
  at::AutoDispatchBelowADInplaceOrView below;
  return layer_norm_inference_op(x, residual, weight, bias, eps);
}

Tensor bias_gelu_autograd(const Tensor& x, const Tensor& bias, std::string approximate) {
  return BiasGelu::apply(x, bias, approximate);
}

Tensor dropout_autograd(const Tensor& x, double p, const Tensor& seed) { return Dropout::apply(x, p, seed); }

BdalnOut bias_dropout_add_layer_norm_autograd(const Tensor& x, const Tensor& bias, const Tensor& residual,
                                              const Tensor& weight, const Tensor& ln_bias, double eps, double p,
                                              const std::optional<Tensor>& seed) {
  const variable_list out = BiasDropoutAddLayerNorm::apply(x, bias, residual, weight, ln_bias, eps, p, seed);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(bertctl, Autograd, m) {
  m.impl("softmax", &softmax_autograd);
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("layer_norm_inference", &layer_norm_inference_autograd);
  m.impl("bias_gelu", &bias_gelu_autograd);
  m.impl("softmax_backward", &softmax_backward_autograd);
  m.impl("layer_norm_backward", &layer_norm_backward_autograd);
  m.impl("bias_gelu_backward", &bias_gelu_backward_autograd);
  m.impl("dropout", &dropout_autograd);
  m.impl("bias_dropout_add_layer_norm", &bias_dropout_add_layer_norm_autograd);
  m.impl("bias_dropout_add_layer_norm_backward", &bias_dropout_add_layer_norm_backward_autograd);
  m.impl("bias_dropout_add_layer_norm_backward_from_output",
         &bias_dropout_add_layer_norm_backward_from_output_autograd);
  m.impl("cross_entropy", &cross_entropy_autograd);
  m.impl("cross_entropy_backward", &cross_entropy_backward_autograd);
}
