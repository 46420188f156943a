"""Fine-tuning of hf-bert-impl's BERT with `Trainer` for sequence classification (single sentences or pairs;
regression when the label is a float) or token classification: the code behind `scripts/finetune.py`, whose
docstring holds the commands.

`main(argv)` runs it from Python with the command line's arguments and returns the final metrics;
`--model_name_or_path` takes our checkpoints or a transformers BERT (converted by `hf_bert_impl.convert`), so a
transformers model and ours fine-tune through the same code.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import evaluate
import numpy as np
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithFlattening,
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    Trainer,
    TrainingArguments,
    set_seed,
)

import hf_bert_impl
from hf_bert_impl import BertImplConfig, BertImplForSequenceClassification, BertImplForTokenClassification, cli
from hf_bert_impl import data as D
from hf_bert_impl.hub import BOOKKEEPING_SUFFIXES
from hf_bert_impl.metrics import METRIC_PATH


logger = logging.getLogger(__name__)

# GLUE / SuperGLUE column pairs, tried in this order when --sentence1_key is not given.
SENTENCE_KEYS = [
    ("sentence1", "sentence2"),
    ("question", "sentence"),
    ("question1", "question2"),
    ("premise", "hypothesis"),
    ("question", "passage"),
    ("sentence", None),
    ("text", None),
]
TAG_COLUMNS = ("ner_tags", "tags", "pos_tags", "labels", "label")
EMBEDDED_TASKS = {
    "statement_topic": "embedded statement-topic task (hf_bert_impl.data.statement_topic_task): sentences of the "
    "Python Language Reference, label 1 = from a section titled as a statement, 0 = any other section",
    "word_order": "embedded word-order task (hf_bert_impl.data.word_order_task): sentences of the Python Language "
    "Reference, label 1 = as written, 0 = words shuffled",
}


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Our checkpoint (e.g. from pretrain_mlm.py) or a transformers BERT. Required."}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer; default: the model's."})
    task_type: str = field(
        default="auto", metadata={"help": "sequence | token | auto (token when the data has tokens + tags columns)."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Config fields to set on the loaded model, e.g. 'hidden_dropout_prob=0.1,"
            "attention_probs_dropout_prob=0.1' (fine-tuning dropout for a model pretrained without it)."
        },
    )
    kernels: str = field(default="auto", metadata={"help": cli.KERNELS_HELP})

    def __post_init__(self):
        cli.parse_config_overrides(self.config_overrides)  # a malformed one stops here, before any loading
        if not self.model_name_or_path:
            raise cli.UsageError(
                "--model_name_or_path is required (a checkpoint from scripts/pretrain_mlm.py or a transformers BERT)"
            )
        if self.task_type not in ("sequence", "token", "auto"):
            raise cli.UsageError(f"--task_type must be sequence, token or auto, got {self.task_type!r}")
        cli.check_kernels_argument(self.kernels)


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A datasets Hub name (needs the Hub)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration, e.g. a GLUE task."})
    train_file: str | None = field(default=None, metadata={"help": "csv, json/jsonl or parquet training file."})
    validation_file: str | None = field(default=None, metadata={"help": "Same formats as --train_file."})
    test_file: str | None = field(default=None, metadata={"help": "Rows to predict (labels optional)."})
    embedded_task: str = field(
        default="statement_topic",
        metadata={
            "help": "Task used when no data option is given: statement_topic or word_order (hf_bert_impl/data.py)."
        },
    )
    sentence1_key: str | None = field(default=None, metadata={"help": "First text column (default: GLUE names)."})
    sentence2_key: str | None = field(default=None, metadata={"help": "Second text column of a pair (optional)."})
    label_column: str = field(default="label", metadata={"help": "Label column (sequence classification)."})
    tokens_column: str = field(default="tokens", metadata={"help": "Column of word lists (token classification)."})
    tags_column: str | None = field(
        default=None, metadata={"help": f"Column of tag lists; default: first of {TAG_COLUMNS}."}
    )
    label_all_tokens: bool = field(
        default=False, metadata={"help": "Label every WordPiece of a word (default: the first one, others ignored)."}
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate inputs to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training rows."})
    early_stopping_patience: int | None = field(
        default=None,
        metadata={"help": "Stop after this many evaluations without improvement (needs --load_best_model_at_end)."},
    )
    pack_sequences: bool = field(
        default=False,
        metadata={
            "help": "Token classification: pack each batch into one row without padding (DataCollatorWithFlattening; "
            "the model keeps attention inside each sequence)."
        },
    )
    metric: str = field(
        default="auto",
        metadata={
            "help": "auto: evaluate.load('glue', config) for GLUE data when the Hub is reachable, else the shipped "
            "module; local: always the shipped module."
        },
    )

    def __post_init__(self):
        if self.dataset_name and (self.train_file or self.validation_file or self.test_file):
            raise cli.UsageError(
                f"--dataset_name {self.dataset_name} and --train_file / --validation_file / --test_file "
                "are exclusive: give one data source"
            )
        if not self.train_file and (self.validation_file or self.test_file):
            raise cli.UsageError("--validation_file / --test_file need --train_file")
        if not (self.dataset_name or self.train_file) and self.embedded_task not in D.EMBEDDED_TASKS:
            raise cli.UsageError(
                f"--embedded_task must be one of {sorted(D.EMBEDDED_TASKS)}, got {self.embedded_task!r}"
            )


def load_data(data_args: DataArguments, seed: int):
    """-> (DatasetDict, description, where each split came from for error messages); DataArguments checked the
    choice of source."""
    if data_args.dataset_name:
        raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
        return raw, data_args.dataset_name, {k: f"{data_args.dataset_name} ({k} split)" for k in raw}
    if data_args.train_file:
        raw = D.load_data_files(data_args.train_file, data_args.validation_file, data_args.test_file)
        files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
        return raw, Path(data_args.train_file).name, {k: f"--{k}_file {files[k]}" for k in raw}
    raw = D.EMBEDDED_TASKS[data_args.embedded_task]()  # fixed seed: the task stays the same whatever --seed trains it
    description = EMBEDDED_TASKS[data_args.embedded_task]
    return raw, description, {k: f"embedded task {data_args.embedded_task} ({k} split)" for k in raw}


def split_roles(raw) -> tuple[list[str], list[str]]:
    """-> (evaluation splits, prediction splits), the first of each being the primary one.
    "validation" or, when absent, every "validation_*" split (MNLI's validation_matched /
    validation_mismatched); likewise "test" / "test_*". The primary evaluation split is the one
    Trainer evaluates during training (best model, early stopping); the others are reported too."""

    def role(prefix):
        exact = [prefix] if prefix in raw else []
        return exact + sorted(k for k in raw if k.startswith(prefix + "_"))

    return role("validation"), role("test")


def placeholder_labels(ds, column: str, token: bool, is_regression: bool, source: str) -> bool:
    """True when every label of `ds[column]` is a placeholder (-1 or None: datasets' ClassLabel writes -1
    for "no label", as in every GLUE test split); such a split gets predictions, never metrics. Some
    placeholders among real labels are an error (a metric over them would score the placeholder as a
    class). For regression only a split of nothing but -1 / None is a placeholder split (STS-B's test
    labels are all -1.0; a single -1.0 is a real score)."""
    values = ds[column]
    flat = [t for row in values for t in (row if isinstance(row, list) else [row])] if token else list(values)
    holes = [v is None or (not isinstance(v, (str, bool)) and v == -1) for v in flat]
    if flat and all(holes):
        return True
    if any(holes) and not is_regression:
        raise cli.UsageError(
            f"{source}: {sum(holes)} of {len(flat)} labels in column {column!r} are placeholders (-1 or None); "
            "label every row, or none (a split without labels gets predictions only)"
        )
    return False


def is_regression_column(train, column: str) -> bool:
    feature = train.features[column]
    if isinstance(feature, datasets.Value):
        return feature.dtype.startswith("float")
    return False


def resolve_task(model_args, data_args, train) -> str:
    tags = data_args.tags_column or next((c for c in TAG_COLUMNS if c in train.column_names), None)
    if model_args.task_type == "auto":
        is_token = (
            data_args.tokens_column in train.column_names
            and tags is not None
            and isinstance(
                train.features[tags],
                (datasets.Sequence, datasets.List) if hasattr(datasets, "List") else datasets.Sequence,
            )
        )
        return "token" if is_token else "sequence"
    return model_args.task_type  # sequence or token: ModelArguments checked it


def sentence_keys(data_args, train, source) -> tuple[str, str | None]:
    if data_args.sentence1_key:
        D.check_columns(
            train, [data_args.sentence1_key] + ([data_args.sentence2_key] if data_args.sentence2_key else []), source
        )
        return data_args.sentence1_key, data_args.sentence2_key
    for first, second in SENTENCE_KEYS:
        if first in train.column_names and (second is None or second in train.column_names):
            return first, second
    raise cli.UsageError(
        f"{source}: no text column; expected one of {sorted({k for pair in SENTENCE_KEYS for k in pair if k})} "
        f"or --sentence1_key, found {train.column_names}"
    )


def label_scheme(train, column: str, source: str):
    """-> (is_regression, label names or None). ClassLabel keeps its names; float = regression;
    ints and strings become sorted classes."""
    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return False, list(feature.names)
    values = [v for v in train[column] if v is not None]
    if not values:
        raise cli.UsageError(f"{source}: column {column!r} holds no labels")
    if all(isinstance(v, float) for v in values):
        return True, None
    if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in values):
        bad = next(v for v in values if not isinstance(v, (int, str)) or isinstance(v, bool))
        raise cli.UsageError(f"{source}: column {column!r} must hold class names, class ids or floats, got {bad!r}")
    names = sorted({str(v) for v in values}, key=lambda s: (len(s), s) if s.lstrip("-").isdigit() else (0, s))
    if len(names) < 2:
        raise cli.UsageError(
            f"{source}: column {column!r} has a single class {names}; classification needs two or more"
        )
    return False, names


def tag_scheme(train, column: str, source: str):
    feature = train.features[column]
    inner = getattr(feature, "feature", None)
    if isinstance(inner, datasets.ClassLabel):
        return list(inner.names)
    try:
        values = {str(t) for tags in train[column] for t in tags}
    except TypeError:
        raise cli.UsageError(f"{source}: column {column!r} must hold a list of tags per row") from None
    return sorted(values, key=lambda s: (len(s), s) if s.lstrip("-").isdigit() else (0, s))


def load_model(model_args, model_class, **config_kwargs):
    """Our checkpoint (from_pretrained) or a transformers BERT (converted, saved to a temporary
    directory, then loaded like ours so that the new head gets `config_kwargs`), with --config_overrides
    set on its config (`config_kwargs`, the head's labels, win over them)."""
    source = model_args.model_name_or_path
    if not source:
        raise cli.UsageError(
            "--model_name_or_path is required (a checkpoint from scripts/pretrain_mlm.py or a transformers BERT)"
        )
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise cli.UsageError(f"--model_name_or_path {source}: cannot load a config: {str(e).splitlines()[0]}") from e
    if config.model_type not in ("bert_impl", "bert"):
        raise cli.UsageError(
            f"--model_name_or_path {source}: model_type {config.model_type!r} is neither 'bert_impl' nor 'bert'"
        )
    overrides = cli.parse_config_overrides(model_args.config_overrides)
    unknown = sorted(set(overrides) - set(BertImplConfig().to_dict()))
    if unknown:
        raise cli.UsageError(f"--config_overrides {model_args.config_overrides}: no config field named {unknown}")
    config_kwargs = {**overrides, **config_kwargs}
    try:
        if config.model_type == "bert_impl":
            return model_class.from_pretrained(source, **config_kwargs)
        from hf_bert_impl.convert import from_hf_bert

        with tempfile.TemporaryDirectory() as tmp:
            from_hf_bert(source, model_class=hf_bert_impl.BertImplModel).save_pretrained(tmp)
            return model_class.from_pretrained(tmp, **config_kwargs)
    except cli.UsageError:
        raise
    except ValueError as e:  # BertImplConfig's validation names the field and the value
        if not overrides:
            raise
        raise cli.UsageError(f"--config_overrides {model_args.config_overrides}: {str(e).splitlines()[0]}") from e


@dataclass
class LabelSetup:
    """What the training split says about the task: which columns hold the text and the labels, and the classes."""

    task: str  # "sequence" or "token"
    keys: tuple[str, str | None]  # the text column(s); for token classification (tokens column, None)
    label_col: str
    is_regression: bool
    label_names: list[str] | None
    label2id: dict[str, int] | None
    unlabeled: dict[str, str]  # split -> why it gets predictions only


def parse_arguments(argv: list[str] | None = None) -> tuple:
    """(model, data, training) arguments from the flags or a JSON file; each dataclass checks its own fields in
    `__post_init__`, the checks that span two of them are here."""
    model_args, data_args, training_args = cli.parse_script_arguments(
        (ModelArguments, DataArguments, TrainingArguments), argv, logger
    )
    if data_args.early_stopping_patience is not None and not training_args.load_best_model_at_end:
        raise cli.UsageError(
            "--early_stopping_patience needs --load_best_model_at_end with matching --eval_strategy / --save_strategy"
        )
    return model_args, data_args, training_args


def resolve_labels(model_args, data_args, raw, dataset_source: str, sources: dict) -> LabelSetup:
    """Check every split's columns and labels before the model or tokenizer is touched; splits whose labels are
    all placeholders lose their label column (predictions only). -> the task's columns and classes."""
    if "train" not in raw:
        raise cli.UsageError(f"{dataset_source}: no train split")
    train_src = sources["train"]
    task = resolve_task(model_args, data_args, raw["train"])
    if data_args.pack_sequences and task != "token":
        raise cli.UsageError(
            "--pack_sequences needs token classification (--task_type token): a packed row holds several "
            "sequences, and a sequence-classification head reads one [CLS] per row"
        )
    if task == "token":
        tags_col = data_args.tags_column or next((c for c in TAG_COLUMNS if c in raw["train"].column_names), None)
        if tags_col is None:
            raise cli.UsageError(f"{train_src}: no tag column; expected one of {list(TAG_COLUMNS)} or --tags_column")
        for split, ds in raw.items():
            D.check_columns(ds, [data_args.tokens_column] + ([tags_col] if split == "train" else []), sources[split])
        keys = (data_args.tokens_column, None)
    else:
        keys = sentence_keys(data_args, raw["train"], train_src)
        for split, ds in raw.items():
            D.check_columns(
                ds, [k for k in keys if k] + ([data_args.label_column] if split == "train" else []), sources[split]
            )
        tags_col = None
    label_col = tags_col or data_args.label_column
    unlabeled = drop_placeholder_labels(raw, sources, label_col, task)
    if task == "token":
        is_regression, label_names = False, tag_scheme(raw["train"], tags_col, train_src)
    else:
        is_regression, label_names = label_scheme(raw["train"], data_args.label_column, train_src)
    label2id = {name: i for i, name in enumerate(label_names)} if label_names else None
    check_known_labels(raw, sources, label_col, label2id, label_names, task)
    return LabelSetup(task, keys, label_col, is_regression, label_names, label2id, unlabeled)


def drop_placeholder_labels(raw, sources, label_col: str, task: str) -> dict[str, str]:
    """Placeholder labels: the split keeps its rows for predictions and loses the label column, so that nothing
    downstream (metrics, gold labels in predictions.jsonl) can read them as classes. -> {split: why unlabeled}."""
    unlabeled = {}
    for split in list(raw):
        if label_col in raw[split].column_names and placeholder_labels(
            raw[split],
            label_col,
            task == "token",
            task != "token" and is_regression_column(raw["train"], label_col),
            sources[split],
        ):
            if split == "train":
                raise cli.UsageError(
                    f"{sources[split]}: every label in column {label_col!r} is a placeholder (-1 or None); "
                    "training needs labelled rows"
                )
            raw[split] = raw[split].remove_columns(label_col)
            unlabeled[split] = "placeholder labels (-1 / None): predictions only, no metrics"
        elif label_col not in raw[split].column_names and split != "train":
            unlabeled[split] = "no label column: predictions only, no metrics"
    return unlabeled


def check_known_labels(raw, sources, label_col: str, label2id, label_names, task: str) -> None:
    """Every split's labels (names or ids, not ClassLabel features) must occur in the training data."""
    for split, ds in raw.items():
        if (
            label2id is None
            or label_col not in ds.column_names
            or isinstance(ds.features[label_col], datasets.ClassLabel)
        ):
            continue
        values = (
            {str(t) for tags in ds[label_col] for t in tags} if task == "token" else {str(v) for v in ds[label_col]}
        )
        unknown = sorted(values - set(label2id))
        if unknown:
            raise cli.UsageError(
                f"{sources[split]}: labels {unknown[:5]} do not occur in the training data {label_names}"
            )


def load_tokenizer(model_args):
    """--tokenizer_name, else the model's tokenizer; one line naming the flag when it cannot be loaded."""
    tokenizer_source = model_args.tokenizer_name or model_args.model_name_or_path
    try:
        return AutoTokenizer.from_pretrained(tokenizer_source)
    except (OSError, ValueError) as e:
        flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
        raise cli.UsageError(
            f"{flag} {tokenizer_source}: no tokenizer could be loaded ({str(e).splitlines()[0]})"
        ) from e


def build_model(model_args, labels: LabelSetup, tokenizer):
    """The classification head for the task with its labels, under the speed layer (--kernels); its vocabulary
    must cover the tokenizer's."""
    if labels.task == "token":
        model_class = BertImplForTokenClassification
        config_kwargs = {
            "num_labels": len(labels.label_names),
            "id2label": dict(enumerate(labels.label_names)),
            "label2id": labels.label2id,
        }
    else:
        model_class = BertImplForSequenceClassification
        config_kwargs = (
            {"num_labels": 1, "problem_type": "regression"}
            if labels.is_regression
            else {
                "num_labels": len(labels.label_names),
                "id2label": dict(enumerate(labels.label_names)),
                "label2id": labels.label2id,
                "problem_type": "single_label_classification",
            }
        )
    model = load_model(model_args, model_class, **config_kwargs)
    cli.apply_kernels(model, model_args.kernels, logger)  # the speed layer, from outside: config and saves unchanged
    if tokenizer is None or len(tokenizer) > model.config.vocab_size:
        raise cli.UsageError(
            f"the tokenizer has {len(tokenizer) if tokenizer else 0} tokens but the model's vocab_size is "
            f"{model.config.vocab_size}; pass a matching --tokenizer_name"
        )
    return model


def tokenize_splits(raw, tokenizer, labels: LabelSetup, data_args, training_args) -> dict:
    """Every split tokenized (truncated to --max_seq_length), its labels as class ids (word labels aligned to
    WordPieces for token classification)."""
    keys, label_col, label2id = labels.keys, labels.label_col, labels.label2id

    def class_label_names(ds, column):
        feature = ds.features.get(column)
        inner = getattr(feature, "feature", feature)
        return inner.names if isinstance(inner, datasets.ClassLabel) else None

    def preprocess_sequence(batch, names):
        texts = (batch[keys[0]],) if keys[1] is None else (batch[keys[0]], batch[keys[1]])
        enc = tokenizer(*texts, truncation=True, max_length=data_args.max_seq_length)
        if label_col in batch:
            values = batch[label_col]
            if labels.is_regression:
                enc["labels"] = [float(v) for v in values]
            else:
                enc["labels"] = [label2id[names[v] if names else str(v)] for v in values]
        return enc

    def preprocess_tokens(batch, names):
        enc = tokenizer(batch[keys[0]], is_split_into_words=True, truncation=True, max_length=data_args.max_seq_length)
        if label_col in batch:
            all_labels = []
            for i, tags in enumerate(batch[label_col]):
                ids = [label2id[names[t] if names else str(t)] for t in tags]
                all_labels.append(D.align_word_labels(enc.word_ids(i), ids, data_args.label_all_tokens))
            enc["labels"] = all_labels
        return enc

    preprocess = preprocess_tokens if labels.task == "token" else preprocess_sequence
    with training_args.main_process_first(desc="tokenizing"):
        return {
            split: ds.map(
                preprocess,
                batched=True,
                remove_columns=ds.column_names,
                desc=f"Tokenizing {split}",
                fn_kwargs={"names": class_label_names(ds, label_col)},
            )
            for split, ds in raw.items()
        }


def load_metric(data_args, labels: LabelSetup):
    """-> (evaluate module, its name): GLUE's own metric for GLUE data when the Hub is reachable (--metric auto),
    else the shipped module for the task."""
    if (
        data_args.metric == "auto"
        and data_args.dataset_name in ("glue", "nyu-mll/glue")
        and data_args.dataset_config_name
        and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false")
    ):
        try:
            return evaluate.load("glue", data_args.dataset_config_name), "glue"
        except Exception as e:  # no network or no such task: the shipped module computes the same numbers
            logger.warning(
                "evaluate.load('glue', %r) failed (%s); using the shipped metric module",
                data_args.dataset_config_name,
                e,
            )
    kind = "token_classification" if labels.task == "token" else "regression" if labels.is_regression else None
    return evaluate.load(METRIC_PATH, kind or "classification"), "local"


def metrics_function(metric, labels: LabelSetup):
    """Trainer's compute_metrics: `metric` over the predictions at the labelled positions."""

    def compute_metrics(eval_pred):
        logits, label_ids = eval_pred.predictions, eval_pred.label_ids
        if labels.task == "token":
            preds = logits.argmax(-1)
            keep = label_ids != D.IGNORE_INDEX
            return metric.compute(
                predictions=[p[k].tolist() for p, k in zip(preds, keep)],
                references=[l[k].tolist() for l, k in zip(label_ids, keep)],
                label_names=labels.label_names,
            )
        preds = logits.reshape(-1) if labels.is_regression else logits.argmax(-1)
        return metric.compute(predictions=preds.tolist(), references=label_ids.reshape(-1).tolist())

    return compute_metrics


def build_trainer(model, tokenizer, encoded, labels: LabelSetup, compute_metrics, data_args, training_args):
    """-> (Trainer, evaluation splits): the collator for the task, early stopping, and the primary labelled
    validation split as Trainer's eval_dataset (the others are reported after training)."""
    if data_args.pack_sequences:
        # One row per batch, position_ids restarting at 0 per sequence: the model's packed path keeps
        # attention inside each sequence; labels get -100 at each sequence's first token ([CLS] already has it).
        collator = DataCollatorWithFlattening(return_position_ids=True)
    elif labels.task == "token":
        collator = DataCollatorForTokenClassification(tokenizer)
    else:
        collator = DataCollatorWithPadding(tokenizer)
    cli.default_logging_steps(training_args, num_update_steps=None)
    callbacks = [EarlyStoppingCallback(data_args.early_stopping_patience)] if data_args.early_stopping_patience else []
    eval_splits = [k for k in split_roles(encoded)[0] if k not in labels.unlabeled]
    evaluation = encoded[eval_splits[0]] if eval_splits else None
    if evaluation is not None and eval_splits[0] != "validation":
        logger.info(
            "evaluating on %s (%s reported after training)",
            eval_splits[0],
            ", ".join(eval_splits[1:]) or "nothing else",
        )
    # Saved with the model: whoever loads the directory (AutoTokenizer, pipeline) truncates as training did.
    tokenizer.model_max_length = min(tokenizer.model_max_length, data_args.max_seq_length)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=encoded["train"],
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
        callbacks=callbacks,
    )
    if training_args.logging_steps == 500 and training_args.max_steps <= 0:
        training_args.logging_steps = max(
            1,
            int(
                len(trainer.get_train_dataloader())
                * training_args.num_train_epochs
                / training_args.gradient_accumulation_steps
            )
            // 50,
        )
    return trainer, eval_splits


def evaluate_splits(trainer, encoded, eval_splits) -> tuple[dict, dict]:
    """-> (metrics of the primary evaluation split, metrics of the other labelled validation splits)."""
    final, other_metrics = {}, {}
    if eval_splits:
        final.update(trainer.evaluate())
        trainer.log_metrics("eval", final)
        for split in eval_splits[1:]:  # e.g. MNLI's validation_mismatched
            other = trainer.evaluate(encoded[split], metric_key_prefix=split)
            other_metrics.update({k: v for k, v in other.items() if not k.endswith(BOOKKEEPING_SUFFIXES)})
            trainer.log_metrics(split, other)
    return final, other_metrics


def predict_splits(trainer, raw, encoded, labels: LabelSetup, data_args, final, other_metrics) -> dict[str, str]:
    """Predictions for every test split (without one, for the validation split(s)) into predictions*.jsonl in
    --output_dir; a test split with real labels adds its metrics to `final` ("test") or `other_metrics`.
    -> {split: predictions file name}, the primary split first."""
    validation_splits, test_splits = split_roles(encoded)
    predictions_files = {}
    for n, split in enumerate(test_splits or validation_splits):
        output = trainer.predict(encoded[split], metric_key_prefix=split)
        if split.startswith("test") and split not in labels.unlabeled and "labels" in encoded[split].column_names:
            if split == "test":
                final.update({k: v for k, v in output.metrics.items() if k.startswith("test_")})
            else:
                other_metrics.update({k: v for k, v in output.metrics.items() if not k.endswith(BOOKKEEPING_SUFFIXES)})
            trainer.log_metrics(split, output.metrics)
        if trainer.is_world_process_zero():
            path = Path(trainer.args.output_dir) / ("predictions.jsonl" if n == 0 else f"predictions_{split}.jsonl")
            write_predictions(
                path,
                raw[split],
                output.predictions,
                labels.task,
                labels.is_regression,
                labels.label_names,
                labels.keys,
                trainer.processing_class,
                data_args.max_seq_length,
                labels.label_col,
            )
            predictions_files[split] = path.name
            logger.info("wrote %d predictions for the %s split to %s", len(raw[split]), split, path)
    return predictions_files


def report(
    trainer,
    model,
    labels: LabelSetup,
    args,
    dataset_source,
    metric_name,
    final,
    other_metrics,
    eval_splits,
    predictions_files,
) -> None:
    """The end of the run: all_results.json, the kernels it ran, and (main process) the loss curve,
    training_facts.json and the model card in --output_dir."""
    model_args, data_args, training_args = args
    first = next(iter(predictions_files), None)
    trainer.save_metrics("all", {**final, **other_metrics})
    kernels = cli.kernel_facts(model, model_args.kernels)
    if trainer.is_world_process_zero():
        cli.log_kernel_facts(kernels, logger)
    out = cli.finish_run(
        trainer,
        title=f"{type(model).__name__} fine-tuning",
        task="token-classification" if labels.task == "token" else "text-classification",
        dataset=dataset_source,
        base_model=model_args.model_name_or_path,
        hyperparameters={
            "num_train_epochs": training_args.num_train_epochs if training_args.max_steps <= 0 else None,
            "max_seq_length": data_args.max_seq_length,
            "early_stopping_patience": data_args.early_stopping_patience,
            "metric": metric_name,
        },
        # The card's metrics are for one split (validation); test numbers are kept beside them.
        metrics={k: v for k, v in final.items() if k.startswith("eval_") and not k.endswith(BOOKKEEPING_SUFFIXES)},
        test_metrics={
            k: v for k, v in final.items() if k.startswith("test_") and not k.endswith(BOOKKEEPING_SUFFIXES)
        },
        other_split_metrics=other_metrics or None,
        unlabeled_splits=labels.unlabeled or None,
        predictions_files=predictions_files or None,
        dataset_config=data_args.dataset_config_name,
        dataset_split=eval_splits[0] if eval_splits else None,
        labels=labels.label_names,
        predictions_file=predictions_files[first] if first else None,
        kernels=kernels,
    )
    if out:
        logger.info("saved the model, tokenizer, predictions, loss curve and model card to %s", out)


def main(argv: list[str] | None = None) -> dict:
    """Run the fine-tuning; returns the final metrics (eval_* and, when the test split has real labels, test_*)."""
    model_args, data_args, training_args = parse_arguments(argv)
    resume = cli.resolve_resume_argument(training_args)
    set_seed(training_args.seed)

    raw, dataset_source, sources = load_data(data_args, training_args.seed)
    labels = resolve_labels(model_args, data_args, raw, dataset_source, sources)
    tokenizer = load_tokenizer(model_args)
    if data_args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(len(raw["train"]), data_args.max_train_samples)))

    model = build_model(model_args, labels, tokenizer)
    encoded = tokenize_splits(raw, tokenizer, labels, data_args, training_args)
    metric, metric_name = load_metric(data_args, labels)
    compute_metrics = metrics_function(metric, labels)
    trainer, eval_splits = build_trainer(model, tokenizer, encoded, labels, compute_metrics, data_args, training_args)

    train_result = trainer.train(resume_from_checkpoint=resume)
    cli.save_trained(trainer, train_result)

    final, other_metrics = evaluate_splits(trainer, encoded, eval_splits)
    predictions_files = predict_splits(trainer, raw, encoded, labels, data_args, final, other_metrics)
    report(
        trainer,
        model,
        labels,
        (model_args, data_args, training_args),
        dataset_source,
        metric_name,
        final,
        other_metrics,
        eval_splits,
        predictions_files,
    )
    return final


def write_predictions(
    path, raw_split, predictions, task, is_regression, label_names, keys, tokenizer, max_length, label_column
):
    """One JSON object per input row: its index, its text, the gold label when the split has one, and
    the prediction (a label name, a float for regression, or one tag per word for token
    classification; words cut off by truncation get null)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(len(raw_split)):
            row = {"index": i, keys[0]: raw_split[i][keys[0]]}
            if keys[1]:
                row[keys[1]] = raw_split[i][keys[1]]
            if label_column in raw_split.column_names:
                gold = raw_split[i][label_column]
                names = getattr(
                    getattr(raw_split.features[label_column], "feature", raw_split.features[label_column]),
                    "names",
                    None,
                )
                row["label"] = (
                    [names[t] for t in gold] if names and task == "token" else names[gold] if names else gold
                )
            if task == "token":
                words = raw_split[i][keys[0]]
                word_ids = tokenizer(
                    words, is_split_into_words=True, truncation=True, max_length=max_length
                ).word_ids()
                ids = np.asarray(predictions[i]).argmax(-1)
                tags = [None] * len(words)
                for pos, w in enumerate(word_ids):
                    if w is not None and tags[w] is None:  # the first WordPiece of a word carries its tag
                        tags[w] = label_names[int(ids[pos])]
                row["prediction"] = tags
            elif is_regression:
                row["prediction"] = float(np.asarray(predictions[i]).reshape(-1)[0])
            else:
                row["prediction"] = label_names[int(np.argmax(predictions[i]))]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
