"""Hostile inputs and hostile files.

Inputs: hypothesis draws valid configs (sizes, heads, position type, activation, attention backend)
and valid inputs (lengths, padding patterns, token types, all-zero masks, int / bool / float masks)
and checks that every output is finite and padding is invisible; it draws invalid configs and
inputs and checks for the documented ValueError naming the field or the value.

Files: a truncated or corrupt model.safetensors, one lacking encoder tensors, config.json of the
wrong model type or with a required field missing or of the wrong type, a transformers BERT
directory, pickled .bin weights and edited code files (each with a payload that would create a
marker file), and interrupted saves. Each gives a clear error (or is ignored, for code files),
changes no file and runs no code; an interrupted save never leaves a checkpoint that loads with
mixed contents."""

import hashlib
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import AutoModel

from hf_bert_impl import BertImplConfig, BertImplForMaskedLM, BertImplForPreTraining, BertImplModel
from hf_bert_impl.configuration_bert_impl import HIDDEN_ACTS, REQUIRED_FIELDS

# About 20 ms an example on one thread: 300 + 84 + 300 examples take about 7 s.
VALID_EXAMPLES = 300
INVALID_EXAMPLES = 300
HYPO = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


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
    return config, seed, dict(input_ids=input_ids, attention_mask=mask, token_type_ids=token_type_ids), labels, pattern


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


# (field, bad value, text the error must contain)
BAD_CONFIG_VALUES = [
    ("vocab_size", 0, "vocab_size"), ("vocab_size", -3, "vocab_size"), ("vocab_size", 99.0, "vocab_size"),
    ("hidden_size", True, "hidden_size"), ("hidden_size", "32", "hidden_size"),
    ("num_hidden_layers", 0, "num_hidden_layers"), ("num_attention_heads", 5, "divisible"),
    ("num_attention_heads", 0, "num_attention_heads"), ("intermediate_size", None, "intermediate_size"),
    ("max_position_embeddings", -1, "max_position_embeddings"), ("type_vocab_size", 0, "type_vocab_size"),
    ("hidden_dropout_prob", 1.0, "hidden_dropout_prob"), ("attention_probs_dropout_prob", -0.1, "attention_probs_dropout_prob"),
    ("classifier_dropout", 1.5, "classifier_dropout"), ("position_embedding_type", "absolute", "'learned'"),
    ("position_embedding_type", "rotary", "position_embedding_type"), ("hidden_act", "gelu2", "hidden_act"),
    ("layer_norm_eps", 0, "layer_norm_eps"), ("initializer_range", "0.02", "initializer_range"),
    ("pad_token_id", 99, "pad_token_id"), ("pad_token_id", -1, "pad_token_id"),
]


@settings(max_examples=INVALID_EXAMPLES, **HYPO)
@given(st.sampled_from(BAD_CONFIG_VALUES), st.integers(1, 4))
def test_invalid_config_raises_value_error_naming_field(bad, heads):
    field, value, expected = bad
    kw = dict(vocab_size=99, hidden_size=heads * 8, num_attention_heads=heads, num_hidden_layers=1, intermediate_size=7)
    kw[field] = value
    if field == "num_attention_heads" and value == 5:
        kw["hidden_size"] = 32
    with pytest.raises(ValueError, match=expected) as err:
        BertImplConfig(**kw)
    assert repr(value) in str(err.value) or str(value) in str(err.value)


@st.composite
def invalid_input(draw):
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    kind = draw(st.sampled_from([
        "id_high", "id_negative", "type_high", "mask_shape", "ids_3d", "learned_too_long", "both", "float_ids",
        "empty", "embeds_width", "mask_values", "position_negative", "position_shape",
    ]))
    ids = torch.randint(0, 20, (b, s))
    kw = dict(input_ids=ids)
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
            return kind, dict(input_ids=ids, inputs_embeds=torch.zeros(b, s, 16)), "exactly one", ""
        return kind, dict(attention_mask=torch.ones(b, s)), "exactly one", ""
    if kind == "float_ids":
        kw["input_ids"] = ids.float()
        return kind, kw, "input_ids", "torch.float32"
    if kind == "empty":
        kw["input_ids"] = ids[:, :0] if draw(st.booleans()) else ids[:0]
        return kind, kw, "empty", str(tuple(kw["input_ids"].shape))
    if kind == "embeds_width":
        width = draw(st.integers(1, 40).filter(lambda w: w != 16))
        return kind, dict(inputs_embeds=torch.zeros(b, s, width)), "inputs_embeds", str(width)
    if kind == "mask_values":
        bad = draw(st.sampled_from([2, -1, 0.5, 7]))
        mask = torch.ones(b, s) if isinstance(bad, float) else torch.ones(b, s, dtype=torch.long)
        mask[-1, -1] = bad
        kw["attention_mask"] = mask
        return kind, kw, "attention_mask", str(bad)
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
        vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=7,
        max_position_embeddings=8, position_embedding_type="learned",
    )
    model = BertImplModel(config).eval()
    with pytest.raises(ValueError) as err:
        model(**kw)
    assert names in str(err.value) and mentions in str(err.value), str(err.value)


# ----------------------------------------------------------------------------------------------
# Hostile files


def snapshot(folder: Path) -> dict:
    """Every file under `folder` (and the folder's siblings' names) -> sha256, to prove nothing changed."""
    files = {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}
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
def test_corrupt_safetensors_is_a_clear_error(saved, corruption):
    folder, _ = saved
    weights = folder / "model.safetensors"
    weights.write_bytes(CORRUPTIONS[corruption](weights.read_bytes()))
    msg = assert_refused(folder, lambda: BertImplModel.from_pretrained(folder), "truncated or corrupt")
    assert str(folder) in msg
    print(f"{corruption}: {msg}")


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
    "num_attention_heads": "4", "hidden_size": 32.0, "vocab_size": None, "layer_norm_eps": "1e-12",
    "position_embedding_type": 1, "hidden_act": ["gelu"], "type_vocab_size": True, "hidden_dropout_prob": "0.1",
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


def test_pickled_weights_are_refused_and_run_no_code(saved, tmp_path):
    folder, model = saved
    marker = tmp_path / "code_ran.txt"
    (folder / "model.safetensors").unlink()
    state = dict(model.state_dict())
    state["payload"] = _MarkerPayload(marker)
    torch.save(state, folder / "pytorch_model.bin")

    msg = assert_refused(folder, lambda: BertImplModel.from_pretrained(folder), "only pickled weights")
    assert "weights_only=True" in msg
    assert not marker.exists()
    print(f"pickled pytorch_model.bin: {msg}")
    # Opting in (use_safetensors=False) goes through transformers' torch.load(weights_only=True),
    # which refuses the payload: still no code.
    before = snapshot(folder)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        BertImplModel.from_pretrained(folder, use_safetensors=False)
    assert not marker.exists() and snapshot(folder) == before
    # The payload is live: an unsafe load does run it, so the two checks above could have failed.
    torch.load(folder / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_clean_pickled_weights_load_only_when_asked(saved):
    folder, model = saved
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    assert_refused(folder, lambda: BertImplModel.from_pretrained(folder), "use_safetensors=False")
    loaded = BertImplModel.from_pretrained(folder, use_safetensors=False)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


# ----------------------------------------------------------------------------------------------
# Interrupted saves


def _model(debug_config, seed, **overrides):
    torch.manual_seed(seed)
    return BertImplModel(debug_config(**overrides)).eval()


def _same(a, b) -> bool:
    return a.config.hidden_act == b.config.hidden_act and all(
        torch.equal(a.state_dict()[k], t) for k, t in b.state_dict().items()
    )


class Interrupted(Exception):
    pass


def _interrupt_weight_write(monkeypatch):
    """Make transformers' weight writer die after writing half a file (a crash or Ctrl-C mid-write)."""
    import transformers.modeling_utils as mu

    real = mu.safe_save_file

    def half_then_die(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise Interrupted(filename)

    monkeypatch.setattr(mu, "safe_save_file", half_then_die)


def test_plain_transformers_save_can_leave_a_mixed_checkpoint(tmp_path, debug_config, monkeypatch):
    """The hazard the override removes: transformers writes config.json before the weights, so a save
    interrupted before the weights land leaves the new config beside the old weights, and it loads."""
    from transformers import PreTrainedModel

    old, new = _model(debug_config, 0), _model(debug_config, 1, hidden_act="relu")
    old.save_pretrained(tmp_path / "ckpt")
    import transformers.modeling_utils as mu

    def die(*args, **kwargs):
        raise Interrupted

    monkeypatch.setattr(mu, "safe_save_file", die)
    with pytest.raises(Interrupted):
        PreTrainedModel.save_pretrained(new, tmp_path / "ckpt")
    mixed = BertImplModel.from_pretrained(tmp_path / "ckpt")
    assert mixed.config.hidden_act == "relu" and not _same(mixed, new) and not _same(mixed, old)


def test_interrupted_weight_write_leaves_old_checkpoint(tmp_path, debug_config, monkeypatch):
    old, new = _model(debug_config, 0), _model(debug_config, 1, hidden_act="relu")
    folder = tmp_path / "ckpt"
    old.save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    before = snapshot(folder)
    _interrupt_weight_write(monkeypatch)
    with pytest.raises(Interrupted):
        new.save_pretrained(folder)
    assert snapshot(folder) == before  # untouched, and no staging directory left beside it
    assert _same(BertImplModel.from_pretrained(folder), old)


def test_interrupted_new_directory_does_not_exist(tmp_path, debug_config, monkeypatch):
    _interrupt_weight_write(monkeypatch)
    with pytest.raises(Interrupted):
        _model(debug_config, 0).save_pretrained(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _old_checkpoint_with_extras(folder, old):
    old.save_pretrained(folder)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"stale shard of an older save")
    (folder / "tokenizer.json").write_text('{"kept": true}')
    (folder / "checkpoint-5").mkdir()
    (folder / "checkpoint-5" / "trainer_state.json").write_text("{}")


def _loads_as(folder, old, new) -> str:
    """'old' or 'new'; fails on a mix, on a missing checkpoint, or on lost user files."""
    loaded = BertImplModel.from_pretrained(folder)  # raises if nothing loadable is there
    assert (folder / "tokenizer.json").read_text() == '{"kept": true}'
    assert (folder / "checkpoint-5" / "trainer_state.json").exists()
    if _same(loaded, new):
        assert not (folder / "model-00001-of-00002.safetensors").exists()  # the old save's shard went with it
        return "new"
    assert _same(loaded, old), "loads a mixed checkpoint"
    return "old"


def test_replacing_a_checkpoint_is_atomic_at_every_step(tmp_path, debug_config, monkeypatch):
    """Replace an existing checkpoint directory (with a tokenizer, a checkpoint-5 folder and a stale
    shard of an older save) and make the save fail at each of its steps in turn, then once not at all:
    after every failure the directory loads as the complete old model, after the last as the complete
    new one; user files survive; nothing is left beside it."""
    import os

    import hf_bert_impl.checkpoint_bert_impl as mb

    old, new = _model(debug_config, 0), _model(debug_config, 1, hidden_act="relu")
    real = {"_link_tree": mb._link_tree, "rename": os.rename, "rmtree": mb.shutil.rmtree}
    outcomes = []
    for k in range(20):
        folder = tmp_path / f"ckpt{k}"
        _old_checkpoint_with_extras(folder, old)
        calls, fired = [], []

        def failing(name):
            def call(*args, **kwargs):
                # the cleanup in `finally` and the recovery after the failure are not steps
                if not fired and (name != "rmtree" or not kwargs.get("ignore_errors")):
                    if len(calls) == k:
                        fired.append(name)
                        raise Interrupted(f"step {k}: {name}{args}")
                    calls.append(name)
                return real[name](*args, **kwargs)
            return call

        monkeypatch.setattr(mb, "_link_tree", failing("_link_tree"))
        monkeypatch.setattr(mb.os, "rename", failing("rename"))
        monkeypatch.setattr(mb.shutil, "rmtree", failing("rmtree"))
        try:
            new.save_pretrained(folder)
            finished = True
        except Interrupted:
            finished = False
        monkeypatch.setattr(mb, "_link_tree", real["_link_tree"])
        monkeypatch.setattr(mb.os, "rename", real["rename"])
        monkeypatch.setattr(mb.shutil, "rmtree", real["rmtree"])
        outcomes.append(_loads_as(folder, old, new))
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".ckpt{k}.")] == []
        if finished:
            assert outcomes[-1] == "new"
            break
    print(f"interrupted replacement outcomes by step: {outcomes}")
    assert outcomes == ["old"] * 4 + ["new"], outcomes  # link x2, rename aside, rename in; then done


# A save of the model in argv[1] into argv[2], SIGKILLed at the step named by argv[3] (module docstring
# of checkpoint_bert_impl.py): after the links, between the two renames, before removing the old one.
_KILLED_SAVE = """
import os, signal, sys
import hf_bert_impl.checkpoint_bert_impl as mb
from hf_bert_impl import BertImplModel
source, folder, step = sys.argv[1:]
model = BertImplModel.from_pretrained(source)
kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
real = {"link": mb._link_tree, "rename": os.rename, "rmtree": mb.shutil.rmtree}
def link(*a):
    if step == "linking":
        kill()
    return real["link"](*a)
def rename(src, dst):
    if step == "between_renames" and ".saving-" in os.fspath(src):
        kill()
    return real["rename"](src, dst)
def rmtree(path, **kw):
    if step == "removing_old" and ".replaced-" in os.fspath(path):
        kill()
    return real["rmtree"](path, **kw)
mb._link_tree, os.rename, mb.shutil.rmtree = link, rename, rmtree
model.save_pretrained(folder)
"""


@pytest.mark.parametrize("step, loads, left", [
    ("linking", "old", ["ckpt", "saving"]),
    ("between_renames", "old", ["replaced", "saving"]),
    ("removing_old", "new", ["ckpt", "replaced"]),
])
def test_save_killed_at_each_step_loads_and_is_repaired(tmp_path, debug_config, caplog, step, loads, left):
    """SIGKILL a save at each step of checkpoint_bert_impl's replacement: the checkpoint loads as the old
    or the new model, without changing a file; between the two renames there is no directory, and
    from_pretrained loads the old model from `.ckpt.replaced-*` with a warning that says what happened and
    how to recover. The next save restores or removes every leftover and keeps the user files."""
    import os
    import signal
    import subprocess

    old, new = _model(debug_config, 0), _model(debug_config, 1, hidden_act="relu")
    new.save_pretrained(tmp_path / "new_src")
    root = tmp_path / "work"
    folder = root / "ckpt"
    _old_checkpoint_with_extras(folder, old)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path / "new_src"), str(folder), step],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]  # killed at that step, not finished
    names = sorted(p.name for p in root.iterdir())
    assert sorted(n if n == "ckpt" else n.split(".")[2].split("-")[0] for n in names) == left, names
    before = snapshot(root)["files"]
    with caplog.at_level("WARNING"):
        loaded = BertImplModel.from_pretrained(folder)
    assert _same(loaded, old if loads == "old" else new)
    assert snapshot(root)["files"] == before and sorted(p.name for p in root.iterdir()) == names  # read only
    warned = [r.getMessage() for r in caplog.records if "killed between its two renames" in r.getMessage()]
    if step == "between_renames":
        assert len(warned) == 1 and str(folder) in warned[0] and "mv " in warned[0], warned
        print(f"load between the renames: {warned[0]}")
    else:
        assert warned == []
    new.save_pretrained(folder)  # the dead save's leftovers are restored / removed first
    assert sorted(p.name for p in root.iterdir()) == ["ckpt"]
    assert _loads_as(folder, old, new) == "new"


def test_several_previous_checkpoints_are_a_clear_error(saved):
    """Two saves killed between their renames (possible only from two hosts): which is newer is not known."""
    import os

    folder, _ = saved
    tag = "otherhost-1-"
    os.rename(folder, folder.parent / f".ckpt.replaced-{tag}{'a' * 12}")
    BertImplModel.from_pretrained(folder)  # one: loads it
    (folder.parent / f".ckpt.replaced-{tag}{'b' * 12}").mkdir()
    with pytest.raises(ValueError, match=r"does not exist, and 2 interrupted saves left previous checkpoints.*Rename"):
        BertImplModel.from_pretrained(folder)


_SAVE_LOOP = """
import sys, torch
from hf_bert_impl import BertImplConfig, BertImplModel
config = BertImplConfig.from_preset("debug", vocab_size=99)
models = []
for seed in (0, 1):
    torch.manual_seed(seed)
    models.append(BertImplModel(config))
models[0].save_pretrained(sys.argv[1])
print("ready", flush=True)
i = 1
while True:
    models[i % 2].save_pretrained(sys.argv[1])
    i += 1
"""


def test_killed_save_leaves_a_loadable_checkpoint(tmp_path, debug_config):
    """SIGKILL a process that keeps replacing a checkpoint directory, at several moments: every time
    the directory loads as one of the two models, and the next save removes the dead save's hidden
    staging directory."""
    import os
    import signal
    import subprocess
    import time

    import torch

    folder = tmp_path / "ckpt"
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(BertImplModel(BertImplConfig.from_preset("debug", vocab_size=99)).eval())
    models[0].save_pretrained(tmp_path / "reference")  # the files of a complete save (the Hub files vary)
    complete = sorted(p.name for p in (tmp_path / "reference").iterdir())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    seen = set()
    for delay in (0.05, 0.17, 0.41):
        proc = subprocess.Popen([sys.executable, "-c", _SAVE_LOOP, str(folder)], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        loaded = BertImplModel.from_pretrained(folder).eval()
        which = [i for i, m in enumerate(models) if _same(loaded, m)]
        assert len(which) == 1, "the killed save left a checkpoint that is neither model"
        seen.add(which[0])
        # killed between the two renames (rare): the old checkpoint waits complete beside the directory
        source = folder if folder.exists() else next(tmp_path.glob(".ckpt.replaced-*"))
        visible = sorted(p.name for p in source.iterdir())
        assert visible == complete and "model.safetensors" in visible, visible
    models[0].save_pretrained(folder)  # the dead processes' staging directories go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "reference"]
    print(f"models found after kills: {sorted(seen)}")


def test_saved_config_never_carries_sparse_prediction(tmp_path, debug_config):
    """pretrain_mlm.py trains with sparse_prediction on; Trainer's mid-run checkpoint-N saves went
    through save_pretrained with the flag set, so a loaded checkpoint returned (n, V) logits with labels.
    The saved config has it off; the live model keeps it (the training keeps its speed)."""
    model = BertImplForMaskedLM(debug_config(sparse_prediction=True))
    model.save_pretrained(tmp_path / "ckpt")
    assert model.config.sparse_prediction is True
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["sparse_prediction"] is False
    loaded = BertImplForMaskedLM.from_pretrained(tmp_path / "ckpt")
    ids = torch.randint(5, 99, (2, 7))
    assert loaded(ids, labels=ids).logits.shape == (2, 7, 99)


def test_save_into_existing_directory_keeps_other_files(tmp_path, debug_config):
    old, new = _model(debug_config, 0), _model(debug_config, 1)
    folder = tmp_path / "ckpt"
    old.save_pretrained(folder)
    (folder / "tokenizer.json").write_text('{"kept": true}')
    (folder / "checkpoint-5").mkdir()
    (folder / "checkpoint-5" / "trainer_state.json").write_text("{}")
    new.save_pretrained(folder)
    assert (folder / "tokenizer.json").read_text() == '{"kept": true}'
    assert (folder / "checkpoint-5" / "trainer_state.json").exists()
    assert _same(BertImplModel.from_pretrained(folder), new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_saved_directory_has_the_usual_permissions(tmp_path, debug_config):
    """The staging directory must not leak a private (0700) mode into the saved checkpoint."""
    import os
    import stat

    (tmp_path / "plain").mkdir()
    _model(debug_config, 0).save_pretrained(tmp_path / "ckpt")
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "ckpt") == mode(tmp_path / "plain")


def test_checkpoint_missing_encoder_weights_loads_with_a_warning(saved, caplog):
    """transformers' contract for renamed or absent weights: the model loads, they start random and are
    listed in missing_keys. Encoder weights are never normally missing, so a warning says how many."""
    from safetensors.torch import load_file, save_file

    folder, model = saved
    state = load_file(folder / "model.safetensors")
    renamed = {("old." + k if k.startswith("layers.1.") else k): v for k, v in state.items()}
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(folder)
    with caplog.at_level("WARNING"):
        loaded, info = BertImplModel.from_pretrained(folder, output_loading_info=True)
    assert snapshot(folder) == before
    lost = {k for k in state if k.startswith("layers.1.")}
    assert len(lost) == 12 and lost <= set(info["missing_keys"]) and "layers.1.attn.Wo.bias" in info["missing_keys"]
    warned = [r.getMessage() for r in caplog.records if "encoder weight" in r.getMessage()]
    assert len(warned) == 1 and "lacks 12 encoder weight(s)" in warned[0] and "layers.1.attn.Wo.bias" in warned[0]
    assert "initialised randomly" in warned[0] and str(folder) in warned[0]
    for name, tensor in loaded.state_dict().items():
        if name not in lost:
            assert torch.equal(tensor, model.state_dict()[name]), name
    assert type(BertImplModel.from_pretrained(folder)) is BertImplModel  # without output_loading_info: the model
    print(f"encoder weights missing: {warned[0]}")


def test_new_head_and_pooler_on_an_encoder_checkpoint_still_load(tmp_path, debug_config):
    from hf_bert_impl import BertImplForSequenceClassification

    mlm = BertImplForMaskedLM(debug_config()).eval()
    mlm.save_pretrained(tmp_path / "mlm")  # no pooler, an MLM head
    model, info = BertImplForSequenceClassification.from_pretrained(tmp_path / "mlm", output_loading_info=True)
    assert info["missing_keys"] == {"classifier.weight", "classifier.bias", "bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    assert torch.equal(model.bert.layers[1].attn.Wqkv.weight, mlm.bert.layers[1].attn.Wqkv.weight)


def test_tampered_code_files_in_a_checkpoint_are_not_run(saved, tmp_path):
    """A checkpoint carries our three code files for trust_remote_code users. With this package
    installed and no trust_remote_code, loading uses the installed classes and never runs them."""
    import runpy

    from transformers import AutoModel

    folder, model = saved
    markers = {}
    for name in ("modeling_bert_impl.py", "configuration_bert_impl.py", "checkpoint_bert_impl.py"):
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


# ----------------------------------------------------------------------------------------------
# Config validation on every assignment, not only in __init__


@pytest.mark.parametrize("field, value, problem", [
    ("hidden_size", 30, "divisible by num_attention_heads"),
    ("hidden_size", -3, "positive integer"),
    ("num_attention_heads", 5, "divisible"),
    ("hidden_dropout_prob", 1.5, "probability"),
    ("position_embedding_type", "absolute", "position_embedding_type"),
    ("hidden_act", "nope", "hidden_act"),
    ("sparse_prediction", "yes", "True or False"),
    ("pad_token_id", 500, "pad_token_id"),
])
def test_config_assignment_is_validated_and_rolled_back(debug_config, field, value, problem):
    config = debug_config()
    before = getattr(config, field)
    with pytest.raises(ValueError, match=problem) as info:
        setattr(config, field, value)
    message = str(info.value)
    assert field in message and (repr(value) in message or str(value) in message), message
    assert getattr(config, field) == before  # the bad value did not stay
    config.hidden_dropout_prob = 0.25  # a good value still goes in
    assert config.hidden_dropout_prob == 0.25


def test_from_pretrained_overrides_are_validated(tmp_path, debug_config):
    """transformers applies `from_pretrained(dir, field=value)` overrides with setattr after __init__."""
    BertImplModel(debug_config()).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"hidden_size.*-3"):
        BertImplConfig.from_pretrained(tmp_path / "ckpt", hidden_size=-3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(5\)"):
        BertImplModel.from_pretrained(tmp_path / "ckpt", num_attention_heads=5)
    with pytest.raises(ValueError, match="attention_probs_dropout_prob"):
        AutoModel.from_pretrained(tmp_path / "ckpt", attention_probs_dropout_prob=2.0)
    assert BertImplConfig.from_pretrained(tmp_path / "ckpt", hidden_dropout_prob=0.3).hidden_dropout_prob == 0.3
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert not [k for k in saved if k.startswith("_bert_impl")]  # the validation flag is not serialised
