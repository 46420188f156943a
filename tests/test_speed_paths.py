"""The speed paths of modeling_bert_impl.py, each against the plain path it replaces (fp32, 1e-5):
unpadding (padded batches and packed rows from DataCollatorWithFlattening), sparse MLM
prediction, and torch.compile (no graph breaks at fixed shape, no recompile per length).

Run: pytest tests/test_speed_paths.py -q
"""

import copy
import functools
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface, DataCollatorWithFlattening

from hf_bert_impl import BertImplForMaskedLM, BertImplForPreTraining, BertImplModel
from hf_bert_impl import modeling_bert_impl as mb

from .test_convert import hf_config  # transformers' BertConfig of the debug flavour (the oracle models)

ATOL = 1e-5  # float32, unit-scale activations (docs/formulas.md, tolerances)
VOCAB = 99


def _plain(model):
    """The same weights with the unpadded path switched off: the reference every speed path must match."""
    other = copy.deepcopy(model)
    other.config.unpad_inputs = False
    return other


def _spy_unpadding(monkeypatch, layout=None):
    """Record each forward that runs the layers on the real tokens only (its token map), so a test
    cannot pass on the padded path by accident; with `layout`, check which way attention ran."""
    calls = []
    original = BertImplModel._token_map

    def spy(self, *args, **kwargs):
        tokens = original(self, *args, **kwargs)
        if tokens is not None:
            assert tokens.cu_seqlens is not None  # unpadded
            if layout is not None:
                assert (tokens.seq_lengths is not None, tokens.grid_index is not None) == (
                    layout == "per-sequence", layout == "grid"), layout
            calls.append(tokens)
        return tokens

    monkeypatch.setattr(BertImplModel, "_token_map", spy)
    return calls


@pytest.fixture(params=["per-sequence", "grid"])
def attention_layout(request, monkeypatch):
    """Both ways unpadded sequences attend under eager / sdpa: one unmasked call per sequence (on
    CPU) and one call on a masked (n, m) grid (on other devices), each forced here on the CPU."""
    monkeypatch.setattr(mb, "_PER_SEQUENCE_DEVICES", ("cpu",) if request.param == "per-sequence" else ())
    return request.param


def _max_diff_real(a, b, attention_mask):
    real = attention_mask.bool()
    return (a - b)[real].abs().max().item()


# ---------------------------------------------------------------------------------------------
# Linear layers on oneDNN (CPU float32)

needs_onednn = pytest.mark.skipif(mb._ONEDNN_LINEAR is None, reason="this torch build has no oneDNN linear")


def _spy_onednn_linear(monkeypatch, record=lambda x: 1) -> list:
    """Records `record(input)` for each linear layer call that runs on oneDNN (`_LinearFunction`, onednn=True)."""
    calls, apply = [], mb._LinearFunction.apply
    monkeypatch.setattr(mb._LinearFunction, "apply", lambda *a: (calls.append(record(a[0])) if a[3] else None) or apply(*a))
    return calls


def _spy_gemm(monkeypatch, record=lambda a, w: a.reshape(-1, a.size(-1)).size(0)) -> list:
    """Records `record(left operand, weight)` of each GEMM `_LinearFunction` runs (`_gemm`); by default the row count."""
    calls, gemm = [], mb._gemm
    monkeypatch.setattr(mb, "_gemm", lambda a, w, *rest: calls.append(record(a, w)) or gemm(a, w, *rest))
    return calls


def _spy_attention_impls(monkeypatch) -> list:
    """Records the attention implementation each attention call of ours looks up (`_attention_function`)."""
    impls, get = [], mb._attention_function
    monkeypatch.setattr(mb, "_attention_function", lambda impl: impls.append(impl) or get(impl))
    return impls


def _assert_bf16_within_3x_of_nn_linear(layer, x32, g32):
    """`layer` (float32 weights, cast to bf16 here) against nn.Linear in bf16, both against a float32 copy: the
    output and the input, weight and bias gradients of g32 each within 3x nn.Linear's own error (+1e-6), the
    project's bf16 rule."""
    ref32 = torch.nn.Linear(layer.in_features, layer.out_features)
    ref32.load_state_dict(layer.state_dict())
    ref16 = copy.deepcopy(ref32).bfloat16()
    layer.bfloat16()
    results = {}
    for name, module, dtype in (("mine", layer, torch.bfloat16), ("linear", ref16, torch.bfloat16), ("fp32", ref32, torch.float32)):
        x = x32.to(dtype).requires_grad_()
        y = module(x)
        y.backward(g32.to(dtype))
        results[name] = [t.float() for t in (y, x.grad, module.weight.grad, module.bias.grad)]
    for mine, theirs, exact in zip(results["mine"], results["linear"], results["fp32"]):
        assert (mine - exact).abs().max() <= 3 * (theirs - exact).abs().max() + 1e-6


@needs_onednn
@pytest.mark.parametrize("in_features,out_features,dw_by_mm", [(32, 37, False), (8, 100, True)],
                         ids=["dW-on-onednn", "wide-output-dW-by-torch.mm"])
def test_onednn_linear_forward_and_backward_match_nn_linear(debug_config, monkeypatch, in_features, out_features, dw_by_mm):
    """Forward and every gradient against nn.Linear, on both weight-gradient routes of the backward
    (oneDNN, and torch.mm for an output over 8x wider than the input: the vocabulary projection)."""
    config = debug_config()
    torch.manual_seed(0)
    layer = mb.BertImplLinear(config, in_features, out_features)
    ref = torch.nn.Linear(in_features, out_features)
    ref.load_state_dict(layer.state_dict())
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
    # switched off, and every case it does not cover, take nn.Linear's own path
    config.onednn_linear = False
    layer(x)
    config.onednn_linear = True
    layer.to(torch.float16)(x.detach().half())
    assert calls == [1]


@pytest.mark.skipif(torch.bfloat16 not in mb._ONEDNN_DTYPES, reason="no bfloat16 oneDNN linear on this CPU / build")
def test_onednn_linear_in_bfloat16_matches_nn_linear(debug_config, monkeypatch):
    """bf16 forward and backward on oneDNN against nn.Linear in bf16: each within 3x nn.Linear's own
    error against a float32 copy (the bf16 rule of the benchmark), and the oneDNN branch was taken."""
    torch.manual_seed(0)
    layer = mb.BertImplLinear(debug_config(onednn_linear=True), 64, 48)
    calls = _spy_onednn_linear(monkeypatch)
    _assert_bf16_within_3x_of_nn_linear(layer, torch.randn(9, 5, 64), torch.randn(9, 5, 48))
    assert calls == [1]


def _spy_fused_activations(monkeypatch) -> list:
    """Records the post-op of each oneDNN call that applies an activation inside the GEMM (`_ONEDNN_ACTS`)."""
    calls, op = [], mb._ONEDNN_LINEAR
    monkeypatch.setattr(mb, "_ONEDNN_LINEAR", lambda *a: (calls.append(a[3]) if a[3] != "none" else None) or op(*a))
    return calls


@needs_onednn
@pytest.mark.parametrize("act,post", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu"), ("gelu_new", "gelu"), ("relu", "relu")])
def test_float32_inference_runs_the_activation_inside_the_gemm(debug_config, batch, monkeypatch, act, post):
    """On oneDNN in float32 without grad, each MLP's and the MLM head's activation run as oneDNN's post-op: the same logits
    as the activation after the GEMM (erf GELU bit for bit, the others <= 1e-6) and as transformers' BertForMaskedLM."""
    from transformers import BertForMaskedLM

    from hf_bert_impl.convert import to_hf_bert

    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config(onednn_linear=True, hidden_act=act)).eval()
    if type(model.bert.layers[0].mlp.act) not in mb._ONEDNN_ACTS:
        pytest.skip(f"oneDNN's post-op for {act} did not reproduce it in the import probe on this CPU / build")
    input_ids, attention_mask, token_type_ids = batch
    calls = _spy_fused_activations(monkeypatch)
    with torch.no_grad():
        fused = model(input_ids, attention_mask, token_type_ids).logits
        assert calls == [post] * (model.config.num_hidden_layers + 1)  # every MLP and the MLM head's dense layer
        hf = to_hf_bert(model)
        assert isinstance(hf, BertForMaskedLM) and hf.config.hidden_act == act
        reference = hf.eval()(input_ids, attention_mask, token_type_ids).logits
        monkeypatch.setattr(mb, "_ONEDNN_ACTS", {})  # the activation after the GEMM, as before
        unfused = model(input_ids, attention_mask, token_type_ids).logits
    assert len(calls) == model.config.num_hidden_layers + 1
    diff = (fused - unfused).abs().max().item()
    assert diff == 0.0 if act == "gelu" else diff <= 1e-6
    assert _max_diff_real(fused, reference, attention_mask) <= ATOL


@needs_onednn
def test_the_activation_stays_after_the_gemm_where_it_must(debug_config, batch, monkeypatch):
    """Not fused: with grad (the backward needs the pre-activation), in bfloat16 (rounded as transformers rounds), for an
    activation oneDNN has no post-op for (silu), and on a hooked activation module, whose hook still sees its output."""
    input_ids, attention_mask, _ = batch
    calls = _spy_fused_activations(monkeypatch)
    model = BertImplForMaskedLM(debug_config(onednn_linear=True)).eval()
    model(input_ids, attention_mask)  # grad enabled
    with torch.no_grad():
        BertImplForMaskedLM(debug_config(onednn_linear=True, hidden_act="silu")).eval()(input_ids, attention_mask)
        if torch.bfloat16 in mb._ONEDNN_DTYPES:
            copy.deepcopy(model).bfloat16()(input_ids, attention_mask)
        assert calls == []
        expected = model(input_ids, attention_mask).logits
        seen = []
        model.bert.layers[0].mlp.act.register_forward_hook(lambda module, args, out: seen.append(out))
        hooked = model(input_ids, attention_mask).logits
    assert len(seen) == 1 and seen[0].shape[-1] == model.config.intermediate_size
    assert calls == ["gelu"] * (2 * model.config.num_hidden_layers + 1)  # unhooked: L + 1 fused calls; hooked: L (layer 0 not)
    assert (hooked - expected).abs().max().item() == 0.0  # the erf GELU fused or not: bit for bit


@needs_onednn
def test_the_activation_probe_rejects_a_post_op_that_computes_something_else():
    """`_onednn_agrees` (run at import for `_ONEDNN_ACTS`) takes a post-op only where it reproduces the activation."""
    from transformers.activations import GELUActivation, GELUTanh

    assert mb._onednn_agrees(post=("gelu", [], "none"), act=GELUActivation())
    assert mb._onednn_agrees(post=("gelu", [], "tanh"), act=GELUTanh())
    assert not mb._onednn_agrees(post=("relu", [], ""), act=GELUActivation())
    assert not mb._onednn_agrees(post=("gelu", [], "tanh"), act=GELUActivation())  # tanh approximation, not erf
    assert not mb._onednn_agrees(post=("gelu", [], "no-such-algorithm"), act=GELUActivation())  # an error means no


@pytest.mark.skipif(torch.bfloat16 not in mb._ONEDNN_DTYPES, reason="no bfloat16 oneDNN linear on this CPU / build")
def test_onednn_linear_under_bfloat16_autocast(debug_config, batch, monkeypatch):
    """Under torch.autocast("cpu", bfloat16) (Trainer's --bf16 on a CPU) the oneDNN branch runs every
    linear layer in bfloat16 from the float32 weights, as nn.Linear's op does under autocast: the same
    output dtype, and the MLM loss, the logits and every weight's gradient within 3x the nn.Linear
    path's own error against float32 without autocast. Under float16 autocast nn.Linear's op runs."""
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config(onednn_linear=True))
    blas = copy.deepcopy(model)
    blas.config.onednn_linear = False
    exact = copy.deepcopy(blas)
    calls = _spy_onednn_linear(monkeypatch, record=lambda x: x.dtype)
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    results = {}
    for name, m, enabled in (("onednn", model, True), ("linear", blas, True), ("fp32", exact, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = m(**inputs)
        out.loss.backward()
        results[name] = [out.loss.float(), out.logits.float()] + [p.grad for p in m.parameters()]
        assert out.logits.dtype == (torch.bfloat16 if enabled else torch.float32)
    linear_layers = 4 * model.config.num_hidden_layers + 2  # Wqkv, Wo, Wi, Wo per layer; the head's dense and decoder
    assert calls == [torch.bfloat16] * linear_layers
    names = ["loss", "logits"] + [n for n, _ in model.named_parameters()]
    for name, mine, theirs, ref in zip(names, results["onednn"], results["linear"], results["fp32"]):
        assert (mine - ref).abs().max() <= 3 * (theirs - ref).abs().max() + 1e-6, name
    calls.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(**inputs)
    assert calls == []


@pytest.mark.skipif(torch.bfloat16 not in mb._ONEDNN_DTYPES, reason="no bfloat16 oneDNN linear on this CPU / build")
def test_autocast_inference_casts_weights_anew_into_a_kept_buffer(debug_config, monkeypatch):
    """Without grad under bf16 autocast the oneDNN branch casts each float32 weight into a buffer kept per
    thread, shape and dtype (one allocation, not one per call): the output equals the freshly cast one bit
    for bit, every call casts anew (a weight changed in place, even through `.data`, is seen at once), and
    another thread gets its own buffer."""
    torch.manual_seed(0)
    layer = mb.BertImplLinear(debug_config(onednn_linear=True), 16, 24)
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


@pytest.mark.parametrize("setting", [True, False], ids=["onednn", "blas"])
@pytest.mark.parametrize("labelled,skipped", [(0.15, True), (0.8, False)], ids=["15%-rows", "80%-rows"])
def test_the_decoder_backward_skips_rows_with_a_zero_gradient(debug_config, monkeypatch, setting, labelled, skipped):
    """`skip_zero_rows` (the MLM decoder): a row of dy that is all zero adds nothing to dx, dW or db, so
    the backward runs on the other rows when at most half are left and on every row otherwise; on
    either GEMM library every gradient equals nn.Linear's (float32, 1e-5). Without grad, or for the
    other linear layers, nothing changes."""
    if setting and mb._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    config = debug_config(onednn_linear=setting)
    torch.manual_seed(0)
    layer = mb.BertImplLinear(config, 16, 90, skip_zero_rows=True)
    ref = torch.nn.Linear(16, 90)
    ref.load_state_dict(layer.state_dict())
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
    assert gemm_rows == ([91] if setting else [])  # no grad: the forward alone (blas: nn.Linear's own op)
    gemm_rows.clear()
    mb.BertImplLinear(config, 16, 90)(x).backward(g)  # not the decoder: every row (forward, dx, dWᵀ's 90 rows)
    assert gemm_rows == ([91, 91, 90] if setting else [])


@pytest.mark.parametrize("setting", [True, False], ids=["onednn", "blas"])
def test_the_decoder_backward_skips_zero_rows_in_bfloat16(debug_config, monkeypatch, setting):
    """bf16 weights: the skipping backward's output and gradients each within 3x nn.Linear's own bf16
    error against a float32 copy (the project's bf16 rule), and the dx GEMM ran on the nonzero rows."""
    if setting and torch.bfloat16 not in mb._ONEDNN_DTYPES:
        pytest.skip("no bfloat16 oneDNN linear on this CPU / build")
    torch.manual_seed(0)
    layer = mb.BertImplLinear(debug_config(onednn_linear=setting), 64, 600, skip_zero_rows=True)
    rows = torch.rand(9, 5, generator=torch.Generator().manual_seed(5)) < 0.2  # (9, 5)
    x32, g32 = torch.randn(9, 5, 64), torch.randn(9, 5, 600) * rows.unsqueeze(-1)
    gemm_rows = _spy_gemm(monkeypatch)
    _assert_bf16_within_3x_of_nn_linear(layer, x32, g32)
    assert gemm_rows[:2] == [45, int(rows.sum())]


@pytest.mark.parametrize("setting", [True, False], ids=["onednn", "blas"])
def test_torch_func_grad_runs_through_the_written_out_backward(debug_config, batch, setting):
    """torch.func.grad (functorch) over the MLM loss gives autograd's gradients on either GEMM library:
    `_LinearFunction` keeps its context in `setup_context`, as functorch transforms require."""
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config(onednn_linear=setting)).train()
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    inputs = dict(attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    params = {name: p.detach() for name, p in model.named_parameters()}
    grads = grad(lambda p: functional_call(model, p, (input_ids,), inputs).loss)(params)
    model(input_ids, **inputs).loss.backward()
    for name, p in model.named_parameters():
        assert (grads[name] - p.grad).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("setting", [True, False], ids=["onednn", "blas"])
def test_default_config_mlm_step_matches_transformers(debug_config, batch, setting, monkeypatch):
    """The oracle for the training step with full logits (the default config): transformers'
    BertForMaskedLM with the same weights, on a padded batch with 30% of the real tokens labelled.
    The loss, the logits and every gradient within 1e-5, with the cross-entropy on the labelled rows
    only and the decoder's backward on those rows only (the others' gradient is zero)."""
    if setting and mb._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    from transformers import BertForMaskedLM

    from hf_bert_impl.convert import convert_hf_state_dict, from_hf_bert

    torch.manual_seed(0)
    hf = BertForMaskedLM(hf_config("BertForMaskedLM", attn_implementation="sdpa"))
    ours = from_hf_bert(hf, BertImplForMaskedLM)
    ours.config.onednn_linear = setting
    assert not ours.config.sparse_prediction
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    rows, ce, cross_entropy = _spy_gemm(monkeypatch), [], F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda logits, *a, **k: ce.append(logits.size(0)) or cross_entropy(logits, *a, **k))
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    got = ours(**inputs)
    got.loss.backward()
    monkeypatch.setattr(F, "cross_entropy", cross_entropy)
    want = hf(**inputs)
    want.loss.backward()
    n = int(labels.ne(-100).sum())
    assert ce == [n] and n < input_ids.numel() // 2
    assert n in rows  # the decoder's dx = dy W ran on the labelled rows
    real = attention_mask.bool()
    assert abs(got.loss.item() - want.loss.item()) <= ATOL
    assert (got.logits - want.logits)[real].abs().max().item() <= ATOL
    hf_grads, _ = convert_hf_state_dict({k: p.grad for k, p in hf.named_parameters()}, 2, tied=True)
    for name, p in ours.named_parameters():
        assert (p.grad - hf_grads[name]).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel", ""])
def test_linear_kernel_is_chosen_by_cpu_vendor_and_dtype_and_forceable(vendor, monkeypatch):
    """"auto": in float32 oneDNN on AMD (MKL's fp32 GEMM is slow there), torch's BLAS on Intel (the
    oneDNN linear loses to MKL there, most in the backward); in bfloat16 oneDNN on both (bias fused,
    where addmm copies it first); torch's BLAS on any CPU not measured and in float16; True / False
    force it, within the dtypes where oneDNN's op reproduces F.linear."""
    monkeypatch.setattr(mb, "_CPU_VENDOR", vendor)
    monkeypatch.setattr(mb, "_ONEDNN_DTYPES", (torch.float32, torch.bfloat16))  # as on a CPU with bf16 on oneDNN
    fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
    assert mb.linear_kernel("auto") == mb.linear_kernel("auto", fp32) == ("onednn" if vendor == "AuthenticAMD" else "blas")
    assert mb.linear_kernel("auto", bf16) == ("onednn" if vendor else "blas")
    assert [mb.linear_kernel(True, dt) for dt in (fp32, bf16, fp16)] == ["onednn", "onednn", "blas"]
    assert {mb.linear_kernel(False, dt) for dt in (fp32, bf16)} == {"blas"}
    assert mb.linear_kernel("auto", fp16) == "blas"
    monkeypatch.setattr(mb, "_ONEDNN_DTYPES", (torch.float32,))  # oneDNN's bf16 op does not reproduce F.linear
    assert {mb.linear_kernel(s, bf16) for s in ("auto", True)} == {"blas"}
    monkeypatch.setattr(mb, "_ONEDNN_DTYPES", ())  # a torch build without the op: always the BLAS
    assert {mb.linear_kernel(s, dt) for s in ("auto", True, False) for dt in (fp32, bf16)} == {"blas"}


def test_cpu_vendor_is_read_once_at_import(monkeypatch):
    assert mb._CPU_VENDOR == mb._cpu_vendor()
    monkeypatch.setattr("builtins.open", lambda *a, **k: pytest.fail("the CPU vendor was read again"))
    for setting in ("auto", True, False):
        mb.linear_kernel(setting)


def test_onednn_linear_setting_is_validated(debug_config):
    assert debug_config().onednn_linear == "auto"
    for bad in ("yes", 1, "onednn"):
        with pytest.raises(ValueError, match=f"onednn_linear must be 'auto', True or False, got {bad!r}"):
            debug_config(onednn_linear=bad)


@needs_onednn
def test_a_loaded_or_moved_model_takes_the_onednn_branch(debug_config, tmp_path, monkeypatch):
    """from_pretrained builds on the meta device and then loads weights; .to() moves and casts: the
    branch follows the weights as they are when called, not as they were when built."""
    calls = _spy_onednn_linear(monkeypatch)
    BertImplModel(debug_config(onednn_linear=True)).save_pretrained(tmp_path)
    model = BertImplModel.from_pretrained(tmp_path).eval()
    ids = torch.ones(1, 4, dtype=torch.long)
    with torch.no_grad():
        model(ids)
        assert len(calls) > 0
        del calls[:]
        model.to(torch.float16)(ids)
        assert calls == []
        model.to(torch.bfloat16)(ids)
        assert bool(calls) == (torch.bfloat16 in mb._ONEDNN_DTYPES)


@pytest.mark.skipif(torch.bfloat16 not in mb._ONEDNN_DTYPES, reason="no bfloat16 oneDNN linear on this CPU / build")
def test_auto_on_intel_takes_onednn_in_bfloat16_and_blas_in_float32(debug_config, batch, monkeypatch):
    """On Intel "auto" keeps torch's BLAS for float32 GEMMs and takes oneDNN for bfloat16 ones, with bf16
    weights and under bf16 autocast (float32 weights): every linear layer's call, and the outputs are
    those of the forced oneDNN branch (whose bf16 numerics the tests above check against nn.Linear)."""
    monkeypatch.setattr(mb, "_CPU_VENDOR", "GenuineIntel")
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config()).eval()
    forced = copy.deepcopy(model)
    forced.config.onednn_linear = True
    calls = _spy_onednn_linear(monkeypatch, record=lambda x: x.dtype)
    input_ids, attention_mask, token_type_ids, _ = _mlm_batch(batch)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    linear_layers = 4 * model.config.num_hidden_layers + 2  # Wqkv, Wo, Wi, Wo per layer; the head's dense and decoder
    with torch.no_grad():
        model(**inputs)
        assert calls == []
        for cast in ("autocast", "weights"):
            if cast == "weights":
                model, forced = model.bfloat16(), forced.bfloat16()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast == "autocast"):
                calls.clear()
                got = model(**inputs).logits
                assert calls == [torch.bfloat16] * linear_layers, cast
                assert torch.equal(got, forced(**inputs).logits), cast


@needs_onednn
@pytest.mark.parametrize("vendor,setting", [("AuthenticAMD", "auto"), ("GenuineIntel", "auto"), ("GenuineIntel", True),
                                            ("AuthenticAMD", False)])
def test_every_linear_kernel_branch_gives_the_same_outputs_and_gradients(debug_config, batch, vendor, setting, monkeypatch):
    """Each branch forced (CPU vendor x setting) against torch's BLAS path: logits, loss and every
    gradient within 1e-5, and the branch taken is the one `linear_kernel` names."""
    monkeypatch.setattr(mb, "_CPU_VENDOR", vendor)
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config()).train()
    blas = copy.deepcopy(model)
    model.config.onednn_linear = setting
    blas.config.onednn_linear = False
    calls = _spy_onednn_linear(monkeypatch)
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    ref = blas(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    assert calls == []
    out = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    assert bool(calls) == (mb.linear_kernel(setting) == "onednn")
    assert (out.logits - ref.logits).abs().max().item() <= ATOL
    assert abs(out.loss.item() - ref.loss.item()) <= ATOL
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), blas.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


# ---------------------------------------------------------------------------------------------
# Dropout masks on the CPU (`_dropout`: 32 random bits per element where torch draws them serially)


@pytest.fixture
def fast_dropout(monkeypatch):
    """`_dropout`'s own mask on any CPU (on Intel with MKL it defers to F.dropout)."""
    monkeypatch.setattr(mb, "_SERIAL_BERNOULLI", True)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_cpu_dropout_keeps_each_element_with_probability_1_minus_p(p, fast_dropout):
    """Bernoulli(1 - p) masks, kept values scaled by 1/(1 - p) exactly as a float32 product: over 2M elements the dropped
    fraction, and the fraction of adjacent pairs (the two halves of one 64-bit draw) both dropped, are within 5 binomial
    standard deviations of p and p²."""
    n = 2_000_000
    x = torch.randn(n)
    y = mb._dropout(x, p, True)
    dropped = y == 0
    assert abs(dropped.double().mean().item() - p) <= 5 * (p * (1 - p) / n) ** 0.5
    both = (dropped[0::2] & dropped[1::2]).double().mean().item()
    assert abs(both - p * p) <= 5 * (p * p * (1 - p * p) / (n // 2)) ** 0.5
    assert torch.equal(y[~dropped], x[~dropped] * (1 / (1 - p)))
    xb = x[:1000].bfloat16()  # bf16: the product rounded once, from float32
    yb = mb._dropout(xb, p, True)
    assert torch.equal(yb[yb != 0], (xb.float() * (1 / (1 - p))).bfloat16()[yb != 0])


def test_cpu_dropout_gradient_seed_and_identity_cases(fast_dropout):
    """The gradient is the kept mask times 1/(1 - p); torch's generator (manual_seed) decides the mask; eval, p = 0,
    and (on Intel with MKL, `_SERIAL_BERNOULLI` False) every case are F.dropout's, bit for bit."""
    x = torch.randn(4, 5, 6, requires_grad=True)
    g = torch.randn(4, 5, 6)
    torch.manual_seed(3)
    y = mb._dropout(x, 0.25, True)
    y.backward(g)
    assert torch.equal(x.grad, torch.where(y != 0, g * (1 / 0.75), 0.0))
    torch.manual_seed(3)
    assert torch.equal(mb._dropout(x, 0.25, True), y) and not torch.equal(mb._dropout(x, 0.25, True), y)
    assert mb._dropout(x, 0.25, False) is x and mb._dropout(x, 0.0, True).equal(x)
    mb._SERIAL_BERNOULLI = False  # restored by the fixture's monkeypatch
    torch.manual_seed(3)
    theirs = F.dropout(x, 0.25, True)
    torch.manual_seed(3)
    assert torch.equal(mb._dropout(x, 0.25, True), theirs)


def test_own_masks_only_in_plain_eager_cpu_training(fast_dropout, monkeypatch):
    """`_own_mask` (which decides both the mask `_dropout` draws and the attention route): training, 0 < p < 1, a plain CPU
    tensor, not while torch.compile traces (there F.dropout and SDPA, as inductor expects)."""
    x = torch.randn(3)
    assert mb._own_mask(x, 0.1, True)
    assert not any([mb._own_mask(x, 0.1, False), mb._own_mask(x, 0.0, True), mb._own_mask(x.to("meta"), 0.1, True),
                    mb._own_mask(torch.nn.Parameter(x), 0.1, True)])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not mb._own_mask(x, 0.1, True)


@pytest.mark.parametrize("serial", [True, False])
def test_training_attention_with_dropout_runs_eager_where_cpu_masks_are_serial(debug_config, batch, serial, monkeypatch):
    """Training with attention dropout on the CPU: where torch's masks are serial, attention runs the eager formula with
    `_dropout` (SDPA would run the same formula with F.dropout), and no module draws a mask with bernoulli_; on Intel with
    MKL SDPA as configured. Either way the probabilities are dropped: the same seed repeats a step, another changes it."""
    monkeypatch.setattr(mb, "_SERIAL_BERNOULLI", serial)
    impls = _spy_attention_impls(monkeypatch)
    torch.manual_seed(0)
    model = BertImplModel(debug_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)).train()
    assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {mb.BertImplDropout}
    input_ids, attention_mask, _ = batch
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        with torch.profiler.profile() as prof:
            outs.append(model(input_ids, attention_mask=attention_mask).last_hidden_state)
    assert set(impls) == {"eager" if serial else "sdpa"}
    assert any(e.key == "aten::bernoulli_" for e in prof.key_averages()) != serial
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    impls.clear()
    model.eval()(input_ids, attention_mask=attention_mask)
    assert set(impls) == {"sdpa"}


def test_eager_training_attention_drops_the_probabilities(debug_config, fast_dropout):
    """One attention block in training: its output equals softmax(QKᵀ/√d) with `_dropout`'s mask (same seed), times V,
    then W^O, to 1e-6."""
    torch.manual_seed(0)
    config = debug_config(attention_probs_dropout_prob=0.3)
    attn = mb.BertImplSelfAttention(config).train()
    x = torch.randn(1, 6, config.hidden_size)
    tokens = mb.TokenMap((1, 6), (1, 6))
    torch.manual_seed(5)
    out, _ = attn(x, tokens)
    q, k, v = attn.Wqkv(x).view(1, 6, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)  # (b, h, s, d) each
    torch.manual_seed(5)
    probs = mb._dropout(torch.softmax(q @ k.transpose(-2, -1) * attn.scaling, -1), 0.3, True)
    ref = attn.Wo((probs @ v).transpose(1, 2).reshape(1, 6, -1))
    assert (out - ref).abs().max().item() <= 1e-6
    assert (probs == 0).any()  # some probabilities were dropped: the check sees the mask


# ---------------------------------------------------------------------------------------------
# Input checks without a host sync on accelerators


def _record_device_asserts(monkeypatch):
    """Value checks as if the tensors were on an accelerator: reading a value on the host fails the
    test, and each asynchronous assert is recorded as (condition, message)."""
    asserts = []
    monkeypatch.setattr(mb, "_values_on_host", lambda t: False)
    monkeypatch.setattr(mb, "_device_assert", lambda cond, msg: asserts.append((cond, msg)))
    for name in ("item", "tolist", "__int__", "__bool__", "__index__", "unique"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read: Tensor.{_n}"))
    return asserts


@pytest.mark.parametrize("case,field", [
    (None, None), ("id_too_large", "input_ids"), ("id_negative", "input_ids"), ("token_type", "token_type_ids"),
    ("mask_value", "attention_mask"), ("position_negative", "position_ids"), ("position_too_long", "learned positions"),
])
def test_input_checks_on_accelerators_use_async_asserts(debug_config, batch, case, field, monkeypatch):
    model = BertImplModel(debug_config(position_embedding_type="learned", max_position_embeddings=16))
    input_ids, attention_mask, token_type_ids = (t.clone() for t in batch)
    position_ids = torch.arange(input_ids.size(1)).expand_as(input_ids).clone()
    if case == "id_too_large":
        input_ids[2, 3] = VOCAB
    elif case == "id_negative":
        input_ids[0, 0] = -3
    elif case == "token_type":
        token_type_ids[1, 1] = 2
    elif case == "mask_value":
        attention_mask[0, 0] = 2
    elif case == "position_negative":
        position_ids[0, 0] = -1
    elif case == "position_too_long":
        position_ids[0, -1] = 16
    asserts = _record_device_asserts(monkeypatch)
    model._check_model_inputs(input_ids, attention_mask, token_type_ids, position_ids, None)
    monkeypatch.undo()  # the recorded conditions may be read now
    assert len(asserts) == 5  # input_ids, token_type_ids, attention_mask, position_ids >= 0, < max positions
    failed = [msg for cond, msg in asserts if not bool(cond)]
    assert all(cond.dtype == torch.bool and cond.dim() == 0 for cond, _ in asserts)
    assert failed == ([] if case is None else [failed[0]]) and (case is None or field in failed[0]), failed


def test_input_checks_on_a_non_cpu_device_do_not_read_values(debug_config, monkeypatch):
    """Meta tensors (no values at all, like a device the host cannot read without a sync): the checks
    pass through as device asserts instead of calling int() / .unique()."""
    model = BertImplModel(debug_config())
    recorded = []
    monkeypatch.setattr(mb, "_device_assert", lambda cond, msg: recorded.append(cond.device.type))
    ids = torch.ones(2, 5, dtype=torch.long, device="meta")
    model._check_model_inputs(ids, torch.ones(2, 5, dtype=torch.long, device="meta"), ids, None, None)
    assert recorded == ["meta", "meta", "meta"]


class _HostReads(TorchDispatchMode):
    """Records every op of a forward that makes the host wait for an accelerator: reading a value
    (int(), bool(), .item() -> _local_scalar_dense; .tolist(), counted by `count_host_reads`) and ops
    whose output size depends on the values (nonzero, unique, masked_select, repeat_interleave without
    output_size). nonzero_static and repeat_interleave with output_size are not syncs."""

    SIZE_FROM_VALUES = ("aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                        "aten.unique_dim.default", "aten.unique_consecutive.default")

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if (name == "aten._local_scalar_dense.default" or name in self.SIZE_FROM_VALUES
                or name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None):
            self.reads.append(name)
        return func(*args, **kwargs)


def _count_host_reads(model, monkeypatch, **inputs) -> list[str]:
    """The host reads of one forward of `model`, ours taking its accelerator branch (no value read by
    the input checks: `_values_on_host` is False, the device asserts are recorded, not run)."""
    monkeypatch.setattr(mb, "_values_on_host", lambda t: False)
    monkeypatch.setattr(mb, "_device_assert", lambda cond, msg: None)
    mode = _HostReads()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: mode.reads.append("Tensor.tolist") or tolist(t))
    with torch.no_grad(), mode:
        model(**inputs)
    monkeypatch.undo()
    return mode.reads


@pytest.mark.parametrize("position_type", ["sinusoidal", "learned"])
@pytest.mark.parametrize("unpad", [True, False])
def test_a_forward_waits_for_the_device_no_more_often_than_transformers(debug_config, batch, position_type, unpad, monkeypatch):
    """Host syncs per forward on an accelerator, counted op by op: without a mask none (transformers:
    none), with a mask one (transformers: one, its all-ones check), whatever the padding and however
    many layers: the mask is read on the host once, every size of the unpadded layout follows from it."""
    from transformers import BertConfig, BertModel

    input_ids, attention_mask, token_type_ids = batch
    masks = {"no mask": None, "all ones": torch.ones_like(attention_mask), "padded": attention_mask}
    counts = {}
    for layers in (1, 3):
        ours = BertImplModel(debug_config(num_hidden_layers=layers, position_embedding_type=position_type, unpad_inputs=unpad)).eval()
        c = ours.config
        hf = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=c.hidden_size, num_hidden_layers=layers, intermediate_size=c.intermediate_size,
                                  num_attention_heads=c.num_attention_heads, attn_implementation="sdpa")).eval()
        for name, mask in masks.items():
            inputs = dict(input_ids=input_ids, token_type_ids=token_type_ids, **({} if mask is None else {"attention_mask": mask}))
            counts[layers, name] = (_count_host_reads(ours, monkeypatch, **inputs), _count_host_reads(hf, monkeypatch, **inputs))
    for (layers, name), (got, theirs) in counts.items():
        assert len(got) <= len(theirs), (layers, name, got, theirs)
        assert len(got) == (0 if name == "no mask" else 1), (layers, name, got)
        assert got == counts[1, name][0]  # none per layer
    assert counts[1, "padded"][0] == ["Tensor.tolist"]


def test_sinusoidal_positions_without_reading_them_come_from_the_formula(debug_config, monkeypatch):
    """Where reading the largest position id would be a host sync (an accelerator), the encoding is
    computed at each given position on the device instead of looked up: the same rows as the stored
    table (float32, 1e-6), past its end too; positions the model builds itself (0 .. s-1) are looked up."""
    model = BertImplModel(debug_config(max_position_embeddings=16)).eval()
    H = model.config.hidden_size
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    position_ids = torch.stack([torch.arange(12), torch.arange(15, 3, -1)])  # (2, 12), all inside the 16 rows
    calls = []
    formula = mb._sinusoid
    monkeypatch.setattr(mb, "_sinusoid", lambda pos, dim: calls.append(tuple(pos.shape)) or formula(pos, dim))
    with torch.no_grad():
        looked_up = model.embeddings(ids, position_ids=position_ids)
        assert calls == []
        monkeypatch.setattr(mb, "_values_on_host", lambda t: False)
        computed = model.embeddings(ids, position_ids=position_ids)
        assert calls == [(2, 12)]
        model.embeddings(ids)  # built positions: known to fit, no formula
        assert calls == [(2, 12)]
    assert (computed - looked_up).abs().max().item() <= 1e-6
    far = torch.tensor([[0, 15, 16, 100, 511]])
    assert (formula(far, H) - mb.sinusoidal_position_encoding(512, H)[far]).abs().max().item() <= 1e-6


# ---------------------------------------------------------------------------------------------
# Unpadding on padded batches


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_unpadded_forward_matches_padded_path(debug_config, batch, backend, monkeypatch, attention_layout):
    torch.manual_seed(0)
    model = BertImplModel(debug_config(attn_implementation=backend)).eval()
    plain = _plain(model)
    input_ids, attention_mask, token_type_ids = batch
    calls = _spy_unpadding(monkeypatch, attention_layout)
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, output_hidden_states=True)
        assert len(calls) == 1 and calls[0].indices.numel() == int(attention_mask.sum())
        want = plain(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, output_hidden_states=True)
    assert len(calls) == 1  # the plain model did not unpad
    assert _max_diff_real(got.last_hidden_state, want.last_hidden_state, attention_mask) <= ATOL
    assert (got.pooler_output - want.pooler_output).abs().max().item() <= ATOL
    assert len(got.hidden_states) == len(want.hidden_states) == model.config.num_hidden_layers + 1
    for g, w in zip(got.hidden_states, want.hidden_states):
        assert _max_diff_real(g, w, attention_mask) <= ATOL
        assert g[~attention_mask.bool()].abs().max().item() == 0.0  # padding positions hold zeros
    assert torch.equal(got.hidden_states[-1], got.last_hidden_state)


def test_unpadded_gradients_match_padded_path(debug_config, batch, attention_layout, monkeypatch):
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config()).train()
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


def test_unpadding_with_gradient_checkpointing(debug_config, batch):
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config()).train()
    plain = _plain(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids, attention_mask, _ = batch
    labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
    for m in (model, plain):
        m(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


@pytest.mark.parametrize("pattern", ["left", "holes", "one_row_fully_padded"])
def test_unpadding_any_padding_pattern(debug_config, batch, pattern, monkeypatch, attention_layout):
    torch.manual_seed(0)
    model = BertImplModel(debug_config()).eval()
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


def test_unpadded_path_matches_transformers_bert(debug_config, batch, attention_layout, monkeypatch):
    """The oracle: transformers' BertModel (sdpa) with the same weights, on a padded batch."""
    from transformers import BertModel

    from hf_bert_impl.convert import from_hf_bert

    torch.manual_seed(0)
    hf = BertModel(hf_config(attn_implementation="sdpa")).eval()
    ours = from_hf_bert(hf, BertImplModel).eval()
    assert getattr(ours.config, "unpad_inputs", True)
    input_ids, attention_mask, token_type_ids = batch
    calls = _spy_unpadding(monkeypatch, attention_layout)
    with torch.no_grad():
        got = ours(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        want = hf(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert len(calls) == 1
    assert _max_diff_real(got.last_hidden_state, want.last_hidden_state, attention_mask) <= ATOL
    assert (got.pooler_output - want.pooler_output).abs().max().item() <= ATOL


def test_unpadding_switched_off_and_skipped_for_attentions(debug_config, batch, monkeypatch):
    model = BertImplModel(debug_config()).eval()
    input_ids, attention_mask, _ = batch
    calls = _spy_unpadding(monkeypatch)
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True)
        _plain(model)(input_ids, attention_mask=attention_mask)
        model(input_ids)  # no padding: nothing to unpad
    assert calls == []
    assert out.attentions[0].shape == (13, 4, 7, 7)


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
    model = BertImplModel(debug_config(attn_implementation=backend)).eval()
    lengths = [5, 7, 3, 6]
    feats = _packed_features(lengths)
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(feats)
    assert packed["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in packed
    inputs = {k: v for k, v in packed.items() if k != "labels"}
    calls = _spy_unpadding(monkeypatch, attention_layout)
    with torch.no_grad():
        got = model(**inputs).last_hidden_state[0]  # (T, H)
        assert len(calls) == 1 and calls[0].cu_seqlens.diff().tolist() == lengths and calls[0].max_seqlen == 7
        start = 0
        for n, f in zip(lengths, feats):
            alone = model(torch.tensor([f["input_ids"]])).last_hidden_state[0]
            assert (got[start : start + n] - alone).abs().max().item() <= ATOL, (n, start)
            start += n
        # The plain path (unpadding off) keeps sequences apart with a block-diagonal mask instead.
        plain = _plain(model)(**inputs).last_hidden_state[0]
    assert (plain - got).abs().max().item() <= ATOL


def test_packed_attention_probabilities_never_cross_sequences(debug_config):
    model = BertImplModel(debug_config(attn_implementation="eager")).eval()
    packed = DataCollatorWithFlattening()(_packed_features([4, 3]))
    with torch.no_grad():
        out = model(packed["input_ids"], position_ids=packed["position_ids"], output_attentions=True)
    for probs in out.attentions:  # (1, h, 7, 7)
        assert probs[..., :4, 4:].abs().max().item() == 0.0 and probs[..., 4:, :4].abs().max().item() == 0.0
        torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4, 7), atol=ATOL, rtol=0)


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(debug_config, attention_layout, monkeypatch):
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config()).train()
    twin = copy.deepcopy(model)
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
    assert len(calls) == 2
    assert abs(loss_packed.item() - loss_padded.item()) <= ATOL
    loss_packed.backward()
    loss_padded.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


def test_trainer_trains_padding_free(debug_config, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config())
    feats = _packed_features([5, 7, 3, 6, 4, 7, 2, 5], seed=2)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
    )
    before = model.bert.layers[0].attn.Wqkv.weight.detach().clone()
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(feats),
                      data_collator=DataCollatorWithFlattening())
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.bert.layers[0].attn.Wqkv.weight)


# A flash-attention stand-in that takes exactly what flash_attn_varlen_func takes (tokens + cu_seqlens)
# and attends within each sequence; it checks the varlen plumbing on a machine without flash-attn.
def _varlen_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    assert attention_mask is None and query.size(0) == 1, "varlen takes tokens, not a padded batch"
    assert torch.equal(cu_seq_lens_q, cu_seq_lens_k) and cu_seq_lens_q.dtype == torch.int32
    assert max_length_q == max_length_k == int(cu_seq_lens_q.diff().max())
    out = torch.zeros_like(query)  # (1, h, T, d)
    for a, b in zip(cu_seq_lens_q[:-1].tolist(), cu_seq_lens_q[1:].tolist()):
        if b > a:
            out[:, :, a:b] = F.scaled_dot_product_attention(
                query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scaling
            )
    return out.transpose(1, 2), None  # (1, T, h, d)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_flash_style_varlen_route(debug_config, batch, layout):
    AttentionInterface.register("flash_varlen_reference", _varlen_reference)
    torch.manual_seed(0)
    model = BertImplModel(debug_config()).eval()
    varlen = copy.deepcopy(model)
    varlen.config._attn_implementation = "flash_varlen_reference"
    assert mb._is_flash(varlen.config._attn_implementation)
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
            want = model(**inputs).last_hidden_state
            assert (got - want).abs().max().item() <= ATOL


def test_packed_kwargs_that_do_not_fit_raise(debug_config):
    model = BertImplModel(debug_config()).eval()
    ids = torch.randint(1, VOCAB, (1, 9))
    with pytest.raises(ValueError, match=r"cu_seq_lens_q \[0, 4, 8\] must run from 0 to the packed length 9"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 4, 8], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# Sparse MLM prediction


def _mlm_batch(batch):
    input_ids, attention_mask, token_type_ids = batch
    g = torch.Generator().manual_seed(7)
    chosen = (torch.rand(input_ids.shape, generator=g) < 0.3) & attention_mask.bool()
    chosen[0, 0] = True
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    return input_ids, attention_mask, token_type_ids, labels


@pytest.mark.parametrize("num_items_in_batch", [None, 50])
def test_sparse_prediction_matches_dense(debug_config, batch, num_items_in_batch):
    torch.manual_seed(0)
    dense = BertImplForMaskedLM(debug_config()).train()
    sparse = copy.deepcopy(dense)
    sparse.config.sparse_prediction = True
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
    config = debug_config(sparse_prediction=True)
    model = BertImplForMaskedLM(config).eval()
    input_ids, attention_mask, _ = batch
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask)
    assert out.logits.shape == (13, 7, VOCAB) and out.loss is None


def test_sparse_prediction_pretraining_head(debug_config, batch):
    torch.manual_seed(0)
    dense = BertImplForPreTraining(debug_config()).eval()
    sparse = copy.deepcopy(dense)
    sparse.config.sparse_prediction = True
    input_ids, attention_mask, token_type_ids, labels = _mlm_batch(batch)
    nsp = torch.randint(0, 2, (13,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        d = dense(input_ids, attention_mask=attention_mask, labels=labels, next_sentence_label=nsp)
        s = sparse(input_ids, attention_mask=attention_mask, labels=labels, next_sentence_label=nsp)
    keep = labels.ne(-100)
    assert s.prediction_logits.shape == (int(keep.sum()), VOCAB)
    assert (s.prediction_logits - d.prediction_logits[keep]).abs().max().item() <= ATOL
    assert abs(s.loss.item() - d.loss.item()) <= ATOL
    assert torch.equal(s.seq_relationship_logits, d.seq_relationship_logits)


@pytest.mark.parametrize("sparse", [False, True])
def test_mlm_labels_of_the_wrong_shape_raise(debug_config, batch, sparse):
    model = BertImplForMaskedLM(debug_config(sparse_prediction=sparse))
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


def test_compile_fullgraph_fixed_shape_matches_eager(debug_config, batch, fresh_dynamo):
    """fullgraph=True turns any graph break into an error; the eager backend keeps the test fast (the
    graph capture, where breaks happen, is the same for every backend)."""
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config()).eval()
    input_ids, attention_mask, token_type_ids = batch
    labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
        want = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
    assert _max_diff_real(got.logits, want.logits, attention_mask) <= ATOL
    assert abs(got.loss.item() - want.loss.item()) <= ATOL
    assert fresh_dynamo["stats"]["unique_graphs"] == 1
    assert not fresh_dynamo["graph_break"]


def test_compile_fullgraph_training_step(debug_config, batch, fresh_dynamo):
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config()).train()
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
    model = BertImplModel(debug_config()).eval()
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


# ---------------------------------------------------------------------------------------------
# scripts/benchmark.py


@functools.cache
def _benchmark_module():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("benchmark_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return module


def _tiny_benchmark(tmp_path, *argv) -> dict:
    """scripts/benchmark.py on the tiny size, one timed pair, plus `argv`; its JSON result."""
    import json

    out = tmp_path / "bench.json"
    _benchmark_module().main(["--size", "tiny", "--seq_len", "16", "--batch_size", "2", "--pairs", "1", "--warmup", "0",
                              *argv, "--json", str(out)])
    return json.loads(out.read_text())


def test_benchmark_script_checks_outputs_and_writes_json(tmp_path):
    """One timed pair of the tiny size: the output checks ran and passed, and every reported number is there."""
    result = _tiny_benchmark(tmp_path, "--workloads", "fixed,mixed", "--memory", "false")
    checks = result["backends"]["sdpa"]["checks"]
    assert {"fixed_max_abs_diff", "mixed_max_abs_diff", "mlm_loss_abs_diff", "mlm_grad_max_abs_diff"} <= set(checks)
    assert all(v <= 1e-5 for v in checks.values()), checks
    rows = result["backends"]["sdpa"]["workloads"]
    assert set(rows) == {"fixed", "mixed"}
    assert rows["mixed"]["real_token_fraction"] < 1.0 and rows["fixed"]["real_token_fraction"] == 1.0
    for row in rows.values():
        assert row["ratio_median"] > 0 and row["ours"]["tokens_per_s_real"] > 0 and 0 < row["ours"]["mfu"]
    assert result["matmul_peak_flops"]["best"] > 0 and "| sdpa | mixed |" in result["markdown_table"]


def test_benchmark_dense_mlm_step_checks_full_logits(tmp_path):
    """The default-config MLM step (sparse_prediction off): full (b, s, V) logits checked against
    transformers before timing, and timed as its own row."""
    result = _tiny_benchmark(tmp_path, "--workloads", "mlm_dense", "--memory", "false")
    checks = result["backends"]["sdpa"]["checks"]
    assert checks["mlm_dense_logits_max_abs_diff"] <= 1e-5 and checks["mlm_dense_loss_abs_diff"] <= 1e-5
    row = result["backends"]["sdpa"]["workloads"]["mlm_dense"]
    assert row["ratio_median"] > 0 and len(row["load_average_after"]) == 3
    assert "| sdpa | mlm_dense |" in result["markdown_table"]


def test_benchmark_under_bf16_autocast(tmp_path):
    """--dtype autocast: float32 weights, every forward under bf16 autocast; the outputs are checked
    against float32 first (ours within 3x transformers' own bf16 error, which must be non-zero: bf16
    ran), MFU is against the bf16 matmul peak and the bf16 targets apply."""
    result = _tiny_benchmark(tmp_path, "--dtype", "autocast", "--workloads", "fixed,mixed,mlm_dense", "--memory", "false")
    checks = result["backends"]["sdpa"]["checks"]
    for name in ("fixed", "mixed"):
        assert 0 < checks[f"{name}_hf_bf16_err"] and checks[f"{name}_ours_bf16_err"] <= 3 * checks[f"{name}_hf_bf16_err"], checks
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


@pytest.mark.parametrize("masks,route", [("torch", "sdpa"), ("bits", "eager")])
def test_benchmark_dropout_masks_choose_ours_training_dropout(tmp_path, monkeypatch, masks, route):
    """--dropout_masks torch: ours trains with F.dropout and SDPA (as before 0.3.5); bits: the 32-bit masks and eager
    attention, on any CPU. Seen in the attention route of ours' timed training steps (BertConfig's dropout 0.1)."""
    monkeypatch.setattr(mb, "_SERIAL_BERNOULLI", mb._SERIAL_BERNOULLI)  # the script sets it for its process; restored here
    impls = _spy_attention_impls(monkeypatch)
    result = _tiny_benchmark(tmp_path, "--dropout_masks", masks, "--workloads", "mlm", "--memory", "false")
    assert result["args"]["dropout_masks"] == masks and mb._SERIAL_BERNOULLI == (masks == "bits")
    assert ("eager" in impls) == (route == "eager")  # the output checks (eval) run sdpa either way


def test_benchmark_mlm_step_uses_the_optimizer_trainer_builds(tmp_path, monkeypatch):
    """The MLM steps step the optimizer Trainer builds for --optim: by default Trainer's own (fused AdamW), the same for both
    models; --optim adamw_torch gives torch's per-parameter AdamW, which the runs before 0.3.6 timed."""
    from transformers import TrainingArguments

    bench = _benchmark_module()
    made, make = [], bench.make_optimizer
    monkeypatch.setattr(bench, "make_optimizer", lambda *a: made.append(make(*a)) or made[-1])
    assert bench.optimizer_args(bench.BenchmarkArguments()).optim == TrainingArguments(str(tmp_path)).optim  # Trainer's default
    _tiny_benchmark(tmp_path, "--workloads", "mlm", "--memory", "false")
    assert len(made) == 2 and all(type(o) is torch.optim.AdamW and o.defaults["fused"] for o in made)
    assert [o.defaults["weight_decay"] for o in made] == [0.0, 0.0]  # TrainingArguments' default, as Trainer's groups
    result = _tiny_benchmark(tmp_path, "--workloads", "mlm", "--memory", "false", "--optim", "adamw_torch")
    assert result["args"]["optim"] == "adamw_torch" and len(made) == 4 and not any(o.defaults["fused"] for o in made[2:])


def test_benchmark_against_onnxruntime(tmp_path):
    """transformers' BERT and ours exported to ONNX, checked (<= 1e-4) and timed against ours."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    result = _tiny_benchmark(tmp_path, "--against", "onnxruntime")
    res = result["backends"]["onnxruntime"]
    assert len(res["checks"]) == 8 and all(v <= 1e-4 for v in res["checks"].values()), res["checks"]
    assert set(res["workloads"]) == {"fixed", "mixed"}
    for row in res["workloads"].values():
        assert row["ratio_median"] > 0 and row["ours_onnx_ratio_median"] > 0
        assert row["onnxruntime_transformers"]["tokens_per_s_real"] > 0
    assert "| mixed |" in result["markdown_table"]


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
    (["--onednn_linear", "maybe"], "--onednn_linear must be auto, true or false, got 'maybe'"),
    (["--against", "tensorrt"], "--against must be transformers or onnxruntime, got 'tensorrt'"),
    (["--against", "onnxruntime", "--dtype", "bf16"], "--against onnxruntime runs on the CPU in fp32"),
    (["--autocast_scope", "always"], "--autocast_scope must be forward or run, got 'always'"),
    (["--autocast_scope", "run"], "--autocast_scope run needs --dtype autocast, got --dtype fp32"),
    (["--dropout_masks", "cuda"], "--dropout_masks must be auto, torch or bits, got 'cuda'"),
    (["--optim", "adamw_fast"], "--optim 'adamw_fast': adamw_fast is not a valid OptimizerNames"),
])
def test_benchmark_rejects_bad_arguments(argv, message, capsys):
    bench = _benchmark_module()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
