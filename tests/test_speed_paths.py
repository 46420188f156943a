"""The speed layer (kernels_bert_impl.py), put on a model from outside with `hf_bert_impl.kernelize(model, kernels)`:
each kernel FORCED against the plain model (the model a user loads, or `kernelize(model, "reference")`) and, for
parity, transformers' BERT with the same weights: float32 within 1e-5 (bit for bit where said), bf16 within 3x the
error nn.Linear / transformers have against float32. No test assumes which kernel "auto" picks on this machine (the
suite runs unchanged on AMD and Intel CPUs): the measured choice is tested for its contract instead (recorded under the
Hugging Face cache with the package version in its key, reused by later processes, the same in concurrent ones, never
a disagreeing kernel, a held lock given up). Also here: what kernelize leaves alone (saved files, modules another tool
replaced or hooked), sparse MLM prediction, host reads, torch.compile, scripts/benchmark.py.

Run: pytest tests/test_speed_paths.py -q
"""

import copy
import functools
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface, DataCollatorWithFlattening
from transformers.activations import ACT2FN

import hf_bert_impl
from hf_bert_impl import BertImplForMaskedLM, BertImplForPreTraining, BertImplModel, kernelize, kernelized
from hf_bert_impl import kernels_bert_impl as K
from hf_bert_impl import modeling_bert_impl as mb

from .conftest import REPO_ROOT, ListDataset
from .test_convert import hf_config  # transformers' BertConfig of the debug flavour (the oracle models)


ATOL = 1e-5  # float32, unit-scale activations (docs/formulas.md, tolerances)
VOCAB = 99


def _model(cls, config, kernels):
    """`cls(config)` with `kernels` put on it (seeded by the caller)."""
    return kernelize(cls(config), kernels)


def _forced(model, kernels):
    """A copy of `model` (the same weights) that runs `kernels` ("reference": the plain model alone)."""
    return kernelize(copy.deepcopy(model), kernels)


def _plain(model):
    """The same weights on the plain model: the reference every kernel must match."""
    plain = _forced(model, "reference")
    assert kernelized(plain) == {}
    return plain


def _max_diff_real(a, b, attention_mask):
    real = attention_mask.bool()
    return (a - b)[real].abs().max().item()


def _linear_layers(config) -> int:  # Wqkv, Wo, Wi, Wo per layer; the MLM head's dense and decoder
    return 4 * config.num_hidden_layers + 2


def _mlm_batch(batch):
    input_ids, attention_mask, token_type_ids = batch
    g = torch.Generator().manual_seed(7)
    chosen = (torch.rand(input_ids.shape, generator=g) < 0.3) & attention_mask.bool()
    chosen[0, 0] = True
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    return input_ids, attention_mask, token_type_ids, labels


def _decoder(layer: nn.Linear, kernels) -> nn.Module:
    """`layer` as an MLM decoder (`lm_head.decoder`, the linear layer kernelize gives "skip_zero_rows"), kernelized."""
    holder = nn.Module()
    holder.lm_head = nn.Module()
    holder.lm_head.decoder = layer
    kernelize(holder, kernels)
    assert kernelized(holder) == {"lm_head.decoder": "_linear_forward"}
    return layer


needs_onednn = pytest.mark.skipif(K._onednn_op() is None, reason="this torch build has no oneDNN linear")
needs_onednn_bf16 = pytest.mark.skipif(not K._onednn_runs(torch.bfloat16),
                                       reason="oneDNN's linear has no bfloat16 kernel on this CPU / build")


# ---------------------------------------------------------------------------------------------
# Spies: each test sees the kernel it forced run, so it cannot pass on the reference by accident


def _spy_onednn_linear(monkeypatch, record=lambda x: 1) -> list:
    """Records `record(input)` for each linear layer call that runs on oneDNN (`_LinearFunction`'s forward with
    onednn=True: through `apply` with gradients on, called directly without)."""
    calls, forward = [], K._LinearFunction.forward
    monkeypatch.setattr(K._LinearFunction, "forward",
                        staticmethod(lambda *a: (calls.append(record(a[0])) if a[3] else None) or forward(*a)))
    return calls


def _spy_linear_function(monkeypatch) -> list:
    """Records (onednn, skip_zero_rows) of each call of the written-out linear (`_LinearFunction`)."""
    calls, apply = [], K._LinearFunction.apply
    monkeypatch.setattr(K._LinearFunction, "apply", lambda *a: calls.append((a[3], a[4])) or apply(*a))
    return calls


def _spy_gemm(monkeypatch, record=lambda a, w: a.reshape(-1, a.size(-1)).size(0)) -> list:
    """Records `record(left operand, weight)` of each GEMM `_LinearFunction` runs (`_gemm`); by default its rows."""
    calls, gemm = [], K._gemm
    monkeypatch.setattr(K, "_gemm", lambda a, w, *rest: calls.append(record(a, w)) or gemm(a, w, *rest))
    return calls


def _spy_fused_activations(monkeypatch) -> list:
    """Records the post-op of each oneDNN call that applies an activation inside the GEMM: the kernel module fetches
    the op through `_onednn_op()` at every call, so a wrapper returned from there sees them all."""
    calls, op = [], K._onednn_op()
    wrapper = lambda *a: (calls.append(a[3]) if a[3] != "none" else None) or op(*a)  # noqa: E731
    monkeypatch.setattr(K, "_onednn_op", lambda: wrapper)
    return calls


def _spy_bits_attention(monkeypatch) -> list:
    """Records each call of training attention with bits_dropout masks (`_eager_bits_dropout`, the formula written out;
    looked up at call time by the attention kernel)."""
    calls, eager = [], K._eager_bits_dropout
    monkeypatch.setattr(K, "_eager_bits_dropout", lambda *a, **k: calls.append(a[1].shape) or eager(*a, **k))
    return calls


def _spy_unpadding(monkeypatch, layout=None) -> list:
    """Records each forward whose layers run on the real tokens only (the token map of the "layout" point); with
    `layout`, checks how attention ran: one call per sequence or a compact masked grid."""
    calls, original = [], K.token_map_kernel

    def spy(*args, **kwargs):
        tokens = original(*args, **kwargs)
        if tokens is not None:
            if layout is not None:
                per_sequence = layout in ("unpadded", "per_sequence_attention")
                assert (tokens.seq_lengths is not None, tokens.grid_index is not None) == (
                    per_sequence, not per_sequence), layout
            calls.append(tokens)
        return tokens

    monkeypatch.setattr(K, "token_map_kernel", spy)
    return calls


@pytest.fixture(params=["per_sequence_attention", "grid_attention"])
def attention_layout(request):
    """Both ways unpadded sequences attend under eager / sdpa, each forced: one unmasked call per sequence, and one
    call on a masked (n, m) grid (what "auto" may pick on a CPU; the grid is what accelerators get)."""
    return request.param


def _assert_bf16_within_3x_of_nn_linear(layer, x32, g32):
    """`layer` (float32 weights, cast to bf16 here) against nn.Linear in bf16, both against a float32 copy: the
    output and the input, weight and bias gradients of g32 each within 3x nn.Linear's own error (+1e-6), the
    project's bf16 rule."""
    ref32 = nn.Linear(layer.in_features, layer.out_features)
    ref32.load_state_dict(layer.state_dict())
    ref16 = copy.deepcopy(ref32).bfloat16()
    layer.bfloat16()
    results = {}
    for name, module, dtype in (("mine", layer, torch.bfloat16), ("linear", ref16, torch.bfloat16),
                                ("fp32", ref32, torch.float32)):
        x = x32.to(dtype).requires_grad_()
        y = module(x)
        y.backward(g32.to(dtype))
        results[name] = [t.float() for t in (y, x.grad, module.weight.grad, module.bias.grad)]
    for mine, theirs, exact in zip(results["mine"], results["linear"], results["fp32"]):
        assert (mine - exact).abs().max() <= 3 * (theirs - exact).abs().max() + 1e-6


# ---------------------------------------------------------------------------------------------
# kernelize: the setting, what it puts on, what it leaves alone


def test_kernels_setting_is_validated_and_parsed():
    """"auto" by default; "reference"; kernel names as a string, comma-separated, or a list (forced; fused_activation
    and packed_linear imply onednn_linear). The config holds no speed switch any more: old config.json fields are
    dropped on load."""
    import inspect

    assert inspect.signature(kernelize).parameters["kernels"].default == "auto" and K.parse_setting("auto") == "auto"
    assert K.parse_setting("reference") == "reference"
    assert K.parse_setting("onednn_linear, bits_dropout") == frozenset({"onednn_linear", "bits_dropout"})
    assert K.parse_setting(["unpadded"]) == frozenset({"unpadded"})
    assert K.parse_setting("fused_activation") == frozenset({"fused_activation", "onednn_linear"})
    assert K.parse_setting("packed_linear") == frozenset({"packed_linear", "onednn_linear"})
    assert set(K.KERNELS) == {"onednn_linear", "fused_activation", "packed_linear", "skip_zero_rows", "bits_dropout",
                              "unpadded", "per_sequence_attention", "grid_attention", "matmul_attention"}
    assert K.parse_setting("matmul_attention") == frozenset({"matmul_attention", "unpadded"})
    old = hf_bert_impl.BertImplConfig.from_preset("debug", kernels="onednn_linear", sparse_prediction=True,
                                                  onednn_linear=True, unpad_inputs=False)
    assert not {"kernels", "sparse_prediction", "onednn_linear", "unpad_inputs"} & set(old.to_dict())


@pytest.mark.parametrize("bad", ["fast", "", "onednn", "onednn_linear,nope", [], ["unpadded", 3], None, 0,
                                 True, 1])
def test_a_bad_kernels_setting_is_refused_naming_the_value(debug_config, bad):
    """kernelize(model, kernels=<bad>) raises a ValueError naming the value and changes nothing on the model (the
    kernels it had stay on)."""
    message = re.escape(f"kernels must be 'auto', 'reference' or kernel names from {K.KERNELS} "
                        f"(comma-separated), got {bad!r}")
    model = _model(BertImplModel, debug_config(), "unpadded")
    before = kernelized(model)
    with pytest.raises(ValueError, match=message):
        kernelize(model, bad)
    assert kernelized(model) == before and before["layers.0.attn"] == "_attention_forward"
    with pytest.raises(ValueError, match=message):
        kernelize(BertImplModel(debug_config()), kernels=bad)


def test_a_kernelized_model_saves_exactly_what_the_plain_model_saves(debug_config, tmp_path):
    """kernelize replaces instance forwards only: save_pretrained of a kernelized model (every kernel, sparse
    prediction) writes the same files, byte for byte, as the plain model's: config.json (no speed field), the
    safetensors (same keys and tensors) and the code files; its state dict is the plain model's."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    plain = BertImplForPreTraining(debug_config())
    fast = kernelize(copy.deepcopy(plain), ",".join(K.KERNELS), sparse_prediction=True)
    assert len(kernelized(fast)) > _linear_layers(plain.config)
    assert fast.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(t, plain.state_dict()[k]) for k, t in fast.state_dict().items())
    plain.save_pretrained(tmp_path / "plain")
    fast.save_pretrained(tmp_path / "fast")
    files = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "fast").iterdir())
    assert {"config.json", "model.safetensors", "modeling_bert_impl.py", "configuration_bert_impl.py"} <= set(files)
    for name in files:
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    config = json.loads((tmp_path / "fast" / "config.json").read_text())
    assert not {"kernels", "sparse_prediction"} & set(config)
    saved = load_file(tmp_path / "fast" / "model.safetensors")
    assert set(saved) == set(load_file(tmp_path / "plain" / "model.safetensors"))
    assert kernelized(BertImplForPreTraining.from_pretrained(tmp_path / "fast")) == {}  # loads as the plain model


def test_kernelize_reference_restores_the_plain_forwards(debug_config, batch):
    """kernelize(model, "reference") takes every kernel off: no module keeps an instance `forward` (nor the sparse MLM
    method), kernelized(model) == {}, and the outputs are the plain model's bit for bit; kernelizing again replaces
    the previous kernels rather than stacking them."""
    torch.manual_seed(0)
    plain = BertImplForMaskedLM(debug_config()).eval()
    model = kernelize(copy.deepcopy(plain), ",".join(K.KERNELS), sparse_prediction=True)
    assert kernelized(model)["._mlm_logits_and_loss"] == "_sparse_mlm_logits_and_loss"
    kernelize(model, "unpadded")
    assert kernelized(model)["._mlm_logits_and_loss"] == "_dense_mlm_logits_and_loss"  # replaced, not added to
    assert kernelize(model, "reference") is model and kernelized(model) == {}
    assert not any("forward" in m.__dict__ or "_mlm_logits_and_loss" in m.__dict__ for m in model.modules())
    input_ids, attention_mask, _, labels = _mlm_batch(batch)
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask, labels=labels)
        want = plain(input_ids, attention_mask=attention_mask, labels=labels)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)


class _LoraLinear(nn.Linear):
    """What peft's LoRA puts in place of an nn.Linear (a subclass with its own forward): y = x Wᵀ + b + s (x Aᵀ) Bᵀ."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__(base.in_features, base.out_features)
        self.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(0)
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, generator=g) * 0.3)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank, generator=g) * 0.3)

    def forward(self, x):
        return super().forward(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


@needs_onednn
@pytest.mark.parametrize("change", ["replaced_after", "replaced_before", "hooked"])
def test_a_replaced_or_hooked_linear_runs_its_own_forward(debug_config, batch, monkeypatch, change):
    """A tool that replaces a layer's Wi (peft's LoRA: a subclass of nn.Linear) before or after kernelize, or hooks it:
    the fused MLP of that layer falls back to act(Wi(x)), so the replaced module's forward (or the hook) runs, and the
    output equals the plain model's with the same change (1e-5); the other layer keeps its fused activation."""
    torch.manual_seed(0)
    plain = BertImplModel(debug_config()).eval()
    original, fast = copy.deepcopy(plain), copy.deepcopy(plain)
    if change != "replaced_before":
        kernelize(fast, "fused_activation")
    seen = []
    for model in (plain, fast):
        mlp = model.layers[0].mlp
        if change == "hooked":
            mlp.Wi.register_forward_hook(lambda module, args, out: seen.append(1) or out * 1.5)
        else:
            mlp.Wi = _LoraLinear(mlp.Wi)  # the same A, B in both (a seeded generator)
    if change == "replaced_before":
        kernelize(fast, "fused_activation")
    assert kernelized(fast)["layers.0.mlp"] == "_mlp_forward"
    if change != "hooked":
        assert "layers.0.mlp.Wi" not in kernelized(fast)  # a subclass keeps its own forward
    calls = _spy_fused_activations(monkeypatch)
    input_ids, attention_mask, _ = batch
    with torch.no_grad():
        got = fast(input_ids, attention_mask=attention_mask).last_hidden_state
        assert calls == ["gelu"]  # layer 1 fused; layer 0 ran its Wi's own forward, then the activation
        want = plain(input_ids, attention_mask=attention_mask).last_hidden_state
    assert len(seen) == (2 if change == "hooked" else 0)
    assert (got - want).abs().max().item() <= ATOL
    with torch.no_grad():  # the control: without the change the outputs differ
        other = original(input_ids, attention_mask=attention_mask).last_hidden_state
    assert (other - want).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------------------------
# Point "linear": oneDNN's GEMM, the activation inside it


@needs_onednn
@pytest.mark.parametrize("in_features,out_features,dw_by_mm", [(32, 37, False), (8, 100, True)],
                         ids=["dW-on-onednn", "wide-output-dW-by-torch.mm"])
def test_onednn_linear_forward_and_backward_match_nn_linear(monkeypatch, in_features, out_features, dw_by_mm):
    """Forward and every gradient against nn.Linear, on both weight-gradient routes of the backward
    (oneDNN, and torch.mm for an output over 8x wider than the input: the vocabulary projection)."""
    torch.manual_seed(0)
    ref = nn.Linear(in_features, out_features)
    layer = kernelize(copy.deepcopy(ref), "onednn_linear")
    calls = _spy_onednn_linear(monkeypatch)
    x = torch.randn(13, 7, in_features, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    assert calls == [1]
    assert (y - y_ref).abs().max().item() <= ATOL
    g = torch.randn_like(y)
    mm_calls, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a: mm_calls.append(1) or mm(*a))
    y.backward(g)
    assert bool(mm_calls) == dw_by_mm
    monkeypatch.setattr(torch, "mm", mm)
    y_ref.backward(g)
    assert (x.grad - x_ref.grad).abs().max().item() <= ATOL
    assert (layer.weight.grad - ref.weight.grad).abs().max().item() <= 1e-4  # a sum over 91 rows of O(1) terms
    assert (layer.bias.grad - ref.bias.grad).abs().max().item() <= 1e-4
    # the reference, and every dtype oneDNN is not measured for, take nn.Linear's own path
    kernelize(layer, "reference")(x)
    kernelize(layer, "onednn_linear").to(torch.float16)(x.detach().half())
    assert calls == [1]


@needs_onednn_bf16
def test_onednn_linear_in_bfloat16_matches_nn_linear(monkeypatch):
    """bf16 forward and backward on oneDNN against nn.Linear in bf16: each within 3x nn.Linear's own
    error against a float32 copy (the project's bf16 rule), and the oneDNN branch was taken."""
    torch.manual_seed(0)
    layer = kernelize(nn.Linear(64, 48), "onednn_linear")
    calls = _spy_onednn_linear(monkeypatch)
    _assert_bf16_within_3x_of_nn_linear(layer, torch.randn(9, 5, 64), torch.randn(9, 5, 48))
    assert calls == [1]


@needs_onednn
@pytest.mark.parametrize("act,post", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu"), ("gelu_new", "gelu"),
                                      ("relu", "relu")])
def test_float32_inference_runs_the_activation_inside_the_gemm(debug_config, batch, monkeypatch, act, post):
    """"fused_activation" forced, float32 without grad: each MLP's and the MLM head's activation run as oneDNN's
    post-op; the same logits as the activation after oneDNN's GEMM (erf GELU bit for bit, the others <= 1e-6), as the
    plain model and as transformers' BertForMaskedLM (1e-5)."""
    from transformers import BertForMaskedLM

    from hf_bert_impl.convert import to_hf_bert

    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(hidden_act=act), "fused_activation").eval()
    unfused, plain = _forced(model, "onednn_linear"), _plain(model)
    input_ids, attention_mask, token_type_ids = batch
    calls = _spy_fused_activations(monkeypatch)
    with torch.no_grad():
        fused = model(input_ids, attention_mask, token_type_ids).logits
        assert calls == [post] * (model.config.num_hidden_layers + 1)  # every MLP and the MLM head's dense layer
        after = unfused(input_ids, attention_mask, token_type_ids).logits
        reference = plain(input_ids, attention_mask, token_type_ids).logits
        hf = to_hf_bert(model)
        assert isinstance(hf, BertForMaskedLM) and hf.config.hidden_act == act
        theirs = hf.eval()(input_ids, attention_mask, token_type_ids).logits
    assert len(calls) == model.config.num_hidden_layers + 1  # the unfused model fused nothing
    diff = (fused - after).abs().max().item()
    assert diff == 0.0 if act == "gelu" else diff <= 1e-6
    assert (fused - reference).abs().max().item() <= ATOL
    assert _max_diff_real(fused, theirs, attention_mask) <= ATOL


@needs_onednn
def test_inference_linears_skip_autograd_function_and_training_ones_keep_it(debug_config, batch, monkeypatch):
    """oneDNN's linear without gradients runs `_LinearFunction`'s forward directly (autograd.Function.apply binds its
    arguments to the signature at every call, a cost a batch-1 request feels), with gradients through `apply` (its
    backward); the outputs are the plain model's within ATOL either way."""
    forwards = _spy_onednn_linear(monkeypatch)
    applies = _spy_linear_function(monkeypatch)
    torch.manual_seed(0)
    model = _model(BertImplModel, debug_config(), "onednn_linear").eval()
    input_ids, attention_mask, _ = batch
    want = _plain(model)(input_ids, attention_mask=attention_mask).last_hidden_state.detach()
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask).last_hidden_state
    linears = 4 * model.config.num_hidden_layers + 1  # each layer's four and the pooler (no MLM head here)
    assert len(forwards) == linears and applies == []
    assert _max_diff_real(got, want, attention_mask) <= ATOL
    forwards.clear()
    got = model(input_ids, attention_mask=attention_mask).last_hidden_state
    assert len(applies) == len(forwards) == linears
    assert _max_diff_real(got.detach(), want, attention_mask) <= ATOL


@needs_onednn
def test_the_activation_stays_after_the_gemm_where_it_must(debug_config, batch, monkeypatch):
    """"fused_activation" forced, yet not fused: with grad (the backward needs the pre-activation), for an activation
    oneDNN has no post-op for (silu), and on a hooked activation module, whose hook still sees its output."""
    input_ids, attention_mask, _ = batch
    calls = _spy_fused_activations(monkeypatch)
    model = _model(BertImplForMaskedLM, debug_config(), "fused_activation").eval()
    model(input_ids, attention_mask)  # grad enabled
    with torch.no_grad():
        silu = _model(BertImplForMaskedLM, debug_config(hidden_act="silu"), "fused_activation").eval()
        silu(input_ids, attention_mask)
        assert calls == []
        expected = model(input_ids, attention_mask).logits
        seen = []
        model.bert.layers[0].mlp.act.register_forward_hook(lambda module, args, out: seen.append(out))
        hooked = model(input_ids, attention_mask).logits
    assert len(seen) == 1 and seen[0].shape[-1] == model.config.intermediate_size
    # unhooked: L + 1 fused calls; hooked: L (layer 0 not)
    assert calls == ["gelu"] * (2 * model.config.num_hidden_layers + 1)
    assert (hooked - expected).abs().max().item() == 0.0  # the erf GELU fused or not: bit for bit


@needs_onednn
@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_a_bf16_activation_inside_the_gemm_keeps_the_bf16_rule(act, monkeypatch):
    """"fused_activation" in bfloat16 inference: the activation runs inside oneDNN's GEMM (on the float32 accumulator,
    before the output is rounded), and its error against the float32 layer stays within 3x that of the unfused bfloat16
    layer (F.linear then the activation, as transformers runs it), the project's bf16 rule."""
    if not K._onednn_runs(torch.bfloat16):
        pytest.skip("oneDNN cannot compute in bfloat16 here")
    calls = _spy_fused_activations(monkeypatch)
    g = torch.Generator().manual_seed(0)
    layer, activation = nn.Linear(64, 96), ACT2FN[act]
    x = torch.randn(33, 64, generator=g)
    exact = activation(layer(x))
    layer16 = copy.deepcopy(layer).bfloat16()
    with torch.no_grad():
        fused = K.linear_kernel("fused_activation", layer16, x.bfloat16(), activation)
        unfused = activation(layer16(x.bfloat16()))
    assert calls == [{"gelu_pytorch_tanh": "gelu"}.get(act, act)] and fused.dtype == torch.bfloat16
    error, own = ((t.float() - exact).abs().max().item() for t in (fused, unfused))
    assert 0 < own and error <= 3 * own + 1e-6


needs_packing = pytest.mark.skipif(not K._packs(torch.float32),
                                   reason="this torch build cannot reorder a float32 weight for oneDNN")


def _spy_packing(monkeypatch) -> list:
    """Records (weight shape, rows it is packed for) of each weight `packed_linear` reorders into oneDNN's layout."""
    calls, reorder = [], K._reorder_op()
    monkeypatch.setattr(K, "_reorder_op", lambda: lambda w, rows: calls.append((tuple(w.shape), rows)) or
                        reorder(w, rows))
    return calls


@needs_packing
def test_packed_linear_infers_as_the_plain_model_and_packs_each_weight_once(debug_config, batch, monkeypatch):
    """"packed_linear" forced, float32 inference: every linear layer runs oneDNN's GEMM on its weight reordered once
    (the activation inside, as "fused_activation"), the logits within 1e-5 of the plain model's and of
    transformers' BertForMaskedLM; a second call packs nothing; the packed weights live beside the model: its state
    dict (what save_pretrained writes) holds the plain tensors, and a deep copy packs its own."""
    from transformers import BertForMaskedLM

    from hf_bert_impl.convert import to_hf_bert

    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), "packed_linear").eval()
    plain = _plain(model)
    input_ids, attention_mask, token_type_ids = batch
    packed, fused = _spy_packing(monkeypatch), _spy_fused_activations(monkeypatch)
    with torch.no_grad():
        got = model(input_ids, attention_mask, token_type_ids).logits
        assert len(packed) == _linear_layers(model.config)  # every linear layer, once
        assert fused == ["gelu"] * (model.config.num_hidden_layers + 1)
        again = model(input_ids, attention_mask, token_type_ids).logits
        assert len(packed) == _linear_layers(model.config)  # kept: nothing packed again
        want = plain(input_ids, attention_mask, token_type_ids).logits
        theirs = to_hf_bert(plain).eval()(input_ids, attention_mask, token_type_ids).logits
    assert torch.equal(got, again)
    assert (got - want).abs().max().item() <= ATOL
    assert _max_diff_real(got, theirs, attention_mask) <= ATOL
    state = model.state_dict()
    assert state.keys() == plain.state_dict().keys() and all(t.layout == torch.strided for t in state.values())
    with torch.no_grad():
        copied = copy.deepcopy(model)(input_ids, attention_mask, token_type_ids).logits  # its own packed weights
    assert torch.equal(copied, got) and len(packed) == 2 * _linear_layers(model.config)


@needs_packing
def test_packed_weights_follow_every_change_of_the_weights(debug_config, batch, monkeypatch):
    """A packed weight is made again when its weight changes: in place (an optimizer step, load_state_dict) or by a
    new Parameter: inference after each equals the plain model with the same change (1e-5). With grad the
    layers run oneDNN on the plain weight (a packed one has no backward): training steps as the plain model does.
    One packed weight per layer serves every row count; kernelize drops them."""
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), "packed_linear").eval()
    plain = _plain(model)
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    packed, onednn = _spy_packing(monkeypatch), _spy_onednn_linear(monkeypatch)

    def agree():
        with torch.no_grad():
            got = model(input_ids, attention_mask, token_type_ids).logits
            want = plain(input_ids, attention_mask, token_type_ids).logits
        assert (got - want).abs().max().item() <= ATOL

    agree()
    layers = _linear_layers(model.config)
    for m in (model, plain):  # a training step, on each
        m.train()
        m(input_ids, attention_mask, token_type_ids, labels=labels).loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.5 * p.grad
        m.eval()
    assert len(onednn) == layers and len(packed) == layers  # the step ran oneDNN on the plain weights, packed nothing
    agree()
    assert len(packed) == 2 * layers  # every weight changed: every one packed again
    state = {k: v * 1.1 for k, v in plain.state_dict().items()}
    model.load_state_dict(state)
    plain.load_state_dict(state)
    agree()
    fresh = nn.Parameter(torch.randn_like(plain.bert.layers[0].mlp.Wi.weight))
    model.bert.layers[0].mlp.Wi.weight = fresh
    plain.bert.layers[0].mlp.Wi.weight = nn.Parameter(fresh.detach().clone())
    before = len(packed)
    agree()
    assert len(packed) == before + 1  # only the new one
    before = len(packed)
    with torch.no_grad():  # other row counts: the same packed weights
        for rows in (1, 3, 9, 17):
            got = model(input_ids[:1, :rows], attention_mask[:1, :rows]).logits
            assert (got - plain(input_ids[:1, :rows], attention_mask[:1, :rows]).logits).abs().max() <= ATOL
    assert len(packed) == before and {rows for _, rows in packed} == {K.PACK_ROWS}
    for m in (model, plain):  # a write through .data (peft's merge) bumps no version: kernelize again after one
        m.bert.layers[1].mlp.Wo.weight.data += 0.5
    kernelize(model, "packed_linear")
    assert model.bert.layers[0].mlp.Wi not in K._PACKED
    agree()


@needs_packing
def test_auto_packs_weights_only_for_a_frozen_model(debug_config, batch, monkeypatch, fresh_choices):
    """"auto" measures "packed_linear" among the inference candidates only under kernelize(..., frozen=True) (a
    promise that the weights stay as they are), under its own choice key ("infer-frozen"); not without it, and never
    in training. Either way the logits are the plain model's (1e-5)."""
    seen, candidates = [], K._linear_candidates
    monkeypatch.setattr(K, "_linear_candidates", lambda *a: (lambda c: seen.append((a[4], set(c))) or c)(
        candidates(*a)))
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), "auto")
    plain = _plain(model).eval()
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    for frozen in (False, True):
        kernelize(model, "auto", frozen=frozen).eval()
        with torch.no_grad():
            got = model(input_ids, attention_mask, token_type_ids).logits
            want = plain(input_ids, attention_mask, token_type_ids).logits
        assert (got - want).abs().max().item() <= ATOL
        inference = [names for grad, names in seen if not grad]
        assert inference and all(("packed_linear" in names) == frozen for names in inference), seen
        seen.clear()
    model.train()(input_ids, attention_mask, token_type_ids, labels=labels).loss.backward()  # frozen: still trains
    assert seen and all(grad and "packed_linear" not in names for grad, names in seen)
    keys = K.chosen_kernels()
    assert any("|infer-frozen|" in key for key in keys) and any("|infer|" in key for key in keys)
    _assert_valid_choices(keys, ("linear",))


@needs_onednn_bf16
def test_onednn_linear_under_bfloat16_autocast(debug_config, batch, monkeypatch):
    """Under torch.autocast("cpu", bfloat16) (Trainer's --bf16 on a CPU) forced oneDNN runs every linear layer in
    bfloat16 from the float32 weights, as nn.Linear's op does under autocast: the same output dtype, and the MLM loss,
    the logits and every weight's gradient within 3x the plain model's own error against float32 without autocast.
    Under float16 autocast nn.Linear's op runs."""
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), "onednn_linear")
    plain = _plain(model)
    exact = _plain(model)
    calls = _spy_onednn_linear(monkeypatch, record=lambda x: x.dtype)
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    results = {}
    for name, m, enabled in (("onednn", model, True), ("linear", plain, True), ("fp32", exact, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = m(**inputs)
        out.loss.backward()
        results[name] = [out.loss.float(), out.logits.float()] + [p.grad for p in m.parameters()]
        assert out.logits.dtype == (torch.bfloat16 if enabled else torch.float32)
    assert calls == [torch.bfloat16] * _linear_layers(model.config)
    names = ["loss", "logits"] + [n for n, _ in model.named_parameters()]
    for name, mine, theirs, ref in zip(names, results["onednn"], results["linear"], results["fp32"]):
        assert (mine - ref).abs().max() <= 3 * (theirs - ref).abs().max() + 1e-6, name
    calls.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(**inputs)
    assert calls == []


@needs_onednn_bf16
def test_autocast_inference_casts_weights_anew_into_a_kept_buffer(monkeypatch):
    """Without grad under bf16 autocast forced oneDNN casts each float32 weight into a buffer kept per thread, shape
    and dtype (one allocation, not one per call): the output equals the freshly cast one bit for bit, every call casts
    anew (a weight changed in place, even through `.data`, is seen at once), and another thread gets its own buffer."""
    torch.manual_seed(0)
    layer = kernelize(nn.Linear(16, 24), "onednn_linear")
    weights = _spy_gemm(monkeypatch, record=lambda a, w: w)  # the weight each GEMM is given
    x = torch.randn(5, 16)

    def run(grad: bool):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x).detach()

    assert torch.equal(run(False), run(True))  # kept buffer vs a fresh cast (with grad: saved for the backward)
    kept, fresh = weights
    assert kept.dtype == torch.bfloat16 and fresh.data_ptr() != kept.data_ptr()
    run(False)
    assert weights[2].data_ptr() == kept.data_ptr()  # the same buffer again
    with torch.no_grad():
        layer.weight.mul_(2)
    layer.weight.data.add_(1)  # bypasses the version counter: still seen, the buffer is refilled every call
    assert torch.equal(run(False), F.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16()))
    other = []
    thread = threading.Thread(target=lambda: other.append(run(False)))
    thread.start()
    thread.join()
    assert torch.equal(other[0], run(False))
    assert weights[-2].data_ptr() != weights[-1].data_ptr() == kept.data_ptr()  # the other thread's buffer, then ours


@needs_onednn
def test_a_loaded_or_moved_model_takes_the_forced_onednn_branch(debug_config, tmp_path, monkeypatch):
    """A saved model loads as the plain model (the kernels are not saved: nothing runs oneDNN until kernelize is
    called); kernelize after from_pretrained, then .to() moves and casts: the branch follows the weights as they are
    when called, not as they were when kernelized."""
    calls = _spy_onednn_linear(monkeypatch)
    _model(BertImplModel, debug_config(), "onednn_linear").save_pretrained(tmp_path)
    model = BertImplModel.from_pretrained(tmp_path).eval()
    ids = torch.ones(1, 4, dtype=torch.long)
    with torch.no_grad():
        model(ids)
        assert kernelized(model) == {} and calls == []
        kernelize(model, "onednn_linear")(ids)
        assert len(calls) > 0
        del calls[:]
        model.to(torch.float16)(ids)
        assert calls == []
        if K._onednn_runs(torch.bfloat16):
            model.to(torch.bfloat16)(ids)
            assert len(calls) > 0


# ---------------------------------------------------------------------------------------------
# Point "decoder": the MLM decoder's backward skips positions without a label


@pytest.mark.parametrize("setting", ["onednn_linear,skip_zero_rows", "skip_zero_rows"], ids=["onednn", "blas"])
@pytest.mark.parametrize("labelled,skipped", [(0.15, True), (0.8, False)], ids=["15%-rows", "80%-rows"])
def test_the_decoder_backward_skips_rows_with_a_zero_gradient(monkeypatch, setting, labelled, skipped):
    """"skip_zero_rows" forced (the MLM decoder): a row of dy that is all zero adds nothing to dx, dW or db, so the
    backward runs on the other rows when at most half are left and on every row otherwise; on either GEMM library every
    gradient equals nn.Linear's (float32, 1e-5). Without grad, or for the other linear layers, nothing changes."""
    onednn = "onednn_linear" in setting
    if onednn and K._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear")
    torch.manual_seed(0)
    ref = nn.Linear(16, 90)
    layer = _decoder(copy.deepcopy(ref), setting)
    x = torch.randn(13, 7, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    rows = torch.rand(13, 7, generator=torch.Generator().manual_seed(3)) < labelled  # (13, 7) rows with a gradient
    g = torch.randn(13, 7, 90) * rows.unsqueeze(-1)
    gemm_rows = _spy_gemm(monkeypatch)
    y = layer(x)
    assert gemm_rows == [91]  # the forward: every row (the logits are an output)
    y.backward(g)
    assert gemm_rows[1] == (int(rows.sum()) if skipped else 91)  # dx = dy W
    ref(x_ref).backward(g)
    assert (y - ref(x_ref)).abs().max().item() <= ATOL
    assert (x.grad - x_ref.grad).abs().max().item() <= ATOL
    assert x.grad[~rows].abs().max().item() == 0.0
    assert (layer.weight.grad - ref.weight.grad).abs().max().item() <= ATOL
    assert (layer.bias.grad - ref.bias.grad).abs().max().item() <= ATOL
    gemm_rows.clear()
    with torch.no_grad():
        layer(x)
    assert gemm_rows == ([91] if onednn else [])  # no grad: the forward alone (blas: nn.Linear's own op)
    gemm_rows.clear()
    kernelize(nn.Linear(16, 90), setting)(x).backward(g)  # not the decoder: every row (forward, dx, dWᵀ's 90 rows)
    assert gemm_rows == ([91, 91, 90] if onednn else [])


@pytest.mark.parametrize("setting", ["onednn_linear,skip_zero_rows", "skip_zero_rows"], ids=["onednn", "blas"])
def test_the_decoder_backward_skips_zero_rows_in_bfloat16(monkeypatch, setting):
    """bf16 weights: the skipping backward's output and gradients each within 3x nn.Linear's own bf16
    error against a float32 copy (the project's bf16 rule), and the dx GEMM ran on the nonzero rows."""
    if "onednn_linear" in setting and not K._onednn_runs(torch.bfloat16):
        pytest.skip("oneDNN's linear has no bfloat16 kernel on this CPU / build")
    torch.manual_seed(0)
    layer = _decoder(nn.Linear(64, 600), setting)
    rows = torch.rand(9, 5, generator=torch.Generator().manual_seed(5)) < 0.2  # (9, 5)
    x32, g32 = torch.randn(9, 5, 64), torch.randn(9, 5, 600) * rows.unsqueeze(-1)
    gemm_rows = _spy_gemm(monkeypatch)
    _assert_bf16_within_3x_of_nn_linear(layer, x32, g32)
    assert gemm_rows[:2] == [45, int(rows.sum())]


@pytest.mark.parametrize("setting", ["onednn_linear", "skip_zero_rows"])
def test_torch_func_grad_runs_through_the_written_out_backward(debug_config, batch, setting, monkeypatch):
    """torch.func.grad (functorch) over the MLM loss gives autograd's gradients through `_LinearFunction` (oneDNN's
    GEMMs; the decoder's row skipping): it keeps its context in `setup_context`, as functorch transforms require."""
    if setting == "onednn_linear" and K._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear")
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), setting).train()
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    inputs = dict(attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    params = {name: p.detach() for name, p in model.named_parameters()}
    calls = _spy_linear_function(monkeypatch)
    grads = grad(lambda p: functional_call(model, p, (input_ids,), inputs).loss)(params)
    assert calls and all(c == (setting == "onednn_linear", setting == "skip_zero_rows") for c in calls), calls
    model(input_ids, **inputs).loss.backward()
    for name, p in model.named_parameters():
        assert (grads[name] - p.grad).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("setting", ["auto", "reference", "skip_zero_rows", "onednn_linear,skip_zero_rows"])
def test_kernelized_mlm_step_matches_transformers(batch, setting, monkeypatch):
    """The oracle for the training step with full logits (sparse_prediction off, kernelize's default): transformers'
    BertForMaskedLM with the same weights, on a padded batch with 30% of the real tokens labelled. The loss, the logits
    and every gradient within 1e-5 whatever runs ("auto": whatever it picks here; "reference": the plain model), and
    with skip_zero_rows forced the decoder's backward on the labelled rows only (the others' gradient is zero)."""
    if "onednn_linear" in setting and K._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear")
    from transformers import BertForMaskedLM

    from hf_bert_impl.convert import convert_hf_state_dict, from_hf_bert

    torch.manual_seed(0)
    hf = BertForMaskedLM(hf_config("BertForMaskedLM", attn_implementation="sdpa"))
    ours = from_hf_bert(hf, BertImplForMaskedLM)
    assert kernelized(ours) == {}  # converted: the plain model
    kernelize(ours, setting)
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    rows = _spy_gemm(monkeypatch)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    got = ours(**inputs)
    got.loss.backward()
    want = hf(**inputs)
    want.loss.backward()
    n = int(labels.ne(-100).sum())
    assert n < input_ids.numel() // 2 and got.logits.shape == want.logits.shape
    if "skip_zero_rows" in setting:
        assert n in rows  # the decoder's dx = dy W ran on the labelled rows
    elif setting == "reference":
        assert rows == [] and kernelized(ours) == {}  # nn.Linear everywhere
    real = attention_mask.bool()
    assert abs(got.loss.item() - want.loss.item()) <= ATOL
    assert (got.logits - want.logits)[real].abs().max().item() <= ATOL
    hf_grads, _ = convert_hf_state_dict({k: p.grad for k, p in hf.named_parameters()}, 2, tied=True)
    for name, p in ours.named_parameters():
        assert (p.grad - hf_grads[name]).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("setting", ["auto", *K.KERNELS, ",".join(K.KERNELS)])
def test_every_kernel_forced_gives_the_reference_outputs_and_gradients(debug_config, batch, setting):
    """Each kernel forced alone, all of them together, and "auto" (whatever it picks), against the plain model on a
    padded MLM training step (dropout off): logits at every position (both zero the padding), loss and every gradient
    within 1e-5; and the inference logits."""
    if ("onednn_linear" in setting or "fused_activation" in setting) and K._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear")
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), setting).train()
    plain = _plain(model)
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    out, ref = model(**inputs), plain(**inputs)
    assert (out.logits - ref.logits).abs().max().item() <= ATOL
    assert abs(out.loss.item() - ref.loss.item()) <= ATOL
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name
    with torch.no_grad():
        got, want = model.eval()(**inputs).logits, plain.eval()(**inputs).logits
    assert (got - want).abs().max().item() <= ATOL


# ---------------------------------------------------------------------------------------------
# Point "dropout": masks from 32 random bits per element


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_bits_dropout_keeps_each_element_with_probability_1_minus_p(p):
    """Bernoulli(1 - p) masks, kept values scaled by 1/(1 - p) exactly as a float32 product: over 2M elements the
    dropped fraction, and the fraction of adjacent pairs (the two halves of one 64-bit draw) both dropped, are within 5
    binomial standard deviations of p and p²."""
    n = 2_000_000
    x = torch.randn(n)
    y = K.bits_dropout(x, p)
    dropped = y == 0
    assert abs(dropped.double().mean().item() - p) <= 5 * (p * (1 - p) / n) ** 0.5
    both = (dropped[0::2] & dropped[1::2]).double().mean().item()
    assert abs(both - p * p) <= 5 * (p * p * (1 - p * p) / (n // 2)) ** 0.5
    assert torch.equal(y[~dropped], x[~dropped] * (1 / (1 - p)))
    xb = x[:1000].bfloat16()  # bf16: the product rounded once, from float32
    yb = K.bits_dropout(xb, p)
    assert torch.equal(yb[yb != 0], (xb.float() * (1 / (1 - p))).bfloat16()[yb != 0])


def test_bits_dropout_gradient_seed_and_identity_cases():
    """Forced on an nn.Dropout (kernelize): the gradient is the kept mask times 1/(1 - p); torch's generator
    (manual_seed) decides the mask; eval and p = 0 give the input itself; "reference" and the plain module are
    F.dropout bit for bit."""
    drop = kernelize(nn.Dropout(0.25), "bits_dropout").train()
    assert kernelized(drop) == {"": "_dropout_forward"}
    x = torch.randn(4, 5, 6, requires_grad=True)
    g = torch.randn(4, 5, 6)
    torch.manual_seed(3)
    y = drop(x)
    y.backward(g)
    assert torch.equal(x.grad, torch.where(y != 0, g * (1 / 0.75), 0.0))
    torch.manual_seed(3)
    assert torch.equal(drop(x), y) and not torch.equal(drop(x), y)
    torch.manual_seed(3)
    assert torch.equal(K.bits_dropout(x, 0.25), y)  # the kernel itself, nothing else drawn
    assert drop.eval()(x) is x and kernelize(nn.Dropout(0.0), "bits_dropout").train()(x) is x
    torch.manual_seed(3)
    theirs = F.dropout(x, 0.25, True)
    torch.manual_seed(3)
    assert torch.equal(kernelize(drop, "reference").train()(x), theirs)
    assert not torch.equal(theirs, y)  # the two kernels draw different masks from the same seed
    torch.manual_seed(3)
    assert torch.equal(nn.Dropout(0.25)(x), theirs)  # the plain module: the reference


_DROPOUT_CASES = {  # case: (kernels, p, training, device, the answer)
    "forced": (frozenset({"bits_dropout"}), 0.1, True, "cpu", "bits_dropout"),
    "forced-by-name": ("bits_dropout,unpadded", 0.5, True, "cpu", "bits_dropout"),
    "eval": ("bits_dropout", 0.1, False, "cpu", "reference"),
    "p=0": ("bits_dropout", 0.0, True, "cpu", "reference"),
    "p=1": ("bits_dropout", 1.0, True, "cpu", "reference"),
    "not-a-cpu-tensor": ("bits_dropout", 0.1, True, "meta", "reference"),
    "reference": ("reference", 0.1, True, "cpu", "reference"),
    "other-kernels-forced": ("onednn_linear", 0.1, True, "cpu", "reference"),
    "auto-in-eval": ("auto", 0.1, False, "cpu", "reference"),
}


@pytest.mark.parametrize("case", list(_DROPOUT_CASES))
def test_dropout_choice_takes_bits_only_in_plain_eager_cpu_training(case):
    """`dropout_choice` (which decides both the mask and the attention route): forced bits only in training with
    0 < p < 1, on a plain CPU tensor; every other case runs the reference (F.dropout)."""
    setting, p, training, device, expected = _DROPOUT_CASES[case]
    assert K.dropout_choice(setting, torch.randn(3, device=device), p, training) == expected


def test_dropout_choice_is_the_reference_while_compiling(monkeypatch):
    """Not while torch.compile traces (there F.dropout and SDPA, as inductor expects), even forced."""
    x = torch.randn(3)
    assert K.dropout_choice("bits_dropout", x, 0.1, True) == "bits_dropout"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert K.dropout_choice("bits_dropout", x, 0.1, True) == "reference"
    assert K.dropout_choice("auto", x, 0.1, True) == "reference"


@pytest.mark.parametrize("faster,masks", [("bits_dropout", "right"), ("reference", "right"),
                                          ("bits_dropout", "keep everything")])
def test_auto_dropout_takes_the_faster_kernel_whose_statistics_hold(fresh_choices, monkeypatch, faster, masks):
    """"auto" at the dropout point, its timing rigged so that `faster` wins: it answers bits_dropout only where
    bits_dropout is faster AND its masks pass the statistics check (a kernel that keeps every element never does),
    records the answer under the point's key, answers the same afterwards without measuring, and leaves the random
    stream as it was (measuring draws numbers of its own)."""
    ran, real_bits = [], K.bits_dropout
    if masks == "right":
        monkeypatch.setattr(K, "bits_dropout", lambda x, p: ran.append("bits") or real_bits(x, p))
    else:
        monkeypatch.setattr(K, "bits_dropout", lambda x, p: ran.append("bits") or x * (1 / (1 - p)))

    def rigged(fn, reps=3, warm=False):  # which kernel `fn` runs decides its time
        ran.clear()
        fn()
        return 0.0 if ("bits" in ran) == (faster == "bits_dropout") else 1.0

    monkeypatch.setattr(K, "_median_seconds", rigged)
    x = torch.randn(6, 50)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    choice = K.dropout_choice("auto", x, 0.3, True)
    assert torch.equal(torch.get_rng_state(), state)
    expected = "bits_dropout" if faster == "bits_dropout" and masks == "right" else "reference"
    assert choice == expected
    assert K.chosen_kernels() == {"dropout|cpu|float32|numel<=512": expected}
    monkeypatch.setattr(K, "_median_seconds", lambda *a, **k: pytest.fail("a made choice was measured again"))
    assert K.dropout_choice("auto", torch.randn(7, 60), 0.3, True) == expected  # the same shape class
    assert next(iter(json.loads(fresh_choices.read_text()).values())) == K.chosen_kernels()


@pytest.mark.parametrize("grad", [True, False])
def test_auto_times_training_linears_with_their_backward(fresh_choices, monkeypatch, grad):
    """"auto" at a linear point in grad mode times each candidate on forward + backward (a GEMM that wins the
    forward can lose the step), in inference on the forward alone; every candidate's output agrees with F.linear."""
    if K._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear")
    layer, act = nn.Linear(16, 24), ACT2FN["gelu"]  # the model's activation class (oneDNN can fuse it)
    backwards, timed = [], []
    act.register_full_backward_hook(lambda *a: backwards.append(1))
    x = torch.randn(4, 16, requires_grad=grad)

    def counting(fn, reps=3, warm=False):  # the timing itself rigged: each candidate's call counted, no clock
        before = len(backwards)
        fn()
        timed.append(len(backwards) - before)
        return float(len(timed))  # the first timed candidate (the reference) is the fastest

    monkeypatch.setattr(K, "_median_seconds", counting)
    with torch.set_grad_enabled(grad):
        out = K.linear_kernel("auto", layer, x, act)
        expected = act(F.linear(x, layer.weight, layer.bias))
    assert out is None  # the reference won: the plain path runs
    assert len(timed) >= 2  # the reference and oneDNN's linear at least
    assert timed == [1 if grad else 0] * len(timed)  # each timed call ran one backward in grad mode, none otherwise
    assert {k.split("|")[-2] for k in K.chosen_kernels()} == {"train" if grad else "infer"}
    candidates = K._linear_candidates(x.detach(), layer.weight.detach(), layer.bias.detach(), act, grad)
    assert ("fused_activation" in candidates) == (not grad)
    for name, fn in candidates.items():
        torch.testing.assert_close(fn(), expected.detach(), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("setting,bits", [("bits_dropout", True), ("unpadded,bits_dropout", True),
                                          ("reference", False)])
def test_training_attention_with_bits_dropout_runs_the_formula(debug_config, batch, setting, bits, monkeypatch):
    """Training with attention dropout: with bits_dropout forced attention runs the eager formula with its masks
    (SDPA's CPU kernels draw their own) and no module draws a mask with bernoulli_, padded or unpadded; the reference
    runs SDPA with F.dropout. Either way the probabilities are dropped: the same seed repeats a step, another changes
    it."""
    calls = _spy_bits_attention(monkeypatch)
    torch.manual_seed(0)
    config = debug_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = _model(BertImplModel, config, setting).train()
    assert model.config._attn_implementation == "sdpa"
    assert {type(m) for m in model.modules() if isinstance(m, nn.Dropout)} == {nn.Dropout}  # the standard module
    input_ids, attention_mask, _ = batch
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        with torch.profiler.profile() as prof:
            outs.append(model(input_ids, attention_mask=attention_mask).last_hidden_state)
    assert bool(calls) == bits
    assert any(e.key == "aten::bernoulli_" for e in prof.key_averages()) != bits
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    calls.clear()
    with torch.no_grad():
        model.eval()(input_ids, attention_mask=attention_mask)
    assert calls == []


def test_training_attention_with_bits_dropout_drops_the_probabilities(debug_config):
    """One attention block in training with bits_dropout forced: its output equals softmax(QKᵀ/√d) with bits_dropout's
    mask (same seed), times V, then W^O, to 1e-6."""
    torch.manual_seed(0)
    config = debug_config(attention_probs_dropout_prob=0.3)
    attn = kernelize(mb.BertImplSelfAttention(config), "bits_dropout").train()
    x = torch.randn(1, 6, config.hidden_size)
    torch.manual_seed(5)
    out, _ = attn(x)
    q, k, v = attn.Wqkv(x).view(1, 6, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)  # (b, h, s, d) each
    torch.manual_seed(5)
    probs = K.bits_dropout(torch.softmax(q @ k.transpose(-2, -1) * attn.scaling, -1), 0.3)
    ref = attn.Wo((probs @ v).transpose(1, 2).reshape(1, 6, -1))
    assert (out - ref).abs().max().item() <= 1e-6
    assert (probs == 0).any()  # some probabilities were dropped: the check sees the mask


@pytest.mark.parametrize("setting", ["bits_dropout", "unpadded,bits_dropout", "reference"])
def test_gradient_checkpointing_redraws_the_same_dropout_masks(debug_config, batch, setting):
    """Gradient checkpointing runs each layer's forward again in the backward: with dropout on, the recomputation
    must draw the masks of the first forward (torch's checkpoint restores the generator), so the loss and every
    gradient equal those of the same seeded step without checkpointing (1e-5)."""
    torch.manual_seed(0)
    config = debug_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = _model(BertImplForMaskedLM, config, setting).train()
    twin = copy.deepcopy(model)
    assert kernelized(twin) == kernelized(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids, attention_mask, _, labels = _mlm_batch(batch)
    losses = []
    for m in (model, twin):
        torch.manual_seed(11)
        loss = m(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= ATOL
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


# ---------------------------------------------------------------------------------------------
# Host reads: values are read on the CPU only; a forward waits for an accelerator no more often than transformers


def _no_host_reads(monkeypatch):
    """Every way of reading a tensor's value on the host fails the test (inside a monkeypatch context)."""
    for name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__", "unique"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read: Tensor.{_n}"))


def test_input_checks_read_no_value_off_the_cpu(debug_config, monkeypatch):
    """The model's input checks (`_check_inputs`) on meta tensors (no values, as an accelerator's, which the host reads
    only with a sync): shapes and dtypes are checked, no value is read, so bad values pass unseen there; the same
    values on the CPU raise a ValueError naming the value."""
    config = debug_config(position_embedding_type="learned", max_position_embeddings=16)
    ids = torch.randint(1, VOCAB, (2, 5))
    ids[1, 3] = VOCAB + 3
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 0] = 2
    positions = torch.arange(5).expand(2, 5).clone()
    positions[0, 4] = 40
    meta = [t.to("meta") for t in (ids, mask, ids.clamp(max=1), positions)]
    with monkeypatch.context() as guard:
        _no_host_reads(guard)
        mb._check_inputs(config, *meta, None)  # nothing read: no error
        with pytest.raises(ValueError, match=r"token_type_ids has shape \(2, 4\) but the input has shape \(2, 5\)"):
            mb._check_inputs(config, meta[0], meta[1], meta[2][:, :4], meta[3], None)
        with pytest.raises(ValueError, match="input_ids must hold integer ids, got dtype torch.float32"):
            mb._check_inputs(config, meta[0].float(), None, None, None, None)
    with pytest.raises(ValueError, match=r"input_ids contains 102, outside \[0, vocab_size=99\)"):
        mb._check_inputs(config, ids, None, None, None, None)
    with pytest.raises(ValueError, match="attention_mask must hold 1 for tokens and 0 for padding, got 2"):
        mb._check_inputs(config, ids.clamp(max=VOCAB - 1), mask, None, None, None)
    with pytest.raises(ValueError, match="sequence needs position 40 but learned positions stop at"):
        mb._check_inputs(config, ids.clamp(max=VOCAB - 1), None, None, positions, None)


class _HostReads(TorchDispatchMode):
    """Records every op of a forward that makes the host wait for an accelerator: reading a value
    (int(), bool(), .item() -> _local_scalar_dense; .tolist(), counted by `_count_host_reads`) and ops
    whose output size depends on the values (nonzero, unique, masked_select, repeat_interleave without
    output_size). nonzero_static and repeat_interleave with output_size are not syncs."""

    SIZE_FROM_VALUES = ("aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                        "aten.unique_dim.default", "aten.unique_consecutive.default")

    def __init__(self):
        super().__init__()
        self.reads, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if not self.paused and (name == "aten._local_scalar_dense.default" or name in self.SIZE_FROM_VALUES
                                or name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None):
            self.reads.append(name)
        return func(*args, **kwargs)


def _count_host_reads(model, monkeypatch, **inputs) -> list[str]:
    """The host reads of one forward of `model`. The input checks and the embeddings read values on the CPU only (the
    tensors here), and nothing on another device (tested above and below): their reads are not counted."""
    mode = _HostReads()
    tolist, embeddings, checks = torch.Tensor.tolist, mb.BertImplEmbeddings.forward, mb._check_inputs

    def unrecorded(fn):
        def call(*args, **kwargs):
            mode.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                mode.paused = False
        return call

    def counted_tolist(t):
        if not mode.paused:
            mode.reads.append("Tensor.tolist")
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(mb.BertImplEmbeddings, "forward", unrecorded(embeddings))
    monkeypatch.setattr(mb, "_check_inputs", unrecorded(checks))
    with torch.no_grad(), mode:
        model(**inputs)
    monkeypatch.undo()
    return mode.reads


@pytest.mark.parametrize("position_type", ["sinusoidal", "learned"])
@pytest.mark.parametrize("setting,mask_kind", [
    ("reference", "no mask"), ("reference", "all ones"), ("reference", "padded"), ("unpadded", "no mask"),
    ("unpadded", "all ones"), ("unpadded", "padded"), ("unpadded,grid_attention", "padded"),
])
def test_a_forward_waits_for_the_device_no_more_often_than_transformers(debug_config, batch, position_type, setting,
                                                                         mask_kind, monkeypatch):
    """Host syncs per forward, counted op by op (kernels forced: "auto"'s first call measures): without a mask none
    (transformers: none), with a mask one (transformers: one, its all-ones check), whatever the padding and however
    many layers: the mask is read on the host once, every size of the unpadded layout (per sequence, or the grid an
    accelerator gets) follows from it."""
    from transformers import BertConfig, BertModel

    input_ids, attention_mask, token_type_ids = batch
    mask = {"no mask": None, "all ones": torch.ones_like(attention_mask), "padded": attention_mask}[mask_kind]
    inputs = dict(input_ids=input_ids, token_type_ids=token_type_ids,
                  **({} if mask is None else {"attention_mask": mask}))
    counts = {}
    for layers in (1, 3):
        config = debug_config(num_hidden_layers=layers, position_embedding_type=position_type)
        ours = _model(BertImplModel, config, setting).eval()
        hf = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=config.hidden_size, num_hidden_layers=layers,
                                  intermediate_size=config.intermediate_size,
                                  num_attention_heads=config.num_attention_heads, attn_implementation="sdpa")).eval()
        counts[layers] = (_count_host_reads(ours, monkeypatch, **inputs), _count_host_reads(hf, monkeypatch, **inputs))
    for layers, (got, theirs) in counts.items():
        assert len(got) <= len(theirs), (layers, got, theirs)
        assert len(got) == (0 if mask is None else 1), (layers, got)
        assert got == counts[1][0]  # none per layer
    if setting != "reference" and mask is not None:
        assert counts[1][0] == ["Tensor.tolist"]  # the lengths, read once; an all-ones mask is not read again


def test_sinusoidal_positions_without_reading_them_come_from_the_formula(debug_config, monkeypatch):
    """Given position ids are looked up in the stored table where their largest value can be read for free (the CPU)
    and is inside it; past its end, and on any other device (where reading it would be a host sync), the encoding is
    computed at each position from the formula: the same rows as a float64 evaluation (float32, 1e-6), without reading
    a value. Positions the model builds itself (0 .. s-1) are looked up."""
    model = BertImplModel(debug_config(max_position_embeddings=16)).eval()
    H = model.config.hidden_size
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    formula = mb._sinusoid
    monkeypatch.setattr(mb, "_sinusoid",
                        lambda pos, dim: calls.append((tuple(pos.shape), pos.device.type)) or formula(pos, dim))
    inside = torch.stack([torch.arange(12), torch.arange(15, 3, -1)])  # (2, 12), all inside the 16 rows
    past = inside + torch.tensor([[0], [30]])  # the second row past the table's end
    with torch.no_grad():
        looked_up = model.embeddings(ids, position_ids=inside)
        model.embeddings(ids)  # built positions: known to fit, no formula
        assert calls == []
        computed = model.embeddings(ids, position_ids=past)
        assert calls == [((2, 12), "cpu")]
        on_meta = copy.deepcopy(model.embeddings).to("meta")
        with monkeypatch.context() as guard:
            _no_host_reads(guard)
            out = on_meta(ids.to("meta"), position_ids=inside.to("meta"))
        assert calls[-1] == ((2, 12), "meta") and out.shape == (2, 12, H)
    table = mb.sinusoidal_position_encoding(64, H)  # float64 evaluation of the formula, as float32
    assert (computed[0] - looked_up[0]).abs().max().item() <= 1e-6  # the first row is the same positions
    embeddings = model.embeddings
    word = embeddings.word_embeddings(ids[1]) * model.config.word_embedding_scale
    expected = embeddings.LayerNorm(word + embeddings.token_type_embeddings.weight[0] + table[past[1]])
    assert (computed[1] - expected).abs().max().item() <= 1e-5
    far = torch.tensor([[0, 15, 16, 100, 511]])
    assert (formula(far, H) - mb.sinusoidal_position_encoding(512, H)[far]).abs().max().item() <= 1e-6


# ---------------------------------------------------------------------------------------------
# Point "layout": unpadded padded batches


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_unpadded_forward_matches_padded_path(debug_config, batch, backend, monkeypatch, attention_layout):
    torch.manual_seed(0)
    model = _model(BertImplModel, debug_config(attn_implementation=backend), attention_layout).eval()
    plain = _plain(model)
    input_ids, attention_mask, token_type_ids = batch
    calls = _spy_unpadding(monkeypatch, attention_layout)
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        assert len(calls) == 1 and calls[0].indices.numel() == int(attention_mask.sum())
        want = plain(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert len(calls) == 1  # the plain model did not unpad
    assert _max_diff_real(got.last_hidden_state, want.last_hidden_state, attention_mask) <= ATOL
    assert (got.last_hidden_state - want.last_hidden_state).abs().max().item() <= ATOL  # both zero the padding
    assert got.last_hidden_state[~attention_mask.bool()].abs().max().item() == 0.0
    assert (got.pooler_output - want.pooler_output).abs().max().item() <= ATOL


def test_unpadded_alone_attends_per_sequence(debug_config, batch, monkeypatch):
    """"unpadded" forced without a layout: attention per sequence."""
    model = _model(BertImplModel, debug_config(), "unpadded").eval()
    input_ids, attention_mask, _ = batch
    calls = _spy_unpadding(monkeypatch, "unpadded")
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    assert len(calls) == 1 and calls[0].seq_lengths == tuple(attention_mask.sum(1).tolist())


def test_unpadded_gradients_match_padded_path(debug_config, batch, attention_layout, monkeypatch):
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), attention_layout).train()
    plain = _plain(model)
    input_ids, attention_mask, token_type_ids = batch
    labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
    calls, losses = _spy_unpadding(monkeypatch, attention_layout), []
    for m in (model, plain):
        out = m(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.item())
    assert len(calls) == 1 and abs(losses[0] - losses[1]) <= ATOL
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


def test_unpadding_with_gradient_checkpointing(debug_config, batch, monkeypatch):
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), "unpadded").train()
    plain = _plain(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids, attention_mask, _ = batch
    labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
    calls = _spy_unpadding(monkeypatch)
    for m in (model, plain):
        m(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    assert len(calls) == 1
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_auto_measures_inside_gradient_checkpointing(debug_config, batch, fresh_choices, use_reentrant):
    """"auto" making its first choices (training linears timed with their backward) inside a checkpointed layer:
    the measuring's backward must not run gradient checkpointing's recompute (non-reentrant checkpointing packs every
    saved tensor of the layer's forward; without its own hooks the measuring re-entered the layer and waited on its
    own lock forever). Run in a thread with a deadline; the gradients are the plain model's."""
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), "auto").train()  # dropout off: plain gradients comparable
    plain = _plain(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    input_ids, attention_mask, _ = batch
    labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))

    def train_step():
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()

    step = threading.Thread(target=train_step, daemon=True)
    step.start()
    step.join(timeout=120)
    assert not step.is_alive(), "the kernelized training step under gradient checkpointing did not finish in 120 s"
    assert any("|train|" in key for key in K.chosen_kernels()), K.chosen_kernels()
    plain(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("pattern", ["left", "holes", "one_row_fully_padded"])
def test_unpadding_any_padding_pattern(debug_config, batch, pattern, monkeypatch, attention_layout):
    torch.manual_seed(0)
    model = _model(BertImplModel, debug_config(), attention_layout).eval()
    input_ids, attention_mask, _ = batch
    if pattern == "left":
        attention_mask = attention_mask.flip(1)
    elif pattern == "holes":
        attention_mask = attention_mask.clone()
        attention_mask[:, 2] = 0
    else:
        attention_mask = attention_mask.clone()
        attention_mask[3] = 0
    calls = _spy_unpadding(monkeypatch, attention_layout)
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask)
        want = _plain(model)(input_ids, attention_mask=attention_mask)
    assert len(calls) == 1
    assert torch.isfinite(got.last_hidden_state).all() and torch.isfinite(got.pooler_output).all()
    assert _max_diff_real(got.last_hidden_state, want.last_hidden_state, attention_mask) <= ATOL
    if pattern != "one_row_fully_padded":  # a row without tokens: its pooled [CLS] is padding, any finite value
        assert (got.pooler_output - want.pooler_output).abs().max().item() <= ATOL


def test_unpadded_path_matches_transformers_bert(batch, attention_layout, monkeypatch):
    """The oracle: transformers' BertModel (sdpa) with the same weights, on a padded batch."""
    from transformers import BertModel

    from hf_bert_impl.convert import from_hf_bert

    torch.manual_seed(0)
    hf = BertModel(hf_config(attn_implementation="sdpa")).eval()
    ours = from_hf_bert(hf, BertImplModel).eval()
    assert kernelized(ours) == {}
    kernelize(ours, attention_layout)
    input_ids, attention_mask, token_type_ids = batch
    calls = _spy_unpadding(monkeypatch, attention_layout)
    with torch.no_grad():
        got = ours(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        want = hf(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert len(calls) == 1
    assert _max_diff_real(got.last_hidden_state, want.last_hidden_state, attention_mask) <= ATOL
    assert (got.pooler_output - want.pooler_output).abs().max().item() <= ATOL


def test_unpadding_switched_off_and_skipped_for_recorded_outputs(debug_config, batch, monkeypatch):
    """No unpadding with "reference", with kernels forced elsewhere, without padding, and while hidden states or
    attentions are recorded (transformers' hooks see the padded batch; the attentions need eager): those outputs equal
    the plain model's, padding positions of last_hidden_state hold zeros."""
    torch.manual_seed(0)
    model = _model(BertImplModel, debug_config(), "unpadded").eval()
    input_ids, attention_mask, _ = batch
    calls = _spy_unpadding(monkeypatch)
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True, output_hidden_states=True)
        want = _plain(model)(input_ids, attention_mask=attention_mask, output_attentions=True,
                             output_hidden_states=True)
        _forced(model, "onednn_linear,bits_dropout")(input_ids, attention_mask=attention_mask)
        model(input_ids)  # no padding: nothing to unpad
    assert calls == []
    assert out.attentions[0].shape == (13, 4, 7, 7)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for g, w in zip(out.hidden_states + out.attentions, want.hidden_states + want.attentions):
        assert torch.equal(g, w)
    assert out.last_hidden_state[~attention_mask.bool()].abs().max().item() == 0.0
    assert _max_diff_real(out.hidden_states[-1], out.last_hidden_state, attention_mask) == 0.0


# ---------------------------------------------------------------------------------------------
# Packed rows (DataCollatorWithFlattening): padding-free training


def _packed_features(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        labels = torch.where(torch.rand(n, generator=g) < 0.4, ids, torch.full_like(ids, -100))
        labels[1] = ids[1]  # at least one masked position per sequence
        feats.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return feats


@pytest.mark.parametrize("flash_kwargs", [False, True])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_packed_row_equals_each_sequence_alone(debug_config, backend, flash_kwargs, monkeypatch, attention_layout):
    torch.manual_seed(0)
    model = _model(BertImplModel, debug_config(attn_implementation=backend), attention_layout).eval()
    lengths = [5, 7, 3, 6]
    feats = _packed_features(lengths)
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(feats)
    assert packed["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in packed
    inputs = {k: v for k, v in packed.items() if k != "labels"}
    calls = _spy_unpadding(monkeypatch, attention_layout)
    with torch.no_grad():
        got = model(**inputs).last_hidden_state[0]  # (T, H)
        assert len(calls) == 1 and calls[0].indices is None
        tokens = calls[0]
        if attention_layout == "per_sequence_attention":
            assert tokens.seq_lengths == tuple(lengths)
        else:
            assert tokens.grid == (4, 7) and tokens.grid_index.numel() == sum(lengths)
        start = 0
        for n, f in zip(lengths, feats):
            alone = model(torch.tensor([f["input_ids"]])).last_hidden_state[0]
            assert (got[start : start + n] - alone).abs().max().item() <= ATOL, (n, start)
            start += n
        # The plain model keeps sequences apart with a block-diagonal mask instead.
        plain_inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "position_ids")}
        plain = _plain(model)(**plain_inputs).last_hidden_state[0]
    assert (plain - got).abs().max().item() <= ATOL


def test_packed_attention_probabilities_never_cross_sequences(debug_config):
    model = _model(BertImplModel, debug_config(attn_implementation="eager"), "auto").eval()
    packed = DataCollatorWithFlattening()(_packed_features([4, 3]))
    with torch.no_grad():
        out = model(packed["input_ids"], position_ids=packed["position_ids"], output_attentions=True)
    for probs in out.attentions:  # (1, h, 7, 7)
        assert probs[..., :4, 4:].abs().max().item() == 0.0 and probs[..., 4:, :4].abs().max().item() == 0.0
        torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4, 7), atol=ATOL, rtol=0)


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(debug_config, attention_layout, monkeypatch):
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), attention_layout).train()
    twin = _plain(model)
    feats = _packed_features([5, 7, 3, 6], seed=1)
    packed = DataCollatorWithFlattening()(feats)
    s = max(len(f["input_ids"]) for f in feats)
    pad = lambda key, v: [f[key] + [v] * (s - len(f[key])) for f in feats]  # noqa: E731
    input_ids, labels = torch.tensor(pad("input_ids", 0)), torch.tensor(pad("labels", -100))
    # the collator writes separator_id (-100) over each sequence's first label, as it must for causal LMs
    labels[:, 0] = -100
    attention_mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (s - len(f["input_ids"])) for f in feats])
    calls = _spy_unpadding(monkeypatch, attention_layout)
    loss_packed = model(**packed).loss
    loss_padded = twin(input_ids, attention_mask=attention_mask, labels=labels).loss
    assert len(calls) == 1  # the packed row; the padded batch ran on the plain model
    assert abs(loss_packed.item() - loss_padded.item()) <= ATOL
    loss_packed.backward()
    loss_padded.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


def test_trainer_trains_padding_free(debug_config, tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), "unpadded")
    feats = _packed_features([5, 7, 3, 6, 4, 7, 2, 5], seed=2)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
    )
    before = model.bert.layers[0].attn.Wqkv.weight.detach().clone()
    trainer = Trainer(model=model, args=args, train_dataset=ListDataset(feats),
                      data_collator=DataCollatorWithFlattening())
    calls = _spy_unpadding(monkeypatch, "unpadded")
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert len(calls) == 2 and all(len(t.seq_lengths) == 4 for t in calls)  # each step: one row of 4 sequences
    assert not torch.equal(before, model.bert.layers[0].attn.Wqkv.weight)


_VARLEN_DROPOUT = []  # the dropout probability each call of the stand-in below was given


# A flash-attention stand-in that takes exactly what flash_attn_varlen_func takes (tokens + cu_seqlens) and attends
# within each sequence (dropping probabilities with `dropout`, as flash does); it checks the varlen plumbing on a
# machine without flash-attn.
def _varlen_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    assert attention_mask is None and query.size(0) == 1, "varlen takes tokens, not a padded batch"
    assert torch.equal(cu_seq_lens_q, cu_seq_lens_k) and cu_seq_lens_q.dtype == torch.int32
    assert max_length_q == max_length_k == int(cu_seq_lens_q.diff().max())
    _VARLEN_DROPOUT.append(dropout)
    out = torch.zeros_like(query)  # (1, h, T, d)
    for a, b in zip(cu_seq_lens_q[:-1].tolist(), cu_seq_lens_q[1:].tolist()):
        if b > a:
            out[:, :, a:b] = F.scaled_dot_product_attention(
                query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scaling, dropout_p=dropout
            )
    return out.transpose(1, 2), None  # (1, T, h, d)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_flash_style_varlen_route(debug_config, batch, layout, monkeypatch):
    """A flash-named attention function gets the real tokens and cu_seqlens (unpadded forced), and gives the plain
    model's outputs."""
    AttentionInterface.register("flash_varlen_reference", _varlen_reference)
    torch.manual_seed(0)
    model = BertImplModel(debug_config()).eval()
    varlen = _forced(model, "unpadded")
    varlen.config._attn_implementation = "flash_varlen_reference"
    calls = _spy_unpadding(monkeypatch)
    with torch.no_grad():
        if layout == "padded":
            input_ids, attention_mask, _ = batch
            attention_mask = attention_mask.clone()
            attention_mask[5] = 0  # a zero-length sequence in cu_seqlens
            got = varlen(input_ids, attention_mask=attention_mask).last_hidden_state
            want = model(input_ids, attention_mask=attention_mask).last_hidden_state
            assert _max_diff_real(got, want, attention_mask) <= ATOL
        else:
            packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(_packed_features([6, 2, 5]))
            inputs = {k: v for k, v in packed.items() if k != "labels"}
            got = varlen(**inputs).last_hidden_state
            want = model(**{k: v for k, v in inputs.items() if k in ("input_ids", "position_ids")}).last_hidden_state
            assert (got - want).abs().max().item() <= ATOL
    assert len(calls) == 1
    assert set(calls[0].attention_kwargs) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


def test_flash_style_varlen_route_in_training_with_bits_dropout(debug_config, batch, monkeypatch):
    """Training on the varlen route with bits_dropout forced, attention and hidden dropout 0.25: attention keeps
    flash's own function (given the dropout probability 0.25, 0 in eval), not the masked formula on the padded grid,
    so it stays within each sequence: changing one sequence's tokens leaves every other sequence's outputs as they
    were, bit for bit, under the same seed. The hidden states' masks come from bits_dropout: a quarter of the
    embeddings' outputs dropped (within 5 binomial standard deviations), and a new seed draws new ones."""
    AttentionInterface.register("flash_varlen_reference", _varlen_reference)
    _VARLEN_DROPOUT.clear()
    torch.manual_seed(0)
    config = debug_config(attention_probs_dropout_prob=0.25, hidden_dropout_prob=0.25)
    model = _model(BertImplModel, config, "unpadded,bits_dropout").train()
    model.config._attn_implementation = "flash_varlen_reference"
    bits = _spy_bits_attention(monkeypatch)
    dropped = []
    model.embeddings.dropout.register_forward_hook(lambda m, args, out: dropped.append((out == 0).sum().item()))
    input_ids, attention_mask, _ = batch
    changed = input_ids.clone()
    changed[0, : int(attention_mask[0].sum())] = changed[0, : int(attention_mask[0].sum())] % (VOCAB - 1) + 1
    outs = []
    for ids, seed in ((input_ids, 3), (changed, 3), (input_ids, 4)):
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(model(ids, attention_mask=attention_mask).last_hidden_state)
    assert _VARLEN_DROPOUT == [0.25] * (3 * config.num_hidden_layers) and bits == []
    real = attention_mask.bool()
    assert not torch.equal(outs[0][0], outs[1][0])  # the changed sequence
    assert torch.equal(outs[0][1:], outs[1][1:])  # every other one: as it was
    assert not torch.equal(outs[0][real], outs[2][real])  # another seed, other masks
    n = int(attention_mask.sum()) * config.hidden_size  # the embeddings' real-token outputs
    for count in dropped:
        assert abs(count - 0.25 * n) <= 5 * (n * 0.25 * 0.75) ** 0.5, (count, n)
    with torch.no_grad():
        model.eval()(input_ids, attention_mask=attention_mask)
    assert _VARLEN_DROPOUT[-config.num_hidden_layers:] == [0.0] * config.num_hidden_layers


def test_packed_kwargs_that_do_not_fit_raise(debug_config):
    model = _model(BertImplModel, debug_config(), "unpadded").eval()
    ids = torch.randint(1, VOCAB, (1, 9))
    with pytest.raises(ValueError, match=r"cu_seq_lens_q \[0, 4, 8\] must run from 0 to the packed length 9"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 4, 8], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# "auto": the measured choice


_AUTO_RUN = r'''
import json, sys
import torch
torch.set_num_threads(1)
from hf_bert_impl import BertImplConfig, BertImplForMaskedLM, kernelize
from hf_bert_impl import kernels_bert_impl as K

timings, median_seconds = [], K._median_seconds
# counts the kernels timed
K._median_seconds = lambda fn, reps=3, warm=False: timings.append(1) or median_seconds(fn, reps, warm)


def run(steps=3):
    """A seeded training run of the kernelized debug model ("auto", dropout 0.1, a padded batch), then one inference
    call: each loss as float.hex, the choices made, the seconds spent measuring and the number of kernels timed."""
    torch.manual_seed(0)
    config = BertImplConfig.from_preset("debug", vocab_size=99, hidden_dropout_prob=0.1,
                                        attention_probs_dropout_prob=0.1)
    model = kernelize(BertImplForMaskedLM(config).train())
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(7)[None] < torch.tensor([7 - i % 4 for i in range(13)])[:, None]).long()
    ids = torch.randint(1, 99, (13, 7), generator=g) * mask
    labels = torch.where((torch.rand(13, 7, generator=g) < 0.3) & mask.bool(), ids, -100)
    labels[0, 0] = ids[0, 0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item().hex())
    with torch.no_grad():
        model.eval()(ids, attention_mask=mask)
    return {"losses": losses, "chosen": K.chosen_kernels(), "seconds": K.measurement_seconds(), "timed": len(timings)}
'''

# The points, their candidates (names kernels= takes, or "reference") and the shape of their keys.
_CANDIDATES = {"linear": {"reference", "onednn_linear", "fused_activation", "packed_linear"},
               "dropout": {"reference", "bits_dropout"}, "layout": {"per_sequence_attention", "grid_attention"},
               "attention": {"reference", "matmul_attention"}}
_KEY = re.compile(r"(linear\|cpu\|(float32|bfloat16)\|\d+x\d+\|rows<=\d+\|(train|infer|infer-frozen)\|\w+"
                  r"|dropout\|cpu\|(float32|bfloat16)\|numel<=\d+"
                  r"|layout\|cpu\|(float32|bfloat16)\|n<=\d+\|m<=\d+\|\d+x\d+"
                  r"|attention\|cpu\|(float32|bfloat16)\|n<=\d+\|m<=\d+\|\d+x\d+\|(masked|unmasked))")


def _auto_run(monkeypatch):
    """_AUTO_RUN's run() in this process (its spy on `_median_seconds` undone afterwards)."""
    monkeypatch.setattr(K, "_median_seconds", K._median_seconds)
    namespace = {}
    exec(compile(_AUTO_RUN, "<auto run>", "exec"), namespace)
    return namespace["run"]()


def _python(code: str, cache, *argv, popen=False, env=None):
    """A fresh Python of this venv running `code` with the kernel record at `cache` (None: where the package puts it
    by default), one thread, this checkout, and `env` on top."""
    env = {**os.environ, "HF_BERT_IMPL_KERNEL_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           **(env or {})}
    if cache is None:
        del env["HF_BERT_IMPL_KERNEL_CACHE"]
    command = [sys.executable, "-c", code, *map(str, argv)]
    if popen:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """This process as if nothing was measured yet, its record an empty file of this test (both restored after)."""
    monkeypatch.setattr(K, "_CHOICES", K._Choices())
    monkeypatch.setattr(K, "_UNRECORDED", set())
    path = tmp_path / "kernels.json"
    monkeypatch.setenv("HF_BERT_IMPL_KERNEL_CACHE", str(path))
    return path


def _assert_valid_choices(chosen: dict, points=("linear", "dropout", "layout")):
    """Every key names a point, the device, dtype and shape class; every value is a candidate of its point; each of
    `points` is seen."""
    assert set(points) <= {key.split("|")[0] for key in chosen}, chosen
    for key, name in chosen.items():
        assert _KEY.fullmatch(key), key
        assert name in _CANDIDATES[key.split("|")[0]], (key, name)


def test_auto_choices_are_recorded_and_a_fresh_process_reuses_them_bit_for_bit(fresh_choices, monkeypatch):
    """(1) "auto" measures each point once per (device, dtype, shape class) on first use: the choices name a candidate
    or "reference", per key; the record file holds exactly them, under this machine's key (the package version,
    torch's, the CPU capability, the threads, the kernels); measuring took time. (2) A fresh process reading the same
    record measures nothing and makes the same choices, and its seeded training run with dropout gives the same losses
    bit for bit (measuring draws nothing from the run's random stream)."""
    first = _auto_run(monkeypatch)
    _assert_valid_choices(first["chosen"], tuple(_CANDIDATES))  # the inference call's SDPA: the "attention" point
    assert first["chosen"] == K.chosen_kernels() and first["seconds"] == K.measurement_seconds() > 0
    assert first["timed"] >= len(first["chosen"])  # at least one timing per choice
    assert any("|train|" in key for key in first["chosen"]) and any("|infer|" in key for key in first["chosen"])
    assert K.cache_path() == str(fresh_choices)
    record = json.loads(fresh_choices.read_text())
    assert list(record) == [f"hf_bert_impl {hf_bert_impl.__version__}, torch {torch.__version__}, "
                            f"{torch.backends.cpu.get_cpu_capability()}, 1 threads, kernels {'/'.join(K.KERNELS)}"]
    assert record[next(iter(record))] == first["chosen"]
    again = _python(_AUTO_RUN + "\nprint(json.dumps(run()))", fresh_choices).stdout.strip().splitlines()[-1]
    again = json.loads(again)
    assert again["timed"] == 0 and again["seconds"] < first["seconds"]  # nothing measured (0.0: the test below)
    assert again["chosen"] == first["chosen"]
    assert again["losses"] == first["losses"]
    assert json.loads(fresh_choices.read_text()) == record  # nothing new to write


def test_measurement_seconds_is_zero_when_every_choice_comes_from_the_record(debug_config, batch, fresh_choices,
                                                                              monkeypatch):
    model = _model(BertImplModel, debug_config(), "auto").eval()
    input_ids, attention_mask, _ = batch
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    assert K.measurement_seconds() > 0 and fresh_choices.exists()
    monkeypatch.setattr(K, "_CHOICES", K._Choices())  # a process that starts with the record
    monkeypatch.setattr(K, "_median_seconds", lambda *a: pytest.fail("a recorded choice was measured again"))
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    assert K.chosen_kernels() and K.measurement_seconds() == 0.0


def test_result_files_state_the_record_path_without_the_machines_own_folders(monkeypatch, tmp_path):
    """What the scripts write into a result JSON for the record (cli.kernel_record_path): `$HF_HOME/...` for the
    default place, `~/...` under the home folder, other paths as given, None when recording is off."""
    from huggingface_hub import constants

    from hf_bert_impl.cli import kernel_record_path

    home, hf_home = tmp_path / "home", tmp_path / "home" / ".cache" / "huggingface"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_BERT_IMPL_KERNEL_CACHE")
    assert kernel_record_path() == os.path.join("$HF_HOME", "hf_bert_impl", "kernels.json")
    cases = ((home / "k" / "r.json", os.path.join("~", "k", "r.json")), ("outputs/r.json", "outputs/r.json"),
             (tmp_path / "r.json", str(tmp_path / "r.json")), ("off", None))
    for given, shown in cases:
        monkeypatch.setenv("HF_BERT_IMPL_KERNEL_CACHE", str(given))
        assert kernel_record_path() == shown, given


def test_the_record_lives_under_hf_home_and_another_version_measures_anew(debug_config, batch, fresh_choices,
                                                                          monkeypatch, tmp_path):
    """Without HF_BERT_IMPL_KERNEL_CACHE the record is $HF_HOME/hf_bert_impl/kernels.json (the Hugging Face cache, as
    a fresh process with HF_HOME set reports); its key holds the package version, so another version of the package
    does not reuse the choices: it measures anew and records them under its own key, beside the first."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    proc = _python("from hf_bert_impl import kernels_bert_impl as K; print(K.cache_path())", None,
                   env={"HF_HOME": str(home)})
    assert proc.stdout.strip().splitlines()[-1] == str(home / "hf_bert_impl" / "kernels.json")
    monkeypatch.delenv("HF_BERT_IMPL_KERNEL_CACHE")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    path = home / "hf_bert_impl" / "kernels.json"
    assert K.cache_path() == str(path)
    model = _model(BertImplModel, debug_config(), "auto").eval()
    input_ids, attention_mask, _ = batch
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    first = K.chosen_kernels()
    (key, recorded), = json.loads(path.read_text()).items()
    assert key.startswith(f"hf_bert_impl {hf_bert_impl.__version__}, ") and recorded == first
    version = hf_bert_impl.__version__
    monkeypatch.setattr(hf_bert_impl, "__version__", version + ".post1")
    monkeypatch.setattr(K, "_CHOICES", K._Choices())  # a process of the other version
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    assert K.measurement_seconds() > 0  # measured anew (which keys it meets depends on what it chooses)
    _assert_valid_choices(K.chosen_kernels(), points=("linear",))
    record = json.loads(path.read_text())
    other = key.replace(f"hf_bert_impl {version}, ", f"hf_bert_impl {version}.post1, ")
    assert sorted(record) == sorted([key, other]) and record[other] == K.chosen_kernels() and record[key] == first


_HOLD_LOCK = """
import sys, time
import filelock
lock = filelock.FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_held_record_lock_is_given_up_after_the_timeout(debug_config, batch, fresh_choices, monkeypatch, caplog):
    """Another process holds the record's lock (and never lets go): the first choice waits LOCK_TIMEOUT_S for it, then
    gives the record up for the rest of the process, with one warning naming the record: every choice is made and kept
    in memory, nothing is written, no other choice waits again, and the training step runs to the end."""
    import filelock

    monkeypatch.setattr(K, "LOCK_TIMEOUT_S", 0.5)
    attempts = []

    class CountedLock(filelock.FileLock):
        def acquire(self, *args, **kwargs):
            attempts.append(self.timeout)
            return super().acquire(*args, **kwargs)

    monkeypatch.setattr(K.filelock, "FileLock", CountedLock)
    fresh_choices.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, f"{fresh_choices}.lock"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        torch.manual_seed(0)
        model = _model(BertImplForMaskedLM, debug_config(hidden_dropout_prob=0.1), "auto").train()
        input_ids, attention_mask, _, labels = _mlm_batch(batch)
        with caplog.at_level(logging.WARNING, logger="hf_bert_impl.kernels"):
            model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    finally:
        holder.kill()
        holder.wait()
    chosen = K.chosen_kernels()
    _assert_valid_choices(chosen)
    assert len(chosen) >= 5 and attempts == [0.5]  # one wait, for the first choice only
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(fresh_choices) in warnings[0] and "made in memory" in warnings[0], warnings
    assert not fresh_choices.exists()


_CONCURRENT = _AUTO_RUN + r'''
import os, time
open(sys.argv[1], "w").close()  # ready: everything imported
while not os.path.exists(sys.argv[2]):  # the start signal, given to both at once
    time.sleep(0.005)
print(json.dumps(run(steps=1)))
'''


def test_two_processes_started_together_make_the_same_choices(tmp_path):
    """Two processes of one machine with the same empty record, measuring at the same moment: the file lock makes one
    measure while the other waits and reads, so both use the same kernels (and the record holds them)."""
    cache, go = tmp_path / "kernels.json", tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [_python(_CONCURRENT, cache, r, go, popen=True) for r in ready]
    try:
        deadline = time.monotonic() + 180
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a process did not start"
            time.sleep(0.02)
        go.touch()
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    _assert_valid_choices(results[0]["chosen"])
    assert results[0]["chosen"] == results[1]["chosen"]
    assert results[0]["losses"] == results[1]["losses"]
    assert next(iter(json.loads(cache.read_text()).values())) == results[0]["chosen"]


@needs_onednn
@pytest.mark.parametrize("wrong", ["nowhere", "everywhere", "forward_only"])
def test_auto_never_chooses_a_kernel_that_disagrees_with_the_reference(debug_config, batch, fresh_choices, monkeypatch,
                                                                        wrong):
    """The timing is rigged so that every kernel but the reference looks infinitely fast. With oneDNN's op as it is
    (the control) "auto" takes a oneDNN kernel; with an op that adds 1e-3 to its result, in every GEMM or only in the
    forward's (where its bias is given: the backward's transposed check passes), it takes the reference for every
    linear key, and the outputs are the plain model's bit for bit."""
    real, timed = K._onednn_op(), {}

    def op(x, w, b, *post):
        y = real(x, w, b, *post)
        return y + 1e-3 if wrong == "everywhere" or wrong == "forward_only" and b is not None else y

    candidates = K._linear_candidates

    def named_candidates(*args):
        out = candidates(*args)
        timed.update({fn: name for name, fn in out.items()})
        return out

    monkeypatch.setattr(K, "_onednn_op", lambda: op)
    monkeypatch.setattr(K, "_linear_candidates", named_candidates)
    monkeypatch.setattr(K, "_median_seconds",
                        lambda fn, reps=3, warm=False: 1.0 if timed.get(fn, "reference") == "reference" else 0.0)
    torch.manual_seed(0)
    model = _model(BertImplModel, debug_config(), "auto").eval()
    input_ids = batch[0]
    with torch.no_grad():
        got = model(input_ids).last_hidden_state  # no padding, no dropout: only the linear point has a choice
        want = _plain(model)(input_ids).last_hidden_state
    linear = {k: v for k, v in K.chosen_kernels().items() if k.startswith("linear|")}
    assert len(linear) >= 3, linear  # Wqkv, Wo, Wi (with its GELU), Wo, the pooler
    # "everywhere": oneDNN is not even a candidate (the backward's transposed GEMM is checked first); "forward_only":
    # it is one, and is timed, but its output disagrees
    assert ("onednn_linear" in timed.values()) == (wrong != "everywhere"), timed
    if wrong == "nowhere":
        assert set(linear.values()) <= {"onednn_linear", "fused_activation"}, linear
    else:
        assert set(linear.values()) == {"reference"}, linear
        assert torch.equal(got, want)


def test_auto_candidates_are_only_kernels_that_apply():
    """The linear candidates: the reference always; oneDNN where its op computes the backward's transposed GEMM right;
    the fused activation only for an unhooked GELU / ReLU in float32 or bfloat16 inference (`_fusable`)."""
    from transformers.activations import ACT2FN

    x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)
    gelu, silu = ACT2FN["gelu"], ACT2FN["silu"]
    onednn = {"onednn_linear"} if K._onednn_op() is not None else set()
    fused = {"fused_activation"} if onednn else set()
    assert set(K._linear_candidates(x, w, b, gelu, False)) == {"reference"} | onednn | fused
    assert set(K._linear_candidates(x, w, b, gelu, True)) == {"reference"} | onednn
    assert set(K._linear_candidates(x, w, b, silu, False)) == {"reference"} | onednn
    assert set(K._linear_candidates(x.half(), w.half(), b.half(), gelu, False)) == {"reference"}
    assert K._fusable(gelu, False, torch.float32) and K._fusable(gelu, False, torch.bfloat16)
    assert not K._fusable(gelu, False, torch.float16) and not K._fusable(gelu, True, torch.bfloat16)
    hooked = type(gelu)()
    hooked.register_forward_hook(lambda *a: None)
    assert not K._fusable(hooked, False, torch.float32) and not K._fusable(None, False, torch.float32)
    ref = torch.ones(3)
    assert K._fastest({"reference": lambda: ref, "off": lambda: ref + 1e-3, "fails": lambda: 1 / 0}) == "reference"


def test_kernel_cache_off_writes_no_file(debug_config, batch, monkeypatch, tmp_path):
    """HF_BERT_IMPL_KERNEL_CACHE=off: the choices are made and kept in memory; no file (record or lock) is written,
    neither there nor under the Hugging Face cache nor the home directory."""
    from huggingface_hub import constants

    monkeypatch.setattr(K, "_CHOICES", K._Choices())
    monkeypatch.setenv("HF_BERT_IMPL_KERNEL_CACHE", "off")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    assert K.cache_path() is None
    model = _model(BertImplForMaskedLM, debug_config(hidden_dropout_prob=0.1), "auto").train()
    input_ids, attention_mask, _, labels = _mlm_batch(batch)
    model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    _assert_valid_choices(K.chosen_kernels())
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Sparse MLM prediction (kernelize(..., sparse_prediction=True))


@pytest.mark.parametrize("num_items_in_batch", [None, 50])
def test_sparse_prediction_matches_dense(debug_config, batch, num_items_in_batch):
    torch.manual_seed(0)
    dense = BertImplForMaskedLM(debug_config()).train()
    sparse = kernelize(copy.deepcopy(dense), "auto", sparse_prediction=True)
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    kw = dict(attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels,
              num_items_in_batch=num_items_in_batch)
    d, s = dense(input_ids, **kw), sparse(input_ids, **kw)
    keep = labels.ne(-100)
    assert d.logits.shape == (13, 7, VOCAB) and s.logits.shape == (int(keep.sum()), VOCAB)
    assert (s.logits - d.logits[keep]).abs().max().item() <= ATOL  # row i <-> labels[labels != -100][i]
    assert abs(s.loss.item() - d.loss.item()) <= ATOL
    d.loss.backward()
    s.loss.backward()
    for (name, p), q in zip(dense.named_parameters(), sparse.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name
    # the hand-computed loss: mean (or sum / num_items_in_batch) of -log p over labelled positions
    nll = -torch.log_softmax(d.logits[keep].double(), -1).gather(1, labels[keep][:, None]).sum()
    assert abs(s.loss.item() - (nll / (num_items_in_batch or keep.sum())).item()) <= ATOL


def test_sparse_prediction_full_logits_without_labels(debug_config, batch):
    model = _model(BertImplForMaskedLM, debug_config(), "auto")
    kernelize(model, "auto", sparse_prediction=True).eval()
    input_ids, attention_mask, _ = batch
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask)
    assert out.logits.shape == (13, 7, VOCAB) and out.loss is None


def test_sparse_prediction_pretraining_head(debug_config, batch):
    torch.manual_seed(0)
    dense = BertImplForPreTraining(debug_config()).eval()
    sparse = kernelize(copy.deepcopy(dense), "auto", sparse_prediction=True)
    assert kernelized(sparse)["._mlm_logits_and_loss"] == "_sparse_mlm_logits_and_loss"
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    nsp = torch.randint(0, 2, (13,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        d = dense(input_ids, attention_mask=attention_mask, labels=labels, next_sentence_label=nsp)
        s = sparse(input_ids, attention_mask=attention_mask, labels=labels, next_sentence_label=nsp)
    keep = labels.ne(-100)
    assert s.prediction_logits.shape == (int(keep.sum()), VOCAB)
    assert (s.prediction_logits - d.prediction_logits[keep]).abs().max().item() <= ATOL
    assert abs(s.loss.item() - d.loss.item()) <= ATOL
    assert (s.seq_relationship_logits - d.seq_relationship_logits).abs().max().item() <= ATOL


@pytest.mark.parametrize("sparse", [False, True])
def test_mlm_labels_of_the_wrong_shape_raise(debug_config, batch, sparse):
    model = kernelize(BertImplForMaskedLM(debug_config()), "auto", sparse_prediction=sparse)
    input_ids, attention_mask, _ = batch
    with pytest.raises(ValueError, match=r"labels have shape \(13, 6\) but the input has shape \(13, 7\)"):
        model(input_ids, attention_mask=attention_mask, labels=input_ids[:, :6])


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo: no cached graphs, counters at zero (reset() keeps the counters)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@pytest.mark.parametrize("setting", ["auto", ",".join(K.KERNELS)])
def test_compile_fullgraph_fixed_shape_matches_eager(debug_config, batch, fresh_dynamo, setting):
    """A kernelized model under torch.compile: fullgraph=True turns any graph break into an error (while compiling
    the kernel points answer None or, for inference's linear layers, one op of the graph); the eager backend keeps
    the test fast (the graph capture, where breaks happen, is the same for every backend)."""
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), setting).eval()
    input_ids, attention_mask, token_type_ids = batch
    labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    inputs = dict(attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    with torch.no_grad():
        got = compiled(input_ids, **inputs)
        want = model(input_ids, **inputs)
    assert _max_diff_real(got.logits, want.logits, attention_mask) <= ATOL
    assert abs(got.loss.item() - want.loss.item()) <= ATOL
    assert fresh_dynamo["stats"]["unique_graphs"] == 1
    assert not fresh_dynamo["graph_break"]


def test_compile_fullgraph_training_step(debug_config, batch, fresh_dynamo):
    torch.manual_seed(0)
    model = _model(BertImplForMaskedLM, debug_config(), "auto").train()
    input_ids, attention_mask, _ = batch
    labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    for n, p in model.named_parameters():
        assert (grads[n] - p.grad).abs().max().item() <= ATOL, n
    assert not fresh_dynamo["graph_break"]


def test_compile_dynamic_does_not_recompile_per_length(debug_config, fresh_dynamo):
    torch.manual_seed(0)
    model = _model(BertImplModel, debug_config(), "auto").eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")
    g = torch.Generator().manual_seed(0)

    def check(b, s):
        ids = torch.randint(1, VOCAB, (b, s), generator=g)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, s - 2 :] = 0
        got = compiled(ids, attention_mask=mask).last_hidden_state
        want = model(ids, attention_mask=mask).last_hidden_state
        assert _max_diff_real(got, want, mask) <= ATOL

    with torch.no_grad():
        check(3, 5)
        # Any later compile is a recompile: make it an error. config.patch restores the option on
        # exit (monkeypatch's undo would delete it, and later compiles in this process would fail).
        with torch._dynamo.config.patch(error_on_recompile=True):
            for b, s in [(4, 9), (2, 12), (5, 3)]:
                check(b, s)
    assert fresh_dynamo["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("captures,attention,kernels", [(True, "sdpa", "auto"), (True, "eager", "auto"),
                                                       (False, "sdpa", "auto"), (True, "sdpa", "matmul_attention")],
                         ids=["captures_sizes", "captures_sizes_eager_attention", "default", "matmul_attention"])
def test_compile_keeps_the_unpadded_layout_where_dynamo_captures_data_dependent_sizes(debug_config, fresh_dynamo,
                                                                                      monkeypatch, captures,
                                                                                      attention, kernels):
    """torch.compile (not fullgraph) of a kernelized model: with dynamo's capture_dynamic_output_shape_ops the layers
    run on the real tokens (the graph holds the nonzero that finds them; their count a size known only at run time)
    and, with SDPA attention, attend per sequence through one op (hf_bert_impl::varlen_attention, which reads the
    lengths when it runs; "eager" attention runs the formula on the padded grid), otherwise the plain model's padded
    graph; either way one graph, no break, no recompile when the padding changes (a row of padding alone included),
    and the outputs of eager at every real token; with "matmul_attention" forced the op runs it in every layer. With
    gradients on, a second graph without the op (it has no backward), through which backward runs."""
    torch.manual_seed(0)
    model = _model(BertImplModel, debug_config(attn_implementation=attention), kernels).eval()
    matmuls = _spy_matmul_attention(monkeypatch)
    graphs = []

    def backend(gm, example_inputs):  # dynamo's graphs, run as traced
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch._dynamo.config.patch(capture_dynamic_output_shape_ops=captures):
        for i, lengths in enumerate([(10, 4, 7), (2, 10, 9), (10, 10, 10), (0, 3, 10)]):
            mask = (torch.arange(10)[None] < torch.tensor(lengths)[:, None]).long()
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = compiled(ids, attention_mask=mask).last_hidden_state
            assert _max_diff_real(got, model(ids, attention_mask=mask).last_hidden_state, mask) <= ATOL, lengths
    assert len(graphs) == 1 and not fresh_dynamo["graph_break"]
    targets = [str(node.target) for node in graphs[0].graph.nodes]
    assert any("nonzero" in t for t in targets) == captures
    assert sum("varlen_attention" in t for t in targets) == (model.config.num_hidden_layers
                                                             if captures and attention == "sdpa" else 0)
    if kernels == "matmul_attention":  # per layer: each non-empty sequence in the op (compiled) and in eager, where
        # sequences all of one length attend as one grid: 3 + 3, 3 + 3, 1 + 1, 2 + 2 calls in the four rounds
        assert len(matmuls) == model.config.num_hidden_layers * (6 + 6 + 2 + 4)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=captures):  # gradients on: no op (no backward)
        compiled(ids, attention_mask=mask).last_hidden_state[mask.bool()].sum().backward()
    assert len(graphs) == 2 and not any("varlen_attention" in str(node.target) for node in graphs[1].graph.nodes)


def _traced_linears(model, call, grad: bool = False) -> tuple[list, object]:
    """The hf_bert_impl::onednn_linear nodes (their activation argument) of the one graph dynamo captures of `model`
    running `call(compiled)`, and what that call returned."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.set_grad_enabled(grad):
        out = call(torch.compile(model, fullgraph=True, backend=backend))
    assert len(graphs) == 1
    return [node.args[3] for node in graphs[0].graph.nodes if "onednn_linear" in str(node.target)], out


@pytest.mark.parametrize("setting,winner", [("auto", "onednn_linear"), ("auto", "fused_activation"),
                                            ("auto", "reference"), ("fused_activation", None),
                                            ("onednn_linear", None), ("reference", None)])
def test_compiled_inference_runs_the_linear_kernel_as_one_op_of_the_graph(debug_config, batch, fresh_dynamo,
                                                                          fresh_choices, monkeypatch, setting, winner):
    """Under torch.compile, inference's linear layers run oneDNN's GEMM as one op of the graph where it is chosen
    (forced, or "auto"'s eager choice, measured outside the graph while tracing: here its timing rigged so that
    `winner` wins where it is a candidate), the activation inside it for fused_activation, and where oneDNN runs and
    reproduces F.linear here: the outputs of eager at every real token, no graph break. "reference", training and
    autocast leave them to the compiler (the plain model's F.linear)."""
    if winner is not None:
        monkeypatch.setattr(K, "_fastest", lambda candidates, reference="reference": winner
                            if winner in candidates else "onednn_linear" if "onednn_linear" in candidates else reference)
    torch.manual_seed(0)
    config = debug_config()
    model = _model(BertImplForMaskedLM, config, setting).eval()
    input_ids, attention_mask, token_type_ids = batch
    inputs = dict(attention_mask=attention_mask, token_type_ids=token_type_ids)
    ops, got = _traced_linears(model, lambda compiled: compiled(input_ids, **inputs).logits)
    with torch.no_grad():
        want = model(input_ids, **inputs).logits
    assert _max_diff_real(got, want, attention_mask) <= ATOL
    assert not fresh_dynamo["graph_break"]
    if "reference" in (setting, winner) or not K._onednn_runs(torch.float32):
        assert ops == []
    else:  # each layer's Wqkv, Wo, Wi, Wo, the MLM head's dense and decoder; GELU inside Wi and dense where chosen
        fused = [op for op in ops if op != "none"]
        assert len(ops) == _linear_layers(config)
        assert fused == (["GELUActivation"] * (config.num_hidden_layers + 1) if "fused_activation" in (setting, winner)
                         else [])
    if setting == "auto":  # the choices were made once, under eager's keys (a compiled graph's rows: TRACED_ROWS)
        linear = [key for key in K.chosen_kernels() if key.startswith("linear")]
        assert linear and all(key.split("|")[-2] == "infer" for key in linear)
        assert any(f"|rows<={K.TRACED_ROWS}|" in key for key in linear)  # the eager batch's 91 rows: class 128
    torch._dynamo.reset()
    train_ops, _ = _traced_linears(model.train(), lambda compiled: compiled(input_ids, **inputs).logits, grad=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_ops, _ = _traced_linears(model.eval(), lambda compiled: compiled(input_ids, **inputs).logits)
    assert train_ops == [] and autocast_ops == []


@needs_packing
@pytest.mark.parametrize("setting,frozen", [("auto", True), ("packed_linear", False)], ids=["auto-frozen", "forced"])
def test_compiled_frozen_inference_runs_the_packed_weights(debug_config, batch, fresh_dynamo, fresh_choices,
                                                           monkeypatch, setting, frozen):
    """Under torch.compile (AOTAutograd, as inductor receives the graph), a frozen model's inference runs each linear
    layer as hf_bert_impl::packed_linear where "auto" chose the packed weight (its timing rigged so that it wins;
    under eager's "infer-frozen" keys), or forced: the layer's packed copy, the one eager runs, made once per weight
    and again after the weight changes in place; the outputs of eager within 1e-5 before and after, no graph break.
    Given a weight that is not its layer's, the op runs that weight; torch.library's own checks of a custom op pass."""
    monkeypatch.setattr(K, "_fastest", lambda candidates, reference="reference": "packed_linear"
                        if "packed_linear" in candidates else reference)
    torch.manual_seed(0)
    config = debug_config()
    model = kernelize(BertImplForMaskedLM(config), setting, frozen=frozen).eval()
    input_ids, attention_mask, token_type_ids = batch
    inputs = dict(attention_mask=attention_mask, token_type_ids=token_type_ids)
    graphs, packed_calls, packing = [], [], _spy_packing(monkeypatch)
    packed_weight = K._packed_weight
    monkeypatch.setattr(K, "_packed_weight", lambda *a: packed_calls.append(a[0]) or packed_weight(*a))

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    layers = _linear_layers(config)
    with torch.no_grad():
        for change in (False, True):  # then with a weight changed in place
            if change:
                model.bert.layers[0].attn.Wo.weight.mul_(1.5)
            got = compiled(input_ids, **inputs).logits
            assert (got - model(input_ids, **inputs).logits).abs().max().item() <= ATOL
    ops = [node.args[3] for node in graphs[0].graph.nodes if "packed_linear" in str(node.target)]
    assert len(graphs) == 1 and not fresh_dynamo["graph_break"]
    assert len(ops) == layers and ops.count("GELUActivation") == config.num_hidden_layers + 1
    assert not any("onednn_linear" in str(node.target) for node in graphs[0].graph.nodes)
    # each call of the graph: every layer's packed weight (compiled and eager share them); packed: each weight once,
    # then the changed one again
    linears = {id(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert len(packed_calls) == 4 * layers and set(map(id, packed_calls)) == linears
    assert len(packing) == layers + 1
    if setting == "auto":
        linear = [key for key in K.chosen_kernels() if key.startswith("linear")]
        assert any(f"|rows<={K.TRACED_ROWS}|infer-frozen|" in key for key in linear), linear
    layer = model.bert.layers[0].mlp.Wi
    x, other = torch.randn(3, config.hidden_size), torch.randn_like(layer.weight)
    assert (K.packed_linear(x, other, layer.bias, "none", id(layer)) - F.linear(x, other, layer.bias)).abs().max() \
        <= ATOL
    torch.library.opcheck(K.packed_linear, (x, layer.weight.detach(), layer.bias.detach(), "none", id(layer)))


def test_the_linear_op_matches_f_linear_and_traces_on_fake_tensors():
    """hf_bert_impl::onednn_linear: F.linear's output (and act(F.linear) with an activation inside), and the shape of
    its fake (meta) form, which torch.compile traces with; torch.library's own checks of a custom op pass."""
    if not K._onednn_runs(torch.float32):
        pytest.skip("oneDNN's GEMM does not run here (the op is then never put in a graph)")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 5, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, generator=g)
    assert (K.onednn_linear(x, w, b, "none") - F.linear(x, w, b)).abs().max().item() <= ATOL
    assert (K.onednn_linear(x, w, None, "ReLU") - F.linear(x, w).relu()).abs().max().item() <= ATOL
    gelu = (K.onednn_linear(x, w, b, "GELUActivation") - F.gelu(F.linear(x, w, b))).abs().max().item()
    assert gelu <= ATOL
    torch.library.opcheck(K.onednn_linear, (x, w, b, "none"))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        assert K.onednn_linear(mode.from_tensor(x), mode.from_tensor(w), None, "none").shape == (2, 5, 3)


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [6], [4, 4]], ids=["mixed", "one", "equal"])
@pytest.mark.parametrize("attention", ["auto", "matmul_attention", "reference"])
@pytest.mark.parametrize("layout", ["per_sequence_attention", "grid_attention", "auto"])
def test_the_varlen_attention_op_attends_within_each_sequence_and_traces_on_fake_tensors(fresh_choices, monkeypatch,
                                                                                         layout, attention, lengths):
    """hf_bert_impl::varlen_attention on sequences laid one after another (one of them empty; a single one; two of one
    length, which attend as one grid): each sequence's SDPA alone, per sequence or on the masked grid (or "auto"'s
    pick), by SDPA or matmul_attention as `attention` says (or "auto"'s pick), within ATOL; the output contiguous, as
    its fake (meta) form, which torch.compile traces with, says (inductor checks the strides); torch.library's own
    checks of a custom op pass."""
    calls = _spy_matmul_attention(monkeypatch)
    g = torch.Generator().manual_seed(0)
    heads, d = 2, 4
    qkv = torch.randn(1, sum(lengths), 3 * heads * d, generator=g)
    got = K.varlen_attention(qkv, torch.tensor(lengths), heads, 0.5, layout, attention)  # (1, T, h, d)
    want = torch.cat([F.scaled_dot_product_attention(*part.view(1, n, 3, heads, d).permute(2, 0, 3, 1, 4), scale=0.5)
                      .transpose(1, 2) for part, n in zip(qkv.split(lengths, 1), lengths)], 1)
    assert got.shape == (1, sum(lengths), heads, d) and got.is_contiguous()
    assert (got - want).abs().max().item() <= ATOL
    per_sequence = sum(n > 0 for n in lengths) if len(set(lengths)) > 1 else 1  # one length: one grid call
    if attention == "reference":
        assert calls == []
    elif attention == "matmul_attention":  # one call per sequence or one on the grid ("auto" layout: either)
        expected = {"per_sequence_attention": {per_sequence}, "grid_attention": {1}}.get(layout, {1, per_sequence})
        assert len(calls) in expected, (layout, calls)
    torch.library.opcheck(K.varlen_attention, (qkv, torch.tensor(lengths), heads, 0.5, layout, attention))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = K.varlen_attention(mode.from_tensor(qkv), mode.from_tensor(torch.tensor(lengths)), heads, 0.5, layout,
                                  attention)
    assert fake.shape == got.shape


# ---------------------------------------------------------------------------------------------
# Point "attention": matmul_attention in place of SDPA in inference


def _qkv_views(n, h, m, d, dtype, seed=0):
    """q, k, v (n, h, m, d) as the model makes them: views into one fused projection (n, m, 3·h·d)."""
    qkv = torch.randn(n, m, 3 * h * d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return qkv.unflatten(-1, (3, h, d)).permute(2, 0, 3, 1, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_matmul_attention_is_the_formula_and_agrees_with_sdpa(dtype, masked):
    """matmul_attention on views of a fused projection (a padded grid's additive mask, or none) gives the formula's
    numbers (modeling_bert_impl.eager_attention_forward: its float32 softmax rounded once) and SDPA's: float32 within
    1e-6 and ATOL, bfloat16 within the kernel tolerance (TOLERANCE: 1e-2 of the largest magnitude) of both."""
    q, k, v = _qkv_views(3, 2, 9, 8, dtype)
    lengths = torch.tensor([9, 4, 1])
    mask = K._additive_mask(torch.arange(9)[None] < lengths[:, None], dtype) if masked else None
    got = K.matmul_attention(q, k, v, mask, 0.35)  # (n, m, h, d)
    formula, _ = mb.eager_attention_forward(nn.Module().eval(), q, k, v, mask, scaling=0.35)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.35).transpose(1, 2)
    assert got.shape == formula.shape == (3, 9, 2, 8) and got.dtype == dtype
    for want, tol in ((formula, 1e-6), (sdpa, ATOL)):
        tol = tol if dtype == torch.float32 else K.TOLERANCE[dtype] * want.abs().max().item()
        real = (torch.arange(9)[None] < lengths[:, None]) if masked else torch.ones(3, 9, dtype=torch.bool)
        assert (got.float() - want.float())[real].abs().max().item() <= tol


def _spy_matmul_attention(monkeypatch) -> list:
    """Records the q shape (n, h, m, d) of each `matmul_attention` call (looked up at call time by the kernels)."""
    calls, matmul = [], K.matmul_attention
    monkeypatch.setattr(K, "matmul_attention", lambda *a: calls.append(tuple(a[0].shape)) or matmul(*a))
    return calls


@pytest.mark.parametrize("padded", [True, False])
def test_forced_matmul_attention_runs_in_inference_and_matches_the_plain_model(debug_config, batch, monkeypatch,
                                                                               attention_layout, padded):
    """kernels "matmul_attention" (with each layout; alone it implies "unpadded"): in inference with SDPA each layer's
    attention runs it, once per sequence or once on the grid (once on the batch when nothing is padded), and the
    outputs are the plain model's within ATOL; with gradients on, in training, with "eager" attention or while
    attentions are recorded it never runs (SDPA, the formula or the plain path do)."""
    torch.manual_seed(0)
    config = debug_config(attn_implementation="sdpa")
    model = _model(BertImplModel, config, f"matmul_attention,{attention_layout}").eval()
    plain = _plain(model)
    input_ids, attention_mask, token_type_ids = batch
    if not padded:
        attention_mask = torch.ones_like(attention_mask)
    calls = _spy_matmul_attention(monkeypatch)
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        want = plain(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
    per_layer = len(input_ids) if padded and attention_layout == "per_sequence_attention" else 1
    assert len(calls) == config.num_hidden_layers * per_layer
    assert _max_diff_real(got, want, attention_mask) <= ATOL
    calls.clear()
    grad = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state  # grads on
    model.train()(input_ids, attention_mask=attention_mask)
    with torch.no_grad():
        model.eval()(input_ids, attention_mask=attention_mask, output_attentions=True)
        eager = _model(BertImplModel, debug_config(attn_implementation="eager"), "matmul_attention").eval()
        eager(input_ids, attention_mask=attention_mask)
    assert calls == []
    assert _max_diff_real(grad.detach(), want, attention_mask) <= ATOL
    assert K.parse_setting("matmul_attention") >= {"unpadded"}
    alone = _forced(model, "matmul_attention")
    with torch.no_grad():
        assert _max_diff_real(alone(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
                              .last_hidden_state, want, attention_mask) <= ATOL
    assert len(calls) == config.num_hidden_layers * (len(input_ids) if padded else 1)  # per sequence: "unpadded"'s


def test_sequences_of_one_length_attend_as_one_unmasked_grid(debug_config, batch, monkeypatch, attention_layout):
    """Sequences all of one length (a padded batch whose rows are equally long, or a packed row of equal sequences)
    attend in one call on their (n, m) grid, unmasked and with no slot map, whatever layout is set; the outputs are
    the plain model's within ATOL."""
    for indices in (torch.arange(12), None):
        tokens = K._sequence_layout(K.parse_setting(attention_layout), (3, 6) if indices is not None else (1, 12),
                                    indices, torch.tensor([4, 4, 4]), [4, 4, 4], 2, 4, torch.float32)
        assert tokens.grid == (3, 4) and tokens.mask is None and tokens.unpadded
        assert tokens.seq_lengths is None and tokens.grid_index is None
    torch.manual_seed(0)
    config = debug_config(attn_implementation="sdpa")
    model = _model(BertImplModel, config, f"matmul_attention,{attention_layout}").eval()
    input_ids, attention_mask, token_type_ids = batch
    attention_mask = (torch.arange(attention_mask.size(1)) < 5).long().expand_as(attention_mask)  # 5 of 7 each
    calls = _spy_matmul_attention(monkeypatch)
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        want = _plain(model)(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    heads = config.num_attention_heads
    assert calls == [(len(input_ids), heads, 5, config.hidden_size // heads)] * config.num_hidden_layers
    assert _max_diff_real(got, want.last_hidden_state, attention_mask) <= ATOL


@pytest.mark.parametrize("faster", ["matmul_attention", "reference"])
def test_auto_attention_takes_the_faster_of_sdpa_and_matmul_attention(debug_config, batch, fresh_choices,
                                                                      monkeypatch, faster):
    """"auto" at the attention point, its timing rigged so that `faster` wins: the inference forward records that
    choice per (dtype, sequences, length, heads x head_dim, masked) class, runs it in every layer, and agrees with the
    plain model; a disagreeing candidate is never chosen, however fast."""
    calls = _spy_matmul_attention(monkeypatch)

    def rigged(fn, reps=3, warm=False):  # which kernel `fn` runs decides its time
        before = len(calls)
        fn()
        return 0.0 if (len(calls) > before) == (faster == "matmul_attention") else 1.0

    monkeypatch.setattr(K, "_median_seconds", rigged)
    torch.manual_seed(0)
    config = debug_config(attn_implementation="sdpa")
    model = _model(BertImplModel, config, "auto").eval()
    input_ids, attention_mask, token_type_ids = batch
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        want = _plain(model)(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert _max_diff_real(got, want.last_hidden_state, attention_mask) <= ATOL
    chosen = {k: v for k, v in K.chosen_kernels().items() if k.startswith("attention|")}
    assert chosen and set(chosen.values()) == {faster}, chosen
    assert all(k.endswith(("|masked", "|unmasked")) and "|float32|" in k and "|4x8|" in k for k in chosen)
    calls.clear()
    monkeypatch.setattr(K, "_median_seconds", lambda *a, **k: pytest.fail("a made choice was measured again"))
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert (len(calls) >= config.num_hidden_layers) == (faster == "matmul_attention")
    monkeypatch.setattr(K, "_CHOICES", K._Choices())  # a wrong matmul_attention is never chosen
    monkeypatch.setattr(K, "_median_seconds", rigged)
    monkeypatch.setattr(K, "matmul_attention", lambda q, k, v, mask, scaling: calls.append(1) or torch.zeros_like(
        q.transpose(1, 2)))
    q, k, v = _qkv_views(2, 4, 7, 8, torch.float32)
    candidates = lambda: {"reference": lambda: F.scaled_dot_product_attention(q, k, v).transpose(1, 2),  # noqa: E731
                          "matmul_attention": lambda: K.matmul_attention(q, k, v, None, 8 ** -0.5)}
    assert K._attention_choice("auto", q, None, candidates) == "reference"


# ---------------------------------------------------------------------------------------------
# scripts/benchmark.py


@functools.cache
def _benchmark_module():
    import importlib.util

    path = REPO_ROOT / "scripts" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("benchmark_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return module


def _tiny_benchmark(tmp_path, *argv) -> dict:
    """scripts/benchmark.py on the tiny size, one timed pair, plus `argv`; its JSON result. The matmul peak (MFU's
    ceiling, sampled before and after every workload) is measured on 256² instead of 1536² matrices (`--peak_n`): a
    bf16 GEMM of that size takes seconds on a CPU without bf16 instructions."""
    bench, out = _benchmark_module(), tmp_path / "bench.json"
    bench.main(["--size", "tiny", "--seq_len", "16", "--batch_size", "2", "--pairs", "1", "--warmup", "0",
                "--peak_n", "256", *argv, "--json", str(out)])
    return json.loads(out.read_text())


def _assert_row_follows_from_its_times(row, baseline, peak):
    """A workload's numbers are derived from its raw times: latency = the median time, tokens/s = tokens / latency
    (real / padded = the real-token fraction), MFU = model FLOPs / latency / the run's matmul peak, and the ratio = the
    median over pairs of t_baseline / t_ours, which with one pair is ours' tokens/s over the baseline's."""
    a, b = row[baseline]["times_s"], row["ours"]["times_s"]
    assert len(a) == len(b) == row["pairs"] == 1
    assert row["ratio_median"] == pytest.approx(statistics.median(x / y for x, y in zip(a, b)), rel=1e-9)
    ours_speed, theirs_speed = row["ours"]["tokens_per_s_real"], row[baseline]["tokens_per_s_real"]
    assert row["ratio_median"] == pytest.approx(ours_speed / theirs_speed, rel=1e-9)
    for tag in (baseline, "ours"):
        r, t = row[tag], statistics.median(row[tag]["times_s"])
        assert r["latency_ms"] == pytest.approx(1e3 * t, rel=1e-9)
        assert r["tokens_per_s_real"] / r["tokens_per_s_padded"] == pytest.approx(row["real_token_fraction"])
        assert r["mfu"] == pytest.approx(row["model_flops"] / t / peak, rel=1e-9)


def test_benchmark_script_checks_outputs_and_writes_json(tmp_path):
    """One timed pair of the tiny size: the output checks ran and passed, every reported number follows from the raw
    times, and the kernels ours used are there ("auto": the choices made by then, per workload, the modules
    kernelized, and the one-time cost of measuring them)."""
    result = _tiny_benchmark(tmp_path, "--workloads", "fixed,mixed", "--memory", "false")
    checks = result["backends"]["sdpa"]["checks"]
    assert {"fixed_max_abs_diff", "mixed_max_abs_diff", "mlm_loss_abs_diff", "mlm_grad_max_abs_diff"} <= set(checks)
    assert all(v <= 1e-5 for v in checks.values()), checks
    rows = result["backends"]["sdpa"]["workloads"]
    assert set(rows) == {"fixed", "mixed"}
    assert rows["mixed"]["real_token_fraction"] < 1.0 and rows["fixed"]["real_token_fraction"] == 1.0
    for row in rows.values():
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])
        kernels = row["ours_kernels"]
        assert kernels["setting"] == "auto" and kernels["measurement_s"] >= 0
        assert kernels["kernelized"]["_linear_forward"] == 4 * 2 + 2  # the tiny model's 2 layers, the MLM head
        _assert_valid_choices(kernels["chosen"], points=("linear", "layout"))  # the mixed batch's padding: "layout"
        assert any(k.startswith("linear|cpu|float32|128x") for k in kernels["chosen"])  # the tiny model's layers
    assert rows["mixed"]["ours_kernels"]["measurement_s"] >= rows["fixed"]["ours_kernels"]["measurement_s"]
    assert result["kernels"]["setting"] == "auto"
    assert result["kernels"]["chosen"] == rows["mixed"]["ours_kernels"]["chosen"]
    assert result["kernels"]["measurement_s"] == rows["mixed"]["ours_kernels"]["measurement_s"]
    assert result["matmul_peak_flops"]["best"] == max(max(s.values()) for s in result["matmul_peak_flops"]["samples"])
    assert "| sdpa | mixed |" in result["markdown_table"]


def test_benchmark_against_the_serving_runtimes_in_one_run(tmp_path, monkeypatch):
    """--against onnxruntime,openvino,compile: transformers in torch, ours (kernelized, "auto", --frozen: served, as
    the runtimes run a converted snapshot, so its inference choices are "infer-frozen" ones), onnxruntime running
    transformers' and our ONNX export, OpenVINO (f32 hint and its defaults) and torch.compile of both, in one
    interleaved run; each runner's output checked against float32 transformers first (its error and precision in the
    JSON, within its precision's tolerance), the versions recorded, every ratio (ours / runner) from the raw times,
    one markdown row per runner. A runner that disagrees stops the run (exit status 2)."""
    monkeypatch.setenv("CI", "true")  # openvino's usage telemetry off (it writes under ~/intel outside CI)
    for module in ("openvino", "onnxruntime", "onnxscript"):
        pytest.importorskip(module)
    result = _tiny_benchmark(tmp_path, "--against", "onnxruntime,openvino,compile", "--memory", "false", "--frozen")
    anchors = result["backends"]["anchors"]
    runners = {"transformers", "ours", "onnxruntime_transformers", "onnxruntime_ours", "openvino_f32",
               "openvino_default", "transformers_compile", "ours_compile"}
    assert set(anchors["versions"]) == {"torch", "onnxruntime", "openvino"}
    assert set(anchors["workloads"]) == {"fixed", "mixed"} and anchors["errors"] == {
        w: {tag: anchors["workloads"][w][tag]["max_abs_diff_vs_transformers_fp32"] for tag in runners}
        for w in ("fixed", "mixed")}
    for workload, row in anchors["workloads"].items():
        assert runners == {tag for tag in row if isinstance(row[tag], dict) and "times_s" in row[tag]}, sorted(row)
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])
        assert row["ours_kernels"]["setting"] == "auto" and row["ours_kernels"]["kernelized"]["_encoder_forward"] == 1
        assert row["ours_kernels"]["frozen"] is True
        assert any("|infer-frozen|" in key for key in row["ours_kernels"]["chosen"])
        for tag in runners - {"ours"}:
            ratio = statistics.median(a / b for a, b in zip(row[tag]["times_s"], row["ours"]["times_s"]))
            assert row[f"ours_vs_{tag}_median"] == pytest.approx(ratio, rel=1e-9)
        for tag in runners:
            error, mean = row[tag]["max_abs_diff_vs_transformers_fp32"], row[tag]["mean_abs_diff_vs_transformers_fp32"]
            assert error == anchors["errors"][workload][tag] <= anchors["tolerances"][tag]
            assert mean == anchors["mean_errors"][workload][tag] <= error
        assert row["openvino_f32"]["precision"] == "f32" and row["openvino_default"]["precision"] in ("f32", "bf16")
    assert all(f"| {tag} |" in result["markdown_table"] for tag in runners)

    bench = _benchmark_module()

    def off_by_one(hf, ours, precision="f32"):  # a runner 1.0 off transformers (uncompiled: the check is tested)
        return {"transformers_compile": (lambda batch: hf.bert(**batch).last_hidden_state + 1.0, precision)}

    monkeypatch.setattr(bench, "compiled_runners", off_by_one)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--size", "tiny", "--seq_len", "16", "--batch_size", "2", "--pairs", "1", "--warmup", "0",
                    "--peak_n", "256", "--against", "compile", "--memory", "false"])
    assert stop.value.code == 2


def test_benchmark_against_openvino_in_bf16(tmp_path, monkeypatch):
    """--dtype bf16 --against openvino: transformers and ours run bf16 weights (the same weights, rounded), OpenVINO
    converts the float32 model and runs its default precision (bf16 where the CPU has bf16 units) beside its f32
    hint; each error is against float32 transformers, a bf16 runner's within 3x transformers' own bf16 error (the
    transformers runner's), an f32 one's within 1e-4."""
    monkeypatch.setenv("CI", "true")  # openvino's usage telemetry off
    pytest.importorskip("openvino")
    result = _tiny_benchmark(tmp_path, "--dtype", "bf16", "--against", "openvino", "--memory", "false")
    anchors = result["backends"]["anchors"]
    assert anchors["weights"] == "bf16" and "bf16_autocast_error_transformers" not in anchors
    own = max(anchors["errors"][w]["transformers"] for w in ("fixed", "mixed"))
    assert anchors["bf16_error_transformers"] == own > 1e-4  # bf16 rounding, far above float32's
    for workload, row in anchors["workloads"].items():
        assert row["transformers"]["precision"] == row["ours"]["precision"] == "bf16"
        assert row["openvino_f32"]["precision"] == "f32" and row["openvino_default"]["precision"] in ("f32", "bf16")
        for tag in ("transformers", "ours", "openvino_f32", "openvino_default"):
            limit = 1e-4 if row[tag]["precision"] == "f32" else 3 * own
            assert anchors["tolerances"][tag] == pytest.approx(limit)
            assert row[tag]["max_abs_diff_vs_transformers_fp32"] == anchors["errors"][workload][tag] <= limit
            mean = row[tag]["mean_abs_diff_vs_transformers_fp32"]
            assert mean == anchors["mean_errors"][workload][tag] <= anchors["errors"][workload][tag]
        assert row["transformers"]["mean_abs_diff_vs_transformers_fp32"] > 1e-5  # bf16 rounding, on average too
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])


def test_benchmark_dense_mlm_step_checks_full_logits(tmp_path):
    """The MLM step with full logits (mlm_dense: kernelized with sparse_prediction=False) is checked against
    transformers' (b, s, V) logits before timing and timed as its own row; the mlm row runs the sparse decoder."""
    result = _tiny_benchmark(tmp_path, "--workloads", "mlm,mlm_dense", "--memory", "false")
    checks = result["backends"]["sdpa"]["checks"]
    assert checks["mlm_dense_logits_max_abs_diff"] <= 1e-5 and checks["mlm_dense_loss_abs_diff"] <= 1e-5
    assert checks["mlm_logits_max_abs_diff"] <= 1e-5 and checks["mlm_dense_grad_max_abs_diff"] <= 1e-5
    rows = result["backends"]["sdpa"]["workloads"]
    assert rows["mlm"]["ours_kernels"]["kernelized"]["_sparse_mlm_logits_and_loss"] == 1
    assert "_sparse_mlm_logits_and_loss" not in rows["mlm_dense"]["ours_kernels"]["kernelized"]
    for row in rows.values():
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])
        assert len(row["load_average_after"]) == 3
    assert "| sdpa | mlm_dense |" in result["markdown_table"]


def test_benchmark_under_bf16_autocast(tmp_path):
    """--dtype autocast: float32 weights, every forward under bf16 autocast; the outputs are checked
    against float32 first (ours within 3x transformers' own bf16 error, which must be non-zero: bf16
    ran), MFU is against the bf16 matmul peak and the bf16 targets apply."""
    result = _tiny_benchmark(tmp_path, "--dtype", "autocast", "--workloads", "fixed,mixed,mlm_dense",
                             "--memory", "false")
    checks = result["backends"]["sdpa"]["checks"]
    for name in ("fixed", "mixed"):
        hf_err, ours_err = checks[f"{name}_hf_bf16_err"], checks[f"{name}_ours_bf16_err"]
        assert 0 < hf_err and ours_err <= 3 * hf_err, checks
    assert set(result["backends"]["sdpa"]["workloads"]) == {"fixed", "mixed", "mlm_dense"}
    assert "| sdpa | fixed |" in result["markdown_table"] and ">= 1.3x" in result["markdown_table"]


def test_benchmark_autocast_scope_run_times_inference_inside_one_context(tmp_path, monkeypatch):
    """--autocast_scope run: every timed inference call of a workload runs inside one autocast context
    (what a serving loop does); training steps keep a context each."""
    bench = _benchmark_module()
    timed, interleaved = [], bench.interleaved

    def spy(fns, *rest):  # records, per timed workload, whether autocast was already on around its calls
        timed.append(torch.is_autocast_enabled("cpu"))
        return interleaved(fns, *rest)

    monkeypatch.setattr(bench, "interleaved", spy)
    result = _tiny_benchmark(tmp_path, "--dtype", "autocast", "--autocast_scope", "run", "--workloads", "fixed,mlm",
                             "--memory", "false")
    assert result["args"]["autocast_scope"] == "run" and timed == [True, False]
    _tiny_benchmark(tmp_path, "--dtype", "autocast", "--workloads", "fixed", "--memory", "false")
    assert timed[-1] is False  # the default: a context per forward


@pytest.mark.parametrize("kernels,bits", [("reference", False), ("bits_dropout", True),
                                          ("onednn_linear,bits_dropout", True)])
def test_benchmark_kernels_option_kernelizes_ours(tmp_path, monkeypatch, capsys, kernels, bits):
    """--kernels goes to hf_bert_impl.kernelize(ours, kernels): "reference" leaves ours the plain model (nothing
    kernelized, SDPA with F.dropout in training, full logits in the mlm step, which still matches transformers);
    forced bits_dropout trains with its masks on the attention formula (BertConfig's dropout 0.1). Each workload's
    row records the forced set, the modules kernelized and no measuring."""
    if "onednn_linear" in kernels and K._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear")
    calls = _spy_bits_attention(monkeypatch)
    built, build = [], _benchmark_module().build_models
    monkeypatch.setattr(_benchmark_module(), "build_models", lambda *a: built.append(build(*a)) or built[-1])
    result = _tiny_benchmark(tmp_path, "--kernels", kernels, "--workloads", "mlm", "--memory", "false")
    ours = built[0][1]
    assert result["args"]["kernels"] == kernels
    assert bool(calls) == bits  # the output checks (eval) run SDPA either way
    assert result["backends"]["sdpa"]["checks"]["mlm_logits_max_abs_diff"] <= 1e-5
    row = result["backends"]["sdpa"]["workloads"]["mlm"]["ours_kernels"]
    assert row["setting"] == kernels and row["measurement_s"] == 0.0
    assert row["chosen"] == ("reference" if kernels == "reference" else sorted(K.parse_setting(kernels)))
    if kernels == "reference":
        assert kernelized(ours) == {} and row["kernelized"] == {}
    else:
        names = list(kernelized(ours).values())
        assert row["kernelized"] == {name: names.count(name) for name in sorted(set(names))}
        assert kernelized(ours)["._mlm_logits_and_loss"] == "_sparse_mlm_logits_and_loss"
    said = "reference (the plain model)" if kernels == "reference" else f"{kernels} (forced)"
    assert f"mlm    ours' kernels: {said}" in capsys.readouterr().out  # the log says it too


def test_benchmark_mlm_step_uses_the_optimizer_trainer_builds(tmp_path, monkeypatch):
    """The MLM steps step the optimizer Trainer builds for --optim: by default Trainer's own (fused AdamW), the same
    for both models; --optim adamw_torch gives torch's per-parameter AdamW, which the runs before 0.3.6 timed."""
    from transformers import TrainingArguments

    bench = _benchmark_module()
    made, make = [], bench.make_optimizer
    monkeypatch.setattr(bench, "make_optimizer", lambda *a: made.append(make(*a)) or made[-1])
    default = TrainingArguments(str(tmp_path)).optim
    assert bench.optimizer_args(bench.BenchmarkArguments()).optim == default  # Trainer's default
    _tiny_benchmark(tmp_path, "--workloads", "mlm", "--memory", "false")
    assert len(made) == 2 and all(type(o) is torch.optim.AdamW and o.defaults["fused"] for o in made)
    assert [o.defaults["weight_decay"] for o in made] == [0.0, 0.0]  # TrainingArguments' default, as Trainer's groups
    result = _tiny_benchmark(tmp_path, "--workloads", "mlm", "--memory", "false", "--optim", "adamw_torch")
    assert result["args"]["optim"] == "adamw_torch" and len(made) == 4
    assert not any(o.defaults["fused"] for o in made[2:])


def test_benchmark_mixed_lengths_are_the_uniform_quantiles():
    bench = _benchmark_module()
    lengths = bench.mixed_lengths(128, 8, torch.Generator().manual_seed(0))
    assert sorted(lengths) == [16, 32, 48, 64, 80, 96, 112, 128]
    assert sum(lengths) / (8 * 128) == 0.5625


@pytest.mark.parametrize("argv,message", [
    (["--size", "huge"], "--size must be tiny or base, got 'huge'"),
    (["--workloads", "fixed,train"], "--workloads takes a comma-separated subset of fixed,mixed,mlm"),
    (["--seq_len", "1000"], "--seq_len must be in [8, 512]"),
    (["--dtype", "fp16"], "--dtype must be one of ['autocast', 'bf16', 'fp32'], got 'fp16'"),
    (["--kernels", "fast"], "--kernels must be auto, reference or kernel names from onednn_linear, fused_activation,"),
    (["--kernels", "onednn_linear,nope"], "got 'onednn_linear,nope'"),
    (["--against", "tensorrt"],
     "--against must be transformers or a comma-separated subset of onnxruntime,openvino,compile, got 'tensorrt'"),
    (["--against", "openvino,transformers"], "comma-separated subset of onnxruntime,openvino,compile, got 'openvino,"),
    (["--against", "onnxruntime", "--dtype", "bf16"], "--against onnxruntime runs float32 only"),
    (["--against", "openvino", "--dtype", "autocast"],
     "--against openvino runs on the CPU with fp32 or bf16 weights, got --dtype autocast"),
    (["--autocast_scope", "always"], "--autocast_scope must be forward or run, got 'always'"),
    (["--autocast_scope", "run"], "--autocast_scope run needs --dtype autocast, got --dtype fp32"),
    (["--optim", "adamw_fast"], "--optim 'adamw_fast': adamw_fast is not a valid OptimizerNames"),
])
def test_benchmark_rejects_bad_arguments(argv, message, capsys):
    bench = _benchmark_module()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["bf16_weights", "autocast"])
def test_forced_onednn_in_bfloat16_runs_on_every_cpu(batch, mode, monkeypatch):
    """Forced "onednn_linear" in bfloat16 runs oneDNN where it has a bf16 kernel and the reference where it has none
    (AVX2-only CPUs); either way the output's error against float32 is within 3x the error transformers' own BertModel
    (the same weights, an independent implementation) has in bfloat16 against its float32 self."""
    from transformers import BertModel

    from hf_bert_impl.convert import from_hf_bert

    torch.manual_seed(0)
    hf = BertModel(hf_config(attn_implementation="sdpa")).eval()
    ours = kernelize(from_hf_bert(hf, BertImplModel).eval(), "onednn_linear")
    calls = _spy_onednn_linear(monkeypatch, record=lambda x: x.dtype)
    input_ids, attention_mask, _ = batch
    errors = {}
    with torch.no_grad():
        exact = hf(input_ids, attention_mask=attention_mask).last_hidden_state  # float32: the reference
        for name, model in (("ours", ours), ("transformers", hf)):
            if mode == "bf16_weights":
                out = copy.deepcopy(model).to(torch.bfloat16)(input_ids, attention_mask=attention_mask)
                assert out.last_hidden_state.dtype == torch.bfloat16
            else:  # the GEMMs in bf16, the LayerNorms (and so the outputs) in float32, as autocast runs them
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(input_ids, attention_mask=attention_mask)
            errors[name] = _max_diff_real(out.last_hidden_state.float(), exact, attention_mask)
    assert calls == ([torch.bfloat16] * 9 if K._onednn_runs(torch.bfloat16) else [])  # 4 per layer, the pooler
    assert 0 < errors["transformers"] and errors["ours"] <= 3 * errors["transformers"], errors
