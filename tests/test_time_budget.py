"""Pretraining for a time budget: the seeded masking collator (one vectorised draw per global batch), the
`TimeBudget` callback (schedule laid over time, clean stop, evaluation time not counted, resumable clock,
driven here by a fake clock so nothing depends on this machine's speed), and `pretrain_mlm.py --time_budget`
end to end. The pretraining race built on them (scripts/benchmark_pretraining.py) is tested in
tests/test_benchmark_pretraining.py."""

import json
import math

import numpy as np
import pytest
import torch
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

from hf_bert_impl import BertImplConfig, BertImplForMaskedLM, pretraining
from hf_bert_impl import data as D
from hf_bert_impl.budget import STATE_FILE, TimeBudget

from .conftest import ListDataset
from .test_scripts import recomputed_accuracies, script_args


@pytest.fixture(scope="module")
def tokenizer():
    return D.train_wordpiece_tokenizer(D.default_corpus_dataset()["train"]["text"][:200], vocab_size=300)


@pytest.fixture(scope="module")
def blocks(tokenizer):
    return D.tokenize_and_group(
        D.default_corpus_dataset()["train"].select(range(200)), tokenizer, 24, with_offsets=True
    )


def rows(blocks, n, drop=("offset_mapping",)):
    return [{k: v for k, v in blocks[i].items() if k not in drop} for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------------
# The collator


@pytest.mark.parametrize("whole_word_mask", [False, True], ids=["tokens", "whole-words"])
def test_processes_mask_their_slices_of_the_global_batch_as_one_process_does(tokenizer, blocks, whole_word_mask):
    """3 processes with batch 4 each == 1 process with batch 12, batch after batch (exact)."""
    drop = () if whole_word_mask else ("offset_mapping",)
    data = rows(blocks, 24, drop)
    one = D.MLMCollator(tokenizer, whole_word_mask=whole_word_mask, seed=7, max_length=24)
    ranks = [
        D.MLMCollator(tokenizer, whole_word_mask=whole_word_mask, seed=7, rank=r, world_size=3, max_length=24)
        for r in range(3)
    ]
    for k in range(2):
        batch = data[12 * k : 12 * (k + 1)]
        whole = one(batch)
        parts = [c(batch[4 * r : 4 * (r + 1)]) for r, c in enumerate(ranks)]
        for key in ("input_ids", "labels"):
            assert torch.equal(whole[key], torch.cat([p[key] for p in parts])), (k, key)
        assert (whole["labels"] != D.IGNORE_INDEX).any()
    # Not vacuous: another seed, or another batch number, masks differently.
    other = D.MLMCollator(tokenizer, whole_word_mask=whole_word_mask, seed=8, max_length=24)(data[:12])
    assert not torch.equal(
        other["labels"],
        D.MLMCollator(tokenizer, whole_word_mask=whole_word_mask, seed=7, max_length=24)(data[:12])["labels"],
    )


def test_masks_do_not_depend_on_the_padding_width(tokenizer):
    """Rows of different lengths (next-sentence pairs, packed sequences) keep their masks whatever the longest row
    of their batch: the draw covers max_length columns."""
    texts = [" ".join(["word"] * n) + " end" for n in (3, 9, 5, 14)]
    feats = [dict(tokenizer(t, return_special_tokens_mask=True)) for t in texts]
    full = D.MLMCollator(tokenizer, seed=3, world_size=2, max_length=32)(feats[:2])
    short = D.MLMCollator(tokenizer, seed=3, world_size=2, max_length=32)([feats[0], feats[0]])
    width = len(feats[0]["input_ids"])
    assert torch.equal(full["labels"][0, :width], short["labels"][0])
    with pytest.raises(ValueError, match="wider than the collator's max_length 8"):
        D.MLMCollator(tokenizer, seed=3, max_length=8)(feats)
    with pytest.raises(ValueError, match="rank 2 is not a process of world_size 2"):
        D.MLMCollator(tokenizer, seed=3, rank=2, world_size=2)


def test_a_resumed_collator_masks_as_the_uninterrupted_one(tokenizer, blocks):
    data = rows(blocks, 40)
    straight = D.MLMCollator(tokenizer, seed=1, max_length=24)
    expected = [straight(data[8 * k : 8 * (k + 1)])["input_ids"] for k in range(5)]
    resumed = D.MLMCollator(tokenizer, seed=1, max_length=24)
    resumed.batches_made = 3
    assert torch.equal(resumed(data[24:32])["input_ids"], expected[3])
    assert torch.equal(resumed(data[32:40])["input_ids"], expected[4])


def test_the_masking_is_the_library_recipe(tokenizer, blocks):
    """Over 3 000 maskable tokens: 15% masked (within 3 standard deviations), of those 80% [MASK] / 10% random / 10%
    kept (within 5 points); special tokens never masked; labels hold the original ids at masked positions only."""
    data = rows(blocks, 160)
    collate = D.MLMCollator(tokenizer, seed=0, max_length=24)
    ids = torch.tensor([r["input_ids"] for r in data])
    special = torch.tensor([r["special_tokens_mask"] for r in data]).bool()
    out = [collate(data[i : i + 32]) for i in range(0, 160, 32)]
    masked_ids, labels = torch.cat([o["input_ids"] for o in out]), torch.cat([o["labels"] for o in out])
    chosen = labels != D.IGNORE_INDEX
    n = int((~special).sum())
    rate = chosen.sum().item() / n
    assert abs(rate - 0.15) <= 3 * math.sqrt(0.15 * 0.85 / n), rate
    assert not (chosen & special).any()
    assert torch.equal(labels[chosen], ids[chosen])
    as_mask = (masked_ids[chosen] == tokenizer.mask_token_id).float().mean().item()
    kept = (masked_ids[chosen] == ids[chosen]).float().mean().item()
    assert abs(as_mask - 0.8) <= 0.05 and abs(kept - 0.1) <= 0.05, (as_mask, kept)
    assert torch.equal(masked_ids[~chosen], ids[~chosen])


def test_the_collator_draws_as_data_collator_for_language_modeling_with_the_same_generator(tokenizer, blocks):
    """One process: the draw is the library's `torch_mask_tokens` with a generator seeded from (seed, batch), on the
    special-tokens mask the data holds ([UNK] pieces, special to the tokenizer, stay maskable as in the library)."""
    data = rows(blocks, 8)
    for row in data[:2]:  # bodies of [UNK]: recomputing the mask from the ids would make them unmaskable
        row["input_ids"] = [row["input_ids"][0]] + [tokenizer.unk_token_id] * 22 + [row["input_ids"][-1]]
    ours = D.MLMCollator(tokenizer, seed=11, max_length=24)
    key = int(np.random.SeedSequence([11, 0]).generate_state(1)[0])
    library = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    library.generator = torch.Generator().manual_seed(key)
    batch = tokenizer.pad([dict(r.items()) for r in data], return_tensors="pt")
    expected_ids, expected_labels = library.torch_mask_tokens(
        batch["input_ids"].clone(), special_tokens_mask=batch["special_tokens_mask"]
    )
    got = ours(data)
    assert torch.equal(got["input_ids"], expected_ids) and torch.equal(got["labels"], expected_labels)
    assert (got["labels"][:2] == tokenizer.unk_token_id).any(), "no [UNK] was masked: the check above proves little"


# ---------------------------------------------------------------------------------------------------------------------
# TimeBudget on a fake clock: each optimizer step takes 1 s, each evaluation batch 10 s


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Ticks(TrainerCallback):
    def __init__(self, clock):
        self.clock = clock

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.now += 1.0

    def on_prediction_step(self, args, state, control, **kwargs):
        self.clock.now += 10.0


def mlm_rows(n=64, seq=8, vocab=40):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(5, vocab, (seq,), generator=g)
        labels = torch.where(torch.rand(seq, generator=g) < 0.3, ids, torch.full_like(ids, D.IGNORE_INDEX))
        labels[0] = ids[0]
        out.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels})
    return out


def budget_trainer(tmp_path, budget, clock, **kwargs):
    torch.manual_seed(0)
    config = BertImplConfig.from_preset(
        "debug", vocab_size=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=10**9,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=16,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **kwargs,
    )
    return Trainer(
        model=BertImplForMaskedLM(config),
        args=args,
        train_dataset=ListDataset(mlm_rows()),
        eval_dataset=ListDataset(mlm_rows(16)),
        callbacks=[Ticks(clock), budget],
    )


def test_the_schedule_is_laid_over_time_and_training_stops_at_the_budget(tmp_path):
    clock = FakeClock()
    budget = TimeBudget(10.0, eval_interval=4.0, clock=clock)
    trainer = budget_trainer(tmp_path, budget, clock, save_strategy="no")
    trainer.train()
    history = trainer.state.log_history
    assert trainer.state.global_step == 10 and budget.stopped_at == (10, 10.0)
    # Linear decay over the 10 s: step t (from 1) runs at the rate set when step t - 1 ended, at t - 1 seconds.
    rates = [h["learning_rate"] for h in history if "loss" in h]
    assert rates == pytest.approx([1e-2 * (1 - (t - 1) / 10) for t in range(1, 11)], abs=1e-9)
    # Evaluations at 4 s, 8 s and the end; their 10 s per batch are not training time.
    evals = [(h["step"], h["training_seconds"]) for h in history if "eval_loss" in h]
    assert evals == [(4, 4.0), (8, 8.0), (10, 10.0)]
    assert budget.elapsed() == 10.0 and clock.now - 100.0 == 10.0 + 3 * 10.0


def test_warmup_in_steps_and_as_a_share_of_the_time(tmp_path):
    for warmup, expected in ((4, [0.0, 0.25 * 0.9, 0.5 * 0.8, 0.75 * 0.7]), (0.2, [0.0, 0.5 * 0.9, 0.8, 0.7])):
        clock = FakeClock()
        trainer = budget_trainer(
            tmp_path / str(warmup), TimeBudget(10.0, clock=clock), clock, save_strategy="no", warmup_steps=warmup
        )
        trainer.train()
        rates = [h["learning_rate"] / 1e-2 for h in trainer.state.log_history if "loss" in h][:4]
        assert rates == pytest.approx(expected, abs=1e-6), warmup


def test_a_resumed_run_continues_the_clock_and_the_schedule(tmp_path):
    clock = FakeClock()
    straight = budget_trainer(tmp_path / "straight", TimeBudget(10.0, clock=clock), clock, save_strategy="no")
    straight.train()
    clock = FakeClock()
    first = budget_trainer(tmp_path / "run", TimeBudget(10.0, clock=clock), clock, save_strategy="steps", save_steps=6)
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-6"
    assert json.loads((checkpoint / STATE_FILE).read_text()) == {"training_seconds": 6.0}
    clock = FakeClock()
    second = budget_trainer(
        tmp_path / "run", TimeBudget(10.0, resume_from=str(checkpoint), clock=clock), clock, save_strategy="no"
    )
    second.train(resume_from_checkpoint=str(checkpoint))
    assert second.state.global_step == 10
    rate = [h["learning_rate"] for h in second.state.log_history if "loss" in h]
    expected = [h["learning_rate"] for h in straight.state.log_history if "loss" in h]
    assert rate[-4:] == pytest.approx(expected[-4:], abs=1e-9)
    with pytest.raises(ValueError, match="has no time_budget_state.json"):
        TimeBudget(10.0, resume_from=str(tmp_path)).on_train_begin(straight.args, straight.state, straight.control)


def test_bad_budgets_are_refused():
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="positive number of seconds"):
            TimeBudget(bad)
    with pytest.raises(ValueError, match="eval_interval"):
        TimeBudget(5.0, eval_interval=0)


# ---------------------------------------------------------------------------------------------------------------------
# The scripts


def test_pretrain_mlm_time_budget_saves_a_loadable_model_and_its_card(tmp_path):
    """A 4-second budget, evaluations every 1.2 s of training time, an evaluation batch that does not divide the
    held-out set (sparse predictions of the last batch must stay whole: the masked accuracy is the one recomputed
    from the saved model's predictions on every held-out block)."""
    from transformers import AutoModelForMaskedLM

    pretrain = pretraining
    texts = D.default_corpus_dataset()["train"]["text"]
    (tmp_path / "train.txt").write_text("\n".join(texts[:60]) + "\n", encoding="utf-8")
    (tmp_path / "valid.txt").write_text("\n".join(texts[60:75]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    metrics = pretrain.main(
        script_args(
            output_dir=out,
            train_file=tmp_path / "train.txt",
            validation_file=tmp_path / "valid.txt",
            model_size="debug",
            max_seq_length=32,
            tokenizer_vocab_size=300,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=5,
            time_budget=4 / 60,
            eval_every_minutes=1.2 / 60,
            warmup_steps="0.1",
            save_strategy="no",
        )
    )
    facts = json.loads((out / "training_facts.json").read_text())
    seconds, steps = facts["metrics"]["training_seconds"], facts["hyperparameters"]["max_steps"]
    assert (
        4.0 <= seconds < 30 and steps > 3 and facts["hyperparameters"]["time_budget_minutes"] == pytest.approx(4 / 60)
    )
    evals = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "eval_loss" in h]
    assert len(evals) >= 3 and all(a["training_seconds"] < b["training_seconds"] for a, b in zip(evals, evals[1:]))
    recomputed = recomputed_accuracies(out, tmp_path / "valid.txt", seed=5, max_seq_length=32, batch_size=5)
    assert recomputed["positions"] > 20
    assert metrics["eval_masked_accuracy"] == pytest.approx(recomputed["masked_accuracy"], abs=1e-12), recomputed
    assert "time_budget_minutes" in (out / "README.md").read_text()
    model = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)  # the plain model: full logits
    ids = torch.randint(5, 100, (2, 9))
    assert type(model).__name__ == "BertImplForMaskedLM"
    assert model(ids, labels=ids).logits.shape == (2, 9, model.config.vocab_size)


def test_pretrain_mlm_refuses_a_bad_time_budget(tmp_path, capsys):
    from hf_bert_impl import cli

    pretrain = pretraining
    for flags, message in (
        (["--time_budget", "0"], "--time_budget must be a positive number of minutes, got 0.0"),
        (["--eval_every_minutes", "1"], "--eval_every_minutes needs --time_budget"),
    ):
        with pytest.raises(cli.UsageError, match=message):
            pretrain.main(script_args(*flags, output_dir=tmp_path, model_size="debug", max_steps=1))
