"""Hostile inputs and hostile files.

Inputs: hypothesis draws valid configs (sizes, heads, position type, activation, attention backend) and valid inputs
(lengths, padding patterns, token types, all-zero masks, int / bool / float masks) and checks that every output is
finite and padding is invisible; it draws invalid field values (out-of-range numbers, wrong types, unknown names) and
checks for the ValueError naming the field and the value at construction, fields that do not fit together (a head
count that does not divide the hidden size, a pad id outside the vocabulary) and checks that the model refuses them
when it is built, and invalid inputs and checks for the ValueError naming the value.

Files: a truncated or corrupt model.safetensors and pickled .bin weights with a payload (each beside transformers'
BertModel as the control: the same exception, no code run), one lacking encoder tensors, config.json of the wrong model
type or with a required field missing or of the wrong type, retired speed fields, a transformers BERT directory and
edited code files. Each gives an error (or is ignored, for code files), changes no file and runs no code. What a save
writes (and that a save rewrites no config field) is checked here; where it writes and its crash safety in
test_saving.py."""

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import AutoModel

from hf_bert_impl import BertImplConfig, BertImplForMaskedLM, BertImplForPreTraining, BertImplModel
from hf_bert_impl.configuration_bert_impl import HIDDEN_ACTS, POSITION_EMBEDDING_TYPES, REQUIRED_FIELDS


# Examples per property: a valid case runs a model (about 20 ms on one thread), an invalid one mostly does not.
VALID_EXAMPLES = 300
INVALID_EXAMPLES = 300
COUPLED_EXAMPLES = 60  # each builds (part of) a model
HYPO = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.too_slow]}


# ----------------------------------------------------------------------------------------------
# Hostile inputs


@st.composite
def valid_case(draw):
    heads = draw(st.integers(1, 4))
    position = draw(st.sampled_from(["sinusoidal", "learned"]))
    max_pos = draw(st.integers(2, 12))
    config = BertImplConfig(
        vocab_size=draw(st.integers(2, 40)),
        hidden_size=heads * draw(st.integers(1, 6)),
        num_hidden_layers=draw(st.integers(1, 2)),
        num_attention_heads=heads,
        intermediate_size=draw(st.integers(1, 24)),
        hidden_act=draw(st.sampled_from(HIDDEN_ACTS)),
        max_position_embeddings=max_pos,
        type_vocab_size=draw(st.integers(1, 3)),
        position_embedding_type=position,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation=draw(st.sampled_from(["eager", "sdpa"])),
    )
    b = draw(st.integers(1, 4))
    # Sinusoidal positions work past the stored table, so lengths go beyond it there.
    s = draw(st.integers(1, max_pos if position == "learned" else max_pos + 6))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (b, s), generator=g)
    token_type_ids = draw(st.sampled_from([None, "random"]))
    if token_type_ids == "random":
        token_type_ids = torch.randint(0, config.type_vocab_size, (b, s), generator=g)
    pattern = draw(st.sampled_from(["none", "ones", "zeros", "right_pad", "random", "one_row_zero"]))
    if pattern == "none":
        mask = None
    elif pattern == "ones":
        mask = torch.ones(b, s, dtype=torch.long)
    elif pattern == "zeros":
        mask = torch.zeros(b, s, dtype=torch.long)
    elif pattern == "right_pad":
        lengths = torch.randint(0, s + 1, (b,), generator=g)
        mask = (torch.arange(s)[None, :] < lengths[:, None]).long()
    elif pattern == "random":
        mask = torch.randint(0, 2, (b, s), generator=g)
    else:
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0] = 0
    if mask is not None:
        mask = mask.to(draw(st.sampled_from([torch.long, torch.bool, torch.float32])))
    labels = torch.where(torch.rand(b, s, generator=g) < 0.5, input_ids, torch.full_like(input_ids, -100))
    inputs = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": token_type_ids}
    return config, seed, inputs, labels, pattern


@settings(max_examples=VALID_EXAMPLES, **HYPO)
@given(valid_case())
def test_valid_configs_and_inputs_give_finite_outputs(case):
    config, seed, inputs, labels, pattern = case
    event(f"mask {pattern}")
    event(f"{config._attn_implementation} / {config.position_embedding_type}")
    torch.manual_seed(seed)
    # The pretraining head covers the encoder, the pooler and both heads in one model.
    model = BertImplForPreTraining(config).eval()
    b, s = inputs["input_ids"].shape
    nsp = torch.arange(b) % 2
    with torch.no_grad():
        out = model(**inputs, labels=labels, next_sentence_label=nsp, output_hidden_states=True)
        probs = model(**inputs, output_attentions=True).attentions
    assert torch.isfinite(out.prediction_logits).all(), f"non-finite logits ({pattern} mask)"
    assert torch.isfinite(out.seq_relationship_logits).all(), f"non-finite pooled logits ({pattern} mask)"
    assert torch.isfinite(out.loss), f"non-finite loss {out.loss} ({pattern} mask)"
    for h in out.hidden_states:
        assert torch.isfinite(h).all()
    for p in probs:  # real probabilities, even for a fully padded row (uniform, not NaN)
        assert p.shape == (b, config.num_attention_heads, s, s)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)), atol=1e-5, rtol=0)
    mask = inputs["attention_mask"]
    if mask is not None and not mask.bool().all():
        # Padding is invisible: other ids under the mask change nothing at the real tokens.
        real = mask.bool()
        noise = torch.randint(0, config.vocab_size, real.shape, generator=torch.Generator().manual_seed(seed + 1))
        with torch.no_grad():
            again = model(**{**inputs, "input_ids": torch.where(real, inputs["input_ids"], noise)}).prediction_logits
        torch.testing.assert_close(again[real], out.prediction_logits[real], atol=1e-5, rtol=1e-5)


COUNTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
)
PROBABILITIES = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")
POSITIVE = ("initializer_range", "layer_norm_eps")
CHOICES = {"position_embedding_type": POSITION_EMBEDDING_TYPES, "hidden_act": HIDDEN_ACTS}
OPTIONAL = ("classifier_dropout", "scale_word_embeddings", "pad_token_id")  # None is accepted there
# anything of another type than a field takes; bool is refused wherever a number is asked
OTHER_TYPES = st.one_of(st.text(max_size=8), st.lists(st.integers(), max_size=2), st.binary(max_size=4))


@st.composite
def bad_config_value(draw):
    """(field, a value the field refuses): drawn, not listed: out-of-range numbers of the right type (NaN and inf
    included), numbers of the wrong type, booleans, None where it is not accepted, strings that name nothing."""
    field = draw(
        st.sampled_from([*COUNTS, *PROBABILITIES, *POSITIVE, *CHOICES, "scale_word_embeddings", "pad_token_id"])
    )
    if field in COUNTS:
        value = draw(st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.none(), OTHER_TYPES))
    elif field in PROBABILITIES:
        out = st.one_of(
            st.floats(min_value=1.0),
            st.floats(max_value=-1e-300),
            st.integers(min_value=1),
            st.integers(max_value=-1),
            st.just(float("nan")),
        )
        value = draw(st.one_of(out, st.booleans(), OTHER_TYPES, *([] if field in OPTIONAL else [st.none()])))
    elif field in POSITIVE:
        value = draw(
            st.one_of(
                st.floats(max_value=0.0),
                st.integers(max_value=0),
                st.just(float("nan")),
                st.booleans(),
                st.none(),
                OTHER_TYPES,
            )
        )
    elif field in CHOICES:
        value = draw(
            st.one_of(
                st.text(max_size=12).filter(lambda v: v not in CHOICES[field]),
                st.integers(),
                st.none(),
                st.lists(st.sampled_from(CHOICES[field]), min_size=1, max_size=1),
            )
        )
    elif field == "scale_word_embeddings":
        value = draw(st.one_of(st.integers(), st.floats(), OTHER_TYPES))
    else:  # pad_token_id
        value = draw(st.one_of(st.integers(max_value=-1), st.floats(), st.booleans(), OTHER_TYPES))
    return field, value


@settings(max_examples=INVALID_EXAMPLES, **HYPO)
@given(bad_config_value())
def test_invalid_config_raises_value_error_naming_field(bad):
    field, value = bad
    event(field)
    kw = {
        "vocab_size": 99,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 7,
    }
    with pytest.raises(ValueError, match=rf"^BertImplConfig\.{field} must be ") as err:
        BertImplConfig(**{**kw, field: value})
    assert str(err.value).endswith(f", got {value!r}"), str(err.value)


@st.composite
def coupled_case(draw):
    """A config whose fields are each valid but do not fit together: a head count that does not divide the hidden
    size, or a pad id at or past the end of the vocabulary."""
    if draw(st.booleans()):
        heads = draw(st.integers(2, 12))
        hidden = draw(st.integers(1, 96).filter(lambda h: h % heads))
        return {"hidden_size": hidden, "num_attention_heads": heads}, (
            rf"hidden_size \({hidden}\) must be divisible by num_attention_heads \({heads}\)"
        )
    vocab = draw(st.integers(1, 200))
    pad = draw(st.integers(vocab, 10**9))
    message = rf"pad_token_id must be None or in \[0, config.vocab_size={vocab}\), got {pad}$"
    return {"vocab_size": vocab, "pad_token_id": pad}, message


@settings(max_examples=COUPLED_EXAMPLES, **HYPO)
@given(coupled_case())
def test_coupled_fields_are_checked_when_the_model_is_built(case):
    """The config takes them (transformers' ConfigTester builds such configs); building a model names both values."""
    overrides, message = case
    kw = {
        "vocab_size": 99,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 7,
    }
    config = BertImplConfig(**{**kw, **overrides})
    assert all(getattr(config, k) == v for k, v in overrides.items())
    with pytest.raises(ValueError, match=message):
        BertImplModel(config)


@st.composite
def invalid_input(draw):
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    kind = draw(
        st.sampled_from(
            [
                "id_high",
                "id_negative",
                "type_high",
                "mask_shape",
                "ids_3d",
                "learned_too_long",
                "both",
                "float_ids",
                "empty",
                "embeds_width",
                "mask_values",
                "position_negative",
                "position_shape",
            ]
        )
    )
    ids = torch.randint(0, 20, (b, s))
    kw = {"input_ids": ids}
    if kind == "id_high":
        bad = draw(st.integers(20, 10**6))
        ids[draw(st.integers(0, b - 1)), draw(st.integers(0, s - 1))] = bad
        return kind, kw, "input_ids", str(bad)
    if kind == "id_negative":
        bad = draw(st.integers(-(10**6), -1))
        ids[0, 0] = bad
        return kind, kw, "input_ids", str(bad)
    if kind == "type_high":
        bad = draw(st.integers(2, 50))
        kw["token_type_ids"] = torch.full((b, s), bad)
        return kind, kw, "token_type_ids", str(bad)
    if kind == "mask_shape":
        kw["attention_mask"] = torch.ones(b, s + draw(st.integers(1, 3)))
        return kind, kw, "attention_mask", "shape"
    if kind == "ids_3d":
        kw["input_ids"] = ids[None]
        return kind, kw, "input_ids", "shape"
    if kind == "both":  # both input_ids and inputs_embeds, or neither
        if draw(st.booleans()):
            return kind, {"input_ids": ids, "inputs_embeds": torch.zeros(b, s, 16)}, "exactly one", ""
        return kind, {"attention_mask": torch.ones(b, s)}, "exactly one", ""
    if kind == "float_ids":
        kw["input_ids"] = ids.float()
        return kind, kw, "input_ids", "torch.float32"
    if kind == "empty":
        kw["input_ids"] = ids[:, :0] if draw(st.booleans()) else ids[:0]
        return kind, kw, "empty", str(tuple(kw["input_ids"].shape))
    if kind == "embeds_width":
        width = draw(st.integers(1, 40).filter(lambda w: w != 16))
        return kind, {"inputs_embeds": torch.zeros(b, s, width)}, "inputs_embeds", str(width)
    if kind == "mask_values":  # an integer or a float32 value that is neither 0 nor 1 (NaN and inf included)
        bad = draw(st.one_of(st.integers(-(2**62), 2**62), st.floats(width=32)).filter(lambda v: v not in (0, 1)))
        mask = torch.ones(b, s) if isinstance(bad, float) else torch.ones(b, s, dtype=torch.long)
        mask[draw(st.integers(0, b - 1)), draw(st.integers(0, s - 1))] = bad
        kw["attention_mask"] = mask
        return kind, kw, "attention_mask", f"got {bad}"
    if kind == "position_negative":
        bad = draw(st.integers(-50, -1))
        kw["position_ids"] = torch.arange(s)[None].clone()
        kw["position_ids"][0, -1] = bad
        return kind, kw, "position_ids", str(bad)
    if kind == "position_shape":
        kw["position_ids"] = torch.arange(s + draw(st.integers(1, 3)))[None]
        return kind, kw, "position_ids", "shape"
    kw["input_ids"] = torch.randint(0, 20, (b, 8 + draw(st.integers(1, 5))))
    return kind, kw, "max_position_embeddings", "truncat"


@settings(max_examples=INVALID_EXAMPLES, **HYPO)
@given(invalid_input())
def test_invalid_inputs_raise_value_error_naming_the_value(case):
    kind, kw, names, mentions = case
    event(kind)
    config = BertImplConfig(
        vocab_size=20,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=7,
        max_position_embeddings=8,
        position_embedding_type="learned",
    )
    model = BertImplModel(config).eval()
    with pytest.raises(ValueError) as err:
        model(**kw)
    assert names in str(err.value) and mentions in str(err.value), str(err.value)


# ----------------------------------------------------------------------------------------------
# Hostile files


def snapshot(folder: Path) -> dict:
    """Every file under `folder` (and the folder's siblings' names) -> sha256, to prove nothing changed."""
    files = {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }
    return {"files": files, "siblings": sorted(p.name for p in folder.parent.iterdir())}


@pytest.fixture
def saved(tmp_path, debug_config):
    """A valid saved BertImplModel (debug flavour) in tmp_path/ckpt, and the model."""
    torch.manual_seed(0)
    model = BertImplModel(debug_config()).eval()
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    return folder, model


def assert_refused(folder: Path, load, match: str):
    """`load()` raises a ValueError matching `match` and leaves every file as it was. Returns the message."""
    before = snapshot(folder)
    with pytest.raises(ValueError, match=match) as err:
        load()
    assert snapshot(folder) == before, "a failed load changed files"
    return str(err.value)


CORRUPTIONS = {
    "truncated_half": lambda data: data[: len(data) // 2],
    "truncated_to_header_length": lambda data: data[:8],
    "empty": lambda data: b"",
    "header_garbage": lambda data: data[:8] + b"\xff" * 16 + data[24:],
    "not_safetensors": lambda data: b"<html>404 Not Found</html>",
    "last_byte_missing": lambda data: data[:-1],
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_safetensors_fails_as_for_bert_model(saved, corruption):
    """A truncated or corrupt model.safetensors, beside transformers' BertModel holding the same weights (the
    control, corrupted the same way): both loads raise, with the same exception type, and change no file."""
    from transformers import BertModel

    from hf_bert_impl.convert import to_hf_bert

    folder, model = saved
    control = folder.parent / "bert"
    to_hf_bert(model).save_pretrained(control)
    errors = []
    for where, cls in ((folder, BertImplModel), (control, BertModel)):
        weights = where / "model.safetensors"
        weights.write_bytes(CORRUPTIONS[corruption](weights.read_bytes()))
        before = snapshot(where)
        with pytest.raises(Exception) as err:  # any type: the two types are compared below
            cls.from_pretrained(where)
        assert snapshot(where) == before, f"a failed {cls.__name__} load changed files"
        errors.append(err.value)
    assert type(errors[0]) is type(errors[1]), errors
    print(f"{corruption}: {type(errors[0]).__name__}: {errors[0]}")


@pytest.mark.parametrize("model_type", ["gpt2", "roberta", None])
def test_wrong_model_type_is_refused(saved, model_type):
    folder, _ = saved
    config = json.loads((folder / "config.json").read_text())
    if model_type is None:
        del config["model_type"]
    else:
        config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    for load in (lambda: BertImplModel.from_pretrained(folder), lambda: BertImplConfig.from_pretrained(folder)):
        msg = assert_refused(folder, load, f"model_type={model_type!r}")
    print(f"model_type={model_type!r}: {msg}")


def test_transformers_bert_directory_points_to_the_converter(minilm_dir):
    """A real transformers BERT checkpoint (all-MiniLM-L6-v2) loaded with our classes: the error names
    the converter instead of building our model with random weights (transformers only warns)."""
    for load in (
        lambda: BertImplConfig.from_pretrained(minilm_dir),
        lambda: BertImplModel.from_pretrained(minilm_dir),
        lambda: BertImplForMaskedLM.from_pretrained(minilm_dir),
    ):
        msg = assert_refused(minilm_dir, load, "model_type='bert'")
        assert "hf_bert_impl.convert.from_hf_bert" in msg and "convert_checkpoint.py --from-hf" in msg
    print(f"transformers BERT dir: {msg}")


@pytest.mark.parametrize("field", REQUIRED_FIELDS)
def test_missing_required_field_is_named(saved, field):
    folder, _ = saved
    config = json.loads((folder / "config.json").read_text())
    del config[field]
    (folder / "config.json").write_text(json.dumps(config))
    # Through our class and through the Auto class (AutoConfig reads the file, then our from_dict).
    for load in (lambda: BertImplModel.from_pretrained(folder), lambda: AutoModel.from_pretrained(folder)):
        msg = assert_refused(folder, load, f"missing required field.*'{field}'")
    print(f"missing {field}: {msg}")


WRONG_TYPES = {
    "num_attention_heads": "4",
    "hidden_size": 32.0,
    "vocab_size": None,
    "layer_norm_eps": "1e-12",
    "position_embedding_type": 1,
    "hidden_act": ["gelu"],
    "type_vocab_size": True,
    "hidden_dropout_prob": "0.1",
}


@pytest.mark.parametrize("field", sorted(WRONG_TYPES))
def test_wrong_field_type_is_named(saved, field):
    folder, _ = saved
    config = json.loads((folder / "config.json").read_text())
    config[field] = WRONG_TYPES[field]
    (folder / "config.json").write_text(json.dumps(config))
    msg = assert_refused(folder, lambda: BertImplModel.from_pretrained(folder), f"BertImplConfig.{field}")
    assert repr(WRONG_TYPES[field]) in msg
    print(f"{field}={WRONG_TYPES[field]!r}: {msg}")


class _MarkerPayload:
    """Unpickling this calls open(marker, 'w'): the file appears if and only if the pickle's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_weights_with_a_payload_run_no_code(saved, tmp_path):
    """A checkpoint whose only weights are a pytorch_model.bin carrying a payload: transformers' loader
    (torch.load(weights_only=True)) refuses it for our model exactly as for BertModel (the control, same payload),
    runs no code and changes no file."""
    from transformers import BertModel

    from hf_bert_impl.convert import to_hf_bert

    folder, model = saved
    control = folder.parent / "bert"
    to_hf_bert(model).save_pretrained(control)
    marker = tmp_path / "code_ran.txt"
    errors = []
    for where, cls, source in ((folder, BertImplModel, model), (control, BertModel, to_hf_bert(model))):
        (where / "model.safetensors").unlink()
        torch.save({**source.state_dict(), "payload": _MarkerPayload(marker)}, where / "pytorch_model.bin")
        before = snapshot(where)
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed") as err:
            cls.from_pretrained(where)
        assert not marker.exists() and snapshot(where) == before
        errors.append(err.value)
    assert type(errors[0]) is type(errors[1])
    # The payload is live: an unsafe load does run it, so the checks above could have failed.
    torch.load(folder / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_no_config_field_is_rewritten_by_a_save(tmp_path, debug_config):
    """A save writes the model's config as it is: non-default values of every kind (the model option
    sparse_prediction included) come back from config.json unchanged, and a kernelized model saves the same
    config.json and weights as the plain one (0.5 rewrote sparse_prediction in the saved file)."""
    from hf_bert_impl import kernelize, kernelized

    config = debug_config(
        hidden_act="relu",
        classifier_dropout=0.3,
        layer_norm_eps=1e-7,
        initializer_range=0.05,
        position_embedding_type="learned",
        max_position_embeddings=64,
        scale_word_embeddings=True,
        hidden_dropout_prob=0.2,
        type_vocab_size=3,
        pad_token_id=1,
        num_labels=3,
        sparse_prediction=True,
    )
    torch.manual_seed(0)
    model = BertImplForMaskedLM(config)
    model.save_pretrained(tmp_path / "plain")
    written = json.loads((tmp_path / "plain" / "config.json").read_text())
    live = json.loads(model.config.to_json_string(use_diff=False))
    assert {k: v for k, v in written.items() if k != "transformers_version"} == {
        k: live[k] for k in written if k != "transformers_version"
    }
    fields = BertImplConfig.__init__.__code__.co_varnames[1 : BertImplConfig.__init__.__code__.co_argcount]
    assert all(written[f] == live[f] for f in fields), [f for f in fields if written.get(f) != live[f]]
    assert (written["hidden_act"], written["classifier_dropout"], written["pad_token_id"]) == ("relu", 0.3, 1)
    assert written["sparse_prediction"] is True
    reloaded = BertImplConfig.from_pretrained(tmp_path / "plain").to_dict()
    assert {k: v for k, v in reloaded.items() if k != "_name_or_path"} == {
        k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"
    }
    kernelize(model, "unpadded")
    assert kernelized(model)["bert.layers"] == "unpadded_encoder_forward"
    model.save_pretrained(tmp_path / "kernelized")
    assert sorted(p.name for p in (tmp_path / "kernelized").iterdir()) == sorted(
        p.name for p in (tmp_path / "plain").iterdir()
    )
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "kernelized" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    assert not {"kernels", "unpad_inputs", "onednn_linear"} & set(written)


def test_checkpoint_missing_encoder_weights_lists_them_in_missing_keys(saved):
    """transformers' contract for renamed or absent weights: the model loads, they start freshly initialised and
    are listed in missing_keys (transformers also reports them); every other weight is the checkpoint's."""
    from safetensors.torch import load_file, save_file

    folder, model = saved
    state = load_file(folder / "model.safetensors")
    renamed = {("old." + k if k.startswith("layers.1.") else k): v for k, v in state.items()}
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(folder)
    loaded, info = BertImplModel.from_pretrained(folder, output_loading_info=True)
    assert snapshot(folder) == before
    lost = {k for k in state if k.startswith("layers.1.")}
    assert len(lost) == 12 and set(info["missing_keys"]) == lost, sorted(info["missing_keys"])
    assert set(info["unexpected_keys"]) == {"old." + k for k in lost}
    for name, tensor in loaded.state_dict().items():
        if name not in lost:
            assert torch.equal(tensor, model.state_dict()[name]), name
    assert not torch.equal(loaded.layers[1].attn.Wqkv.weight, model.layers[1].attn.Wqkv.weight)


def test_new_head_and_pooler_on_an_encoder_checkpoint_still_load(tmp_path, debug_config):
    from hf_bert_impl import BertImplForSequenceClassification

    mlm = BertImplForMaskedLM(debug_config()).eval()
    mlm.save_pretrained(tmp_path / "mlm")  # no pooler, an MLM head
    model, info = BertImplForSequenceClassification.from_pretrained(tmp_path / "mlm", output_loading_info=True)
    assert set(info["missing_keys"]) == {
        "classifier.weight",
        "classifier.bias",
        "bert.pooler.dense.weight",
        "bert.pooler.dense.bias",
    }
    assert torch.equal(model.bert.layers[1].attn.Wqkv.weight, mlm.bert.layers[1].attn.Wqkv.weight)


def test_tampered_code_files_in_a_checkpoint_are_not_run(saved, tmp_path):
    """A checkpoint carries our two Hub files for trust_remote_code users. With this package installed and no
    trust_remote_code, loading uses the installed classes and never runs them."""
    import runpy

    folder, model = saved
    markers = {}
    for name in ("modeling_bert_impl.py", "configuration_bert_impl.py"):
        markers[name] = tmp_path / f"ran_{name}.txt"
        code = folder / name
        code.write_text(f"open({str(markers[name])!r}, 'w').close()\n" + code.read_text())
    for load in (lambda: AutoModel.from_pretrained(folder), lambda: BertImplModel.from_pretrained(folder)):
        loaded = load()
        assert type(loaded) is BertImplModel and not any(m.exists() for m in markers.values())
        assert torch.equal(loaded.layers[0].attn.Wqkv.weight, model.layers[0].attn.Wqkv.weight)
    # The payload is live: running the file creates the marker (then fails on its relative import).
    with pytest.raises(ImportError):
        runpy.run_path(str(folder / "modeling_bert_impl.py"))
    assert markers["modeling_bert_impl.py"].exists()


def test_from_pretrained_overrides_are_validated(tmp_path, debug_config):
    """`from_pretrained(dir, field=value)` overrides go through the config's checks; a coupled one through the
    model's."""
    BertImplModel(debug_config()).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"BertImplConfig\.hidden_size must be a positive integer, got -3"):
        BertImplConfig.from_pretrained(tmp_path / "ckpt", hidden_size=-3)
    assert BertImplConfig.from_pretrained(tmp_path / "ckpt", num_attention_heads=5).num_attention_heads == 5
    with pytest.raises(ValueError, match=r"hidden_size \(32\) must be divisible by num_attention_heads \(5\)"):
        BertImplModel.from_pretrained(tmp_path / "ckpt", num_attention_heads=5)
    with pytest.raises(ValueError, match=r"attention_probs_dropout_prob must be a probability in \[0, 1\), got 2\.0"):
        AutoModel.from_pretrained(tmp_path / "ckpt", attention_probs_dropout_prob=2.0)
    assert BertImplConfig.from_pretrained(tmp_path / "ckpt", hidden_dropout_prob=0.3).hidden_dropout_prob == 0.3
