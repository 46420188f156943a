"""Masked-LM (optionally + next-sentence) pretraining of hf-bert-impl's BERT with `Trainer`: the code behind
`scripts/pretrain_mlm.py`, whose docstring holds the commands.

`main(argv)` runs it from Python with the command line's arguments and returns the final held-out metrics; the
pieces it runs in order (`parse_arguments`, `load_raw_data`, `load_tokenizer`, `tokenize_splits`, `prepare_model`,
`build_trainer`, ...) are importable on their own. The recipe's defaults (batch 16, learning rate 1e-3, warm-up 10%,
masking 30%, dropout off while pretraining, sparse prediction) are `RECIPE_DEFAULTS` and the argument dataclasses'.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, Trainer, TrainingArguments, set_seed

from hf_bert_impl import (
    SIZE_PRESETS,
    BertImplConfig,
    BertImplForMaskedLM,
    BertImplForPreTraining,
    cli,
)
from hf_bert_impl import data as D
from hf_bert_impl.budget import UNBOUNDED_MAX_STEPS, TimeBudget, remove_step_progress_bar


logger = logging.getLogger(__name__)

# The recipe's settings of TrainingArguments that `main` sets unless told otherwise, from docs/training.md's
# ablation (the mini model, 10 minutes on 2 CPU cores; a change is taken where it lowers the held-out loss on every
# seed): batch 16, learning rate 1e-3, warm-up 10% of the steps (or of --time_budget's time; transformers 4.x spells
# a share warmup_ratio). TrainingArguments' own (batch 8, learning rate 5e-5, no warm-up) are fine-tuning's.
# Continuing a pretrained BERT (--model_name_or_path) wants a lower rate: BERT pretrained at 1e-4.
RECIPE_BATCH_SIZE, RECIPE_LEARNING_RATE, RECIPE_WARMUP = 16, 1e-3, 0.1
RECIPE_DEFAULTS = {
    "per_device_train_batch_size": RECIPE_BATCH_SIZE,
    "learning_rate": RECIPE_LEARNING_RATE,
    "warmup_ratio" if hasattr(TrainingArguments, "warmup_ratio") else "warmup_steps": RECIPE_WARMUP,
}


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Start from this checkpoint: ours (model_type bert_impl) or a transformers BERT (converted on "
            "the fly)."
        },
    )
    config_name: str | None = field(
        default=None, metadata={"help": "A BertImplConfig (directory or config.json) to train from scratch."}
    )
    model_size: str = field(
        default="tiny", metadata={"help": f"Size preset when training from scratch: {', '.join(SIZE_PRESETS)}."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Config fields to override, e.g. 'hidden_dropout_prob=0,position_embedding_type=learned'."},
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "A fast BERT tokenizer (name or path). Default: the model's, else a WordPiece trained on the "
            "corpus."
        },
    )
    tokenizer_vocab_size: int = field(
        default=8000, metadata={"help": "Vocabulary size of the WordPiece tokenizer trained when none is given."}
    )
    tokenizer_train_samples: int = field(
        default=100_000,
        metadata={
            "help": "With --streaming: the WordPiece tokenizer (when none is given) is trained on this many "
            "first texts of the stream."
        },
    )
    sparse_prediction: bool = field(
        default=True,
        metadata={
            "help": "Run the MLM decoder only on masked positions when labels are given (same loss, less work): "
            "the model's config.sparse_prediction while training, whatever --kernels says. The final model in "
            "--output_dir is saved with it off: it returns full (batch, seq, vocab) logits as usual."
        },
    )
    pretraining_dropout: str = field(
        default="0",
        metadata={
            "help": "Dropout rate of the encoder (hidden and attention dropout) while pretraining. Default 0: off, "
            "as Cramming pretrains (Geiping & Goldstein 2022); it trains best in docs/training.md's ablation. "
            "'config': the config's own rates. The saved config (checkpoints too) keeps its own rates (BERT's "
            "0.1 unless --config_overrides, --config_name or the checkpoint set others): fine-tuning the saved "
            "model runs with them."
        },
    )
    kernels: str = field(default="auto", metadata={"help": cli.KERNELS_HELP})

    def __post_init__(self):
        pretraining_dropout_rate(self.pretraining_dropout)  # a UsageError naming a bad value
        cli.check_kernels_argument(self.kernels)
        if self.tokenizer_train_samples <= 0:
            raise cli.UsageError(
                f"--tokenizer_train_samples must be a positive integer, got {self.tokenizer_train_samples}"
            )
        if not (self.model_name_or_path or self.config_name) and self.model_size not in SIZE_PRESETS:
            raise cli.UsageError(f"--model_size {self.model_size!r}: choose one of {list(SIZE_PRESETS)}")


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A datasets Hub name (needs the Hub)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration name."})
    train_file: str | None = field(default=None, metadata={"help": "txt, csv, json/jsonl or parquet file of texts."})
    validation_file: str | None = field(default=None, metadata={"help": "Same formats as --train_file."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text (csv/json/parquet/Hub data)."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of the training data held out when no validation split exists."}
    )
    max_seq_length: int = field(default=128, metadata={"help": "Block length in tokens, [CLS] and [SEP] included."})
    mlm_probability: float = field(
        default=0.3,
        metadata={
            "help": "Fraction of tokens masked (80%% [MASK], 10%% random, 10%% kept). Default 0.3, as Wettig et al. "
            "(2023) and MosaicBERT pretrain; it trains best in docs/training.md's ablation (BERT's: 0.15)."
        },
    )
    eval_mlm_probability: float | None = field(
        default=None,
        metadata={
            "help": "Fraction of held-out tokens masked for evaluation (default: --mlm_probability). Set 0.15 to "
            "compare runs trained at other masking rates on the same task, as Wettig et al. (2023) do."
        },
    )
    whole_word_mask: bool = field(default=False, metadata={"help": "Mask whole words instead of single WordPieces."})
    static_masking: bool = field(
        default=False,
        metadata={
            "help": "Mask the training data once (seeded) instead of per batch, as the original BERT pipeline did."
        },
    )
    nsp: bool = field(
        default=False, metadata={"help": "Train BertImplForPreTraining: MLM + next-sentence prediction."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many evaluation examples."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for datasets.map."})
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Stream --train_file (or --dataset_name) instead of loading it: for corpora larger than memory. "
            "Needs --max_steps; evaluation uses --validation_file."
        },
    )
    pack_sequences: bool = field(
        default=False,
        metadata={
            "help": "One sequence per text (long texts cut into pieces) instead of fixed blocks that run across "
            "texts; each batch is packed into one row without padding (DataCollatorWithFlattening)."
        },
    )

    def __post_init__(self):
        if self.nsp and self.whole_word_mask:
            raise cli.UsageError("--whole_word_mask is supported for MLM blocks only, not with --nsp")
        if not 0.0 < self.mlm_probability < 1.0:
            raise cli.UsageError(f"--mlm_probability must lie in (0, 1), got {self.mlm_probability}")
        if self.eval_mlm_probability is None:
            self.eval_mlm_probability = self.mlm_probability
        if not 0.0 < self.eval_mlm_probability < 1.0:
            raise cli.UsageError(f"--eval_mlm_probability must lie in (0, 1), got {self.eval_mlm_probability}")
        if self.dataset_name and (self.train_file or self.validation_file):
            raise cli.UsageError(
                f"--dataset_name {self.dataset_name} and --train_file / --validation_file are exclusive: "
                "give one data source"
            )
        if self.streaming and not (self.dataset_name or self.train_file):
            raise cli.UsageError(
                "--streaming needs --train_file (or --dataset_name): the embedded corpus is loaded whole"
            )
        if not (self.streaming or self.dataset_name or self.train_file) and self.validation_file:
            raise cli.UsageError(f"--validation_file {self.validation_file} was given without --train_file")
        if self.pack_sequences and self.nsp:
            raise cli.UsageError(
                "--pack_sequences packs MLM sequences; next-sentence prediction (--nsp) reads one pair per row"
            )
        if self.pack_sequences and self.whole_word_mask:
            raise cli.UsageError(
                "--pack_sequences cannot be combined with --whole_word_mask (packed rows carry no word offsets)"
            )
        if self.pack_sequences and self.static_masking:
            raise cli.UsageError("--pack_sequences masks per batch; it cannot be combined with --static_masking")
        if self.streaming and (self.nsp or self.static_masking):
            raise cli.UsageError(
                "--streaming supports MLM with per-batch masking only (not --nsp or --static_masking)"
            )


@dataclass
class BudgetArguments:
    time_budget: float | None = field(
        default=None,
        metadata={
            "help": "Train for this many minutes of training time (evaluation and saving not counted) instead of a "
            "step count: the learning-rate schedule (--lr_scheduler_type; --warmup_steps in steps, or below 1 a "
            "share of the time) is laid over the time, and the run stops at the first step past it and saves as "
            "usual. "
            "--max_steps, when given too, still caps the steps."
        },
    )
    eval_every_minutes: float | None = field(
        default=None,
        metadata={"help": "With --time_budget: evaluate every so many minutes of training time (and at the end)."},
    )

    def __post_init__(self):
        if self.eval_every_minutes is not None and self.time_budget is None:
            raise cli.UsageError("--eval_every_minutes needs --time_budget (and validation data)")
        if self.time_budget is not None and not self.time_budget > 0:
            raise cli.UsageError(f"--time_budget must be a positive number of minutes, got {self.time_budget}")
        if self.eval_every_minutes is not None and not self.eval_every_minutes > 0:
            raise cli.UsageError(
                f"--eval_every_minutes must be a positive number of minutes, got {self.eval_every_minutes}"
            )


def load_raw_data(data_args: DataArguments, seed: int):
    """-> (DatasetDict with "train" and maybe "validation", dataset description for the model card).
    With --streaming "train" is an IterableDataset, read lazily. DataArguments checked the choice of source."""
    if data_args.streaming:
        import datasets

        if data_args.dataset_name:
            train = datasets.load_dataset(
                data_args.dataset_name, data_args.dataset_config_name, split="train", streaming=True
            )
            source = data_args.dataset_name
        else:
            train = D.stream_data_file(data_args.train_file)
            source = Path(data_args.train_file).name
        raw = {
            "train": train.filter(
                lambda row: (
                    isinstance(row.get(data_args.text_column), str) and bool(row[data_args.text_column].strip())
                )
            )
        }
        if data_args.validation_file:
            validation = D.load_data_files(validation_file=data_args.validation_file)["validation"]
            D.check_columns(validation, [data_args.text_column], f"--validation_file {data_args.validation_file}")
            raw["validation"] = validation
        first = next(iter(train.take(1)), None)
        if first is None:
            raise cli.UsageError(f"{source}: the stream holds no rows")
        if data_args.text_column not in first:
            raise cli.UsageError(f"{source}: missing column(s) {[data_args.text_column]}; found {sorted(first)}")
        return raw, source
    if data_args.dataset_name:
        import datasets

        raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
        source = data_args.dataset_name
    elif data_args.train_file:
        raw = D.load_data_files(data_args.train_file, data_args.validation_file)
        source = Path(data_args.train_file).name
        files = {"train": data_args.train_file, "validation": data_args.validation_file}
    else:
        return D.default_corpus_dataset(), D.DEFAULT_CORPUS_NAME
    for split in raw:
        where = f"--{split}_file {files[split]}" if data_args.train_file else f"{source} ({split} split)"
        D.check_columns(raw[split], [data_args.text_column], where)
        if split != "train" or not data_args.train_file:
            continue
        texts = [t for t in raw[split][data_args.text_column] if isinstance(t, str) and t.strip()]
        if not texts:
            raise cli.UsageError(
                f"--train_file {data_args.train_file}: column {data_args.text_column!r} holds no text"
            )
    if "validation" not in raw and data_args.validation_split_percentage > 0 and len(raw["train"]) >= 20:
        parts = raw["train"].train_test_split(test_size=data_args.validation_split_percentage / 100, seed=seed)
        raw["train"], raw["validation"] = parts["train"], parts["test"]
    return raw, source


def load_tokenizer(
    model_args: ModelArguments,
    raw,
    text_column: str,
    resume_dir: str | None,
    training_args=None,
    streaming: bool = False,
):
    """--tokenizer_name, else the tokenizer of the checkpoint resumed from or of --model_name_or_path, else a
    WordPiece tokenizer trained on the training texts (saved into --output_dir)."""
    if model_args.tokenizer_name:
        try:
            return AutoTokenizer.from_pretrained(model_args.tokenizer_name)
        except (OSError, ValueError) as e:
            raise cli.UsageError(
                f"--tokenizer_name {model_args.tokenizer_name}: no tokenizer could be loaded "
                f"({str(e).splitlines()[0]})"
            ) from e
    for candidate in (resume_dir, model_args.model_name_or_path):
        if candidate and any((Path(candidate) / f).is_file() for f in ("tokenizer.json", "vocab.txt")):
            return AutoTokenizer.from_pretrained(candidate)
    if model_args.model_name_or_path and not Path(model_args.model_name_or_path).exists():
        return AutoTokenizer.from_pretrained(model_args.model_name_or_path)  # a Hub id
    # Trained once, by the main process, into --output_dir; the other processes (other machines too, when
    # --output_dir is on a shared file system) load it from there once it is written.
    out = Path(training_args.output_dir)
    with training_args.main_process_first(desc="training the WordPiece tokenizer", local=False):
        if training_args.process_index == 0 or not (out / "tokenizer.json").is_file():
            if streaming:
                logger.info(
                    "training a WordPiece tokenizer (vocab %d) on the first %d texts of the stream",
                    model_args.tokenizer_vocab_size,
                    model_args.tokenizer_train_samples,
                )
                texts = (row[text_column] for row in raw["train"].take(model_args.tokenizer_train_samples))
            else:
                logger.info(
                    "training a WordPiece tokenizer (vocab %d) on the training texts", model_args.tokenizer_vocab_size
                )
                texts = raw["train"][text_column]  # a column, read as it is needed
            tokenizer = D.train_wordpiece_tokenizer(texts, vocab_size=model_args.tokenizer_vocab_size)
            if training_args.process_index == 0:
                out.mkdir(parents=True, exist_ok=True)
                tokenizer.save_pretrained(out)
            return tokenizer
        return AutoTokenizer.from_pretrained(out)


def build_model(model_args: ModelArguments, tokenizer, nsp: bool):
    """BertImplForMaskedLM (BertImplForPreTraining with --nsp): from --model_name_or_path (ours, or a transformers
    BERT converted), else new from --config_name or the --model_size preset, with --config_overrides; its vocabulary
    must cover the tokenizer's."""
    model_class = BertImplForPreTraining if nsp else BertImplForMaskedLM
    overrides = cli.parse_config_overrides(model_args.config_overrides)
    try:
        if model_args.model_name_or_path:
            source = model_args.model_name_or_path
            config = AutoConfig.from_pretrained(source)
            if config.model_type == "bert_impl":
                model = model_class.from_pretrained(source, **overrides)
            elif config.model_type == "bert":
                from hf_bert_impl.convert import from_hf_bert

                model = from_hf_bert(source, model_class=model_class)
                for key, value in overrides.items():
                    setattr(model.config, key, value)
            else:
                raise cli.UsageError(
                    f"--model_name_or_path {source}: model_type {config.model_type!r} is neither 'bert_impl' "
                    "nor 'bert'"
                )
        else:
            if model_args.config_name:
                config = BertImplConfig.from_pretrained(model_args.config_name, **overrides)
            else:
                config = BertImplConfig.from_preset(
                    model_args.model_size, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **overrides
                )
            model = model_class(config)
    except cli.UsageError:
        raise
    except ValueError as e:  # BertImplConfig's validation names the field and the value
        raise cli.UsageError(str(e).splitlines()[0]) from e
    if len(tokenizer) > model.config.vocab_size:
        raise cli.UsageError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model.config.vocab_size}; "
            "pass the model's own tokenizer or a matching --tokenizer_name"
        )
    return model


def pretraining_dropout_rate(text: str) -> float | None:
    """--pretraining_dropout: 'config' -> None (the config's rates), else a rate in [0, 1)."""
    if text.strip().lower() == "config":
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not 0.0 <= rate < 1.0:
        raise cli.UsageError(f"--pretraining_dropout must be a rate in [0, 1) or 'config', got {text!r}")
    return rate


def set_pretraining_dropout(model, rate: float | None) -> list[float]:
    """Every dropout of the model (nn.Dropout modules, attention's rate) at `rate` for this run; the config, read by
    every save and every later load, keeps its own rates. -> [hidden, attention] rates the run trains with."""
    config = model.config
    if rate is None:
        return [config.hidden_dropout_prob, config.attention_probs_dropout_prob]
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = rate
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = rate
    return [rate, rate]


def preprocess_logits_for_metrics(logits, labels):
    """Keep only argmax ids: the full (b, s, V) logits of a whole evaluation set would not fit in memory.

    With sparse prediction the logits are (n, V), one row per labelled position: their ids go back to a
    (b, s) grid (-100 elsewhere), since Trainer cuts the last batch's predictions by rows of the batch."""
    if isinstance(logits, tuple):  # BertImplForPreTraining: (prediction_logits, seq_relationship_logits)
        return _on_label_grid(logits[0].argmax(-1), labels), logits[1].argmax(-1)
    return _on_label_grid(logits.argmax(-1), labels)


def _on_label_grid(ids, labels):
    labels = labels[0] if isinstance(labels, (tuple, list)) else labels
    if ids.dim() != 1 or labels is None or ids.shape == labels.shape:
        return ids
    grid = torch.full(labels.shape, D.IGNORE_INDEX, dtype=ids.dtype, device=ids.device)
    grid[labels != D.IGNORE_INDEX] = ids
    return grid


def compute_metrics(eval_pred):
    """masked_accuracy: share of masked positions whose argmax is the original token (+ nsp_accuracy)."""
    preds, labels = eval_pred.predictions, eval_pred.label_ids
    metrics = {}
    if isinstance(preds, tuple):
        nsp_preds, preds = preds[1], preds[0]
        labels, nsp_labels = labels if isinstance(labels, tuple) else (labels, None)
        if nsp_labels is not None:
            metrics["nsp_accuracy"] = float((nsp_preds.reshape(-1) == nsp_labels.reshape(-1)).mean())
    mask = labels != D.IGNORE_INDEX
    if not mask.any():
        metrics["masked_accuracy"] = float("nan")
        return metrics
    if preds.shape != labels.shape:
        raise ValueError(f"predictions of shape {preds.shape} for labels of shape {labels.shape}")
    metrics["masked_accuracy"] = float((preds[mask] == labels[mask]).mean())
    return metrics


def parse_arguments(argv: list[str] | None = None) -> tuple:
    """(model, data, budget, training) arguments from the flags or a JSON file, under RECIPE_DEFAULTS; each dataclass
    checks its own fields in `__post_init__`, the checks that span two of them are here."""
    model_args, data_args, budget_args, training_args = cli.parse_script_arguments(
        (ModelArguments, DataArguments, BudgetArguments, TrainingArguments), argv, logger, RECIPE_DEFAULTS
    )
    # A time budget runs Trainer for "unbounded" max_steps (make_time_budget), which a stream needs.
    if data_args.streaming and training_args.max_steps <= 0 and budget_args.time_budget is None:
        raise cli.UsageError(
            "--streaming needs --max_steps or --time_budget: a stream has no length to count epochs in"
        )
    return model_args, data_args, budget_args, training_args


def make_time_budget(budget_args: BudgetArguments, training_args, resume: str | None) -> TimeBudget | None:
    """--time_budget as a TimeBudget callback (None without one); Trainer then loops for max_steps (unbounded unless
    given) and the budget ends the run."""
    if budget_args.time_budget is None:
        return None
    interval = budget_args.eval_every_minutes
    budget = TimeBudget(budget_args.time_budget * 60, eval_interval=interval and interval * 60, resume_from=resume)
    if training_args.max_steps <= 0:
        training_args.max_steps = UNBOUNDED_MAX_STEPS
    return budget


def tokenize_splits(raw, tokenizer, data_args: DataArguments, training_args) -> dict:
    """Every split as training examples: sentence pairs (--nsp), one sequence per text (--pack_sequences) or
    fixed blocks of --max_seq_length tokens that run across texts."""
    with training_args.main_process_first(desc="tokenizing"):
        if data_args.nsp:
            return {
                k: D.nsp_examples(v, tokenizer, data_args.max_seq_length, training_args.seed, data_args.text_column)
                for k, v in raw.items()
            }
        if data_args.pack_sequences:
            return {
                k: D.tokenize_documents(
                    v,
                    tokenizer,
                    data_args.max_seq_length,
                    data_args.text_column,
                    data_args.preprocessing_num_workers,
                    desc=k,
                )
                for k, v in raw.items()
            }
        return {
            k: D.tokenize_and_group(
                v,
                tokenizer,
                data_args.max_seq_length,
                data_args.text_column,
                data_args.preprocessing_num_workers,
                desc=k,
                with_offsets=data_args.whole_word_mask,
            )
            for k, v in raw.items()
        }


def training_and_evaluation_sets(splits: dict, tokenizer, data_args: DataArguments, training_args, dataset_source):
    """-> (training examples, held-out examples or None): cut to --max_train_samples / --max_eval_samples, the
    held-out masks drawn once (seeded) so that every evaluation of a run scores the same positions, the training
    masks too with --static_masking."""
    train = splits["train"]
    no_block = (
        f"{dataset_source}: the training text gives no block of --max_seq_length {data_args.max_seq_length} tokens; "
        "add text or lower --max_seq_length"
    )
    if data_args.streaming:
        if next(iter(train.take(1)), None) is None:
            raise cli.UsageError(no_block)
        if data_args.max_train_samples is not None:
            train = train.take(data_args.max_train_samples)
    elif len(train) == 0:
        raise cli.UsageError(no_block)
    if data_args.max_train_samples is not None and not data_args.streaming:
        train = train.select(range(min(len(train), data_args.max_train_samples)))
    evaluation = splits.get("validation")
    if evaluation is not None and len(evaluation) == 0:
        evaluation = None
    if evaluation is not None and data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(len(evaluation), data_args.max_eval_samples)))
    if evaluation is not None:
        evaluation = D.mask_once(
            evaluation, tokenizer, training_args.seed + 1, data_args.eval_mlm_probability, data_args.whole_word_mask
        )
    if data_args.static_masking:
        train = D.mask_once(train, tokenizer, training_args.seed, data_args.mlm_probability, data_args.whole_word_mask)
    return train, evaluation


def prepare_model(model_args: ModelArguments, tokenizer, data_args: DataArguments, train) -> tuple:
    """-> (the model to pretrain, [hidden, attention] dropout it trains with): built or loaded (build_model),
    --pretraining_dropout applied, under the speed layer (--kernels), with --sparse_prediction."""
    model = build_model(model_args, tokenizer, data_args.nsp)
    trains_with = set_pretraining_dropout(model, pretraining_dropout_rate(model_args.pretraining_dropout))
    logger.info(
        "pretraining with dropout %g (hidden) / %g (attention); the saved config keeps %g / %g for fine-tuning",
        *trains_with,
        model.config.hidden_dropout_prob,
        model.config.attention_probs_dropout_prob,
    )
    # The speed layer, from outside: the config and every save (checkpoint-N included) stay the plain model's.
    cli.apply_kernels(model, model_args.kernels, logger)
    # A model option, in the config (checkpoint-N folders keep it; the final save below turns it off).
    model.config.sparse_prediction = model_args.sparse_prediction
    logger.info(
        "model: %s, %.2fM parameters, %s training examples of %d tokens",
        type(model).__name__,
        model.num_parameters() / 1e6,
        "streamed" if data_args.streaming else len(train),
        data_args.max_seq_length,
    )
    return model, trains_with


def build_trainer(model, tokenizer, train, evaluation, data_args: DataArguments, training_args, resume, budget):
    """Trainer with the masking collator (per batch, seeded), the masking-resume and time-budget callbacks, and the
    masked-token accuracy when there is held-out data."""
    cli.default_logging_steps(training_args)
    # The collator needs special_tokens_mask / offset_mapping, which Trainer would drop as columns
    # the model's forward does not take; every column of these datasets is meant for the collator or model.
    training_args.remove_unused_columns = False

    # Masks drawn per batch from (seed, batch number) over the global batch: resumed and multi-process
    # runs mask as one uninterrupted process does.
    collator = D.MLMCollator(
        tokenizer,
        data_args.mlm_probability,
        data_args.whole_word_mask,
        seed=training_args.seed,
        rank=training_args.process_index,
        world_size=training_args.world_size,
        max_length=data_args.max_seq_length,
    )
    if data_args.pack_sequences:
        collator = D.PackedMLMCollator(collator)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=collator,
        callbacks=[D.MaskingResumeCallback(collator, resume), *([budget] if budget else [])],
        compute_metrics=compute_metrics if evaluation is not None else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if evaluation is not None else None,
    )
    if budget is not None:
        remove_step_progress_bar(trainer)  # its total is max_steps; the budget's bar counts seconds
    return trainer


def train_and_save(trainer, model, model_args: ModelArguments, resume) -> dict:
    """Train, then save the plain model (full logits: sparse prediction off) into --output_dir; -> the training
    metrics. The model keeps sparse prediction as it trained for the evaluation and facts that follow."""
    train_result = trainer.train(resume_from_checkpoint=resume)
    model.config.sparse_prediction = False  # the saved model gives full logits, as --sparse_prediction's help says
    metrics = cli.save_trained(trainer, train_result)
    model.config.sparse_prediction = model_args.sparse_prediction
    return metrics


def evaluate_held_out(trainer, train, evaluation, tokenizer, data_args: DataArguments) -> dict:
    """The held-out loss, masked accuracy and perplexity, beside the unigram baseline (a model that ignores context:
    token frequencies of the training data); {} without held-out data."""
    if evaluation is None:
        return {}
    eval_metrics = trainer.evaluate()
    eval_metrics["perplexity"] = (
        math.exp(eval_metrics["eval_loss"]) if eval_metrics["eval_loss"] < 700 else float("inf")
    )
    if not data_args.streaming:
        eval_metrics["unigram_perplexity"] = math.exp(D.unigram_loss(train, evaluation, len(tokenizer)))
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    return eval_metrics


def report(trainer, model, args: tuple, dataset_source, trains_with, budget, metrics, eval_metrics) -> None:
    """The end of the run: the kernels it ran, and (main process) the loss curve, training_facts.json and the model
    card in --output_dir."""
    model_args, data_args, budget_args, training_args = args
    kernels = cli.kernel_facts(model, model_args.kernels)
    if trainer.is_world_process_zero():
        cli.log_kernel_facts(kernels, logger)
    out = cli.finish_run(
        trainer,
        title=f"{type(model).__name__} pretraining",
        task="fill-mask",
        dataset=dataset_source,
        base_model=model_args.model_name_or_path,
        hyperparameters={
            "num_train_epochs": round(trainer.state.epoch or 0.0, 3),
            "max_seq_length": data_args.max_seq_length,
            "mlm_probability": data_args.mlm_probability,
            "eval_mlm_probability": data_args.eval_mlm_probability,
            "pretraining_dropout": trains_with,  # [hidden, attention]; the saved config keeps its own
            "lr_scheduler_type": getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type),
            "whole_word_mask": data_args.whole_word_mask,
            "next_sentence_prediction": data_args.nsp,
            "streaming": data_args.streaming,
            "pack_sequences": data_args.pack_sequences,
            "model_size": None if model_args.model_name_or_path or model_args.config_name else model_args.model_size,
            "time_budget_minutes": budget_args.time_budget,
            **({"max_steps": trainer.state.global_step} if budget else {}),  # the steps the budget allowed
        },
        metrics={
            **{
                k: v
                for k, v in eval_metrics.items()
                if k in ("eval_loss", "eval_masked_accuracy", "eval_nsp_accuracy", "perplexity", "unigram_perplexity")
            },
            "train_loss": metrics.get("train_loss"),
            **({"training_seconds": round(budget.elapsed(), 1)} if budget else {}),
        },
        dataset_split="validation" if trainer.eval_dataset is not None else None,
        kernels=kernels,
    )
    if out:
        logger.info("saved the model, tokenizer, loss curve and model card to %s", out)


def main(argv: list[str] | None = None) -> dict:
    """Run the pretraining; returns the final evaluation metrics (empty without validation data)."""
    model_args, data_args, budget_args, training_args = parse_arguments(argv)
    resume = cli.resolve_resume_argument(training_args)
    budget = make_time_budget(budget_args, training_args, resume)
    set_seed(training_args.seed)

    raw, dataset_source = load_raw_data(data_args, training_args.seed)
    tokenizer = load_tokenizer(model_args, raw, data_args.text_column, resume, training_args, data_args.streaming)
    splits = tokenize_splits(raw, tokenizer, data_args, training_args)
    train, evaluation = training_and_evaluation_sets(splits, tokenizer, data_args, training_args, dataset_source)
    if budget_args.eval_every_minutes is not None and evaluation is None:
        raise cli.UsageError(
            "--eval_every_minutes needs validation data (--validation_file, or a split of the training data)"
        )

    model, trains_with = prepare_model(model_args, tokenizer, data_args, train)
    trainer = build_trainer(model, tokenizer, train, evaluation, data_args, training_args, resume, budget)
    metrics = train_and_save(trainer, model, model_args, resume)
    eval_metrics = evaluate_held_out(trainer, train, evaluation, tokenizer, data_args)
    report(
        trainer,
        model,
        (model_args, data_args, budget_args, training_args),
        dataset_source,
        trains_with,
        budget,
        metrics,
        eval_metrics,
    )
    return eval_metrics
