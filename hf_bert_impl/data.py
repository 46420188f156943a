"""Data for the package's pretraining and fine-tuning (`hf_bert_impl.pretraining`, `hf_bert_impl.finetuning`):
corpus, tokenizer training, masking collators and datasets.

The embedded corpus is the Python Language Reference text that ships with every CPython as
`pydoc_data.topics` (about 460 KB of English prose, 79 topics such as "with", "class", "import"):
real prose that needs no download, so the scripts run offline anywhere. Its exact text follows the
Python version that runs the script.

Two embedded labelled tasks are built from the same sentences, with labels that come from the
text itself, never set by hand (each distinct sentence once; train / validation / test splits
hold disjoint sentences):
- "statement_topic" (the demo's): 1 when the sentence comes from a section whose title names a
  statement ('The "with" statement', 'Assignment statements', ...), 0 for every other section.
- "word_order": 1 = the sentence as written, 0 = the same words in a random order (seeded).

The benchmarks read the embedded corpus or a text file through `text_corpus` (their own corpora, the fortunes and
the standard library's docstrings, live in their scripts).

`UsageError`, the error these helpers raise for a bad file, column or option, lives in
`hf_bert_impl.cli` with the rest of the scripts' command-line plumbing.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import BertTokenizerFast, TrainerCallback

from .cli import UsageError
from .compat import bert_tokenizer_from_vocab, language_modeling_collator


SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
IGNORE_INDEX = -100
DEFAULT_CORPUS_NAME = (
    f"embedded default corpus: the Python {sys.version_info.major}.{sys.version_info.minor} "
    "Language Reference text shipped as pydoc_data.topics"
)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(])")
_HEADING_RULE = re.compile(r"^[*=\-~^\"]{3,}$")


# ----------------------------------------------------------------------------------------------
# The embedded corpus


def default_corpus_documents() -> list[dict]:
    """The embedded corpus as documents: [{"topic": str, "title": str, "paragraphs": [str, ...]}],
    sorted by topic; a paragraph that already appeared under an earlier topic is not repeated.

    Keeps prose paragraphs only: indented blocks (grammar rules, code examples, notes' bodies),
    headings and their underlines, and paragraphs without a sentence-like shape are dropped.
    """
    from pydoc_data.topics import topics

    documents = []
    seen = set()  # some topics repeat others' text ("else" is "if"; "compound" holds every compound statement)
    for topic in sorted(topics):
        paragraphs = []
        title = topics[topic].strip().split("\n")[0].strip()
        for block in re.split(r"\n\s*\n", topics[topic]):
            lines = block.split("\n")
            if any(line.startswith("   ") for line in lines) or any(_HEADING_RULE.match(l.strip()) for l in lines):
                continue
            text = " ".join(line.strip() for line in lines).strip()
            if len(text.split()) >= 6 and text[-1] in ".:;!?)" and text not in seen:
                seen.add(text)
                paragraphs.append(text)
        if paragraphs:
            documents.append({"topic": topic, "title": title, "paragraphs": paragraphs})
    return documents


def split_sentences(paragraph: str) -> list[str]:
    """A paragraph -> its sentences (split after . ! ? when a capital or quote follows)."""
    return [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]


def default_corpus_dataset() -> datasets.DatasetDict:
    """The embedded corpus as a DatasetDict with a "text" column, one paragraph per row.

    "validation" holds whole topics, about 10% of the paragraphs, so no paragraph is in both splits.
    """
    rows = {"train": [], "validation": []}
    for doc in default_corpus_documents():
        # Whole topics go to validation while it holds under 10% of the paragraphs seen so far.
        seen = len(rows["train"]) + len(rows["validation"])
        split = "validation" if seen and len(rows["validation"]) < 0.1 * seen else "train"
        rows[split].extend(doc["paragraphs"])
    return datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in rows.items()})


def _corpus_sentences(min_words: int, max_words: int):
    """(sentence, document) pairs of the embedded corpus, each distinct sentence once, in corpus order."""
    seen = set()
    for doc in default_corpus_documents():
        for paragraph in doc["paragraphs"]:
            for s in split_sentences(paragraph):
                words = s.rstrip(".").split()
                text = " ".join(words)
                if min_words <= len(words) <= max_words and len(set(words)) > 1 and text not in seen:
                    seen.add(text)
                    yield text, doc


def split_80_10_10(rows, features, rng) -> datasets.DatasetDict:
    """`rows` shuffled with `rng` into train / validation / test (80 / 10 / 10) under `features`."""
    rng.shuffle(rows)
    n = len(rows)
    cut1, cut2 = int(0.8 * n), int(0.9 * n)
    return datasets.DatasetDict(
        {
            name: datasets.Dataset.from_list(part, features=features)
            for name, part in (("train", rows[:cut1]), ("validation", rows[cut1:cut2]), ("test", rows[cut2:]))
        }
    )


def statement_topic_task(seed: int = 0, min_words: int = 6, max_words: int = 40) -> datasets.DatasetDict:
    """The demo's labelled task: columns "sentence" and "label": 1 ("statement") when the sentence
    comes from a Language Reference section whose title names a statement ('The "with" statement',
    'Assignment statements', ... 20 topics), 0 ("other") for the other sections (expressions, data
    model, types, literals, ...). The label is read off the section title, never set by hand.
    Each distinct sentence appears once; splits 80 / 10 / 10 by sentence, shuffled with `seed`."""
    rows = [
        {"sentence": text, "label": int("statement" in doc["title"].lower())}
        for text, doc in _corpus_sentences(min_words, max_words)
    ]
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["other", "statement"])}
    )
    return split_80_10_10(rows, features, random.Random(seed))


def word_order_task(seed: int = 0, min_words: int = 6, max_words: int = 30) -> datasets.DatasetDict:
    """A harder labelled task: columns "sentence" and "label" (1 = original order, 0 = shuffled).

    Every sentence of the corpus with `min_words`..`max_words` words is used once; half of them
    (chosen with `seed`) have their words permuted, with the permutation re-drawn until it differs
    from the original. The final full stop is removed from every sentence so that it cannot
    give the label away; the tokenizer lower-cases, so the capital letter cannot either. Splits
    80 / 10 / 10 by sentence.
    """
    rng = random.Random(seed)
    texts = [text for text, _ in _corpus_sentences(min_words, max_words)]
    rng.shuffle(texts)
    rows = []
    for i, text in enumerate(texts):
        words = text.split()
        if i % 2 == 0:
            rows.append({"sentence": text, "label": 1})
        else:
            shuffled = words[:]
            while shuffled == words:
                rng.shuffle(shuffled)
            rows.append({"sentence": " ".join(shuffled), "label": 0})
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["shuffled", "original"])}
    )
    return split_80_10_10(rows, features, rng)


EMBEDDED_TASKS = {"statement_topic": statement_topic_task, "word_order": word_order_task}


# ----------------------------------------------------------------------------------------------
# Tokenizer


def train_wordpiece_tokenizer(texts, vocab_size: int = 8000, min_frequency: int = 2) -> BertTokenizerFast:
    """A WordPiece tokenizer trained on `texts` with `tokenizers`, BERT's pipeline (lower-casing,
    accent stripping, punctuation splitting, [CLS] A [SEP] B [SEP]); returned as a
    `BertTokenizerFast` so `save_pretrained` writes files `AutoTokenizer` loads. `texts`: any
    iterable of strings (a dataset column, a list; a generator is kept in memory, as the texts are
    read twice); other values (None) are skipped.

    The same texts give the same vocabulary on every run. `tokenizers`' trainer numbers the
    continuing-subword tokens ("##a", "##b", ...) in hash-map order as it meets them, and those
    numbers break the ties between equally frequent merges, so on its own it learns a slightly
    different vocabulary from run to run (huggingface/tokenizers#1794). Here the alphabet and
    those tokens are handed to the trainer up front, after the special tokens, each sorted by code
    point: the same tokens it would create (a character, and "##" + each character seen after the
    first of a word), in the order it gives the alphabet. They stay ordinary vocabulary entries of
    the returned tokenizer; its special tokens are the five of BERT."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if iter(texts) is texts:  # a one-shot iterator (a generator): kept, as it is read twice
        texts = list(texts)

    def strings():  # the texts, once more; rows without text (None) skipped
        return (t for t in texts if isinstance(t, str))

    alphabet, continuing = set(), set()
    for text in strings():
        for word, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)):
            alphabet.update(word)
            continuing.update(word[1:])
    fixed_order = sorted(alphabet) + ["##" + char for char in sorted(continuing)]
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS + fixed_order,
        show_progress=False,
    )
    tok.train_from_iterator(strings(), trainer=trainer)
    # BertTokenizerFast builds the same normalizer / pre-tokenizer / post-processor from the vocabulary.
    return bert_tokenizer_from_vocab(tok.get_vocab(), do_lower_case=True)


# ----------------------------------------------------------------------------------------------
# MLM examples


def tokenize_and_group(
    dataset,
    tokenizer,
    max_seq_length: int,
    text_column: str = "text",
    num_proc=None,
    desc="",
    with_offsets: bool = False,
):
    """Tokenize with `datasets.map` (batched, cached), concatenate everything and cut it into blocks
    of `max_seq_length` tokens: [CLS] + (max_seq_length - 2) corpus tokens + [SEP]. The tail shorter
    than a block is dropped, as in transformers' run_mlm.py. `with_offsets` keeps each token's
    character span ("offset_mapping"), which whole-word masking reads to find word boundaries
    (a token that starts where the previous one ended continues its word)."""
    body = max_seq_length - 2
    if body < 1:
        raise UsageError(f"--max_seq_length must be at least 3 ([CLS] x [SEP]), got {max_seq_length}")
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id

    def tokenize(batch):
        enc = tokenizer(batch[text_column], add_special_tokens=False, return_offsets_mapping=with_offsets)
        out = {"ids": enc["input_ids"]}
        if with_offsets:
            out["offsets"] = [[list(o) for o in row] for row in enc["offset_mapping"]]
        return out

    def group(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        starts = range(0, len(flat) - body + 1, body)
        blocks = [flat[i : i + body] for i in starts]
        out = {
            "input_ids": [[cls_id, *b, sep_id] for b in blocks],
            "token_type_ids": [[0] * max_seq_length for _ in blocks],
            "attention_mask": [[1] * max_seq_length for _ in blocks],
            "special_tokens_mask": [[1] + [0] * body + [1] for _ in blocks],
        }
        if with_offsets:
            offsets = [o for row in batch["offsets"] for o in row]
            out["offset_mapping"] = [[[0, 0], *offsets[i : i + body], [0, 0]] for i in starts]
        return out

    if isinstance(dataset, datasets.IterableDataset):  # streamed: tokenized and grouped lazily, batch by batch
        tokenized = dataset.select_columns([text_column]).map(tokenize, batched=True, remove_columns=[text_column])
        spent = ["ids"] + (["offsets"] if with_offsets else [])
        return tokenized.map(group, batched=True, batch_size=1000, remove_columns=spent)
    tokenized = dataset.map(
        tokenize,
        batched=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing {desc}".strip(),
    )
    return tokenized.map(
        group,
        batched=True,
        batch_size=1000,
        remove_columns=tokenized.column_names,
        num_proc=num_proc,
        desc=f"Grouping {desc} into blocks of {max_seq_length}".strip(),
    )


def nsp_examples(dataset, tokenizer, max_seq_length: int, seed: int, text_column: str = "text"):
    """BERT's next-sentence pairs. The rows are read as one stream of sentences (consecutive rows of
    the embedded corpus are consecutive paragraphs of a topic). A is 1-3 sentences; B is the 1-3
    sentences that follow (next_sentence_label 0) or, with probability 1/2, 1-3 sentences taken at
    least 20 sentences away (label 1). Pairs are truncated to `max_seq_length` as [CLS] A [SEP] B [SEP]."""
    rng = random.Random(seed)
    sents = [s for text in dataset[text_column] for s in split_sentences(text)]
    if len(sents) < 45:
        raise UsageError(f"next-sentence prediction needs at least 45 sentences of text, got {len(sents)}")
    firsts, seconds, labels = [], [], []
    i = 0
    while i + 2 <= len(sents):
        a_len = rng.randint(1, 3)
        a = sents[i : i + a_len]
        b_len = rng.randint(1, 3)
        if rng.random() < 0.5 and i + a_len < len(sents):
            b, label = sents[i + a_len : i + a_len + b_len], 0
        else:
            far = [j for j in (rng.randrange(len(sents)) for _ in range(10)) if abs(j - i) >= 20]
            j = far[0] if far else (i + len(sents) // 2) % len(sents)
            b, label = sents[j : j + b_len], 1
        firsts.append(" ".join(a))
        seconds.append(" ".join(b))
        labels.append(label)
        i += a_len + (len(b) if label == 0 else 0)
    enc = tokenizer(
        firsts, seconds, truncation="longest_first", max_length=max_seq_length, return_special_tokens_mask=True
    )
    return datasets.Dataset.from_dict({**enc, "next_sentence_label": labels})


class MLMCollator:
    """Masks batches with `DataCollatorForLanguageModeling`'s own masking (`mlm_probability` of the
    tokens; of those 80% [MASK], 10% random, 10% unchanged; whole words with `whole_word_mask=True`);
    examples that already carry "labels" (masked once by `mask_once`) are only padded, so evaluation
    sees the same masks every time and runs that must compare see the same batches.

    With a `seed`, batch k is masked from one generator seeded with (seed, k), in one vectorised draw
    over the global batch: `world_size` processes of `len(features)` examples each, `max_length`
    columns (the batch's width when None). Process `rank` keeps its slice of that draw. So:
    - N processes with per-device batch B mask the examples of a global batch exactly as one process
      with batch N*B does (accelerate hands rank r the r-th slice), and
    - a resumed run (`MaskingResumeCallback` sets k) masks every batch as the uninterrupted run did,
      whatever the data loader prefetched before the checkpoint.
    The cost is one masking call of the library per batch (the draw covers N*B rows, so a process of
    N pays for the draws of N; drawing is a small part of the call)."""

    def __init__(
        self,
        tokenizer,
        mlm_probability: float = 0.15,
        whole_word_mask: bool = False,
        pad_to_multiple_of=None,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        max_length: int | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a process of world_size {world_size}")
        self.tokenizer, self.pad_to_multiple_of, self.max_length = tokenizer, pad_to_multiple_of, max_length
        self.mlm = language_modeling_collator(
            tokenizer,
            mlm_probability=mlm_probability,
            whole_word_mask=whole_word_mask,
            pad_to_multiple_of=pad_to_multiple_of,
        )
        self.seed, self.rank, self.world_size, self.batches_made = seed, rank, world_size, 0

    def __call__(self, features):
        if "labels" not in features[0] and self.seed is None:
            return self.mlm(features)
        labels = [list(f["labels"]) for f in features] if "labels" in features[0] else None
        # Masked once already: only padded. To be masked: special_tokens_mask goes through (padding positions are 1).
        drop = (
            ("labels", "offset_mapping", "special_tokens_mask") if labels is not None else ("labels", "offset_mapping")
        )
        batch = self.tokenizer.pad(
            [{k: v for k, v in f.items() if k not in drop} for f in features],
            return_tensors="pt",
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        width = batch["input_ids"].shape[1]
        if labels is not None:  # masked once already: pad the labels too
            batch["labels"] = torch.tensor([l + [IGNORE_INDEX] * (width - len(l)) for l in labels])
            return batch
        special = batch.pop("special_tokens_mask", None)
        offsets = None
        if self.mlm.whole_word_mask:
            offsets = torch.zeros(len(features), width, 2, dtype=torch.long)
            for i, f in enumerate(features):
                offsets[i, : len(f["offset_mapping"])] = torch.as_tensor(f["offset_mapping"], dtype=torch.long)
        batch["input_ids"], batch["labels"] = self.mask(batch["input_ids"], special, offsets)
        return batch

    def mask(self, input_ids, special_tokens_mask=None, offset_mapping=None):
        """(input_ids, labels) of this process's (b, width) batch: batch `batches_made` of the global draw."""
        b, width = input_ids.shape
        cols = self.max_length or width
        if width > cols:
            raise ValueError(f"a batch of width {width} is wider than the collator's max_length {cols}")
        if special_tokens_mask is None:
            special_tokens_mask = torch.tensor(
                [
                    self.tokenizer.get_special_tokens_mask(row, already_has_special_tokens=True)
                    for row in input_ids.tolist()
                ]
            )
        rows = slice(self.rank * b, (self.rank + 1) * b)
        # The global batch; other processes' rows hold padding. A draw depends only on its place in the
        # (world_size * b, cols) grid, never on the values of the other rows.
        ids = torch.full((self.world_size * b, cols), self.tokenizer.pad_token_id, dtype=input_ids.dtype)
        special = torch.ones_like(ids)
        ids[rows, :width], special[rows, :width] = input_ids, special_tokens_mask
        offsets = None
        if offset_mapping is not None:
            offsets = torch.zeros(self.world_size * b, cols, 2, dtype=torch.long)
            offsets[rows, :width] = offset_mapping
        key = int(np.random.SeedSequence([self.seed, self.batches_made]).generate_state(1)[0])
        self.batches_made += 1
        self.mlm.generator = torch.Generator().manual_seed(key)
        masked, labels = self.mlm.torch_mask_tokens(ids, special_tokens_mask=special, offset_mapping=offsets)
        return masked[rows, :width].contiguous(), labels[rows, :width].contiguous()


def tokenize_documents(dataset, tokenizer, max_seq_length: int, text_column: str = "text", num_proc=None, desc=""):
    """For `--pack_sequences`: every text becomes [CLS] tokens [SEP] sequences of at most `max_seq_length`
    tokens (a long text is cut into consecutive pieces), never joined with another text; the collator
    packs them into one row without padding. Works on a `Dataset` and on a streamed `IterableDataset`."""
    body = max_seq_length - 2
    if body < 1:
        raise UsageError(f"--max_seq_length must be at least 3 ([CLS] x [SEP]), got {max_seq_length}")
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id

    def tokenize(batch):
        pieces = []
        for ids in tokenizer([t for t in batch[text_column] if isinstance(t, str)], add_special_tokens=False)[
            "input_ids"
        ]:
            pieces.extend(ids[i : i + body] for i in range(0, len(ids), body))
        return {
            "input_ids": [[cls_id, *p, sep_id] for p in pieces],
            "special_tokens_mask": [[1] + [0] * len(p) + [1] for p in pieces],
        }

    if isinstance(dataset, datasets.IterableDataset):
        return dataset.select_columns([text_column]).map(tokenize, batched=True, remove_columns=[text_column])
    return dataset.map(
        tokenize,
        batched=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing {desc} (one sequence per text)".strip(),
    )


class PackedMLMCollator:
    """`--pack_sequences`: masks the batch with `MLMCollator` (the same seeded per-batch masking), then
    packs its sequences into one row with `DataCollatorWithFlattening`: no padding tokens, and
    `position_ids` restarting at 0 per sequence, which the model reads as sequence boundaries
    (attention stays inside each sequence)."""

    def __init__(self, mlm_collator: MLMCollator):
        from transformers import DataCollatorWithFlattening

        self.inner = mlm_collator
        self.flatten = DataCollatorWithFlattening(return_position_ids=True)

    # MaskingResumeCallback reads and sets the batch counter of the collator it is given.
    @property
    def batches_made(self):
        return self.inner.batches_made

    @batches_made.setter
    def batches_made(self, value):
        self.inner.batches_made = value

    def __call__(self, features):
        batch = self.inner(features)
        keep = batch["attention_mask"].bool()
        rows = [
            {"input_ids": batch["input_ids"][i][keep[i]].tolist(), "labels": batch["labels"][i][keep[i]].tolist()}
            for i in range(keep.shape[0])
        ]
        return self.flatten(rows)


class MaskingResumeCallback(TrainerCallback):
    """Exact resume with per-batch masking. Trainer (transformers 5.24) restores the global RNG only
    after it has fetched the first batch past a checkpoint, so a collator drawing masks from the global
    RNG masks that batch differently than the uninterrupted run. This callback counts the training
    batches consumed, writes the count into every checkpoint (`masking_state.json`), and on resume
    sets the seeded `MLMCollator` to continue at that batch. Needs `dataloader_num_workers=0` (the
    default): with worker processes each worker holds its own copy of the collator."""

    FILE = "masking_state.json"

    def __init__(self, collator: MLMCollator, resume_from: str | None = None):
        self.collator, self.resume_from, self.consumed = collator, resume_from, 0

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resume_from is None:
            return
        path = os.path.join(self.resume_from, self.FILE)
        if not os.path.isfile(path):
            raise UsageError(
                f"{self.resume_from} has no {self.FILE}: it was not written by this script with per-batch "
                "masking, so the resumed run cannot mask the next batches as the interrupted one would"
            )
        self.consumed = json.loads(Path(path).read_text())["batches_consumed"]
        self.collator.batches_made = self.consumed

    def on_substep_end(self, args, state, control, **kwargs):  # a micro-batch inside gradient accumulation
        self.consumed += 1

    def on_step_end(self, args, state, control, **kwargs):  # the micro-batch that ends an optimizer step
        self.consumed += 1

    def on_save(self, args, state, control, **kwargs):
        if args.process_index == 0:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            Path(folder, self.FILE).write_text(json.dumps({"batches_consumed": self.consumed}))


def mask_once(dataset, tokenizer, seed: int, mlm_probability: float = 0.15, whole_word_mask: bool = False):
    """Static masking (as the original BERT data pipeline): apply the MLM masking once, with a fixed
    seed, and store input_ids and labels in the dataset."""
    collator = language_modeling_collator(
        tokenizer, mlm_probability=mlm_probability, whole_word_mask=whole_word_mask, seed=seed, return_tensors="np"
    )

    def apply(batch):
        keys = [k for k in batch if k != "labels"]
        features = [{k: batch[k][i] for k in keys} for i in range(len(batch["input_ids"]))]
        out = {}
        # One example at a time: lengths may differ (NSP pairs) and no padding may be stored.
        for f in features:
            masked = collator([f])
            for k in ("input_ids", "labels"):
                out.setdefault(k, []).append(masked[k][0].tolist())
        return out

    # The masking inputs are spent once the labels are stored.
    spent = [c for c in ("special_tokens_mask", "offset_mapping") if c in dataset.column_names]
    return dataset.map(apply, batched=True, remove_columns=spent, desc="Masking once (static)")


def unigram_loss(train_blocks, eval_masked, vocab_size: int) -> float:
    """The loss of a model that ignores context: the cross-entropy of the held-out masked tokens (`eval_masked`'s
    labels) under the training blocks' token frequencies (add-one smoothed). exp() of it is the baseline a
    pretraining's perplexity is read against; a model that has learned nothing about context sits there."""
    counts = (
        np.bincount(np.concatenate([np.asarray(row) for row in train_blocks["input_ids"]]), minlength=vocab_size) + 1.0
    )
    logp = np.log(counts / counts.sum())
    labels = np.concatenate([np.asarray(row) for row in eval_masked["labels"]])
    return float(-logp[labels[labels != IGNORE_INDEX]].mean())


# ----------------------------------------------------------------------------------------------
# Corpora for the benchmarks


def held_out_split(texts: list[str]) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, held-out) datasets with a "text" column: every tenth text held out, the rest for training."""
    held = set(range(0, len(texts), 10))
    train = [t for i, t in enumerate(texts) if i not in held]
    return (
        datasets.Dataset.from_dict({"text": train}),
        datasets.Dataset.from_dict({"text": [texts[i] for i in sorted(held)]}),
    )


def text_corpus(name: str) -> tuple[datasets.Dataset, datasets.Dataset, str]:
    """ "embedded" (`default_corpus_dataset`: held out, whole topics) or a text file (one text per line, through
    `load_data_files`; every tenth held out) -> (train, held-out, a description)."""
    if name == "embedded":
        raw = default_corpus_dataset()
        return raw["train"], raw["validation"], DEFAULT_CORPUS_NAME
    texts = [t for t in load_data_files(train_file=name)["train"]["text"] if isinstance(t, str) and t.strip()]
    return *held_out_split(texts), name


# ----------------------------------------------------------------------------------------------
# Files


DATA_FILE_TYPES = {".txt": "text", ".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _data_file_kind(files, flag: str, path) -> str:
    """The `datasets` builder ("text", "json", ...) for local `files` given as `flag path`; a UsageError
    naming them when one is missing, the extension is unknown (or differs between files), or all are empty."""
    if not files or not all(Path(f).is_file() for f in files):
        raise UsageError(f"{flag} {path}: no such file")
    kinds = {DATA_FILE_TYPES.get(Path(f).suffix.lower()) for f in files}
    if len(files) == 1 and None in kinds:
        raise UsageError(
            f"{flag} {path}: unknown extension {Path(files[0]).suffix!r}; use one of {sorted(DATA_FILE_TYPES)}"
        )
    if None in kinds or len(kinds) != 1:
        raise UsageError(f"{flag} {path}: files must share one extension of {sorted(DATA_FILE_TYPES)}")
    if all(Path(f).stat().st_size == 0 for f in files):
        raise UsageError(f"{flag} {path}: the file is empty")
    return kinds.pop()


def stream_data_file(path, flag: str = "--train_file") -> datasets.IterableDataset:
    """A local text / json lines / csv / parquet file (or a glob of them) as a streamed `IterableDataset`:
    rows are read as training consumes them, so the file may be larger than memory."""
    import glob

    matches = sorted(glob.glob(str(path))) if any(c in str(path) for c in "*?[") else [str(path)]
    kind = _data_file_kind(matches, flag, path)
    return datasets.load_dataset(kind, data_files={"train": matches}, split="train", streaming=True)


def load_data_files(train_file=None, validation_file=None, test_file=None) -> datasets.DatasetDict:
    """Local files -> DatasetDict through `datasets` (txt, csv, json/jsonl, parquet). Raises ValueError
    naming the file when it is missing, has an unknown extension, cannot be parsed or is empty."""
    files = {k: v for k, v in (("train", train_file), ("validation", validation_file), ("test", test_file)) if v}
    loaded = {}
    for split, path in files.items():
        p = Path(path)
        kind = _data_file_kind([p], f"--{split}_file", path)
        # A local file converts in a blink; its progress bar would only clutter an error message.
        bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            ds = datasets.load_dataset(kind, data_files={split: str(p)}, split=split)
        except Exception as e:  # datasets raises many types for unparsable files; the user needs the file name
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"--{split}_file {path}: cannot be read as {kind}: {first}") from e
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
        if len(ds) == 0:
            raise UsageError(f"--{split}_file {path}: the file holds no rows")
        loaded[split] = ds
    return datasets.DatasetDict(loaded)


def check_columns(dataset, required, source: str):
    """Raise ValueError naming `source` when `dataset` lacks one of the `required` columns."""
    missing = [c for c in required if c not in dataset.column_names]
    if missing:
        raise UsageError(f"{source}: missing column(s) {missing}; found {dataset.column_names}")


def align_word_labels(word_ids, word_labels, label_all_tokens: bool = False) -> list[int]:
    """Word-level label ids -> one label per token for token classification: special tokens get -100;
    the first WordPiece of a word gets the word's label; the word's other pieces get -100 (ignored by
    the loss), or the same label with `label_all_tokens`. `word_ids` comes from a fast tokenizer's
    `BatchEncoding.word_ids(i)`."""
    out, previous = [], None
    for w in word_ids:
        if w is None:
            out.append(IGNORE_INDEX)
        elif w != previous or label_all_tokens:
            out.append(word_labels[w])
        else:
            out.append(IGNORE_INDEX)
        previous = w
    return out
