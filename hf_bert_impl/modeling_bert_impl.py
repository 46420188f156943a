"""hf-bert-impl: a from-scratch BERT encoder and its eight task heads, as a plain transformers model. References:
[1] Vaswani et al., "Attention Is All You Need" (2017), arXiv:1706.03762; [2] Devlin et al., "BERT: Pre-training of
Deep Bidirectional Transformers for Language Understanding" (2019), arXiv:1810.04805; [3] transformers'
bert/modeling_bert.py (the numerical reference) and modernbert/modular_modernbert.py.
How it differs from transformers' BERT: 1. positions default to the sinusoidal encoding of [1] (not stored, any
length), added to word embeddings scaled by √d_model as in [1] (`config.scale_word_embeddings`; "learned" = BERT's
table, unscaled); 2. Q, K and V come from one projection `Wqkv` = [W^Q; W^K; W^V]; 3. the MLM loss divides by
Trainer's `num_items_in_batch`; 4. `output_attentions=True` returns real probabilities under every backend (it runs
eager); 5. bad inputs raise a ValueError naming the value; 6. padding positions of the outputs hold zeros, and a packed
row (DataCollatorWithFlattening) attends within each sequence. Standard modules (nn.Linear, nn.Dropout, activations),
attention through ALL_ATTENTION_FUNCTIONS, masks from masking_utils; `hf_bert_impl.kernelize` adds speed from outside.
Shape legend: b batch, s sequence, h heads, d head dim (d_k), H hidden (= h * d), V vocabulary, c choices."""

import copy
from collections import OrderedDict
from typing import Unpack

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, modeling_outputs
from transformers.activations import ACT2FN
from transformers.masking_utils import packed_sequence_mask_function
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput as BertImplForPreTrainingOutput
from transformers.utils import TransformersKwargs, can_return_tuple

from .configuration_bert_impl import BertImplConfig


IGNORE_INDEX = -100

# --- transformers 4.57 / 5.x: the APIs that differ, each the newer one where it exists (this block only) -------------
try:  # 5.x: init functions that skip tensors loaded from a checkpoint
    from transformers import initialization as init
except ImportError:  # 4.57: _init_weights runs only on modules whose weights were not loaded
    init = None
try:  # 5.x (recent): output capture by hooks
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs
except ImportError:  # 4.57 / 5.0: the same contract under its older name
    from transformers.utils.generic import OutputRecorder
    from transformers.utils.generic import check_model_inputs as capture_outputs
try:  # 5.x: the mask in `config._attn_implementation`'s format (None: none); positional (5.0 says input_embeds)
    from transformers.masking_utils import create_bidirectional_mask
except ImportError:  # 4.57: flash takes the 2-D mask, eager and sdpa an additive (b, 1, s, s) one

    def create_bidirectional_mask(config, inputs_embeds, attention_mask, and_mask_function=None):
        (b, s), dtype, i = inputs_embeds.shape[:2], inputs_embeds.dtype, torch.arange(inputs_embeds.size(1))
        if "flash" in config._attn_implementation or attention_mask is None and and_mask_function is None:
            return None if attention_mask is None or attention_mask.all() else attention_mask.bool()
        keep = attention_mask[:, None, None] > 0 if attention_mask is not None else torch.ones(b, 1, s, s) > 0
        if and_mask_function is not None:
            keep = keep & and_mask_function(torch.arange(b)[:, None, None, None], 0, i[:, None], i)
        return ((~keep).to(dtype) * torch.finfo(dtype).min).to(inputs_embeds.device)


def attention_interface(name: str | None):
    """The attention function `config._attn_implementation` names (eager: `eager_attention_forward`). 5.x (recent):
    `get_interface`, which refuses an unknown name; 4.57 / 5.0 have only the mapping's `get`."""
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)
    return ALL_ATTENTION_FUNCTIONS.get(name, eager_attention_forward)


# ---------------------------------------------------------------------------------------------------------------------


def sinusoidal_position_encoding(num_positions: int, dim: int) -> torch.Tensor:
    """Sinusoidal positional encoding of [1]: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).
    Interleaved (even columns sines, odd columns cosines; an odd `dim` ends with a sine); float64 -> float32."""
    if num_positions < 0 or dim <= 0:
        raise ValueError(f"sinusoidal_position_encoding needs num_positions >= 0, dim > 0, got {num_positions}, {dim}")
    return _sinusoid(torch.arange(num_positions), dim)


def _sinusoid(pos: torch.Tensor, dim: int) -> torch.Tensor:  # rows at positions `pos` (any shape) -> (*pos.shape, dim)
    pos = pos.to(torch.float32 if pos.device.type == "mps" else torch.float64)  # MPS has no float64
    two_i = torch.arange(0, dim, 2, dtype=pos.dtype, device=pos.device)  # (ceil(dim/2),) the even columns 2i
    angle = pos.unsqueeze(-1) / torch.pow(10000.0, two_i / dim)  # (..., ceil(dim/2))
    return torch.stack([angle.sin(), angle.cos()], -1).flatten(-2)[..., :dim].float()  # sin, cos interleaved


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Scaled dot-product attention of [1]: softmax(QKᵀ/√d_k + M) V. q, k, v: (b, h, s, d); M: boolean (True:
    attend) or additive, broadcastable to (b, h, s, s). Returns the output (b, s, h, d) and the probabilities."""
    scores = torch.matmul(query, key.transpose(-2, -1)) * scaling  # (b, h, s, s)
    if attention_mask is not None:  # boolean: True where a key may be attended; else additive
        boolean, low = attention_mask.dtype == torch.bool, torch.finfo(scores.dtype).min
        scores = scores.masked_fill(~attention_mask, low) if boolean else scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (b, h, s, s)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs  # (b, s, h, d)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """The masked-LM loss of [2]: L = -Σ_i log P(x_i | x_\\i) over labels that are not -100, divided by their number
    or Trainer's `num_items_in_batch` (accumulation = one large batch); 0 if none; half-precision summed in float32."""
    logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)  # (N, V), (N,)
    nll_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none").float().sum()
    count = labels.ne(IGNORE_INDEX).sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return nll_sum / (count.to(nll_sum.device) if torch.is_tensor(count) else count)


def _check_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds) -> None:
    """A ValueError naming the value for inputs torch would reject opaquely or take silently (values: CPU, eager)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"input_ids must have shape (batch, sequence), got {shape}" + " (empty)" * (0 in shape))
    if inputs_embeds is not None and inputs_embeds.size(-1) != config.hidden_size:
        raise ValueError(f"inputs_embeds has width {inputs_embeds.size(-1)} but hidden_size = {config.hidden_size}")
    P = config.max_position_embeddings if config.position_embedding_type == "learned" else None
    if P is not None and position_ids is None:  # learned positions: the table's rows must cover 0 .. s-1
        position_ids = torch.arange(shape[1])[None]
    V, T, ids = config.vocab_size, config.type_vocab_size, "contains {}, outside [0, %s); check the model's tokenizer"
    checks = {
        "input_ids": (input_ids, V, "input_ids " + ids % f"vocab_size={V}"),
        "token_type_ids": (token_type_ids, T, "token_type_ids " + ids % f"type_vocab_size={T}"),
        "position_ids": (
            position_ids,
            P,
            f"sequence needs position {{}} but learned positions stop at "
            f"max_position_embeddings - 1 = {P and P - 1}; truncate (tokenizer(truncation=True))",
        ),
        "attention_mask": (attention_mask, 2, "attention_mask must hold 1 for tokens and 0 for padding, got {}"),
    }
    for name, (t, high, message) in checks.items():
        if t is not None and tuple(t.shape) != shape and (name != "position_ids" or tuple(t.shape) != (1, shape[1])):
            raise ValueError(f"{name} has shape {tuple(t.shape)} but the input has shape {shape}")
        if t is not None and name != "attention_mask" and (t.is_floating_point() or t.dtype == torch.bool):
            raise ValueError(f"{name} must hold integer ids, got dtype {t.dtype}")
        if t is None or t.device.type != "cpu" or torch.compiler.is_compiling():
            continue
        bad = t[(t != 0) & (t != 1)] if name == "attention_mask" else t[(t < 0) | (t >= (high or float("inf")))]
        if bad.numel():
            value = (bad.max() if bad.max() >= 0 else bad.min()).item()  # the largest, or the most negative
            negative = value < 0 and name == "position_ids"
            raise ValueError(f"position_ids contains {value}; they start at 0" if negative else message.format(value))


class BertImplEmbeddings(nn.Module):
    """word (× √d_model: `config.word_embedding_scale`) + position + token type embeddings, LayerNorm, dropout.
    ids (b, s), position_ids (b|1, s), inputs_embeds (b, s, H) -> (b, s, H)."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        if (pad := config.pad_token_id or 0) >= config.vocab_size:  # None: no padding id
            raise ValueError(f"BertImplConfig.pad_token_id must be None or in [0, {config.vocab_size=}), got {pad}")
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:  # fixed by the formula: a buffer (P, H), not a weight, not saved
            pe = sinusoidal_position_encoding(config.max_position_embeddings, config.hidden_size)
            self.register_buffer("position_encoding", pe, persistent=False)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (b, s, H)
        if (scale := self.config.word_embedding_scale) != 1.0:  # √d_model of [1] §3.4
            inputs_embeds = inputs_embeds * scale
        s, P, dtype = inputs_embeds.size(1), self.config.max_position_embeddings, self.word_embeddings.weight.dtype
        built = position_ids is None  # then the positions are 0 .. s-1, known without reading them
        position_ids = torch.arange(s, device=inputs_embeds.device)[None] if built else position_ids  # (b|1, s)
        if self.config.position_embedding_type == "learned":
            positions = self.position_embeddings(position_ids)  # (b|1, s, H)
        elif s <= P if built else position_ids.device.type == "cpu" and int(position_ids.max()) < P:  # stored rows
            positions = F.embedding(position_ids, self.position_encoding.to(dtype))  # (b|1, s, H)
        else:  # past the stored rows, or unread (on an accelerator a read would be a host sync): the formula
            positions = _sinusoid(position_ids, self.config.hidden_size).to(dtype)  # (b|1, s, H)
        types = self.token_type_embeddings  # no token type ids: all of type 0
        types = types.weight[0] if token_type_ids is None else types(token_type_ids)  # (H,) or (b, s, H)
        return self.dropout(self.LayerNorm(inputs_embeds + types + positions))  # (b, s, H)


class BertImplSelfAttention(nn.Module):
    """Multi-head attention of [1]: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q,
    K W_i^K, V W_i^V). `Wqkv` = [W^Q; W^K; W^V] (one matmul; head i uses columns i*d:(i+1)*d of each); `Wo` = W^O."""

    kernel_seam = "BertImplSelfAttention"

    def __init__(self, config: BertImplConfig):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"BertImplConfig.hidden_size ({config.hidden_size}) must be divisible by "
                f"num_attention_heads ({config.num_attention_heads}); pick a head count that divides it"
            )
        self.config = config
        self.num_heads, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5  # 1/√d_k
        self.is_causal = False  # read by the sdpa / flash integrations: BERT attends both ways
        self.attention_dropout = config.attention_probs_dropout_prob
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size)

    def attention_function(self, impl: str | None):
        """The attention function `impl` names (`attention_interface`). A kernel seam: `hf_bert_impl.kernelize` may
        give an instance one that attends per sequence on a packed row (`cu_seq_lens_q`), else calls this one."""
        return attention_interface(impl)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs: Unpack[TransformersKwargs]):
        """hidden_states (b, s, H) -> (b, s, H), and the probabilities (b, h, s, s) under eager."""
        q, k, v = self.Wqkv(hidden_states).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        impl = "eager" if kwargs.get("output_attentions") else self.config._attn_implementation
        attend = self.attention_function(impl)  # transformers' function for `impl`; eager: ours
        out, probs = attend(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.scaling,  # q, k, v: (b, h, s, d)
            dropout=self.attention_dropout if self.training else 0.0,
            **kwargs,
        )  # out: (b, s, h, d)
        return self.Wo(out.reshape(hidden_states.shape)), probs  # (b, s, H)


class BertImplLayer(GradientCheckpointingLayer):
    """Post-LN encoder layer of [2]: x = LN(x + Drop(MHA(x))); x = LN(x + Drop(MLP(x))), MLP(x) = Wo(act(Wi x))."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.attn = BertImplSelfAttention(config)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential(
            OrderedDict(
                Wi=nn.Linear(config.hidden_size, config.intermediate_size),
                act=ACT2FN[config.hidden_act],
                Wo=nn.Linear(config.intermediate_size, config.hidden_size),
            )
        )  # FFN
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, **kwargs: Unpack[TransformersKwargs]) -> torch.Tensor:
        attn_out, _ = self.attn(hidden_states, attention_mask, **kwargs)
        hidden_states = self.attn_norm(hidden_states + self.dropout(attn_out))
        return self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))


class BertImplEncoder(nn.ModuleList):
    """The `num_hidden_layers` layers of [2] and the attention mask they share, built once. A kernel seam
    (`kernel_seam`, declared as transformers' `use_kernel_forward_from_hub` declares one): `hf_bert_impl.kernelize` may
    give it a forward that runs these layers on the real tokens only; the layers and their weights stay as they are."""

    kernel_seam = "BertImplEncoder"

    def __init__(self, config: BertImplConfig):
        super().__init__(BertImplLayer(config) for _ in range(config.num_hidden_layers))
        self.config = config

    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs: Unpack[TransformersKwargs]):
        """hidden_states (b, s, H), attention_mask (b, s) (1: token, 0: padding), position_ids (b|1, s) -> (b, s, H).
        A packed row (b = 1, position ids restarting at 0, no mask) attends within each of its sequences."""
        packed = None
        if attention_mask is None and position_ids is not None and hidden_states.size(0) == 1:
            sequence = position_ids.eq(0).cumsum(-1)  # (1, s): each token's sequence number
            if "flash" in (self.config._attn_implementation or ""):
                kwargs.setdefault("position_ids", position_ids)  # flash's varlen path finds the sequences in them
            elif torch.compiler.is_compiling() or int(sequence[0, -1]) > 1:
                packed = packed_sequence_mask_function(sequence)
        config = self.config  # the layers run eager when attentions are asked for: the mask is eager's then
        if kwargs.get("output_attentions") and config._attn_implementation != "eager":
            config = copy.copy(config)
            config._attn_implementation = "eager"
        mask = create_bidirectional_mask(config, hidden_states, attention_mask, and_mask_function=packed)
        for layer in self:
            hidden_states = layer(hidden_states, mask, **kwargs)
        return hidden_states


class BertImplPreTrainedModel(PreTrainedModel):
    config_class = BertImplConfig
    config: BertImplConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BertImplEmbeddings", "BertImplLayer"]
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": BertImplLayer,
        "attentions": OutputRecorder(BertImplSelfAttention, index=1),
    }
    accepts_loss_kwargs = False  # a loss that is a mean over examples: Trainer divides by the accumulation steps

    def __init__(self, config: BertImplConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        self.model_tags = ["bert_impl", "custom_code"]  # the cards transformers writes list it as remote code

    @torch.no_grad()
    def _init_weights(self, module):
        """transformers' init, the sinusoidal table, and word embeddings scaled by √d_model at normal(0,
        1/√d_model) (unit scale in use, as [1]'s code); loaded tensors are skipped."""
        super()._init_weights(module)
        if not isinstance(module, BertImplEmbeddings):
            return
        if (pe := getattr(module, "position_encoding", None)) is not None:
            (init or torch.Tensor).copy_(pe, sinusoidal_position_encoding(*pe.shape))
        weight, pad = module.word_embeddings.weight, module.word_embeddings.padding_idx
        if self.config.word_embedding_scale != 1.0 and not getattr(weight, "_is_hf_initialized", False):
            (init or nn.init).normal_(weight, mean=0.0, std=self.config.hidden_size**-0.5)
            if pad is not None:
                weight[pad].zero_()


class BertImplModel(BertImplPreTrainedModel):
    """The bare encoder: embeddings, `num_hidden_layers` post-LN layers, optional tanh pooler."""

    def __init__(self, config: BertImplConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertImplEmbeddings(config)
        self.layers = BertImplEncoder(config)
        H, self.pooler = config.hidden_size, None  # the pooler: tanh(W h_[CLS] + b), [2]'s sentence vector
        if add_pooling_layer:
            self.pooler = nn.Sequential(OrderedDict(dense=nn.Linear(H, H), activation=nn.Tanh()))
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @capture_outputs
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> modeling_outputs.BaseModelOutputWithPooling:
        """inputs (b, s), inputs_embeds (b, s, H) -> last_hidden_state (b, s, H) (zeros at padding), pooler_output
        (b, H); hidden states and attentions are recorded by transformers' hooks."""
        _check_inputs(self.config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        hidden_states = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # (b, s, H)
        hidden_states = self.layers(hidden_states, attention_mask, position_ids, **kwargs)  # (b, s, H)
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)  # zeros at padding
        pooled = self.pooler(hidden_states[:, 0]) if self.pooler is not None else None  # (b, H)
        return modeling_outputs.BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)


class _BertImplHead(BertImplPreTrainedModel):  # output flags travel in **kwargs; return_dict=False gives tuples
    """The encoder `bert` (pooled where `_pooled`), then the head's modules (`_build`; default dropout, classifier)."""

    _pooled, _outputs = True, None

    def __init__(self, config: BertImplConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertImplModel(config, add_pooling_layer=self._pooled)
        self._build(config)
        self.post_init()

    def _build(self, config: BertImplConfig) -> None:
        p = config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(config.hidden_size, self._outputs or config.num_labels)

    def _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs):
        return self.bert(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs, return_dict=True
        )


class _BertImplMLMHeadModel(_BertImplHead):
    """What the two masked-LM heads share: the tied decoder and `num_items_in_batch`."""

    _tied_weights_keys = {"lm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}
    accepts_loss_kwargs = True  # takes num_items_in_batch (see `masked_lm_loss`)

    def _build(self, config: BertImplConfig) -> None:
        self.lm_head = nn.Sequential(
            OrderedDict(  # the MLM head of [2]: decoder(LN(act(dense x))), decoder tied
                dense=nn.Linear(config.hidden_size, config.hidden_size),
                act=ACT2FN[config.hidden_act],
                norm=nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps),
                decoder=nn.Linear(config.hidden_size, config.vocab_size),
            )
        )
        self.nsp_head = nn.Linear(config.hidden_size, 2) if self._pooled else None

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def _mlm_logits_and_loss(self, sequence_output, labels, num_items_in_batch):
        """The MLM head on (b, s, H) states -> logits (b, s, V), and `masked_lm_loss` when (b, s) labels are given.
        With `config.sparse_prediction` and labels, the head runs on the n labelled positions only (as ModernBERT's):
        logits (n, V), the same loss (unlabelled positions add nothing to it)."""
        if labels is not None and tuple(labels.shape) != tuple(sequence_output.shape[:-1]):
            raise ValueError(
                f"labels have shape {tuple(labels.shape)} but the input has shape "
                f"{tuple(sequence_output.shape[:-1])}; pass one label per token (-100: none)"
            )
        if self.config.sparse_prediction and labels is not None:
            labels = labels.reshape(-1)  # (b*s,)
            labelled = labels.ne(IGNORE_INDEX)
            sequence_output = sequence_output.reshape(labels.size(0), -1)[labelled]  # (n, H)
            labels = labels[labelled]  # (n,)
        logits = self.lm_head(sequence_output)  # (b, s, V), or (n, V)
        return logits, None if labels is None else masked_lm_loss(logits, labels, num_items_in_batch)


class BertImplForMaskedLM(_BertImplMLMHeadModel):
    """Encoder + MLM head; the decoder weight is tied to the word embeddings. labels: (b, s), -100 where not masked."""

    _pooled = False

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        num_items_in_batch=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> modeling_outputs.MaskedLMOutput:
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits, loss = self._mlm_logits_and_loss(out.last_hidden_state, labels, num_items_in_batch)  # (b, s, V)
        return modeling_outputs.MaskedLMOutput(loss, logits, out.hidden_states, out.attentions)


class BertImplForPreTraining(_BertImplMLMHeadModel):
    """Encoder + MLM head + next-sentence head: L = L_MLM + L_NSP (labels (b, s); next_sentence_label (b,), 0 = B
    follows A); under accumulation each micro-batch's NSP mean is weighted by its share of the masked tokens."""

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        next_sentence_label=None,
        num_items_in_batch=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BertImplForPreTrainingOutput:
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        nsp_logits = self.nsp_head(out.pooler_output)  # (b, 2)
        both = labels is not None and next_sentence_label is not None
        logits, loss = self._mlm_logits_and_loss(out.last_hidden_state, labels if both else None, num_items_in_batch)
        if both:
            nsp = F.cross_entropy(nsp_logits.float(), next_sentence_label.view(-1))
            scale = 1 if num_items_in_batch is None else labels.ne(IGNORE_INDEX).sum() / num_items_in_batch
            loss = loss + nsp * scale
        return BertImplForPreTrainingOutput(
            loss=loss,
            prediction_logits=logits,
            seq_relationship_logits=nsp_logits,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )


class BertImplForNextSentencePrediction(_BertImplHead):
    """Encoder + pooler + next-sentence head (labels (b,): 0 = B follows A, 1 = B is random)."""

    def _build(self, config: BertImplConfig) -> None:
        self.nsp_head = nn.Linear(config.hidden_size, 2)

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> modeling_outputs.NextSentencePredictorOutput:
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits = self.nsp_head(out.pooler_output)  # (b, 2)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return modeling_outputs.NextSentencePredictorOutput(loss, logits, out.hidden_states, out.attentions)


class BertImplForSequenceClassification(_BertImplHead):
    """Encoder + pooler + linear classifier; the loss follows `config.problem_type` as in transformers' BERT."""

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> modeling_outputs.SequenceClassifierOutput:
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits, loss = self.classifier(self.dropout(out.pooler_output)), None  # (b, num_labels)
        if labels is not None:  # regression and multi-label targets in the logits' dtype (int scores, bf16)
            multi = "multi_label_classification" if labels.is_floating_point() else "single_label_classification"
            problem = self.config.problem_type or ("regression" if self.num_labels == 1 else multi)
            labels = labels if problem == "single_label_classification" else labels.to(logits.dtype)
            loss = self.loss_function(labels, logits, self.config)
        return modeling_outputs.SequenceClassifierOutput(loss, logits, out.hidden_states, out.attentions)


class BertImplForTokenClassification(_BertImplHead):
    """Encoder + per-token linear classifier (NER, POS); labels (b, s), -100 ignored."""

    _pooled = False

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> modeling_outputs.TokenClassifierOutput:
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (b, s, num_labels)
        loss = self.loss_function(logits, labels, self.config) if labels is not None else None
        return modeling_outputs.TokenClassifierOutput(loss, logits, out.hidden_states, out.attentions)


class BertImplForQuestionAnswering(_BertImplHead):
    """Encoder + span head: start and end logits per token (extractive QA); answers truncated away are ignored."""

    _pooled = False

    def _build(self, config: BertImplConfig) -> None:
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        start_positions=None,
        end_positions=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> modeling_outputs.QuestionAnsweringModelOutput:
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits = self.qa_outputs(out.last_hidden_state)  # (b, s, 2)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))  # 2 x (b, s)
        both = start_positions is not None and end_positions is not None
        loss = self.loss_function(start_logits, end_logits, start_positions, end_positions) if both else None
        out = (loss, start_logits, end_logits, out.hidden_states, out.attentions)
        return modeling_outputs.QuestionAnsweringModelOutput(*out)


class BertImplForMultipleChoice(_BertImplHead):
    """Encoder + pooler + one score per choice; inputs are (b, c, s), logits (b, c), labels (b,)."""

    _outputs = 1

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> modeling_outputs.MultipleChoiceModelOutput:
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        out = self._encode(*(t.flatten(0, 1) if t is not None else None for t in inputs), kwargs)  # (b*c, s[, H])
        choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        logits = self.classifier(self.dropout(out.pooler_output)).view(-1, choices)  # (b, c)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return modeling_outputs.MultipleChoiceModelOutput(loss, logits, out.hidden_states, out.attentions)
