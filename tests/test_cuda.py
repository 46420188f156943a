"""The accelerator paths against transformers' BERT (the oracle), on the device that
`HF_BERT_IMPL_TEST_DEVICE` names:

    HF_BERT_IMPL_TEST_DEVICE=cuda pytest tests/test_cuda.py   # the GPU check (scripts/gpu_check.sh)
    HF_BERT_IMPL_TEST_DEVICE=cpu  pytest tests/test_cuda.py   # its dry run on the CPU (small sizes)

Unset, the file runs on CUDA when torch sees a GPU and is skipped otherwise; `cuda` without a GPU is
an error, so a GPU check cannot pass by skipping everything.

What is checked, each test against transformers' Bert* class holding the same weights
(`hf_bert_impl.convert.from_hf_bert`). Ours is kernelized (`hf_bert_impl.kernelize(model)`, as the
package's scripts run it: the "unpadded" layout where KERNEL_TABLE names it for the device, mode and
dtype and the attention backend has a packed-row path there (`takes_unpadded`), elsewhere the plain
model); the parity tests run the plain model (never kernelized, as a trust_remote_code user runs it)
as well:
  - float32 with TF32 off: max |diff| <= 1e-5 on real tokens (eager and SDPA), on a full, a padded,
    a mixed-length (lengths spread over [s/8, s]) and a packed batch (DataCollatorWithFlattening);
  - bf16, as bf16 weights and as autocast over float32 weights: our error against transformers'
    float32 output is at most 3x transformers' own bf16 error (SDPA, and flash_attention_2 when
    flash-attn is importable);
  - every head, forward and backward (losses, outputs, every gradient), in float32 and bf16 autocast;
  - output_attentions (real probabilities, equal to transformers' eager ones);
  - torch.compile (fullgraph, dynamic) with no recompile across batch shapes, inference and training;
  - gradient checkpointing on the unpadded path;
  - host syncs per forward (torch.cuda's sync debug mode): kernelized, none without a mask and, where
    it unpads, one with a mask; plain or kernelized, never more than transformers';
  - Trainer with bf16: mean per-step loss deviation within 3x transformers' own bf16 deviation.

Sizes: on CUDA the "mini" preset (hidden 256, 4 layers, 4 heads of 64, so flash-attention takes it),
vocabulary 1000, batch 16, sequence 128; on the CPU dry run the debug preset, batch 6, sequence 16.
torch.compile uses inductor on CUDA and aot_eager on the CPU dry run (no C++ toolchain needed; the
graph capture, where breaks and recompiles happen, is the same); `HF_BERT_IMPL_COMPILE_BACKEND`
overrides it. Tolerances follow design rule "float32 <= 1e-5 on unit-scale activations; bf16 within
3x transformers' own error against float32"; gradients are compared to 1e-5 relative to
max(1, max |gradient|) of each tensor.
"""

import copy
import os
import warnings
from contextlib import ExitStack, nullcontext

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import BertConfig, DataCollatorWithFlattening, Trainer, TrainingArguments, default_data_collator
from transformers.utils import is_flash_attn_2_available

from hf_bert_impl import SIZE_PRESETS, BertImplModel, kernelize, kernelized
from hf_bert_impl.convert import ARCHITECTURES, convert_hf_state_dict, from_hf_bert
from hf_bert_impl.kernels_bert_impl import table_kernels
from hf_bert_impl.modeling_bert_impl import BertImplEncoder

from .conftest import ListDataset


DEVICE_ENV = "HF_BERT_IMPL_TEST_DEVICE"


def _pick_device():
    want = os.environ.get(DEVICE_ENV, "").strip().lower()
    if want not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must be 'cpu', 'cuda' or unset, got {want!r}")
    if want == "cpu":
        return torch.device("cpu"), ""
    if torch.cuda.is_available():
        return torch.device("cuda"), ""
    if want == "cuda":
        raise RuntimeError(
            f"{DEVICE_ENV}=cuda but torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
        )
    return None, f"no CUDA device; {DEVICE_ENV}=cpu runs this file on the CPU (the dry run)"


DEVICE, _SKIP_REASON = _pick_device()
ON_CUDA = DEVICE is not None and DEVICE.type == "cuda"
PRESET, VOCAB, BATCH, SEQ, MAX_POS = ("mini", 1000, 16, 128, 512) if ON_CUDA else ("debug", 99, 6, 16, 64)
COMPILE_BACKEND = os.environ.get("HF_BERT_IMPL_COMPILE_BACKEND") or ("inductor" if ON_CUDA else "aot_eager")
ATOL = 1e-5
FLASH = ON_CUDA and is_flash_attn_2_available()
LAYOUTS = ["full", "padded", "mixed", "packed"]
SPEEDS = ["kernelized", "plain"]  # kernelize(model) (the scripts' model), or the model file alone
BF16_BACKENDS = [
    "sdpa",
    pytest.param(
        "flash_attention_2",
        marks=pytest.mark.skipif(not FLASH, reason="flash_attention_2: needs CUDA and an importable flash-attn"),
    ),
]

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(DEVICE is None, reason=_SKIP_REASON)]


@pytest.fixture(autouse=True)
def exact_float32():
    """TF32 off for the float32 comparisons (TF32 matmuls carry ~1e-3 relative error). The one legacy
    switch only: torch refuses reads after a mix of its legacy and new (fp32_precision) TF32 APIs."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


# ---------------------------------------------------------------------------------------------
# Models and batches


def hf_config(arch="BertModel", **overrides):
    kw = dict(
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **SIZE_PRESETS[PRESET],
    )
    if arch != "BertForQuestionAnswering":  # QA has exactly two outputs (start, end)
        kw["num_labels"] = 3
    kw.update(overrides)
    return BertConfig(**kw)


def make_pair(arch="BertModel", backend="sdpa", seed=0, speed="kernelized"):
    """transformers' `arch` with BERT's init (seeded) and ours converted from it, both on DEVICE in float32,
    ours kernelized (`speed="kernelized"`, kernels "auto") or the plain model (`speed="plain"`).
    BERT's init leaves every LayerNorm at (1, 0) and every bias at 0; each gets its own noise, so a
    swapped LayerNorm or bias cannot pass, while the weights keep BERT's scale (std 0.02)."""
    torch.manual_seed(seed)
    hf = getattr(transformers, arch)(hf_config(arch))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    ours = from_hf_bert(hf)
    assert type(ours) is ARCHITECTURES[arch]
    hf, ours = hf.to(DEVICE).eval(), ours.to(DEVICE).eval()
    for m in (hf, ours):
        m.set_attn_implementation(backend)
    if speed == "kernelized":
        kernelize(ours)
        assert kernelized(ours), "kernelize put nothing on the model"
    else:
        assert speed == "plain" and not kernelized(ours), speed
    return hf, ours


def lengths_of(layout, b=BATCH, s=SEQ):
    """full: every row s tokens; padded: s - (i % 4); mixed / packed: the b quantiles of [s/8, s],
    shuffled (the benchmark's mixed workload)."""
    if layout == "full":
        return [s] * b
    if layout == "padded":
        return [s - (i % 4) for i in range(b)]
    low = max(2, s // 8)
    quantiles = [round(low + i * (s - low) / (b - 1)) for i in range(b)]
    return [quantiles[i] for i in torch.randperm(b, generator=torch.Generator().manual_seed(1)).tolist()]


def make_inputs(layout, seed=0, b=BATCH, s=SEQ):
    """(ours, theirs): the inputs for our model and for transformers', on DEVICE. transformers gets the
    padded batch (right padding, pad id 0, token types switching half-way through each row); ours
    gets the same, except for `packed`: the rows back to back in one row (DataCollatorWithFlattening:
    input_ids and position_ids restarting at 0; no token types)."""
    lengths = lengths_of(layout, b, s)
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    n = torch.tensor(lengths)
    mask = (torch.arange(s)[None, :] < n[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(lengths), s), generator=g) * mask
    types = (torch.arange(s)[None, :] >= (n // 2)[:, None]).long() * mask
    to = lambda d: {k: v.to(DEVICE) for k, v in d.items()}  # noqa: E731
    if layout != "packed":
        padded = to({"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
        return padded, padded
    packed = DataCollatorWithFlattening()([{"input_ids": ids[i, :k].tolist()} for i, k in enumerate(lengths)])
    assert packed["input_ids"].shape == (1, sum(lengths))
    return to({k: packed[k] for k in ("input_ids", "position_ids")}), to({"input_ids": ids, "attention_mask": mask})


def real_tokens(t, inputs):
    """(b, s, ...) -> (T, ...): the real tokens in row-major order (a packed row: all of them)."""
    if "attention_mask" in inputs:
        return t[inputs["attention_mask"].bool()]
    return t[0]


def takes_unpadded(backend, training=False, dtype=torch.float32) -> bool:
    """Whether kernelize "auto" runs a padded batch on the real tokens here: KERNEL_TABLE names "unpadded" for the
    device, mode and dtype (CUDA: half precision only), and the backend has a packed-row path on the device (the CPU:
    eager and sdpa, a block mask; CUDA: flash-attention's varlen arguments)."""
    backend_ok = backend in ("eager", "sdpa") if DEVICE.type == "cpu" else "flash" in backend
    return backend_ok and "unpadded" in table_kernels(DEVICE.type, training, dtype)


def spy_packed_rows(monkeypatch):
    """The layers' runs on one packed row: the shape (1, T, H) of each BertImplEncoder.forward call whose input is
    one row (kernelize's "unpadded" layout calls it on the padded batch's real tokens; a packed input is one row
    already)."""
    calls, forward = [], BertImplEncoder.forward

    def spy(self, hidden_states, *args, **kwargs):
        if hidden_states.size(0) == 1:
            calls.append(tuple(hidden_states.shape))
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(BertImplEncoder, "forward", spy)
    return calls


def grad_diffs(hf, ours):
    """{our parameter: max |our grad - transformers' grad| / max(1, max |transformers' grad|)};
    transformers' gradients go through the converter's key table (Q, K, V joined into Wqkv)."""
    hf_grads, _ = convert_hf_state_dict(
        {k: p.grad for k, p in hf.named_parameters() if p.grad is not None},
        hf.config.num_hidden_layers,
        tied=hf.config.tie_word_embeddings,
    )
    prefix = "bert." if isinstance(ours, BertImplModel) else ""
    diffs = {}
    for name, p in ours.named_parameters():
        want = hf_grads.get(prefix + name)
        assert (p.grad is None) == (want is None), f"{name}: gradient in one model only"
        if want is not None:
            scale = want.float().abs().max().clamp_min(1.0)
            diffs[name] = ((p.grad.float() - want.float()).abs().max() / scale).item()
    assert diffs, "no gradients compared"
    return diffs


def worst(diffs):
    name = max(diffs, key=diffs.get)
    return name, diffs[name]


# ---------------------------------------------------------------------------------------------
# The encoder: float32 parity and bf16 error on every batch layout


@pytest.mark.parametrize("speed", SPEEDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_encoder_matches_transformers_float32(backend, layout, speed, monkeypatch):
    hf, ours = make_pair("BertModel", backend, speed=speed)
    ours_in, hf_in = make_inputs(layout)
    calls = spy_packed_rows(monkeypatch)
    with torch.no_grad():
        fast = ours(**ours_in)  # kernelized, padded batches: the real tokens only (where the table says so)
        packed_rows = len(calls)
        got = ours(**ours_in, output_hidden_states=True)  # recorded hidden states: the padded batch
        want = hf(**hf_in, output_hidden_states=True)
    assert got.last_hidden_state.device.type == DEVICE.type
    unpadded = speed == "kernelized" and layout in ("padded", "mixed") and takes_unpadded(backend)
    assert packed_rows == (unpadded or layout == "packed"), "kernelized padded batches take the unpadded path here"
    diffs = [
        (real_tokens(a, ours_in) - real_tokens(b, hf_in)).abs().max().item()
        for a, b in zip(got.hidden_states + (fast.last_hidden_state,), want.hidden_states + (want.last_hidden_state,))
    ]
    if layout != "packed":  # a packed row has one [CLS] position for many sequences: no pooler to compare
        diffs.append((got.pooler_output - want.pooler_output).abs().max().item())
    print(f"\n[{DEVICE.type} {backend} {layout} {speed}] float32 max|diff| per layer {['%.1e' % d for d in diffs]}")
    assert max(diffs) <= ATOL, diffs


@pytest.mark.parametrize("speed", SPEEDS)
@pytest.mark.parametrize("mode", ["bf16_weights", "autocast"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_encoder_bf16_within_3x_transformers_error(backend, layout, mode, speed):
    hf, ours = make_pair("BertModel", "sdpa", speed=speed)
    ours_in, hf_in = make_inputs(layout)
    with torch.no_grad():
        reference = real_tokens(hf(**hf_in).last_hidden_state, hf_in)  # float32, sdpa (flash has no float32)
    context = nullcontext()
    if mode == "bf16_weights":
        hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    else:
        context = torch.autocast(DEVICE.type, dtype=torch.bfloat16)
    for m in (hf, ours):
        m.set_attn_implementation(backend)
    with torch.no_grad(), context:
        theirs = real_tokens(hf(**hf_in).last_hidden_state, hf_in).float()
        got = real_tokens(ours(**ours_in).last_hidden_state, ours_in).float()
    assert got.dtype == torch.float32 and got.shape == reference.shape
    err_hf = (theirs - reference).abs().max().item()
    err_ours = (got - reference).abs().max().item()
    print(
        f"\n[{DEVICE.type} {backend} {layout} {mode} {speed}] max|bf16 - fp32|: ours {err_ours:.3e}, "
        f"transformers {err_hf:.3e}"
    )
    assert err_hf > 0, "transformers' bf16 run equals float32: bf16 did not run"
    assert err_ours <= 3 * err_hf, f"ours {err_ours:.3e} > 3 x transformers' {err_hf:.3e}"


class _HostReads(TorchDispatchMode):
    """The CPU dry run's stand-in for torch.cuda's sync debug mode: the ops that would be a host sync on an
    accelerator (a scalar read, ops whose output size depends on the values: nonzero, masked_select, unique,
    repeat_interleave without output_size); `Tensor.tolist` is counted apart. nonzero_static is no sync."""

    SIZE_FROM_VALUES = (
        "aten.nonzero.default",
        "aten.masked_select.default",
        "aten._unique2.default",
        "aten.unique_dim.default",
        "aten.unique_consecutive.default",
    )

    def __init__(self):
        super().__init__()
        self.reads, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if not self.paused and (
            name == "aten._local_scalar_dense.default"
            or name in self.SIZE_FROM_VALUES
            or name == "aten.repeat_interleave.Tensor"
            and kwargs.get("output_size") is None
        ):
            self.reads.append(name)
        return func(*args, **kwargs)


def _cpu_host_reads(model, inputs, monkeypatch) -> list[str]:
    """The would-be host syncs of one forward on the CPU. What ours reads on the CPU only (the input checks'
    values, the embeddings' stored-row test on given position ids: on an accelerator neither reads) is not
    counted; transformers' model runs unchanged."""
    import hf_bert_impl.modeling_bert_impl as modeling

    mode = _HostReads()

    def unrecorded(fn):
        def run(*args, **kwargs):
            mode.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                mode.paused = False

        return run

    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        if not mode.paused:
            mode.reads.append("Tensor.tolist")
        return tolist(t)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counted_tolist)
        patch.setattr(modeling, "_check_inputs", unrecorded(modeling._check_inputs))
        patch.setattr(modeling.BertImplEmbeddings, "forward", unrecorded(modeling.BertImplEmbeddings.forward))
        with torch.no_grad(), mode:
            model(**inputs)
    return mode.reads


def host_syncs(model, inputs, monkeypatch) -> list[str]:
    """The host syncs of one forward: on CUDA what torch's sync debug mode reports; on the CPU dry run
    the ops that would be one (`_cpu_host_reads`)."""
    if not ON_CUDA:
        return _cpu_host_reads(model, inputs, monkeypatch)
    torch.cuda.synchronize(DEVICE)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(**inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("speed", SPEEDS)
@pytest.mark.parametrize("layout", ["no mask", "full", "padded", "mixed"])
def test_a_forward_syncs_no_more_often_than_transformers(layout, speed, monkeypatch):
    """Kernelized: the unpadded layout (where it runs) reads the mask's lengths once, nothing without a mask. Plain:
    the mask is transformers' (masking_utils), so at most what transformers' BERT syncs."""
    hf, ours = make_pair("BertModel", "sdpa", speed=speed)
    inputs, _ = make_inputs("full" if layout == "no mask" else layout)
    if layout == "no mask":
        inputs.pop("attention_mask")
    with torch.no_grad():  # first calls pick kernels and fill caches: not what every forward costs
        hf(**inputs), ours(**inputs)
    got, theirs = host_syncs(ours, inputs, monkeypatch), host_syncs(hf, inputs, monkeypatch)
    print(f"\n[{DEVICE.type} {layout} {speed}] host syncs per forward: ours {len(got)}, transformers {len(theirs)}")
    assert len(got) <= len(theirs), (got, theirs)
    if speed == "kernelized" and (layout == "no mask" or takes_unpadded("sdpa")):
        assert len(got) == (0 if layout == "no mask" else 1), (got, theirs)


# ---------------------------------------------------------------------------------------------
# Every head, forward and backward


def head_inputs(arch, seed=0):
    """The padded layout with labels, so that losses and gradients are compared. Question answering
    takes the full layout: transformers' span loss is a softmax over every position, padding
    included, and our padding positions hold zeros by design (modeling note 6). Multiple choice:
    (BATCH // 3, 3, SEQ)."""
    x, _ = make_inputs("full" if arch == "BertForQuestionAnswering" else "padded", seed)
    ids, mask = x["input_ids"], x["attention_mask"]
    b, s = ids.shape
    g = torch.Generator().manual_seed(seed + 7)
    rand = lambda *shape, high: torch.randint(0, high, shape, generator=g).to(DEVICE)  # noqa: E731
    if arch in ("BertForMaskedLM", "BertForPreTraining"):
        chosen = (torch.rand(b, s, generator=g).to(DEVICE) < 0.15) & mask.bool()
        chosen[0, 0] = True
        x["labels"] = torch.where(chosen, ids, torch.full_like(ids, -100))
        if arch == "BertForPreTraining":
            x["next_sentence_label"] = rand(b, high=2)
    elif arch in ("BertForSequenceClassification", "BertForNextSentencePrediction"):
        x["labels"] = rand(b, high=3 if arch.endswith("Classification") else 2)
    elif arch == "BertForTokenClassification":
        x["labels"] = torch.where(mask.bool(), rand(b, s, high=3), torch.full_like(ids, -100))
    elif arch == "BertForQuestionAnswering":
        x["start_positions"], x["end_positions"] = rand(b, high=s), rand(b, high=s)
    elif arch == "BertForMultipleChoice":
        c = b // 3
        x = {k: v[: 3 * c].reshape(c, 3, s) for k, v in x.items()}
        x["labels"] = rand(c, high=3)
    return x


def outputs_at_real_tokens(out, x):
    """Every output tensor except hidden states, per-token ones at real tokens only, flattened into one vector."""
    mask = x["attention_mask"].reshape(-1, x["attention_mask"].shape[-1]).bool()  # (b, s)
    parts = []
    for key, t in out.items():
        if key in ("hidden_states", "attentions") or t is None:
            continue
        t = t.float()
        parts.append((t[mask] if t.shape[:2] == mask.shape else t).reshape(-1))
    return torch.cat(parts)


def forward_backward(model, x):
    out = model(**x)
    if out.get("loss") is None:  # the bare encoder: a fixed random projection of both outputs
        g = torch.Generator().manual_seed(3)
        w = torch.randn(out.last_hidden_state.shape[-1], generator=g).to(DEVICE)
        real = x["attention_mask"].bool()
        loss = (out.last_hidden_state[real].float() @ w).sum() + (out.pooler_output.float() @ w).sum()
    else:
        loss = out.loss
    loss.backward()
    return out, loss


@pytest.mark.parametrize("speed", SPEEDS)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_head_forward_backward_matches_transformers_float32(arch, speed):
    hf, ours = make_pair(arch, speed=speed)
    hf.train(), ours.train()  # dropout is 0: train mode for the training code paths, same numbers
    x = head_inputs(arch)
    out_hf, loss_hf = forward_backward(hf, x)
    out_ours, loss_ours = forward_backward(ours, x)
    out_diff = (outputs_at_real_tokens(out_ours, x) - outputs_at_real_tokens(out_hf, x)).abs().max().item()
    loss_diff = abs(loss_ours.item() - loss_hf.item())
    name, grad_diff = worst(grad_diffs(hf, ours))
    print(
        f"\n[{DEVICE.type} {arch} {speed}] max|diff|: outputs {out_diff:.1e}, loss {loss_diff:.1e}, "
        f"gradients {grad_diff:.1e} ({name})"
    )
    assert out_diff <= ATOL and loss_diff <= ATOL * max(1.0, abs(loss_hf.item()))
    assert grad_diff <= ATOL, (name, grad_diff)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_head_forward_backward_bf16_autocast(arch):
    """Under bf16 autocast (what Trainer's --bf16 runs): outputs within 3x transformers' own error
    against float32, a finite loss, finite float32 gradients on every parameter."""
    hf, ours = make_pair(arch)
    x = head_inputs(arch)
    with torch.no_grad():
        reference = outputs_at_real_tokens(hf(**x), x)
    hf.train(), ours.train()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out_hf, _ = forward_backward(hf, x)
        out_ours, loss = forward_backward(ours, x)
    err_hf = (outputs_at_real_tokens(out_hf, x) - reference).abs().max().item()
    err_ours = (outputs_at_real_tokens(out_ours, x) - reference).abs().max().item()
    print(f"\n[{DEVICE.type} {arch}] autocast max|bf16 - fp32|: ours {err_ours:.3e}, transformers {err_hf:.3e}")
    assert err_hf > 0 and err_ours <= 3 * err_hf, (err_ours, err_hf)
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().max() > 0 for n, g in grads.items() if "word_embeddings" in n or "Wqkv" in n)


# ---------------------------------------------------------------------------------------------
# output_attentions, torch.compile, gradient checkpointing


@pytest.mark.parametrize("layout", ["padded", "mixed"])
def test_output_attentions_match_transformers_eager(layout):
    """Ours on SDPA (output_attentions switches to the eager function) vs transformers on eager."""
    hf, ours = make_pair("BertModel", "eager")
    ours.set_attn_implementation("sdpa")
    x, _ = make_inputs(layout)
    with torch.no_grad():
        got = ours(**x, output_attentions=True)
        want = hf(**x, output_attentions=True)
    mask = x["attention_mask"].bool()
    b, s = mask.shape
    assert len(got.attentions) == hf.config.num_hidden_layers
    diffs = []
    for a, w in zip(got.attentions, want.attentions):  # (b, h, s, s)
        assert a.shape == (b, hf.config.num_attention_heads, s, s)
        rows_a, rows_w = a.transpose(1, 2)[mask], w.transpose(1, 2)[mask]  # real queries: (T, h, s)
        torch.testing.assert_close(rows_a.sum(-1), torch.ones_like(rows_a[..., 0]), atol=ATOL, rtol=0)
        assert rows_a.masked_select(~mask.repeat_interleave(mask.sum(1), 0)[:, None, :]).abs().max().item() == 0.0
        diffs.append((rows_a - rows_w).abs().max().item())
    diffs.append((real_tokens(got.last_hidden_state, x) - real_tokens(want.last_hidden_state, x)).abs().max().item())
    print(f"\n[{DEVICE.type} {layout}] attentions max|diff| {['%.1e' % d for d in diffs]}")
    assert max(diffs) <= ATOL, diffs


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo (no cached graphs, counters at zero) and an ExitStack for config patches, which
    are undone at the end. (config.patch, not monkeypatch: monkeypatch's undo deletes the option from
    dynamo's config module.)"""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with ExitStack() as stack:
        stack.counters = torch._dynamo.utils.counters
        yield stack
    torch._dynamo.reset()


def _shapes():
    """(batch, sequence) per call: the first compiles, every later one would be a recompile."""
    return [(BATCH, SEQ // 2 + 3), (BATCH, SEQ), (BATCH // 2 + 1, SEQ // 4 + 1), (BATCH, SEQ - 1)]


@pytest.mark.parametrize("speed", SPEEDS)
def test_compile_dynamic_inference_no_recompile_across_lengths(fresh_dynamo, speed):
    hf, ours = make_pair("BertModel", speed=speed)
    compiled = torch.compile(ours, fullgraph=True, dynamic=True, backend=COMPILE_BACKEND)
    diffs = []
    for i, (b, s) in enumerate(_shapes()):
        x, _ = make_inputs("padded", seed=i, b=b, s=s)
        with torch.no_grad():
            got = compiled(**x).last_hidden_state
            want = hf(**x).last_hidden_state
        diffs.append((real_tokens(got, x) - real_tokens(want, x)).abs().max().item())
        if i == 0:  # any later compile is a recompile: make it an error
            fresh_dynamo.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
    print(
        f"\n[{DEVICE.type} compile {COMPILE_BACKEND} {speed}] max|diff| vs transformers per shape "
        f"{['%.1e' % d for d in diffs]}"
    )
    assert max(diffs) <= ATOL, diffs
    assert fresh_dynamo.counters["stats"]["unique_graphs"] == 1 and not fresh_dynamo.counters["graph_break"]


def test_compile_dynamic_training_step_no_recompile(fresh_dynamo):
    speed = "kernelized"  # the model the scripts train
    hf, ours = make_pair("BertForMaskedLM", speed=speed)
    hf.train(), ours.train()
    compiled = torch.compile(ours, fullgraph=True, dynamic=True, backend=COMPILE_BACKEND)
    for i, (b, s) in enumerate(_shapes()[:2]):
        x = head_inputs("BertForMaskedLM", seed=i)
        x = {k: v[:b, :s].contiguous() for k, v in x.items()}
        x["labels"][0, 0] = x["input_ids"][0, 0]
        hf.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        loss = compiled(**x).loss
        loss.backward()
        want = hf(**x).loss
        want.backward()
        name, grad_diff = worst(grad_diffs(hf, ours))
        print(
            f"\n[{DEVICE.type} compile {COMPILE_BACKEND} {speed} train {b}x{s}] loss diff "
            f"{abs(loss.item() - want.item()):.1e}, gradients {grad_diff:.1e} ({name})"
        )
        assert abs(loss.item() - want.item()) <= ATOL * max(1.0, abs(want.item()))
        assert grad_diff <= ATOL, (name, grad_diff)
        if i == 0:
            fresh_dynamo.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
    assert not fresh_dynamo.counters["graph_break"]


@pytest.mark.parametrize("layout", ["padded", "mixed"])
def test_gradient_checkpointing_matches_transformers(layout, monkeypatch):
    hf, ours = make_pair("BertForMaskedLM")
    unchecked = copy.deepcopy(ours)  # kernelized too (deepcopy rebinds the kernels to the copy), no checkpointing
    kw = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    ours.gradient_checkpointing_enable(**kw)
    hf.gradient_checkpointing_enable(**kw)
    for m in (hf, ours, unchecked):
        m.train()
    x = head_inputs("BertForMaskedLM")
    if layout == "mixed":
        x2, _ = make_inputs("mixed")
        x = {**x2, "labels": torch.where(x2["attention_mask"].bool(), x2["input_ids"], -100)}
    calls = spy_packed_rows(monkeypatch)
    for m in (hf, ours, unchecked):
        m(**x).loss.backward()
    # both of our models took the unpadded path where the table says so (checkpointing recomputes each layer only)
    assert len(calls) == (2 if takes_unpadded("sdpa", training=True) else 0), calls
    name, vs_hf = worst(grad_diffs(hf, ours))
    vs_unchecked = max(
        (p.grad - q.grad).abs().max().item() / max(1.0, q.grad.abs().max().item())
        for p, q in zip(ours.parameters(), unchecked.parameters())
    )
    print(
        f"\n[{DEVICE.type} checkpointing {layout}] gradients vs transformers {vs_hf:.1e} ({name}), "
        f"vs no checkpointing {vs_unchecked:.1e}"
    )
    assert vs_hf <= ATOL and vs_unchecked <= ATOL


# ---------------------------------------------------------------------------------------------
# Trainer with bf16


def test_trainer_bf16_losses_match_transformers(tmp_path):
    """Four Trainer runs from the same weights on the same batches: transformers and ours, float32 and
    --bf16 (autocast). float32: per-step losses agree within 1e-4 (tests/test_training.py's bound).
    bf16: our mean per-step deviation from transformers' float32 losses is at most 3x transformers'
    own bf16 deviation."""
    steps, b = 10, BATCH
    rows = []
    for step in range(steps):  # a fresh padded batch with 15% of the real tokens as labels per step
        x = head_inputs("BertForMaskedLM", seed=10 + step)
        rows += [{k: v[i].cpu() for k, v in x.items()} for i in range(b)]
    hf0, ours0 = make_pair("BertForMaskedLM")
    losses = {}
    for tag, model0 in (("transformers", hf0), ("ours", ours0)):
        for bf16 in (False, True):
            model = copy.deepcopy(model0).float()
            args = TrainingArguments(
                output_dir=str(tmp_path / f"{tag}{bf16}"),
                per_device_train_batch_size=b,
                max_steps=steps,
                learning_rate=1e-3,
                warmup_steps=1,
                optim="adamw_torch",
                bf16=bf16,
                use_cpu=not ON_CUDA,
                logging_steps=1,
                report_to="none",
                save_strategy="no",
                seed=0,
                data_seed=0,
                disable_tqdm=True,
                dataloader_num_workers=0,
            )
            trainer = Trainer(
                model=model, args=args, train_dataset=ListDataset(rows), data_collator=default_data_collator
            )
            trainer.train()
            assert next(model.parameters()).device.type == DEVICE.type
            losses[tag, bf16] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ref = losses["transformers", False]
    assert all(len(v) == steps for v in losses.values()), losses
    fp32 = max(abs(a - c) for a, c in zip(losses["ours", False], ref))
    # bf16 deviation as the mean over the steps: the max of a few steps is one noisy draw
    err_hf = sum(abs(a - c) for a, c in zip(losses["transformers", True], ref)) / steps
    err_ours = sum(abs(a - c) for a, c in zip(losses["ours", True], ref)) / steps
    print(
        f"\n[{DEVICE.type} Trainer] float32 max|loss diff| {fp32:.2e}; bf16 vs float32 (mean |diff|): "
        f"ours {err_ours:.2e}, "
        f"transformers {err_hf:.2e}; losses {losses}"
    )
    assert max(ref) - min(ref) > 10 * ATOL, f"a flat loss curve proves little: {ref}"
    assert fp32 <= 1e-4, losses
    assert err_hf > 0 and err_ours <= 3 * err_hf, losses
