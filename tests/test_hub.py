"""The Hub: the model card, the push script's upload folder, and loading back by repo id.

The card tests render cards from a saved debug model plus a `training_facts.json` like the one the
training scripts write, and read them back with `huggingface_hub.ModelCard`.
"""

import json
import re

import pytest

from hf_bert_impl.hub import NOT_RECORDED, build_model_card, save_model_card, validate_model_card

FACTS = {
    "task": "fill-mask",
    "dataset": "wikitext",
    "dataset_config": "wikitext-2-raw-v1",
    "base_model": "sentence-transformers/all-MiniLM-L6-v2",
    "hyperparameters": {"learning_rate": 0.0005, "num_train_epochs": 3, "per_device_train_batch_size": 16},
    "metrics": {"eval_loss": 4.123456789, "perplexity": 61.7618, "eval_runtime": 1.5, "epoch": 3.0},
    "loss_curve": "loss_curve.png",
}


@pytest.fixture
def saved_mlm(tmp_path, debug_config):
    from hf_bert_impl import BertImplForMaskedLM

    model_dir = tmp_path / "mlm"
    BertImplForMaskedLM(debug_config()).save_pretrained(model_dir)
    return model_dir


def test_card_without_facts_says_not_recorded_and_invents_nothing(saved_mlm):
    from huggingface_hub import ModelCard

    path = save_model_card(saved_mlm)
    assert path == saved_mlm / "README.md"
    card = ModelCard.load(path)
    validate_model_card(card)
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "fill-mask"
    assert "custom_code" in data["tags"]
    assert data["license"] == "apache-2.0"
    # No recorded evaluation -> no model-index, no dataset, no base model in the metadata.
    assert "model-index" not in data and "datasets" not in data and "base_model" not in data
    for section in ("## Training", "## Results", "## Loss curve"):
        body = card.text.split(section, 1)[1].split("\n## ", 1)[0]
        assert NOT_RECORDED in body, f"{section} should say {NOT_RECORDED!r}:\n{body}"
    assert "| metric | value |" not in card.text and "![" not in card.text
    assert "trust_remote_code=True" in card.text and "to_hf_bert" in card.text
    assert "Attention Is All You Need" in card.text and "Pre-training of Deep Bidirectional" in card.text


def test_card_results_match_recorded_metrics(saved_mlm):
    from huggingface_hub import ModelCard

    (saved_mlm / "training_facts.json").write_text(json.dumps(FACTS))
    (saved_mlm / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    card = ModelCard.load(save_model_card(saved_mlm, repo_id="someone/bert-impl-mlm"))
    validate_model_card(card)
    data = card.data
    assert data.base_model == FACTS["base_model"]
    assert data.datasets == ["wikitext"]
    assert data.model_name == "bert-impl-mlm"
    recorded = {r.metric_name: r.metric_value for r in data.eval_results}
    # Exactly the quality metrics, bit for bit; Trainer's bookkeeping stays out of the model-index.
    assert recorded == {"eval_loss": FACTS["metrics"]["eval_loss"], "perplexity": FACTS["metrics"]["perplexity"]}
    assert {r.metric_type for r in data.eval_results} == {"loss", "perplexity"}
    assert {(r.task_type, r.dataset_type, r.dataset_config) for r in data.eval_results} == {
        ("fill-mask", "wikitext", "wikitext-2-raw-v1")}
    for name, value in FACTS["metrics"].items():
        assert f"| {name} | {value:.6g} |" in card.text
    for name in FACTS["hyperparameters"]:
        assert f"| {name} |" in card.text
    assert "![training loss curve](loss_curve.png)" in card.text
    assert 'from_pretrained("someone/bert-impl-mlm", trust_remote_code=True)' in card.text


@pytest.mark.parametrize(
    "facts, message",
    [
        ({"metrics": {"eval_loss": float("nan")}}, "metric 'eval_loss' must be a finite number"),
        ({"metrics": {"accuracy": "high"}}, "metric 'accuracy' must be a finite number, got 'high'"),
        ({"hyperparameters": [1, 2]}, "'hyperparameters' must be an object"),
        ({"loss_curve": "missing.png"}, "names loss_curve 'missing.png'"),
    ],
)
def test_bad_training_facts_are_named(saved_mlm, facts, message):
    (saved_mlm / "training_facts.json").write_text(json.dumps(facts))
    with pytest.raises(ValueError, match=re.escape(message)):
        build_model_card(saved_mlm)


def test_card_refuses_a_directory_that_is_not_bert_impl(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert', not 'bert_impl'"):
        build_model_card(tmp_path)
    with pytest.raises(ValueError, match="has no config.json"):
        build_model_card(tmp_path / "nowhere")
