"""hf-bert-impl: a from-scratch BERT encoder and its eight task heads, as a transformers model.

References: [1] Vaswani et al., "Attention Is All You Need" (2017), arXiv:1706.03762 (attention, multi-head attention,
sinusoidal positions, the √d_model embedding scale); [2] Devlin et al., "BERT: Pre-training of Deep Bidirectional
Transformers for Language Understanding" (2019), arXiv:1810.04805 (post-LN encoder, pooler, MLM and NSP);
[3] transformers' models/bert/modeling_bert.py (the numerical reference) and models/modernbert/modular_modernbert.py.

How it differs from transformers' BERT:
  1. Positions default to the sinusoidal encoding of [1] (not stored, any length), added to word embeddings scaled by
     √d_model as in [1] (`config.scale_word_embeddings`); "learned" = BERT's table, unscaled.
  2. Q, K and V come from one fused projection `Wqkv` = [W^Q; W^K; W^V].
  3. The MLM loss divides by `num_items_in_batch` when Trainer passes it (accumulation = one large batch).
  4. `output_attentions=True` returns real probabilities under every backend (that call runs eager).
  5. Bad inputs raise a ValueError naming the value (`BertImplConfig.check_inputs`), not an IndexError inside torch.
  6. Padding positions of the outputs hold zeros; a packed row (DataCollatorWithFlattening) attends within each sequence.
  7. `config.sparse_prediction` (training): the MLM head runs on the labelled positions only.
  8. `save_pretrained` is all or nothing; `from_pretrained` refuses pickled-only or corrupt files (checkpoint_bert_impl.py).
This file is the plain model, the reference. Four points call kernels_bert_impl.py (linear, dropout, layout, attention;
`config.kernels`); each answers with a faster kernel that agrees with the code here, or None.

Shape legend: b batch, s sequence, T real tokens, h heads, d head dim (d_k), H hidden (= h * d), V vocabulary, c choices.
"""

from typing import Unpack

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_bert_impl import BertImplConfig  # first: it refuses a too-old transformers with one clear error
from .checkpoint_bert_impl import CheckpointSafetyMixin
from .kernels_bert_impl import attention_kernel, dropout_kernel, linear_kernel, token_map_kernel  # the speed paths

from transformers import PreTrainedModel
from transformers import masking_utils
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (BaseModelOutputWithPooling, MaskedLMOutput, MultipleChoiceModelOutput,
    NextSentencePredictorOutput, QuestionAnsweringModelOutput, SequenceClassifierOutput, TokenClassifierOutput)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput
from transformers.utils import TransformersKwargs, can_return_tuple

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------
# transformers 4.57 / 5.x: one named shim per API that differs, each using the newer API where it exists.

try:  # 5.x: init functions that skip tensors loaded from a checkpoint
    from transformers import initialization as _hf_init
except ImportError:  # 4.57: _init_weights runs only on modules whose weights were not loaded
    _hf_init = None

try:  # 5.x (recent): output capture by hooks
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs as _record_outputs
except ImportError:  # 4.57 / 5.0: the same contract under its older name
    from transformers.utils.generic import OutputRecorder, check_model_inputs as _record_outputs


def _init_(method: str, tensor: torch.Tensor, *args, **kwargs) -> None:  # at init: transformers.initialization's if any
    with torch.no_grad():
        getattr(_hf_init if _hf_init is not None else torch.Tensor, method)(tensor, *args, **kwargs)


def _attention_function(impl: str | None):
    """The attention function registered for `impl`, eager_attention_forward for "eager" (5.x: AttentionInterface.get_interface)."""
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
    return eager_attention_forward if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]


def _bidirectional_mask(config, embeddings: torch.Tensor, attention_mask: torch.Tensor):
    """The padding mask in the format of flash / flex attention (masking_utils.create_bidirectional_mask,
    5.x). 4.57 lacks it: flash takes the 2-D mask itself, flex a BlockMask from the same mask functions."""
    if hasattr(masking_utils, "create_bidirectional_mask"):
        return masking_utils.create_bidirectional_mask(config=config, inputs_embeds=embeddings, attention_mask=attention_mask)
    if "flash" in config._attn_implementation:
        return attention_mask.bool()
    s = embeddings.size(1)
    return masking_utils.flex_attention_mask(
        batch_size=embeddings.size(0), cache_position=torch.arange(s, device=embeddings.device), kv_length=s,
        mask_function=lambda b, h, q, kv: torch.ones_like(q, dtype=torch.bool), attention_mask=attention_mask.bool())


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
    return _sinusoid(torch.arange(num_positions, dtype=torch.float64), dim)


def _sinusoid(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """The encoding's rows at positions `pos` (any shape, float) -> (*pos.shape, dim) float32, on pos's device."""
    pos = pos.to(torch.float32 if pos.device.type == "mps" else torch.float64)  # MPS has no float64
    two_i = torch.arange(0, dim, 2, dtype=pos.dtype, device=pos.device)  # (ceil(dim/2),) the even columns 2i
    angle = pos.unsqueeze(-1) / torch.pow(10000.0, two_i / dim)  # (..., ceil(dim/2))
    return torch.stack([angle.sin(), angle.cos()], -1).flatten(-2)[..., :dim].float()  # sin, cos interleaved


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Scaled dot-product attention of [1], written out: Attention(Q, K, V) = softmax(QKᵀ/√d_k + M) V.

    query, key, value: (b, h, s, d); attention_mask M: additive, broadcastable to (b, h, s, s), 0 where a key may be attended
    and the dtype's minimum where it is padding. `scaling` is 1/√d_k; in training the probabilities take dropout `dropout`.
    Returns the output as (b, s, h, d) (the layout of every transformers attention function) and the probabilities (b, h, s, s).
    """
    scores = torch.matmul(query, key.transpose(-2, -1)) * scaling  # (b, h, s, s)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (b, h, s, s)
    probs = _dropout(getattr(module, "config", None), probs, dropout, module.training)
    out = torch.matmul(probs, value)  # (b, h, s, d)
    return out.transpose(1, 2).contiguous(), probs  # (b, s, h, d)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """The masked-LM loss of [2]: L = -Σ_i log P(x_i | x_\\i) over the positions whose label is not -100.

    Divided by the number of such positions, or by `num_items_in_batch` when Trainer passes the count over all accumulated
    micro-batches (4 accumulated batches of 2 give exactly the update of one batch of 8); 0, not NaN, when none is masked.
    logits: (..., V), labels: (...). Half-precision per-token losses are summed in float32 (as transformers' BertForMaskedLM's)
    without a float32 copy of the (N, V) logits. On the CPU only labelled rows enter the cross-entropy (the rest add 0).
    """
    logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)  # (N, V), (N,)
    keep = labels.ne(IGNORE_INDEX).nonzero().squeeze(1) if labels.device.type == "cpu" and not torch.compiler.is_compiling() else None
    if keep is not None and keep.numel() < labels.numel():
        logits, labels = logits.index_select(0, keep), labels.index_select(0, keep)  # (n, V), (n,)
    if logits.dtype in (torch.bfloat16, torch.float16):
        nll_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none").float().sum()
    else:
        nll_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if num_items_in_batch is None:
        num_items_in_batch = labels.ne(IGNORE_INDEX).sum().clamp(min=1)
    elif torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(nll_sum.device)
    return nll_sum / num_items_in_batch


# ----------------------------------------------------------------------------------------------
# The encoder


def _dropout(config: BertImplConfig | None, x: torch.Tensor, p: float, training: bool) -> torch.Tensor:  # point "dropout"
    y = dropout_kernel(getattr(config, "kernels", "reference"), x, p, training)
    return F.dropout(x, p, training) if y is None else y


class BertImplDropout(nn.Dropout):
    """nn.Dropout (inverted dropout of [2]) through the kernel point "dropout"."""

    def __init__(self, config: BertImplConfig, p: float):
        super().__init__(p)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.config, x, self.p, self.training)


class BertImplLinear(nn.Linear):
    """nn.Linear and the activation after it, act(x Wᵀ + b), through the kernel point "linear" (oneDNN's GEMM, the
    activation inside it); `skip_zero_rows`: the MLM decoder, whose backward may skip positions without a label."""

    def __init__(self, config: BertImplConfig, in_features: int, out_features: int, skip_zero_rows: bool = False):
        super().__init__(in_features, out_features)
        self.config, self.skip_zero_rows = config, skip_zero_rows

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        y = linear_kernel(self.config.kernels, self, x, act, self.skip_zero_rows)  # None: the reference, nn.Linear's
        return y if y is not None else super().forward(x) if act is None else act(super().forward(x))


class BertImplEmbeddings(nn.Module):
    """word (× √d_model when `config.word_embedding_scale`) + position + token type embeddings, LayerNorm, dropout."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            pe = sinusoidal_position_encoding(config.max_position_embeddings, config.hidden_size)  # (P, H)
            self.register_buffer("position_encoding", pe, persistent=False)  # fixed by the formula: not a weight, not saved
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = BertImplDropout(config, config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None) -> torch.Tensor:
        """ids: (b, s), position_ids (b|1, s), inputs_embeds (b, s, H) -> (b, s, H)."""
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (b, s, H)
        if (scale := self.config.word_embedding_scale) != 1.0:  # √d_model of [1] §3.4
            inputs_embeds = inputs_embeds * scale
        s, dtype = inputs_embeds.size(1), self.word_embeddings.weight.dtype
        built = position_ids is None  # then the positions are 0 .. s-1, known without reading them
        if built:
            position_ids = torch.arange(s, device=inputs_embeds.device).unsqueeze(0)  # (1, s)
        if self.config.position_embedding_type == "learned":
            positions = self.position_embeddings(position_ids)  # (b|1, s, H)
        else:  # the stored rows when every position is known to be among them, else the formula at each position
            # (it holds past the rows; and on an accelerator reading the largest position would be a host sync)
            P = self.position_encoding.size(0)
            stored = s <= P if built else torch.compiler.is_compiling() or position_ids.device.type == "cpu" and (
                not position_ids.numel() or int(position_ids.max()) < P)
            positions = (F.embedding(position_ids, self.position_encoding.to(dtype)) if stored
                         else _sinusoid(position_ids, self.config.hidden_size).to(dtype))  # (b|1, s, H)
        types = self.token_type_embeddings.weight[0] if token_type_ids is None else self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(inputs_embeds + types + positions))  # (b, s, H); no token types: all type 0


def _attention_mask(config, attention_mask, position_ids, embeddings: torch.Tensor, eager: bool):
    """The mask in the backend's format, and extra attention kwargs, for the padded batch (b, s); None: nothing to mask.
    A packed row (b = 1, position ids restarting at 0, no attention_mask: DataCollatorWithFlattening) attends inside each
    sequence: flash finds them in position_ids, the others get a block-diagonal mask."""
    s, dtype, impl = embeddings.size(1), embeddings.dtype, config._attn_implementation
    if attention_mask is None and position_ids is not None and position_ids.size(0) == 1 and s > 1:
        if impl is not None and "flash" in impl and "paged" not in impl and not eager:  # flash: varlen
            return None, {"position_ids": position_ids}
        seq = position_ids.eq(0).cumsum(-1)  # (1, s): index of each token's sequence
        if not torch.compiler.is_compiling() and int(seq[0, -1]) - int(seq[0, 0]) == 0:
            return None, {}
        same = seq[:, :, None] == seq[:, None, :]  # (1, s, s)
        return (~same[:, None]).to(dtype) * torch.finfo(dtype).min, {}  # (1, 1, s, s)
    if attention_mask is None or (not torch.compiler.is_compiling() and bool(attention_mask.all())):
        return None, {}
    if eager or impl in ("eager", "sdpa"):
        return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min, {}  # (b, 1, 1, s)
    return _bidirectional_mask(config, embeddings, attention_mask), {}  # flash: the 2-D mask, flex: a BlockMask


class BertImplSelfAttention(nn.Module):
    """Multi-head attention of [1] with BERT's output projection:

        MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

    `Wqkv` holds [W^Q; W^K; W^V] stacked along the output dimension (one matmul for all three); head i uses columns
    i*d:(i+1)*d of each. `Wo` is W^O. The attention function comes from transformers' interface (`config._attn_implementation`).
    """

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.config = config
        self.num_heads, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5  # 1/√d_k
        self.is_causal = False  # read by the sdpa / flash integrations: BERT attends both ways
        self.Wqkv = BertImplLinear(config, config.hidden_size, 3 * config.hidden_size)
        self.Wo = BertImplLinear(config, config.hidden_size, config.hidden_size)
        self.attention_dropout = config.attention_probs_dropout_prob

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, tokens=None, eager: bool = False, **kwargs):
        """hidden_states (b, s, H), or (1, T, H) with `tokens` (kernels' map of the real tokens) -> that shape, and the
        probabilities (b, h, s, s) under eager."""
        h, d = self.num_heads, self.head_dim
        qkv = self.Wqkv(hidden_states)  # (b, s, 3H)
        attend = eager_attention_forward if eager else _attention_function(self.config._attn_implementation)
        fast = attention_kernel(self, qkv, tokens, attend, eager_attention_forward, attention_mask, kwargs)  # kernel point
        if fast is None:
            q, k, v = qkv.unflatten(-1, (3, h, d)).permute(2, 0, 3, 1, 4)  # 3 x (b, h, s, d)
            fast = attend(self, q, k, v, attention_mask, scaling=self.scaling,
                          dropout=self.attention_dropout if self.training else 0.0, **kwargs)
        out, probs = fast  # out: (b, s, h, d)
        return self.Wo(out.reshape(hidden_states.shape)), probs  # like hidden_states


class BertImplMLP(nn.Module):
    """Position-wise feed-forward block: Wo(act(Wi x))."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.Wi = BertImplLinear(config, config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.Wo = BertImplLinear(config, config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.Wi(hidden_states, self.act))


class BertImplLayer(GradientCheckpointingLayer):
    """Post-LN encoder layer of [2]: x = LN(x + Drop(MHA(x))); x = LN(x + Drop(MLP(x)))."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.attn = BertImplSelfAttention(config)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = BertImplMLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = BertImplDropout(config, config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, tokens=None, eager: bool = False, **kwargs: Unpack[TransformersKwargs]) -> torch.Tensor:
        attn_out, _ = self.attn(hidden_states, attention_mask, tokens, eager, **kwargs)
        hidden_states = self.attn_norm(hidden_states + self.dropout(attn_out))
        return self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))


class BertImplPooler(nn.Module):
    """tanh(W h_[CLS] + b): the sentence vector of [2], from the first token."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = BertImplLinear(config, config.hidden_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden_states[:, 0]))  # (b, H)


class BertImplLMHead(nn.Module):
    """MLM prediction head of [2]: LN(act(dense(x))) then a decoder tied to the word embeddings."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.dense = BertImplLinear(config, config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = BertImplLinear(config, config.hidden_size, config.vocab_size, skip_zero_rows=True)  # tied to word_embeddings

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.dense(hidden_states, self.act)))  # (..., V)


# ----------------------------------------------------------------------------------------------
# The Hugging Face machinery


class BertImplPreTrainedModel(CheckpointSafetyMixin, PreTrainedModel):
    config_class = BertImplConfig
    config: BertImplConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BertImplEmbeddings", "BertImplLayer"]
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": BertImplLayer, "attentions": OutputRecorder(BertImplSelfAttention, index=1)}
    accepts_loss_kwargs = False  # a loss that is a mean over examples: Trainer divides by the accumulation steps

    def __init__(self, config: BertImplConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        self.model_tags = ["bert_impl", "custom_code"]  # the cards transformers writes list it as remote code

    def _init_weights(self, module):
        """normal(0, initializer_range) weights, zero biases, LayerNorm (1, 0), the sinusoidal table; loaded tensors skipped.
        Word embeddings that are scaled by √d_model start at normal(0, 1/√d_model), unit scale in use (as [1]'s code)."""
        super()._init_weights(module)
        if isinstance(module, BertImplEmbeddings) and hasattr(module, "position_encoding"):
            _init_("copy_", module.position_encoding, sinusoidal_position_encoding(*module.position_encoding.shape))
        if isinstance(module, BertImplEmbeddings) and self.config.word_embedding_scale != 1.0:
            weight, pad = module.word_embeddings.weight, module.word_embeddings.padding_idx
            _init_("normal_", weight, mean=0.0, std=self.config.hidden_size**-0.5)
            if pad is not None and not getattr(weight, "_is_hf_initialized", False):
                _init_("zero_" if _hf_init is None else "zeros_", weight[pad])

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

    @_record_outputs
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                **kwargs: Unpack[TransformersKwargs]) -> BaseModelOutputWithPooling:
        """input_ids, attention_mask, token_type_ids, position_ids: (b, s); inputs_embeds: (b, s, H).
        Returns last_hidden_state (b, s, H), zeros at padding, pooler_output (b, H) and, when asked, hidden_states
        (num_layers + 1) x (b, s, H) and attentions num_layers x (b, h, s, s) (recorded by transformers' hooks)."""
        input_shape = self.config.check_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        flags = [kwargs.pop(f"output_{n}", None) or getattr(self.config, f"output_{n}") for n in ("attentions", "hidden_states")]
        eager, recording = bool(flags[0]), any(flags)  # recorded outputs are the padded batch's; probabilities need eager
        dtype = self.embeddings.word_embeddings.weight.dtype if inputs_embeds is None else inputs_embeds.dtype
        tokens = None if recording else token_map_kernel(  # kernel point "layout": the real tokens only
            self.config.kernels, self.config, attention_mask, position_ids, input_shape, dtype, kwargs)
        if tokens is not None:  # the layers run on (1, T, H): inputs gathered, outputs scattered back
            if position_ids is None:  # real tokens keep their places in their rows
                position_ids = torch.arange(input_shape[1], device=(input_ids if input_ids is not None else inputs_embeds).device)[None]
            hidden_states, mask = self.embeddings(*map(tokens.gather, (input_ids, token_type_ids, position_ids, inputs_embeds))), None
        else:
            hidden_states = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # (b, s, H)
            mask, extra = _attention_mask(self.config, attention_mask, position_ids, hidden_states, eager)
            kwargs.update(extra)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, tokens, eager, **kwargs)
        if tokens is not None:
            hidden_states = tokens.scatter(hidden_states)  # (b, s, H), zeros at padding
        elif attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)  # zeros at padding
        pooled = self.pooler(hidden_states) if self.pooler is not None else None  # (b, H)
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)


# ----------------------------------------------------------------------------------------------
# The heads, in transformers v5's shape: output flags travel in **kwargs to the encoder, return_dict=False gives tuples.


# The output of BertImplForPreTraining: transformers' own (loss, prediction_logits, seq_relationship_logits, ...).
BertImplForPreTrainingOutput = BertForPreTrainingOutput


class _BertImplMLMHeadModel(BertImplPreTrainedModel):
    """What the two masked-LM heads share: the tied decoder, `num_items_in_batch`, sparse prediction."""

    _tied_weights_keys = {"lm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}
    accepts_loss_kwargs = True  # takes num_items_in_batch (see `masked_lm_loss`)

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def _mlm_logits_and_loss(self, sequence_output, labels, num_items_in_batch):
        """The MLM head and `masked_lm_loss` for (b, s, H) states and (b, s) labels. With `config.sparse_prediction` the head
        runs on the n labelled positions only (item 7): logits (n, V), the same loss (unlabelled positions add 0)."""
        if labels is None:
            return self.lm_head(sequence_output), None  # (b, s, V)
        if tuple(labels.shape) != tuple(sequence_output.shape[:-1]):
            raise ValueError(f"labels have shape {tuple(labels.shape)} but the input has shape {tuple(sequence_output.shape[:-1])}; "
                             "pass one label per token (-100 where there is nothing to predict)")
        if self.config.sparse_prediction and not torch.compiler.is_compiling():
            keep = labels.reshape(-1).ne(IGNORE_INDEX).nonzero().squeeze(1)  # (n,)
            sequence_output = sequence_output.reshape(-1, sequence_output.size(-1)).index_select(0, keep)  # (n, H)
            labels = labels.reshape(-1).index_select(0, keep)  # (n,)
        logits = self.lm_head(sequence_output)  # (b, s, V) or (n, V)
        return logits, masked_lm_loss(logits, labels, num_items_in_batch)


class BertImplForMaskedLM(_BertImplMLMHeadModel):
    """Encoder + MLM head; the decoder weight is tied to the word embeddings."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config, add_pooling_layer=False)
        self.lm_head = BertImplLMHead(config)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, num_items_in_batch=None, **kwargs: Unpack[TransformersKwargs]) -> MaskedLMOutput:
        """labels: (b, s), a token id at masked positions and -100 elsewhere. logits: (b, s, V)."""
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True, **kwargs)
        logits, loss = self._mlm_logits_and_loss(out.last_hidden_state, labels, num_items_in_batch)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertImplForPreTraining(_BertImplMLMHeadModel):
    """Encoder + MLM head + next-sentence head, BERT's pretraining objective: L = L_MLM + L_NSP."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config)
        self.lm_head = BertImplLMHead(config)
        self.nsp_head = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, next_sentence_label=None, num_items_in_batch=None, **kwargs: Unpack[TransformersKwargs]) -> BertImplForPreTrainingOutput:
        """labels: (b, s) MLM targets (-100 = not masked); next_sentence_label: (b,), 0 = B follows A.
        Loss when both are given: MLM (as `masked_lm_loss`) + NSP cross-entropy. Under gradient
        accumulation the NSP mean of each micro-batch is weighted by its share of the masked tokens."""
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True, **kwargs)
        nsp_logits = self.nsp_head(out.pooler_output)  # (b, 2)
        both = labels is not None and next_sentence_label is not None
        prediction_logits, loss = self._mlm_logits_and_loss(out.last_hidden_state, labels if both else None, num_items_in_batch)
        if both:
            nsp = F.cross_entropy(nsp_logits.float(), next_sentence_label.view(-1))
            if num_items_in_batch is not None:
                nsp = nsp * labels.ne(IGNORE_INDEX).sum() / num_items_in_batch
            loss = loss + nsp
        return BertImplForPreTrainingOutput(loss=loss, prediction_logits=prediction_logits, seq_relationship_logits=nsp_logits,
                                            hidden_states=out.hidden_states, attentions=out.attentions)


class BertImplForNextSentencePrediction(BertImplPreTrainedModel):
    """Encoder + pooler + next-sentence head (2 classes: 0 = B follows A, 1 = B is random)."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.bert = BertImplModel(config)
        self.nsp_head = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]) -> NextSentencePredictorOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True, **kwargs)
        logits = self.nsp_head(out.pooler_output)  # (b, 2)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return NextSentencePredictorOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class _BertImplClassifierModel(BertImplPreTrainedModel):
    """What three heads share: encoder (pooler unless `_pooled` is False), dropout (classifier_dropout, else hidden's), classifier."""

    _pooled, _one_score = True, False

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertImplModel(config, add_pooling_layer=self._pooled)
        self.dropout = BertImplDropout(config, config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, 1 if self._one_score else config.num_labels)
        self.post_init()


class BertImplForSequenceClassification(_BertImplClassifierModel):
    """Encoder + pooler + linear classifier. The loss follows `config.problem_type` (transformers' ForSequenceClassificationLoss):
    "regression" (MSE; the default when num_labels == 1), "single_label_classification" (cross-entropy; integer labels)
    or "multi_label_classification" (BCE with logits; float labels)."""

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]) -> SequenceClassifierOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True, **kwargs)
        logits = self.classifier(self.dropout(out.pooler_output))  # (b, num_labels)
        loss = None
        if labels is not None:  # regression and multi-label targets in the logits' dtype (int scores, bf16)
            problem = self.config.problem_type or ("regression" if self.num_labels == 1 else "multi_label_classification"
                                                   if labels.is_floating_point() else "single_label_classification")
            loss = self.loss_function(labels if problem == "single_label_classification" else labels.to(logits.dtype),
                                      logits, self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertImplForTokenClassification(_BertImplClassifierModel):
    """Encoder + per-token linear classifier (NER, POS); labels -100 are ignored."""

    _pooled = False

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]) -> TokenClassifierOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True, **kwargs)
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (b, s, num_labels)
        loss = self.loss_function(logits, labels, self.config) if labels is not None else None
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertImplForQuestionAnswering(BertImplPreTrainedModel):
    """Encoder + span head: start and end logits per token (extractive QA); answers truncated away are ignored by the loss."""

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertImplModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None, **kwargs: Unpack[TransformersKwargs]) -> QuestionAnsweringModelOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True, **kwargs)
        logits = self.qa_outputs(out.last_hidden_state)  # (b, s, 2)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))  # 2 x (b, s)
        both = start_positions is not None and end_positions is not None
        loss = self.loss_function(start_logits, end_logits, start_positions, end_positions) if both else None
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                            hidden_states=out.hidden_states, attentions=out.attentions)


class BertImplForMultipleChoice(_BertImplClassifierModel):
    """Encoder + pooler + one score per choice; inputs are (b, c, s), logits (b, c)."""

    _one_score = True

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]) -> MultipleChoiceModelOutput:
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        out = self.bert(*(t.flatten(0, 1) if t is not None else None for t in inputs), return_dict=True, **kwargs)  # (b*c, s[, H])
        logits = self.classifier(self.dropout(out.pooler_output)).view(-1, num_choices)  # (b, c)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


__all__ = [
    "BertImplPreTrainedModel", "BertImplModel", "BertImplForMaskedLM", "BertImplForPreTraining", "BertImplForNextSentencePrediction",
    "BertImplForSequenceClassification", "BertImplForTokenClassification", "BertImplForQuestionAnswering", "BertImplForMultipleChoice",
    "BertImplForPreTrainingOutput", "sinusoidal_position_encoding", "eager_attention_forward", "masked_lm_loss",
]
