"""BERT (Devlin et al., 2018) in one file: embeddings, post-LN encoder, pooler and heads.

Module and parameter names are Hugging Face's (``bert.encoder.layer.N.attention.self.query``,
``attention.output.LayerNorm``, ``intermediate.dense``, ``output.dense``,
``cls.predictions.transform``, ``cls.seq_relationship``, ...), so a state dict moves
between bertctl and ``transformers`` unchanged.

Three choices are made per config, over the same weights:
- ``attn_implementation``: ``sdpa`` (torch's scaled_dot_product_attention), ``explicit``
  (materialised scores, the path the fused softmax serves) or ``unpadded`` (the encoder runs on
  the batch's real tokens only, (T, H) with T = the sum of the lengths; see ``Packed``);
- ``kernels``: ``fused`` (bertctl's softmax / LayerNorm+residual / bias+GELU /
  bias+dropout+residual+LayerNorm ops, and on the CPU its dropout), ``torch`` (plain PyTorch), or
  ``auto`` (fused when the compiled module loaded);
- ``dropout_masks``: with fused kernels, whether training draws bertctl's own masks (``fused``) or torch's
  (``torch``, fine-tuning's; see ``own_masks``).

Shapes: B batch, S sequence, H hidden, nh heads, hs head size, I intermediate, V vocab,
P masked positions per sequence, C choices.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bertctl import ops
from bertctl.config import GELU_APPROXIMATION, BertConfig

IGNORE_INDEX = -100


def use_fused(config: BertConfig) -> bool:
    if config.kernels == "torch":
        return False
    available = ops.fused_available() if hasattr(ops, "fused_available") else False
    return available or config.kernels == "fused"


def own_masks(config: BertConfig) -> bool:
    """Whether training's dropout draws bertctl's own masks (the compiled ops' hash of a seed and the element's
    index) rather than torch's.  With ``dropout_masks="torch"`` every dropout is torch's, and the sub-layer
    outputs train with it before the fused LayerNorm (inference keeps the one fused op, which then drops
    nothing).  Fine-tuning trains so: on the acceptability task over 160 seeds, MiniLM-L6 on H200s, torch's
    masks gave a Matthews correlation 0.10 below the transformers Trainer (one standard error 0.21); the fused
    op's own masks 0.42 below it (0.20), and 0.29 (0.22) with f3569a0's two-round hash
    (``benchmarks/results/finetune-diagnostics/README.md``)."""
    return use_fused(config) and config.dropout_masks == "fused"


def activation(name: str):
    if name in GELU_APPROXIMATION:
        return lambda x: F.gelu(x, approximate=GELU_APPROXIMATION[name])
    if name == "relu":
        return F.relu
    if name == "tanh":
        return torch.tanh
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"unsupported hidden_act {name!r}")


def layer_norm(ln: nn.LayerNorm, x: torch.Tensor, residual: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """LN(x + residual): one fused op, or the add then torch's LayerNorm.

    Under autocast the fused path keeps the residual stream in the autocast dtype (bf16/fp16 in
    and out, fp32 statistics and parameters, as apex's mixed LayerNorm): half the bytes of the
    fp32 stream that torch's autocast LayerNorm produces, and no casts before the next matmul.
    """
    if fused:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x = x.to(dtype)
            residual = None if residual is None else residual.to(dtype)
        return ops.layer_norm(x, ln.weight, ln.bias, ln.eps, residual=residual)
    return ln(x if residual is None else x + residual)


def dropout(module: nn.Dropout, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """The module's dropout: with fused kernels bertctl's (on the CPU a hashed mask, recomputed in
    the backward, where torch draws each element from a Mersenne Twister), else torch's."""
    return ops.dropout(x, module.p, module.training) if fused else module(x)


def dense_dropout_add_norm(dense: nn.Linear, drop: nn.Dropout, ln: nn.LayerNorm, h: torch.Tensor,
                           residual: torch.Tensor, fused: bool, own: bool = True) -> torch.Tensor:
    """LN(Dropout(h W^T + b) + residual).

    With fused kernels (CPU and CUDA): the matmul without its bias, then one op for the bias, dropout,
    residual add and LayerNorm (its mask a hash of a seed and the element's index; on the CPU the mask
    that ``dropout`` would draw, so the same seed trains the same), which never writes the dropped-out
    sum or a mask to memory.  Otherwise the Linear, the dropout, then LN(x + residual): so too in training
    without ``own`` masks (``own_masks``), with torch's dropout.
    """
    device = h.device.type
    dropping = drop.training and drop.p > 0
    if fused and (own or not dropping) and ops.bias_dropout_add_layer_norm_available(device):
        y = linear(h, dense.weight)  # (..., H), the bias added by the fused op
        if torch.is_autocast_enabled(device):  # as layer_norm: the residual stream in the autocast dtype
            dtype = torch.get_autocast_dtype(device)
            y, residual = y.to(dtype), residual.to(dtype)
        return ops.bias_dropout_add_layer_norm(y, dense.bias, residual, ln.weight, ln.bias, ln.eps, drop.p,
                                               drop.training)
    return layer_norm(ln, dropout(drop, dense(h), fused and own), residual, fused)


def dense_act(dense: nn.Linear, act_name: str, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """act(x W^T + b): with fused kernels the bias add and GELU are one op after the matmul."""
    return bias_act(dense, act_name, linear(x, dense.weight) if fuses_bias(act_name, fused) else dense(x), fused)


def fuses_bias(act_name: str, fused: bool) -> bool:
    """Whether ``bias_act`` adds the bias itself (the fused bias + GELU op), so the matmul goes without it."""
    return fused and act_name in GELU_APPROXIMATION


def bias_act(dense: nn.Linear, act_name: str, h: torch.Tensor, fused: bool) -> torch.Tensor:
    """act(h + b) for the matmul output h, which already holds the bias unless ``fuses_bias``."""
    if fuses_bias(act_name, fused):
        return ops.bias_gelu(h, dense.bias, approximate=GELU_APPROXIMATION[act_name])
    return activation(act_name)(h)


class InputProjection(torch.autograd.Function):
    """A sub-layer's input projection x W^T + b, cut into column blocks of ``widths`` (Q, K and V, or
    the FFN's one), and x itself, handed on as the sub-layer's residual.

    A post-LN layer reads x twice: in this matmul and in the residual add before the sub-layer's
    LayerNorm. Left to autograd, the two gradients of x meet in a separate add, which reads two
    activation-sized tensors and writes one (25 adds, 1.1 ms of a BERT-Base s128 training step on an
    H100). Here one node owns both reads of x, and its backward accumulates the matmul's input
    gradient into the residual's as the GEMM's C operand (``addmm_``, beta 1). The blocks' gradients
    are joined into one (N, sum of widths) gradient first (Q, K and V's arrive from the attention
    kernels in (B, S, nh, hs) memory: one vectorised concatenation), so each product is one wide
    GEMM: three narrow ones, each accumulating, took 1.6 ms more GEMM time a step on an H100 than
    one wide one, which cancelled the saving. The bias's gradient, the joined gradient's column sums,
    is taken in the same pass (``ops.concat_column_sums``) rather than by reading it again.

    ``into_residual_grad``: the residual feeds only a LayerNorm, whose backward writes its gradient
    as a new tensor, downstream of every use of the projection: when this backward runs that
    gradient has no other reader left, so it is accumulated into in place (when it is a plain
    contiguous tensor of the GEMM's dtype and no graph is being built over the backward). Otherwise,
    as for a gradient a caller passes in, the sum is a new tensor.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, widths, into_residual_grad, dtype):
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        if dtype is not None:  # under autocast: the parameters cast here, their gradients returned as they are
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        xc = x.to(weight.dtype)
        ctx.save_for_backward(xc, weight)
        ctx.widths, ctx.has_bias, ctx.x_dtype = widths, bias is not None, x.dtype
        ctx.into_residual_grad = into_residual_grad
        y = F.linear(xc, weight, bias)
        return (*(y.split(widths, dim=-1) if len(widths) > 1 else (y,)), x.view_as(x))

    @staticmethod
    def backward(ctx, *grads):
        xc, weight = ctx.saved_tensors
        *blocks, grad_r = grads
        H = xc.shape[-1]
        rows = [xc.new_zeros(xc.numel() // H, w) if g is None else g.reshape(-1, w)
                for g, w in zip(blocks, ctx.widths)]
        dx = dw = db = None
        if len(rows) == 1:
            g = rows[0]
        elif ctx.has_bias and ctx.needs_input_grad[2]:
            g, db = ops.concat_column_sums(rows)  # (N, sum of widths) and its column sums, one pass
        else:
            g = torch.cat(rows, dim=-1)
        if ctx.needs_input_grad[0]:
            if (ctx.into_residual_grad and grad_r is not None and grad_r.dtype == weight.dtype
                    and grad_r.is_contiguous() and not grad_r._is_view() and not torch.is_grad_enabled()):
                dx = grad_r.view(-1, H).addmm_(g, weight).view(xc.shape)
            else:
                dx = (g @ weight).view(xc.shape)
                if grad_r is not None:
                    dx = grad_r + dx
            dx = dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(g, xc, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = (g.sum(0) if db is None else db).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def weight_grad(g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """g^T x over all leading dims, (out, in), in ``dtype``: a linear layer's weight gradient. For an
    fp32 weight under autocast the GEMM writes fp32 itself (on CUDA, from its fp32 accumulator)
    instead of a 16-bit product that a cast then widens: that cast, autograd's for autocast's
    16-bit copy of the weight, ran as 69 unvectorised copies, 0.54 ms of a BERT-Base step at seq 128
    batch 256 on an H200."""
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    if dtype == g.dtype:
        return g2.t() @ x2
    if g.is_cuda and dtype == torch.float32:
        return torch.mm(g2.t(), x2, out_dtype=dtype)
    return (g2.t() @ x2).to(dtype)


class CastLinear(torch.autograd.Function):
    """x W^T (no bias) in the autocast dtype for a weight of another dtype: autocast's cast of the
    weight and the matmul in one node, whose backward returns the weight's gradient in the weight's
    dtype (``weight_grad``) rather than a 16-bit one for autograd to widen."""

    @staticmethod
    def forward(ctx, x, weight, dtype):
        xc, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(xc, w)
        ctx.x_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        return F.linear(xc, w)

    @staticmethod
    def backward(ctx, g):
        xc, w = ctx.saved_tensors
        dx = (g @ w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = weight_grad(g, xc, ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T without a bias: ``CastLinear`` under autocast where a backward will run, ``F.linear`` otherwise."""
    device = x.device.type
    if (torch.is_grad_enabled() and weight.requires_grad and torch.is_autocast_enabled(device)
            and weight.dtype != torch.get_autocast_dtype(device)):
        return CastLinear.apply(x, weight, torch.get_autocast_dtype(device))
    return F.linear(x, weight)


def input_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     widths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """(x W^T + b cut into column blocks of ``widths``, ..., x): ``InputProjection`` where a backward
    will run, plain ``F.linear`` otherwise. The caller feeds the residual x only to its sub-layer's
    LayerNorm (``into_residual_grad``). Under autocast the weight and bias are cast to the autocast
    dtype inside the node, whose backward returns their gradients in their own dtype (``weight_grad``);
    the residual keeps x's dtype."""
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        y = F.linear(x, weight, bias)
        return (*(y.split(widths, dim=-1) if len(widths) > 1 else (y,)), x)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    # Under torch.compile the backward's in-place accumulation is left to the compiler (dynamo cannot
    # trace the aliasing check that guards it, and broke the graph at every layer).
    return InputProjection.apply(x, weight, bias, tuple(widths), not torch.compiler.is_compiling(), dtype)


# --------------------------------------------------------------------------- outputs


@dataclass
class BertOutput:
    last_hidden_state: torch.Tensor  # (B, S, H)
    pooler_output: torch.Tensor | None  # (B, H)
    hidden_states: tuple[torch.Tensor, ...] | None = None  # L+1 of (B, S, H): embeddings, then each layer


@dataclass
class PreTrainingOutput:
    loss: torch.Tensor | None
    mlm_loss: torch.Tensor | None
    nsp_loss: torch.Tensor | None
    prediction_logits: torch.Tensor  # (B, P, V) at masked_positions, else (B, S, V)
    seq_relationship_logits: torch.Tensor | None  # (B, 2); None for BertForMaskedLM (no NSP head)
    hidden_states: tuple[torch.Tensor, ...] | None = None
    # The same logits over V rounded up to VOCAB_ALIGN on CUDA, the extra columns -inf
    # (prediction_logits is a view of it): what a loss should read, as its gradient then needs no
    # slicing back to the padded width. prediction_logits itself where V needs no padding.
    padded_prediction_logits: torch.Tensor | None = None


@dataclass
class TaskOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class QAOutput:
    loss: torch.Tensor | None
    start_logits: torch.Tensor  # (B, S)
    end_logits: torch.Tensor  # (B, S)
    hidden_states: tuple[torch.Tensor, ...] | None = None


# --------------------------------------------------------------------------- encoder


class BertEmbeddings(nn.Module):
    """Token + segment + position embeddings, then LayerNorm and dropout (paper §3, Figure 2)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        S = input_ids.shape[1]
        if S > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {S} exceeds max_position_embeddings {self.config.max_position_embeddings}")
        positions = torch.arange(S, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = layer_norm(self.LayerNorm, x, None, use_fused(self.config))
        return dropout(self.dropout, x, own_masks(self.config))  # (B, S, H)


class Packed:
    """A padded batch's real tokens, packed: ``index`` (T,) into the flattened (B * S) positions,
    ``cu_seqlens`` (B + 1,) the offsets of each sequence's tokens (FlashAttention's varlen layout).

    With ``attn_implementation="unpadded"`` the encoder runs on (T, H): the projections, the FFN,
    LayerNorm, GELU and dropout do no work for padding. Attention runs FlashAttention's
    variable-length kernel on the packed tokens where it can (``varlen_ok``: a GPU, fp16/bf16);
    elsewhere it scatters Q, K and V back to (B, nh, S, hs) and runs SDPA with the key mask (the
    real positions' results equal the padded model's), its padded work the one part left.
    """

    def __init__(self, attention_mask: torch.Tensor):
        self.shape = tuple(attention_mask.shape)  # (B, S)
        mask = attention_mask.bool()
        self.key_mask = mask
        self.index = mask.flatten().nonzero().squeeze(1)
        lengths = mask.sum(1)
        self.cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        self.max_seqlen = int(lengths.max()) if mask.is_cuda else 0  # FlashAttention's varlen kernel needs it

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (T, ...)"""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (B, S, ...), zeros at the padding."""
        B, S = self.shape
        out = x.new_zeros((B * S, *x.shape[1:]))
        return out.index_copy(0, self.index, x).view(B, S, *x.shape[1:])


# Fine-tuning trains with cuDNN's attention where its steps are long and many: heads at least this wide,
# the run's median step padded to at least this many tokens, and at least this many steps (see
# cudnn_training_attention).
CUDNN_TRAINING_MIN_HEAD_DIM = 64
CUDNN_TRAINING_MIN_LENGTH = 256
CUDNN_TRAINING_MIN_STEPS = 1000


def cudnn_training_attention(head_dim: int, median_step_length: int, steps: int) -> bool:
    """Whether fine-tuning's training steps keep SDPA's cuDNN backend (else ``varied_shapes``).

    With padding masks and dropout, SDPA without cuDNN runs the memory-efficient kernel, built for
    Ampere. Measured on an H200 (bf16, batch 32, forward and backward, benchmarks/bench_attention_plans.py):
    at 64-wide heads cuDNN took 0.55-0.65 ms against 0.68-1.14 at 256-384 tokens and was slower below
    about 200; at MiniLM's 32-wide heads it was no faster at 128 and slower below. Its costs: 2-4 s at
    the process's first call and about 0.14 s for every new shape (a plan). BERT-Base on the SQuAD
    split's 384-token windows: the step 21.6 ms against 27.6, whole 3-epoch runs 1,179-1,194 against
    1,054-1,064 examples/s; MiniLM's runs were slower with it (SST-2 10,189-11,673 against
    13,004-13,078), so it is kept for long steps of wide heads only. Its start-up is paid in every
    process (2.0 s again in a second process on the same machine), so a run needs enough steps to win
    it back: BERT-Base saves about 6 ms a step at 384 tokens, so 1,000 steps about 6 s, against 2-4 s
    and the plans; on the SQuAD split's 483 steps the whole run gained 1-4 s with the start-up warm
    and lost it on a fresh machine (8.0 s of captures against about 1).
    """
    return (head_dim >= CUDNN_TRAINING_MIN_HEAD_DIM and median_step_length >= CUDNN_TRAINING_MIN_LENGTH
            and steps >= CUDNN_TRAINING_MIN_STEPS)


@contextlib.contextmanager
def varied_shapes():
    """SDPA without its cuDNN backend while batches come in many shapes (evaluation, embedding, and
    fine-tuning's short steps: ``cudnn_training_attention``).

    cuDNN's attention builds an execution plan for every new shape. Measured on an H100 (MiniLM, an
    RTE-size task, CUDA graphs, 9 batch shapes): warming up and capturing took 4.1 s with cuDNN and
    1.2 s without, and the 234 steps themselves took 0.75 s either way. PyTorch's other fused
    kernels (FlashAttention, memory-efficient) need no plan.
    """
    if not torch.cuda.is_available():
        yield
        return
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def varlen_ok(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether FlashAttention's variable-length kernel takes these packed projections: an Ampere or
    newer GPU, fp16 or bf16, a head size it supports; otherwise attention scatters back to (B, S) and
    runs SDPA."""
    return (qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.cuda.get_device_capability(qkv.device) >= (8, 0))


class VarlenAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v over each sequence of a packed batch, with dropout on the
    probabilities: ``aten._flash_attention_forward``/``_backward`` on (T, heads, head_dim) with
    ``cu_seqlens`` (PyTorch's public ``varlen_attn`` has no dropout, which BERT trains with). The
    backward replays the forward's dropout from the philox state the forward returns."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, dropout_p: float, scale: float):
        out, lse, rng, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, False, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng, offset)
        ctx.meta = (max_seqlen, dropout_p, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_seqlens, rng, offset = ctx.saved_tensors
        max_seqlen, dropout_p, scale = ctx.meta
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
            False, rng, offset, scale=scale)
        return dq, dk, dv, None, None, None, None


PACK_BELOW = 0.9  # real share of the positions under which packing pays (a full CPU batch: 8% slower packed)


def worth_packing(key_mask: torch.Tensor) -> bool:
    """Whether a batch has enough padding for ``Packed`` to pay for its gathers (one host sync; packing
    needs one anyway for its data-dependent size)."""
    return int(key_mask.sum()) < PACK_BELOW * key_mask.numel()


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | Packed | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, S, H); key_mask (B, S) bool, True = a real token that may be attended to.
        Or x (T, H) and ``key_mask`` the batch's ``Packed`` layout.

        Returns the attention output and x, handed on as the sub-layer's residual (``InputProjection``).
        """
        # One (H -> 3H) matmul instead of three: the same weights (HF's query/key/value names),
        # concatenated per call; a wider GEMM keeps the GPU busier than three narrow ones.
        weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
        bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
        H = x.shape[-1]
        q, k, v, residual = input_projection(x, weight, bias, (H, H, H))  # column views of one (..., 3H)
        packed = key_mask if isinstance(key_mask, Packed) else None
        p = self.dropout_p if self.training else 0.0
        scale = 1.0 / math.sqrt(self.head_dim)
        if packed is not None and varlen_ok(q, self.head_dim):  # (T, H) each: attention without padding
            q, k, v = (t.view(-1, self.num_heads, self.head_dim).contiguous() for t in (q, k, v))  # (T, nh, hs)
            ctx = VarlenAttention.apply(q, k, v, packed.cu_seqlens, packed.max_seqlen, p, scale)
            return ctx.reshape(-1, H), residual
        if packed is not None:
            q, k, v, key_mask = packed.unpack(q), packed.unpack(k), packed.unpack(v), packed.key_mask
        B, S = q.shape[0], q.shape[1]
        # (B, nh, S, hs) views; the attention kernels return their gradients in (B, S, nh, hs) memory,
        # which InputProjection's backward reads as (B * S, H) rows without a copy.
        q, k, v = (t.view(B, S, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.config.attn_implementation in ("sdpa", "unpadded"):
            mask = None if key_mask is None else key_mask[:, None, None, :]  # broadcast over heads, queries
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
        else:
            scores = q @ k.transpose(-1, -2)  # (B, nh, S, S), unscaled: the softmax applies the scale
            if use_fused(self.config):
                probs = ops.softmax(scores, key_mask, scale)
            else:
                scores = scores * scale
                if key_mask is not None:
                    scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
                probs = torch.softmax(scores, dim=-1)
            probs = ops.dropout(probs, p, self.training) if own_masks(self.config) else F.dropout(probs, p, self.training)
            ctx = probs @ v  # (B, nh, S, hs)
        ctx = ctx.transpose(1, 2).reshape(B, S, H)
        return (ctx if packed is None else packed.pack(ctx)), residual


class ProjectAddNorm(nn.Module):
    """Post-LN sub-layer output (the original Transformer and BERT): LN(residual + Dropout(W h + b)).

    Two of these per layer: after attention (HF's ``BertSelfOutput``, in_features = H) and after
    the FFN (HF's ``BertOutput``, in_features = I).
    """

    def __init__(self, config: BertConfig, in_features: int):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return dense_dropout_add_norm(self.dense, self.dropout, self.LayerNorm, h, residual, use_fused(self.config),
                                      own_masks(self.config))


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = ProjectAddNorm(config, config.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(*self.self(x, key_mask))


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """act(x W^T + b) (B, S, I), and x, handed on as the FFN's residual (``InputProjection``)."""
        act, fused = self.config.hidden_act, use_fused(self.config)
        bias = None if fuses_bias(act, fused) else self.dense.bias
        h, residual = input_projection(x, self.dense.weight, bias, (self.dense.out_features,))
        return bias_act(self.dense, act, h, fused), residual


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = ProjectAddNorm(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, key_mask)
        return self.output(*self.intermediate(x))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, output_hidden_states: bool = False):
        states = [x] if output_hidden_states else None
        for layer in self.layer:
            x = layer(x, key_mask)
            if states is not None:
                states.append(x)
        return x, (tuple(states) if states is not None else None)


class BertPooler(nn.Module):
    """tanh(W h_[CLS] + b): the sentence representation the NSP and classification heads read (§3)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden[:, 0]))


class BertPreTrainedModel(nn.Module):
    """Weight initialisation shared by every model class (truncation-free normal, as HF and the reference)."""

    config: BertConfig
    # Parameter-name prefixes of this class's task head: may be initialised fresh when a checkpoint lacks them.
    head_prefixes: tuple[str, ...] = ()
    has_pooler: bool = True

    def init_weights(self) -> None:
        self.apply(self._init_module)
        if hasattr(self, "tie_weights"):
            self.tie_weights()

    def _init_module(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BertLMPredictionHead):
            nn.init.zeros_(module.bias)


class BertModel(BertPreTrainedModel):
    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.has_pooler = add_pooling_layer
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.init_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> BertOutput:
        """input_ids, token_type_ids, attention_mask: (B, S); attention_mask 1 = token, 0 = padding."""
        key_mask = None if attention_mask is None else attention_mask.bool()
        x = self.embeddings(input_ids, token_type_ids)
        if self.config.attn_implementation == "unpadded" and key_mask is not None and worth_packing(key_mask):
            packed = Packed(key_mask)
            x, states = self.encoder(packed.pack(x), packed, output_hidden_states)
            x = packed.unpack(x)
            states = None if states is None else tuple(packed.unpack(h) for h in states)
        else:
            x, states = self.encoder(x, key_mask, output_hidden_states)
        pooled = self.pooler(x) if self.pooler is not None else None
        return BertOutput(x, pooled, states)


# --------------------------------------------------------------------------- heads


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = use_fused(self.config)
        return layer_norm(self.LayerNorm, dense_act(self.dense, self.config.hidden_act, x, fused), None, fused)


class BertLMPredictionHead(nn.Module):
    """MLM head: transform, then a decoder tied to the word embeddings plus an output bias (§3.1)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _unpadded(self.padded(x), self.bias.shape[0])  # (..., V)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """The logits over V rounded up to ``VOCAB_ALIGN`` on CUDA, the extra columns -inf: (..., V')."""
        return vocab_projection(self.transform(x), self.decoder.weight, self.bias,
                                pad_to=VOCAB_ALIGN if x.is_cuda else 1)


#: On CUDA the V-way projection computes V rounded up to this many logits: its output rows then start on
#: 16-byte boundaries, which cuBLAS needs for its Hopper kernels (BERT's 30,522 is 2 past a multiple of 8).
VOCAB_ALIGN = 8


def vocab_projection(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, pad_to: int = 1) -> torch.Tensor:
    """h W^T + b over V rounded up to a multiple of ``pad_to``, (..., V'): the matmul runs on W padded
    with zero rows and b padded with -inf, so each extra column is -inf. A softmax over the padded row
    then gives the V real columns the same probabilities (exp(-inf) = 0), the same loss and argmax, and
    the extra columns a gradient of exactly 0; the loss's gradient is the padded matrix's, with no
    zero-filled copy made by slicing back (about 0.4 ms of a BERT-Base step at batch 256 on an H200). An H100 profile
    of that step found the unaligned V = 30,522 projections on cuBLAS's Ampere kernels for 16-bit
    inputs misaligned to 4 bytes, about 1 ms each of its three matmuls: hence the padding."""
    pad = -weight.shape[0] % pad_to
    if not pad:
        return F.linear(h, weight, bias)
    return F.linear(h, F.pad(weight, (0, 0, 0, pad)), F.pad(bias, (0, pad), value=float("-inf")))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertForPreTraining(BertPreTrainedModel):
    """Masked LM + next-sentence prediction (paper §3.1, Task #1 and Task #2)."""

    head_prefixes = ("cls.",)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.init_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
        masked_lm_labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> PreTrainingOutput:
        """masked_positions (B, P): where the MLM head runs (gathered before the V-way projection,
        so its cost is P rather than S per sequence); masked_lm_labels (B, P), or (B, S) without
        positions, with -100 in slots that carry no prediction; next_sentence_label (B,), 0 = IsNext."""
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states)
        padded, mlm_loss = _masked_lm(self.cls.predictions, out.last_hidden_state, masked_positions, masked_lm_labels)
        nsp_logits = self.cls.seq_relationship(out.pooler_output)
        nsp_loss = None
        loss = mlm_loss
        if next_sentence_label is not None:
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label)
            loss = nsp_loss if loss is None else loss + nsp_loss
        return PreTrainingOutput(loss, mlm_loss, nsp_loss, _unpadded(padded, self.config.vocab_size), nsp_logits,
                                 out.hidden_states, padded)


def _unpadded(logits: torch.Tensor, V: int) -> torch.Tensor:
    """The first V columns of vocabulary-padded logits (the tensor itself where there are no more)."""
    return logits if logits.shape[-1] == V else logits[..., :V]


def _masked_lm(head: BertLMPredictionHead, hidden: torch.Tensor, masked_positions: torch.Tensor | None,
               labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MLM logits at ``masked_positions`` (gathered before the V-way projection, so its cost is P rather
    than S per sequence), (B, P, V'), else (B, S, V'), over V' >= V columns (``head.padded``, the extra
    ones -inf); and the mean cross-entropy when ``labels`` is given."""
    if masked_positions is not None:
        index = masked_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        hidden = hidden.gather(1, index)  # (B, P, H)
    logits = head.padded(hidden)
    loss = None
    if labels is not None:
        flat = labels.flatten()
        loss = _mean_over_labelled(masked_lm_cross_entropy(head.transform.config, logits.flatten(0, 1), flat)[0], flat)
    return logits, loss


def masked_lm_cross_entropy(config: BertConfig, logits: torch.Tensor,
                            labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy (float32, 0 where the label is -100) and argmax of MLM logits (N, V) against
    labels (N,): the compiled op, which reads the logits in their own dtype, where the config uses the
    fused kernels; else ``F.cross_entropy`` on an fp32 copy."""
    if use_fused(config):
        return ops.cross_entropy(logits, labels, IGNORE_INDEX)
    return ops.reference.cross_entropy(logits, labels, IGNORE_INDEX)


def _mean_over_labelled(loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean of per-row losses over the rows whose label is not -100 (NaN when there are none, as
    ``F.cross_entropy``'s mean)."""
    return loss.sum() / (labels != IGNORE_INDEX).sum()


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)


class BertForMaskedLM(BertPreTrainedModel):
    """Masked LM alone: the paper's "No NSP" ablation (§5.1), RoBERTa's objective.

    No pooler and no NSP head (nothing would train them), so a checkpoint holds exactly what
    ``transformers.BertForMaskedLM`` has. The output is a ``PreTrainingOutput`` without the
    NSP fields, so pretraining code reads both classes alike.
    """

    head_prefixes = ("cls.predictions.",)
    has_pooler = False

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.init_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
        masked_lm_labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> PreTrainingOutput:
        """As ``BertForPreTraining.forward`` without next-sentence prediction."""
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states)
        padded, mlm_loss = _masked_lm(self.cls.predictions, out.last_hidden_state, masked_positions, masked_lm_labels)
        return PreTrainingOutput(mlm_loss, mlm_loss, None, _unpadded(padded, self.config.vocab_size), None,
                                 out.hidden_states, padded)


def _classifier_dropout(config: BertConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


class BertForSequenceClassification(BertPreTrainedModel):
    """[CLS] pooled output -> labels (GLUE, §4.1); regression (MSE) with one label or problem_type='regression'."""

    head_prefixes = ("classifier.",)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    @property
    def is_regression(self) -> bool:
        return self.config.problem_type == "regression" or self.config.num_labels == 1

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None, output_hidden_states=False):
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states)
        logits = self.classifier(dropout(self.dropout, out.pooler_output, own_masks(self.config)))  # (B, num_labels)
        loss = None
        if labels is not None:
            if self.is_regression:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels)
        return TaskOutput(loss, logits, out.hidden_states)


class BertForTokenClassification(BertPreTrainedModel):
    """Per-token labels (NER, §4.3 of the paper's CoNLL experiment); -100 labels are ignored."""

    head_prefixes = ("classifier.",)
    has_pooler = False

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None, output_hidden_states=False):
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states)
        logits = self.classifier(dropout(self.dropout, out.last_hidden_state, own_masks(self.config)))  # (B, S, labels)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        return TaskOutput(loss, logits, out.hidden_states)


PAD_LOGIT = -1e4  # a span logit at padding: exp() underflows to 0 in the softmax, yet finite in saved logits


class BertForQuestionAnswering(BertPreTrainedModel):
    """Span QA (SQuAD, §4.2): a start vector S and end vector E dotted with every token."""

    head_prefixes = ("qa_outputs.",)
    has_pooler = False

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(
        self, input_ids, token_type_ids=None, attention_mask=None, start_positions=None, end_positions=None,
        output_hidden_states=False,
    ) -> QAOutput:
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states)
        start, end = self.qa_outputs(out.last_hidden_state).float().unbind(-1)  # (B, S) each
        if attention_mask is not None:
            # Padding is never an answer: out of the softmax over positions. Without this the loss would
            # depend on what the encoder leaves at the padding (the padded encoder computes states there,
            # the unpadded one zeros), so the two layouts would train different models.
            pad = attention_mask == 0
            start, end = start.masked_fill(pad, PAD_LOGIT), end.masked_fill(pad, PAD_LOGIT)
        loss = None
        if start_positions is not None and end_positions is not None:
            # Positions outside the window are clamped to S and ignored, as in the reference.
            S = start.shape[1]
            loss = (
                F.cross_entropy(start, start_positions.clamp(0, S), ignore_index=S)
                + F.cross_entropy(end, end_positions.clamp(0, S), ignore_index=S)
            ) / 2
        return QAOutput(loss, start.contiguous(), end.contiguous(), out.hidden_states)


class BertForMultipleChoice(BertPreTrainedModel):
    """SWAG (§4.4): one [CLS] score per (context, ending) pair, softmax across the C choices."""

    head_prefixes = ("classifier.",)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.init_weights()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None, output_hidden_states=False):
        """input_ids etc. (B, C, S); labels (B,) index of the right choice."""
        B, C, S = input_ids.shape
        flat = lambda t: None if t is None else t.reshape(B * C, S)  # noqa: E731
        out = self.bert(flat(input_ids), flat(token_type_ids), flat(attention_mask), output_hidden_states)
        logits = self.classifier(dropout(self.dropout, out.pooler_output, own_masks(self.config))).view(B, C)
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return TaskOutput(loss, logits, out.hidden_states)


MODEL_CLASSES = {
    cls.__name__: cls
    for cls in (
        BertModel,
        BertForPreTraining,
        BertForMaskedLM,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertForQuestionAnswering,
        BertForMultipleChoice,
    )
}
