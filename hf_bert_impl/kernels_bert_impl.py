"""The speed layer of hf-bert-impl: kernels put on a loaded model from outside, chosen from a static table.

    model = AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True)
    hf_bert_impl.kernelize(model)               # the kernels `KERNEL_TABLE` names for each call
    hf_bert_impl.kernelize(model, "unpadded")   # forced by name, for benchmarks and debugging
    hf_bert_impl.kernelize(model, "reference")  # back to the plain model

The model file (modeling_bert_impl.py) is the plain model and the reference. It declares the seams this layer may
replace, by `kernel_seam` on the module class (as transformers' `use_kernel_forward_from_hub` declares a layer):
`BertImplEncoder.forward`, the layer loop, and `BertImplSelfAttention.attention_function`, which picks the attention
function. `kernelize` replaces those methods on the module instances (transformers' `kernelize` does the same), never
their class, parameters or buffers, so a kernelized model saves exactly what the plain one saves.

  kernel      replaces                          what it does                                  reference
  "unpadded"  BertImplEncoder.forward           the layers run on the real tokens only: the   the padded batch,
                                                padded batch gathered into one packed row     masked
                                                (1, T, H), scattered back with zeros at
                                                padding (MosaicBERT's unpad / pad pair)
              BertImplSelfAttention             on a CPU each sequence of the packed row      (the same function
              .attention_function               attends alone, by the model's own attention   on the padded batch)
                                                function; on CUDA flash-attention takes the
                                                varlen arguments (`cu_seq_lens_q`, ...) itself

Which kernels run is looked up at each call in `KERNEL_TABLE`, by the input's device type, the module's mode (training
or inference) and the dtype: nothing is timed, read, written or cached, so the same call gives the same kernels and
the same numbers in every process. docs/benchmarks.md holds the measurements behind each entry; `python
scripts/benchmark.py` measures a machine. Recorded outputs (`output_attentions`, `output_hidden_states`) and
torch.compile run the plain model (compile: with one warning).
"""

import functools
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn


KERNELS = ("unpadded",)

# (device type, "training" or "inference", dtype) -> the kernels that run there. The measurements behind each entry are
# in docs/benchmarks.md ("The speed layer's table"): "unpadded" on mixed-length batches, bert-base, 2 threads
# (`python scripts/benchmark.py --size base --threads 2`), AMD EPYC Zen 4. On CUDA it runs with flash-attention
# only (flash-attn installed, `attn_implementation="flash_attention_2"`; float32 weights: under autocast).
KERNEL_TABLE = {
    ("cpu", "training", torch.float32): ("unpadded",),
    ("cpu", "training", torch.bfloat16): ("unpadded",),
    ("cpu", "inference", torch.float32): ("unpadded",),
    ("cpu", "inference", torch.bfloat16): ("unpadded",),
    ("cuda", "training", torch.float32): ("unpadded",),  # float32 weights under bf16 / fp16 autocast
    ("cuda", "training", torch.float16): ("unpadded",),
    ("cuda", "training", torch.bfloat16): ("unpadded",),
    ("cuda", "inference", torch.float32): ("unpadded",),
    ("cuda", "inference", torch.float16): ("unpadded",),
    ("cuda", "inference", torch.bfloat16): ("unpadded",),
}


def kernel_names(setting) -> str | frozenset:
    """`kernels` -> "auto" (the table), "reference" (none), or the frozenset of kernel names forced; a ValueError
    naming a bad value."""
    if setting in ("auto", "reference"):
        return setting
    names = setting.split(",") if isinstance(setting, str) else setting
    accepted = (list, tuple, set, frozenset)
    names = [n.strip() if isinstance(n, str) else n for n in names] if isinstance(names, accepted) else []
    if not names or any(n not in KERNELS for n in names):
        raise ValueError(
            f"kernels must be 'auto', 'reference' or kernel names from {KERNELS} (comma-separated), got {setting!r}"
        )
    return frozenset(names)


def table_kernels(device_type: str, training: bool, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels `KERNEL_TABLE` names for a device type, mode and dtype (none where it has no entry)."""
    return KERNEL_TABLE.get((device_type, "training" if training else "inference", dtype), ())


def _runs(kernel: str, setting, x: torch.Tensor, training: bool) -> bool:  # `kernel` applies to this call
    if setting == "reference":
        return False
    return kernel in (table_kernels(x.device.type, training, x.dtype) if setting == "auto" else setting)


# ----------------------------------------------------------------------------------------------
# "unpadded"


def _warn_compiled() -> None:  # once per process (Python's warning registry), while dynamo traces: no graph break
    from torch._dynamo.comptime import comptime

    comptime(
        lambda ctx: warnings.warn(
            "hf_bert_impl.kernelize: under torch.compile the layers run on the padded "
            "batch, as the plain model does; the unpadded layout runs in eager mode only",
            UserWarning,
            stacklevel=1,
        )
    )


def unpadded_encoder_forward(self, hidden_states, attention_mask=None, position_ids=None, *, setting, **kwargs):
    """BertImplEncoder on the real tokens only: hidden_states (b, s, H) and attention_mask (b, s) -> the T real tokens
    as one packed row (1, T, H), through the plain forward, -> (b, s, H) with zeros at padding. The packed row's
    sequences ride to the attention function as transformers' varlen arguments (`cu_seq_lens_q/k`, `max_length_q/k`):
    flash-attention takes them itself, `per_sequence_attention` on a CPU; were a layer's attention without it, the
    position ids restarting at each sequence give the plain model's block mask instead. One host read of the mask.
    Everything else (no padding, recorded outputs, other attention backends, compiled graphs) is the plain forward."""
    plain = type(self).forward
    recording = any(
        kwargs.get(f"output_{n}", getattr(self.config, f"output_{n}", False))  # asked, or the config's
        for n in ("attentions", "hidden_states")
    )
    impl = self.config._attn_implementation or "eager"
    cpu = hidden_states.device.type == "cpu"
    if (
        attention_mask is None
        or recording
        or not (impl in ("eager", "sdpa") if cpu else "flash" in impl)
        or attention_mask.dim() != 2
        or not _runs("unpadded", setting, hidden_states, self.training)
    ):
        return plain(self, hidden_states, attention_mask, position_ids, **kwargs)
    if torch.compiler.is_compiling():  # the real token count is a size the graph would depend on
        _warn_compiled()
        return plain(self, hidden_states, attention_mask, position_ids, **kwargs)
    b, s, H = hidden_states.shape
    keep = attention_mask.bool()  # (b, s)
    lengths = keep.sum(1)  # (b,)
    counts = lengths.tolist()  # the forward's one host read (a sync on an accelerator)
    if min(counts) == s:  # nothing to unpad, nor to mask
        return plain(self, hidden_states, None, position_ids, **kwargs)
    total = sum(counts)
    indices = keep.flatten().nonzero_static(size=total).squeeze(1)  # (T,) row-major: each sequence's tokens together
    cu_seq_lens = F.pad(lengths.cumsum(0), (1, 0)).int()  # (b + 1,) where each sequence starts, then T
    varlen = {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max(counts),
        "max_length_k": max(counts),
    }
    positions = None  # (1, T) restarting at each sequence, where a layer's attention would not read `varlen`
    if cpu and all("attention_function" in _kernels_of(layer.attn) for layer in self):
        varlen["seq_lengths"] = tuple(counts)  # `per_sequence_attention` splits by them without another read
    elif cpu:
        positions = (torch.arange(total) - cu_seq_lens[:-1].repeat_interleave(lengths, output_size=total))[None]
    packed = hidden_states.reshape(b * s, H).index_select(0, indices)[None]  # (1, T, H)
    out = plain(self, packed, None, positions, **varlen, **kwargs)  # (1, T, H)
    return out.new_zeros(b * s, H).index_copy(0, indices, out[0]).view(b, s, H)  # (b, s, H), zeros at padding


def per_sequence_attention(module, query, key, value, attention_mask, *, plain, seq_lengths=None, **kwargs):
    """`plain` (the attention function the model chose: SDPA, eager, ...) on each sequence of a packed row alone,
    unmasked: q, k, v (1, h, T, d) split into sequences of `seq_lengths` (summing to T) -> (1, T, h, d). Without
    `seq_lengths` (not a packed row of `unpadded_encoder_forward` on a CPU), `plain` as the model calls it."""
    if seq_lengths is None or query.size(0) != 1:
        return plain(module, query, key, value, attention_mask, **kwargs)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    parts = zip(*(t.split(seq_lengths, dim=2) for t in (query, key, value)))  # b x 3 x (1, h, n_i, d)
    outs = [plain(module, q, k, v, None, **kwargs)[0] for q, k, v in parts if q.size(2)]  # b x (1, n_i, h, d)
    return torch.cat(outs, dim=1), None  # (1, T, h, d); no probabilities (recorded attentions run the plain model)


def attention_function(self, impl, *, setting):
    """BertImplSelfAttention.attention_function with `per_sequence_attention` in front of the plain choice."""
    return functools.partial(per_sequence_attention, plain=type(self).attention_function(self, impl))


# ----------------------------------------------------------------------------------------------
# kernelize


# a model class's `kernel_seam` -> (the method "unpadded" replaces on its instances, the kernel)
_SEAMS = {
    "BertImplEncoder": ("forward", unpadded_encoder_forward),
    "BertImplSelfAttention": ("attention_function", attention_function),
}
_OURS = (unpadded_encoder_forward, attention_function)


def _put(module: nn.Module, attribute: str, fn, setting) -> None:
    def kernel(self, *args, **kwargs):  # bound to the module: a deep copy of the model rebinds it to the copy
        return fn(self, *args, **kwargs, setting=setting)

    kernel.bert_impl_kernel = fn
    setattr(module, attribute, types.MethodType(kernel, module))


def _kernels_of(module: nn.Module) -> dict:  # {attribute: the kernel function put there} on `module`
    found = {a: getattr(module.__dict__.get(a), "bert_impl_kernel", None) for a in ("forward", "attention_function")}
    return {a: fn for a, fn in found.items() if fn in _OURS}


def kernelize(model: nn.Module, kernels="auto") -> nn.Module:
    """Put the speed layer on `model` (any bert_impl model or head, loaded by the package or by trust_remote_code) and
    return it. `kernels`: "auto" (`KERNEL_TABLE`'s kernels for each call's device, mode and dtype), "reference" (take
    every kernel off: the plain model), or kernel names to force (`KERNELS`, comma-separated). Parameters, buffers,
    config and saved files do not change; calling it again replaces the previous kernels."""
    setting = kernel_names(kernels)
    for module in model.modules():
        for attribute in _kernels_of(module):
            delattr(module, attribute)
    if setting == "reference":
        return model
    for module in model.modules():
        seam = getattr(type(module), "kernel_seam", None)
        if seam in _SEAMS:
            _put(module, *_SEAMS[seam], setting)
    return model


def kernelized(model: nn.Module) -> dict[str, str]:
    """{module name: the kernel function put on it} for every module `kernelize` changed."""
    return {
        name + ("" if attribute == "forward" else f".{attribute}"): fn.__name__
        for name, module in model.named_modules()
        for attribute, fn in _kernels_of(module).items()
    }
