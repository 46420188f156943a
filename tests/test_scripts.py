"""The command-line scripts end to end on tiny local data: pretrain_mlm.py, finetune.py (sequence
pairs, regression, token classification, early stopping), demo_reload.py, the speed layer the scripts
apply (`--kernels`) and the plain model they save, and bad input files that must stop before any
training with a one-line message and a non-zero exit.

The scripts run in this process through their `main(argv)` / `cli.run_cli(main)` (an interpreter start costs
seconds on this machine); one test per script runs the real command line in a subprocess."""

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from hf_bert_impl import (
    BertImplConfig,
    BertImplForMaskedLM,
    BertImplForPreTraining,
    finetuning,
    kernelize,
    kernelized,
    pretraining,
)
from hf_bert_impl import data as D
from hf_bert_impl.data import default_corpus_dataset, statement_topic_task, train_wordpiece_tokenizer, word_order_task
from hf_bert_impl.hub import CODE_FILES
from hf_bert_impl.saving import STAGING_PREFIX

from .conftest import REPO_ROOT, SCRIPTS, load_script


FAST = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1", "--seed", "5"]


def script_args(*extra: str, **options) -> list[str]:
    """A script's command line for a quick run: each option as `--name value` (True: the bare flag), then `extra`
    as given, then FAST: script_args(output_dir=out, max_steps=2) == ["--output_dir", str(out), "--max_steps", "2",
    *FAST]."""
    argv = []
    for name, value in options.items():
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return [*argv, *extra, *FAST]


@pytest.fixture(scope="module")
def pretrain():
    return pretraining


@pytest.fixture(scope="module")
def finetune():
    return finetuning


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny inputs: a text file of 120 corpus paragraphs, a WordPiece tokenizer (vocab <= 400), and a
    debug-size BertImplForMaskedLM saved with it (the starting point of the fine-tuning tests)."""
    root = tmp_path_factory.mktemp("inputs")
    texts = default_corpus_dataset()["train"]["text"]
    (root / "train.txt").write_text("\n".join(texts[:120]) + "\n", encoding="utf-8")
    (root / "valid.txt").write_text("\n".join(texts[120:150]) + "\n", encoding="utf-8")
    tokenizer = train_wordpiece_tokenizer(texts[:300], vocab_size=400)
    torch.manual_seed(0)
    config = BertImplConfig.from_preset("debug", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model_dir = root / "mlm"
    BertImplForMaskedLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return root


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def write_jsonl(path, rows):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def assert_hub_directory(out: Path, architecture: str):
    """Weights, config with auto_map for the head, the Hub code files (the plain model only: no kernel file), a
    tokenizer, training_args.bin, facts, PNG, card; no field of the speed layer in the config and the training option
    sparse_prediction off (the saved model gives full logits), no staging folder left."""
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bert_impl" and config["architectures"] == [architecture]
    assert config["auto_map"]["AutoConfig"] == "configuration_bert_impl.BertImplConfig"
    assert "kernels" not in config and not config.get("sparse_prediction", False), sorted(config)
    for name in (
        "model.safetensors",
        *CODE_FILES,
        "tokenizer.json",
        "tokenizer_config.json",
        "training_args.bin",
        "training_facts.json",
        "loss_curve.png",
        "README.md",
    ):
        assert (out / name).is_file(), f"{name} missing from {out}"
    assert sorted(p.name for p in out.glob("*_bert_impl.py")) == sorted(CODE_FILES)
    assert not list(out.glob(STAGING_PREFIX + "*")), "a staging folder was left behind"
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return config, json.loads((out / "training_facts.json").read_text())


def recomputed_accuracies(
    out: Path,
    validation_file: Path,
    *,
    seed: int,
    max_seq_length: int,
    batch_size: int = 8,
    whole_word_mask: bool = False,
    nsp: bool = False,
) -> dict:
    """The held-out accuracies of the model saved in `out`, recomputed here, outside the script's metric code: its
    validation file cut into blocks (pairs with `nsp`) and masked once with seed + 1 as pretrain_mlm.py does, the
    saved weights kernelized as the script evaluated them (auto, with the model option sparse_prediction) in its
    evaluation batches, argmax against the labels. The masking rate is the one training_facts.json says the
    held-out blocks were masked at. Returns the accuracies and the number of masked positions."""
    from transformers import AutoTokenizer

    rate = json.loads((out / "training_facts.json").read_text())["hyperparameters"]["eval_mlm_probability"]

    tokenizer = AutoTokenizer.from_pretrained(out)
    texts = D.load_data_files(validation_file=str(validation_file))["validation"]
    blocks = (
        D.nsp_examples(texts, tokenizer, max_seq_length, seed)
        if nsp
        else D.tokenize_and_group(texts, tokenizer, max_seq_length, with_offsets=whole_word_mask)
    )
    held_out = D.mask_once(blocks, tokenizer, seed + 1, rate, whole_word_mask)
    model = (BertImplForPreTraining if nsp else BertImplForMaskedLM).from_pretrained(out).eval()
    model.config.sparse_prediction = True
    kernelize(model, "auto")
    collate = D.MLMCollator(tokenizer)  # examples masked once already: only padded
    hits = positions = pair_hits = 0
    for start in range(0, len(held_out), batch_size):
        batch = collate([held_out[i] for i in range(start, min(start + batch_size, len(held_out)))])
        with torch.no_grad():
            output = model(**batch)
        labelled = batch["labels"] != D.IGNORE_INDEX
        predicted = (output.prediction_logits if nsp else output.logits).argmax(-1)
        if predicted.shape == labelled.shape:  # full (b, s) logits; sparse ones are already one row per label
            predicted = predicted[labelled]
        hits += int((predicted == batch["labels"][labelled]).sum())
        positions += int(labelled.sum())
        if nsp:
            pair_hits += int((output.seq_relationship_logits.argmax(-1) == batch["next_sentence_label"]).sum())
    result = {"masked_accuracy": hits / positions, "positions": positions}
    if nsp:
        result["nsp_accuracy"] = pair_hits / len(held_out)
    return result


# ----------------------------------------------------------------------------------------------
# pretrain_mlm.py


def test_pretrain_mlm_writes_a_complete_hub_directory(pretrain, files, tmp_path):
    """MLM with whole-word masking on a local txt file, a WordPiece trained on it, evaluation on a
    validation file: the masked accuracy is the one recomputed from the saved model's predictions on
    the held-out blocks, perplexity = exp(eval_loss), the card names them, and the directory loads
    with AutoModelForMaskedLM + trust_remote_code."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    out = tmp_path / "mlm"
    metrics = pretrain.main(
        script_args(
            output_dir=out,
            train_file=files / "train.txt",
            validation_file=files / "valid.txt",
            model_size="debug",
            max_seq_length=32,
            tokenizer_vocab_size=300,
            whole_word_mask=True,
            max_steps=4,
            per_device_train_batch_size=4,
            save_strategy="no",
        )
    )
    recomputed = recomputed_accuracies(out, files / "valid.txt", seed=5, max_seq_length=32, whole_word_mask=True)
    assert recomputed["positions"] > 50
    assert metrics["eval_masked_accuracy"] == pytest.approx(recomputed["masked_accuracy"], abs=1e-12), recomputed
    assert math.isclose(metrics["perplexity"], math.exp(metrics["eval_loss"]), rel_tol=1e-9)
    config, facts = assert_hub_directory(out, "BertImplForMaskedLM")
    assert facts["task"] == "fill-mask" and facts["dataset"] == "train.txt" and facts["base_model"] is None
    assert facts["hyperparameters"]["whole_word_mask"] is True and facts["hyperparameters"]["max_steps"] == 4
    # the defaults: masking 30%, held out at the training rate, dropout off while pretraining
    assert facts["hyperparameters"]["mlm_probability"] == facts["hyperparameters"]["eval_mlm_probability"] == 0.3
    assert facts["hyperparameters"]["pretraining_dropout"] == [0.0, 0.0]
    assert facts["metrics"]["eval_masked_accuracy"] == pytest.approx(metrics["eval_masked_accuracy"])
    card = (out / "README.md").read_text()
    assert "masked_accuracy" in card and "loss_curve.png" in card
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) <= 300 and config["vocab_size"] == len(tokenizer)
    model = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)
    assert type(model).__name__ == "BertImplForMaskedLM"
    state = json.loads((out / "trainer_state.json").read_text())
    assert len([h for h in state["log_history"] if "loss" in h]) == 4


def test_pretrain_with_next_sentence_prediction(pretrain, files, tmp_path):
    """--nsp trains BertImplForPreTraining on sentence pairs and reports the NSP and masked accuracies: those
    recomputed from the saved model's predictions on the held-out pairs."""
    out = tmp_path / "nsp"
    metrics = pretrain.main(
        script_args(
            output_dir=out,
            train_file=files / "train.txt",
            validation_file=files / "valid.txt",
            tokenizer_name=files / "mlm",
            model_size="debug",
            max_seq_length=48,
            nsp=True,
            max_steps=3,
            per_device_train_batch_size=4,
            save_strategy="no",
        )
    )
    recomputed = recomputed_accuracies(out, files / "valid.txt", seed=5, max_seq_length=48, nsp=True)
    assert metrics["eval_nsp_accuracy"] == pytest.approx(recomputed["nsp_accuracy"], abs=1e-12), recomputed
    assert metrics["eval_masked_accuracy"] == pytest.approx(recomputed["masked_accuracy"], abs=1e-12), recomputed
    assert_hub_directory(out, "BertImplForPreTraining")


def test_pretrain_continues_from_a_transformers_bert_checkpoint(pretrain, minilm_dir, tmp_path):
    """--model_name_or_path on a real transformers BertModel (all-MiniLM-L6-v2): converted on the fly,
    its tokenizer used, trained 2 steps, saved as bert_impl with the base model recorded."""
    out = tmp_path / "cont"
    pretrain.main(
        script_args(
            output_dir=out,
            model_name_or_path=minilm_dir,
            max_seq_length=16,
            max_train_samples=8,
            max_eval_samples=4,
            max_steps=2,
            per_device_train_batch_size=2,
            save_strategy="no",
        )
    )
    config, facts = assert_hub_directory(out, "BertImplForMaskedLM")
    assert config["num_hidden_layers"] == 6 and config["hidden_size"] == 384
    assert config["position_embedding_type"] == "learned"
    assert facts["base_model"] == str(minilm_dir)


@pytest.mark.parametrize("flag", ["--gradient_checkpointing", "--bf16"])
def test_pretrain_training_flags(pretrain, files, tmp_path, flag):
    """--gradient_checkpointing and --bf16 (CPU autocast here) run through and give a finite loss."""
    out = tmp_path / flag.strip("-")
    pretrain.main(
        script_args(
            flag,
            output_dir=out,
            train_file=files / "train.txt",
            tokenizer_name=files / "mlm",
            model_size="debug",
            max_seq_length=16,
            max_steps=2,
            per_device_train_batch_size=4,
            validation_split_percentage=0,
            save_strategy="no",
        )
    )
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


# ----------------------------------------------------------------------------------------------
# finetune.py


def test_finetune_sentence_pairs_with_string_labels_and_unlabelled_test_file(finetune, files, tmp_path):
    """GLUE-style csv (sentence1, sentence2, label in {no, yes}): classes from the strings,
    metrics from the shipped evaluate module, predictions.jsonl with one label name per test row."""
    import csv

    rows = [
        {"sentence1": f"the value {i} is", "sentence2": f"number {i % 3}", "label": "yes" if i % 2 else "no"}
        for i in range(24)
    ]
    for name, part in (("train", rows[:16]), ("dev", rows[16:])):
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["sentence1", "sentence2", "label"])
            w.writeheader()
            w.writerows(part)
    with open(tmp_path / "test.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["sentence1", "sentence2"])
        w.writeheader()
        w.writerows({k: r[k] for k in ("sentence1", "sentence2")} for r in rows[:5])
    out = tmp_path / "pairs"
    metrics = finetune.main(
        script_args(
            model_name_or_path=files / "mlm",
            output_dir=out,
            train_file=tmp_path / "train.csv",
            validation_file=tmp_path / "dev.csv",
            test_file=tmp_path / "test.csv",
            max_steps=3,
            per_device_train_batch_size=8,
            save_strategy="no",
        )
    )
    assert set(metrics) >= {"eval_accuracy", "eval_f1", "eval_matthews_correlation", "eval_loss"}
    config, facts = assert_hub_directory(out, "BertImplForSequenceClassification")
    assert config["id2label"] == {"0": "no", "1": "yes"} and config["problem_type"] == "single_label_classification"
    assert facts["task"] == "text-classification" and facts["labels"] == ["no", "yes"]
    predictions = read_jsonl(out / "predictions.jsonl")
    assert [p["sentence1"] for p in predictions] == [r["sentence1"] for r in rows[:5]]
    assert all(p["prediction"] in ("no", "yes") and "label" not in p for p in predictions)


def test_finetune_regression_on_float_labels(finetune, files, tmp_path):
    """A float label column means regression: one output, MSE loss, pearson/spearmanr metrics."""
    rows = [{"sentence": f"score {i} of ten", "label": float(i % 5) / 4} for i in range(20)]
    train = write_jsonl(tmp_path / "train.jsonl", rows[:14])
    dev = write_jsonl(tmp_path / "dev.jsonl", rows[14:])
    out = tmp_path / "reg"
    metrics = finetune.main(
        script_args(
            model_name_or_path=files / "mlm",
            output_dir=out,
            train_file=train,
            validation_file=dev,
            max_steps=2,
            per_device_train_batch_size=7,
            save_strategy="no",
        )
    )
    assert {"eval_pearson", "eval_spearmanr", "eval_mse"} <= set(metrics)
    config, _ = assert_hub_directory(out, "BertImplForSequenceClassification")
    assert config["problem_type"] == "regression" and len(config["id2label"]) == 1
    predictions = read_jsonl(out / "predictions.jsonl")
    assert len(predictions) == 6 and all(isinstance(p["prediction"], float) for p in predictions)


def test_finetune_token_classification_aligns_word_labels(finetune, files, tmp_path):
    """tokens + ner_tags (string tags): labels go to the first WordPiece of each word, the others are
    ignored (-100); predictions.jsonl holds one tag per word."""
    words = ["Python", "evaluates", "expressions", "from", "left", "to", "right", "unconditionally"]
    rows = [
        {"tokens": words[i % 3 :], "ner_tags": ["B-X" if w[0].isupper() else "O" for w in words[i % 3 :]]}
        for i in range(12)
    ]
    train = write_jsonl(tmp_path / "ner.jsonl", rows)
    dev = write_jsonl(tmp_path / "ner_dev.jsonl", rows[:4])

    # The alignment the script uses: first WordPiece of a word -> its tag, other pieces and specials -100.
    from transformers import AutoTokenizer

    from hf_bert_impl.data import align_word_labels

    tokenizer = AutoTokenizer.from_pretrained(files / "mlm")
    word_ids = tokenizer(words, is_split_into_words=True).word_ids()
    tags = list(range(10, 10 + len(words)))
    aligned = align_word_labels(word_ids, tags)
    assert len(word_ids) > len(words) + 2, "the test needs a word split into several pieces"
    assert [a for a in aligned if a != -100] == tags  # each word labelled exactly once, in order
    assert aligned[0] == aligned[-1] == -100  # [CLS], [SEP]
    firsts = [i for i, w in enumerate(word_ids) if w is not None and (i == 0 or word_ids[i - 1] != w)]
    assert [aligned[i] for i in firsts] == tags
    assert align_word_labels(word_ids, tags, label_all_tokens=True)[1:-1] == [tags[w] for w in word_ids[1:-1]]

    out = tmp_path / "ner"
    metrics = finetune.main(
        script_args(
            model_name_or_path=files / "mlm",
            output_dir=out,
            train_file=train,
            validation_file=dev,
            max_steps=2,
            per_device_train_batch_size=6,
            save_strategy="no",
        )
    )
    assert {"eval_accuracy", "eval_precision", "eval_recall", "eval_f1"} <= set(metrics)  # seqeval, IOB tags
    config, facts = assert_hub_directory(out, "BertImplForTokenClassification")
    assert config["id2label"] == {"0": "B-X", "1": "O"} and facts["task"] == "token-classification"
    predictions = read_jsonl(out / "predictions.jsonl")
    assert len(predictions) == 4
    for p, r in zip(predictions, rows[:4]):
        assert len(p["prediction"]) == len(r["tokens"]) and set(p["prediction"]) <= {"O", "B-X"}
        assert p["label"] == r["ner_tags"]


def test_finetune_early_stopping_stops_when_the_eval_loss_stalls(finetune, files, tmp_path):
    """learning rate 0: the evaluation loss never improves, so patience 1 stops after the second
    evaluation, far before the 20 epochs asked for."""
    rows = [{"sentence": f"a sentence number {i}", "label": i % 2} for i in range(8)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "es"
    finetune.main(
        script_args(
            model_name_or_path=files / "mlm",
            output_dir=out,
            train_file=train,
            validation_file=train,
            num_train_epochs=20,
            per_device_train_batch_size=8,
            learning_rate=0,
            eval_strategy="epoch",
            save_strategy="epoch",
            load_best_model_at_end=True,
            early_stopping_patience=1,
        )
    )
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2, f"expected a stop after 2 epochs, ran {state['global_step']} steps"


@pytest.mark.slow
def test_finetune_embedded_task_and_fresh_process_reload(finetune, files, tmp_path):
    """No data option: the embedded statement-topic task. Then demo_reload.py, in a fresh process
    that cannot import hf_bert_impl, loads the result through trust_remote_code, predicts the test
    split and agrees with the fine-tuning run's own predictions on every row."""
    from .conftest import run_without_package

    out = tmp_path / "topic"
    metrics = finetune.main(
        script_args(
            model_name_or_path=files / "mlm",
            output_dir=out,
            max_steps=2,
            per_device_train_batch_size=16,
            per_device_eval_batch_size=128,
            max_seq_length=48,
            save_strategy="no",
        )
    )
    task = statement_topic_task()
    assert "test_accuracy" in metrics
    facts = json.loads((out / "training_facts.json").read_text())
    assert facts["dataset"].startswith("embedded statement-topic task") and facts["labels"] == ["other", "statement"]
    assert facts["test_metrics"]["test_accuracy"] == pytest.approx(metrics["test_accuracy"])
    assert facts["dataset_split"] == "validation" and all(k.startswith("eval_") for k in facts["metrics"])
    kernels = facts["kernels"]  # fine-tuned with the speed layer (no MLM head: no sparse prediction)
    assert (
        kernels["setting"] == "auto"
        and kernels["sparse_prediction"] is False
        and kernels["kernelized"]["unpadded_encoder_forward"] == 1
    )
    predictions = read_jsonl(out / "predictions.jsonl")
    assert [p["sentence"] for p in predictions] == task["test"]["sentence"]
    assert [p["label"] for p in predictions] == [["other", "statement"][y] for y in task["test"]["label"]]
    # The saved tokenizer truncates as fine-tuning did, so the reload below sees the same 48 tokens
    # (some test sentences are longer: without it, a reload predicted one of 143 rows differently).
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out)
    assert saved.model_max_length == 48
    assert max(len(ids) for ids in saved(list(task["test"]["sentence"]), truncation=True)["input_ids"]) == 48

    data_file = tmp_path / "test.jsonl"
    task["test"].to_json(str(data_file))
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['demo_reload.py', '--model_dir', {str(out)!r}, '--data_file', {str(data_file)!r}]\n"
        f"runpy.run_path({str(SCRIPTS / 'demo_reload.py')!r}, run_name='__main__')\n"
    )
    result = run_without_package(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transformers_modules" in result.stdout, result.stdout
    assert (
        f"agreement with the fine-tuning run's own predictions: {len(predictions)}/{len(predictions)}" in result.stdout
    )
    n = len(predictions)
    correct = round(metrics["test_accuracy"] * n)
    assert f"{n} rows of test.jsonl: {correct}/{n} correct" in result.stdout, result.stdout


def test_embedded_tasks_labels_come_from_the_text():
    """statement_topic: label 1 exactly for sentences of sections titled as statements; word_order:
    label 0 rows are permutations of a real corpus sentence, different from it; splits are disjoint."""
    from hf_bert_impl.data import _corpus_sentences

    source = dict(_corpus_sentences(6, 40))
    topic = statement_topic_task()
    for split in topic.values():
        for row in split:
            assert row["label"] == int("statement" in source[row["sentence"]]["title"].lower())
    assert 0.15 < sum(topic["train"]["label"]) / len(topic["train"]) < 0.85

    order = word_order_task()
    by_bag = {}
    for original in source:
        by_bag.setdefault(tuple(sorted(original.split())), set()).add(original)
    for row in order["train"]:
        if row["label"] == 1:
            assert row["sentence"] in source
        else:  # the words of one real sentence, in an order that is not that sentence's
            candidates = by_bag[tuple(sorted(row["sentence"].split()))]
            assert candidates and row["sentence"] not in candidates
    for task in (topic, order):
        sets = [set(task[k]["sentence"]) for k in ("train", "validation", "test")]
        assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])


# ----------------------------------------------------------------------------------------------
# Bad input: a one-line message naming the file and the problem, non-zero exit, no training


def _bad_train_files(tmp_path, script):
    missing = tmp_path / "does_not_exist.csv"
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    wrong = tmp_path / "wrong_column.csv"
    wrong.write_text("body,target\nsome words here,1\nmore words there,0\n")
    return [
        (missing, "no such file"),
        (empty, "the file is empty"),
        (wrong, "missing column(s) ['text']" if script == "pretrain_mlm" else "no text column"),
    ]


@pytest.mark.parametrize("script_name", ["pretrain_mlm", "finetune"])
def test_bad_train_file_stops_before_training_with_one_line(script_name, files, tmp_path, monkeypatch, capsys):
    script = {"pretrain_mlm": pretraining, "finetune": finetuning}[script_name]
    trained = []
    monkeypatch.setattr(script.Trainer, "train", lambda *a, **k: trained.append(1))
    for path, problem in _bad_train_files(tmp_path, script_name):
        out = tmp_path / f"out_{path.stem}"
        argv = script_args(output_dir=out, train_file=path)
        if script_name == "finetune":
            argv += ["--model_name_or_path", str(files / "mlm")]
        monkeypatch.setattr(sys, "argv", [f"{script_name}.py", *argv])
        code = script.cli.run_cli(script.main)
        err = capsys.readouterr().err.strip()
        assert code == 2
        assert len(err.splitlines()) == 1, repr(err)
        assert str(path) in err and problem in err, err
        assert not (out / "model.safetensors").exists()
    assert not trained


@pytest.mark.slow
def test_bad_train_file_on_the_real_command_line(files, tmp_path):
    """The same through a real interpreter: exit status 2, stderr is exactly one line, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "finetune.py"),
            "--model_name_or_path",
            str(files / "mlm"),
            "--output_dir",
            str(tmp_path / "o"),
            "--train_file",
            str(tmp_path / "nope.jsonl"),
            "--use_cpu",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert lines == [f"finetune.py: error: --train_file {tmp_path / 'nope.jsonl'}: no such file"], result.stderr


def test_masked_accuracy_is_the_same_with_sparse_and_full_predictions(pretrain):
    """pretrain_mlm evaluates with sparse prediction (one logit row per masked position, put back on the (b, s)
    grid); the plain model gives full logits: both layouts must score the same positions the same way. The labels
    are built so that the accuracy is known in advance: of the masked positions, exactly those of even rank carry the
    plain model's argmax, the others a different token."""
    from transformers import EvalPrediction

    from hf_bert_impl.data import IGNORE_INDEX

    torch.manual_seed(0)
    config = BertImplConfig.from_preset(
        "debug", vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    model = BertImplForMaskedLM(config).eval()
    batches, hits, positions = [], 0, 0
    for _ in range(3):  # Trainer concatenates evaluation batches in order
        ids = torch.randint(1, 50, (4, 9))
        with torch.no_grad():
            argmax = model(ids).logits.argmax(-1)  # the plain model, (4, 9)
        chosen = (torch.rand(4, 9) < 0.3).reshape(-1)
        chosen[0] = True
        rank = torch.cumsum(chosen.long(), 0) - 1  # the masked positions numbered in order
        right = chosen & (rank % 2 == 0)
        labels = torch.where(right, argmax.reshape(-1), (argmax.reshape(-1) + 1) % 50)
        labels = torch.where(chosen, labels, torch.full_like(labels, IGNORE_INDEX)).reshape(4, 9)
        hits, positions = hits + int(right.sum()), positions + int(chosen.sum())
        batches.append((ids, labels))
    results = {}
    for sparse in (False, True):
        model.config.sparse_prediction = sparse  # sparse: logits (n, V) for the labelled tokens; full: (b, s, V)
        with torch.no_grad():
            logits = [model(ids, labels=labels).logits for ids, labels in batches]
        assert [tuple(x.shape) for x in logits] == [
            ((int((l != IGNORE_INDEX).sum()), 50) if sparse else (4, 9, 50)) for _, l in batches
        ]
        preds = [pretrain.preprocess_logits_for_metrics(x, l) for x, (_, l) in zip(logits, batches)]
        assert all(p.shape == l.shape for p, (_, l) in zip(preds, batches))  # sparse ids go back on the (b, s) grid
        results[sparse] = pretrain.compute_metrics(
            EvalPrediction(predictions=torch.cat(preds).numpy(), label_ids=torch.cat([l for _, l in batches]).numpy())
        )
    assert results[True] == results[False] == {"masked_accuracy": pytest.approx(hits / positions, abs=1e-12)}
    assert 0 < hits < positions


def _built_model(script, monkeypatch) -> dict:
    """Patches the script's Trainer to keep the model it is given: {"model": ...} after main()."""
    seen = {}

    class Keeping(script.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["model"] = self.model

    monkeypatch.setattr(script, "Trainer", Keeping)
    return seen


def test_pretrain_mlm_applies_the_speed_layer_and_saves_the_plain_model(pretrain, files, tmp_path, monkeypatch):
    """Default --kernels auto: the model trains kernelized (the table's kernels) with sparse prediction, recorded in
    training_facts.json (the setting, the kernels per mode, how many modules run each kernel function, sparse
    prediction), and the save is the plain model's: config.json without a kernels field, sparse_prediction off, the
    same as a --kernels reference run's, the same files and weight names and shapes, full (b, s, V) logits once
    loaded. --kernels reference trains the plain model (no module kernelized), with sparse prediction still on (a model
    option, not a kernel). The auto run saves into a symlinked folder that holds another file: the link stays a link,
    the other file stays, no staging folder is left."""
    from safetensors import safe_open

    from hf_bert_impl.cli import UsageError

    target = tmp_path / "target"
    target.mkdir()
    (target / "notes.txt").write_text("kept")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    common = script_args(
        train_file=files / "train.txt",
        tokenizer_name=files / "mlm",
        model_size="debug",
        max_seq_length=16,
        max_steps=2,
        per_device_train_batch_size=4,
        validation_split_percentage=0,
        save_strategy="no",
    )
    with pytest.raises(UsageError, match="--kernels: kernels must be .* got 'fastest'"):
        pretrain.main(["--output_dir", str(tmp_path / "bad"), *common, "--kernels", "fastest"])
    seen = _built_model(pretrain, monkeypatch)
    pretrain.main(["--output_dir", str(link), *common])  # --kernels auto, --sparse_prediction: the defaults
    auto_model = seen["model"]
    facts = json.loads((target / "training_facts.json").read_text())["kernels"]
    assert facts["setting"] == "auto" and facts["sparse_prediction"] is True
    assert facts["kernels"] == {"training": ["unpadded"], "inference": ["unpadded"]}  # CPU, float32
    layers = auto_model.config.num_hidden_layers
    assert facts["kernelized"] == {"attention_function": layers, "unpadded_encoder_forward": 1}
    assert facts["kernelized"] == dict(sorted(Counter(kernelized(auto_model).values()).items()))
    assert link.is_symlink() and (target / "notes.txt").read_text() == "kept"
    assert not list(target.glob(STAGING_PREFIX + "*")) and (target / "model.safetensors").is_file()

    seen.clear()
    plain_out = tmp_path / "plain"
    pretrain.main(["--output_dir", str(plain_out), *common, "--kernels", "reference"])
    assert kernelized(seen["model"]) == {}
    assert json.loads((plain_out / "training_facts.json").read_text())["kernels"] == {
        "setting": "reference",
        "kernels": {"training": [], "inference": []},
        "kernelized": {},
        "sparse_prediction": True,
    }

    configs = [json.loads((d / "config.json").read_text()) for d in (target, plain_out)]
    assert "kernels" not in configs[0] and not configs[0].get("sparse_prediction", False)
    assert configs[0] == configs[1]
    assert sorted(p.name for p in target.iterdir() if p.name != "notes.txt") == sorted(
        p.name for p in plain_out.iterdir()
    )
    shapes = []
    for d in (target, plain_out):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            shapes.append({k: f.get_slice(k).get_shape() for k in f.keys()})
    assert shapes[0] == shapes[1]
    loaded = BertImplForMaskedLM.from_pretrained(target).eval()
    ids = torch.randint(5, 100, (2, 9))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    assert loaded(ids, labels=labels).logits.shape == (2, 9, loaded.config.vocab_size)


def _dropout_rates(model) -> tuple[set, set]:
    """({p of every nn.Dropout}, {attention_dropout of every attention module}) of a model."""
    hidden = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    return hidden, {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")}


def test_pretraining_dropout_is_off_while_pretraining_and_the_saved_config_keeps_its_rates(
    pretrain, files, tmp_path, monkeypatch
):
    """The defaults pretrain at 30% masking with every dropout off (the model in train mode gives the same output
    twice, kernels applied), while config.json keeps BERT's 0.1 / 0.1, so the saved model fine-tunes with them;
    --pretraining_dropout 0.25 trains every dropout at 0.25, 'config' at the config's own rates (here overridden);
    a rate outside [0, 1) stops before training, naming the value."""
    from hf_bert_impl.cli import UsageError

    common = script_args(
        train_file=files / "train.txt",
        tokenizer_name=files / "mlm",
        model_size="debug",
        max_seq_length=16,
        max_steps=2,
        per_device_train_batch_size=4,
        validation_split_percentage=0,
        save_strategy="no",
    )
    seen = _built_model(pretrain, monkeypatch)
    runs = {
        "default": [],
        "0.25": ["--pretraining_dropout", "0.25"],
        "config": ["--pretraining_dropout", "config", "--config_overrides", "hidden_dropout_prob=0.2"],
    }
    expected = {
        "default": ([0.0, 0.0], [0.1, 0.1]),
        "0.25": ([0.25, 0.25], [0.1, 0.1]),
        "config": ([0.2, 0.1], [0.2, 0.1]),
    }
    for name, options in runs.items():
        out = tmp_path / name
        pretrain.main(["--output_dir", str(out), *common, *options])
        trained_with, saved = expected[name]
        model = seen["model"]
        assert _dropout_rates(model) == ({trained_with[0]}, {trained_with[1]}), name
        facts = json.loads((out / "training_facts.json").read_text())["hyperparameters"]
        assert facts["pretraining_dropout"] == trained_with and facts["mlm_probability"] == 0.3, facts
        config = json.loads((out / "config.json").read_text())
        assert [config["hidden_dropout_prob"], config["attention_probs_dropout_prob"]] == saved, name
        reloaded = BertImplForMaskedLM.from_pretrained(out)
        assert _dropout_rates(reloaded) == ({saved[0]}, {saved[1]}), name  # fine-tuning runs with the config's
        if name == "default":
            model.train()
            ids = torch.randint(5, 100, (2, 12))
            with torch.no_grad():
                first, second = model(ids).logits, model(ids).logits
            assert torch.equal(first, second), "dropout is still on while pretraining"
    for bad in ("1.5", "-0.1", "off"):
        with pytest.raises(UsageError, match=f"--pretraining_dropout must be a rate in \\[0, 1\\) .*got '{bad}'"):
            pretrain.main(["--output_dir", str(tmp_path / "bad"), *common, "--pretraining_dropout", bad])
    assert not (tmp_path / "bad" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "name, option",
    [("pretrain_mlm", "--time_budget"), ("finetune", "--output_dir"), ("benchmark_pretraining", "--budget")],
)
def test_help_lists_the_options(name, option, capsys):
    """`--help` prints every option (a bare % in a help text used to crash argparse's formatting)."""
    with pytest.raises(SystemExit) as exit_info:
        load_script(name).main(["--help"])
    assert exit_info.value.code == 0 and option in capsys.readouterr().out


def test_pretrain_mlm_trains_with_its_recipe_unless_told_otherwise(pretrain, tmp_path, monkeypatch, capsys):
    """pretrain_mlm.py's own defaults (docs/training.md's ablation: batch 16, learning rate 1e-3, warm-up 10%,
    masking 30%, dropout off) in place of TrainingArguments' fine-tuning ones (batch 8, 5e-5, no warm-up), from the
    flags and from a JSON file of arguments alike, in --help too; a value the user gives wins."""
    warmup = "warmup_ratio" if hasattr(pretrain.TrainingArguments, "warmup_ratio") else "warmup_steps"

    def recipe(parsed):
        model_args, data_args, _, training = parsed
        return (
            training.per_device_train_batch_size,
            training.learning_rate,
            getattr(training, warmup),
            data_args.mlm_probability,
            model_args.pretraining_dropout,
        )

    assert recipe(pretrain.parse_arguments(["--output_dir", str(tmp_path)])) == (16, 1e-3, 0.1, 0.3, "0")
    given = ["--per_device_train_batch_size", "4", "--learning_rate", "5e-4", f"--{warmup}", "0.2"]
    assert recipe(pretrain.parse_arguments(["--output_dir", str(tmp_path), *given])) == (4, 5e-4, 0.2, 0.3, "0")

    arguments = tmp_path / "args.json"
    arguments.write_text(json.dumps({"output_dir": str(tmp_path), "learning_rate": 2e-4}))
    monkeypatch.setattr(sys, "argv", ["pretrain_mlm.py", str(arguments)])
    assert recipe(pretrain.parse_arguments()) == (16, 2e-4, 0.1, 0.3, "0")
    arguments.write_text("[1, 2]")
    with pytest.raises(pretrain.cli.UsageError, match=r"args\.json: a JSON file of arguments holds one object"):
        pretrain.parse_arguments()

    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    shown = {
        name: re.search(rf"--{name} {name.upper()}, .*?\(default: ([^)]*)\)", text).group(1)
        for name in ("per_device_train_batch_size", "learning_rate", warmup, "num_train_epochs")
    }
    batch, rate = "per_device_train_batch_size", "learning_rate"
    assert shown == {batch: "16", rate: "0.001", warmup: "0.1", "num_train_epochs": "3.0"}  # the last: Trainer's own


@pytest.mark.slow
def test_pretraining_runs_without_the_plot_and_stats_extras(files, tmp_path):
    """matplotlib and scipy are optional (the `plot` and `stats` extras): with both made unimportable, the package
    and its training modules import, and a pretraining run finishes, saves, logs that it drew no loss curve and
    names none in its facts or card."""
    out = tmp_path / "mlm"
    argv = script_args(output_dir=out, train_file=files / "train.txt", model_size="debug", max_steps=2)
    code = f"""
import sys
sys.modules["matplotlib"] = sys.modules["scipy"] = None  # an import of either raises ImportError
import hf_bert_impl
from hf_bert_impl import cli, convert, data, export, finetuning, hub, pretraining
pretraining.main({[*argv, "--tokenizer_vocab_size", "300", "--max_seq_length", "32"]!r})
loaded = [m for m, module in sys.modules.items() if module and m.split(".")[0] in ("matplotlib", "scipy")]
print("imported:", loaded)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported: []" in result.stdout
    assert "no " in result.stderr and "matplotlib is not installed" in result.stderr
    assert (out / "model.safetensors").is_file() and not (out / "loss_curve.png").exists()
    assert json.loads((out / "training_facts.json").read_text())["loss_curve"] is None
    assert "loss_curve.png" not in (out / "README.md").read_text()


def test_finetune_config_overrides_set_the_loaded_models_config_and_refuse_unknown_fields(finetune, files, tmp_path):
    """--config_overrides sets config fields on the loaded model (the race fine-tunes a model pretrained without
    dropout at 0.1 this way); an unknown field or a bad value stops the run before
    any training, naming it."""
    from hf_bert_impl.cli import UsageError

    rows = [{"sentence": f"sentence number {i}", "label": ["no", "yes"][i % 2]} for i in range(16)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    common = {"model_name_or_path": files / "mlm", "train_file": train, "max_steps": 1, "save_strategy": "no"}
    out = tmp_path / "cls"
    overrides = "hidden_dropout_prob=0.25,attention_probs_dropout_prob=0.3"
    finetune.main(script_args(output_dir=out, config_overrides=overrides, **common))
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_dropout_prob"], config["attention_probs_dropout_prob"]) == (0.25, 0.3)
    assert config["id2label"] == {"0": "no", "1": "yes"}
    for bad, message in (
        ("dropout=0.1", r"no config field named \['dropout'\]"),
        ("hidden_dropout_prob=1.5", "hidden_dropout_prob"),
        ("hidden_dropout_prob", "is not of the form name=value"),
    ):
        with pytest.raises(UsageError, match=message):
            finetune.main(script_args(output_dir=tmp_path / "bad", config_overrides=bad, **common))
        assert not (tmp_path / "bad" / "model.safetensors").exists()
