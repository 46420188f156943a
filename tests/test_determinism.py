"""Determinism: the same seed gives bit-identical initial weights (in this process and in a fresh
one) and, on CPU, bit-identical losses and weights over 10 Trainer steps with dropout on, for the plain model and
for the kernelized one (`hf_bert_impl.kernelize`: the layers on the real tokens). A different seed gives
different numbers, so the equalities below can fail. The WordPiece tokenizer
trained on the same texts is the same on every run (tokenizers' own trainer is not)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments, set_seed

from hf_bert_impl import BertImplConfig, BertImplForMaskedLM, kernelize, kernelized
from hf_bert_impl.data import SPECIAL_TOKENS, default_corpus_dataset, train_wordpiece_tokenizer


REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB = 99
# Dropout on, so the runs also have to reproduce the dropout masks.
CONFIG = {"vocab_size": VOCAB, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}


def init_model(seed):
    set_seed(seed)
    return BertImplForMaskedLM(BertImplConfig.from_preset("debug", **CONFIG))


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def test_same_seed_same_initial_weights_bit_for_bit():
    a, b, c = init_model(7), init_model(7), init_model(8)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert weights_digest(a) == weights_digest(b) != weights_digest(c)
    # A fresh process (nothing shared but the seed) builds the same bytes.
    code = (
        "import sys; sys.path.insert(0, 'tests'); import test_determinism as t; "
        "print(t.weights_digest(t.init_model(7)))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == weights_digest(a)


class RecordingTrainer(Trainer):
    """Trainer that keeps every training-step loss at full precision (log_history rounds them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        self.step_losses.append((loss[0] if return_outputs else loss).detach().item())
        return loss


def tiny_mlm_data(n=48, seq=7):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (n, seq), generator=g)
    labels = torch.where(torch.rand(n, seq, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    mask = (torch.arange(seq)[None, :] < torch.randint(3, seq + 1, (n, 1), generator=g)).long()
    return Dataset.from_dict(
        {"input_ids": (ids * mask).tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()}
    )


def train_steps(seed, out_dir, steps=10, kernels=None):
    model = init_model(seed)
    if kernels is not None:
        assert kernelized(kernelize(model, kernels))
    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = RecordingTrainer(model=model, args=args, train_dataset=tiny_mlm_data())
    trainer.train()
    return trainer.step_losses, [e["loss"] for e in trainer.state.log_history if "loss" in e], weights_digest(model)


@pytest.mark.parametrize("kernels", [None, "auto", "unpadded"], ids=["plain", "auto", "unpadded"])
def test_same_seed_same_losses_for_10_cpu_steps(tmp_path, kernels):
    losses_a, logged_a, final_a = train_steps(3, tmp_path / "a", kernels=kernels)
    losses_b, logged_b, final_b = train_steps(3, tmp_path / "b", kernels=kernels)
    losses_c, _, final_c = train_steps(4, tmp_path / "c", steps=2, kernels=kernels)  # another seed: already different
    assert len(losses_a) == 10 and len(logged_a) == 10
    assert losses_a == losses_b  # exact float equality, step by step
    assert logged_a == logged_b and final_a == final_b
    assert losses_a[:2] != losses_c
    assert len(set(losses_a)) > 1  # it trained: the loss moved
    print("losses, seed 3:", losses_a)


def test_the_wordpiece_tokenizer_is_the_same_on_every_run():
    """tokenizers' WordPieceTrainer numbers its "##x" tokens in hash-map order, so on the demo's corpus and vocabulary
    size four runs gave four different vocabularies (2814 or 2815 tokens; huggingface/tokenizers#1794).
    `train_wordpiece_tokenizer` fixes that order: three runs (the texts given three ways) must give the same token ->
    id map, holding the same characters and "##" characters as the library's own trainer, with BERT's five special
    tokens and nothing else special."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    column = default_corpus_dataset()["train"]["text"]
    texts = [t for t in column if isinstance(t, str)]
    # three runs, from a dataset column (read twice), a generator (kept) and a list with an empty row
    runs = [train_wordpiece_tokenizer(source, vocab_size=4000) for source in (column, iter(texts), texts + [None])]
    vocab = runs[0].get_vocab()
    assert all(run.get_vocab() == vocab for run in runs[1:])
    assert set(runs[0].all_special_tokens) == set(SPECIAL_TOKENS)
    assert [vocab[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))

    library = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    library.normalizer = normalizers.BertNormalizer(lowercase=True)
    library.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    library.train_from_iterator(
        texts,
        trainers.WordPieceTrainer(
            vocab_size=4000, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False
        ),
    )

    def characters(v):
        return {t for t in v if len(t.removeprefix("##")) == 1}

    assert characters(vocab) == characters(library.get_vocab())
    assert abs(len(vocab) - library.get_vocab_size()) <= 5, (len(vocab), library.get_vocab_size())
    # It tokenizes as a WordPiece tokenizer: no [UNK], and the pieces put back together are the words.
    sentence = " ".join(texts[:20])
    backend = runs[0].backend_tokenizer
    words = [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(sentence))]
    pieces = runs[0].convert_ids_to_tokens(runs[0](sentence, add_special_tokens=False)["input_ids"])
    assert "[UNK]" not in pieces and len(pieces) > len(words)  # some words are split
    rebuilt = []
    for piece in pieces:
        if piece.startswith("##"):
            rebuilt[-1] += piece[2:]
        else:
            rebuilt.append(piece)
    assert rebuilt == words
