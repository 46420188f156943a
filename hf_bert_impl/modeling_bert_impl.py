"""hf-bert-impl: a from-scratch BERT encoder and its eight task heads, as a transformers model.

References: [1] Vaswani et al., "Attention Is All You Need" (2017), arXiv:1706.03762 (attention,
multi-head attention, sinusoidal positions); [2] Devlin et al., "BERT: Pre-training of Deep
Bidirectional Transformers for Language Understanding" (2019), arXiv:1810.04805 (post-LN encoder,
pooler, MLM and NSP); [3] transformers' models/bert/modeling_bert.py (the numerical reference) and
models/modernbert/modular_modernbert.py (short names, unpadding, sparse prediction).

How it differs from transformers' BERT:
  1. Positions default to the fixed sinusoidal encoding of [1] (not stored, any length); "learned" = BERT's table.
  2. Q, K and V come from one fused projection `Wqkv` = [W^Q; W^K; W^V].
  3. The MLM loss divides by `num_items_in_batch` when Trainer passes it (accumulation = one large batch).
  4. `output_attentions=True` returns real probabilities under every backend (that call runs eager).
  5. Bad inputs raise a ValueError naming the value, not an IndexError deep inside torch.
  6. Unpadding: padded and packed (DataCollatorWithFlattening) batches run the layers on their real
     tokens only, attention per sequence (`TokenMap`); padding positions of the outputs hold zeros.
  7. `config.sparse_prediction` (training): the MLM head runs on the labelled positions only.
  8. CPU float32 / bfloat16 linear layers may run on oneDNN instead of torch's BLAS (float32 inference: GELU inside the GEMM),
     and the MLM decoder's backward skips positions without a label (`BertImplLinear`).
  9. `save_pretrained` is all or nothing; `from_pretrained` refuses pickled-only, corrupt or incomplete
     checkpoints (`CheckpointSafetyMixin` of checkpoint_bert_impl.py).
  10. CPU dropout masks from 32 random bits per element where torch draws them serially (`_dropout`; attention: eager).

Shape legend: b batch, s sequence, T real tokens, n sequences, m longest sequence, h heads,
d head dim (d_k), H hidden (= h * d), V vocabulary, c choices.

Remote code: imports only torch, transformers, `.configuration_bert_impl` and `.checkpoint_bert_impl`
(item 9); runs on transformers 4.57.x and 5.x (the shims below).
"""

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_bert_impl import BertImplConfig  # first: it refuses a too-old transformers with one clear error
from .checkpoint_bert_impl import CheckpointSafetyMixin  # all-or-nothing save_pretrained, refusing from_pretrained

from transformers import PreTrainedModel
from transformers import masking_utils
from transformers.activations import ACT2FN, GELUActivation, GELUTanh, NewGELUActivation
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (BaseModelOutputWithPooling, MaskedLMOutput, MultipleChoiceModelOutput,
    NextSentencePredictorOutput, QuestionAnsweringModelOutput, SequenceClassifierOutput, TokenClassifierOutput)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput
from transformers.utils import can_return_tuple

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------
# transformers 4.57 / 5.x: one named shim per API that differs, each using the newer API where it exists.

try:  # 5.x: init functions that skip tensors loaded from a checkpoint
    from transformers import initialization as _hf_init
except ImportError:  # 4.57: _init_weights runs only on modules whose weights were not loaded
    _hf_init = None


def _init_copy_(tensor: torch.Tensor, value: torch.Tensor) -> None:  # at init; transformers.initialization.copy_ if any
    with torch.no_grad():
        (_hf_init.copy_ if _hf_init is not None else torch.Tensor.copy_)(tensor, value)


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
# The GEMM library of CPU linear layers (item 8)


def _onednn_agrees(dtype: torch.dtype = torch.float32, tol: float = 1e-5, post=("none", [], ""), act=None) -> bool:
    """Whether oneDNN's linear, post-op `post`, reproduces `act`(F.linear) in `dtype` (bias, none, Wᵀ); an error means no."""
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b, y = (torch.randn(*shape, generator=g).to(dtype) for shape in ((5, 8), (3, 8), (3,), (5, 3)))
        return all(torch.allclose(_ONEDNN_LINEAR(*args, *post).float(), (act or nn.Identity())(F.linear(*args)).float(),
                                  atol=tol, rtol=tol) for args in ((x, w, b), (x, w, None), (y, w.t(), None)))
    except Exception:  # noqa: BLE001  any failure of an internal op means: do not use it
        return False


# oneDNN's linear op (torch.compile's CPU GEMM) and the dtypes where it reproduces F.linear, probed at import; else nn.Linear's.
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
_ONEDNN_DTYPES = tuple(dt for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)) if _onednn_agrees(dt, tol))
if torch.float32 not in _ONEDNN_DTYPES:
    _ONEDNN_LINEAR, _ONEDNN_DTYPES = None, ()
# activation class -> oneDNN's post-op applying it inside the float32 GEMM (inference), where a probe at import agrees
_ONEDNN_ACTS = {cls: post for cls, post in {GELUActivation: ("gelu", [], "none"), GELUTanh: ("gelu", [], "tanh"),
                NewGELUActivation: ("gelu", [], "tanh"), nn.ReLU: ("relu", [], "")}.items() if _onednn_agrees(post=post, act=cls())}

# "auto" takes oneDNN for: fp32 on AMD (MKL's is slow there; on Intel it wins), bf16 on both (both paths run oneDNN's GEMM;
# its op fuses the bias, and it is the bf16 branch measured on Intel). Others: torch's BLAS, as transformers does.
_AUTO_KERNEL = {("AuthenticAMD", torch.float32), ("AuthenticAMD", torch.bfloat16), ("GenuineIntel", torch.bfloat16)}
_PER_SEQUENCE_DEVICES = ("cpu",)  # where unpadded sequences attend one call each, not on a masked grid (`TokenMap`)


def _cpu_vendor() -> str:
    """The `vendor_id` of /proc/cpuinfo (e.g. AuthenticAMD, GenuineIntel); "" when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


_CPU_VENDOR = _cpu_vendor()  # read once, at import (never inside a forward, so torch.compile sees no I/O)
_SERIAL_BERNOULLI = not (torch.backends.mkl.is_available() and _CPU_VENDOR == "GenuineIntel")  # torch's CPU bernoulli_ (item 10)


def linear_kernel(setting="auto", dtype: torch.dtype = torch.float32) -> str:
    """The GEMM library of CPU linear layers computing in `dtype` for `config.onednn_linear = setting`: "onednn" or "blas"
    (torch's own, as nn.Linear). True / False force it; "auto": by CPU vendor and dtype. "blas" where oneDNN's op is
    missing or does not reproduce F.linear in `dtype` (`_ONEDNN_DTYPES`)."""
    auto = setting == "auto" and (_CPU_VENDOR, dtype) in _AUTO_KERNEL
    return "onednn" if dtype in _ONEDNN_DTYPES and (setting is True or auto) else "blas"


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias, onednn: bool) -> torch.Tensor:  # x Wᵀ + b
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "") if onednn else F.linear(x, weight, bias)


class _LinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b with its backward written out (dx = dy W, dW = dyᵀ x, db = Σ dy) where nn.Linear falls short. (1) oneDNN's
    op has no autograd formula; it copies dyᵀ, which torch.mm reads as a strided view, so dW goes through torch.mm in bfloat16
    and, in float32, for outputs over 8x wider than the input. (2) `skip_zero_rows` (the MLM decoder): rows of dy that are all
    zero (positions without a label) add nothing; when at most half are left the backward runs on those (docs/benchmarks.md)."""

    @staticmethod
    def forward(x, weight, bias, onednn: bool, skip_zero_rows: bool):
        return _gemm(x, weight, bias, onednn)

    @staticmethod
    def setup_context(ctx, inputs, output):  # apart from forward: torch.func transforms (grad) can then run it
        x, weight, _, ctx.onednn, ctx.skip_zero_rows = inputs
        ctx.save_for_backward(x, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x, weight), need = ctx.saved_tensors, ctx.needs_input_grad
        grad_2d, x_2d = grad.reshape(-1, grad.size(-1)), x.reshape(-1, x.size(-1))  # (N, out), (N, in)
        rows = grad_2d.ne(0).any(1).nonzero().squeeze(1) if ctx.skip_zero_rows else None  # (n,) not all zero
        if rows is not None and 2 * rows.numel() <= grad_2d.size(0):
            grad_2d, x_2d = grad_2d.index_select(0, rows), x_2d.index_select(0, rows)  # (n, out), (n, in)
        grad_x = _gemm(grad_2d, weight.t(), None, ctx.onednn) if need[0] else None  # (N, in) or (n, in)
        if grad_x is not None and grad_x.size(0) < x.numel() // x.size(-1):  # the skipped rows' dx is zero
            grad_x = x.new_zeros(x.shape).view(-1, x.size(-1)).index_copy_(0, rows, grad_x)
        by_mm = not ctx.onednn or grad.dtype == torch.bfloat16 or grad_2d.size(1) > 8 * x_2d.size(1)
        grad_w = (torch.mm(grad_2d.t(), x_2d) if by_mm else _gemm(grad_2d.t(), x_2d.t(), None, True)) if need[1] else None
        return None if grad_x is None else grad_x.view(x.shape), grad_w, grad_2d.sum(0) if need[2] else None, None, None


_CAST_BUFFERS = threading.local()  # per thread: (shape, dtype) -> the buffer no-grad casts of weights of that shape reuse


class BertImplLinear(nn.Linear):
    """nn.Linear on oneDNN where `linear_kernel(config.onednn_linear, dtype)` says so; `skip_zero_rows`: in training, the backward
    skips rows whose gradient is zero (`_LinearFunction`). forward(x, act) = act(x Wᵀ + b); in float32 inference on oneDNN an
    unhooked GELU / ReLU runs inside the GEMM (`_ONEDNN_ACTS`: no pass over, nor buffer for, the pre-activation). Per call only
    what can change is looked at: dtype, device, plain tensors, grad mode, CPU autocast (GEMM in bf16 on either path), capture."""

    def __init__(self, config: BertImplConfig, in_features: int, out_features: int, skip_zero_rows: bool = False):
        super().__init__(in_features, out_features)
        self.config, self.skip_zero_rows = config, skip_zero_rows

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        w, b, autocast, grad = self.weight, self.bias, torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()
        dtype = torch.get_autocast_dtype("cpu") if autocast else x.dtype  # the dtype the GEMM runs in
        plain = (w.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and x.numel() > 0
                 and (x.dtype == w.dtype or autocast and {x.dtype, w.dtype} <= {torch.float32, torch.bfloat16})
                 and type(x) is torch.Tensor and type(w) in (torch.Tensor, nn.Parameter) and not (torch.compiler.is_compiling()
                 or torch.jit.is_tracing() or torch.jit.is_scripting() or torch.onnx.is_in_onnx_export()))
        onednn = plain and linear_kernel(self.config.onednn_linear, dtype) == "onednn"
        skip_zero_rows = plain and self.skip_zero_rows and grad
        post = (_ONEDNN_ACTS.get(type(act)) if onednn and dtype == torch.float32 and act is not None and not grad
                and not (act._forward_hooks or act._forward_pre_hooks) else None)  # oneDNN's post-op computing act
        if onednn or skip_zero_rows:
            if onednn and w.dtype != dtype and not grad:  # autocast inference: cast anew each call into a
                buffers, key = vars(_CAST_BUFFERS), (tuple(w.shape), dtype)  # kept buffer; a fresh copy per call can cost more
                w = (buffers[key] if key in buffers else buffers.setdefault(key, w.new_empty(w.shape, dtype=dtype))).copy_(w)
            x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
            y = _ONEDNN_LINEAR(x, w, b, *post) if post else _LinearFunction.apply(x, w, b, onednn, skip_zero_rows)
        else:
            y = F.linear(x, w, b)
        return y if act is None or post else act(y)


def _own_mask(x: torch.Tensor, p: float, training: bool) -> bool:  # where torch would draw the mask element by element
    return training and 0 < p < 1 and _SERIAL_BERNOULLI and x.is_cpu and type(x) is torch.Tensor and not torch.compiler.is_compiling()


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout as BERT applies it (inverted): in training each element kept with probability 1 - p and scaled by 1/(1 - p), else
    0. F.dropout, but where `_own_mask`: kept iff 32 random bits of torch's generator (int32) < (1 - p)·2^32 - 2^31 (p to 2^-32)."""
    if not _own_mask(x, p, training):
        return F.dropout(x, p, training)
    bits = torch.empty((x.numel() + 1) // 2, dtype=torch.int64, device="cpu").random_(-2**63, None).view(torch.int32)
    return x * (bits[:x.numel()].view(x.shape) < min(round((1 - p) * 2**32), 2**32 - 1) - 2**31) * (1 / (1 - p))


class BertImplDropout(nn.Dropout):  # nn.Dropout through `_dropout`
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(x, self.p, self.training)


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
    probs = _dropout(probs, dropout, module.training)
    out = torch.matmul(probs, value)  # (b, h, s, d)
    return out.transpose(1, 2).contiguous(), probs  # (b, s, h, d)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """The masked-LM loss of [2]: L = -Σ_i log P(x_i | x_\\i) over the positions whose label is not -100.

    Divided by the number of such positions in this batch, or by `num_items_in_batch` when the caller (Trainer) passes the count
    over all accumulated micro-batches, so that 4 accumulated batches of 2 give exactly the update of one batch of 8. A batch with
    no masked position gives 0, not NaN (transformers' ForMaskedLMLoss takes a mean there, NaN). logits: (..., V), labels: (...).
    Half-precision logits are not cast: their per-token losses (as transformers' BertForMaskedLM's) are summed in float32, sparing
    a float32 copy of the (N, V) logits. On the CPU only labelled rows enter the cross-entropy (the rest add 0).
    """
    logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)  # (N, V), (N,)
    keep = labels.ne(IGNORE_INDEX).nonzero().squeeze(1) if _values_on_host(labels) and not torch.compiler.is_compiling() else None
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
            pe = sinusoidal_position_encoding(config.max_position_embeddings, config.hidden_size)  # (P, H)
            self.register_buffer("position_encoding", pe, persistent=False)  # fixed by the formula: not a weight, not saved
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = BertImplDropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None) -> torch.Tensor:
        """ids: (b, s), position_ids (b|1, s), inputs_embeds (b, s, H) -> (b, s, H)."""
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (b, s, H)
        s = inputs_embeds.size(1)
        built = position_ids is None  # then the positions are 0 .. s-1, known without reading them
        if built:
            position_ids = torch.arange(s, device=inputs_embeds.device).unsqueeze(0)  # (1, s)
        dtype = self.word_embeddings.weight.dtype
        if self.config.position_embedding_type == "learned":
            positions = self.position_embeddings(position_ids)  # (b|1, s, H)
        else:  # the stored rows when every position is known to be among them, else the formula at each position
            # (it holds past the rows; and on an accelerator reading the largest position would be a host sync)
            P = self.position_encoding.size(0)
            stored = s <= P if built else torch.compiler.is_compiling() or _values_on_host(position_ids) and (
                not position_ids.numel() or int(position_ids.max()) < P)
            positions = (F.embedding(position_ids, self.position_encoding.to(dtype)) if stored
                         else _sinusoid(position_ids, self.config.hidden_size).to(dtype))  # (b|1, s, H)
        types = self.token_type_embeddings.weight[0] if token_type_ids is None else self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + types + positions  # no token types given: all type 0
        return self.dropout(self.LayerNorm(embeddings))  # (b, s, H)


@dataclass
class TokenMap:
    """Where the tokens the layers run on sit; built once per forward, read by every layer.

    The layers run on the padded batch (b, s, H), or on its T real tokens (1, T, H) with each sequence contiguous; `indices`
    (T,) are their places in the flattened (b*s) batch (None: every position). Attention sees them as `grid` (n, m), n
    sequences of m slots, with `mask` (additive, or the backend's format) or None. The padded batch is its own grid (b, s).
    Real tokens stay a (1, T) grid and attend per sequence: one unmasked call each of `seq_lengths` on CPU (no work on
    padding), cu_seqlens (n + 1,) and max_seqlen in `attention_kwargs` for flash-attention (varlen); elsewhere they go to
    slots `grid_index` (T,) of a compact masked grid (m = the longest).
    """

    batch_shape: tuple[int, int]
    grid: tuple[int, int]
    mask: object = None
    indices: torch.Tensor | None = None
    grid_index: torch.Tensor | None = None
    seq_lengths: tuple[int, ...] | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    attention_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_padding_mask(cls, attention_mask: torch.Tensor, row_lengths: list[int], dtype, flash: bool) -> "TokenMap":
        """A padded batch; any padding pattern (left, right, holes): a row's tokens attend to each other.
        row_lengths: each row's token count, read on the host once (every size below follows from it)."""
        keep = attention_mask.bool()
        indices = keep.flatten().nonzero_static(size=sum(row_lengths)).squeeze(1)  # (T,) row-major: rows contiguous
        return cls._from_lengths(tuple(keep.shape), indices, keep.sum(1), row_lengths, dtype, flash)

    @classmethod
    def from_packed(cls, total: int, starts: torch.Tensor, dtype, flash: bool) -> "TokenMap":
        """One row of `total` tokens holding sequences back to back; starts: (n,) their first indices."""
        lengths = torch.cat([starts.long(), torch.tensor([total], device=starts.device)]).diff()  # (n,)
        return cls._from_lengths((1, total), None, lengths, lengths.tolist(), dtype, flash)

    @classmethod
    def _from_lengths(cls, batch_shape, indices, lengths, host_lengths, dtype, flash) -> "TokenMap":
        device, n, total = lengths.device, len(host_lengths), sum(host_lengths)
        m = max(max(host_lengths), 1)  # an all-padding batch keeps a grid of empty slots: finite, no special case
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))  # (n + 1,)
        common = dict(indices=indices, cu_seqlens=cu_seqlens.int(), max_seqlen=m)
        if flash:
            kwargs = dict(cu_seq_lens_q=common["cu_seqlens"], cu_seq_lens_k=common["cu_seqlens"], max_length_q=m, max_length_k=m)
            return cls(batch_shape, (1, total), attention_kwargs=kwargs, **common)
        if device.type in _PER_SEQUENCE_DEVICES and total:  # empty rows have nothing to attend
            return cls(batch_shape, (1, total), seq_lengths=tuple(length for length in host_lengths if length), **common)
        seq = torch.repeat_interleave(torch.arange(n, device=device), lengths, output_size=total)  # (T,) each token's sequence
        slot = torch.arange(total, device=device) - cu_seqlens[seq]  # (T,) its place in that sequence
        valid = torch.arange(m, device=device)[None, :] < lengths[:, None]  # (n, m)
        mask = None if min(host_lengths) == m else _additive_padding_mask(valid, dtype)  # (n, 1, 1, m)
        return cls(batch_shape, (n, m), mask, grid_index=seq * m + slot, **common)

    def gather(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """An input (b, s[, H]) or (1, s) -> the layout the layers run on: itself, or (1, T[, H])."""
        if t is None or self.indices is None:
            return t
        t = t.expand(*self.batch_shape, *t.shape[2:]).flatten(0, 1)  # (b*s[, H])
        return t.index_select(0, self.indices).unsqueeze(0)  # (1, T[, H])

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states in the layers' layout -> (b, s, H), zeros at padding."""
        if self.indices is None:  # every position ran: x is (b, s, H) already
            return x
        b, s = self.batch_shape
        x = x.reshape(-1, x.size(-1))  # (T, H)
        return x.new_zeros(b * s, x.size(-1)).index_copy(0, self.indices, x).view(b, s, -1)


def _additive_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(b, s) 1/0 mask -> (b, 1, 1, s) additive: 0 to attend, else the dtype's minimum (an all-padding row: uniform, not NaN)."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def _block_diagonal_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, s) packed position ids -> (1, 1, s, s) additive mask: attend inside one's sequence (from position id 0); compiles."""
    seq = position_ids.eq(0).cumsum(-1)  # (1, s): index of the sequence each token belongs to
    same = seq[:, :, None] == seq[:, None, :]  # (1, s, s)
    return (~same[:, None]).to(dtype) * torch.finfo(dtype).min  # (1, 1, s, s)


def _sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(1, s) position ids of a packed row -> (n,) index of each sequence's first token: token 0 and
    every token whose position id restarts at 0 (DataCollatorWithFlattening's convention)."""
    first = position_ids.view(-1).eq(0)
    first[0] = True
    return first.nonzero().squeeze(1)


def _is_flash(impl: str | None) -> bool:  # flash-attention backends take variable-length sequences (cu_seqlens)
    return impl is not None and "flash" in impl and "paged" not in impl


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

    def forward(self, hidden_states: torch.Tensor, tokens: TokenMap, output_attentions: bool = False, **kwargs):
        """hidden_states (b, s, H) or (1, T, H) as `tokens` says -> that shape, and if output_attentions (b, h, s, s) probs."""
        (n, m), h, d = tokens.grid, self.num_heads, self.head_dim
        qkv = self.Wqkv(hidden_states)  # (b, s, 3H) or (1, T, 3H)
        if tokens.grid_index is not None:  # each real token into its slot of the (n, m) grid
            qkv = qkv.new_zeros(n * m, 3 * h * d).index_copy(0, tokens.grid_index, qkv.view(-1, 3 * h * d))  # (n*m, 3H)
        parts = qkv.split(tokens.seq_lengths, dim=1) if tokens.seq_lengths is not None else (qkv.view(n, m, 3 * h * d),)
        impl = self.config._attn_implementation  # eager: materialises probabilities; draws `_dropout`'s mask (SDPA: no CPU dropout)
        impl = "eager" if output_attentions or impl == "sdpa" and _own_mask(qkv, self.attention_dropout, self.training) else impl
        outs = [_attention_function(impl)(self, *part.unflatten(-1, (3, h, d)).permute(2, 0, 3, 1, 4), tokens.mask, scaling=self.scaling,
                                          dropout=self.attention_dropout if self.training else 0.0, **tokens.attention_kwargs, **kwargs)
                for part in parts]  # one call on the (n, m) grid or one per sequence (1, L): q, k, v (n, h, m, d) -> (out, probs)
        out, probs = outs[0] if len(outs) == 1 else (torch.cat([o for o, _ in outs], 1), None)  # out: (n, m, h, d)
        if tokens.grid_index is not None:  # from the grid's slots back to the real tokens
            out = out.reshape(n * m, h * d).index_select(0, tokens.grid_index)  # (T, H)
        return self.Wo(out.reshape(hidden_states.shape)), probs  # like hidden_states


class BertImplMLP(nn.Module):
    """Position-wise feed-forward block: Wo(act(Wi x)); on oneDNN in float32 inference act runs inside Wi's GEMM."""

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
        self.dropout = BertImplDropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, tokens: TokenMap, output_attentions=False, **kwargs):
        attn_out, probs = self.attn(hidden_states, tokens, output_attentions, **kwargs)
        hidden_states = self.attn_norm(hidden_states + self.dropout(attn_out))
        return self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states))), probs


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


def _values_on_host(t: torch.Tensor) -> bool:  # may a check read t's values? on the CPU; an accelerator would sync
    return t.device.type == "cpu"


def _device_assert(condition: torch.Tensor, message: str) -> None:  # no host sync: a failure raises at the next sync
    torch._assert_async(condition, message)


def _check_range(t: torch.Tensor, low: int | None, high: int | None, message: str, device_message: str) -> None:
    """ValueError(message.format(the bad value)) unless low <= t < high (None: no bound); on an accelerator an async assert."""
    has_low, has_high = low is not None, high is not None  # which bounds apply
    if not _values_on_host(t):
        _device_assert(((t >= low if has_low else True) & (t < high if has_high else True)).all(), device_message)
        return
    lo, hi = int(t.min()), int(t.max())
    if has_low and lo < low or has_high and hi >= high:
        raise ValueError(message.format(lo if has_low and lo < low else hi))


class BertImplPreTrainedModel(CheckpointSafetyMixin, PreTrainedModel):
    config_class = BertImplConfig
    config: BertImplConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BertImplEmbeddings", "BertImplLayer"]
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True
    accepts_loss_kwargs = False  # a loss that is a mean over examples: Trainer divides by the accumulation steps

    def __init__(self, config: BertImplConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        self.model_tags = ["bert_impl", "custom_code"]  # the cards transformers writes list it as remote code

    def _init_weights(self, module):
        """normal(0, initializer_range) weights, zero biases, LayerNorm (1, 0), the sinusoidal table; loaded tensors skipped."""
        super()._init_weights(module)
        if isinstance(module, BertImplEmbeddings) and hasattr(module, "position_encoding"):
            _init_copy_(module.position_encoding, sinusoidal_position_encoding(*module.position_encoding.shape))

    def _check_model_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds) -> tuple[int, int]:
        """The input's (b, s). Inputs that torch would reject with an opaque IndexError raise a ValueError
        naming the value. Skipped while compiling (data-dependent checks break the graph); on an accelerator
        the value checks are asynchronous device asserts (`_check_range`), not a host sync per forward."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
        if len(shape) != 2:
            raise ValueError(f"input_ids must have shape (batch, sequence), got {shape}")
        if torch.compiler.is_compiling():
            return shape
        config = self.config
        if 0 in shape:
            raise ValueError(f"the input has an empty dimension: shape {shape}; pass at least one sequence of one token")
        for name, t in (("input_ids", input_ids), ("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                raise ValueError(f"{name} must hold integer ids, got dtype {t.dtype}")
        if inputs_embeds is not None and inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(f"inputs_embeds has width {inputs_embeds.shape[-1]} but config.hidden_size = {config.hidden_size}")
        for name, t, hint in (("token_type_ids", token_type_ids, "token type ids"),
                              ("attention_mask", attention_mask, "mask of 1 for tokens and 0 for padding")):
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)} but the input has shape {shape}; pass a (batch, sequence) {hint}")
        for name, ids, field_name in (("input_ids", input_ids, "vocab_size"), ("token_type_ids", token_type_ids, "type_vocab_size")):
            if ids is not None:
                limit = getattr(config, field_name)
                rule = f"outside [0, {field_name}={limit}); check that the tokenizer matches this model (config.{field_name} = {limit})"
                _check_range(ids, 0, limit, f"{name} contains {{}}, {rule}", f"{name} contains an id {rule}")
        if attention_mask is not None:
            binary, message = attention_mask.eq(0) | attention_mask.eq(1), "attention_mask must hold 1 for tokens and 0 for padding, got"
            if not _values_on_host(attention_mask):
                _device_assert(binary.all(), f"{message} other values")
            elif not binary.all():
                values = attention_mask.unique().tolist()
                raise ValueError(f"{message} values {values[:8]}" + " ..." * (len(values) > 8))
        if position_ids is not None:
            pshape = tuple(position_ids.shape)
            if len(pshape) != 2 or pshape[1] != shape[1] or pshape[0] not in (1, shape[0]):
                raise ValueError(f"position_ids has shape {pshape}; pass (batch, sequence) or (1, sequence) for input shape {shape}")
            message = "position_ids contains {}; positions start at 0"
            _check_range(position_ids, 0, None, message, message.format("a negative value"))
        if config.position_embedding_type == "learned":
            limit = config.max_position_embeddings
            message = (f"sequence needs position {{}} but learned positions stop at max_position_embeddings - 1 = {limit - 1}; "
                       "truncate the input (tokenizer(..., truncation=True)) or use position_embedding_type='sinusoidal'")
            if position_ids is None and shape[1] > limit:
                raise ValueError(message.format(shape[1] - 1))
            if position_ids is not None:
                _check_range(position_ids, None, limit, message, message.format(f">= {limit}"))
        return shape


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

    def _token_map(self, input_shape, attention_mask, row_lengths, padding, position_ids, dtype, output_attentions, kwargs):
        """The real tokens' map (item 6), or None for the padded batch: nothing to unpad, `unpad_inputs=False`, probabilities
        asked for (eager needs the full square), no varlen route (flex), compiling (the map's shapes depend on data).
        Packed flash kwargs of `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` are taken out of `kwargs`."""
        packed = {name: kwargs.pop(name, None) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        impl, flash = self.config._attn_implementation, _is_flash(self.config._attn_implementation)
        if not self.config.unpad_inputs or output_attentions or torch.compiler.is_compiling() or not (impl in ("eager", "sdpa") or flash):
            return None
        b, s = input_shape
        if padding:  # row_lengths is known: only compiling leaves it None, and that returned above
            return TokenMap.from_padding_mask(attention_mask, row_lengths, dtype, flash)
        if b != 1:
            return None
        if (cu_seqlens := packed["cu_seq_lens_q"]) is not None:
            cu_seqlens = cu_seqlens.to(torch.long).view(-1)
            if cu_seqlens[[0, -1]].tolist() != [0, s]:
                raise ValueError(f"cu_seq_lens_q {cu_seqlens.tolist()} must run from 0 to the packed length {s}; pass the "
                                 "collator's kwargs unchanged (DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
            starts = cu_seqlens[:-1]
        elif position_ids is not None:
            starts = _sequence_starts(position_ids)
        else:
            return None
        return TokenMap.from_packed(s, starts, dtype, flash) if starts.numel() > 1 else None

    def _padded_token_map(self, attention_mask, padding, embeddings, output_attentions, position_ids) -> TokenMap:
        """The padded batch as its own grid, the mask in the backend's format (None: nothing to mask, its fastest path)."""
        b, s = embeddings.shape[:2]
        impl, compiling, mask, kwargs = self.config._attn_implementation, torch.compiler.is_compiling(), None, {}
        if attention_mask is None and position_ids is not None and position_ids.size(0) == 1 and s > 1:
            # Possibly a packed row (DataCollatorWithFlattening): attention stays inside each sequence;
            # flash finds the sequences in position_ids itself, the others get a block-diagonal mask.
            if _is_flash(impl) and not output_attentions:
                kwargs = {"position_ids": position_ids}
            elif compiling or _sequence_starts(position_ids).numel() > 1:
                mask = _block_diagonal_mask(position_ids, embeddings.dtype)
        elif padding:
            if output_attentions or impl in ("eager", "sdpa"):
                mask = _additive_padding_mask(attention_mask, embeddings.dtype)
            else:  # flash_attention_2 takes the 2-D mask (and unpads), flex_attention a BlockMask
                mask = _bidirectional_mask(self.config, embeddings, attention_mask)
        return TokenMap((b, s), (b, s), mask, attention_kwargs=kwargs)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_attentions=None, output_hidden_states=None, **kwargs) -> BaseModelOutputWithPooling:
        """input_ids, attention_mask, token_type_ids, position_ids: (b, s); inputs_embeds: (b, s, H).
        Returns last_hidden_state (b, s, H), pooler_output (b, H) and, when asked, hidden_states
        (num_layers + 1) x (b, s, H) and attentions num_layers x (b, h, s, s)."""
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        b, s = input_shape = self._check_model_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        dtype = self.embeddings.word_embeddings.weight.dtype if inputs_embeds is None else inputs_embeds.dtype
        # each row's token count: the forward's one host read of the mask (a sync on an accelerator)
        row_lengths = None if attention_mask is None or torch.compiler.is_compiling() else attention_mask.bool().sum(1).tolist()
        padding = attention_mask is not None and (row_lengths is None or min(row_lengths) < s)
        tokens = self._token_map(input_shape, attention_mask, row_lengths, padding, position_ids, dtype, output_attentions, kwargs)
        if tokens is not None and position_ids is None:  # real tokens keep their places in their rows
            position_ids = torch.arange(s, device=(input_ids if input_ids is not None else inputs_embeds).device)[None]  # (1, s)
        gather = tokens.gather if tokens is not None else (lambda t: t)
        hidden_states = self.embeddings(gather(input_ids), gather(token_type_ids), gather(position_ids), gather(inputs_embeds))
        if tokens is None:
            tokens = self._padded_token_map(attention_mask, padding, hidden_states, output_attentions, position_ids)
        # hidden_states: (b, s, H) for the padded batch, (1, T, H) for the real tokens
        all_hidden = (tokens.scatter(hidden_states),) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            hidden_states, probs = layer(hidden_states, tokens, output_attentions, **kwargs)
            if output_hidden_states:
                all_hidden += (tokens.scatter(hidden_states),)
            if output_attentions:
                all_attentions += (probs,)
        hidden_states = all_hidden[-1] if output_hidden_states else tokens.scatter(hidden_states)  # (b, s, H)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None  # (b, H)
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled, hidden_states=all_hidden,
                                          attentions=all_attentions)


# ----------------------------------------------------------------------------------------------
# The heads, in transformers v5's shape: output flags (output_attentions, output_hidden_states,
# return_dict) travel in **kwargs to the encoder; `return_dict=False` gives the output's tuple.


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
                labels=None, num_items_in_batch=None, **kwargs) -> MaskedLMOutput:
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
                labels=None, next_sentence_label=None, num_items_in_batch=None, **kwargs) -> BertImplForPreTrainingOutput:
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
                labels=None, **kwargs) -> NextSentencePredictorOutput:
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
        self.dropout = BertImplDropout(config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, 1 if self._one_score else config.num_labels)
        self.post_init()


class BertImplForSequenceClassification(_BertImplClassifierModel):
    """Encoder + pooler + linear classifier. The loss follows `config.problem_type` (transformers' ForSequenceClassificationLoss):
    "regression" (MSE; the default when num_labels == 1), "single_label_classification" (cross-entropy; integer labels)
    or "multi_label_classification" (BCE with logits; float labels)."""

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs) -> SequenceClassifierOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict=True, **kwargs)
        logits = self.classifier(self.dropout(out.pooler_output))  # (b, num_labels)
        loss = None
        if labels is not None:  # regression and multi-label targets in the logits' dtype (int scores, bf16)
            targets = labels.to(logits.dtype) if self.num_labels == 1 or labels.is_floating_point() else labels
            loss = self.loss_function(targets, logits, self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertImplForTokenClassification(_BertImplClassifierModel):
    """Encoder + per-token linear classifier (NER, POS); labels -100 are ignored."""

    _pooled = False

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs) -> TokenClassifierOutput:
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
                start_positions=None, end_positions=None, **kwargs) -> QuestionAnsweringModelOutput:
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
                labels=None, **kwargs) -> MultipleChoiceModelOutput:
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
