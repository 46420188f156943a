"""What a user with a real GLUE / CoNLL / Wikipedia-sized job meets: Hub-layout datasets with ClassLabel
features, placeholder test labels (-1) and MNLI's split names, entity-level NER scores, streamed corpora,
packed sequences, `--resume_from_checkpoint true`, and a usage error for every bad flag value.

The Hub-layout datasets are parquet files written by `datasets` (features in the schema) under
`data/{split}-00000-of-00001.parquet`, loaded with `--dataset_name DIR`: the same `load_dataset`
call, builder and ClassLabel features a Hub dataset goes through, offline."""

import json
import sys

import datasets
import pytest
import torch

from . import test_scripts
from .test_scripts import read_jsonl, script_args, write_jsonl


files, finetune, pretrain = test_scripts.files, test_scripts.finetune, test_scripts.pretrain  # the shared fixtures


SENTENCES = [
    "the with statement wraps a block",
    "a class defines a new type",
    "import binds a module name",
    "expressions are evaluated from left to right",
    "the for loop walks an iterable",
    "a function returns a value",
    "assignment binds a name to an object",
    "the try statement handles exceptions",
]


def hub_layout(root, splits: dict, pair: bool = True):
    """A dataset directory as the Hub stores one: data/{split}-00000-of-00001.parquet with ClassLabel labels."""
    features = (
        {"premise": datasets.Value("string"), "hypothesis": datasets.Value("string")}
        if pair
        else {"sentence": datasets.Value("string")}
    )
    features = datasets.Features(
        {**features, "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"])}
    )
    (root / "data").mkdir(parents=True)
    for split, labels in splits.items():
        rows = {"label": labels}
        if pair:
            rows.update(
                premise=[SENTENCES[i % 8] for i in range(len(labels))],
                hypothesis=[SENTENCES[(3 * i + 1) % 8] for i in range(len(labels))],
            )
        else:
            rows.update(sentence=[SENTENCES[i % 8] for i in range(len(labels))])
        datasets.Dataset.from_dict(rows, features=features).to_parquet(
            root / "data" / f"{split}-00000-of-00001.parquet"
        )
    return root


def test_glue_test_split_with_placeholder_labels_gets_predictions_only(finetune, files, tmp_path):
    """GLUE's test splits carry the ClassLabel placeholder -1. The script used to map it through
    names[-1] (the last class) and report test_* metrics against it; now the split is predicted and
    never scored, and training_facts.json and the model card say so."""
    data = hub_layout(
        tmp_path / "glue_like",
        {"train": [0, 1, 2, 0, 1, 2, 0, 1], "validation": [0, 1, 2, 2], "test": [-1] * 5},
        pair=False,
    )
    out = tmp_path / "out"
    metrics = finetune.main(
        script_args(
            model_name_or_path=files / "mlm",
            dataset_name=data,
            output_dir=out,
            max_steps=2,
            save_strategy="no",
        )
    )
    assert "eval_accuracy" in metrics
    assert not [k for k in metrics if k.startswith("test_")], metrics
    facts = json.loads((out / "training_facts.json").read_text())
    assert facts["test_metrics"] == {} and "test" in facts["unlabeled_splits"]
    assert "placeholder" in facts["unlabeled_splits"]["test"]
    predictions = read_jsonl(out / "predictions.jsonl")
    assert len(predictions) == 5 and all("label" not in p for p in predictions)
    assert all(p["prediction"] in ("entailment", "neutral", "contradiction") for p in predictions)
    card = (out / "README.md").read_text()
    assert "placeholder labels" in card and "`test`" in card


def test_mnli_split_names_are_evaluated(finetune, files, tmp_path):
    """MNLI: validation_matched is the evaluation split (Trainer's eval_*), validation_mismatched is
    reported beside it (its accuracy is the saved model's, recomputed here on its rows), test_matched /
    test_mismatched (-1 labels) get predictions only."""
    data = hub_layout(
        tmp_path / "mnli_like",
        {
            "train": [0, 1, 2, 0, 1, 2, 0, 1],
            "validation_matched": [0, 1, 2],
            "validation_mismatched": [2, 1, 0, 0],
            "test_matched": [-1, -1, -1],
            "test_mismatched": [-1, -1],
        },
    )
    out = tmp_path / "out"
    metrics = finetune.main(
        script_args(
            model_name_or_path=files / "mlm",
            dataset_name=data,
            output_dir=out,
            max_steps=2,
            save_strategy="no",
        )
    )
    assert "eval_accuracy" in metrics and not [k for k in metrics if k.startswith("test")]
    facts = json.loads((out / "training_facts.json").read_text())
    assert facts["dataset_split"] == "validation_matched"
    mismatched = facts["other_split_metrics"]
    assert "validation_mismatched_loss" in mismatched
    rows = datasets.load_dataset(str(data), split="validation_mismatched")
    assert mismatched["validation_mismatched_accuracy"] == pytest.approx(_saved_model_accuracy(out, rows), abs=1e-12)
    assert set(facts["unlabeled_splits"]) == {"test_matched", "test_mismatched"}
    assert len(read_jsonl(out / "predictions.jsonl")) == 3
    assert len(read_jsonl(out / "predictions_test_mismatched.jsonl")) == 2
    assert "validation_mismatched_accuracy" in (out / "README.md").read_text()


def _saved_model_accuracy(out, rows) -> float:
    """Accuracy of the classifier saved in `out` on premise / hypothesis rows, computed here: the saved weights with
    the speed layer, as the script evaluated them; argmax against the ClassLabel ids."""
    from transformers import AutoTokenizer

    from hf_bert_impl import BertImplForSequenceClassification, kernelize

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = kernelize(BertImplForSequenceClassification.from_pretrained(out).eval())
    enc = tokenizer(
        list(rows["premise"]), list(rows["hypothesis"]), padding=True, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        predicted = model(**enc).logits.argmax(-1).tolist()
    return sum(p == g for p, g in zip(predicted, list(rows["label"]))) / len(rows)


def test_some_placeholder_labels_among_real_ones_is_a_usage_error(finetune, files, tmp_path, monkeypatch, capsys):
    data = hub_layout(tmp_path / "holes", {"train": [0, 1, -1, 2, 0, 1], "validation": [0, 1]}, pair=False)
    argv = script_args(model_name_or_path=files / "mlm", dataset_name=data, output_dir=tmp_path / "o")
    monkeypatch.setattr(sys, "argv", ["finetune.py", *argv])
    capsys.readouterr()
    assert finetune.cli.run_cli(finetune.main) == 2
    err = capsys.readouterr().err.strip()  # datasets' "Generating ... split" progress bars, then the error
    assert "Traceback" not in err and err.splitlines()[-1].startswith("finetune.py: error: "), err
    assert "1 of 6 labels" in err and "placeholders" in err, err


# ----------------------------------------------------------------------------------------------
# Token classification: seqeval's entity-level scores


def test_entity_level_scores_follow_seqeval():
    """Worked by hand (CoNLL scoring): gold entities PER[0:2], LOC[3]; predicted PER[0:1], LOC[3].
    The PER span is cut short, so 1 of 2 predicted entities is right and 1 of 2 gold ones is found:
    precision = recall = f1 = 0.5, while token accuracy is 3/4."""
    import evaluate

    from hf_bert_impl.metrics import METRIC_PATH

    names = ["O", "B-PER", "I-PER", "B-LOC"]
    metric = evaluate.load(METRIC_PATH, "token_classification")
    scores = metric.compute(predictions=[[1, 0, 0, 3]], references=[[1, 2, 0, 3]], label_names=names)
    assert scores == {"accuracy": 0.75, "precision": 0.5, "recall": 0.5, "f1": 0.5}
    # A tag set that is not IOB (POS tags) keeps token-level F1: entities mean nothing there.
    pos = metric.compute(predictions=[[0, 1, 1]], references=[[0, 1, 2]], label_names=["NN", "VB", "DT"])
    assert set(pos) == {"accuracy", "f1_macro", "f1_micro"}


def _ner_rows():
    words = ["Guido", "van", "Rossum", "wrote", "Python", "in", "Amsterdam"]
    tags = ["B-PER", "I-PER", "I-PER", "O", "B-MISC", "O", "B-LOC"]
    return [{"tokens": words[i % 3 :], "ner_tags": tags[i % 3 :]} for i in range(12)]


def test_token_classification_reports_entity_scores(finetune, files, tmp_path):
    rows = _ner_rows()
    train, dev = write_jsonl(tmp_path / "ner.jsonl", rows), write_jsonl(tmp_path / "dev.jsonl", rows[:4])
    metrics = finetune.main(
        script_args(
            model_name_or_path=files / "mlm",
            output_dir=tmp_path / "ner",
            train_file=train,
            validation_file=dev,
            max_steps=2,
            save_strategy="no",
        )
    )
    assert {"eval_accuracy", "eval_precision", "eval_recall", "eval_f1"} <= set(metrics)
    assert "eval_f1_macro" not in metrics


def test_pack_sequences_gives_the_padded_runs_loss(finetune, files, tmp_path):
    """--pack_sequences (DataCollatorWithFlattening, the model's packed path) changes how a batch is laid
    out, not what is computed: without dropout, the first step's loss equals the padded run's."""
    from transformers import AutoTokenizer

    from hf_bert_impl import BertImplForMaskedLM

    model = BertImplForMaskedLM.from_pretrained(
        files / "mlm", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    model.save_pretrained(tmp_path / "no_dropout")
    AutoTokenizer.from_pretrained(files / "mlm").save_pretrained(tmp_path / "no_dropout")
    rows = _ner_rows()
    train = write_jsonl(tmp_path / "ner.jsonl", rows)
    losses = {}
    for name, extra in (("padded", []), ("packed", ["--pack_sequences"])):
        out = tmp_path / name
        finetune.main(
            script_args(
                *extra,
                model_name_or_path=tmp_path / "no_dropout",
                output_dir=out,
                train_file=train,
                max_steps=1,
                per_device_train_batch_size=12,
                learning_rate=0,
                save_strategy="no",
                task_type="token",
            )
        )
        losses[name] = [
            h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h
        ]
    assert losses["packed"] == pytest.approx(losses["padded"], abs=1e-5), losses


# ----------------------------------------------------------------------------------------------
# --resume_from_checkpoint true, and every new flag's usage error


def test_finetune_resume_from_checkpoint_true_takes_the_latest_checkpoint(finetune, files, tmp_path):
    """'true' means the latest checkpoint-* in --output_dir (Trainer's resume_from_checkpoint=True); it
    used to reach Trainer as the path "true"."""
    rows = [{"sentence": s, "label": i % 2} for i, s in enumerate(SENTENCES)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "cls"
    common = script_args(
        model_name_or_path=files / "mlm",
        output_dir=out,
        train_file=train,
        per_device_train_batch_size=4,
    )
    finetune.main([*common, "--max_steps", "2", "--save_steps", "1"])
    assert (out / "checkpoint-2").is_dir()
    finetune.main([*common, "--max_steps", "3", "--save_strategy", "no", "--resume_from_checkpoint", "true"])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]  # steps 1-2 come from the checkpoint


def _run_cli(script, argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    monkeypatch.setattr(script.Trainer, "train", lambda *a, **k: pytest.fail("training started"))
    capsys.readouterr()
    code = script.cli.run_cli(script.main)
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["--streaming"], "--streaming needs --max_steps"),
        (["--streaming", "--max_steps", "2", "--nsp"], "--streaming supports MLM"),
        (["--pack_sequences", "--nsp"], "--pack_sequences packs MLM sequences"),
        (["--pack_sequences", "--whole_word_mask"], "--pack_sequences cannot be combined with --whole_word_mask"),
        (["--pack_sequences", "--static_masking"], "--pack_sequences masks per batch"),
        (["--tokenizer_train_samples", "0"], "--tokenizer_train_samples must be a positive integer, got 0"),
        (["--resume_from_checkpoint", "true"], "--resume_from_checkpoint true: no checkpoint-* directory"),
        (["--resume_from_checkpoint", "nowhere"], "--resume_from_checkpoint nowhere: no such directory"),
        (["--dataset_name", "DATA"], "--dataset_name"),
        (["--kernels", "fastest"], "--kernels: kernels must be 'auto', 'reference' or kernel names"),
    ],
)
def test_pretrain_bad_flag_values_are_one_line_usage_errors(
    pretrain, files, tmp_path, monkeypatch, capsys, extra, problem
):
    """Includes --dataset_name together with --train_file, which ended in an UnboundLocalError traceback."""
    data = hub_layout(tmp_path / "data", {"train": [0, 1]}, pair=False)
    extra = [str(data) if e == "DATA" else e for e in extra]
    argv = script_args(*extra, output_dir=tmp_path / "o", train_file=files / "train.txt", model_size="debug")
    code, err = _run_cli(pretrain, argv, monkeypatch, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and problem in err, err
    if "DATA" in extra or str(data) in extra:
        assert "exclusive" in err


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["--pack_sequences"], "--pack_sequences needs token classification"),
        (["--resume_from_checkpoint", "true"], "--resume_from_checkpoint true: no checkpoint-* directory"),
        (["--dataset_name", "DATA"], "exclusive"),
        (["--kernels", "onednn_linear,fastest"], "got 'onednn_linear,fastest'"),
    ],
)
def test_finetune_bad_flag_values_are_one_line_usage_errors(
    finetune, files, tmp_path, monkeypatch, capsys, extra, problem
):
    data = hub_layout(tmp_path / "data", {"train": [0, 1]}, pair=False)
    train = write_jsonl(tmp_path / "train.jsonl", [{"sentence": s, "label": i % 2} for i, s in enumerate(SENTENCES)])
    extra = [str(data) if e == "DATA" else e for e in extra]
    argv = script_args(*extra, model_name_or_path=files / "mlm", output_dir=tmp_path / "o", train_file=train)
    code, err = _run_cli(finetune, argv, monkeypatch, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and problem in err, err


# ----------------------------------------------------------------------------------------------
# Streaming and packing in pretrain_mlm.py


def test_streamed_blocks_equal_the_loaded_ones(files):
    """tokenize_and_group on a streamed IterableDataset yields the same blocks as on the loaded Dataset."""
    from transformers import AutoTokenizer

    from hf_bert_impl import data as D

    tokenizer = AutoTokenizer.from_pretrained(files / "mlm")
    loaded = D.tokenize_and_group(D.load_data_files(str(files / "train.txt"))["train"], tokenizer, 16)
    streamed = D.tokenize_and_group(D.stream_data_file(files / "train.txt"), tokenizer, 16)
    assert isinstance(streamed, datasets.IterableDataset)
    rows = list(streamed)
    assert len(rows) == len(loaded) > 50
    assert [r["input_ids"] for r in rows] == loaded["input_ids"]


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_pretrain_streaming_from_local_files(pretrain, files, tmp_path, fmt):
    """--streaming on a text / JSON lines / parquet file: IterableDataset input, tokenizer trained from the
    stream's first --tokenizer_train_samples texts, blocks packed as they stream in; the run writes a
    complete model directory; its checkpoint (written while the model trains kernelized) holds no speed-layer field
    and keeps the config as it trains (sparse_prediction on: logits for the labelled tokens only, full logits without
    labels), while the final model is saved with sparse_prediction off."""
    texts = (files / "train.txt").read_text().splitlines()
    path = tmp_path / f"corpus.{fmt}"
    if fmt == "txt":
        path.write_text("\n".join(texts) + "\n")
    elif fmt == "jsonl":
        write_jsonl(path, [{"text": t} for t in texts])
    else:
        datasets.Dataset.from_dict({"text": texts}).to_parquet(path)
    out = tmp_path / "out"
    pretrain.main(
        script_args(
            output_dir=out,
            train_file=path,
            streaming=True,
            max_steps=3,
            save_steps=2,
            model_size="debug",
            max_seq_length=32,
            tokenizer_vocab_size=300,
            tokenizer_train_samples=60,
            per_device_train_batch_size=4,
        )
    )
    facts = json.loads((out / "training_facts.json").read_text())
    assert facts["hyperparameters"]["streaming"] is True and facts["hyperparameters"]["max_steps"] == 3
    checkpoint_config = json.loads((out / "checkpoint-2" / "config.json").read_text())
    assert checkpoint_config["sparse_prediction"] is True and "kernels" not in checkpoint_config
    assert facts["kernels"]["sparse_prediction"] is True  # the training ran with sparse prediction
    assert not json.loads((out / "config.json").read_text()).get("sparse_prediction", False)
    from hf_bert_impl import BertImplForMaskedLM

    model = BertImplForMaskedLM.from_pretrained(out / "checkpoint-2")
    ids = torch.randint(5, 100, (2, 9))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    assert model(ids, labels=labels).logits.shape == (2, model.config.vocab_size)
    assert model(ids).logits.shape == (2, 9, model.config.vocab_size)
    final = BertImplForMaskedLM.from_pretrained(out)
    assert final(ids, labels=labels).logits.shape == (2, 9, final.config.vocab_size)


def test_pretrain_pack_sequences(pretrain, files, tmp_path):
    """--pack_sequences: one sequence per text, a batch is one row with position_ids restarting at 0."""
    from transformers import AutoTokenizer

    from hf_bert_impl import data as D

    tokenizer = AutoTokenizer.from_pretrained(files / "mlm")
    docs = D.tokenize_documents(D.load_data_files(str(files / "train.txt"))["train"].select(range(6)), tokenizer, 24)
    collator = D.PackedMLMCollator(D.MLMCollator(tokenizer, seed=0))
    batch = collator([docs[i] for i in range(4)])
    lengths = [len(docs[i]["input_ids"]) for i in range(4)]
    assert batch["input_ids"].shape == (1, sum(lengths))
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    assert (batch["labels"] != -100).sum() > 0
    out = tmp_path / "packed"
    pretrain.main(
        script_args(
            output_dir=out,
            train_file=files / "train.txt",
            pack_sequences=True,
            max_steps=2,
            model_size="debug",
            max_seq_length=32,
            tokenizer_vocab_size=300,
            per_device_train_batch_size=4,
            save_strategy="no",
        )
    )
    assert json.loads((out / "training_facts.json").read_text())["hyperparameters"]["pack_sequences"] is True
