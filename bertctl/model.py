"""BERT (Devlin et al., 2018): embeddings, post-LN encoder, pooler and heads.

Module and parameter names are Hugging Face's (``bert.encoder.layer.N.attention.self.query``,
``attention.output.LayerNorm``, ``intermediate.dense``, ``output.dense``,
``cls.predictions.transform``, ``cls.seq_relationship``, ...), so a state dict moves
between bertctl and ``transformers`` unchanged.

The machinery the classes call lives beside them in ``bertctl.nn``: the attention implementations
(``nn.attention``), packing (``nn.packing``), the projections' autograd nodes (``nn.projections``) and
the fused-op dispatch (``nn.fused``). A model runs by its ``bertctl.runtime.Runtime`` (``set_runtime``),
which makes three choices over the same weights:
- ``attn``: ``sdpa`` (torch's scaled_dot_product_attention), ``explicit``
  (materialised scores, the path the fused softmax serves) or ``unpadded`` (the encoder runs on
  the batch's real tokens only, (T, H) with T = the sum of the lengths; see ``Packed``);
- ``fused``: bertctl's softmax / LayerNorm+residual / bias+GELU /
  bias+dropout+residual+LayerNorm ops, and on the CPU its dropout, or plain PyTorch;
- ``own_masks``: with fused kernels, whether training draws bertctl's own dropout masks or torch's
  (fine-tuning's).

Shapes: B batch, S sequence, H hidden, nh heads, hs head size, I intermediate, V vocab, T packed tokens,
P masked positions per sequence, C choices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bertctl import ops
from bertctl.config import IGNORE_INDEX, BertConfig
from bertctl.nn.attention import attention
from bertctl.nn.fused import bias_act, dense_act, dense_dropout_add_norm, dropout, fuses_bias, layer_norm
from bertctl.nn.packing import Packed, worth_packing
from bertctl.nn.projections import VOCAB_ALIGN, input_projection, vocab_projection
from bertctl.runtime import Runtime, default as default_runtime


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


class RuntimeModule(nn.Module):
    """A module whose forward reads the model's runtime; ``BertPreTrainedModel.set_runtime`` sets it on all."""

    runtime: Runtime


class BertEmbeddings(RuntimeModule):
    """Token + segment + position embeddings, then LayerNorm and dropout (paper §3, Figure 2)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                packed: Packed | None = None) -> torch.Tensor:
        """input_ids, token_type_ids (B, S) -> (B, S, H); with ``packed``, the real tokens' rows, (T, H)."""
        S = input_ids.shape[1]
        if S > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {S} exceeds max_position_embeddings {self.config.max_position_embeddings}")
        if packed is None:
            positions = torch.arange(S, device=input_ids.device)  # (S,), broadcast over the batch
        else:  # each sequence's positions restart at 0
            input_ids, positions = packed.pack(input_ids), packed.positions  # (T,) each
            token_type_ids = None if token_type_ids is None else packed.pack(token_type_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = layer_norm(self.LayerNorm, x, None, self.runtime.fused)
        return dropout(self.dropout, x, self.runtime.own_masks)  # (B, S, H), or (T, H) packed


class BertSelfAttention(RuntimeModule):
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
        p = self.dropout_p if self.training else 0.0
        return attention(self.runtime, self.num_heads, q, k, v, key_mask, p), residual  # (B, S, H), or (T, H) packed


class ProjectAddNorm(RuntimeModule):
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
        return dense_dropout_add_norm(self.dense, self.dropout, self.LayerNorm, h, residual, self.runtime.fused,
                                      self.runtime.own_masks)


class BertAttention(nn.Module):
    """The attention sub-layer: LN(x + Dropout(W_o MultiHead(x) + b_o))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = ProjectAddNorm(config, config.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(*self.self(x, key_mask))


class BertIntermediate(RuntimeModule):
    """The feed-forward network's first half, act(x W_1^T + b_1); the layer's ``output`` is its second."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """act(x W^T + b) (B, S, I), and x, handed on as the FFN's residual (``InputProjection``)."""
        act, fused = self.config.hidden_act, self.runtime.fused
        bias = None if fuses_bias(act, fused) else self.dense.bias
        h, residual = input_projection(x, self.dense.weight, bias, (self.dense.out_features,))
        return bias_act(self.dense, act, h, fused), residual


class BertLayer(nn.Module):
    """One post-LN Transformer layer (paper §3): x = LN(x + Attention(x)), then x = LN(x + FFN(x))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = ProjectAddNorm(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, key_mask)  # (B, S, H), or (T, H) packed
        return self.output(*self.intermediate(x))  # the FFN's output projection and residual LayerNorm


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
        return self.activation(self.dense(hidden[:, 0]))  # (B, H), from the [CLS] token's state


class BertPreTrainedModel(RuntimeModule):
    """Weight initialisation shared by every model class (truncation-free normal, as HF and the reference)."""

    config: BertConfig
    # Parameter-name prefixes of this class's task head: may be initialised fresh when a checkpoint lacks them.
    head_prefixes: tuple[str, ...] = ()
    has_pooler: bool = True

    def set_runtime(self, runtime: Runtime | None = None) -> None:
        """Run by ``runtime`` from now on (None: ``bertctl.runtime.default``), over the same weights."""
        runtime = runtime or default_runtime()
        for module in self.modules():
            if isinstance(module, RuntimeModule):
                module.runtime = runtime

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
    def __init__(self, config: BertConfig, runtime: Runtime | None = None, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.has_pooler = add_pooling_layer
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.init_weights()
        self.set_runtime(runtime)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        packing: torch.Tensor | None = None,
    ) -> BertOutput:
        """input_ids, token_type_ids, attention_mask: (B, S); attention_mask 1 = token, 0 = padding.

        ``packing``: the loader's packed layout of the batch (``bertctl.nn.packing.layout``; empty: run it
        padded). Without one, a model whose runtime attention is ``unpadded`` packs the batch itself."""
        key_mask = None if attention_mask is None else attention_mask.bool()
        packed = None
        if packing is not None and packing.numel():
            packed = Packed.from_layout(packing, key_mask)
        elif packing is None and self.runtime.attn == "unpadded" and key_mask is not None and worth_packing(key_mask):
            packed = Packed.from_mask(key_mask)
        x = self.embeddings(input_ids, token_type_ids, packed)
        if packed is None:
            x, states = self.encoder(x, key_mask, output_hidden_states)
        else:
            x, states = self.encoder(x, packed, output_hidden_states)
            x = packed.unpack(x)
            states = None if states is None else tuple(packed.unpack(h) for h in states)
        pooled = self.pooler(x) if self.pooler is not None else None
        return BertOutput(x, pooled, states)


# --------------------------------------------------------------------------- heads


class BertPredictionHeadTransform(RuntimeModule):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.runtime.fused
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


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertForPreTraining(BertPreTrainedModel):
    """Masked LM + next-sentence prediction (paper §3.1, Task #1 and Task #2)."""

    head_prefixes = ("cls.",)

    def __init__(self, config: BertConfig, runtime: Runtime | None = None):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, runtime)
        self.cls = BertPreTrainingHeads(config)
        self.init_weights()
        self.set_runtime(runtime)

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
        packing: torch.Tensor | None = None,
    ) -> PreTrainingOutput:
        """masked_positions (B, P): where the MLM head runs (gathered before the V-way projection,
        so its cost is P rather than S per sequence); masked_lm_labels (B, P), or (B, S) without
        positions, with -100 in slots that carry no prediction; next_sentence_label (B,), 0 = IsNext."""
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states, packing)
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
        loss = masked_lm_cross_entropy(head.transform.runtime.fused, logits.flatten(0, 1), flat)[0]
        loss = _mean_over_labelled(loss, flat)
    return logits, loss


def masked_lm_cross_entropy(fused: bool, logits: torch.Tensor,
                            labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy (float32, 0 where the label is -100) and argmax of MLM logits (N, V) against
    labels (N,): the compiled op, which reads the logits in their own dtype, with the ``fused`` kernels;
    else ``F.cross_entropy`` on an fp32 copy."""
    if fused:
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

    def __init__(self, config: BertConfig, runtime: Runtime | None = None):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, runtime, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.init_weights()
        self.set_runtime(runtime)

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
        packing: torch.Tensor | None = None,
    ) -> PreTrainingOutput:
        """As ``BertForPreTraining.forward`` without next-sentence prediction."""
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states, packing)
        padded, mlm_loss = _masked_lm(self.cls.predictions, out.last_hidden_state, masked_positions, masked_lm_labels)
        return PreTrainingOutput(mlm_loss, mlm_loss, None, _unpadded(padded, self.config.vocab_size), None,
                                 out.hidden_states, padded)


def _classifier_dropout(config: BertConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


class BertForSequenceClassification(BertPreTrainedModel):
    """[CLS] pooled output -> labels (GLUE, §4.1); regression (MSE) with one label or problem_type='regression'."""

    head_prefixes = ("classifier.",)

    def __init__(self, config: BertConfig, runtime: Runtime | None = None):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, runtime)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()
        self.set_runtime(runtime)

    @property
    def is_regression(self) -> bool:
        return self.config.problem_type == "regression" or self.config.num_labels == 1

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None, output_hidden_states=False,
                packing=None):
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states, packing)
        logits = self.classifier(dropout(self.dropout, out.pooler_output, self.runtime.own_masks))  # (B, num_labels)
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

    def __init__(self, config: BertConfig, runtime: Runtime | None = None):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, runtime, add_pooling_layer=False)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()
        self.set_runtime(runtime)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None, output_hidden_states=False,
                packing=None):
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states, packing)
        logits = self.classifier(dropout(self.dropout, out.last_hidden_state, self.runtime.own_masks))  # (B, S, labels)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        return TaskOutput(loss, logits, out.hidden_states)


PAD_LOGIT = -1e4  # a span logit at padding: exp() underflows to 0 in the softmax, yet finite in saved logits


class BertForQuestionAnswering(BertPreTrainedModel):
    """Span QA (SQuAD, §4.2): a start vector S and end vector E dotted with every token."""

    head_prefixes = ("qa_outputs.",)
    has_pooler = False

    def __init__(self, config: BertConfig, runtime: Runtime | None = None):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, runtime, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights()
        self.set_runtime(runtime)

    def forward(
        self, input_ids, token_type_ids=None, attention_mask=None, start_positions=None, end_positions=None,
        output_hidden_states=False, packing=None,
    ) -> QAOutput:
        out = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states, packing)
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

    def __init__(self, config: BertConfig, runtime: Runtime | None = None):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, runtime)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.init_weights()
        self.set_runtime(runtime)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None, output_hidden_states=False,
                packing=None):
        """input_ids etc. (B, C, S); labels (B,) index of the right choice."""
        B, C, S = input_ids.shape
        flat = lambda t: None if t is None else t.reshape(B * C, S)  # noqa: E731
        out = self.bert(flat(input_ids), flat(token_type_ids), flat(attention_mask), output_hidden_states, packing)
        logits = self.classifier(dropout(self.dropout, out.pooler_output, self.runtime.own_masks)).view(B, C)
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
