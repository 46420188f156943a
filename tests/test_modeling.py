"""The encoder and its heads as Hugging Face models: shapes, losses, backward, backends, padding,
gradient checkpointing, weight tying, save/load, and every documented bad input."""

import copy

import pytest
import torch

import hf_bert_impl
from hf_bert_impl import (
    BertImplConfig,
    BertImplForMaskedLM,
    BertImplForMultipleChoice,
    BertImplForNextSentencePrediction,
    BertImplForPreTraining,
    BertImplForQuestionAnswering,
    BertImplForSequenceClassification,
    BertImplForTokenClassification,
    BertImplModel,
)


ATOL = 1e-5  # float32, unit-scale activations (docs/formulas.md, tolerances)


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"intermediate_size": 2.5}, "intermediate_size"),
        ({"hidden_dropout_prob": 1.0}, "hidden_dropout_prob"),
        ({"attention_probs_dropout_prob": -0.1}, "attention_probs_dropout_prob"),
        ({"classifier_dropout": 1.5}, "classifier_dropout"),
        ({"position_embedding_type": "absolute"}, "position_embedding_type"),
        ({"position_embedding_type": "rotary"}, "position_embedding_type"),
        ({"hidden_act": "gelu_fancy"}, "hidden_act"),
        ({"layer_norm_eps": 0}, "layer_norm_eps"),
        ({"pad_token_id": -1}, "pad_token_id"),
        ({"scale_word_embeddings": 1}, "scale_word_embeddings"),
        ({"sparse_prediction": "yes"}, "sparse_prediction"),
        ({"sparse_prediction": None}, "sparse_prediction"),
    ],
)
def test_invalid_config_names_field_and_value(overrides, field):
    kw = {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 37,
        "vocab_size": 99,
    }
    kw.update(overrides)
    with pytest.raises(ValueError, match=rf"BertImplConfig\.{field} must be") as info:
        BertImplConfig(**kw)
    value = overrides[field]
    assert f"got {value!r}" in str(info.value), str(info.value)


@pytest.mark.parametrize("cls", [BertImplModel, BertImplForMaskedLM, BertImplForSequenceClassification])
def test_coupled_checks_run_when_the_model_is_built(cls):
    """As in transformers' BERT: a hidden size the head count does not divide, or a pad id outside the vocabulary, is
    a valid config (transformers' ConfigTester builds BertConfig(hidden_size=37) with 12 heads) and an error naming
    both values when a model is built from it."""
    small = {"num_hidden_layers": 1, "intermediate_size": 37, "vocab_size": 99}
    indivisible = BertImplConfig(hidden_size=30, num_attention_heads=4, **small)
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"):
        cls(indivisible)
    outside = BertImplConfig(hidden_size=32, num_attention_heads=4, pad_token_id=500, **small)
    with pytest.raises(ValueError, match=r"pad_token_id must be None or in \[0, config.vocab_size=99\), got 500"):
        cls(outside)
    assert BertImplConfig(hidden_size=32).num_attention_heads == 12  # constructs; the model would refuse it
    fits = BertImplConfig(hidden_size=36, num_attention_heads=12, pad_token_id=98, **small)
    assert cls(fits).config.hidden_size == 36


@pytest.mark.parametrize("config_class", [BertImplConfig, "BertConfig"])
def test_config_passes_the_config_tester_checks(config_class, tmp_path):
    """What transformers' ConfigTester checks (its BERT test uses hidden_size=37 with the default 12 heads), with
    transformers' BertConfig as the control."""
    import json

    from transformers import BertConfig

    config_class = BertConfig if config_class == "BertConfig" else config_class
    inputs = {"hidden_size": 37}
    config = config_class(**inputs)
    for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers"):
        assert hasattr(config, name)
        setattr(config, name, 5)  # settable, as ConfigTester's common properties must be
        assert getattr(config, name) == 5
    config = config_class(**inputs)
    assert json.loads(config.to_json_string())["hidden_size"] == 37
    config.to_json_file(tmp_path / "config.json")
    assert config_class.from_json_file(tmp_path / "config.json").to_dict() == config.to_dict()
    config.save_pretrained(tmp_path / "saved")
    assert config_class.from_pretrained(tmp_path / "saved").to_dict() == config.to_dict()
    config.num_labels = 5
    assert len(config.id2label) == 5 and len(config.label2id) == 5
    assert config_class().hidden_size == 768  # can be built without arguments
    common = {
        "return_dict": False,
        "output_hidden_states": True,
        "output_attentions": True,
        "problem_type": "regression",
        "id2label": {0: "a", 1: "b", 2: "c"},
        "tie_word_embeddings": False,
    }
    built = config_class(**inputs, **common)
    assert all(getattr(built, k) == v for k, v in common.items()), {k: getattr(built, k) for k in common}


def test_old_config_with_retired_speed_fields_loads_without_them(debug_config, tmp_path):
    """0.3-0.5 saved speed switches in config.json (`kernels`, `unpad_inputs`, `onednn_linear`). Such a file loads;
    the fields are dropped (the speed layer is `hf_bert_impl.kernelize`), so the loaded model is the plain one and a
    new save does not carry them. (`sparse_prediction`, a retired switch too until 0.6, is a model option again: see
    the sparse prediction tests below.)"""
    import json

    BertImplForMaskedLM(debug_config()).save_pretrained(tmp_path / "old")
    saved = json.loads((tmp_path / "old" / "config.json").read_text())
    retired = {"kernels": "onednn_linear,bits_dropout", "unpad_inputs": True, "onednn_linear": True}
    (tmp_path / "old" / "config.json").write_text(json.dumps({**saved, **retired}))
    config = BertImplConfig.from_pretrained(tmp_path / "old")
    model = BertImplForMaskedLM.from_pretrained(tmp_path / "old").eval()
    for loaded in (config, model.config):
        assert not any(hasattr(loaded, name) for name in retired), [n for n in retired if hasattr(loaded, n)]
        assert loaded.sparse_prediction is False
    assert hf_bert_impl.kernelized(model) == {}
    ids = torch.randint(5, 99, (2, 7))
    assert model(ids, labels=ids).logits.shape == (2, 7, 99)
    model.save_pretrained(tmp_path / "new")
    assert not set(retired) & set(json.loads((tmp_path / "new" / "config.json").read_text()))


def test_config_defaults_are_bert_base():
    c = BertImplConfig()
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (
        30522,
        768,
        12,
        12,
        3072,
    )
    assert (c.max_position_embeddings, c.type_vocab_size, c.layer_norm_eps, c.hidden_act) == (512, 2, 1e-12, "gelu")
    assert c.position_embedding_type == "sinusoidal" and c.model_type == "bert_impl"
    with pytest.raises(ValueError, match="unknown size preset 'huge'"):
        BertImplConfig.from_preset("huge")


# ---------------------------------------------------------------------------------------------
# Every head: shapes, loss, backward


def _head_cases(config, input_ids, attention_mask, token_type_ids):
    b, s = input_ids.shape
    mlm_labels = torch.where(torch.rand(b, s) < 0.3, input_ids, torch.full_like(input_ids, -100))
    mlm_labels[0, 0] = input_ids[0, 0]
    common = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    mc = lambda t: t.unsqueeze(1).expand(-1, 3, -1).contiguous()  # noqa: E731  (b, s) -> (b, 3, s)
    return [
        (
            BertImplModel,
            common,
            {"last_hidden_state": (b, s, config.hidden_size), "pooler_output": (b, config.hidden_size)},
        ),
        (BertImplForMaskedLM, {**common, "labels": mlm_labels}, {"logits": (b, s, config.vocab_size)}),
        (
            BertImplForPreTraining,
            {**common, "labels": mlm_labels, "next_sentence_label": torch.randint(0, 2, (b,))},
            {"prediction_logits": (b, s, config.vocab_size), "seq_relationship_logits": (b, 2)},
        ),
        (BertImplForNextSentencePrediction, {**common, "labels": torch.randint(0, 2, (b,))}, {"logits": (b, 2)}),
        (BertImplForSequenceClassification, {**common, "labels": torch.randint(0, 2, (b,))}, {"logits": (b, 2)}),
        (BertImplForTokenClassification, {**common, "labels": torch.randint(0, 2, (b, s))}, {"logits": (b, s, 2)}),
        (
            BertImplForQuestionAnswering,
            {**common, "start_positions": torch.randint(0, s, (b,)), "end_positions": torch.randint(0, s, (b,))},
            {"start_logits": (b, s), "end_logits": (b, s)},
        ),
        (
            BertImplForMultipleChoice,
            {
                "input_ids": mc(input_ids),
                "attention_mask": mc(attention_mask),
                "token_type_ids": mc(token_type_ids),
                "labels": torch.randint(0, 3, (b,)),
            },
            {"logits": (b, 3)},
        ),
    ]


@pytest.mark.parametrize("position_embedding_type", ["sinusoidal", "learned"])
def test_every_head_shapes_loss_backward(debug_config, batch, position_embedding_type):
    config = debug_config(position_embedding_type=position_embedding_type)
    torch.manual_seed(0)
    for cls, inputs, shapes in _head_cases(config, *batch):
        model = cls(config).train()
        out = model(**inputs)
        for name, shape in shapes.items():
            assert tuple(out[name].shape) == shape, (cls.__name__, name)
        if cls is BertImplModel:
            (out.last_hidden_state.sum() + out.pooler_output.sum()).backward()
        else:
            assert out.loss is not None and out.loss.ndim == 0 and torch.isfinite(out.loss), cls.__name__
            out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), cls.__name__
        assert any(g.abs().sum() > 0 for g in grads)
        # return_dict=False gives the same values as a tuple
        model.eval()
        first = model(**inputs)
        as_tuple = model(**inputs, return_dict=False)
        assert isinstance(as_tuple, tuple)
        key = next(iter(shapes))
        assert torch.equal(as_tuple[list(first.keys()).index(key)], first[key])


@pytest.mark.parametrize(
    "num_labels,labels,problem_type,loss_name",
    [
        (1, torch.randn(13), "regression", "mse"),
        (3, torch.randint(0, 3, (13,)), "single_label_classification", "ce"),
        (3, torch.randint(0, 2, (13, 3)).float(), "multi_label_classification", "bce"),
    ],
)
def test_sequence_classification_problem_types(debug_config, batch, num_labels, labels, problem_type, loss_name):
    model = BertImplForSequenceClassification(debug_config(num_labels=num_labels)).eval()
    input_ids, attention_mask, _ = batch
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert model.config.problem_type == problem_type
    logits = out.logits
    want = {
        "mse": lambda: torch.nn.functional.mse_loss(logits.squeeze(), labels),
        "ce": lambda: torch.nn.functional.cross_entropy(logits, labels),
        "bce": lambda: torch.nn.functional.binary_cross_entropy_with_logits(logits, labels),
    }[loss_name]()
    assert abs(out.loss.item() - want.item()) <= 1e-6


@pytest.mark.parametrize(
    "num_labels,problem_type", [(2, "single_label_classification"), (1, "regression"), (1, None), (3, None)]
)
def test_integer_labels_reach_the_loss_as_transformers_passes_them(debug_config, batch, num_labels, problem_type):
    """Integer labels are cast to float only for regression and multi-label problems (transformers' contract): with
    problem_type="single_label_classification" and one label they stay integer (0.3.6 cast them, and cross-entropy
    raised "expected target dtype Long"); the outcome equals transformers' BertForSequenceClassification's."""
    from hf_bert_impl.convert import to_hf_bert

    torch.manual_seed(0)
    model = BertImplForSequenceClassification(debug_config(num_labels=num_labels, problem_type=problem_type)).eval()
    hf = to_hf_bert(model)
    input_ids, attention_mask, _ = batch
    labels = torch.randint(0, num_labels, (13,))

    def outcome(m):  # the loss, or the error transformers' loss raises (5.x refuses one-label single-label)
        try:
            with torch.no_grad():
                return round(m(input_ids, attention_mask=attention_mask, labels=labels).loss.item(), 6)
        except ValueError as e:
            return str(e)

    got, want = outcome(model), outcome(hf)
    assert got == want and "dtype" not in str(got), (got, want)


# ---------------------------------------------------------------------------------------------
# Attention backends, masks and padding


def _backends():
    names = ["eager", "sdpa"]
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        names.append("flex_attention")
    except ImportError:
        pass
    return names


def _with_backend(model, name):
    m = copy.deepcopy(model)
    m.set_attn_implementation(name)
    return m


@pytest.mark.parametrize("backend", [b for b in _backends() if b != "eager"])
def test_backends_agree_with_eager_on_padded_batch(debug_config, batch, backend):
    torch.manual_seed(0)
    base = BertImplModel(debug_config()).eval()
    input_ids, attention_mask, token_type_ids = batch
    ref = _with_backend(base, "eager")
    try:
        other = _with_backend(base, backend)
        with torch.no_grad():
            got = other(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
    except Exception as e:  # flex attention needs a compiler toolchain on CPU in some torch builds
        if backend == "flex_attention":
            pytest.skip(f"flex_attention unavailable on this machine: {type(e).__name__}: {str(e)[:120]}")
        raise
    with torch.no_grad():
        want = ref(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
    real = attention_mask.bool()
    assert (got - want)[real].abs().max().item() <= ATOL


def test_flash_attention_2_agrees_with_eager_where_available(debug_config, batch):
    if not torch.cuda.is_available():
        pytest.skip("flash_attention_2 needs a CUDA GPU; this machine has none")
    pytest.importorskip("flash_attn")
    base = BertImplModel(debug_config()).eval().cuda().half()
    input_ids, attention_mask, token_type_ids = (t.cuda() for t in batch)
    with torch.no_grad():
        want = _with_backend(base, "eager")(input_ids, attention_mask=attention_mask).last_hidden_state
        got = _with_backend(base, "flash_attention_2")(input_ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    assert (got - want)[real].abs().max().item() <= 1e-2  # fp16


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_padding_invariance(debug_config, batch, backend):
    """A sequence's outputs do not depend on how long the other sequences in its batch are."""
    torch.manual_seed(0)
    model = _with_backend(BertImplModel(debug_config()).eval(), backend)
    input_ids, attention_mask, token_type_ids = batch
    with torch.no_grad():
        padded = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        for i in range(4):
            n = int(attention_mask[i].sum())
            alone = model(input_ids[i : i + 1, :n], token_type_ids=token_type_ids[i : i + 1, :n])
            diff = (padded.last_hidden_state[i, :n] - alone.last_hidden_state[0]).abs().max().item()
            assert diff <= ATOL, (i, n, diff)
            assert (padded.pooler_output[i] - alone.pooler_output[0]).abs().max().item() <= ATOL


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_padded_row_is_finite(debug_config, batch, backend, dtype):
    model = _with_backend(BertImplForMaskedLM(debug_config()).eval(), backend).to(dtype)
    input_ids, attention_mask, _ = batch
    attention_mask = attention_mask.clone()
    attention_mask[2] = 0
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(a).all() for a in out.attentions)


@pytest.mark.parametrize("backend", _backends())
def test_output_attentions_are_real_probabilities_under_every_backend(debug_config, batch, backend):
    """Our attention probabilities against an independent implementation: transformers' own BertModel
    (eager) holding the same weights (hf_bert_impl.convert.to_hf_bert), on a padded batch."""
    from hf_bert_impl.convert import to_hf_bert

    torch.manual_seed(0)
    base = BertImplModel(debug_config()).eval()
    with torch.no_grad():  # non-trivial biases, so a swapped Q/K/V split or a missing bias shows
        for layer in base.layers:
            layer.attn.Wqkv.bias.normal_(std=0.5)
    hf = to_hf_bert(base)
    hf.set_attn_implementation("eager")
    input_ids, attention_mask, token_type_ids = batch
    kwargs = {"attention_mask": attention_mask, "token_type_ids": token_type_ids, "output_attentions": True}
    with torch.no_grad():
        got = _with_backend(base, backend)(input_ids, **kwargs)
        want = hf(input_ids, **kwargs)
    assert len(got.attentions) == base.config.num_hidden_layers == len(want.attentions)
    for a, b in zip(got.attentions, want.attentions):
        assert a.shape == b.shape == (13, 4, 7, 7)
        torch.testing.assert_close(a.sum(-1), torch.ones(13, 4, 7), atol=1e-5, rtol=0)
        real = attention_mask.bool()  # query rows of real tokens (padding rows differ by design)
        assert (a - b).abs().amax(dim=(1, 3))[real].max().item() <= 1e-6
        assert a[1, :, :, 6].abs().max().item() == 0.0  # row 1 has 6 real tokens: padding key gets 0


def test_hidden_states_output(debug_config, batch):
    model = BertImplModel(debug_config()).eval()
    input_ids, attention_mask, _ = batch
    out = model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)


# ---------------------------------------------------------------------------------------------
# Positions


def test_sinusoidal_positions_are_not_stored_and_extend_past_max(debug_config, tmp_path):
    config = debug_config(max_position_embeddings=16)
    model = BertImplModel(config).eval()
    assert not any("position" in k for k in model.state_dict())
    with torch.no_grad():
        long_out = model(torch.randint(1, 99, (2, 40))).last_hidden_state  # 40 > 16 positions
    assert long_out.shape == (2, 40, 32) and torch.isfinite(long_out).all()
    # The encoding rows for 16..39 are the formula's, whatever the stored table length.
    wide = BertImplModel(debug_config(max_position_embeddings=64)).eval()
    wide.load_state_dict(model.state_dict())
    ids = torch.randint(1, 99, (2, 40))
    with torch.no_grad():
        assert (model(ids).last_hidden_state - wide(ids).last_hidden_state).abs().max().item() <= ATOL


def test_learned_positions_reject_too_long_input(debug_config):
    model = BertImplModel(debug_config(position_embedding_type="learned", max_position_embeddings=16))
    assert "embeddings.position_embeddings.weight" in model.state_dict()
    with pytest.raises(ValueError, match=r"position 19 .*max_position_embeddings - 1 = 15"):
        model(torch.randint(1, 99, (2, 20)))
    # the boundary, both ways (an off-by-one in the check would pass the case above)
    assert model(torch.randint(1, 99, (2, 16))).last_hidden_state.shape == (2, 16, 32)
    with pytest.raises(ValueError, match=r"position 16 .*max_position_embeddings - 1 = 15"):
        model(torch.randint(1, 99, (2, 17)))
    with pytest.raises(ValueError, match=r"position 16 .*max_position_embeddings - 1 = 15"):
        model(torch.randint(1, 99, (2, 5)), position_ids=torch.tensor([[0, 1, 2, 3, 16]]))


def test_sinusoidal_positions_extend_from_the_first_missing_row(debug_config):
    """One position past the stored table (an off-by-one in the extension would index out of range)."""
    model = BertImplModel(debug_config(max_position_embeddings=16)).eval()
    wide = BertImplModel(debug_config(max_position_embeddings=17)).eval()
    wide.load_state_dict(model.state_dict())
    ids = torch.randint(1, 99, (2, 17))
    with torch.no_grad():
        assert (model(ids).last_hidden_state - wide(ids).last_hidden_state).abs().max().item() <= ATOL


# ---------------------------------------------------------------------------------------------
# Bad inputs: a ValueError naming the value, never a bare IndexError


@pytest.mark.parametrize(
    "case,match",
    [
        ("id_too_large", r"input_ids contains 99, outside \[0, vocab_size=99\)"),
        ("id_negative", r"input_ids contains -3, outside \[0, vocab_size=99\)"),
        ("token_type", r"token_type_ids contains 2, outside \[0, type_vocab_size=2\)"),
        ("mask_shape", r"attention_mask has shape \(13, 6\) but the input has shape \(13, 7\)"),
        ("token_type_shape", r"token_type_ids has shape \(13, 6\) but the input has shape \(13, 7\)"),
        ("embeds_token_type_shape", r"token_type_ids has shape \(13, 6\) but the input has shape \(13, 7\)"),
        ("both_inputs", r"exactly one of input_ids or inputs_embeds"),
        ("rank", r"input_ids must have shape \(batch, sequence\), got \(7,\)"),
    ],
)
def test_bad_inputs_raise_value_error(debug_config, batch, case, match):
    model = BertImplForMaskedLM(debug_config()).eval()
    input_ids, attention_mask, token_type_ids = (t.clone() for t in batch)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    if case == "id_too_large":
        input_ids[3, 2] = 99
    elif case == "id_negative":
        input_ids[0, 0] = -3
    elif case == "token_type":
        token_type_ids[5, 1] = 2
    elif case == "mask_shape":
        kwargs["attention_mask"] = attention_mask[:, :6]
    elif case == "token_type_shape":
        kwargs["token_type_ids"] = token_type_ids[:, :6]
    elif case == "embeds_token_type_shape":  # the shape comes from inputs_embeds
        kwargs = {"inputs_embeds": torch.zeros(13, 7, 32), "token_type_ids": token_type_ids[:, :6]}
    elif case == "both_inputs":
        kwargs["inputs_embeds"] = torch.zeros(13, 7, 32)
    elif case == "rank":
        kwargs = {"input_ids": input_ids[0]}
    with pytest.raises(ValueError, match=match):
        model(**kwargs)


# ---------------------------------------------------------------------------------------------
# Sparse MLM prediction (config.sparse_prediction, as ModernBERT's): with labels, the head on the labelled rows only


def _mlm_labels(input_ids, attention_mask, seed=7):
    chosen = (torch.rand(input_ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.3) & attention_mask.bool()
    chosen[0, 0] = True
    return torch.where(chosen, input_ids, torch.full_like(input_ids, -100))


@pytest.mark.parametrize("num_items_in_batch", [None, 50])
def test_sparse_prediction_matches_dense(debug_config, batch, num_items_in_batch):
    """Logits (n, V) for the n labelled tokens (row i is labels[labels != -100][i]), the dense logits at those tokens,
    the same loss (the hand-computed one, divided by n or num_items_in_batch) and the same gradients, within 1e-5."""
    torch.manual_seed(0)
    dense = BertImplForMaskedLM(debug_config()).train()
    sparse = copy.deepcopy(dense)
    sparse.config.sparse_prediction = True
    assert dense.config.sparse_prediction is False  # the default, and the copies' configs are their own
    input_ids, attention_mask, token_type_ids = batch
    labels = _mlm_labels(input_ids, attention_mask)
    kw = {
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
        "labels": labels,
        "num_items_in_batch": num_items_in_batch,
    }
    d, s = dense(input_ids, **kw), sparse(input_ids, **kw)
    keep = labels.ne(-100)
    assert d.logits.shape == (*input_ids.shape, 99) and s.logits.shape == (int(keep.sum()), 99)
    assert (s.logits - d.logits[keep]).abs().max().item() <= ATOL
    assert abs(s.loss.item() - d.loss.item()) <= ATOL
    nll = -torch.log_softmax(d.logits[keep].double(), -1).gather(1, labels[keep][:, None]).sum()
    assert abs(s.loss.item() - (nll / (num_items_in_batch or keep.sum())).item()) <= ATOL
    d.loss.backward()
    s.loss.backward()
    for (name, p), q in zip(dense.named_parameters(), sparse.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= ATOL, name


def test_sparse_prediction_gives_full_logits_without_labels(debug_config, batch):
    model = BertImplForMaskedLM(debug_config(sparse_prediction=True)).eval()
    input_ids, attention_mask, _ = batch
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask)
    assert out.logits.shape == (*input_ids.shape, 99) and out.loss is None


def test_sparse_prediction_on_the_pretraining_head(debug_config, batch):
    """BertImplForPreTraining: prediction_logits (n, V), the same loss (MLM + NSP) and NSP logits as dense."""
    torch.manual_seed(0)
    dense = BertImplForPreTraining(debug_config()).eval()
    sparse = copy.deepcopy(dense)
    sparse.config.sparse_prediction = True
    input_ids, attention_mask, _ = batch
    labels = _mlm_labels(input_ids, attention_mask)
    nsp = torch.randint(0, 2, (input_ids.size(0),), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        d = dense(input_ids, attention_mask=attention_mask, labels=labels, next_sentence_label=nsp)
        s = sparse(input_ids, attention_mask=attention_mask, labels=labels, next_sentence_label=nsp)
    keep = labels.ne(-100)
    assert s.prediction_logits.shape == (int(keep.sum()), 99)
    assert (s.prediction_logits - d.prediction_logits[keep]).abs().max().item() <= ATOL
    assert abs(s.loss.item() - d.loss.item()) <= ATOL
    assert (s.seq_relationship_logits - d.seq_relationship_logits).abs().max().item() <= ATOL


@pytest.mark.parametrize("sparse", [False, True])
def test_mlm_labels_of_the_wrong_shape_raise(debug_config, batch, sparse):
    model = BertImplForMaskedLM(debug_config(sparse_prediction=sparse))
    input_ids, attention_mask, _ = batch
    with pytest.raises(ValueError, match=r"labels have shape \(13, 6\) but the input has shape \(13, 7\)"):
        model(input_ids, attention_mask=attention_mask, labels=input_ids[:, :6])


def test_sparse_prediction_is_saved_and_loaded_with_the_config(debug_config, tmp_path):
    """A model option: it travels in config.json; a saved config without it (older saves) loads as False."""
    import json

    BertImplForMaskedLM(debug_config(sparse_prediction=True)).save_pretrained(tmp_path / "on")
    BertImplForMaskedLM(debug_config()).save_pretrained(tmp_path / "off")
    assert json.loads((tmp_path / "on" / "config.json").read_text())["sparse_prediction"] is True
    assert BertImplForMaskedLM.from_pretrained(tmp_path / "on").config.sparse_prediction is True
    off = json.loads((tmp_path / "off" / "config.json").read_text())
    off.pop("sparse_prediction", None)
    (tmp_path / "off" / "config.json").write_text(json.dumps(off))
    assert BertImplForMaskedLM.from_pretrained(tmp_path / "off").config.sparse_prediction is False


# ---------------------------------------------------------------------------------------------
# Training machinery


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradient_checkpointing_gives_same_gradients(debug_config, batch, dropout):
    """With dropout on, the recomputed forward must redraw the same masks (checkpointing restores torch's CPU
    generator)."""
    torch.manual_seed(0)
    config = debug_config(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = BertImplForMaskedLM(config).train()
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ckpt.is_gradient_checkpointing and not model.is_gradient_checkpointing
    input_ids, attention_mask, token_type_ids = batch
    labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
    for m in (model, ckpt):
        torch.manual_seed(1)
        m(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7, rtol=0), name


def test_mlm_decoder_is_tied_and_survives_resize(debug_config):
    model = BertImplForMaskedLM(debug_config())
    assert model.lm_head.decoder.weight is model.bert.embeddings.word_embeddings.weight
    model.resize_token_embeddings(120)
    assert model.config.vocab_size == 120
    assert model.get_input_embeddings().weight.shape == (120, 32)
    assert model.lm_head.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.lm_head.decoder.bias.shape == (120,)
    out = model(torch.randint(0, 120, (2, 5)), labels=torch.randint(0, 120, (2, 5)))
    assert out.logits.shape == (2, 5, 120) and torch.isfinite(out.loss)


def test_init_weights_statistics(debug_config):
    config = debug_config(initializer_range=0.05)
    torch.manual_seed(0)
    model = BertImplForSequenceClassification(config)
    layer = model.bert.layers[0]
    assert abs(layer.mlp.Wi.weight.std().item() - 0.05) < 0.01
    assert layer.mlp.Wi.bias.abs().max().item() == 0.0
    assert torch.equal(layer.attn_norm.weight, torch.ones(32)) and torch.equal(layer.attn_norm.bias, torch.zeros(32))
    assert model.bert.embeddings.word_embeddings.weight[config.pad_token_id].abs().max().item() == 0.0


@pytest.mark.parametrize("cls", [BertImplForMaskedLM, BertImplForSequenceClassification, BertImplForPreTraining])
def test_save_load_roundtrip_keeps_loaded_weights(debug_config, batch, tmp_path, cls):
    """`_init_weights` must not re-initialise what the checkpoint provides."""
    torch.manual_seed(0)
    model = cls(debug_config()).eval()
    with torch.no_grad():  # move every weight away from its init distribution
        for p in model.parameters():
            p.add_(0.5)
    model.save_pretrained(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "configuration_bert_impl.py", "model.safetensors", "modeling_bert_impl.py"]
    loaded = cls.from_pretrained(tmp_path).eval()
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name
    input_ids, attention_mask, _ = batch
    a, b = model(input_ids, attention_mask=attention_mask), loaded(input_ids, attention_mask=attention_mask)
    assert torch.equal(a[0], b[0])


def test_auto_classes_are_registered(debug_config, tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

    assert AutoConfig.for_model("bert_impl").__class__ is BertImplConfig
    assert set(hf_bert_impl.AUTO_MAP) == {"AutoConfig"} | {a.__name__ for a in hf_bert_impl.HEADS}
    for auto_cls, head in hf_bert_impl.HEADS.items():
        assert type(auto_cls.from_config(debug_config())) is head
    BertImplForMaskedLM(debug_config()).save_pretrained(tmp_path)
    assert type(AutoModelForMaskedLM.from_pretrained(tmp_path)) is BertImplForMaskedLM
    assert type(AutoModel.from_pretrained(tmp_path)) is BertImplModel


def test_sharded_save_loads(debug_config, tmp_path):
    model = BertImplForMaskedLM(debug_config()).eval()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    loaded = BertImplForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(1, 99, (2, 7))
    assert torch.equal(model(ids).logits, loaded(ids).logits)
