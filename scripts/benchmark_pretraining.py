"""The pretraining race: which BERT is better after the same training time on this machine?

Per seed, both models pretrain for `--budget` training seconds (evaluation not counted) with the same tokenizer,
blocks, size, batch, AdamW and schedule (linear decay over the time, `hf_bert_impl.budget.TimeBudget`), evaluated
`--evaluations` times on the same held-out blocks under one fixed 15% masking:
  ours          the package's pretraining (`hf_bert_impl.pretraining`, as scripts/pretrain_mlm.py) with its defaults
  transformers  `BertForMaskedLM` with `Trainer` under `--opponent`: run_mlm.py's recipe, yours, or a `--sweep`'s best
Then the package's fine-tuning (`hf_bert_impl.finetuning`; transformers' model converted to our classes, exact to
1e-5) fine-tunes both alike on "statement_topic" (the embedded corpus' task) and "fortune_topic" (which of four
fortune files a fortune is from), scored on the test split or on every sentence by K-fold cross-validation
(`--finetune_folds K`). Speed-up: the budget over the seconds ours took to reach transformers' final loss. A parity
check runs first: ours configured as transformers' BERT follows its per-step loss (exit status 1 if not).

    python scripts/benchmark_pretraining.py --sweep --corpus fortunes --budget 120 --evaluations 6 --seeds 100 \
        --out outputs/sweep                               # transformers' best recipe, on a seed the race does not use
    python scripts/benchmark_pretraining.py --corpus fortunes --budget 180 --seeds 0 1 2 --finetune_folds 5 \
        --opponent outputs/sweep.json --out outputs/race  # the race
    python scripts/benchmark_pretraining.py --ablation "--mlm_probability 0.15" "--pretraining_dropout 0.1" \
        --corpus fortunes --budget 600 --out outputs/ablation         # ours' defaults against one change each
    python scripts/benchmark_pretraining.py --table benchmarks/*_pretraining_*min*.json    # the README's table

Corpora: "embedded" (the package's), "fortunes" (`apt-get install fortunes`) or a text file. Writes OUT.json after
every run and OUT.png (the `plot` extra); the paired test of fine-tuned accuracies needs the `stats` extra.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM, HfArgumentParser, Trainer, TrainingArguments

import hf_bert_impl
from hf_bert_impl import SIZE_PRESETS, BertImplConfig, BertImplForMaskedLM, cli, finetuning, kernelize, pretraining
from hf_bert_impl import data as D
from hf_bert_impl.budget import UNBOUNDED_MAX_STEPS, TimeBudget
from hf_bert_impl.convert import to_hf_bert


FORTUNES_DIR = "/usr/share/games/fortunes"
FORTUNE_TOPICS = ("computers", "politics", "science", "songs-poems")


def fortunes(directory=FORTUNES_DIR) -> dict[str, list[str]]:
    """{topic: [fortune, ...]}: every fortune of every topic file in a fortune folder (fortunes separated by "%"
    lines; strfile's .dat indexes, .u8 links and ascii-art skipped), whitespace collapsed, each distinct fortune of
    three or more words once, topics in name order."""
    folder = Path(directory)
    if not folder.is_dir():
        raise cli.UsageError(f"no fortune files at {str(folder)!r}: install them (apt-get install fortunes)")
    topics, seen = {}, set()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".dat", ".u8") or path.is_symlink() or not path.is_file() or path.name == "ascii-art":
            continue
        texts = []
        for chunk in re.split(r"^%$", path.read_text(encoding="utf-8", errors="replace"), flags=re.MULTILINE):
            text = " ".join(chunk.split())
            if len(text.split()) >= 3 and text not in seen:
                seen.add(text)
                texts.append(text)
        if texts:
            topics[path.name] = texts
    if not topics:
        raise cli.UsageError(f"{str(folder)!r} holds no fortune files (texts separated by '%' lines)")
    return topics


def fortune_topic_task(seed: int = 0, directory=FORTUNES_DIR, topics=FORTUNE_TOPICS) -> datasets.DatasetDict:
    """Which topic file a fortune comes from ("sentence", "label"): each topic keeps as many fortunes as the smallest
    has (drawn with `seed`), so the classes are balanced; splits 80 / 10 / 10."""
    found = fortunes(directory)
    missing = [t for t in topics if t not in found]
    if missing:
        raise cli.UsageError(f"fortune topics {missing} not in {str(directory)!r} (it has {sorted(found)})")
    rng = random.Random(seed)
    n = min(len(found[t]) for t in topics)
    rows = [{"sentence": text, "label": i} for i, t in enumerate(topics) for text in rng.sample(found[t], n)]
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=list(topics))}
    )
    return D.split_80_10_10(rows, features, rng)


def corpus(name: str) -> tuple[datasets.Dataset, datasets.Dataset, str]:
    """(train, held-out, description) of "fortunes" (every topic; every tenth fortune held out), "embedded" or a
    text file (`hf_bert_impl.data.text_corpus`)."""
    if name != "fortunes":
        return D.text_corpus(name)
    texts = [t for group in fortunes().values() for t in group]
    return *D.held_out_split(texts), f"the fortunes package's files ({sum(map(len, texts)) / 1e6:.1f} MB)"


@dataclass
class RaceData:
    """What both models train on: the corpus as files, its tokenizer, the blocks the pretraining makes of them."""

    description: str
    files: tuple[Path, Path]
    tokenizer: object
    blocks: datasets.Dataset
    held_out: datasets.Dataset
    tokenizer_dir: Path

    @classmethod
    def prepare(cls, args, folder: Path) -> RaceData:
        train, validation, description = corpus(args.corpus)
        files = folder / "train.txt", folder / "validation.txt"
        for path, split in zip(files, (train, validation)):
            path.write_text("\n".join(t.replace("\n", " ") for t in split["text"]) + "\n", encoding="utf-8")
        tokenizer = D.train_wordpiece_tokenizer(train["text"], vocab_size=args.vocab_size)
        tokenizer.save_pretrained(folder / "tokenizer")
        raw, _ = pretraining.load_raw_data(
            pretraining.DataArguments(train_file=str(files[0]), validation_file=str(files[1])), seed=0
        )
        blocks, held_out = (D.tokenize_and_group(raw[s], tokenizer, args.max_seq_length, desc=s) for s in raw)
        print(f"corpus: {description}; {len(blocks)} training / {len(held_out)} held-out blocks")
        return cls(description, files, tokenizer, blocks, held_out, folder / "tokenizer")


# task name -> (its dataset, built once with fixed splits; the longest sentence in tokens)
FINETUNE_TASKS = {
    "statement_topic": (lambda: D.statement_topic_task(seed=0), 48),
    "fortune_topic": (fortune_topic_task, 64),
}

# transformers' recipe: what a run_mlm.py user sets. --sweep tries every combination of the grid.
RECIPE_KEYS = ("mlm_probability", "dropout", "learning_rate")
OPPONENT_GRID = {"mlm_probability": (0.15, 0.30), "dropout": (0.1, 0.0), "learning_rate": (5e-4, 1e-3)}


def parse_recipes(spec: str | None, grid: dict, option: str) -> dict:
    """'key=v1/v2,...' over RECIPE_KEYS replaces those keys' values in `grid` (the others kept)."""
    grid = dict(grid)
    for item in filter(None, (spec or "").split(",")):
        key, sep, values = (s.strip() for s in item.partition("="))
        if not sep or key not in RECIPE_KEYS:
            raise ValueError(f"{option}: {item!r} is not key=value with a key in {RECIPE_KEYS}")
        try:
            grid[key] = tuple(dict.fromkeys(float(v) for v in values.split("/")))
        except ValueError:
            raise ValueError(f"{option}: {item!r}: {values!r} is not numbers separated by '/'") from None
    for recipe in recipes_of(grid):
        if not 0 < recipe["mlm_probability"] < 1 or not 0 <= recipe["dropout"] < 1 or recipe["learning_rate"] <= 0:
            raise ValueError(f"{option}: {recipe} out of range: mlm_probability in (0, 1), dropout in [0, 1), lr > 0")
    return grid


def recipes_of(grid: dict) -> list[dict]:
    return [dict(zip(RECIPE_KEYS, values)) for values in itertools.product(*(grid[key] for key in RECIPE_KEYS))]


def opponent_recipe(spec: str, learning_rate: float) -> dict:
    """--opponent: "run_mlm" (masking 15%, dropout 0.1, the race's learning rate), 'key=value,...' (the rest
    run_mlm's) or a --sweep's JSON (its best recipe)."""
    if spec.endswith(".json"):
        try:
            best = json.loads(Path(spec).read_text(encoding="utf-8"))["sweep"]["best"]["recipe"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"--opponent {spec!r} is not a readable --sweep result (sweep.best.recipe): {e}"
            ) from None
        return {key: float(best[key]) for key in RECIPE_KEYS}
    run_mlm = {"mlm_probability": (0.15,), "dropout": (0.1,), "learning_rate": (learning_rate,)}
    recipes = recipes_of(parse_recipes(None if spec == "run_mlm" else spec, run_mlm, "--opponent"))
    if len(recipes) > 1:
        raise ValueError(f"--opponent {spec!r}: one value per key (several are a --sweep's --grid)")
    return recipes[0]


def recipe_label(recipe: dict) -> str:
    return f"masking {recipe['mlm_probability']:.0%}, dropout {recipe['dropout']:g}, lr {recipe['learning_rate']:g}"


def training_flags(args, seed: int, *more: str) -> list[str]:
    """The TrainingArguments flags both models pretrain with (--bf16: both under its autocast), then `more`."""
    return [
        *f"--per_device_train_batch_size {args.batch_size} --learning_rate {args.learning_rate} --seed {seed}".split(),
        *f"--warmup_steps {args.warmup_ratio} --bf16 {args.bf16} --per_device_eval_batch_size 64".split(),
        *"--weight_decay 0.01 --lr_scheduler_type linear --logging_steps 10 --save_strategy no".split(),
        *"--report_to none --use_cpu true --disable_tqdm true".split(),
        *more,
    ]


def training_arguments(args, seed: int, *more: str) -> TrainingArguments:
    return HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(training_flags(args, seed, *more))[0]


def curve_of(log_history: list[dict]) -> list[dict]:
    rows = [row for row in log_history if "eval_loss" in row and "training_seconds" in row]
    return [{"seconds": r["training_seconds"], "step": r["step"], "eval_loss": r["eval_loss"]} for r in rows]


def run_ours(args, data: RaceData, row: dict, seed: int, out: Path) -> dict:
    """Ours through `hf_bert_impl.pretraining.main` with the race's settings, then the row's "options" (pretraining
    flags, which override them); evaluated at 15% masking whatever it trains with."""
    argv = [
        *("--output_dir", str(out), "--train_file", str(data.files[0]), "--validation_file", str(data.files[1])),
        *("--tokenizer_name", str(data.tokenizer_dir), "--model_size", args.model_size),
        *("--max_seq_length", str(args.max_seq_length), "--time_budget", str(args.budget / 60)),
        *("--eval_every_minutes", str(args.budget / args.evaluations / 60), "--eval_mlm_probability", "0.15"),
        *("--kernels", args.kernels),
    ]
    pretraining.main(training_flags(args, seed, *argv, *row.get("options", "").split()))
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    facts = json.loads((out / "training_facts.json").read_text())  # what the pretraining applied
    return {
        "curve": curve_of(history),
        "steps": max(row["step"] for row in history),
        "kernels": facts["kernels"],  # its pretraining_dropout: [hidden, attention] as it trained
        "trained_with": {**facts["hyperparameters"], "sparse_prediction": facts["kernels"]["sparse_prediction"]},
    }


def run_transformers(args, data: RaceData, row: dict, seed: int, out: Path) -> dict:
    """transformers' BertForMaskedLM with Trainer and DataCollatorForLanguageModeling under the row's "recipe"."""
    recipe, tokenizer = row["recipe"], data.tokenizer
    held_out = D.mask_once(data.held_out, tokenizer, seed + 1)  # 15% (as ours' held-out), whatever it trains with
    torch.manual_seed(seed)  # the model is built here, as run_mlm.py builds it
    dropout = {"hidden_dropout_prob": recipe["dropout"], "attention_probs_dropout_prob": recipe["dropout"]}
    size = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, **SIZE_PRESETS[args.model_size]}
    model = BertForMaskedLM(BertConfig(**size, **dropout))
    flags = ["--output_dir", str(out), "--max_steps", str(UNBOUNDED_MAX_STEPS), "--remove_unused_columns", "false"]
    trainer = Trainer(
        model=model,
        args=training_arguments(args, seed, *flags, "--learning_rate", str(recipe["learning_rate"])),
        train_dataset=data.blocks,
        eval_dataset=held_out,  # masked once, so only padded by the collator
        data_collator=D.MLMCollator(tokenizer, mlm_probability=recipe["mlm_probability"], seed=None),
        callbacks=[TimeBudget(args.budget, eval_interval=args.budget / args.evaluations)],
    )
    trainer.train()
    trainer.save_model()
    return {
        "curve": curve_of(trainer.state.log_history),
        "steps": trainer.state.global_step,
        "trained_with": {  # read off what trained
            "mlm_probability": trainer.data_collator.mlm.mlm_probability,
            "dropout": [model.config.hidden_dropout_prob, model.config.attention_probs_dropout_prob],
            "learning_rate": trainer.args.learning_rate,
            "mixed_precision": cli.mixed_precision(trainer.args),
        },
    }


def scored_sentences(task, folds: int) -> datasets.Dataset:
    """The sentences a fine-tuning scores: the test split, or with folds every sentence of the task."""
    return datasets.concatenate_datasets([task[s] for s in ("train", "validation", "test")]) if folds else task["test"]


def finetune(args, seed: int, model_dir: Path, tokenizer_dir: Path, task_name: str, task) -> dict:
    """The pretrained model fine-tuned by `hf_bert_impl.finetuning.main` on the task's train split and scored on its
    test split, or with --finetune_folds K on every sentence: K fine-tunings, each scored on one fold of sklearn's
    StratifiedKFold (shuffled, fixed) and trained on the rest. Accuracy and Matthews correlation."""
    from sklearn.metrics import accuracy_score, matthews_corrcoef
    from sklearn.model_selection import StratifiedKFold

    folds, dropout = args.finetune_folds, args.finetune_dropout
    scored = scored_sentences(task, folds)
    gold = np.asarray(scored["label"])
    if folds:
        splits = [
            (scored.select(a), b) for a, b in StratifiedKFold(folds, shuffle=True, random_state=0).split(gold, gold)
        ]
    else:
        splits = [(task["train"], np.arange(len(gold)))]
    flags = [
        *("--model_name_or_path", str(model_dir), "--tokenizer_name", str(tokenizer_dir), "--kernels", args.kernels),
        *f"--max_seq_length {FINETUNE_TASKS[task_name][1]} --num_train_epochs {args.finetune_epochs}".split(),
        *f"--learning_rate {args.finetune_learning_rate} --seed {seed} --config_overrides".split(),
        f"hidden_dropout_prob={dropout},attention_probs_dropout_prob={dropout}",
        *"--per_device_train_batch_size 32 --per_device_eval_batch_size 128 --warmup_steps 0.1".split(),
        *"--weight_decay 0.01 --save_strategy no --report_to none --use_cpu true --disable_tqdm true".split(),
    ]
    predicted = np.full(len(gold), -1)
    for k, (train, test) in enumerate(splits):
        out = model_dir / f"finetune-{task_name}-{k}"
        out.mkdir()
        train.to_json(out / "train.jsonl")  # the labels as class ids; the predictions come back as them
        scored.select(test).to_json(out / "test.jsonl")
        files = ("--train_file", str(out / "train.jsonl"), "--test_file", str(out / "test.jsonl"))
        finetuning.main([*flags, *files, "--output_dir", str(out / "model")])
        with open(out / "model" / "predictions.jsonl", encoding="utf-8") as f:
            predicted[test] = [int(json.loads(line)["prediction"]) for line in f]
        shutil.rmtree(out)
    return {
        "accuracy": float(accuracy_score(gold, predicted)),
        "mcc": float(matthews_corrcoef(gold, predicted)),
        "predicted": predicted.tolist(),
    }


def paired_test(ours: list[dict], theirs: list[dict], gold: np.ndarray) -> dict | None:
    """Whether the two models' fine-tuned accuracies differ by more than chance: each sentence's share of the seeds
    whose model labelled it right, ours against transformers', and scipy's two-sided sign test over the sentences
    where the shares differ (McNemar's exact test with one seed). None without scipy (the `stats` extra)."""
    try:
        from scipy.stats import binomtest
    except ImportError:
        return None
    share = [np.mean([np.asarray(r["predicted"]) == gold for r in rs], axis=0) for rs in (ours, theirs)]
    better, worse = int((share[0] > share[1]).sum()), int((share[0] < share[1]).sum())
    p_value = float(binomtest(better, better + worse).pvalue) if better + worse else 1.0
    return {"ours_right_more_often": better, "transformers_right_more_often": worse, "p_value": p_value}


def time_to_reach(curve: list[dict], target: float) -> float | None:
    """Training seconds at which the held-out loss first reaches `target` (linear between evaluations)."""
    i = next((i for i, point in enumerate(curve) if point["eval_loss"] <= target), None)
    if i in (None, 0):
        return None if i is None else curve[0]["seconds"]
    (before, after), losses = curve[i - 1 : i + 1], [curve[i]["eval_loss"], curve[i - 1]["eval_loss"]]
    return float(np.interp(target, losses, [after["seconds"], before["seconds"]]))


def summarize(runs: dict, budget: float, gold: dict) -> dict | None:
    """Per seed and over the seeds both models have. `gold`: each fine-tuning task's labels, for the paired test."""
    theirs_of = {r["seed"]: r for r in runs["transformers"]}
    pairs = [(r, theirs_of[r["seed"]]) for r in runs["ours"] if r["seed"] in theirs_of]
    if not pairs:
        return None
    per_seed = []
    for ours, theirs in pairs:
        target = theirs["curve"][-1]["eval_loss"]
        reach = time_to_reach(ours["curve"], target)
        per_seed.append(
            {
                "seed": ours["seed"],
                "ours_final_loss": ours["curve"][-1]["eval_loss"],
                "transformers_final_loss": target,
                "ours_seconds_to_transformers_final_loss": reach,
                "time_to_accuracy_speedup": None if not reach else budget / reach,
            }
        )
    both = {"ours": [o for o, _ in pairs], "transformers": [t for _, t in pairs]}
    tuned = {key: {name: [r["finetune"][key] for r in rs] for name, rs in both.items()} for key in gold}
    mean_finetune = {
        key: {name: {m: float(np.mean([r[m] for r in rs])) for m in ("accuracy", "mcc")} for name, rs in by.items()}
        for key, by in tuned.items()
    }
    tests = {key: paired_test(by["ours"], by["transformers"], gold[key]) for key, by in tuned.items()}
    speedups = [s["time_to_accuracy_speedup"] for s in per_seed]
    return {
        "per_seed": per_seed,
        "mean_final_loss": {n: float(np.mean([r["curve"][-1]["eval_loss"] for r in rs])) for n, rs in both.items()},
        "mean_steps": {n: float(np.mean([r["steps"] for r in rs])) for n, rs in both.items()},
        "mean_finetune": mean_finetune,
        "finetune_paired_test": {key: test for key, test in tests.items() if test},
        "worst_time_to_accuracy_speedup": None if None in speedups else min(speedups),
    }


def parity_check(args, data: RaceData, steps: int) -> dict:
    """Ours as transformers' BERT (learned positions, no dropout) and BertForMaskedLM converted from it
    (`to_hf_bert`), trained by the same Trainer settings on the same masked batches (float32): the per-step losses.
    Ours runs the speed layer and sparse prediction as the pretraining applies them."""
    tokenizer = data.tokenizer
    train = D.mask_once(data.blocks.select(range(min(len(data.blocks), steps * args.batch_size))), tokenizer, seed=0)
    torch.manual_seed(0)
    bert = {"position_embedding_type": "learned", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    size = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    ours = BertImplForMaskedLM(BertImplConfig.from_preset(args.model_size, **size, **bert))
    theirs = to_hf_bert(ours)
    ours.config.sparse_prediction = True
    kernelize(ours, args.kernels)
    collator, losses = D.MLMCollator(tokenizer, seed=None), {}  # the batches are masked: it only pads them
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("ours", ours), ("transformers", theirs)):
            flags = f"--max_steps {steps} --logging_steps 1 --warmup_steps 0.1 --bf16 false".split()
            settings = training_arguments(args, 0, "--output_dir", tmp, "--remove_unused_columns", "false", *flags)
            trainer = Trainer(model=model, args=settings, train_dataset=train, data_collator=collator)
            trainer.train()
            losses[name] = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    worst = max(abs(a - b) for a, b in zip(losses["ours"], losses["transformers"]))
    passed = len(losses["ours"]) == len(losses["transformers"]) == steps and worst <= args.parity_tolerance
    return {"steps": steps, "losses": losses, "max_abs_loss_difference": worst, "passed": passed}


def plot(report: dict, rows: list[tuple[str, list[dict]]], heading: str, path: str) -> None:
    """Held-out loss against training seconds, each (label, runs) row one color, every seed one line (needs
    matplotlib, the `plot` extra)."""
    try:
        import matplotlib
    except ImportError:
        return print("no plot: matplotlib is not installed (pip install -e '.[plot]')")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, (label, runs) in enumerate(rows):
        for j, run in enumerate(runs):
            seconds, losses = zip(*((p["seconds"], p["eval_loss"]) for p in run["curve"]))
            ax.plot(seconds, losses, color=f"C{i % 10}", marker="o", markersize=2, label=None if j else label)
    machine = f"{report['machine']['cpu']} {report['machine'].get('cpu_family_model', '')}"
    size = f"{report['settings']['model_size']} size, batch {report['settings']['batch_size']}"
    ax.set_title(f"{heading}: {report['corpus']}\n{size}; {machine}, hf-bert-impl {report['version']}", fontsize=8.5)
    ax.set(xlabel="training seconds (evaluation not counted)", ylabel="held-out masked-LM loss (15% masked)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table_row(report: dict) -> str:
    """A race report's row of the README's race table; the speed-up is the worst seed's ("at least" where ours'
    first evaluation was already below transformers' final loss)."""
    settings, s, machine, runs = report["settings"], report["summary"], report["machine"], report["runs"]
    worst = min(s["per_seed"], key=lambda row: row["time_to_accuracy_speedup"] or 0)
    first = next(run["curve"][0]["eval_loss"] for run in runs["ours"] if run["seed"] == worst["seed"])
    speedup = worst["time_to_accuracy_speedup"]
    speedup = "never" if not speedup else f"{'at least ' * (first <= worst['transformers_final_loss'])}{speedup:.2f}x"
    loss = " / ".join(f"{s['mean_final_loss'][name]:.3f}" for name in ("ours", "transformers"))
    tuned = " / ".join(  # statement_topic, then fortune_topic
        f"{scores['ours']['accuracy']:.3f} vs {scores['transformers']['accuracy']:.3f}"
        for _, scores in sorted(s["mean_finetune"].items(), reverse=True)
    )
    size = "" if settings["model_size"] == "mini" else f", {settings['model_size']}"
    cpu = f"{machine['cpu']} {machine.get('cpu_family_model', '')}".strip()
    where = f"{settings['budget'] / 60:g} min, {settings['corpus_name']}{size} ({cpu}, {len(s['per_seed'])})"
    return f"| {where} | {loss} | {speedup} | {tuned} |"


def print_table(paths: list[str]) -> None:
    print("| budget, corpus (CPU, seeds) | MLM loss, ours / transformers | speed-up | fine-tuned accuracy ", end="")
    print("(statement / fortune) |\n|---|---|---|---|")
    for path in paths:
        print(table_row(json.loads(Path(path).read_text(encoding="utf-8"))))


def print_run(label: str, run: dict) -> None:
    tuned = "".join(f"; {key}: accuracy {s['accuracy']:.4f}" for key, s in run.get("finetune", {}).items())
    loss = " ".join(f"{p['seconds']:.0f}s:{p['eval_loss']:.3f}" for p in run["curve"])
    print(f"seed {run['seed']} {label}: {run['steps']} steps, held-out loss {loss}{tuned}", flush=True)


def train_all(args, head: dict, rows: list[dict], train, report_of) -> dict:
    """Every row (a model or a recipe: its "label" and fields) trained on every seed by `train(row, seed, out)`, seed
    by seed, the rows taking turns in going first; `report_of(rows)` goes into OUT.json after every run, so an
    interrupted run keeps what it did."""
    for row in rows:
        row["runs"] = []
    for i, seed in enumerate(args.seeds):
        for row in rows[i % len(rows) :] + rows[: i % len(rows)]:
            with tempfile.TemporaryDirectory(prefix="run-") as out:
                row["runs"].append({"seed": seed, **train(row, seed, Path(out))})
            print_run(row["label"], row["runs"][-1])
            finished = all(len(r["runs"]) == len(args.seeds) for r in rows)
            report = {**head, **report_of(rows), "finished": finished}
            cli.write_result_json(report, f"{args.out}.json")
    return report


def race(args, head: dict, data: RaceData, tasks: dict) -> dict:
    """Both models on every seed, each fine-tuned on `tasks` after pretraining."""
    gold = {name: np.asarray(scored_sentences(task, args.finetune_folds)["label"]) for name, task in tasks.items()}

    def train(row, seed, out):
        run = (run_ours if row["label"] == "ours" else run_transformers)(args, data, row, seed, out)
        tuned = {name: finetune(args, seed, out, data.tokenizer_dir, name, task) for name, task in tasks.items()}
        return {**run, "finetune": tuned} if tasks else run

    def report_of(rows):
        runs = {row["label"]: row["runs"] for row in rows}
        return {"summary": summarize(runs, args.budget, gold), "runs": runs}

    rows = [{"label": "ours"}, {"label": "transformers", "recipe": args.recipe}]
    report = train_all(args, head, rows, train, report_of)
    labels = ["hf-bert-impl (defaults)", f"transformers BertForMaskedLM ({recipe_label(args.recipe)})"]
    plot(report, list(zip(labels, report["runs"].values())), "the race", f"{args.out}.png")
    return report


def variants(args, head: dict, kind: str, rows: list[dict], train) -> int:
    """--sweep and --ablation: the rows on every seed; the best has the lowest mean held-out loss at the budget."""

    def report_of(rows):
        trained = [row for row in rows if row["runs"]]
        for row in trained:
            row["mean_final_loss"] = float(np.mean([r["curve"][-1]["eval_loss"] for r in row["runs"]]))
        best = min(trained, key=lambda row: row["mean_final_loss"])
        return {kind: {"best": {k: v for k, v in best.items() if k != "runs"}, "rows": trained}}

    report = train_all(args, head, rows, train, report_of)
    what = "transformers' recipes" if kind == "sweep" else "ours' recipe, one change at a time"
    plot(report, [(f"{r['label']}: {r['mean_final_loss']:.3f}", r["runs"]) for r in rows], what, f"{args.out}.png")
    for row in sorted(rows, key=lambda r: r["mean_final_loss"]):
        print(f"{row['label']}: mean held-out loss at {args.budget:g} s {row['mean_final_loss']:.3f}")
    print(f"wrote {args.out}.json" + (f"; race its best with --opponent {args.out}.json" if kind == "sweep" else ""))
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--corpus", default="embedded", help="embedded, fortunes or a text file (one text per line)")
    add("--seeds", nargs="+", type=int, default=[0, 1, 2])
    add("--budget", type=float, default=180.0, help="training seconds per run")
    add("--evaluations", type=int, default=12, help="held-out evaluations per run, evenly in time")
    add("--model_size", default="mini", choices=list(SIZE_PRESETS))
    add("--max_seq_length", type=int, default=128)
    add("--batch_size", type=int, default=pretraining.RECIPE_BATCH_SIZE, help="both models' (ours' default)")
    add("--learning_rate", type=float, default=pretraining.RECIPE_LEARNING_RATE, help="ours' and run_mlm's")
    add("--warmup_ratio", type=float, default=pretraining.RECIPE_WARMUP, help="warm-up: a share of the budget")
    add("--vocab_size", type=int, default=8192)
    add("--bf16", action="store_true", help="both pretrain under bf16 autocast (parity and fine-tuning: float32)")
    add("--opponent", default="run_mlm", help="run_mlm, 'mlm_probability=0.3,dropout=0' or a --sweep's JSON")
    add("--sweep", action="store_true", help="transformers alone under every recipe of --grid")
    add("--grid", help="--sweep's recipes: 'learning_rate=5e-4/1e-3,...' replaces those of the default 8")
    add("--ablation", nargs="+", metavar="OPTIONS", help="ours alone under its defaults and each pretraining option")
    add("--finetune_tasks", nargs="*", default=list(FINETUNE_TASKS), choices=list(FINETUNE_TASKS))
    add("--finetune_epochs", type=float, default=3.0, help="0: no fine-tuning")
    add("--finetune_learning_rate", type=float, default=3e-4)
    add("--finetune_folds", type=int, default=0, metavar="K", help="K >= 2: every sentence, K-fold")
    add("--finetune_dropout", type=float, default=0.1, help="both models' dropout while fine-tuning")
    add("--parity_steps", type=int, default=20, help="steps of the parity check (0: skip it)")
    add("--parity_tolerance", type=float, default=1e-5)
    add("--kernels", default="auto", help=cli.KERNELS_HELP)
    add("--out", default="outputs/pretraining_race", help="writes OUT.json and OUT.png")
    add("--table", nargs="+", metavar="JSON", help="print the README's race table of these reports")
    args = parser.parse_args(argv)
    if args.sweep + bool(args.ablation) + bool(args.table) > 1 or (args.grid and not args.sweep):
        parser.error("--sweep, --ablation and --table are separate runs; --grid is --sweep's")
    try:
        cli.check_kernels_argument(args.kernels)
        args.recipe = opponent_recipe(args.opponent, args.learning_rate)
        args.grid = parse_recipes(args.grid, OPPONENT_GRID, "--grid")
    except ValueError as e:
        parser.error(str(e))
    if not 0 <= args.finetune_dropout < 1:
        parser.error(f"--finetune_dropout must be a rate in [0, 1), got {args.finetune_dropout}")
    if args.finetune_folds < 0 or args.finetune_folds == 1:
        parser.error(f"--finetune_folds must be 0 (the test split) or at least 2, got {args.finetune_folds}")
    if args.finetune_learning_rate <= 0:
        parser.error(f"--finetune_learning_rate must be positive, got {args.finetune_learning_rate}")
    return args


def finetuning_tasks(args) -> dict:
    """The tasks' datasets, built before any training (no fortune files stops the race here), with the sentences
    of every class that --finetune_folds K needs."""
    tasks = {t: FINETUNE_TASKS[t][0]() for t in args.finetune_tasks} if args.finetune_epochs else {}
    for name, task in tasks.items() if args.finetune_folds else ():
        fewest = np.bincount(scored_sentences(task, args.finetune_folds)["label"]).min()
        if fewest < args.finetune_folds:
            raise cli.UsageError(f"--finetune_folds {args.finetune_folds}: task {name!r} has a class of {fewest}")
    return tasks


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        print_table(args.table)
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tasks = {} if args.sweep or args.ablation else finetuning_tasks(args)
    with tempfile.TemporaryDirectory(prefix="race-") as tmp:
        data = RaceData.prepare(args, Path(tmp))
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "corpus", "table", "recipe")}
        settings["corpus_name"] = Path(args.corpus).name
        head = {"version": hf_bert_impl.__version__, "corpus": data.description, "settings": settings}
        head["machine"] = cli.machine_record()
        if args.sweep:
            rows = [{"label": recipe_label(recipe), "recipe": recipe} for recipe in recipes_of(args.grid)]
            return variants(args, head, "sweep", rows, partial(run_transformers, args, data))
        if args.ablation:
            rows = [{"label": options or "defaults", "options": options} for options in ["", *args.ablation]]
            return variants(args, head, "ablation", rows, partial(run_ours, args, data))
        parity = parity_check(args, data, args.parity_steps) if args.parity_steps else None
        if parity:
            print(
                f"parity, {parity['steps']} steps: max |ours - transformers| {parity['max_abs_loss_difference']:.2e}"
            )
        print(f"transformers' recipe: {recipe_label(args.recipe)}", flush=True)
        kernels = {"setting": args.kernels, "kernels": cli.kernels_in_use(args.kernels, "cpu", torch.float32)}
        report = race(args, {**head, "opponent": args.recipe, "parity": parity, "kernels": kernels}, data, tasks)
    for key, test in report["summary"]["finetune_paired_test"].items():
        right = test["ours_right_more_often"], test["transformers_right_more_often"]
        print(f"{key}: sentences right more often, ours / transformers {right} (sign test p = {test['p_value']:.3g})")
    print_table([f"{args.out}.json"])
    return 1 if parity is not None and not parity["passed"] else 0


if __name__ == "__main__":
    datasets.disable_progress_bars()  # the runs' and folds' tokenizing: each run prints one line when it ends
    sys.exit(cli.run_cli(main))
