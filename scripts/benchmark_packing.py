"""`--pack_sequences` measured: padded batches vs the same examples packed into one row, training mode.

Copy-paste commands (offline; a full-size run takes about 20 s on one thread of a 2-core AMD EPYC):

    # quick check
    python scripts/benchmark_packing.py --num_batches 3 --passes 1

    # the table of docs/training.md ("Sequence packing"): tiny model, 10 batches of 32, 3 passes
    python scripts/benchmark_packing.py --threads 1 --json benchmarks/cpu-amd-zen4_packing_1thread.json
    python scripts/benchmark_packing.py --threads 2 --json benchmarks/cpu-amd-zen4_packing_2threads.json
    # the plain model (no kernels: padded batches on the whole grid, packed rows on a block-diagonal mask)
    python scripts/benchmark_packing.py --threads 1 --kernels reference \
        --json benchmarks/cpu-amd-zen4_packing_1thread_reference.json
    # kernels forced by name (hf_bert_impl.kernels_bert_impl.KERNELS) instead of the table's
    python scripts/benchmark_packing.py --threads 1 --kernels unpadded

What it does: batch_size x num_batches token-classification rows from the embedded corpus
(hf_bert_impl/data.py), each 1 to 8 consecutive sentences of one paragraph (as many as it has), word
tags read off the text (Python keyword / capitalised / other), truncated to --max_seq_length tokens
of a WordPiece tokenizer trained on the corpus as scripts/pretrain_mlm.py trains one (the `tokenizers`
trainer is not bit-reproducible between runs, so the real-token count can move by a few per 10,000;
--tokenizer_name fixes it). Every batch is collated both ways before timing: padded
(DataCollatorForTokenClassification; the model drops the padding inside, by its "unpadded" kernel) and
packed (DataCollatorWithFlattening: one row, position_ids restarting at 0 per sequence).
Check first: with dropout off (model.eval()) the first batch's loss must agree both ways within 1e-5,
else it stops (exit 1). Then, in training mode (dropout on), forward + backward (+ an AdamW step with
--optimizer_step true; off by default) is timed per batch, padded then packed, batch by batch, for
--passes passes after --warmup untimed pairs. Speed-up = padded seconds / packed seconds (all passes;
min-max of the per-pass ratios beside it). `--kernels` goes to `hf_bert_impl.kernelize(model, kernels)` (default
auto: the kernels of `KERNEL_TABLE` for the device, training mode and dtype; reference: the model is not kernelized,
the plain model runs); the JSON's "kernels" records the setting, the kernels the model ran in training (the table's
entry, or the forced set) and how many modules run each kernel function (`kernelized`).
"""

from __future__ import annotations

import keyword
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import (
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithFlattening,
    HfArgumentParser,
)

import hf_bert_impl
from hf_bert_impl import BertImplConfig, BertImplForTokenClassification
from hf_bert_impl import data as D
from hf_bert_impl.cli import kernel_facts, machine_record, write_result_json
from hf_bert_impl.configuration_bert_impl import SIZE_PRESETS
from hf_bert_impl.kernels_bert_impl import KERNELS, kernel_names


TAGS = ["O", "KEYWORD", "CAPITALISED"]
LOSS_TOLERANCE = 1e-5


@dataclass
class PackingArguments:
    model_size: str = field(
        default="tiny", metadata={"help": f"BertImplConfig size preset: {', '.join(SIZE_PRESETS)}"}
    )
    batch_size: int = field(default=32)
    num_batches: int = field(default=10, metadata={"help": "rows = batch_size x num_batches"})
    max_seq_length: int = field(default=256, metadata={"help": "truncate rows to this many tokens (8 to 512)"})
    passes: int = field(default=3, metadata={"help": "timed passes over all batches"})
    warmup: int = field(default=2, metadata={"help": "untimed (padded, packed) batch pairs before timing"})
    kernels: str = field(
        default="auto",
        metadata={
            "help": "hf_bert_impl.kernelize(model, kernels): auto (the "
            "table's kernels), reference (the plain model: padded "
            "batches run on the whole grid, packed rows on a "
            "block-diagonal mask) or kernel names, comma-separated: " + ", ".join(KERNELS)
        },
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "a saved tokenizer (default: one trained on the corpus)"}
    )
    optimizer_step: bool = field(default=False, metadata={"help": "also time an AdamW step per batch"})
    threads: int = field(default=0, metadata={"help": "torch.set_num_threads; 0 leaves torch's default"})
    seed: int = field(default=0, metadata={"help": "row sampling and model initialisation"})
    json: str | None = field(default=None, metadata={"help": "also write every number to this JSON file"})


def fail(message: str) -> None:
    print(f"benchmark_packing.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_args(args: PackingArguments) -> None:
    if args.model_size not in SIZE_PRESETS:
        fail(f"--model_size must be one of {list(SIZE_PRESETS)}, got {args.model_size!r}")
    if args.batch_size < 1 or args.num_batches < 1 or args.passes < 1:
        fail(
            f"--batch_size, --num_batches and --passes must be >= 1, "
            f"got {args.batch_size}, {args.num_batches}, {args.passes}"
        )
    if args.warmup < 0 or args.threads < 0:
        fail(f"--warmup and --threads must be >= 0, got {args.warmup}, {args.threads}")
    if not 8 <= args.max_seq_length <= 512:
        fail(f"--max_seq_length must be in [8, 512] (BERT's learned positions stop at 512), got {args.max_seq_length}")
    try:
        kernel_names(args.kernels)
    except ValueError:
        fail(
            f"--kernels must be auto, reference or kernel names from {', '.join(KERNELS)} (comma-separated), "
            f"got {args.kernels!r}"
        )


def tag(word: str) -> int:
    bare = word.strip(".,;:!?()\"'`")
    return 1 if keyword.iskeyword(bare) else 2 if bare[:1].isupper() else 0


def make_rows(n: int, seed: int) -> list[list[str]]:
    """n rows of words: a random paragraph's k consecutive sentences (k uniform in 1..8, at most all of them)."""
    rng = random.Random(seed)
    paragraphs = [D.split_sentences(p) for doc in D.default_corpus_documents() for p in doc["paragraphs"]]
    rows = []
    for _ in range(n):
        sentences = rng.choice(paragraphs)
        k = min(rng.randint(1, 8), len(sentences))
        start = rng.randint(0, len(sentences) - k)
        rows.append(" ".join(sentences[start : start + k]).split())
    return rows


def encode(rows, tokenizer, max_length: int) -> list[dict]:
    enc = tokenizer(rows, is_split_into_words=True, truncation=True, max_length=max_length)
    return [
        {"input_ids": enc["input_ids"][i], "labels": D.align_word_labels(enc.word_ids(i), [tag(w) for w in words])}
        for i, words in enumerate(rows)
    ]


def step(model, batch, optimizer) -> float:
    """Seconds for forward + backward (+ AdamW step) on one batch; gradients cleared afterwards, untimed."""
    t0 = time.perf_counter()
    model(**batch).loss.backward()
    if optimizer is not None:
        optimizer.step()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def check_same_loss(model, padded: dict, packed: dict) -> tuple[list[float], float]:
    """The loss of one batch padded and packed, dropout off: both layouts must compute the same (exit status 1 if
    they differ by more than LOSS_TOLERANCE, or either is NaN)."""
    model.eval()
    with torch.no_grad():
        losses = [model(**b).loss.item() for b in (padded, packed)]
    diff = abs(losses[0] - losses[1])
    if not diff <= LOSS_TOLERANCE:  # also catches NaN
        print(
            f"benchmark_packing.py: error: padded and packed losses differ: {losses[0]!r} vs {losses[1]!r} "
            f"(|diff| {diff:.2e} > {LOSS_TOLERANCE})",
            file=sys.stderr,
        )
        raise SystemExit(1)
    print(
        f"loss check (first batch, dropout off): padded {losses[0]:.6f}, packed {losses[1]:.6f}, "
        f"|diff| {diff:.2e} <= {LOSS_TOLERANCE}"
    )
    return losses, diff


def main(argv=None):
    (args,) = HfArgumentParser(PackingArguments).parse_args_into_dataclasses(args=argv)
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_record()
    print(f"machine: {info}")

    if args.tokenizer_name:
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
        except (OSError, ValueError) as e:
            fail(f"--tokenizer_name {args.tokenizer_name}: no tokenizer could be loaded ({str(e).splitlines()[0]})")
    else:
        tokenizer = D.train_wordpiece_tokenizer(D.default_corpus_dataset()["train"]["text"])
    rows = make_rows(args.batch_size * args.num_batches, args.seed)
    examples = encode(rows, tokenizer, args.max_seq_length)
    chunks = [examples[i : i + args.batch_size] for i in range(0, len(examples), args.batch_size)]
    pad, flat = DataCollatorForTokenClassification(tokenizer), DataCollatorWithFlattening(return_position_ids=True)
    padded, packed = [pad(c) for c in chunks], [flat(c) for c in chunks]
    lengths = [len(e["input_ids"]) for e in examples]
    real, grid = sum(lengths), sum(b["input_ids"].numel() for b in padded)
    assert real == sum(b["input_ids"].numel() for b in packed) == sum(int(b["attention_mask"].sum()) for b in padded)

    torch.manual_seed(args.seed)
    model = BertImplForTokenClassification(
        BertImplConfig.from_preset(
            args.model_size, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_labels=len(TAGS)
        )
    )
    if args.kernels != "reference":  # reference: the plain model, as a trust_remote_code user runs it
        hf_bert_impl.kernelize(model, args.kernels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if args.optimizer_step else None

    losses, diff = check_same_loss(model, padded[0], packed[0])
    model.train()
    for i in range(args.warmup):
        step(model, padded[i % len(padded)], optimizer)
        step(model, packed[i % len(packed)], optimizer)
    per_pass = {"padded": [], "packed": []}
    for _ in range(args.passes):
        totals = [0.0, 0.0]
        for a, b in zip(padded, packed):  # interleaved batch by batch
            totals[0] += step(model, a, optimizer)
            totals[1] += step(model, b, optimizer)
        per_pass["padded"].append(totals[0])
        per_pass["packed"].append(totals[1])

    paths = {
        k: {
            "seconds": sum(t),
            "seconds_per_pass": t,
            "sequences_per_s": len(examples) * args.passes / sum(t),
            "real_tokens_per_s": real * args.passes / sum(t),
        }
        for k, t in per_pass.items()
    }
    ratios = [a / b for a, b in zip(per_pass["padded"], per_pass["packed"])]
    kernels = kernel_facts(model, args.kernels, modes=("training",))  # the timed steps train
    words, tokens = sorted(len(r) for r in rows), sorted(lengths)
    result = {
        "args": asdict(args),
        "command": "python scripts/benchmark_packing.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {**info, "load_average_at_end": os.getloadavg()},
        "timed": "forward + backward" + (" + AdamW step" if args.optimizer_step else "") + " per batch, training mode",
        "data": {
            "tokenizer": args.tokenizer_name or "WordPiece trained on the corpus",
            "vocab_size": len(tokenizer),
            "rows": len(examples),
            "words_min_median_max": [words[0], statistics.median(words), words[-1]],
            "tokens_min_median_max": [tokens[0], statistics.median(tokens), tokens[-1]],
            "real_tokens": real,
            "padded_grid_tokens": grid,
            "real_token_fraction": real / grid,
            "token_lengths": lengths,
        },
        "loss_check": {"padded": losses[0], "packed": losses[1], "abs_diff": diff, "tolerance": LOSS_TOLERANCE},
        "kernels": kernels,
        **paths,
        "speedup": paths["padded"]["seconds"] / paths["packed"]["seconds"],
        "speedup_per_pass": ratios,
        "speedup_min": min(ratios),
        "speedup_max": max(ratios),
    }

    print(
        f"{len(rows)} rows: {words[0]} to {words[-1]} words (median {statistics.median(words)}), {tokens[0]} to "
        f"{tokens[-1]} tokens; real tokens {100 * real / grid:.1f} % of the padded grid ({real:,} of {grid:,})"
    )
    said = "the plain model" if args.kernels == "reference" else ", ".join(kernels["kernels"]["training"]) or "none"
    print(f"kernels: {args.kernels} ({said})")
    threads = f"{torch.get_num_threads()}" + ("" if args.kernels == "auto" else f", `kernels={args.kernels}`")
    cells = [
        f"{p['seconds']:.2f} s, {p['sequences_per_s']:.1f} sequences/s, {p['real_tokens_per_s']:,.0f} real tokens/s"
        for p in paths.values()
    ]
    result["markdown_table"] = table = "\n".join(
        [
            "| threads | padded | packed | speed-up (min-max over passes) |",
            "|---|---|---|---|",
            f"| {threads} | {cells[0]} | {cells[1]} | {result['speedup']:.2f}x "
            f"({result['speedup_min']:.2f}-{result['speedup_max']:.2f}) |",
        ]
    )
    print(table)
    if args.json:
        write_result_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
