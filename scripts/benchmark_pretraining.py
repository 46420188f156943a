"""The pretraining race: which BERT is better after the same wall-clock time on this machine?

For each seed, pretrains for the same training-time budget (`--budget` seconds; evaluation not counted):
  ours          hf-bert-impl with its defaults, through scripts/pretrain_mlm.py itself (`main(argv)`:
                sinusoidal positions, its seeded per-batch masking collator at 30%, dropout off while pretraining
                (pretrain_mlm.py's defaults; the saved config keeps BERT's 0.1 for fine-tuning), sparse prediction
                (`config.sparse_prediction`) and the speed layer it applies, `hf_bert_impl.kernelize(model,
                --kernels)`: the kernels of its static table (`--kernels auto`, the default); `--time_budget`)
  transformers  transformers' `BertForMaskedLM` with learned positions, `DataCollatorForLanguageModeling` and
                `Trainer`, under the recipe `--opponent` names: run_mlm.py's own (masking 15%, dropout 0.1, the race's
                learning rate; the default), any masking rate / dropout / learning rate, or the best of a `--sweep`
Both: the same WordPiece tokenizer (trained once on the training split), the same blocks of
`--max_seq_length` tokens, size (`--model_size`), batch (`--batch_size`), AdamW, weight decay and schedule (linear
decay laid over the budget, warm-up `--warmup_ratio` of its time: `hf_bert_impl.budget.TimeBudget` for both; the
batch, warm-up and ours' `--learning_rate` default to pretrain_mlm.py's recipe), evaluated every
`--budget / --evaluations` seconds of training time on the same held-out blocks under one fixed 15% masking (the one
pretrain_mlm.py draws: seed + 1), whatever masking rate the opponent trains with. The two runs of a seed take turns
in which goes first.

Reports, per seed and over the seeds: held-out MLM loss at the budget, steps run, and time-to-accuracy at every
evaluation point of transformers' curve: the training seconds ours needs to reach the loss transformers had there
(interpolated between ours' evaluations), and the speed-up, transformers' seconds over ours'; the headline one is at
transformers' final loss (a point where ours' first evaluation was already lower is a bound, marked). Then each
pretrained model is fine-tuned with the same settings, dropout included (`--finetune_dropout`, BERT's 0.1, whatever
rate it pretrained with), on each of `--finetune_tasks` (accuracy and MCC on the test split, or with
`--finetune_folds K` on every sentence of the task by K-fold cross-validation): "statement_topic",
the embedded corpus' statement-topic task, and "fortune_topic", which of four fortune files (computers, politics,
science, songs-poems; chance 25%) a fortune comes from (`hf_bert_impl.data.fortune_topic_task`; needs the fortunes
package); `--finetune_learning_rates` gives each model its own fine-tuning rate, chosen on the task's validation
split, or with `--finetune_sweep` scores both models at every one of those rates (each its own entry, TASK@RATE) and
names each model's best per task (`summary.finetune_rates`), which `--finetune_rates_from` then races on other seeds,
as `--opponent` races a `--sweep`'s recipe; the summary's paired test (`finetune_paired`) says per task whether the
two models' accuracies differ by more than chance. Also two checks that make the race mean something:
- collator cost: the per-batch cost of the scripts' masking collator (`hf_bert_impl.data.MLMCollator`,
  seeded) over `DataCollatorForLanguageModeling`'s, on batches of this corpus (must stay <= 1.5x);
- step-for-step parity: ours configured as transformers' BERT (learned positions, no embedding scale),
  kernelized as pretrain_mlm.py trains it, started from the same weights (`to_hf_bert`) with dropout off and
  trained on the same masked batches through the same Trainer settings, follows transformers' per-step loss
  to `--parity_tolerance`; so the race measures the defaults, not a defect.

`--sweep` runs transformers alone under each of the 8 recipes of masking 15% / 30%, dropout 0.1 / 0 and learning
rate 5e-4 / 1e-3 (`--grid` narrows or moves it) for `--budget` on each seed, and writes the best (lowest mean
held-out loss at the budget) into OUT.json, which `--opponent OUT.json` then races. Corpora: "embedded" (the Language
Reference), "stdlib_docstrings", "fortunes" (the fortune cookie files of the fortunes package, `apt-get install
fortunes` on Debian and Ubuntu: 2.5 MB of English quotations, jokes, definitions and verse) or your text file.
`--ablation` trains ours alone under its defaults and under each of `--ablations` (one pretrain_mlm.py option
changed each); with `--finetune_variants` each variant's model is also fine-tuned as the race fine-tunes ours, and
each task's paired test compares it with the defaults'.

    # choose the opponent on a separate short run (a seed the race does not use), then race it for 3 minutes
    python scripts/benchmark_pretraining.py --sweep --corpus fortunes --budget 120 --evaluations 6 --seeds 100 \
        --out benchmarks/pretraining_sweep_fortunes
    python scripts/benchmark_pretraining.py --corpus fortunes --budget 180 --seeds 0 1 2 \
        --opponent benchmarks/pretraining_sweep_fortunes.json --out benchmarks/pretraining_3min_fortunes
    # run_mlm.py's recipe on the embedded corpus; your text (one text per line), a 10-minute race
    python scripts/benchmark_pretraining.py --corpus embedded --seeds 0 1 2 --out benchmarks/pretraining_embedded
    python scripts/benchmark_pretraining.py --corpus my_corpus.txt --budget 600 --out outputs/race
    # each model's fine-tuning rate per task chosen on a pretraining seed the race does not use, then raced
    python scripts/benchmark_pretraining.py --corpus fortunes --budget 600 --seeds 100 --finetune_folds 5 \
        --finetune_sweep --finetune_learning_rates 2e-4 3e-4 5e-4 --out benchmarks/finetune_rates_fortunes
    python scripts/benchmark_pretraining.py --corpus fortunes --budget 600 --seeds 0 1 2 --finetune_folds 5 \
        --finetune_rates_from benchmarks/finetune_rates_fortunes.json --out benchmarks/pretraining_10min_fortunes

Writes OUT.json (every curve, the opponent's recipe as it trained, the settings, the kernels ours ran, the machine)
and OUT.png (held-out loss against training seconds, both models, every seed; beside it the time-to-accuracy
speed-up at each of transformers' evaluations; with --finetune_sweep also OUT_rates.png, each model's accuracy
against the rate). Exit status 1 when a check fails (collator cost or parity).
A race, a sweep and an ablation write OUT.json after every run ("finished": false until the last; a race's summary
and plot cover the seeds both models have), so an interrupted one keeps what it did: `--resume OUT.json` trains
only the runs it lacks (a race's: model by model and seed by seed), and takes more seeds onto an earlier report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments


sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrain_mlm  # noqa: E402  the script itself: ours is trained through its main()

from hf_bert_impl import (  # noqa: E402
    SIZE_PRESETS,
    BertImplConfig,
    BertImplForMaskedLM,
    __version__,
    cli,
    kernelize,
    kernels_bert_impl,
)
from hf_bert_impl import data as D  # noqa: E402
from hf_bert_impl.budget import UNBOUNDED_MAX_STEPS, TimeBudget  # noqa: E402


COLLATOR_COST_LIMIT = 1.5


def write_corpus(name: str, folder: Path) -> tuple[Path, Path, str]:
    """The corpus as train.txt / validation.txt (one text per line), as pretrain_mlm.py reads files."""
    train, held_out, description = D.benchmark_corpus(name)
    paths = folder / "train.txt", folder / "validation.txt"
    for path, split in zip(paths, (train, held_out)):
        path.write_text("\n".join(t.replace("\n", " ") for t in split["text"]) + "\n", encoding="utf-8")
    return *paths, description


def common_arguments(args, seed: int) -> dict:
    """TrainingArguments both runs share (--bf16: both pretrain under its autocast)."""
    return {
        "per_device_train_batch_size": args.batch_size,
        "per_device_eval_batch_size": 64,
        "learning_rate": args.learning_rate,
        "weight_decay": 0.01,
        "lr_scheduler_type": "linear",
        "warmup_steps": args.warmup_ratio,
        "logging_steps": 10,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": seed,
        "disable_tqdm": True,
        "bf16": args.bf16,
    }


def curve_of(log_history: list[dict]) -> list[dict]:
    return [
        {"seconds": row["training_seconds"], "step": row["step"], "eval_loss": row["eval_loss"]}
        for row in log_history
        if "eval_loss" in row and "training_seconds" in row
    ]


# Our recipe's levers: training choices, not architecture, each one option of pretrain_mlm.py on top of the race's
# settings. --ablation trains ours under the defaults (batch 16, masking 30%, dropout off while pretraining), under
# each change alone and under BERT's masking and dropout together (evaluated at 15% masking for all).
ABLATIONS = {
    "defaults": [],
    "masking 15%": ["--mlm_probability", "0.15"],
    "masking 40%": ["--mlm_probability", "0.4"],
    "dropout 0.1": ["--pretraining_dropout", "0.1"],
    "masking 15% + dropout 0.1": ["--mlm_probability", "0.15", "--pretraining_dropout", "0.1"],
    "dense prediction": ["--sparse_prediction", "false"],
    "cosine schedule": ["--lr_scheduler_type", "cosine"],
    "warm-up 2%": ["--warmup_steps", "0.02"],
    "batch 8": ["--per_device_train_batch_size", "8"],
    "batch 16": ["--per_device_train_batch_size", "16"],
    "batch 16 + masking 40%": ["--per_device_train_batch_size", "16", "--mlm_probability", "0.4"],
    "batch 32": ["--per_device_train_batch_size", "32"],
    "batch 64": ["--per_device_train_batch_size", "64"],
}
# changes from batch 32 (--batch_size 32: 0.7.0's defaults), the same as the defaults or masking 40% at batch 16:
# left out of --ablations by default
FROM_BATCH_32 = ("batch 16", "batch 16 + masking 40%")


def run_ours(args, seed: int, files, tokenizer_dir: Path, out: Path, options=()) -> dict:
    """Ours through pretrain_mlm.py's main() with the race's settings, then `options` (pretrain_mlm.py flags, which
    override them); evaluated at 15% masking whatever it trains with."""
    common = common_arguments(args, seed)
    argv = [
        "--output_dir",
        str(out),
        "--train_file",
        str(files[0]),
        "--validation_file",
        str(files[1]),
        "--tokenizer_name",
        str(tokenizer_dir),
        "--model_size",
        args.model_size,
        "--max_seq_length",
        str(args.max_seq_length),
        "--time_budget",
        str(args.budget / 60),
        "--eval_every_minutes",
        str(args.budget / args.evaluations / 60),
        "--kernels",
        args.kernels,
    ]
    for key, value in common.items():
        argv += [f"--{key}", str(value)]
    pretrain_mlm.main([*argv, "--eval_mlm_probability", "0.15", *options])
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    facts = json.loads((out / "training_facts.json").read_text())  # what pretrain_mlm.py applied
    hyper = facts["hyperparameters"]
    return {
        "curve": curve_of(history),
        "steps": max(row["step"] for row in history),
        "kernels": facts["kernels"],
        "trained_with": {
            "mlm_probability": hyper["mlm_probability"],
            "eval_mlm_probability": hyper["eval_mlm_probability"],
            "sparse_prediction": facts["kernels"]["sparse_prediction"],
            "train_batch_size": hyper["train_batch_size"],
            "learning_rate": hyper["learning_rate"],
            "warmup_steps": hyper["warmup_steps"],
            "lr_scheduler_type": hyper["lr_scheduler_type"],
            "dropout": hyper["pretraining_dropout"],  # [hidden, attention] as it trained (not the saved config's)
            "mixed_precision": hyper["mixed_precision"],
        },
    }


def corpus_blocks(args, files, tokenizer):
    """(training blocks, held-out blocks) exactly as pretrain_mlm.py makes them from the two files; the same for
    every seed (a validation file is given, so no seeded split). Each seed masks the held-out blocks once with
    seed + 1, as pretrain_mlm.py does."""
    raw, _ = pretrain_mlm.load_raw_data(
        pretrain_mlm.DataArguments(train_file=str(files[0]), validation_file=str(files[1])), seed=0
    )
    train = D.tokenize_and_group(raw["train"], tokenizer, args.max_seq_length, desc="train")
    held_out = D.tokenize_and_group(raw["validation"], tokenizer, args.max_seq_length, desc="validation")
    return train, held_out


# The opponent's recipe: what a user sets through run_mlm.py / TrainingArguments. "run_mlm" is run_mlm.py's own
# (masking 15%, BertConfig's dropout 0.1, the race's learning rate); --sweep tries every combination of OPPONENT_GRID.
RECIPE_KEYS = ("mlm_probability", "dropout", "learning_rate")
OPPONENT_GRID = {"mlm_probability": (0.15, 0.30), "dropout": (0.1, 0.0), "learning_rate": (5e-4, 1e-3)}


def opponent_recipe(spec: str, learning_rate: float) -> dict:
    """--opponent: "run_mlm", "key=value,..." over RECIPE_KEYS (the rest from run_mlm), or the JSON a --sweep run
    wrote (its best recipe)."""
    recipe = {"mlm_probability": 0.15, "dropout": 0.1, "learning_rate": learning_rate}
    if spec == "run_mlm":
        return recipe
    if spec.endswith(".json"):
        try:
            best = json.loads(Path(spec).read_text(encoding="utf-8"))["sweep"]["best"]["recipe"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{spec!r} is not a readable --sweep result with sweep.best.recipe: {e}") from None
        return {key: float(best[key]) for key in RECIPE_KEYS}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in RECIPE_KEYS:
            raise ValueError(f"{item!r} is not key=value with a key in {RECIPE_KEYS}")
        try:
            recipe[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number") from None
    return checked(recipe)


def checked(recipe: dict) -> dict:
    if not 0 < recipe["mlm_probability"] < 1 or not 0 <= recipe["dropout"] < 1 or recipe["learning_rate"] <= 0:
        raise ValueError(f"recipe {recipe} out of range: mlm_probability in (0, 1), dropout in [0, 1), lr > 0")
    return recipe


def sweep_grid(spec: str | None) -> dict:
    """--grid: "key=v1/v2,..." over RECIPE_KEYS narrows or moves OPPONENT_GRID (a key left out keeps its values),
    for a sweep a user would cut short (at a bigger size, say: learning_rate=5e-4/1e-3 with the rest fixed)."""
    grid = dict(OPPONENT_GRID)
    for item in spec.split(",") if spec else ():
        key, sep, values = item.partition("=")
        if not sep or key.strip() not in RECIPE_KEYS:
            raise ValueError(f"{item!r} is not key=v1/v2 with a key in {RECIPE_KEYS}")
        try:
            grid[key.strip()] = tuple(dict.fromkeys(float(value) for value in values.split("/")))
        except ValueError:
            raise ValueError(f"{item!r}: {values!r} is not numbers separated by '/'") from None
    for recipe in sweep_recipes(grid):
        checked(recipe)
    return grid


def sweep_recipes(grid: dict = OPPONENT_GRID) -> list[dict]:
    return [dict(zip(RECIPE_KEYS, values)) for values in itertools.product(*(grid[key] for key in RECIPE_KEYS))]


def transformers_model(args, tokenizer, **overrides) -> BertForMaskedLM:
    size = SIZE_PRESETS[args.model_size]
    return BertForMaskedLM(
        BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **size, **overrides)
    )


def run_transformers(args, seed: int, train, held_out_blocks, tokenizer, out: Path, recipe: dict) -> dict:
    held_out = D.mask_once(held_out_blocks, tokenizer, seed + 1)  # 15%, whatever the recipe trains with
    torch.manual_seed(seed)  # Trainer seeds again before building nothing: the model is built here, as run_mlm.py does
    model = transformers_model(
        args, tokenizer, hidden_dropout_prob=recipe["dropout"], attention_probs_dropout_prob=recipe["dropout"]
    )
    budget = TimeBudget(args.budget, eval_interval=args.budget / args.evaluations)
    training_args = TrainingArguments(
        output_dir=str(out),
        max_steps=UNBOUNDED_MAX_STEPS,
        remove_unused_columns=False,
        **{**common_arguments(args, seed), "learning_rate": recipe["learning_rate"]},
    )
    # Training batches: DataCollatorForLanguageModeling itself (MLMCollator without a seed hands them to it) at the
    # recipe's masking rate; held-out batches (masked once, they carry labels) are only padded.
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=D.MLMCollator(tokenizer, mlm_probability=recipe["mlm_probability"], seed=None),
        callbacks=[budget],
    )
    trainer.train()
    trainer.save_model()
    return {
        "curve": curve_of(trainer.state.log_history),
        "steps": trainer.state.global_step,
        "trained_with": {  # read off what trained: the recipe as it took effect
            "mlm_probability": trainer.data_collator.mlm.mlm_probability,
            "dropout": [model.config.hidden_dropout_prob, model.config.attention_probs_dropout_prob],
            "learning_rate": trainer.args.learning_rate,
            "mixed_precision": cli.mixed_precision(trainer.args),
        },
    }


# The fine-tuning tasks: (the task, max_length of a sentence in tokens)
FINETUNE_TASKS = {
    "statement_topic": (lambda: D.statement_topic_task(seed=0), 48),  # the demo's, from the embedded corpus
    "fortune_topic": (lambda: D.fortune_topic_task(seed=0), 64),  # which of 4 fortune files (chance 25%)
}


def scored_splits(folds: int | None, selected: bool = False) -> tuple[str, ...]:
    """The splits of a task whose sentences `finetune` scores, in the order it lists its predictions: the test split;
    with --finetune_folds every sentence, or (a rate `selected` on the validation split) all but the validation's."""
    if not folds:
        return ("test",)
    return ("train", "test") if selected else ("train", "validation", "test")


def finetune_gold(task, folds: int | None, selected: bool = False) -> np.ndarray:
    """A fine-tuning task's labels in the order `finetune` lists its predictions (`scored_splits`)."""
    return np.concatenate([np.asarray(task[split]["label"]) for split in scored_splits(folds, selected)])


def finetune_paired(
    ours: list[dict], theirs: list[dict], gold: np.ndarray, names: tuple[str, str] = ("ours", "transformers")
) -> dict:
    """Whether the two models' fine-tuned accuracies differ by more than chance, sentence by sentence (the same
    sentences, the same folds): each sentence's share of the seeds whose fine-tuned model labelled it right, ours
    against transformers'; the sign test over the sentences where the shares differ (scipy's exact binomial test,
    two-sided, p = 0.5). With one seed this is McNemar's exact test. `ours`, `theirs`: one task's fine-tuning
    results, one per seed, the same seeds in the same order; `names`: the two models' names in the result's keys
    (an ablation's: a variant against the defaults)."""
    from scipy.stats import binomtest

    ours_right, theirs_right = ([np.asarray(r["predicted"]) == gold for r in rs] for rs in (ours, theirs))
    ours_share, theirs_share = np.mean(ours_right, axis=0), np.mean(theirs_right, axis=0)
    better, worse = int((ours_share > theirs_share).sum()), int((ours_share < theirs_share).sum())
    return {
        "sentences": len(gold),
        "seeds": len(ours),
        f"{names[0]}_right_more_often": better,
        f"{names[1]}_right_more_often": worse,
        "p_value": float(binomtest(better, better + worse).pvalue) if better + worse else 1.0,
    }


def paired_on_same_sentences(first: list[dict], second: list[dict], task, names=("ours", "transformers")):
    """`finetune_paired` of two lists of one task's fine-tuning results where every result scored the same
    sentences of `task` (its dataset): one --finetune_folds, and a rate chosen on the validation split in all of
    them or in none; None otherwise (or with no results)."""
    scored = {(r.get("folds"), bool(r.get("validation"))) for r in first + second}
    if len(scored) != 1:
        return None
    return finetune_paired(first, second, finetune_gold(task, *scored.pop()), names)


def mean_scores(results: list[dict]) -> dict:
    """The mean accuracy and MCC of fine-tuning results (one task's, one per seed)."""
    return {k: float(np.mean([r[k] for r in results])) for k in ("accuracy", "mcc")}


def finetune(args, seed: int, model_dir: Path, name: str, tokenizer, task_name: str, task, rates=None) -> dict:
    """Fine-tunes the pretrained model on `task`, FINETUNE_TASKS[task_name] built once (fixed splits), with the same
    settings for both models, dropout included (`--finetune_dropout`, whatever rate each pretrained with and its
    saved config holds); accuracy and Matthews correlation on its test split, or with `--finetune_folds K` on all
    of its sentences: K fine-tunings, each tested on one fold of sklearn's StratifiedKFold (shuffled, fixed folds)
    and trained on the others. With `--finetune_learning_rates`, the rate is this model's own: the one of them whose
    fine-tuning on the train split scored best on the validation split (the first of equals), as Devlin et al.
    (2019) chose BERT's on each task's dev set; the validation sentences are then left out of the scored ones.
    `rates` (one or more) instead of the arguments': a --finetune_sweep's one rate, --finetune_rates_from's pick."""
    from sklearn.metrics import accuracy_score, matthews_corrcoef
    from sklearn.model_selection import StratifiedKFold
    from transformers import BertForSequenceClassification, DataCollatorWithPadding

    from hf_bert_impl import BertImplForSequenceClassification

    max_length = FINETUNE_TASKS[task_name][1]
    labels = task["train"].features["label"].num_classes
    task = task.map(
        lambda batch: tokenizer(batch["sentence"], truncation=True, max_length=max_length),
        batched=True,
        remove_columns=["sentence"],
    )
    rates = rates or args.finetune_learning_rates or [args.finetune_learning_rate]
    selecting = len(rates) > 1
    gold = finetune_gold(task, args.finetune_folds, selecting)
    if args.finetune_folds:  # every (scored) sentence of the task is a test sentence once
        scored = scored_splits(args.finetune_folds, selecting)
        sentences = datasets.concatenate_datasets([task[split] for split in scored])
        folds = StratifiedKFold(args.finetune_folds, shuffle=True, random_state=0).split(gold, gold)
        splits = [(sentences.select(train), sentences.select(test), test) for train, test in folds]
    else:
        splits = [(task["train"], task["test"], np.arange(len(gold)))]
    dropout = {"hidden_dropout_prob": args.finetune_dropout, "attention_probs_dropout_prob": args.finetune_dropout}
    training_args = {
        rate: TrainingArguments(
            output_dir=str(model_dir / f"finetune-{task_name}"),
            num_train_epochs=args.finetune_epochs,
            per_device_train_batch_size=32,
            per_device_eval_batch_size=128,
            learning_rate=rate,
            warmup_steps=0.1,
            weight_decay=0.01,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=seed,
            disable_tqdm=True,
        )
        for rate in rates
    }
    collator = DataCollatorWithPadding(tokenizer)

    def fit_predict(train, test, rate: float) -> tuple[np.ndarray, torch.nn.Module]:  # from the pretrained weights
        if name == "ours":  # with the speed layer, as scripts/finetune.py fine-tunes
            model = kernelize(
                BertImplForSequenceClassification.from_pretrained(model_dir, num_labels=labels, **dropout),
                args.kernels,
            )
        else:
            model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=labels, **dropout)
        trainer = Trainer(model=model, args=training_args[rate], train_dataset=train, data_collator=collator)
        trainer.train()
        return trainer.predict(test).predictions.argmax(-1), model

    validation = None
    if selecting:  # each rate trained on the train split, scored on the validation split
        validation_gold = np.asarray(task["validation"]["label"])
        validation = [
            {
                "learning_rate": r,
                "accuracy": float(
                    accuracy_score(validation_gold, fit_predict(task["train"], task["validation"], r)[0])
                ),
            }
            for r in rates
        ]
    rate = rates[0] if validation is None else max(validation, key=lambda v: v["accuracy"])["learning_rate"]
    predicted = np.full(len(gold), -1)
    for train, test, where in splits:  # each fold from the pretrained weights, under the same arguments
        predicted[where], model = fit_predict(train, test, rate)
    return {
        "accuracy": float(accuracy_score(gold, predicted)),
        "mcc": float(matthews_corrcoef(gold, predicted)),
        "classes": labels,
        "test_sentences": len(gold),
        "folds": args.finetune_folds,
        "learning_rate": rate,
        "validation": validation,
        "predicted": predicted.tolist(),
        "dropout": [model.config.hidden_dropout_prob, model.config.attention_probs_dropout_prob],
    }


def finetunings(args, name: str) -> dict:
    """The fine-tunings of model `name` after pretraining: report key -> (task, its rates for `finetune`; None: the
    arguments'). With --finetune_sweep one per task and rate, keyed TASK@RATE; with --finetune_rates_from one per
    task at the rate that report chose for this model."""
    if args.finetune_sweep:
        rates = args.finetune_learning_rates
        return {sweep_key(task, rate): (task, [rate]) for task in args.finetune_tasks for rate in rates}
    if args.finetune_rates:
        return {task: (task, [args.finetune_rates[name][task]]) for task in args.finetune_tasks}
    return {task: (task, None) for task in args.finetune_tasks}


def finetune_all(args, seed: int, model_dir: Path, name: str, tokenizer, tasks: dict) -> dict:
    """Every fine-tuning of model `name` pretrained in `model_dir` (`finetunings`; `tasks`: the tasks' datasets by
    name), keyed as the report keys them."""
    return {
        key: finetune(args, seed, model_dir, name, tokenizer, task, tasks[task], rates)
        for key, (task, rates) in finetunings(args, name).items()
    }


def sweep_key(task: str, rate: float) -> str:
    return f"{task}@{rate:g}"


def best_rates(mean_finetune: dict, tasks, rates) -> dict:
    """A --finetune_sweep's choice: each model's rate per task with the highest mean accuracy over the seeds (of
    `mean_finetune`, keyed TASK@RATE), the first of equals in the order of `rates`."""
    return {
        name: {
            task: max(rates, key=lambda rate: mean_finetune[sweep_key(task, rate)][name]["accuracy"]) for task in tasks
        }
        for name in ("ours", "transformers")
    }


def rates_from(path: str, seeds, tasks) -> dict:
    """--finetune_rates_from: the rates a --finetune_sweep report chose (summary.finetune_rates), for a race on
    other seeds than the ones they were chosen on, over tasks the report swept."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        rates = report["summary"]["finetune_rates"]
        chosen_on = sorted({run["seed"] for runs in report["runs"].values() for run in runs})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path!r} is not a readable --finetune_sweep report (summary.finetune_rates): {e}") from None
    if not rates:
        raise ValueError(f"{path!r} is a race without --finetune_sweep: it chose no fine-tuning rates")
    if set(seeds) & set(chosen_on):
        raise ValueError(f"{path!r} chose its rates on seeds {chosen_on}: race other seeds than {sorted(seeds)}")
    missing = [task for task in tasks if any(task not in rates[name] for name in ("ours", "transformers"))]
    if missing:
        raise ValueError(f"{path!r} chose no rate for {missing}: it swept {sorted(rates['ours'])}")
    return {name: {task: float(rates[name][task]) for task in tasks} for name in ("ours", "transformers")}


def check_folds(folds: int, tasks: dict) -> None:
    """--finetune_folds K needs K sentences of every class of every task (a stratified fold holds one of each):
    checked before any training, so a K too large stops the run before it has trained anything."""
    if not folds:  # the test split: nothing to check
        return
    for name, task in tasks.items():
        counts = np.bincount(np.concatenate([np.asarray(split["label"]) for split in task.values()]))
        if counts.min() < folds:
            raise cli.UsageError(
                f"--finetune_folds {folds}: task {name!r} has {counts.min()} sentences of its smallest class "
                f"({task['train'].features['label'].names[counts.argmin()]!r}); give at most {counts.min()} folds"
            )


def time_to_reach(curve: list[dict], target: float) -> float | None:
    """Training seconds at which the held-out loss first reaches `target` (linear between evaluations)."""
    previous = {"seconds": 0.0, "eval_loss": math.inf}
    for point in curve:
        if point["eval_loss"] <= target:
            if not math.isfinite(previous["eval_loss"]):
                return point["seconds"]
            share = (previous["eval_loss"] - target) / (previous["eval_loss"] - point["eval_loss"])
            return previous["seconds"] + share * (point["seconds"] - previous["seconds"])
        previous = point
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The two checks


def collator_cost(train_blocks, tokenizer, batch_size: int, batches: int = 40) -> dict:
    """Median milliseconds per batch: the scripts' seeded MLMCollator vs DataCollatorForLanguageModeling."""
    ours = D.MLMCollator(tokenizer, seed=0, max_length=len(train_blocks[0]["input_ids"]))
    library = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    n = min(len(train_blocks), batch_size * batches)
    rows = [train_blocks[i] for i in range(n)]
    groups = [rows[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
    times = {"ours_ms": [], "library_ms": []}
    for group in groups:  # interleaved, so a change of machine load hits both
        for key, collate in (("ours_ms", ours), ("library_ms", library)):
            start = time.perf_counter()
            collate(group)
            times[key].append((time.perf_counter() - start) * 1e3)
    result = {k: float(np.median(v)) for k, v in times.items()}
    result["ratio"] = result["ours_ms"] / result["library_ms"]
    result["batch"] = [batch_size, len(train_blocks[0]["input_ids"])]
    return result


def parity_check(args, train, tokenizer, steps: int) -> dict:
    """Ours as transformers' BERT (learned positions, unscaled embeddings, no dropout) from the same weights,
    through the same Trainer settings on the same masked batches: the per-step training losses. Ours runs the speed
    layer and sparse prediction as pretrain_mlm.py trains with them (`--kernels`, `config.sparse_prediction`)."""
    from hf_bert_impl.convert import to_hf_bert

    train = D.mask_once(train.select(range(min(len(train), steps * args.batch_size))), tokenizer, seed=0)
    torch.manual_seed(0)
    config = BertImplConfig.from_preset(
        args.model_size,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        position_embedding_type="learned",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ours = BertImplForMaskedLM(config)
    theirs = to_hf_bert(ours)  # converted from the plain model; the kernels are put on ours after
    ours.config.sparse_prediction = True
    kernelize(ours, args.kernels)
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("ours", ours), ("transformers", theirs)):
            training_args = TrainingArguments(
                output_dir=tmp,
                max_steps=steps,
                remove_unused_columns=False,
                # float32 whatever --bf16 says: the check compares the two models' formulas step for step
                **{**common_arguments(args, 0), "logging_steps": 1, "warmup_steps": 0.1, "bf16": False},
            )
            trainer = Trainer(
                model=model, args=training_args, train_dataset=train, data_collator=D.MLMCollator(tokenizer, seed=None)
            )
            trainer.train()
            losses[name] = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    worst = max(abs(a - b) for a, b in zip(losses["ours"], losses["transformers"]))
    return {
        "steps": steps,
        "max_abs_loss_difference": worst,
        "tolerance": args.parity_tolerance,
        "passed": len(losses["ours"]) == len(losses["transformers"]) == steps and worst <= args.parity_tolerance,
        "losses": losses,
    }


# ---------------------------------------------------------------------------------------------------------------------


def time_to_accuracy(ours_curve: list[dict], theirs_curve: list[dict]) -> list[dict]:
    """At every evaluation point of transformers' curve (t, loss): the training seconds ours needs to reach that loss
    and the speed-up t / those seconds (None where ours never gets there). "lower_bound": ours' first evaluation
    already had that loss or lower, so ours got there at that evaluation's seconds or sooner (nothing earlier was
    measured) and the speed-up is at least the figure, not the figure."""
    points = []
    for point in theirs_curve:
        reach = time_to_reach(ours_curve, point["eval_loss"])
        points.append(
            {
                "transformers_seconds": point["seconds"],
                "transformers_loss": point["eval_loss"],
                "ours_seconds": reach,
                "speedup": None if not reach else point["seconds"] / reach,
                "lower_bound": ours_curve[0]["eval_loss"] <= point["eval_loss"],
            }
        )
    return points


def summarize(
    runs: dict, budget: float, past_seconds: float = 60.0, datasets_of: dict | None = None, sweep: tuple | None = None
) -> dict:
    """Per seed and over the seeds; `past_seconds`: the evaluation points counted in the worst speed-up after the
    first minute: the measured ones (None where ours never reaches one, or where all are bounds); the bounds (ours'
    first evaluation already lower) are listed apart. `datasets_of` (the fine-tuning tasks' datasets, by name): each
    task's paired test (`finetune_paired`) where every run scored the same sentences (one --finetune_folds, and a
    rate chosen on the validation split in all runs or in none). `sweep`: (tasks, rates) of a --finetune_sweep, whose
    picks (`best_rates`) go into "finetune_rates" once every run has every one of its fine-tunings."""
    per_seed = []
    for ours, theirs in zip(runs["ours"], runs["transformers"]):
        target = theirs["curve"][-1]["eval_loss"]
        reach = time_to_reach(ours["curve"], target)
        points = time_to_accuracy(ours["curve"], theirs["curve"])
        later = [p for p in points if p["transformers_seconds"] > past_seconds]
        measured = [p["speedup"] for p in later if not p["lower_bound"]]  # a bound (>=) is not a worst case
        per_seed.append(
            {
                "seed": ours["seed"],
                "ours_final_loss": ours["curve"][-1]["eval_loss"],
                "transformers_final_loss": target,
                "ours_steps": ours["steps"],
                "transformers_steps": theirs["steps"],
                "ours_seconds_to_transformers_final_loss": reach,
                "share_of_budget": None if reach is None else reach / budget,
                "time_to_accuracy_speedup": None if not reach else budget / reach,
                "time_to_accuracy": points,
                "worst_speedup_past_first_minute": None if None in measured or not measured else min(measured),
                "lower_bounds_past_first_minute": [p["speedup"] for p in later if p["lower_bound"]],
                "ours_finetune": ours.get("finetune"),
                "transformers_finetune": theirs.get("finetune"),
            }
        )
    shares = [s["share_of_budget"] for s in per_seed]
    worst_later = [s["worst_speedup_past_first_minute"] for s in per_seed]
    tasks = sorted(set.intersection(*(set(r.get("finetune", {})) for rs in runs.values() for r in rs)))
    mean_finetune = {
        task: {name: mean_scores([r["finetune"][task] for r in rs]) for name, rs in runs.items()} for task in tasks
    }
    finetune_tests = {}
    for task in (t for t in tasks if t in (datasets_of or {})):  # tasks: the ones every run has
        results = {name: [r["finetune"][task] for r in rs] for name, rs in runs.items()}
        test = paired_on_same_sentences(results["ours"], results["transformers"], datasets_of[task])
        if test:
            finetune_tests[task] = test
    return {
        "per_seed": per_seed,
        "mean_final_loss": {
            name: float(np.mean([r["curve"][-1]["eval_loss"] for r in rs])) for name, rs in runs.items()
        },
        "mean_steps": {name: float(np.mean([r["steps"] for r in rs])) for name, rs in runs.items()},
        "ours_lower_final_loss_every_seed": all(s["ours_final_loss"] < s["transformers_final_loss"] for s in per_seed),
        "mean_finetune": mean_finetune,
        "ours_finetune_at_least_transformers": {
            task: scores["ours"]["accuracy"] >= scores["transformers"]["accuracy"]
            for task, scores in mean_finetune.items()
        },
        "finetune_paired_test": finetune_tests,
        "finetune_rates": best_rates(mean_finetune, *sweep)
        if sweep and all(sweep_key(t, r) in mean_finetune for t in sweep[0] for r in sweep[1])
        else None,
        "worst_share_of_budget": None if None in shares else max(shares),
        "worst_time_to_accuracy_speedup": None if None in shares else budget / max(s * budget for s in shares),
        "worst_speedup_past_first_minute": None if None in worst_later else min(worst_later),
    }


def recipe_label(recipe: dict) -> str:
    return f"masking {recipe['mlm_probability']:.0%}, dropout {recipe['dropout']:g}, lr {recipe['learning_rate']:g}"


def _title(report: dict) -> str:
    m = report["machine"]
    return (
        f"{report['model_size']} model ({report['size']['num_hidden_layers']}x{report['size']['hidden_size']}), "
        f"seq {report['settings']['max_seq_length']}, batch {report['settings']['batch_size']}"
        + (", bf16" if report["settings"].get("bf16") else "")
        + "; "
        f"corpus: {report['settings']['corpus_name']}\n{m['cpu']}"
        + (f" (family/model {m['cpu_family_model']})" if m.get("cpu_family_model") else "")
        + f", {m['torch_threads']} threads, "
        f"hf-bert-impl {report['version']}"
    )


def plot(report: dict, path: str) -> None:
    """Left: held-out loss against training seconds, both models, every seed. Right: at every evaluation point of
    transformers' curve, its seconds over the seconds ours needs to reach the same loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    labels = {
        "ours": "hf-bert-impl (defaults)",
        "transformers": f"transformers BertForMaskedLM ({recipe_label(report['opponent'])})",
    }
    for i, (name, runs) in enumerate(report["runs"].items()):
        for j, run in enumerate(runs):
            ax.plot(
                [p["seconds"] for p in run["curve"]],
                [p["eval_loss"] for p in run["curve"]],
                color=f"C{i}",
                marker="o",
                markersize=2.5,
                alpha=0.85,
                label=f"{labels[name]}, {len(runs)} seed{'s' * (len(runs) != 1)}" if j == 0 else None,
            )
    target = report["summary"]["mean_final_loss"]["transformers"]
    ax.axhline(
        target, color="C1", linestyle=":", linewidth=1, label=f"transformers' mean loss at the budget ({target:.3f})"
    )
    ax.set_xlabel("training seconds (evaluation not counted)")
    ax.set_ylabel("held-out masked-LM loss (15% masked)")
    ax.set_title(_title(report), fontsize=8.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for j, row in enumerate(report["summary"]["per_seed"]):
        points = [p for p in row["time_to_accuracy"] if p["speedup"] is not None]
        right.plot(
            [p["transformers_seconds"] for p in points],
            [p["speedup"] for p in points],
            color="C0",
            marker="o",
            markersize=2.5,
            alpha=0.85,
            label="ours, each seed" if j == 0 else None,
        )
    bounds = [p for row in report["summary"]["per_seed"] for p in row["time_to_accuracy"] if p["lower_bound"]]
    if bounds:  # ours' first evaluation was already lower: the speed-up is at least the figure
        right.plot(
            [p["transformers_seconds"] for p in bounds],
            [p["speedup"] for p in bounds],
            linestyle="none",
            marker="^",
            markersize=6,
            markerfacecolor="none",
            color="C0",
            label="at least (ours' first evaluation was already lower)",
        )
    right.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="as fast as transformers")
    right.set_ylim(bottom=0)
    right.set_xlabel("training seconds of transformers' evaluation point")
    right.set_ylabel("time-to-accuracy speed-up of ours")
    right.set_title("transformers' seconds / ours' seconds to the same held-out loss", fontsize=8.5)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rates(report: dict, path: str) -> None:
    """A --finetune_sweep's result: per task, each model's mean fine-tuned accuracy over the seeds against the
    fine-tuning rate, the rate chosen for each marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, summary = report["settings"], report["summary"]
    tasks, rates = settings["finetune_tasks"], settings["finetune_learning_rates"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, name in enumerate(("ours", "transformers")):
            accuracy = [summary["mean_finetune"][sweep_key(task, rate)][name]["accuracy"] for rate in rates]
            chosen = summary["finetune_rates"][name][task]
            ax.plot(rates, accuracy, color=f"C{i}", marker="o", label=f"{name}: {chosen:g} chosen")
            ax.plot([chosen], [accuracy[rates.index(chosen)]], color=f"C{i}", marker="*", markersize=14)
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{rate:g}" for rate in rates])
        ax.minorticks_off()
        ax.set_xlabel("fine-tuning learning rate")
        ax.set_ylabel(f"accuracy, {settings['finetune_folds']}-fold over every sentence")
        seeds = len(report["runs"]["ours"])
        ax.set_title(f"{task}: mean of {seeds} pretraining seed{'s' * (seeds != 1)}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    title = f"fine-tuning rate sweep after {settings['budget']:g} s of pretraining\n" + _title(report)
    fig.suptitle(title, fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_variants(report: dict, rows: list[dict], label, best, title: str, path: str) -> None:
    """Held-out loss against training seconds of every variant of a sweep or an ablation (`rows`, each with "runs"
    and "mean_final_loss"; `label(row)` names one; the `best` row drawn thick); a row's mean fine-tuned accuracies
    (--finetune_variants) go into its legend entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, row in enumerate(rows):
        tuned = row.get("mean_finetune", {})
        legend = f"{label(row)}: {row['mean_final_loss']:.3f}" + "".join(
            f"; {task} accuracy {scores['accuracy']:.3f}" for task, scores in tuned.items()
        )
        for j, run in enumerate(row["runs"]):
            ax.plot(
                [p["seconds"] for p in run["curve"]],
                [p["eval_loss"] for p in run["curve"]],
                color=f"C{i % 10}",
                linestyle="-" if i < 10 else "--",
                linewidth=2.2 if row is best else 1.0,
                label=legend if j == 0 else None,
            )
    ax.set_xlabel("training seconds (evaluation not counted)")
    ax.set_ylabel("held-out masked-LM loss (15% masked)")
    ax.set_title(f"{title} (thick: the lowest mean loss at the budget)\n" + _title(report), fontsize=8.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpus",
        default="embedded",
        help="embedded, stdlib_docstrings, fortunes (the fortunes package's files) or a text file (one text a line)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", type=float, default=180.0, help="training seconds per run")
    parser.add_argument("--evaluations", type=int, default=12, help="held-out evaluations per run (evenly in time)")
    parser.add_argument("--model_size", default="mini", choices=list(SIZE_PRESETS))
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument(
        "--batch_size", type=int, default=pretrain_mlm.RECIPE_BATCH_SIZE, help="both models' (ours' default)"
    )
    parser.add_argument(
        "--learning_rate",
        type=float,
        default=pretrain_mlm.RECIPE_LEARNING_RATE,
        help="ours' (its default; and run_mlm's recipe's)",
    )
    parser.add_argument(
        "--warmup_ratio",
        type=float,
        default=pretrain_mlm.RECIPE_WARMUP,
        help="warm-up as a share of the budget's time (ours' default)",
    )
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="both models pretrain under TrainingArguments' bf16 (autocast to bfloat16; float32 weights and "
        "AdamW state), as a user of a CPU with native bfloat16 would; the parity check and the fine-tuning stay "
        "float32",
    )
    parser.add_argument(
        "--opponent",
        default="run_mlm",
        help="transformers' recipe: run_mlm (masking 0.15, dropout 0.1, --learning_rate), "
        "'mlm_probability=0.3,dropout=0,learning_rate=5e-4' (keys left out: run_mlm's), or a --sweep result JSON "
        "(its best recipe)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the race: transformers alone under every recipe of masking 0.15 / 0.30, dropout 0.1 / 0, "
        "learning rate 5e-4 / 1e-3, for --budget on each seed; writes OUT.json (with the best recipe, for "
        "--opponent) and OUT.png",
    )
    parser.add_argument(
        "--grid",
        help="with --sweep: other values for some of its keys, "
        "'mlm_probability=0.3,dropout=0,learning_rate=5e-4/1e-3' (values separated by '/'; a key left out keeps "
        "the grid's)",
    )
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="instead of the race: ours alone under its defaults and under each of --ablations (one pretrain_mlm.py "
        "option changed each), for --budget on each seed; writes OUT.json and OUT.png",
    )
    parser.add_argument(
        "--ablations",
        nargs="+",
        default=[name for name in ABLATIONS if name not in FROM_BATCH_32],
        choices=list(ABLATIONS),
        metavar="NAME",
        help=f"the variants --ablation trains: {', '.join(map(repr, ABLATIONS))} (default: all but "
        f"{', '.join(map(repr, FROM_BATCH_32))}, changes from batch 32)".replace("%", "%%"),
    )
    parser.add_argument(
        "--finetune_variants",
        action="store_true",
        help="with --ablation: also fine-tune each variant's model as a race fine-tunes ours (--finetune_tasks and "
        "the --finetune_* settings; --finetune_rates_from: ours' rates); each variant then gets its mean accuracy "
        "per task and a paired test against the defaults",
    )
    parser.add_argument(
        "--resume",
        nargs="+",
        default=[],
        metavar="JSON",
        help="earlier reports of the same kind (race, --sweep or --ablation) and settings (their OUT.json, also an "
        "interrupted one's) whose runs are taken instead of trained again: model (or variant) by model and seed by "
        "seed; a race's also share the opponent's recipe and the fine-tuning settings",
    )
    parser.add_argument(
        "--resume_only",
        action="store_true",
        help="with --resume: train nothing; the report holds the variants and seeds the reports have (one report "
        "from several, with each variant's mean over the seeds it has)",
    )
    parser.add_argument(
        "--finetune_tasks",
        nargs="*",
        default=list(FINETUNE_TASKS),
        choices=list(FINETUNE_TASKS),
        help="fine-tune each pretrained model on these tasks (none: skip)",
    )
    parser.add_argument("--finetune_epochs", type=float, default=3.0)
    parser.add_argument("--finetune_learning_rate", type=float, default=3e-4)
    parser.add_argument(
        "--finetune_learning_rates",
        type=float,
        nargs="+",
        metavar="LR",
        help="instead of --finetune_learning_rate: each model's own rate among these (at least two), per task and "
        "seed, the one whose fine-tuning on the task's train split scores best on its validation split (Devlin et "
        "al. 2019's choice on the dev set); the validation sentences are then not scored",
    )
    parser.add_argument(
        "--finetune_sweep",
        action="store_true",
        help="with --finetune_learning_rates and --finetune_folds: each model fine-tuned at every one of those rates "
        "(entries TASK@RATE) instead of choosing on the validation split; the summary's finetune_rates names each "
        "model's rate per task with the highest mean accuracy over the seeds, for --finetune_rates_from (run it on "
        "seeds the race does not use)",
    )
    parser.add_argument(
        "--finetune_rates_from",
        metavar="JSON",
        help="each model's fine-tuning rate per task from a --finetune_sweep report (its summary.finetune_rates), "
        "for a race on other seeds than it chose them on",
    )
    parser.add_argument(
        "--finetune_folds",
        type=int,
        default=0,
        metavar="K",
        help="0: train on each task's train split, score its test split; K >= 2: score every sentence of the task, "
        "each by the one of K fine-tunings (stratified folds) that did not train on it",
    )
    parser.add_argument(
        "--finetune_dropout",
        type=float,
        default=0.1,
        help="dropout of both models while fine-tuning (BERT's 0.1), whatever each pretrained with",
    )
    parser.add_argument("--parity_steps", type=int, default=20, help="steps of the parity check (0: skip it)")
    parser.add_argument("--parity_tolerance", type=float, default=1e-5)
    parser.add_argument(
        "--kernels",
        default="auto",
        help="ours' speed layer (hf_bert_impl.kernelize): auto (the table's kernels), reference "
        "(the plain model) or kernel names, comma-separated",
    )
    parser.add_argument("--out", default="outputs/pretraining_race", help="writes OUT.json and OUT.png")
    args = parser.parse_args(argv)
    try:
        kernels_bert_impl.kernel_names(args.kernels)
    except ValueError as e:
        parser.error(f"--kernels: {e}")
    try:
        args.recipe = opponent_recipe(args.opponent, args.learning_rate)
    except ValueError as e:
        parser.error(f"--opponent: {e}")
    if args.sweep and args.opponent != "run_mlm":
        parser.error("--sweep tries every recipe: leave --opponent out")
    if args.grid is not None and not args.sweep:
        parser.error("--grid is --sweep's: a race trains one recipe (--opponent)")
    try:
        args.grid = sweep_grid(args.grid) if args.sweep else None  # a race or an ablation records no grid
    except ValueError as e:
        parser.error(f"--grid: {e}")
    if args.sweep and args.ablation:
        parser.error("--sweep (transformers' recipes) and --ablation (ours') are separate runs: choose one")
    if args.finetune_variants and not args.ablation:
        parser.error(
            "--finetune_variants fine-tunes an ablation's variants: give --ablation (a race fine-tunes "
            "both models anyway)"
        )
    if args.finetune_variants and args.finetune_sweep:
        parser.error(
            "--finetune_variants fine-tunes each variant at ours' rate: leave --finetune_sweep out (it "
            "chooses rates for a race)"
        )
    if not 0 <= args.finetune_dropout < 1:
        parser.error(f"--finetune_dropout must be a rate in [0, 1), got {args.finetune_dropout}")
    rates = args.finetune_learning_rates
    if rates is not None and (len(set(rates)) < 2 or min(rates) <= 0):
        parser.error(f"--finetune_learning_rates takes at least two different positive rates, got {rates}")
    if args.finetune_folds < 0 or args.finetune_folds == 1:
        parser.error(f"--finetune_folds must be 0 (the test split) or at least 2, got {args.finetune_folds}")
    if args.finetune_sweep and not (rates and args.finetune_folds):
        parser.error(
            "--finetune_sweep scores every rate of --finetune_learning_rates on every sentence: give those "
            "rates and --finetune_folds K"
        )
    args.finetune_rates = None  # each model's rate per task, read from --finetune_rates_from
    if args.finetune_rates_from:
        if rates or args.finetune_sweep:
            parser.error(
                "--finetune_rates_from gives each model its rates: leave --finetune_learning_rates and "
                "--finetune_sweep out"
            )
        try:
            args.finetune_rates = rates_from(args.finetune_rates_from, args.seeds, args.finetune_tasks)
        except ValueError as e:
            parser.error(f"--finetune_rates_from: {e}")
    if args.resume_only and not args.resume:
        parser.error("--resume_only builds the report from --resume's reports: give them")
    return args


def report_head(args, description: str, blocks, held_out) -> dict:
    return {
        "version": __version__,
        "corpus": description,
        "model_size": args.model_size,
        "size": SIZE_PRESETS[args.model_size],
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "corpus", "recipe")},
            "corpus_name": Path(args.corpus).name,
        },
        "training_blocks": len(blocks),
        "held_out_blocks": len(held_out),
        "machine": cli.machine_record(),
    }


def print_run(seed: int, name: str, result: dict) -> None:
    last = result["curve"][-1]
    print(
        f"seed {seed} {name:12s}: {result['steps']} steps in {last['seconds']:.0f} s, held-out loss "
        + " ".join(f"{p['seconds']:.0f}s:{p['eval_loss']:.3f}" for p in result["curve"])
        + "".join(
            f"; {task}: accuracy {scores['accuracy']:.4f}, MCC {scores['mcc']:.4f}"
            + (
                f" (learning rate {scores['learning_rate']:g}, chosen on the validation split: "
                + ", ".join(f"{v['learning_rate']:g} {v['accuracy']:.4f}" for v in scores["validation"])
                + ")"
                if scores.get("validation")
                else ""
            )
            for task, scores in result.get("finetune", {}).items()
        ),
        flush=True,
    )


# what runs taken from --resume's reports must share with this one (besides the kind, version, corpus and CPU)
RESUME_SETTINGS = (
    "corpus_name",
    "budget",
    "evaluations",
    "model_size",
    "max_seq_length",
    "batch_size",
    "learning_rate",
    "warmup_ratio",
    "bf16",
    "vocab_size",
    "kernels",
    "finetune_variants",
)


# and what a race's (and a --finetune_variants ablation's) must share besides: its runs are also fine-tuned (a
# race's raced against one recipe)
RACE_RESUME_SETTINGS = (
    "finetune_tasks",
    "finetune_epochs",
    "finetune_learning_rate",
    "finetune_dropout",
    "finetune_folds",
    "finetune_learning_rates",
    "finetune_sweep",
    "finetune_rates",
)
# a setting an earlier report has not: the value it ran with
SETTINGS_BEFORE = {
    "bf16": False,
    "finetune_variants": False,
    "finetune_folds": 0,
    "finetune_learning_rates": None,
    "finetune_sweep": False,
    "finetune_rates": None,
}


def resumed_reports(args, head: dict) -> list[tuple[str, dict]]:
    """--resume's reports, read and checked against this run: the same kind (race, sweep or ablation), version,
    corpus (its name and size), CPU (name, family and model) and RESUME_SETTINGS (a race's: also the opponent's
    recipe and RACE_RESUME_SETTINGS; a --finetune_variants ablation's: RACE_RESUME_SETTINGS), so that a run taken
    from one is a run this one would have made."""
    kind = "sweep" if args.sweep else "ablation" if args.ablation else "race"
    keys = RESUME_SETTINGS + (RACE_RESUME_SETTINGS if kind == "race" or args.finetune_variants else ())
    ours = {
        "version": __version__,
        **{k: head["machine"].get(k) for k in ("cpu", "cpu_family_model")},
        "corpus": head["corpus"],
        **({"opponent": args.recipe} if kind == "race" else {}),
        **{k: head["settings"][k] for k in keys},
    }
    reports = []
    for path in args.resume:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise cli.UsageError(f"--resume {path}: not a readable report ({e})") from e
        sections = ("runs", "opponent") if kind == "race" else (kind,)
        if not isinstance(report, dict) or any(section not in report for section in sections):
            what = "race" if kind == "race" else f"--{kind}"
            raise cli.UsageError(f"--resume {path}: not a {what} report (no {' or '.join(map(repr, sections))})")
        theirs = {
            "version": report.get("version"),
            **{k: report.get("machine", {}).get(k) for k in ("cpu", "cpu_family_model")},
            "corpus": report.get("corpus"),
            **({"opponent": report.get("opponent")} if kind == "race" else {}),
            **{k: report.get("settings", {}).get(k, SETTINGS_BEFORE.get(k)) for k in keys},
        }
        for key, value in ours.items():
            if theirs[key] != value:
                raise cli.UsageError(f"--resume {path}: its {key} is {theirs[key]!r}, this run's is {value!r}")
        reports.append((path, report))
    return reports


def earlier_runs(args, head: dict, runs_in) -> dict:
    """(label, seed) -> (what the run belongs to, the report's path, the run) for every run of --resume's reports;
    `runs_in(report)` yields (label, what it belongs to, run). A run two reports hold differently stops here."""
    earlier = {}
    for path, report in resumed_reports(args, head):
        for name, owner, run in runs_in(report):
            key = (name, run["seed"])
            if key in earlier and earlier[key][2] != run:
                raise cli.UsageError(f"--resume: {name} seed {key[1]} differs between {earlier[key][1]} and {path}")
            earlier.setdefault(key, (owner, path, run))
    return earlier


def run_variants(args, head: dict, variants: list[dict], label, train, report_of) -> tuple[list[dict], dict]:
    """Each variant (the fields of its row; `label(row)` names it) trained on every seed by `train(seed, index)`:
    rows of those fields, "mean_final_loss" (held-out loss at the budget, mean of the seeds) and "runs"; and the row
    with the lowest mean loss. A variant and seed that one of --resume's reports holds (same fields) is taken from
    there instead of trained; with --resume_only nothing is trained, a pair no report holds is left out, and so is a
    variant with none. `report_of(rows, best)` is written to OUT.json after every run ("finished": false until every
    variant has every seed), so an interrupted run keeps what it did and `--resume OUT.json` goes on from there."""
    earlier = earlier_runs(
        args,
        head,
        lambda report: (
            (label(row), row, run)
            for row in (report["sweep"]["recipes"] if args.sweep else report["ablation"]["rows"])
            for run in row["runs"]
        ),
    )
    rows, best = [], None
    total, done = len(variants) * len(args.seeds), 0
    for index, fields in enumerate(variants):
        row = {**fields, "runs": []}
        for seed in args.seeds:
            found = earlier.get((label(row), seed))
            if found and any(found[0].get(k) != v for k, v in fields.items()):
                raise cli.UsageError(f"--resume {found[1]}: {label(row)} was trained with other settings there")
            if found:
                result = found[2]
                print(f"seed {seed} {label(row)}: taken from {found[1]}")
            elif args.resume_only:
                print(f"seed {seed} {label(row)}: in no --resume report, left out (--resume_only)")
                continue
            else:
                result = train(seed, index)
                result["seed"] = seed
            print_run(seed, label(row), result)
            if not row["runs"]:
                rows.append(row)
            row["runs"].append(result)
            row["mean_final_loss"] = float(np.mean([r["curve"][-1]["eval_loss"] for r in row["runs"]]))
            done += 1
            best = min(rows, key=lambda row: row["mean_final_loss"])
            cli.write_result_json({**report_of(rows, best), "finished": done == total}, f"{args.out}.json")
    if not rows:
        raise cli.UsageError("--resume_only: the --resume reports hold none of these variants and seeds")
    return rows, best


def sweep(args, tmp: Path, blocks, held_out, tokenizer, head: dict) -> dict:
    recipes = sweep_recipes(args.grid)

    def report_of(rows, best):
        return {
            "what": "recipe sweep of transformers' BertForMaskedLM (the race's opponent): held-out masked-LM loss "
            "(15% masked) against training seconds under every recipe, the same budget",
            **head,
            "sweep": {
                "grid": args.grid,
                "best": {"recipe": best["recipe"], "mean_final_loss": best["mean_final_loss"]},
                "recipes": rows,
            },
        }

    rows, best = run_variants(
        args,
        head,
        [{"recipe": recipe} for recipe in recipes],
        lambda row: recipe_label(row["recipe"]),
        lambda seed, i: run_transformers(args, seed, blocks, held_out, tokenizer, tmp / "sweep", recipes[i]),
        report_of,
    )
    report = report_of(rows, best)
    plot_variants(
        report,
        rows,
        lambda row: recipe_label(row["recipe"]),
        best,
        "transformers' BertForMaskedLM, recipe sweep",
        f"{args.out}.png",
    )
    for row in sorted(rows, key=lambda row: row["mean_final_loss"]):
        print(f"{recipe_label(row['recipe'])}: mean held-out loss at {args.budget:.0f} s {row['mean_final_loss']:.3f}")
    print(f"best: {recipe_label(best['recipe'])}; race it with --opponent {args.out}.json")
    print(f"wrote {args.out}.json and {args.out}.png")
    return report


def variant_finetune(rows: list[dict], datasets_of: dict) -> None:
    """--finetune_variants: each row's mean fine-tuned accuracy and MCC per task over its seeds ("mean_finetune"),
    and per task the paired test (`finetune_paired`) of the variant against the defaults on the seeds both have
    ("finetune_paired_test_vs_defaults"; none for the defaults, or without their row)."""
    defaults = next((row for row in rows if row["variant"] == "defaults"), None)
    for row in rows:
        runs = row["runs"]
        tasks = sorted(set.intersection(*(set(r.get("finetune", {})) for r in runs)))
        row["mean_finetune"] = {task: mean_scores([r["finetune"][task] for r in runs]) for task in tasks}
        if defaults is None or row is defaults:
            continue
        base = {r["seed"]: r for r in defaults["runs"]}
        both = [r for r in runs if r["seed"] in base]
        tests = {}
        for task in (t for t in tasks if t in datasets_of and all(t in base[r["seed"]]["finetune"] for r in both)):
            mine, theirs = [r["finetune"][task] for r in both], [base[r["seed"]]["finetune"][task] for r in both]
            test = paired_on_same_sentences(mine, theirs, datasets_of[task], ("variant", "defaults"))
            if test:  # none without a seed both have
                tests[task] = test
        row["finetune_paired_test_vs_defaults"] = tests


def ablation(args, tmp: Path, files, head: dict, tokenizer, tasks: dict) -> dict:
    """Ours alone under the defaults and under each of --ablations, on every seed; with --finetune_variants
    (`tasks`: the fine-tuning tasks' datasets) each variant's model also fine-tuned as a race fine-tunes ours."""

    def train(seed: int, i: int) -> dict:
        out = tmp / f"ablation-{i}-{seed}"
        result = run_ours(args, seed, files, tmp / "tokenizer", out, ABLATIONS[args.ablations[i]])
        if tasks:
            result["finetune"] = finetune_all(args, seed, out, "ours", tokenizer, tasks)
        return result

    def report_of(rows, best):
        for row in rows:
            row["mean_steps"] = float(np.mean([r["steps"] for r in row["runs"]]))
        if tasks:
            variant_finetune(rows, tasks)
        return {
            "what": "ablation of ours' training recipe: held-out masked-LM loss (15% masked) against training "
            "seconds under the defaults and under each change alone, the same budget"
            + ("; each variant's model also fine-tuned as the race fine-tunes ours" if tasks else ""),
            **head,
            "ablation": {"best": best["variant"], "rows": rows},
        }

    rows, best = run_variants(
        args,
        head,
        [{"variant": name, "options": ABLATIONS[name]} for name in args.ablations],
        lambda row: row["variant"],
        train,
        report_of,
    )
    report = report_of(rows, best)
    plot_variants(report, rows, lambda row: row["variant"], best, "hf-bert-impl, recipe ablation", f"{args.out}.png")
    for row in rows:
        print(
            f"{row['variant']:18s} {' '.join(row['options']) or '(as the race runs pretrain_mlm.py)'}: mean "
            f"held-out loss at {args.budget:.0f} s {row['mean_final_loss']:.3f}, {row['mean_steps']:.0f} steps"
            + "".join(
                f"; {task}: accuracy {scores['accuracy']:.4f}, MCC {scores['mcc']:.4f}"
                + (
                    f" (sentences right more often than the defaults: {test['variant_right_more_often']}, less "
                    f"often: {test['defaults_right_more_often']}, sign test p = {test['p_value']:.3g})"
                    if (test := row.get("finetune_paired_test_vs_defaults", {}).get(task))
                    else ""
                )
                for task, scores in row.get("mean_finetune", {}).items()
            )
        )
    print(f"lowest: {best['variant']}")
    print(f"wrote {args.out}.json and {args.out}.png")
    return report


def paired(runs: dict) -> dict:
    """The runs of the seeds both models have, in the same order (an interrupted race's report is summarised over
    those)."""
    seeds = [r["seed"] for r in runs["ours"] if any(t["seed"] == r["seed"] for t in runs["transformers"])]
    return {name: [next(r for r in rs if r["seed"] == seed) for seed in seeds] for name, rs in runs.items()}


def race(args, head: dict, tmp: Path, files, blocks, held_out, tokenizer, tasks: dict, race_report) -> dict:
    """Both models on every seed (the two runs of a seed take turns in which goes first), each fine-tuned on
    `tasks`; a model and seed that one of --resume's reports holds is taken from there instead (with --resume_only,
    nothing is trained). `race_report(runs, finished)` is written to OUT.json after every run, and OUT.png after
    every seed both models have, so an interrupted race keeps what it did and `--resume OUT.json` goes on. Returns
    the last report written."""
    earlier = earlier_runs(
        args, head, lambda report: ((name, None, run) for name, rs in report["runs"].items() for run in rs)
    )
    runs, report = {"ours": [], "transformers": []}, None
    for i, seed in enumerate(args.seeds):
        order = ("ours", "transformers") if i % 2 == 0 else ("transformers", "ours")
        for name in order:
            if (name, seed) in earlier:
                _, path, result = earlier[(name, seed)]
                print(f"seed {seed} {name}: taken from {path}")
            elif args.resume_only:
                print(f"seed {seed} {name}: in no --resume report, left out (--resume_only)")
                continue
            else:
                out = tmp / f"{name}-{seed}"
                result = (
                    run_ours(args, seed, files, tmp / "tokenizer", out)
                    if name == "ours"
                    else run_transformers(args, seed, blocks, held_out, tokenizer, out, args.recipe)
                )
                result["seed"] = seed
                if tasks:
                    result["finetune"] = finetune_all(args, seed, out, name, tokenizer, tasks)
            runs[name].append(result)
            print_run(seed, name, result)
            report = race_report(runs, all(len(rs) == len(args.seeds) for rs in runs.values()))
            cli.write_result_json(report, f"{args.out}.json")
        if report and report["summary"]:
            plot(report, f"{args.out}.png")
    if not (report and report["summary"]):
        raise cli.UsageError("--resume_only: the --resume reports hold no seed with both models")
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="race-") as tmp:
        tmp = Path(tmp)
        *files, description = write_corpus(args.corpus, tmp)
        train_texts = [t for t in files[0].read_text(encoding="utf-8").splitlines() if t.strip()]
        tokenizer = D.train_wordpiece_tokenizer(train_texts, vocab_size=args.vocab_size)
        tokenizer.save_pretrained(tmp / "tokenizer")
        blocks, held_out = corpus_blocks(args, files, tokenizer)
        print(
            f"corpus: {description}; {len(blocks)} training / {len(held_out)} held-out blocks of {args.max_seq_length}"
        )
        head = report_head(args, description, blocks, held_out)
        # built before any training: a task that cannot be built (no fortune files) stops the race here
        finetuning = args.finetune_epochs and not args.sweep and (args.finetune_variants or not args.ablation)
        tasks = {t: FINETUNE_TASKS[t][0]() for t in args.finetune_tasks} if finetuning else {}
        check_folds(args.finetune_folds, tasks)
        if args.sweep:
            sweep(args, tmp, blocks, held_out, tokenizer, head)
            return 0
        if args.ablation:
            ablation(args, tmp, files, head, tokenizer, tasks)
            return 0
        cost = collator_cost(blocks, tokenizer, args.batch_size)
        print(
            f"collator cost per batch: ours {cost['ours_ms']:.2f} ms, DataCollatorForLanguageModeling "
            f"{cost['library_ms']:.2f} ms ({cost['ratio']:.2f}x; limit {COLLATOR_COST_LIMIT}x)"
        )
        parity = parity_check(args, blocks, tokenizer, args.parity_steps) if args.parity_steps else None
        if parity:
            print(
                f"step-for-step parity over {parity['steps']} steps: max |loss difference| "
                f"{parity['max_abs_loss_difference']:.2e} (tolerance {parity['tolerance']:.0e})"
            )
        print(f"transformers' recipe: {recipe_label(args.recipe)}", flush=True)

        scored = {key: tasks[task] for key, (task, _) in finetunings(args, "ours").items() if task in tasks}
        rate_sweep = (args.finetune_tasks, args.finetune_learning_rates) if args.finetune_sweep and tasks else None

        def race_report(runs: dict, finished: bool) -> dict:
            pairs = paired(runs)
            return {
                "what": "pretraining race: held-out masked-LM loss (15% masked) against training seconds, ours "
                "(defaults) vs transformers' BertForMaskedLM under the opponent's recipe, the same budget",
                **head,
                "opponent": args.recipe,
                "collator_cost": cost,
                "parity": parity,
                "summary": (
                    summarize(pairs, args.budget, datasets_of=scored, sweep=rate_sweep) if pairs["ours"] else None
                ),
                "kernels": {  # both run on the CPU with float32 weights; each run of ours records its own
                    "setting": args.kernels,
                    "kernels": cli.kernels_in_use(args.kernels, "cpu", torch.float32),
                },
                "runs": runs,
                "finished": finished,
            }

        report = race(args, head, tmp, files, blocks, held_out, tokenizer, tasks, race_report)
    s = report["summary"]
    print(
        f"mean held-out loss at {args.budget:.0f} s: ours {s['mean_final_loss']['ours']:.3f} "
        f"({s['mean_steps']['ours']:.0f} steps), transformers {s['mean_final_loss']['transformers']:.3f} "
        f"({s['mean_steps']['transformers']:.0f} steps)"
    )
    for row in s["per_seed"]:
        share = row["share_of_budget"]
        print(
            f"seed {row['seed']}: ours reaches transformers' final loss {row['transformers_final_loss']:.3f} "
            + ("never" if share is None else f"at {share:.2f} of the budget ({1 / share:.2f}x time-to-accuracy)")
            + "; at each of transformers' evaluations: "
            + " ".join(
                f"{p['transformers_seconds']:.0f}s:"
                + ("never" if p["speedup"] is None else f"{'>=' * p['lower_bound']}{p['speedup']:.2f}x")
                for p in row["time_to_accuracy"]
            )
        )
    folds = f"{args.finetune_folds}-fold cross-validated" if args.finetune_folds else "test"
    for task, scores in s["mean_finetune"].items():
        test = s["finetune_paired_test"].get(task)
        print(
            f"{task}: mean {folds} accuracy ours {scores['ours']['accuracy']:.4f} (MCC {scores['ours']['mcc']:.4f}), "
            f"transformers {scores['transformers']['accuracy']:.4f} (MCC {scores['transformers']['mcc']:.4f})"
            + (
                ""
                if test is None
                else f"; sentences right more often: ours {test['ours_right_more_often']}, "
                f"transformers {test['transformers_right_more_often']} (sign test p = {test['p_value']:.3g})"
            )
        )
    if s["finetune_rates"]:
        plot_rates(report, f"{args.out}_rates.png")
        print(f"wrote {args.out}_rates.png (accuracy against the fine-tuning rate)")
        print(
            "fine-tuning rates with the highest mean accuracy: "
            + "; ".join(
                f"{name} " + ", ".join(f"{task} {rate:g}" for task, rate in picks.items())
                for name, picks in s["finetune_rates"].items()
            )
            + f"; race them on other seeds with --finetune_rates_from {args.out}.json"
        )
    ran = "; ".join(f"{mode}: {', '.join(names) or 'none'}" for mode, names in report["kernels"]["kernels"].items())
    print(f"ours' kernels ({args.kernels}): {ran}")
    print(f"wrote {args.out}.json and {args.out}.png")
    failed = cost["ratio"] > COLLATOR_COST_LIMIT or (parity is not None and not parity["passed"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
