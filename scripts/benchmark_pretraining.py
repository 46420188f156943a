"""The pretraining race: which BERT is better after the same wall-clock time on this machine?

For each seed, pretrains for the same training-time budget (`--budget` seconds; evaluation not counted):
  ours          hf-bert-impl with its defaults, through scripts/pretrain_mlm.py itself (`main(argv)`:
                sinusoidal positions, its seeded per-batch masking collator, and the speed layer it applies,
                `hf_bert_impl.kernelize(model, --kernels, sparse_prediction=True)`: sparse prediction and the
                kernels it measures on this machine (`--kernels auto`, the default); `--time_budget`)
  transformers  transformers' `BertForMaskedLM` with `run_mlm.py`'s recipe: learned positions,
                `DataCollatorForLanguageModeling`, `Trainer`
Both: the same WordPiece tokenizer (trained once on the training split), the same blocks of
`--max_seq_length` tokens, size (`--model_size`), batch, AdamW, learning rate, weight decay and schedule
(linear decay laid over the budget, warm-up `--warmup_ratio` of its time: `hf_bert_impl.budget.TimeBudget`
for both), evaluated every `--budget / --evaluations` seconds of training time on the same held-out blocks
under one fixed masking (the one pretrain_mlm.py draws: seed + 1). The two runs of a seed take turns in
which goes first.

Reports, per seed and over the seeds: held-out MLM loss at the budget, steps run, and time-to-accuracy:
the share of the budget ours needs to reach transformers' final held-out loss (interpolated between
evaluations; its inverse is the speed-up in time-to-accuracy); then each pretrained model is fine-tuned
with the same settings on the embedded statement-topic task (`--finetune_epochs`; accuracy and MCC on its
test split). Also two checks that make the race mean
something:
- collator cost: the per-batch cost of the scripts' masking collator (`hf_bert_impl.data.MLMCollator`,
  seeded) over `DataCollatorForLanguageModeling`'s, on batches of this corpus (must stay <= 1.5x);
- step-for-step parity: ours configured as transformers' BERT (learned positions, no embedding scale),
  kernelized as pretrain_mlm.py trains it, started from the same weights (`to_hf_bert`) with dropout off and
  trained on the same masked batches through the same Trainer settings, follows transformers' per-step loss
  to `--parity_tolerance`; so the race measures the defaults, not a defect.

    # the embedded corpus and the standard library's docstrings, 3 seeds, 180 s each (about 40 min per corpus)
    python scripts/benchmark_pretraining.py --corpus embedded --seeds 0 1 2 --out benchmarks/pretraining_embedded
    python scripts/benchmark_pretraining.py --corpus stdlib_docstrings --seeds 0 1 2 \
        --out benchmarks/pretraining_stdlib
    # your text (one text per line), a longer race
    python scripts/benchmark_pretraining.py --corpus my_corpus.txt --budget 900 --out outputs/race

Writes OUT.json (every curve, the settings, the kernels ours chose, the machine) and OUT.png (held-out loss against
training seconds, both models, every seed). Exit status 1 when a check fails (collator cost or parity).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

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
    """TrainingArguments both runs share."""
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
    }


def curve_of(log_history: list[dict]) -> list[dict]:
    return [
        {"seconds": row["training_seconds"], "step": row["step"], "eval_loss": row["eval_loss"]}
        for row in log_history
        if "eval_loss" in row and "training_seconds" in row
    ]


def run_ours(args, seed: int, files, tokenizer_dir: Path, out: Path) -> dict:
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
    pretrain_mlm.main(argv)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    kernels = json.loads((out / "training_facts.json").read_text())["kernels"]  # what pretrain_mlm.py applied
    return {"curve": curve_of(history), "steps": max(row["step"] for row in history), "kernels": kernels}


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


def transformers_model(args, tokenizer, **overrides) -> BertForMaskedLM:
    size = SIZE_PRESETS[args.model_size]
    return BertForMaskedLM(
        BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **size, **overrides)
    )


def run_transformers(args, seed: int, train, held_out_blocks, tokenizer, out: Path) -> dict:
    held_out = D.mask_once(held_out_blocks, tokenizer, seed + 1)
    torch.manual_seed(seed)  # Trainer seeds again before building nothing: the model is built here, as run_mlm.py does
    model = transformers_model(args, tokenizer)
    budget = TimeBudget(args.budget, eval_interval=args.budget / args.evaluations)
    training_args = TrainingArguments(
        output_dir=str(out), max_steps=UNBOUNDED_MAX_STEPS, remove_unused_columns=False, **common_arguments(args, seed)
    )
    # Training batches: DataCollatorForLanguageModeling itself (MLMCollator without a seed hands them to it);
    # held-out batches (masked once, they carry labels) are only padded.
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=D.MLMCollator(tokenizer, seed=None),
        callbacks=[budget],
    )
    trainer.train()
    trainer.save_model()
    return {"curve": curve_of(trainer.state.log_history), "steps": trainer.state.global_step}


def finetune(args, seed: int, model_dir: Path, name: str, tokenizer) -> dict:
    """Fine-tunes the pretrained model on the embedded statement-topic task (the demo's; fixed splits) with the
    same settings for both models; accuracy and Matthews correlation on its test split."""
    from sklearn.metrics import accuracy_score, matthews_corrcoef
    from transformers import BertForSequenceClassification, DataCollatorWithPadding

    from hf_bert_impl import BertImplForSequenceClassification

    task = D.statement_topic_task(seed=0).map(
        lambda batch: tokenizer(batch["sentence"], truncation=True, max_length=48),
        batched=True,
        remove_columns=["sentence"],
    )
    if name == "ours":  # with the speed layer, as scripts/finetune.py fine-tunes
        model = kernelize(BertImplForSequenceClassification.from_pretrained(model_dir, num_labels=2), args.kernels)
    else:
        model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    training_args = TrainingArguments(
        output_dir=str(model_dir / "finetune"),
        num_train_epochs=args.finetune_epochs,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=128,
        learning_rate=args.finetune_learning_rate,
        warmup_steps=0.1,
        weight_decay=0.01,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=task["train"], data_collator=DataCollatorWithPadding(tokenizer)
    )
    trainer.train()
    prediction = trainer.predict(task["test"])
    predicted, labels = prediction.predictions.argmax(-1), prediction.label_ids
    return {
        "accuracy": float(accuracy_score(labels, predicted)),
        "mcc": float(matthews_corrcoef(labels, predicted)),
        "test_sentences": len(labels),
        "predicted": predicted.tolist(),
    }


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
    layer as pretrain_mlm.py trains with it (kernels "auto", sparse prediction)."""
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
    kernelize(ours, args.kernels, sparse_prediction=True)
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("ours", ours), ("transformers", theirs)):
            training_args = TrainingArguments(
                output_dir=tmp,
                max_steps=steps,
                remove_unused_columns=False,
                **{**common_arguments(args, 0), "logging_steps": 1, "warmup_steps": 0.1},
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


def summarize(runs: dict, budget: float) -> dict:
    per_seed = []
    for ours, theirs in zip(runs["ours"], runs["transformers"]):
        target = theirs["curve"][-1]["eval_loss"]
        reach = time_to_reach(ours["curve"], target)
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
                "ours_finetune": ours.get("finetune"),
                "transformers_finetune": theirs.get("finetune"),
            }
        )
    shares = [s["share_of_budget"] for s in per_seed]
    return {
        "per_seed": per_seed,
        "mean_final_loss": {
            name: float(np.mean([r["curve"][-1]["eval_loss"] for r in rs])) for name, rs in runs.items()
        },
        "mean_steps": {name: float(np.mean([r["steps"] for r in rs])) for name, rs in runs.items()},
        "ours_lower_final_loss_every_seed": all(s["ours_final_loss"] < s["transformers_final_loss"] for s in per_seed),
        "mean_finetune": {
            name: {k: float(np.mean([r["finetune"][k] for r in rs])) for k in ("accuracy", "mcc")}
            for name, rs in runs.items()
            if all("finetune" in r for r in rs)
        },
        "worst_share_of_budget": None if None in shares else max(shares),
        "worst_time_to_accuracy_speedup": None if None in shares else budget / max(s * budget for s in shares),
    }


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, (name, runs) in enumerate(report["runs"].items()):
        label = "hf-bert-impl (defaults)" if name == "ours" else "transformers BertForMaskedLM"
        for j, run in enumerate(runs):
            ax.plot(
                [p["seconds"] for p in run["curve"]],
                [p["eval_loss"] for p in run["curve"]],
                color=f"C{i}",
                marker="o",
                markersize=2.5,
                alpha=0.85,
                label=f"{label} ({len(runs)} seed{'s' * (len(runs) != 1)})" if j == 0 else None,
            )
    target = report["summary"]["mean_final_loss"]["transformers"]
    ax.axhline(
        target, color="C1", linestyle=":", linewidth=1, label=f"transformers' mean loss at the budget ({target:.3f})"
    )
    ax.set_xlabel("training seconds (evaluation not counted)")
    ax.set_ylabel("held-out masked-LM loss")
    m = report["machine"]
    ax.set_title(
        f"{report['model_size']} model ({report['size']['num_hidden_layers']}x{report['size']['hidden_size']}), "
        f"seq {report['settings']['max_seq_length']}, batch {report['settings']['batch_size']}; "
        f"corpus: {report['settings']['corpus_name']}\n{m['cpu']}, {m['torch_threads']} threads, "
        f"hf-bert-impl {report['version']}",
        fontsize=8.5,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpus", default="embedded", help="embedded, stdlib_docstrings, or a text file (one text per line)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", type=float, default=180.0, help="training seconds per run")
    parser.add_argument("--evaluations", type=int, default=12, help="held-out evaluations per run (evenly in time)")
    parser.add_argument("--model_size", default="mini", choices=list(SIZE_PRESETS))
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--warmup_ratio", type=float, default=0.1, help="warm-up as a share of the budget's time")
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument(
        "--finetune_epochs",
        type=float,
        default=3.0,
        help="fine-tune each pretrained model on the statement-topic task for so many epochs (0: skip)",
    )
    parser.add_argument("--finetune_learning_rate", type=float, default=3e-4)
    parser.add_argument("--parity_steps", type=int, default=20, help="steps of the parity check (0: skip it)")
    parser.add_argument("--parity_tolerance", type=float, default=1e-5)
    parser.add_argument(
        "--kernels",
        default="auto",
        help="ours' speed layer (hf_bert_impl.kernelize): auto (measured on this machine), reference "
        "(the plain model) or kernel names, comma-separated",
    )
    parser.add_argument("--out", default="outputs/pretraining_race", help="writes OUT.json and OUT.png")
    args = parser.parse_args(argv)
    try:
        kernels_bert_impl.kernel_names(args.kernels)
    except ValueError as e:
        parser.error(f"--kernels: {e}")
    logging.basicConfig(level=logging.WARNING)

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

        runs = {"ours": [], "transformers": []}
        for i, seed in enumerate(args.seeds):
            order = ("ours", "transformers") if i % 2 == 0 else ("transformers", "ours")
            for name in order:
                out = tmp / f"{name}-{seed}"
                result = (
                    run_ours(args, seed, files, tmp / "tokenizer", out)
                    if name == "ours"
                    else run_transformers(args, seed, blocks, held_out, tokenizer, out)
                )
                result["seed"] = seed
                if args.finetune_epochs:
                    result["finetune"] = finetune(args, seed, out, name, tokenizer)
                runs[name].append(result)
                last = result["curve"][-1]
                print(
                    f"seed {seed} {name:12s}: {result['steps']} steps in {last['seconds']:.0f} s, held-out loss "
                    + " ".join(f"{p['seconds']:.0f}s:{p['eval_loss']:.3f}" for p in result["curve"])
                    + (
                        f"; fine-tuned: accuracy {result['finetune']['accuracy']:.4f}, "
                        f"MCC {result['finetune']['mcc']:.4f}"
                        if "finetune" in result
                        else ""
                    )
                )

    report = {
        "what": "pretraining race: held-out masked-LM loss against training seconds, ours (defaults) vs transformers' "
        "BertForMaskedLM (run_mlm.py's recipe), the same budget",
        "version": __version__,
        "corpus": description,
        "model_size": args.model_size,
        "size": SIZE_PRESETS[args.model_size],
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "corpus")},
            "corpus_name": Path(args.corpus).name,
        },
        "training_blocks": len(blocks),
        "held_out_blocks": len(held_out),
        "collator_cost": cost,
        "parity": parity,
        "summary": summarize(runs, args.budget),
        "kernels": {
            "setting": args.kernels,
            "chosen": kernels_bert_impl.chosen_kernels(),
            "measurement_seconds": round(kernels_bert_impl.measurement_seconds(), 3),
            "cache": cli.kernel_record_path(),
        },
        "machine": cli.machine_record(),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    cli.write_result_json(report, f"{args.out}.json")
    plot(report, f"{args.out}.png")
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
        )
    for name, scores in s["mean_finetune"].items():
        print(f"fine-tuned from {name}: mean test accuracy {scores['accuracy']:.4f}, MCC {scores['mcc']:.4f}")
    kernels = report["kernels"]
    print(
        f"ours' kernels ({args.kernels}): {len(kernels['chosen'])} measured choices, measuring took "
        f"{kernels['measurement_seconds']:.2f} s"
        + "".join(f"\n  {key} -> {name}" for key, name in sorted(kernels["chosen"].items()))
    )
    print(f"wrote {args.out}.json and {args.out}.png")
    failed = cost["ratio"] > COLLATOR_COST_LIMIT or (parity is not None and not parity["passed"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
