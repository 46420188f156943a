"""hf-bert-impl: a from-scratch BERT encoder that implements the documented formulas.

References
    [1] Vaswani et al., "Attention Is All You Need" (2017): scaled dot-product attention,
        multi-head attention, sinusoidal positional encoding.
    [2] Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers" (2019): the post-LN
        encoder, the [CLS] pooler, the masked-LM and next-sentence objectives.
    [3] The seed article (shared/seeds/000_93a17e394f50fe2b.txt) and its `MultiHeadAttention`.
    [4] transformers' `modeling_bert.py` (v5), the numerical oracle, and ModernBERT's naming.

How this file differs from transformers' BERT
    1. Positions default to the fixed sinusoidal encoding of [1] ("sinusoidal", not stored in
       checkpoints, any length); "learned" gives Google's trained table and transformers' numbers.
    2. Q, K and V come from one fused projection `Wqkv` (= [W^Q; W^K; W^V] stacked), one matmul
       instead of three; the conversion splits and joins it.
    3. The masked-LM loss is a sum divided by `num_items_in_batch` when Trainer passes it, so
       gradient accumulation gives the same update as one large batch.
    4. `output_attentions=True` returns real probabilities under every backend (that call runs the
       eager function); a fully padded row gives finite outputs.
    5. Bad inputs (ids out of range, wrong mask shape, too-long sequences with learned positions)
       raise a `ValueError` naming the value instead of an `IndexError` deep inside torch.

Shape legend: b batch, s sequence, h heads, d head dim (d_k), H hidden (= h * d), I intermediate,
V vocabulary, c choices.

This file travels to the Hub: it imports only torch, transformers and `.configuration_bert_impl`.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    NextSentencePredictorOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput

from .configuration_bert_impl import BertImplConfig

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------
# The formulas


def sinusoidal_position_encoding(num_positions: int, dim: int) -> torch.Tensor:
    """Sinusoidal positional encoding of [1]:

        PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
        PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

    Interleaved: even columns hold the sines, odd columns the cosines of the same frequency. With an
    odd `dim` the last column is a sine (its cosine partner would be column `dim`). Computed in
    float64, returned as float32 of shape (num_positions, dim).
    """
    if num_positions < 0 or dim <= 0:
        raise ValueError(f"sinusoidal_position_encoding needs num_positions >= 0 and dim > 0, got {num_positions}, {dim}")
    pos = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, dim, 2, dtype=torch.float64)  # (ceil(dim/2),) the even column indices 2i
    angle = pos / torch.pow(10000.0, two_i / dim)  # (P, ceil(dim/2))
    pe = torch.empty(num_positions, dim, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return pe.float()


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention of [1], written out: Attention(Q, K, V) = softmax(QKᵀ/√d_k + M) V.

    query, key, value: (b, h, s, d); attention_mask M: additive, broadcastable to (b, h, s, s), 0 where
    a key may be attended and the dtype's minimum where it is padding. `scaling` is 1/√d_k.
    Returns the output as (b, s, h, d) (the layout every transformers attention function returns)
    and the attention probabilities (b, h, s, s).
    """
    scores = torch.matmul(query, key.transpose(-2, -1)) * scaling  # (b, h, s, s)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (b, h, s, s)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # (b, h, s, d)
    return out.transpose(1, 2).contiguous(), probs  # (b, s, h, d)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """The masked-LM loss of [2]: L = -Σ_i log P(x_i | x_\\i) over the positions whose label is not -100.

    Divided by the number of such positions in this batch, or by `num_items_in_batch` when the caller
    (Trainer) passes the count over all accumulated micro-batches, so that 4 accumulated batches of 2
    give exactly the update of one batch of 8. A batch with no masked position gives 0, not NaN.
    logits: (..., V) and labels: (...) with the same leading shape.
    """
    nll_sum = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    if num_items_in_batch is None:
        num_items_in_batch = labels.ne(IGNORE_INDEX).sum().clamp(min=1)
    elif torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(nll_sum.device)
    return nll_sum / num_items_in_batch


# ----------------------------------------------------------------------------------------------
# The encoder


class BertImplEmbeddings(nn.Module):
    """word + position + token type embeddings, then LayerNorm and dropout (as BERT)."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            # Fixed by the formula, so not a weight: recomputed at load, never in a checkpoint.
            pe = sinusoidal_position_encoding(config.max_position_embeddings, config.hidden_size)
            self.register_buffer("position_encoding", pe, persistent=False)  # (P, H)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def position_vectors(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(b, s) or (1, s) position ids -> (b|1, s, H) position vectors."""
        if self.config.position_embedding_type == "learned":
            return self.position_embeddings(position_ids)
        table = self.position_encoding
        needed = int(position_ids.max()) + 1 if not torch.compiler.is_compiling() else table.size(0)
        if needed > table.size(0):  # longer than the stored rows: the formula holds for any position
            table = sinusoidal_position_encoding(needed, self.config.hidden_size).to(table.device)
        return F.embedding(position_ids, table.to(self.word_embeddings.weight.dtype))

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (b, s, H)
        b, s = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(s, device=inputs_embeds.device).unsqueeze(0)  # (1, s)
        if token_type_ids is None:
            token_type_ids = torch.zeros((b, s), dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids) + self.position_vectors(position_ids)
        return self.dropout(self.LayerNorm(embeddings))  # (b, s, H)


class BertImplSelfAttention(nn.Module):
    """Multi-head attention of [1] with BERT's output projection:

        MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

    `Wqkv` holds [W^Q; W^K; W^V] stacked along the output dimension (one matmul for all three);
    head i uses columns i*d:(i+1)*d of each. `Wo` is W^O. The attention function is chosen once per
    call through transformers' attention interface (`config._attn_implementation`).
    """

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5  # 1/√d_k
        self.is_causal = False  # read by the sdpa / flash integrations: BERT attends both ways
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_dropout = config.attention_probs_dropout_prob

    def forward(self, hidden_states, attention_mask=None, output_attentions=False, **kwargs):
        b, s, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(b, s, 3, self.num_heads, self.head_dim)  # (b, s, 3, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (b, h, s, d)
        if output_attentions:
            attention_fn = eager_attention_forward  # the only backend that materialises probabilities
        else:
            attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, probs = attention_fn(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
            **kwargs,
        )  # out: (b, s, h, d)
        return self.Wo(out.reshape(b, s, -1)), probs  # (b, s, H)


class BertImplMLP(nn.Module):
    """Position-wise feed-forward block: Wo(act(Wi x))."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.act(self.Wi(hidden_states)))


class BertImplLayer(GradientCheckpointingLayer):
    """Post-LN encoder layer of [2]: x = LN(x + Drop(MHA(x))); x = LN(x + Drop(MLP(x)))."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.attn = BertImplSelfAttention(config)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = BertImplMLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False, **kwargs):
        attn_out, probs = self.attn(hidden_states, attention_mask, output_attentions=output_attentions, **kwargs)
        hidden_states = self.attn_norm(hidden_states + self.dropout(attn_out))
        hidden_states = self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))
        return hidden_states, probs  # (b, s, H), (b, h, s, s) or None


class BertImplPooler(nn.Module):
    """tanh(W h_[CLS] + b): the sentence vector of [2], from the first token."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden_states[:, 0]))  # (b, H)


class BertImplLMHead(nn.Module):
    """MLM prediction head of [2]: LN(act(dense(x))) then a decoder tied to the word embeddings."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)  # weight tied to word_embeddings

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(hidden_states))))  # (..., V)


# ----------------------------------------------------------------------------------------------
# The Hugging Face machinery


class BertImplPreTrainedModel(PreTrainedModel):
    config_class = BertImplConfig
    config: BertImplConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BertImplEmbeddings", "BertImplLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # Heads whose loss is a mean over examples let Trainer divide by the accumulation steps;
    # the masked-LM heads override this to take `num_items_in_batch` instead.
    accepts_loss_kwargs = False

    def _init_weights(self, module):
        """normal(0, initializer_range) weights, zero biases, LayerNorm (1, 0); the sinusoidal table
        recomputed. The `init` functions skip tensors loaded from a checkpoint."""
        super()._init_weights(module)
        if isinstance(module, BertImplEmbeddings) and hasattr(module, "position_encoding"):
            pe = sinusoidal_position_encoding(module.position_encoding.size(0), module.position_encoding.size(1))
            init.copy_(module.position_encoding, pe)

    def _check_model_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds):
        """Turn inputs that torch would reject with an opaque IndexError into a ValueError that
        names the value. Skipped while compiling (data-dependent checks would break the graph)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
        if len(shape) != 2:
            raise ValueError(f"input_ids must have shape (batch, sequence), got {shape}")
        if torch.compiler.is_compiling():
            return
        config = self.config
        for name, ids, limit, field in (
            ("input_ids", input_ids, config.vocab_size, "vocab_size"),
            ("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size"),
        ):
            if ids is None or ids.numel() == 0:
                continue
            if tuple(ids.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(ids.shape)} but the input has shape {shape}")
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                raise ValueError(
                    f"{name} contains {bad}, outside [0, {field}={limit}); check that the tokenizer "
                    f"matches this model (config.{field} = {limit})"
                )
        if attention_mask is not None and tuple(attention_mask.shape) != shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the input has shape {shape}; "
                "pass a (batch, sequence) mask of 1 for tokens and 0 for padding"
            )
        if config.position_embedding_type == "learned":
            longest = int(position_ids.max()) + 1 if position_ids is not None else shape[1]
            if longest > config.max_position_embeddings:
                raise ValueError(
                    f"sequence needs position {longest - 1} but learned positions stop at "
                    f"max_position_embeddings - 1 = {config.max_position_embeddings - 1}; truncate the input "
                    "(tokenizer(..., truncation=True)) or use position_embedding_type='sinusoidal'"
                )


@dataclass
class BertImplForPreTrainingOutput(ModelOutput):
    """Output of [`BertImplForPreTraining`] (the fields of transformers' `BertForPreTrainingOutput`)."""

    loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None
    seq_relationship_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


def _additive_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(b, s) 1/0 mask -> (b, 1, 1, s) additive mask: 0 to attend, the dtype's minimum for padding.
    The minimum (not -inf) keeps a fully padded row finite: its softmax is uniform, not NaN."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class BertImplModel(BertImplPreTrainedModel):
    """The bare encoder: embeddings, `num_hidden_layers` post-LN layers, optional tanh pooler."""

    def __init__(self, config: BertImplConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertImplEmbeddings(config)
        self.layers = nn.ModuleList([BertImplLayer(config) for _ in range(config.num_hidden_layers)])
        self.pooler = BertImplPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def _attention_mask(self, attention_mask, embeddings, output_attentions):
        """Built once per forward in the format the chosen backend wants."""
        if attention_mask is None or (not torch.compiler.is_compiling() and bool(attention_mask.all())):
            return None  # nothing to mask: lets SDPA / flash take their fastest path
        if output_attentions or self.config._attn_implementation in ("eager", "sdpa"):
            return _additive_padding_mask(attention_mask, embeddings.dtype)
        # flash_attention_2 takes the 2-D mask (and unpads), flex_attention a BlockMask.
        return create_bidirectional_mask(config=self.config, inputs_embeds=embeddings, attention_mask=attention_mask)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling | tuple:
        """input_ids, attention_mask, token_type_ids, position_ids: (b, s); inputs_embeds: (b, s, H).
        Returns last_hidden_state (b, s, H), pooler_output (b, H) and, when asked, hidden_states
        (num_layers + 1) x (b, s, H) and attentions num_layers x (b, h, s, s)."""
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        self._check_model_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)

        hidden_states = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # (b, s, H)
        mask = self._attention_mask(attention_mask, hidden_states, output_attentions)
        all_hidden = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            hidden_states, probs = layer(hidden_states, mask, output_attentions=output_attentions, **kwargs)
            if output_hidden_states:
                all_hidden += (hidden_states,)
            if output_attentions:
                all_attentions += (probs,)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None
        out = BaseModelOutputWithPooling(
            last_hidden_state=hidden_states,
            pooler_output=pooled,
            hidden_states=all_hidden,
            attentions=all_attentions,
        )
        return out if return_dict else out.to_tuple()


def _head_output(self, output_cls, return_dict, **fields):
    """Build a head's ModelOutput, or its tuple when return_dict=False (transformers' convention)."""
    out = output_cls(**fields)
    return_dict = self.config.return_dict if return_dict is None else return_dict
    return out if return_dict else out.to_tuple()


class BertImplForMaskedLM(BertImplPreTrainedModel):
    """Encoder + MLM head; the decoder weight is tied to the word embeddings."""

    _tied_weights_keys = {"lm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}
    accepts_loss_kwargs = True  # takes num_items_in_batch (see `masked_lm_loss`)

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config, add_pooling_layer=False)
        self.lm_head = BertImplLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        num_items_in_batch=None,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        """labels: (b, s), a token id at masked positions and -100 elsewhere. logits: (b, s, V)."""
        outputs = self.bert(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )
        logits = self.lm_head(outputs.last_hidden_state)  # (b, s, V)
        loss = masked_lm_loss(logits, labels, num_items_in_batch) if labels is not None else None
        return _head_output(
            self, MaskedLMOutput, return_dict,
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


class BertImplForPreTraining(BertImplPreTrainedModel):
    """Encoder + MLM head + next-sentence head, BERT's pretraining objective: L = L_MLM + L_NSP."""

    _tied_weights_keys = {"lm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}
    accepts_loss_kwargs = True

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config)
        self.lm_head = BertImplLMHead(config)
        self.nsp_head = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        next_sentence_label=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        num_items_in_batch=None,
        **kwargs,
    ) -> BertImplForPreTrainingOutput | tuple:
        """labels: (b, s) MLM targets (-100 = not masked); next_sentence_label: (b,), 0 = B follows A.
        Loss when both are given: MLM (as `masked_lm_loss`) + NSP cross-entropy. Under gradient
        accumulation the NSP mean of each micro-batch is weighted by its share of the masked tokens."""
        outputs = self.bert(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )
        prediction_logits = self.lm_head(outputs.last_hidden_state)  # (b, s, V)
        nsp_logits = self.nsp_head(outputs.pooler_output)  # (b, 2)
        loss = None
        if labels is not None and next_sentence_label is not None:
            mlm = masked_lm_loss(prediction_logits, labels, num_items_in_batch)
            nsp = F.cross_entropy(nsp_logits.float(), next_sentence_label.view(-1))
            if num_items_in_batch is not None:
                nsp = nsp * labels.ne(IGNORE_INDEX).sum() / num_items_in_batch
            loss = mlm + nsp
        return _head_output(
            self, BertImplForPreTrainingOutput, return_dict,
            loss=loss, prediction_logits=prediction_logits, seq_relationship_logits=nsp_logits,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


class BertImplForNextSentencePrediction(BertImplPreTrainedModel):
    """Encoder + pooler + next-sentence head (2 classes: 0 = B follows A, 1 = B is random)."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config)
        self.nsp_head = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> NextSentencePredictorOutput | tuple:
        outputs = self.bert(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )
        logits = self.nsp_head(outputs.pooler_output)  # (b, 2)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return _head_output(
            self, NextSentencePredictorOutput, return_dict,
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


def _classifier_dropout(config: BertImplConfig) -> nn.Dropout:
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return nn.Dropout(p)


class BertImplForSequenceClassification(BertImplPreTrainedModel):
    """Encoder + pooler + linear classifier. The loss follows `config.problem_type` as transformers
    does: "regression" (MSE; the default when num_labels == 1), "single_label_classification"
    (cross-entropy; integer labels) or "multi_label_classification" (BCE with logits; float labels)."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertImplModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> SequenceClassifierOutput | tuple:
        outputs = self.bert(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output))  # (b, num_labels)
        loss = None
        if labels is not None:
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"
            if self.config.problem_type == "regression":
                target = labels.to(logits.dtype)
                loss = F.mse_loss(logits.squeeze(), target.squeeze()) if self.num_labels == 1 else F.mse_loss(logits, target)
            elif self.config.problem_type == "single_label_classification":
                loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        return _head_output(
            self, SequenceClassifierOutput, return_dict,
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


class BertImplForTokenClassification(BertImplPreTrainedModel):
    """Encoder + per-token linear classifier (NER, POS); labels -100 are ignored."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertImplModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        outputs = self.bert(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # (b, s, num_labels)
        loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1)) if labels is not None else None
        return _head_output(
            self, TokenClassifierOutput, return_dict,
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


class BertImplForQuestionAnswering(BertImplPreTrainedModel):
    """Encoder + span head: start and end logits per token (extractive QA, SQuAD-style)."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertImplModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        start_positions=None,
        end_positions=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        outputs = self.bert(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )
        logits = self.qa_outputs(outputs.last_hidden_state)  # (b, s, 2)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))  # 2 x (b, s)
        loss = None
        if start_positions is not None and end_positions is not None:
            # Positions outside the input (answer truncated away) are clamped to s and ignored.
            s = start_logits.size(1)
            start_positions = start_positions.view(-1).clamp(0, s)
            end_positions = end_positions.view(-1).clamp(0, s)
            loss = (
                F.cross_entropy(start_logits, start_positions, ignore_index=s)
                + F.cross_entropy(end_logits, end_positions, ignore_index=s)
            ) / 2
        return _head_output(
            self, QuestionAnsweringModelOutput, return_dict,
            loss=loss, start_logits=start_logits, end_logits=end_logits,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


class BertImplForMultipleChoice(BertImplPreTrainedModel):
    """Encoder + pooler + one score per choice; inputs are (b, c, s), logits (b, c)."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> MultipleChoiceModelOutput | tuple:
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]

        def flat(t):  # (b, c, s[, H]) -> (b*c, s[, H])
            return t.reshape(-1, *t.shape[2:]) if t is not None else None

        outputs = self.bert(
            flat(input_ids), flat(attention_mask), flat(token_type_ids), flat(position_ids), flat(inputs_embeds),
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output)).view(-1, num_choices)  # (b, c)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return _head_output(
            self, MultipleChoiceModelOutput, return_dict,
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )


__all__ = [
    "BertImplPreTrainedModel",
    "BertImplModel",
    "BertImplForMaskedLM",
    "BertImplForPreTraining",
    "BertImplForNextSentencePrediction",
    "BertImplForSequenceClassification",
    "BertImplForTokenClassification",
    "BertImplForQuestionAnswering",
    "BertImplForMultipleChoice",
    "BertImplForPreTrainingOutput",
    "sinusoidal_position_encoding",
    "eager_attention_forward",
    "masked_lm_loss",
]
