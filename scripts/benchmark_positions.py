"""How fast each positional encoding learns: held-out masked-LM loss after N steps, per step, not per second.

Pretrains, from the same seed, on the same blocks, batches and masking recipe, with `Trainer`:
  ours-default      BertImplConfig's defaults: sinusoidal positions added to word embeddings scaled by √d_model
                    (Vaswani et al. 2017, section 3.4), initialised at normal(0, 1/√d_model)
  ours-scale-only   the √d_model scale on embeddings initialised as BERT's, normal(0, 0.02) (an ablation)
  ours-unscaled     sinusoidal positions added to unscaled normal(0, 0.02) embeddings (the default before 0.4.0)
  ours-learned      position_embedding_type="learned" (BERT's trained table)
  transformers      transformers' BertForMaskedLM, same sizes (learned positions)
and evaluates each at intervals on the same held-out blocks under one fixed masking. Also reports the unigram loss
(cross-entropy of the held-out masked tokens under the training corpus' token frequencies): a model that has learned
nothing about context sits there.

    # the embedded corpus (Python Language Reference) and the Python standard library's docstrings
    python scripts/benchmark_positions.py --corpus embedded --out benchmarks/positions_embedded
    python scripts/benchmark_positions.py --corpus stdlib_docstrings --out benchmarks/positions_stdlib
    # any text file (one text per line)
    python scripts/benchmark_positions.py --corpus my_corpus.txt --steps 600 --model_size mini

Ours trains with the package's speed layer (`hf_bert_impl.kernelize(model, --kernels)`, default auto: the kernels of
its static table), as the package's scripts do. Writes OUT.json (every curve, the means, the unigram loss, the
settings, the kernels ours ran, the CPU) and OUT.png (held-out loss against steps, one line per variant and seed).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import pkgutil
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

from hf_bert_impl import (
    SIZE_PRESETS,
    BertImplConfig,
    BertImplForMaskedLM,
    __version__,
    cli,
    kernelize,
    kernels_bert_impl,
)
from hf_bert_impl import data as D


VARIANTS = {  # config fields of ours (None: transformers' BertForMaskedLM)
    "ours-default": {},
    "ours-scale-only": {},  # then the word embeddings re-initialised at normal(0, initializer_range)
    "ours-unscaled": {"scale_word_embeddings": False},
    "ours-learned": {"position_embedding_type": "learned"},
    "transformers": None,
}


def build_model(variant: str, size: dict, vocab_size: int, max_len: int, dropout: float):
    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=max_len,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=0,
        **size,
    )
    if VARIANTS[variant] is None:
        return BertForMaskedLM(BertConfig(**common))
    model = BertImplForMaskedLM(BertImplConfig(**common, **VARIANTS[variant]))
    if variant == "ours-scale-only":
        with torch.no_grad():
            table = model.get_input_embeddings().weight
            table.normal_(0.0, model.config.initializer_range)
            table[model.config.pad_token_id].zero_()
    return model


def run(variant: str, seed: int, args, train_blocks, eval_masked, vocab_size: int, collator) -> list[dict]:
    torch.manual_seed(seed)
    model = build_model(variant, SIZE_PRESETS[args.model_size], vocab_size, args.max_seq_length, args.dropout)
    if VARIANTS[variant] is not None:  # ours, with the speed layer as the package's scripts train (--kernels)
        kernelize(model, args.kernels)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix=f"positions-{variant}-{seed}-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        eval_strategy="steps",
        eval_steps=args.eval_every,
        logging_steps=args.eval_every,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=seed,
        data_seed=seed,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_blocks, eval_dataset=eval_masked, data_collator=collator
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    shutil.rmtree(training_args.output_dir, ignore_errors=True)  # nothing is saved: the curve is the result
    curve = [
        {"step": row["step"], "eval_loss": row["eval_loss"]} for row in trainer.state.log_history if "eval_loss" in row
    ]
    return curve, seconds


def stdlib_docstrings() -> list[str]:
    """The docstrings of the Python standard library's public modules, classes and functions (English prose that ships
    with every CPython), one paragraph per text, each distinct paragraph once, in a fixed order."""
    skip = (
        "test",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "this",
        "antigravity",
        "lib2to3",
        "ensurepip",
        "venv",
        "pydoc_data",
        "__phello__",
        "msilib",
        "xxsubtype",
    )
    texts, seen = [], set()
    for name in sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.startswith(sys.base_prefix)):
        if name.startswith("_") or name in skip:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001  a module this platform cannot import (msvcrt, ...): not part of the corpus
            continue
        objects = [module] + [
            obj
            for _, obj in sorted(vars(module).items())
            if not _.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
        ]
        for obj in objects:
            doc = inspect.getdoc(obj) or ""
            for paragraph in doc.split("\n\n"):
                text = " ".join(paragraph.split())
                if len(text.split()) >= 6 and text[-1] in ".:;!?)" and ">>>" not in text and text not in seen:
                    seen.add(text)
                    texts.append(text)
    return texts


def corpus(name: str):
    """(train, held-out, description): the standard library's docstrings (every tenth held out), or
    `hf_bert_impl.data.text_corpus`'s "embedded" or a text file."""
    if name == "stdlib_docstrings":
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return *D.held_out_split(stdlib_docstrings()), f"docstrings of the Python {version} standard library"
    return D.text_corpus(name)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpus", default="embedded", help="embedded, stdlib_docstrings, or a text file (one text per line)"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--model_size", default="tiny", choices=list(SIZE_PRESETS))
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--warmup_steps", type=int, default=30)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--vocab_size", type=int, default=4000)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the losses do not depend on it beyond rounding)"
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        help="ours' speed layer (hf_bert_impl.kernelize): auto (the table's kernels), "
        "reference (the plain model) or kernel names, comma-separated; the losses do not depend on it beyond rounding",
    )
    parser.add_argument("--out", default="outputs/positions", help="writes OUT.json and OUT.png")
    args = parser.parse_args(argv)
    try:
        kernels_bert_impl.kernel_names(args.kernels)
    except ValueError as e:
        parser.error(f"--kernels: {e}")
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    train_text, eval_text, description = corpus(args.corpus)
    tokenizer = D.train_wordpiece_tokenizer(train_text["text"], vocab_size=args.vocab_size)
    train_blocks = D.tokenize_and_group(train_text, tokenizer, args.max_seq_length, desc="train")
    eval_blocks = D.tokenize_and_group(eval_text, tokenizer, args.max_seq_length, desc="held-out")
    eval_masked = D.mask_once(eval_blocks, tokenizer, seed=1234)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    unigram = D.unigram_loss(train_blocks, eval_masked, len(tokenizer))
    print(
        f"corpus: {description}; {len(train_blocks)} training / {len(eval_masked)} held-out blocks of "
        f"{args.max_seq_length}; unigram loss {unigram:.3f}"
    )

    results = {}
    for variant in args.variants:
        for seed in args.seeds:
            curve, seconds = run(variant, seed, args, train_blocks, eval_masked, len(tokenizer), collator)
            results.setdefault(variant, []).append({"seed": seed, "curve": curve, "seconds": round(seconds, 1)})
            print(
                f"{variant:15s} seed {seed}: held-out loss "
                + " ".join(f"{p['step']}:{p['eval_loss']:.3f}" for p in curve)
                + f" ({seconds:.0f} s)"
            )
    final = {v: float(np.mean([r["curve"][-1]["eval_loss"] for r in runs])) for v, runs in results.items()}
    report = {
        "what": "held-out masked-LM loss after each number of steps, per positional encoding",
        "version": __version__,
        "corpus": description,
        "model_size": args.model_size,
        "size": SIZE_PRESETS[args.model_size],
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "corpus")},
        "train_blocks": len(train_blocks),
        "held_out_blocks": len(eval_masked),
        "unigram_loss": unigram,
        "final_mean_eval_loss": final,
        "kernels": {"setting": args.kernels, "kernels": cli.kernels_in_use(args.kernels, "cpu", torch.float32)},
        "machine": cli.machine_record(),
        "runs": results,
    }
    cli.write_result_json(report, f"{args.out}.json")
    plot(report, f"{args.out}.png")
    print(
        "mean held-out loss at step",
        args.steps,
        ":",
        ", ".join(f"{v} {l:.3f}" for v, l in final.items()),
        f"(unigram {unigram:.3f})",
    )
    ran = "; ".join(f"{mode}: {', '.join(names) or 'none'}" for mode, names in report["kernels"]["kernels"].items())
    print(f"ours' kernels ({args.kernels}): {ran}")
    print(f"wrote {args.out}.png")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (variant, runs) in enumerate(report["runs"].items()):
        for j, r in enumerate(runs):
            ax.plot(
                [p["step"] for p in r["curve"]],
                [p["eval_loss"] for p in r["curve"]],
                color=f"C{i}",
                alpha=0.8,
                label=variant if j == 0 else None,
            )
    ax.axhline(report["unigram_loss"], color="grey", linestyle="--", label="unigram loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out masked-LM loss")
    ax.set_title(f"{report['model_size']} model, {report['corpus'][:60]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
