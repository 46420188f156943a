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
    6. Unpadding: a padded batch is gathered once into its real tokens (T, H); the projections,
       LayerNorms and feed-forward run on those only, attention runs per sequence (flash-attention
       varlen, or SDPA/eager on a compact padded grid, n sequences x the longest length), and the
       result is scattered back once. The same
       path takes packed batches from `DataCollatorWithFlattening` (one row, `position_ids`
       restarting at 0): attention never crosses a sequence boundary. Padding positions of
       `last_hidden_state` / `hidden_states` hold zeros (transformers leaves values there that depend
       only on padding). `config.unpad_inputs=False` turns it off; `output_attentions=True`,
       `flex_attention` and `torch.compile` use the padded path.
    7. Sparse prediction (`config.sparse_prediction=True`, off by default): when labels are given
       the MLM head runs only on the labelled positions and `logits` is (n_labelled, V), row i
       predicting `labels[labels != -100][i]`; without labels, and always when off, logits are the
       full (b, s, V) of transformers.
    8. On CPU in float32 and bfloat16 the linear layers (`BertImplLinear`) can run their GEMMs on oneDNN, the
       library torch.compile's CPU backend uses, instead of the BLAS behind torch.mm. The choice is
       made once per process by CPU vendor (`linear_kernel`, `config.onednn_linear="auto"`): oneDNN
       on AMD (where MKL is slow), torch's BLAS on Intel and elsewhere; True / False force it.
       CUDA, float16, autocast, tracing, export and torch.compile use nn.Linear's own path.

Shape legend: b batch, s sequence, h heads, d head dim (d_k), H hidden (= h * d), I intermediate,
V vocabulary, c choices.

This file travels to the Hub: it imports only torch, transformers and `.configuration_bert_impl`,
and runs on transformers 4.57.x and every 5.x (the compatibility shims below; older: one ImportError).
"""

import os
import re
import shutil
import uuid
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_bert_impl import BertImplConfig  # first: it refuses a too-old transformers with one clear error

from transformers import PreTrainedModel
from transformers import masking_utils
from transformers.activations import ACT2FN
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

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------
# transformers 4.57 / 5.x compatibility: one named shim per API that differs; the rest of the file
# has one code path. Each shim uses the newer API when it exists.

try:  # 5.x: init functions that skip tensors loaded from a checkpoint
    from transformers import initialization as _hf_init
except ImportError:  # 4.57: _init_weights runs only on modules whose weights were not loaded
    _hf_init = None


def _init_copy_(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """tensor <- value at initialisation (transformers.initialization.copy_ where it exists)."""
    if _hf_init is not None:
        _hf_init.copy_(tensor, value)
    else:
        with torch.no_grad():
            tensor.copy_(value)


def _attention_function(impl: str | None):
    """The attention function registered for `impl`, eager_attention_forward for "eager"
    (AttentionInterface.get_interface from 5.x on; the registry lookup before that)."""
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
        mask_function=lambda b, h, q, kv: torch.ones_like(q, dtype=torch.bool), attention_mask=attention_mask.bool(),
    )


def _find_onednn_linear():
    """oneDNN's fp32 GEMM (what torch.compile's CPU backend uses for linear layers), or None.

    It is a torch-internal op, so it is used only if it exists in this torch build and reproduces
    F.linear on a probe at import; anything else (absent, renamed, a changed signature) means the
    plain nn.Linear path, which computes the same formula."""
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        op = torch.ops.mkldnn._linear_pointwise
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, generator=g)
        ok = torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        ok = ok and torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), atol=1e-5, rtol=1e-5)
        y = torch.randn(5, 3, generator=g)  # the backward passes transposed (non-contiguous) weights
        ok = ok and torch.allclose(op(y, w.t(), None, "none", [], ""), F.linear(y, w.t()), atol=1e-5, rtol=1e-5)
        return op if ok else None
    except Exception:  # noqa: BLE001  any failure of an internal op means: do not use it
        return None


_ONEDNN_LINEAR = _find_onednn_linear()


def _onednn_linear_dtypes() -> tuple:
    """The dtypes the oneDNN linear is used for: float32 always (when the op exists), bfloat16 when
    the op reproduces F.linear in bfloat16 on a probe (a CPU without native bf16 may lack it)."""
    if _ONEDNN_LINEAR is None:
        return ()
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(5, 8, generator=g).bfloat16(), torch.randn(3, 8, generator=g).bfloat16()
        ok = torch.allclose(_ONEDNN_LINEAR(x, w, None, "none", [], "").float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2)
        return (torch.float32, torch.bfloat16) if ok else (torch.float32,)
    except Exception:  # noqa: BLE001
        return (torch.float32,)


_ONEDNN_DTYPES = _onednn_linear_dtypes()

# Which GEMM library float32 / bfloat16 CPU linear layers use when `config.onednn_linear="auto"`, by CPU vendor
# (read once per process). Measured with scripts/benchmark.py (docs/benchmarks.md): on AMD EPYC
# (Zen 4) MKL's fp32 GEMM takes a slow path and oneDNN's is about 2x faster; on Intel Xeon MKL is
# fast and the oneDNN linear loses to it, most in the backward (MLM step 0.77x vs 0.97x), so Intel
# and any CPU not measured keep torch's own BLAS, as transformers does.
_AUTO_KERNEL_BY_VENDOR = {"AuthenticAMD": "onednn"}


def _cpu_vendor() -> str:
    """The `vendor_id` of /proc/cpuinfo (e.g. AuthenticAMD, GenuineIntel); "" when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


_CPU_VENDOR = _cpu_vendor()  # read once, at import (never inside a forward, so torch.compile sees no I/O)


def linear_kernel(setting="auto") -> str:
    """The GEMM library float32 / bfloat16 CPU linear layers use for `config.onednn_linear = setting`:
    "onednn" or "blas" (torch's own, as nn.Linear). True / False force it (True falls back to
    "blas" where this torch build has no usable oneDNN linear); "auto" decides by CPU vendor."""
    if _ONEDNN_LINEAR is None or setting is False:
        return "blas"
    if setting is True:
        return "onednn"
    return _AUTO_KERNEL_BY_VENDOR.get(_CPU_VENDOR, "blas")


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
# Linear layers on oneDNN (CPU, float32 and bfloat16)


class _OneDNNLinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b with all three GEMMs of forward and backward on oneDNN. The op has no autograd
    formula of its own, so the backward is written out: dx = dy W, dW = dyᵀ x, db = Σ dy."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.size(-1))  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _ONEDNN_LINEAR(grad, weight.t(), None, "none", [], "")  # (..., in)
        if ctx.needs_input_grad[1]:
            grad_w = _ONEDNN_LINEAR(grad_2d.t(), x.reshape(-1, x.size(-1)).t(), None, "none", [], "")  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)
        return grad_x, grad_w, grad_b


class BertImplLinear(nn.Linear):
    """nn.Linear whose float32 / bfloat16 CPU matmuls run on oneDNN instead of the BLAS behind torch.mm where
    `linear_kernel(config.onednn_linear)` says so (default "auto": by CPU vendor, decided once per
    process). Same formula, a different GEMM library: on AMD EPYC, where MKL is slow, this is most
    of the CPU speed-up (docs/benchmarks.md); in bfloat16 it also fuses the bias add that addmm
    does as a separate copy. The library is chosen once per process; per call only what can change
    between two calls is looked at: the weight's and input's dtype and device (a model is moved,
    cast, or built on the meta device and loaded), autocast, tracing / export / compile. Everything
    else is nn.Linear's own path."""

    def __init__(self, config: BertImplConfig, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dtype == w.dtype
            and x.dtype in _ONEDNN_DTYPES
            and w.device.type == "cpu"
            and type(x) is torch.Tensor
            and type(w) in (torch.Tensor, nn.Parameter)
            and linear_kernel(self.config.onednn_linear) == "onednn"
            and x.numel() > 0
            and not _in_graph_capture()
            and not torch.is_autocast_enabled("cpu")
        ):
            return _OneDNNLinearFunction.apply(x, w, self.bias)
        return F.linear(x, w, self.bias)


def _in_graph_capture() -> bool:
    """torch.compile, TorchScript tracing / scripting or ONNX export: they take nn.Linear's own op."""
    return (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch.jit.is_scripting()
        or torch.onnx.is_in_onnx_export()
    )


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
        # An all-padding batch on the unpadded path has no tokens at all: nothing to extend.
        needed = int(position_ids.max()) + 1 if position_ids.numel() and not torch.compiler.is_compiling() else table.size(0)
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
        self.Wqkv = BertImplLinear(config, config.hidden_size, 3 * config.hidden_size)
        self.Wo = BertImplLinear(config, config.hidden_size, config.hidden_size)
        self.attention_dropout = config.attention_probs_dropout_prob

    def forward(self, hidden_states, attention_mask=None, output_attentions=False, unpad=None, **kwargs):
        if unpad is not None:
            return self._forward_unpadded(hidden_states, unpad, **kwargs), None
        b, s, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(b, s, 3, self.num_heads, self.head_dim)  # (b, s, 3, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (b, h, s, d)
        if output_attentions:
            attention_fn = eager_attention_forward  # the only backend that materialises probabilities
        else:
            attention_fn = _attention_function(self.config._attn_implementation)
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

    def _forward_unpadded(self, hidden_states: torch.Tensor, unpad: "UnpadState", **kwargs) -> torch.Tensor:
        """hidden_states: (T, H), the real tokens only, each sequence's tokens contiguous. Flash-attention
        takes them as they are (varlen); other backends see them in a compact padded grid (n sequences x
        the longest length m, not the input's s), scattered in and gathered back once per layer."""
        T = hidden_states.size(0)
        qkv = self.Wqkv(hidden_states)  # (T, 3H)
        impl = self.config._attn_implementation
        attention_fn = _attention_function(impl)
        dropout = self.attention_dropout if self.training else 0.0
        if _is_flash(impl):
            q, k, v = qkv.view(1, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (1, h, T, d)
            kwargs.update(
                cu_seq_lens_q=unpad.cu_seqlens, cu_seq_lens_k=unpad.cu_seqlens,
                max_length_q=unpad.max_seqlen, max_length_k=unpad.max_seqlen,
            )
            out, _ = attention_fn(self, q, k, v, None, scaling=self.scaling, dropout=dropout, **kwargs)  # (1, T, h, d)
            return self.Wo(out.reshape(T, -1))  # (T, H)
        if T == 0:  # every row is padding: nothing to attend
            return self.Wo(qkv.new_zeros(0, qkv.size(1) // 3))
        # One padded (n, m) grid for all sequences: four ops per layer whatever n is, which matters
        # more than the copies on a CPU shared with other work (each parallel op waits for every thread).
        n, m = len(unpad.cu_seqlens) - 1, unpad.max_seqlen
        grid = qkv.new_zeros(n * m, qkv.size(1)).index_copy(0, unpad.grid_index, qkv)  # (n*m, 3H)
        q, k, v = grid.view(n, m, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (n, h, m, d)
        out, _ = attention_fn(self, q, k, v, unpad.grid_mask, scaling=self.scaling, dropout=dropout, **kwargs)  # (n, m, h, d)
        return self.Wo(out.reshape(n * m, -1).index_select(0, unpad.grid_index))  # (T, H)


class BertImplMLP(nn.Module):
    """Position-wise feed-forward block: Wo(act(Wi x))."""

    def __init__(self, config: BertImplConfig):
        super().__init__()
        self.Wi = BertImplLinear(config, config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.Wo = BertImplLinear(config, config.intermediate_size, config.hidden_size)

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

    def forward(self, hidden_states, attention_mask=None, output_attentions=False, unpad=None, **kwargs):
        """hidden_states: (b, s, H), or (T, H) real tokens when `unpad` is given."""
        attn_out, probs = self.attn(hidden_states, attention_mask, output_attentions=output_attentions, unpad=unpad, **kwargs)
        hidden_states = self.attn_norm(hidden_states + self.dropout(attn_out))
        hidden_states = self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))
        return hidden_states, probs  # (b, s, H), (b, h, s, s) or None


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
        self.decoder = BertImplLinear(config, config.hidden_size, config.vocab_size)  # weight tied to word_embeddings

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(hidden_states))))  # (..., V)


# ----------------------------------------------------------------------------------------------
# The Hugging Face machinery


def _owner_tag() -> str:
    """host and pid of this save, so a later save can tell a killed save's leftovers from a running one's."""
    import socket

    return f"{socket.gethostname().replace('-', '_').replace('.', '_')}-{os.getpid()}"


def _remove_stale_staging(parent: str, name: str) -> None:
    """Remove `.NAME.saving-*` / `.NAME.replaced-*` siblings left by a save on this host whose process is gone."""
    host = _owner_tag().rsplit("-", 1)[0]
    for entry in os.listdir(parent):
        m = re.fullmatch(rf"\.{re.escape(name)}\.(saving|replaced)-(.+)-(\d+)-[0-9a-f]{{12}}", entry)
        if not m or m.group(2) != host:
            continue
        try:
            os.kill(int(m.group(3)), 0)
            continue  # that save is still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path = os.path.join(parent, entry)
        if m.group(1) == "replaced" and not os.path.exists(os.path.join(parent, name)):
            os.rename(path, os.path.join(parent, name))  # a crash between the two renames: bring the old one back
        else:
            shutil.rmtree(path, ignore_errors=True)


def _link_tree(src: str, dst: str) -> None:
    """Hard-link (copy where links are not possible) a file or directory tree: no data is copied on one file system."""
    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    elif os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    else:
        link(src, dst)


def _exchange_directories(a: str, b: str) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), b)


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

    def __init__(self, config: BertImplConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        # Tags for the cards transformers writes (Trainer.push_to_hub, push_to_hub): the Hub lists the
        # repository as remote code. A per-instance list: add_model_tags appends to it.
        self.model_tags = ["bert_impl", "custom_code"]

    def _init_weights(self, module):
        """normal(0, initializer_range) weights, zero biases, LayerNorm (1, 0); the sinusoidal table
        recomputed. The `init` functions skip tensors loaded from a checkpoint."""
        super()._init_weights(module)
        if isinstance(module, BertImplEmbeddings) and hasattr(module, "position_encoding"):
            pe = sinusoidal_position_encoding(module.position_encoding.size(0), module.position_encoding.size(1))
            _init_copy_(module.position_encoding, pe)

    # Weight files transformers writes or reads (shards and indexes included): pickled ones, and the
    # ones a previous save leaves behind.
    _PICKLED_WEIGHTS = re.compile(r"pytorch_model(-\d{5}-of-\d{5})?\.bin(\.index\.json)?")
    _WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' loader with two refusals it lacks. A local directory that holds only pickled
        `pytorch_model.bin` weights is refused (a pickle can run code; transformers would try it with
        `torch.load(weights_only=True)`) unless the caller opts in with `use_safetensors=False`. A
        truncated or corrupt `model.safetensors` raises a ValueError that says so, not a bare
        SafetensorError; so does a checkpoint that lacks encoder weights (transformers would warn and
        start them random). The config checks (model type, required fields) live in BertImplConfig."""
        source = pretrained_model_name_or_path
        folder = os.path.join(os.fspath(source), kwargs["subfolder"]) if kwargs.get("subfolder") else source
        if folder is not None and os.path.isdir(folder) and kwargs.get("use_safetensors") is not False:
            names = os.listdir(folder)
            pickled = sorted(n for n in names if cls._PICKLED_WEIGHTS.fullmatch(n))
            if pickled and not any(n.endswith(".safetensors") for n in names):
                raise ValueError(
                    f"{folder} holds only pickled weights {pickled}, which bert_impl does not load by default "
                    "(a pickle can execute code). If you trust the file, convert it explicitly: "
                    "model.load_state_dict(torch.load(path, weights_only=True)); model.save_pretrained(dir), "
                    "or pass use_safetensors=False to load it with torch.load(weights_only=True)"
                )
        want_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(source, *model_args, output_loading_info=True, **kwargs)
        except Exception as e:
            # Matched by name: this file imports only torch and transformers (the Hub rule).
            if type(e).__name__ != "SafetensorError":
                raise
            raise ValueError(
                f"the weights in {source} cannot be read ({e}): model.safetensors is truncated or corrupt "
                "(an interrupted download, copy or save?); download or save it again"
            ) from e
        # transformers only warns about missing weights and initialises them at random. A new head or
        # pooler is normal (an encoder checkpoint fine-tuned for a task); a missing encoder weight is not.
        missing = sorted(k for k in info["missing_keys"] if re.match(r"(bert\.)?(embeddings|layers)\.", k))
        if missing:
            raise ValueError(
                f"the checkpoint in {source} lacks {len(missing)} encoder weight(s) this config needs, e.g. "
                f"{missing[:4]}; they would start random. Is it a bert_impl checkpoint of this architecture? "
                "(transformers BERT: convert it with hf_bert_impl.convert.from_hf_bert; to load a partial "
                "state dict on purpose, use model.load_state_dict(..., strict=False))"
            )
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, is_main_process: bool = True, *args, **kwargs):
        """transformers' save, all or nothing. Everything is written into a hidden sibling directory first
        (`.NAME.saving-*`); a new directory is then one rename. An existing directory is replaced by one
        atomic exchange of the two directories (Linux renameat2 RENAME_EXCHANGE), after the files of the
        old directory that are not part of the model (tokenizer, checkpoint-* folders, ...) were hard-linked
        into the new one: at every instant `save_directory` holds either the complete old checkpoint or the
        complete new one, never a mix and never nothing. Where the exchange is unavailable (another OS or
        file system) the old directory is renamed aside and the new one renamed in: a crash between those
        two renames leaves the old checkpoint complete in `.NAME.replaced-*`. Leftovers of a killed save are
        hidden siblings only, removed by the next save. `config.sparse_prediction` is a training switch
        (scripts/pretrain_mlm.py sets it for speed): it is saved as False, so loaded checkpoints return
        transformers' full logits. Pushes and non-main ranks go straight through."""
        sparse = getattr(self.config, "sparse_prediction", False)
        try:
            if sparse:
                self.config.sparse_prediction = False
            if kwargs.get("push_to_hub") or kwargs.get("distributed_checkpoint") or not is_main_process:
                return super().save_pretrained(save_directory, is_main_process, *args, **kwargs)
            self._save_all_or_nothing(save_directory, is_main_process, *args, **kwargs)
        finally:
            if sparse:
                self.config.sparse_prediction = True

    def _save_all_or_nothing(self, save_directory, is_main_process, *args, **kwargs):
        target = os.path.abspath(os.fspath(save_directory))
        if os.path.isfile(target):
            raise ValueError(f"save_pretrained needs a directory, but {target} is a file")
        parent, name = os.path.split(target)
        os.makedirs(parent, exist_ok=True)
        _remove_stale_staging(parent, name)
        # os.mkdir (not tempfile.mkdtemp, which makes it 0700) so the directory gets the usual umask mode.
        staging = os.path.join(parent, f".{name}.saving-{_owner_tag()}-{uuid.uuid4().hex[:12]}")
        os.mkdir(staging)
        try:
            super().save_pretrained(staging, is_main_process, *args, **kwargs)
            if not os.path.exists(target):
                os.rename(staging, target)
                return
            new_names = set(os.listdir(staging))
            for entry in os.listdir(target):
                # The old model's own files stay behind (a previous save's shards would mix with ours).
                if entry in new_names or self._WEIGHTS_FILE.fullmatch(entry):
                    continue
                _link_tree(os.path.join(target, entry), os.path.join(staging, entry))
            if _exchange_directories(staging, target):
                shutil.rmtree(staging)  # now the old checkpoint
                return
            aside = staging.replace(".saving-", ".replaced-")
            os.rename(target, aside)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(aside, target)  # the old checkpoint goes back
                raise
            shutil.rmtree(aside)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            aside = staging.replace(".saving-", ".replaced-")
            if os.path.exists(aside) and os.path.exists(target):
                shutil.rmtree(aside, ignore_errors=True)

    def _check_model_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds):
        """Turn inputs that torch would reject with an opaque IndexError into a ValueError that
        names the value. Skipped while compiling (data-dependent checks would break the graph).
        Value checks read the tensors on the host only when they are on the CPU; on an accelerator
        that would make every forward wait for the device, so there they run as asynchronous device
        asserts (`torch._assert_async`): the error names the tensor and the allowed range, and
        surfaces at the next synchronisation."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
        if len(shape) != 2:
            raise ValueError(f"input_ids must have shape (batch, sequence), got {shape}")
        if torch.compiler.is_compiling():
            return
        config = self.config
        if 0 in shape:
            raise ValueError(f"the input has an empty dimension: shape {shape}; pass at least one sequence of one token")
        for name, t in (("input_ids", input_ids), ("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                raise ValueError(f"{name} must hold integer ids, got dtype {t.dtype}")
        if inputs_embeds is not None and inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(
                f"inputs_embeds has width {inputs_embeds.shape[-1]} but config.hidden_size = {config.hidden_size}"
            )
        for name, ids, limit, field in (
            ("input_ids", input_ids, config.vocab_size, "vocab_size"),
            ("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size"),
        ):
            if ids is None or ids.numel() == 0:
                continue
            if tuple(ids.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(ids.shape)} but the input has shape {shape}")
            hint = f"check that the tokenizer matches this model (config.{field} = {limit})"
            if not _values_on_host(ids):
                _device_assert(((ids >= 0) & (ids < limit)).all(), f"{name} contains an id outside [0, {field}={limit}); {hint}")
                continue
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                raise ValueError(f"{name} contains {bad}, outside [0, {field}={limit}); {hint}")
        if attention_mask is not None and tuple(attention_mask.shape) != shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the input has shape {shape}; "
                "pass a (batch, sequence) mask of 1 for tokens and 0 for padding"
            )
        if attention_mask is not None:
            binary = attention_mask.eq(0) | attention_mask.eq(1)
            if not _values_on_host(attention_mask):
                _device_assert(binary.all(), "attention_mask must hold 1 for tokens and 0 for padding, got other values")
            elif not binary.all():
                values = attention_mask.unique().tolist()
                raise ValueError(
                    f"attention_mask must hold 1 for tokens and 0 for padding, got values {values[:8]}"
                    + (" ..." if len(values) > 8 else "")
                )
        if position_ids is not None:
            pshape = tuple(position_ids.shape)
            if len(pshape) != 2 or pshape[1] != shape[1] or pshape[0] not in (1, shape[0]):
                raise ValueError(f"position_ids has shape {pshape}; pass (batch, sequence) or (1, sequence) for input shape {shape}")
            if not _values_on_host(position_ids):
                _device_assert((position_ids >= 0).all(), "position_ids contains a negative value; positions start at 0")
            elif int(position_ids.min()) < 0:
                raise ValueError(f"position_ids contains {int(position_ids.min())}; positions start at 0")
        if config.position_embedding_type == "learned":
            limit = config.max_position_embeddings
            message = (
                "sequence needs position {} but learned positions stop at "
                f"max_position_embeddings - 1 = {limit - 1}; truncate the input "
                "(tokenizer(..., truncation=True)) or use position_embedding_type='sinusoidal'"
            )
            if position_ids is not None and not _values_on_host(position_ids):
                _device_assert((position_ids < limit).all(), message.format(f">= {limit}"))
                return
            longest = int(position_ids.max()) + 1 if position_ids is not None else shape[1]
            if longest > limit:
                raise ValueError(message.format(longest - 1))


def _values_on_host(t: torch.Tensor) -> bool:
    """Whether an input check may read `t`'s values on the host: yes on the CPU; on an accelerator
    (CUDA, ...) reading them would synchronise with the device on every forward."""
    return t.device.type == "cpu"


def _device_assert(condition: torch.Tensor, message: str) -> None:
    """An assert that runs on the device without a host sync: a failing one raises at the next
    synchronisation (on CUDA a device-side assert naming `message`)."""
    torch._assert_async(condition, message)


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


def _block_diagonal_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, s) packed position ids -> (1, 1, s, s) additive mask letting a token attend only inside its
    own sequence (a sequence starts where its position id is 0). Tensor ops only, so it compiles."""
    seq = position_ids.eq(0).cumsum(-1)  # (1, s): index of the sequence each token belongs to
    same = seq[:, :, None] == seq[:, None, :]  # (1, s, s)
    return (~same[:, None]).to(dtype) * torch.finfo(dtype).min


def _sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(1, s) position ids of a packed row -> (n,) index of each sequence's first token: token 0 and
    every token whose position id restarts at 0 (DataCollatorWithFlattening's convention)."""
    first = position_ids.view(-1).eq(0)
    first[0] = True
    return first.nonzero().squeeze(1)


def _is_flash(impl: str | None) -> bool:
    """flash-attention backends take variable-length sequences natively (cu_seqlens)."""
    return impl is not None and "flash" in impl and "paged" not in impl


@dataclass
class UnpadState:
    """Where the real tokens of a batch live; built once per forward, read by every layer.

    batch_shape: (b, s) of the input. indices: (T,) the real tokens' positions in the flattened (b*s)
    input, row by row, or None when every position is a token (a packed row). The n sequences, each
    contiguous among the T tokens: cu_seqlens (n + 1,) int32 and max_seqlen m for flash-attention
    varlen; for the other backends a compact (n, m) grid: grid_index (T,) each token's slot in it and
    grid_mask (n, 1, 1, m) its additive mask (0 = token, dtype minimum = empty slot), or None.
    """

    batch_shape: tuple[int, int]
    indices: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int
    grid_index: torch.Tensor
    grid_mask: torch.Tensor | None

    @classmethod
    def from_padding_mask(cls, attention_mask: torch.Tensor, dtype: torch.dtype) -> "UnpadState":
        """A padded batch; any padding pattern (left, right, holes): a row's tokens attend to each other."""
        b, s = attention_mask.shape
        keep = attention_mask.bool()
        indices = keep.flatten().nonzero().squeeze(1)  # (T,) row-major, so each row's tokens are contiguous
        return cls._from_lengths((b, s), indices, keep.sum(1), dtype)

    @classmethod
    def from_packed(cls, total: int, starts: torch.Tensor, dtype: torch.dtype) -> "UnpadState":
        """One row of `total` tokens holding sequences back to back; starts: (n,) their first indices."""
        bounds = torch.cat([starts.long(), torch.tensor([total], device=starts.device)])  # (n + 1,)
        return cls._from_lengths((1, total), None, bounds.diff(), dtype)

    @classmethod
    def _from_lengths(cls, batch_shape, indices, lengths, dtype) -> "UnpadState":
        device = lengths.device
        n, m = lengths.numel(), int(lengths.max()) if lengths.numel() else 0
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))  # (n + 1,)
        total = int(cu_seqlens[-1])
        seq = torch.repeat_interleave(torch.arange(n, device=device), lengths)  # (T,) each token's sequence
        slot = torch.arange(total, device=device) - cu_seqlens[seq]  # (T,) its place in that sequence
        valid = torch.arange(m, device=device)[None, :] < lengths[:, None]  # (n, m)
        mask = None if bool(valid.all()) else _additive_padding_mask(valid, dtype)
        return cls(batch_shape, indices, cu_seqlens.int(), m, seq * m + slot, mask)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(b, s, ...) -> (T, ...): the real tokens."""
        t = t.flatten(0, 1)
        return t if self.indices is None else t.index_select(0, self.indices)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (b, s, H) with zeros at padding."""
        b, s = self.batch_shape
        if self.indices is None:
            return x.view(b, s, -1)
        return x.new_zeros(b * s, x.size(-1)).index_copy(0, self.indices, x).view(b, s, -1)


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

    def _unpad_state(self, input_shape, attention_mask, position_ids, dtype, output_attentions, kwargs):
        """The token map of the unpadded path (docstring item 6), or None for the padded path: no
        padding, `unpad_inputs=False`, attention probabilities asked for (eager needs the full square),
        a backend without a varlen route (flex), or compiling (the map has data-dependent shapes).
        Packed flash-attention kwargs from `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
        are taken from `kwargs` (and removed: each layer gets them from the map)."""
        cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(name, None)
        impl = self.config._attn_implementation
        if (
            not self.config.unpad_inputs
            or output_attentions
            or torch.compiler.is_compiling()
            or not (impl in ("eager", "sdpa") or _is_flash(impl))
        ):
            return None
        b, s = input_shape
        if attention_mask is not None and not bool(attention_mask.all()):
            return UnpadState.from_padding_mask(attention_mask, dtype)
        if b != 1:
            return None
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(torch.long).view(-1)
            if int(cu_seqlens[-1]) != s or int(cu_seqlens[0]) != 0:
                raise ValueError(
                    f"cu_seq_lens_q {cu_seqlens.tolist()} must run from 0 to the packed length {s}; pass the "
                    "collator's kwargs unchanged (DataCollatorWithFlattening(return_flash_attn_kwargs=True))"
                )
            starts = cu_seqlens[:-1]
        elif position_ids is not None:
            starts = _sequence_starts(position_ids)
        else:
            return None
        return UnpadState.from_packed(s, starts, dtype) if starts.numel() > 1 else None

    def _attention_mask(self, attention_mask, embeddings, output_attentions, position_ids=None):
        """Built once per forward in the format the chosen backend wants."""
        if attention_mask is None and position_ids is not None and position_ids.size(0) == 1 and embeddings.size(1) > 1:
            # Possibly a packed row (DataCollatorWithFlattening): keep attention inside each sequence.
            # flash finds the sequences in position_ids itself; the others get a block-diagonal mask.
            if _is_flash(self.config._attn_implementation) and not output_attentions:
                return None
            if not torch.compiler.is_compiling() and _sequence_starts(position_ids).numel() == 1:
                return None  # one sequence: nothing to separate
            return _block_diagonal_mask(position_ids, embeddings.dtype)
        if attention_mask is None or (not torch.compiler.is_compiling() and bool(attention_mask.all())):
            return None  # nothing to mask: lets SDPA / flash take their fastest path
        if output_attentions or self.config._attn_implementation in ("eager", "sdpa"):
            return _additive_padding_mask(attention_mask, embeddings.dtype)
        # flash_attention_2 takes the 2-D mask (and unpads), flex_attention a BlockMask.
        return _bidirectional_mask(self.config, embeddings, attention_mask)

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
        input_shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
        dtype = self.embeddings.word_embeddings.weight.dtype if inputs_embeds is None else inputs_embeds.dtype
        unpad = self._unpad_state(input_shape, attention_mask, position_ids, dtype, output_attentions, kwargs)
        if unpad is not None:
            return self._forward_unpadded(
                unpad, input_ids, token_type_ids, position_ids, inputs_embeds, output_hidden_states, return_dict, **kwargs
            )

        hidden_states = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # (b, s, H)
        if _is_flash(self.config._attn_implementation) and attention_mask is None and position_ids is not None:
            kwargs["position_ids"] = position_ids  # flash-attention finds packed sequences in them
        mask = self._attention_mask(attention_mask, hidden_states, output_attentions, position_ids)
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

    def _forward_unpadded(
        self, unpad, input_ids, token_type_ids, position_ids, inputs_embeds, output_hidden_states, return_dict, **kwargs
    ):
        """The encoder on real tokens only: gather once, run every layer on (T, H), scatter once."""
        b, s = unpad.batch_shape
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if position_ids is None:
            position_ids = torch.arange(s, device=device)[None, :]  # (1, s)
        position_ids = position_ids.expand(b, s)

        def tokens(t):  # (b, s[, H]) -> (1, T[, H]), the layout the embeddings take
            return None if t is None else unpad.gather(t).unsqueeze(0)

        hidden_states = self.embeddings(
            tokens(input_ids), tokens(token_type_ids), tokens(position_ids), tokens(inputs_embeds)
        )[0]  # (T, H)
        all_hidden = (unpad.scatter(hidden_states),) if output_hidden_states else None
        for layer in self.layers:
            hidden_states, _ = layer(hidden_states, None, unpad=unpad, **kwargs)  # (T, H)
            if output_hidden_states:
                all_hidden += (unpad.scatter(hidden_states),)
        hidden_states = all_hidden[-1] if output_hidden_states else unpad.scatter(hidden_states)  # (b, s, H)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None
        out = BaseModelOutputWithPooling(
            last_hidden_state=hidden_states, pooler_output=pooled, hidden_states=all_hidden, attentions=None
        )
        return out if return_dict else out.to_tuple()


def _mlm_logits_and_loss(model, sequence_output, labels, num_items_in_batch):
    """The MLM head and `masked_lm_loss` for (b, s, H) states and (b, s) labels. With
    `config.sparse_prediction` the head runs only on the n labelled positions (docstring item 7) and
    the logits are (n, V); the loss is the same number either way, since unlabelled positions add 0.
    cross_entropy already fuses log-softmax and the gather, so the loss needs no hand-written kernel."""
    if tuple(labels.shape) != tuple(sequence_output.shape[:-1]):
        raise ValueError(
            f"labels have shape {tuple(labels.shape)} but the input has shape {tuple(sequence_output.shape[:-1])}; "
            "pass one label per token (-100 where there is nothing to predict)"
        )
    if model.config.sparse_prediction and not torch.compiler.is_compiling():
        labels = labels.reshape(-1)
        keep = labels.ne(IGNORE_INDEX).nonzero().squeeze(1)  # (n,)
        hidden = sequence_output.reshape(-1, sequence_output.size(-1)).index_select(0, keep)  # (n, H)
        logits = model.lm_head(hidden)  # (n, V)
        return logits, masked_lm_loss(logits, labels.index_select(0, keep), num_items_in_batch)
    logits = model.lm_head(sequence_output)  # (b, s, V)
    return logits, masked_lm_loss(logits, labels, num_items_in_batch)


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
        if labels is None:
            logits, loss = self.lm_head(outputs.last_hidden_state), None  # (b, s, V)
        else:
            logits, loss = _mlm_logits_and_loss(self, outputs.last_hidden_state, labels, num_items_in_batch)
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
        nsp_logits = self.nsp_head(outputs.pooler_output)  # (b, 2)
        loss = None
        if labels is None or next_sentence_label is None:
            prediction_logits = self.lm_head(outputs.last_hidden_state)  # (b, s, V)
        else:
            prediction_logits, mlm = _mlm_logits_and_loss(self, outputs.last_hidden_state, labels, num_items_in_batch)
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
