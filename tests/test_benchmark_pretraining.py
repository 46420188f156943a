"""The pretraining race (scripts/benchmark_pretraining.py) on a debug-size model: both models pretrained for the
same time budget with parity checks, the opponent's recipe sweep, bf16, the fine-tuning evaluation (folds, rate
sweeps, the paired test), the ablation and its fine-tuning variants, interruption and resume, and the fortune
topic task (hf_bert_impl.data.fortunes) the race fine-tunes on. The collator and the time budget it relies on are
tested in tests/test_time_budget.py."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from hf_bert_impl import BertImplConfig, BertImplForMaskedLM
from hf_bert_impl import data as D
from hf_bert_impl.cli import UsageError

from .conftest import load_script


def _seconds_to_reach(curve: list[dict], target: float) -> float | None:
    """Training seconds at which a held-out loss curve first reaches `target`: numpy's linear interpolation between
    the evaluation before (at 0 s the loss counts as infinite: the first point itself) and the first one at or
    below."""
    for i, point in enumerate(curve):
        if point["eval_loss"] <= target:
            if i == 0:
                return point["seconds"]
            before = curve[i - 1]
            return float(
                np.interp(target, [point["eval_loss"], before["eval_loss"]], [point["seconds"], before["seconds"]])
            )
    return None


def _matthews(gold: list[int], predicted: list[int]) -> float:
    """Matthews correlation of two binary label lists from the confusion counts (0 when a margin is empty)."""
    pairs = list(zip(gold, predicted))
    tp, tn = pairs.count((1, 1)), pairs.count((0, 0))
    fp, fn = pairs.count((0, 1)), pairs.count((1, 0))
    denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denominator == 0 else (tp * tn - fp * fn) / denominator


@pytest.mark.slow
def test_the_race_script_runs_both_models_and_checks_parity(tmp_path):
    """benchmark_pretraining.py on a debug model for 2 s per run: both curves, the collator cost, and the
    step-for-step parity of ours (kernelized as pretrain_mlm.py trains it, configured as transformers' BERT, from the
    same weights) with BertForMaskedLM at 1e-5. Every verdict in the report is recomputed here from its raw numbers,
    not read from the script: parity from the two per-step loss lists, the collator ratio from its milliseconds, the
    per-seed summary from the held-out curves (its own interpolation), the fine-tuning scores from the recorded
    predictions against the task's labels, and the exit status from those."""
    race = load_script("benchmark_pretraining")
    budget, steps, tolerance, cost_limit = 2.0, 5, 1e-5, 1.5  # cost_limit: the script's documented 1.5x
    code = race.main(
        [
            "--budget",
            str(budget),
            "--evaluations",
            "2",
            "--seeds",
            "0",
            "--model_size",
            "debug",
            "--max_seq_length",
            "32",
            "--vocab_size",
            "400",
            "--parity_steps",
            str(steps),
            "--finetune_epochs",
            "0.05",
            "--finetune_tasks",
            "statement_topic",
            "--opponent",
            "mlm_probability=0.3,dropout=0",
            "--out",
            str(tmp_path / "race"),
        ]
    )
    report = json.loads((tmp_path / "race.json").read_text())
    assert (tmp_path / "race.png").stat().st_size > 10_000
    assert report["finished"] is True

    losses = report["parity"]["losses"]
    assert len(losses["ours"]) == len(losses["transformers"]) == steps
    worst = max(abs(a - b) for a, b in zip(losses["ours"], losses["transformers"]))
    print(f"parity over {steps} steps: max |loss difference| {worst:.2e}")
    assert worst <= tolerance and report["parity"]["max_abs_loss_difference"] == worst
    assert report["parity"]["passed"] is True and report["parity"]["tolerance"] == tolerance
    assert max(losses["transformers"]) - min(losses["transformers"]) > 0.01, "a flat loss curve proves little"

    cost = report["collator_cost"]
    assert cost["ours_ms"] > 0 and cost["library_ms"] > 0
    assert cost["ratio"] == pytest.approx(cost["ours_ms"] / cost["library_ms"], rel=1e-12)
    assert code == (1 if cost["ours_ms"] / cost["library_ms"] > cost_limit else 0)  # parity passed above

    ours, theirs = report["runs"]["ours"][0], report["runs"]["transformers"][0]
    for run in (ours, theirs):
        curve = run["curve"]
        assert len(curve) >= 2 and curve[-1]["seconds"] >= budget and all(math.isfinite(p["eval_loss"]) for p in curve)
        assert all(a["seconds"] < b["seconds"] and a["step"] < b["step"] for a, b in zip(curve, curve[1:]))
        assert curve[-1]["step"] == run["steps"]  # the last evaluation is at the end of training
    target = theirs["curve"][-1]["eval_loss"]
    reach = _seconds_to_reach(ours["curve"], target)
    row = report["summary"]["per_seed"][0]
    assert row["seed"] == 0 and (row["ours_steps"], row["transformers_steps"]) == (ours["steps"], theirs["steps"])
    assert (row["ours_final_loss"], row["transformers_final_loss"]) == (ours["curve"][-1]["eval_loss"], target)
    assert report["summary"]["ours_lower_final_loss_every_seed"] is (ours["curve"][-1]["eval_loss"] < target)
    assert report["summary"]["mean_final_loss"] == {"ours": ours["curve"][-1]["eval_loss"], "transformers": target}
    if reach is None:
        assert row["ours_seconds_to_transformers_final_loss"] is None and row["share_of_budget"] is None
    else:
        assert row["ours_seconds_to_transformers_final_loss"] == pytest.approx(reach, rel=1e-9)
        assert row["share_of_budget"] == pytest.approx(reach / budget, rel=1e-9)
        assert report["summary"]["worst_share_of_budget"] == pytest.approx(reach / budget, rel=1e-9)
    # the time-to-accuracy at every evaluation point of transformers' curve
    assert len(row["time_to_accuracy"]) == len(theirs["curve"])
    for point, theirs_point in zip(row["time_to_accuracy"], theirs["curve"]):
        seconds = _seconds_to_reach(ours["curve"], theirs_point["eval_loss"])
        assert (point["transformers_seconds"], point["transformers_loss"]) == (
            theirs_point["seconds"],
            theirs_point["eval_loss"],
        )
        assert point["lower_bound"] is (ours["curve"][0]["eval_loss"] <= theirs_point["eval_loss"])
        if seconds is None:
            assert point["ours_seconds"] is None and point["speedup"] is None
        else:
            assert point["ours_seconds"] == pytest.approx(seconds, rel=1e-9)
            assert point["speedup"] == pytest.approx(theirs_point["seconds"] / seconds, rel=1e-9)

    # the opponent trained with the recipe asked for, read off its collator, config and TrainingArguments
    assert report["opponent"] == {"mlm_probability": 0.3, "dropout": 0.0, "learning_rate": 1e-3}
    assert theirs["trained_with"] == {
        "mlm_probability": 0.3,
        "dropout": [0.0, 0.0],
        "learning_rate": 1e-3,
        "mixed_precision": None,
    }
    assert ours["trained_with"]["mixed_precision"] is None  # float32 unless --bf16

    gold = D.statement_topic_task(seed=0)["test"]["label"]
    assert set(report["summary"]["mean_finetune"]) == {"statement_topic"}
    for run in (ours, theirs):
        assert set(run["finetune"]) == {"statement_topic"}
        scores = run["finetune"]["statement_topic"]
        assert scores["dropout"] == [0.1, 0.1]  # both fine-tune at --finetune_dropout (the opponent pretrained at 0)
        assert len(scores["predicted"]) == scores["test_sentences"] == len(gold)
        assert set(scores["predicted"]) <= {0, 1}
        hits = sum(p == g for p, g in zip(scores["predicted"], gold))
        assert scores["accuracy"] == pytest.approx(hits / len(gold), abs=1e-12)
        assert scores["mcc"] == pytest.approx(_matthews(gold, scores["predicted"]), abs=1e-9)
    # one seed: the paired test is McNemar's on the sentences exactly one of the two models labelled right
    right = {
        name: [p == g for p, g in zip(run["finetune"]["statement_topic"]["predicted"], gold)]
        for name, run in (("ours", ours), ("transformers", theirs))
    }
    test = report["summary"]["finetune_paired_test"]["statement_topic"]
    assert (test["sentences"], test["seeds"]) == (len(gold), 1)
    assert test["ours_right_more_often"] == sum(a and not b for a, b in zip(right["ours"], right["transformers"]))
    assert test["transformers_right_more_often"] == sum(
        b and not a for a, b in zip(right["ours"], right["transformers"])
    )
    assert 0 < test["p_value"] <= 1

    # ours ran with the speed layer (the table's kernels) and sparse prediction, as pretrain_mlm.py applies them
    assert report["kernels"]["setting"] == "auto"
    facts = ours["kernels"]
    assert facts["setting"] == "auto" and facts["sparse_prediction"] is True
    assert facts["kernelized"]["unpadded_encoder_forward"] == 1 and facts["kernelized"]["attention_function"] > 0


def test_bf16_pretrains_both_models_under_autocast_and_keeps_parity_and_resume_apart(tmp_path):
    """--bf16: both models pretrain under TrainingArguments' bf16 (read off each run's Trainer arguments: ours'
    from pretrain_mlm.py's training facts), the parity check stays float32 and within its 1e-5, and a report of one
    precision is not resumed by a run of the other."""
    race = load_script("benchmark_pretraining")
    args = ["--budget", "1", "--evaluations", "1", "--seeds", "0", "--model_size", "debug", "--max_seq_length", "32"]
    args += ["--vocab_size", "400", "--finetune_tasks", "--opponent", "mlm_probability=0.3,dropout=0"]
    out = tmp_path / "bf16"
    race.main([*args, "--bf16", "--parity_steps", "3", "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["settings"]["bf16"] is True and report["finished"] is True
    for name in ("ours", "transformers"):
        assert report["runs"][name][0]["trained_with"]["mixed_precision"] == "bf16"
    assert report["parity"]["passed"] is True and report["parity"]["max_abs_loss_difference"] <= 1e-5
    with pytest.raises(UsageError, match="its bf16 is True, this run's is False"):
        race.main([*args, "--resume", str(out.with_suffix(".json")), "--out", str(tmp_path / "no")])


def test_the_paired_finetuning_test_counts_sentences_by_their_share_of_seeds_right():
    """Three seeds on 6 sentences (gold 0 1 0 1 0 1): a sentence counts for the model that labelled it right in more
    seeds; ties (0 and 2: both always right; 5: 2 of 3 each) count for neither; the p-value is the exact two-sided
    binomial test's (2 of 3: 1.0; 6 of 6 in one direction: 2 / 2^6)."""
    race = load_script("benchmark_pretraining")
    gold = np.array([0, 1, 0, 1, 0, 1])
    ours = [[0, 1, 0, 1, 1, 1], [0, 1, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]  # right on 1: 2/3, 3: 3/3, 4: 0/3, 5: 2/3
    theirs = [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 0]]  # 1: 0/3, 3: 1/3, 4: 2/3, 5: 2/3
    test = race.finetune_paired([{"predicted": p} for p in ours], [{"predicted": p} for p in theirs], gold)
    assert test == {
        "sentences": 6,
        "seeds": 3,
        "ours_right_more_often": 2,
        "transformers_right_more_often": 1,
        "p_value": pytest.approx(1.0),
    }
    # one seed: McNemar's exact test on the discordant sentences; the same predictions: nothing to test, p = 1
    one = race.finetune_paired([{"predicted": ours[0]}], [{"predicted": theirs[0]}], gold)
    assert (one["ours_right_more_often"], one["transformers_right_more_often"]) == (2, 1)
    same = race.finetune_paired([{"predicted": ours[0]}], [{"predicted": ours[0]}], gold)
    assert (same["ours_right_more_often"], same["transformers_right_more_often"], same["p_value"]) == (0, 0, 1.0)
    gold = np.array([0, 1] * 4)  # ours right on all 8, transformers' wrong on 6 of them
    lopsided = race.finetune_paired([{"predicted": gold}], [{"predicted": [1, 0, 1, 0, 1, 0, 0, 1]}], gold)
    assert (lopsided["ours_right_more_often"], lopsided["transformers_right_more_often"]) == (6, 0)
    assert lopsided["p_value"] == pytest.approx(2 / 2**6)


def test_time_to_reach_interpolates_between_evaluations():
    race = load_script("benchmark_pretraining")
    curve = [
        {"seconds": 10.0, "eval_loss": 8.0},
        {"seconds": 20.0, "eval_loss": 6.0},
        {"seconds": 30.0, "eval_loss": 5.0},
    ]
    assert race.time_to_reach(curve, 7.0) == pytest.approx(15.0)
    assert race.time_to_reach(curve, 9.0) == pytest.approx(10.0)
    assert race.time_to_reach(curve, 4.0) is None


def test_a_point_ours_beat_at_its_first_evaluation_is_a_bound_not_the_worst_speedup():
    """transformers' loss at 150 s is above ours' first evaluation (also at 150 s): ours got there at 150 s or
    sooner, so 1.0x is a lower bound; the worst speed-up after the first minute is the worst measured one."""
    race = load_script("benchmark_pretraining")
    ours = [{"seconds": t, "eval_loss": loss} for t, loss in ((150.0, 6.3), (300.0, 5.9), (450.0, 5.5))]
    theirs = [{"seconds": t, "eval_loss": loss} for t, loss in ((150.0, 6.7), (300.0, 6.1), (450.0, 6.0))]
    points = race.time_to_accuracy(ours, theirs)
    assert [p["lower_bound"] for p in points] == [True, False, False]
    assert points[0]["speedup"] == pytest.approx(1.0)  # at least
    assert points[1]["speedup"] == pytest.approx(300.0 / 225.0)  # 6.1 halfway between 6.3 (150 s) and 5.9 (300 s)
    assert points[2]["speedup"] == pytest.approx(450.0 / 262.5)
    runs = {"ours": [{"seed": 0, "curve": ours, "steps": 3}]}
    runs["transformers"] = [{"seed": 0, "curve": theirs, "steps": 2}]
    summary = race.summarize(runs, budget=450.0)
    row = summary["per_seed"][0]
    assert row["lower_bounds_past_first_minute"] == [pytest.approx(1.0)]
    assert row["worst_speedup_past_first_minute"] == summary["worst_speedup_past_first_minute"]
    assert summary["worst_speedup_past_first_minute"] == pytest.approx(300.0 / 225.0)
    # ours never reaching a point of transformers' is still the worst case (None)
    runs["ours"][0]["curve"] = [{**p, "eval_loss": p["eval_loss"] + 0.6} for p in ours]  # 6.1 at 450 s > 6.0
    assert race.summarize(runs, budget=450.0)["worst_speedup_past_first_minute"] is None


@pytest.mark.slow
def test_the_sweep_trains_transformers_under_every_recipe_and_its_best_feeds_the_race(tmp_path):
    """--sweep: transformers' BertForMaskedLM alone under each of the 8 recipes (masking 15 / 30%, dropout 0.1 / 0,
    learning rate 5e-4 / 1e-3), each read back off what trained; the best is the lowest mean held-out loss at the
    budget, recomputed here; --opponent reads it from the JSON."""
    race = load_script("benchmark_pretraining")
    out = tmp_path / "sweep"
    args = ["--sweep", "--budget", "1", "--evaluations", "1", "--seeds", "0", "--model_size", "debug"]
    assert race.main([*args, "--max_seq_length", "32", "--vocab_size", "400", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    rows = report["sweep"]["recipes"]
    combos = {(r["recipe"]["mlm_probability"], r["recipe"]["dropout"], r["recipe"]["learning_rate"]) for r in rows}
    assert combos == {(m, d, lr) for m in (0.15, 0.3) for d in (0.1, 0.0) for lr in (5e-4, 1e-3)}
    for row in rows:
        (run,) = row["runs"]
        recipe = row["recipe"]
        assert run["trained_with"] == {
            "mlm_probability": recipe["mlm_probability"],
            "dropout": [recipe["dropout"]] * 2,
            "learning_rate": recipe["learning_rate"],
            "mixed_precision": None,
        }
        assert row["mean_final_loss"] == run["curve"][-1]["eval_loss"] and math.isfinite(row["mean_final_loss"])
    best = min(rows, key=lambda row: row["runs"][0]["curve"][-1]["eval_loss"])
    assert report["sweep"]["best"] == {"recipe": best["recipe"], "mean_final_loss": best["mean_final_loss"]}
    assert race.opponent_recipe(str(out.with_suffix(".json")), 1e-3) == best["recipe"]


def test_opponent_recipes_parse_and_refuse_what_is_not_a_recipe(tmp_path):
    race = load_script("benchmark_pretraining")
    assert race.opponent_recipe("run_mlm", 7e-4) == {"mlm_probability": 0.15, "dropout": 0.1, "learning_rate": 7e-4}
    assert race.opponent_recipe("dropout=0, mlm_probability=0.4", 1e-3) == {
        "mlm_probability": 0.4,
        "dropout": 0.0,
        "learning_rate": 1e-3,
    }
    for spec, message in (
        ("masking=0.3", "'masking=0.3' is not key=value with a key in"),
        ("dropout", "'dropout' is not key=value"),
        ("dropout=none", "'none' is not a number"),
        ("mlm_probability=1.5", "out of range"),
        (str(tmp_path / "missing.json"), "is not a readable --sweep result"),
    ):
        with pytest.raises(ValueError, match=message):
            race.opponent_recipe(spec, 1e-3)
    with pytest.raises(SystemExit):  # argparse's error: the message names the option
        race.parse_args(["--opponent", "lr=1"])


def test_a_sweep_grid_narrows_the_recipes_and_refuses_what_is_not_one(capsys):
    race = load_script("benchmark_pretraining")
    assert race.parse_args(["--sweep"]).grid == race.OPPONENT_GRID and len(race.sweep_recipes()) == 8
    assert race.parse_args([]).grid is None and race.parse_args(["--ablation"]).grid is None  # none to record
    grid = race.parse_args(["--sweep", "--grid", "mlm_probability=0.3, dropout=0,learning_rate=5e-4/1e-3/5e-4"]).grid
    assert race.sweep_recipes(grid) == [
        {"mlm_probability": 0.3, "dropout": 0.0, "learning_rate": 5e-4},
        {"mlm_probability": 0.3, "dropout": 0.0, "learning_rate": 1e-3},
    ]
    assert len(race.sweep_recipes(race.sweep_grid("dropout=0"))) == 4  # masking and lr keep both values
    for spec, message in (
        ("lr=1e-3", "'lr=1e-3' is not key=v1/v2 with a key in"),
        ("dropout=0/none", "'0/none' is not numbers separated by '/'"),
        ("mlm_probability=0.3/1.2", "out of range"),
    ):
        with pytest.raises(ValueError, match=message):
            race.sweep_grid(spec)
    with pytest.raises(SystemExit):
        race.parse_args(["--sweep", "--grid", "dropout=2"])
    assert "--grid: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        race.parse_args(["--grid", "dropout=0"])
    assert "--grid is --sweep's" in capsys.readouterr().err


def test_a_bad_finetune_dropout_is_refused_with_its_value(capsys):
    race = load_script("benchmark_pretraining")
    assert race.parse_args([]).finetune_dropout == 0.1  # BERT's fine-tuning dropout, for both models
    with pytest.raises(SystemExit):
        race.parse_args(["--finetune_dropout", "1.5"])
    assert "--finetune_dropout must be a rate in [0, 1), got 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("folds, rates", [(0, None), (3, None), (0, [1e-3, 1e-5]), (3, [1e-5, 3e-3, 1e-3])])
def test_finetune_folds_score_every_sentence_once_by_a_model_that_did_not_train_on_it(
    tmp_path, monkeypatch, folds, rates
):
    """--finetune_folds K: the task's sentences (train, validation and test) are each predicted once, by the one of
    K fine-tunings whose training set left them out (read off what each Trainer trained on and predicted); the
    scores are recomputed here from the recorded predictions. 0: trained on the train split, scored on the test.
    --finetune_learning_rates: first one fine-tuning per rate, on the train split, scored on the validation split;
    the scored fine-tunings then run at the rate that scored best there, and no validation sentence is scored."""
    import datasets

    race = load_script("benchmark_pretraining")
    grid = [] if rates is None else ["--finetune_learning_rates", *map(str, rates)]
    args = race.parse_args(
        ["--finetune_folds", str(folds), "--finetune_epochs", "0.5", "--kernels", "reference", *grid]
    )
    texts = [f"sentence {i} says {'statement' if i % 3 == 0 else 'other'} number {i}" for i in range(45)]
    tokenizer = D.train_wordpiece_tokenizer(texts, vocab_size=120)
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["other", "statement"])}
    )
    rows = [{"sentence": t, "label": int(i % 3 == 0)} for i, t in enumerate(texts)]
    task = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(rows[a:b], features=features)
            for split, (a, b) in {"train": (0, 33), "validation": (33, 39), "test": (39, 45)}.items()
        }
    )
    config = BertImplConfig.from_preset("debug", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    BertImplForMaskedLM(config).save_pretrained(tmp_path / "ours")
    seen = []

    def as_set(dataset) -> set:
        return {tuple(ids) for ids in dataset["input_ids"]}

    def sentences_of(split: str) -> set:  # a split's sentences as finetune tokenizes them
        return as_set(tokenizer(list(task[split]["sentence"]), truncation=True, max_length=48))

    class RecordingTrainer(race.Trainer):
        def predict(self, test_dataset, *a, **k):
            out = super().predict(test_dataset, *a, **k)
            ran.append((self.args.learning_rate, out.predictions.argmax(-1)))
            seen.append((as_set(self.train_dataset), as_set(test_dataset)))
            return out

    ran = []  # (learning rate, predictions) of each fine-tuning, beside `seen`
    monkeypatch.setattr(race, "Trainer", RecordingTrainer)
    scores = race.finetune(args, 0, tmp_path / "ours", "ours", tokenizer, "statement_topic", task)
    every = {tuple(tokenizer(t, truncation=True, max_length=48)["input_ids"]) for t in texts}
    assert len(every) == len(texts)  # distinct sentences, so the sets below say which sentence went where
    if rates is None:
        assert scores["learning_rate"] == 3e-4 and scores["validation"] is None  # --finetune_learning_rate's
    else:  # one fine-tuning per rate: trained on the train split, scored on the validation split, in order
        tried, ran = ran[: len(rates)], ran[len(rates) :]
        assert seen[: len(rates)] == [(sentences_of("train"), sentences_of("validation"))] * len(rates)
        seen = seen[len(rates) :]
        assert [rate for rate, _ in tried] == rates
        assert scores["validation"] == [
            {"learning_rate": rate, "accuracy": pytest.approx(np.mean(p == np.array(task["validation"]["label"])))}
            for rate, p in tried
        ]
        best = max(v["accuracy"] for v in scores["validation"])
        assert scores["learning_rate"] == next(
            v["learning_rate"] for v in scores["validation"] if v["accuracy"] == best
        )  # the first of equals
        assert {rate for rate, _ in ran} == {scores["learning_rate"]}  # the scored fine-tunings ran at it
        every -= sentences_of("validation")  # never scored
        rows = rows[:33] + rows[39:]
    gold = list(task["test"]["label"]) if folds == 0 else [r["label"] for r in rows]
    assert scores["folds"] == folds and len(seen) == max(folds, 1) and scores["test_sentences"] == len(gold)
    for trained, tested in seen:
        assert trained and tested and not trained & tested
    if folds:
        assert set().union(*(tested for _, tested in seen)) == every and sum(len(t) for _, t in seen) == len(rows)
        assert all(len(trained) + len(tested) == len(rows) for trained, tested in seen)
    else:
        assert seen[0] == (sentences_of("train"), sentences_of("test"))
    race.check_folds(15, {"statement_topic": task})  # 15 of the smaller class: 15 folds can be stratified
    with pytest.raises(
        UsageError,
        match="--finetune_folds 16: task 'statement_topic' has 15 sentences of its smallest "
        "class \\('statement'\\); give at most 15 folds",
    ):
        race.check_folds(16, {"statement_topic": task})
    assert len(scores["predicted"]) == len(gold) and set(scores["predicted"]) <= {0, 1}
    assert scores["accuracy"] == pytest.approx(np.mean(np.array(scores["predicted"]) == np.array(gold)), abs=1e-12)
    assert scores["mcc"] == pytest.approx(_matthews(gold, scores["predicted"]), abs=1e-9)


def test_a_bad_finetune_folds_is_refused_with_its_value(capsys):
    race = load_script("benchmark_pretraining")
    assert race.parse_args([]).finetune_folds == 0  # the task's test split, as before the option
    for bad in ("1", "-2"):
        with pytest.raises(SystemExit):
            race.parse_args(["--finetune_folds", bad])
        assert f"--finetune_folds must be 0 (the test split) or at least 2, got {bad}" in capsys.readouterr().err


def test_a_finetuning_rate_grid_needs_two_positive_rates(capsys):
    race = load_script("benchmark_pretraining")
    assert race.parse_args([]).finetune_learning_rates is None  # --finetune_learning_rate alone, as before the option
    assert race.parse_args(["--finetune_learning_rates", "2e-4", "5e-4"]).finetune_learning_rates == [2e-4, 5e-4]
    for bad in (["3e-4"], ["3e-4", "3e-4"], ["0", "3e-4"]):
        with pytest.raises(SystemExit):
            race.parse_args(["--finetune_learning_rates", *bad])
        assert (
            f"--finetune_learning_rates takes at least two different positive rates, got {[float(r) for r in bad]}"
            in capsys.readouterr().err
        )


def test_a_finetuning_rate_sweep_picks_each_models_best_rate_and_a_race_on_other_seeds_takes_them(tmp_path, capsys):
    """--finetune_sweep: each model fine-tuned per task at every rate (entries TASK@RATE, each with its paired test);
    the summary's finetune_rates is, per model and task, the rate of the highest mean accuracy over the seeds
    (recomputed here from the predictions; the first of equals); --finetune_rates_from reads them for a race on other
    seeds, and refuses the seeds they were chosen on, a task they were not chosen for and a report of no sweep."""
    race = load_script("benchmark_pretraining")
    rates = [2e-4, 3e-4, 5e-4]
    sweep = race.parse_args(
        [
            "--finetune_sweep",
            "--finetune_learning_rates",
            *map(str, rates),
            "--finetune_folds",
            "3",
            "--finetune_tasks",
            "statement_topic",
            "fortune_topic",
            "--seeds",
            "100",
            "101",
        ]
    )
    assert (
        race.finetunings(sweep, "ours")
        == race.finetunings(sweep, "transformers")
        == {f"{task}@{rate:g}": (task, [rate]) for task in ("statement_topic", "fortune_topic") for rate in rates}
    )
    plain = race.parse_args([])
    assert race.finetunings(plain, "ours") == {task: (task, None) for task in race.FINETUNE_TASKS}

    gold = np.array([0, 1, 0, 1, 1, 0, 1, 0])
    rng = np.random.default_rng(0)

    def run(seed):
        curve = [{"seconds": 60.0, "step": 5, "eval_loss": 6.0}]
        predicted = {key: np.where(rng.random(len(gold)) < 0.7, gold, 1 - gold) for key in race.finetunings(sweep, "")}
        predicted["fortune_topic@0.0002"] = predicted["fortune_topic@0.0005"]  # a tie: the first rate is chosen
        return {
            "seed": seed,
            "curve": curve,
            "steps": 5,
            "finetune": {
                key: {
                    "accuracy": float(np.mean(p == gold)),
                    "mcc": 0.0,
                    "folds": 3,
                    "validation": None,
                    "predicted": p.tolist(),
                }
                for key, p in predicted.items()
            },
        }

    runs = {"ours": [run(100), run(101)], "transformers": [run(100), run(101)]}
    splits = {"train": {"label": gold[:4]}, "validation": {"label": gold[4:6]}, "test": {"label": gold[6:]}}
    summary = race.summarize(
        runs,
        budget=60.0,
        datasets_of=dict.fromkeys(race.finetunings(sweep, ""), splits),
        sweep=(sweep.finetune_tasks, rates),
    )
    mean = {
        name: {key: np.mean([r["finetune"][key]["accuracy"] for r in rs]) for key in rs[0]["finetune"]}
        for name, rs in runs.items()
    }
    for name in ("ours", "transformers"):
        for task in sweep.finetune_tasks:
            scores = [mean[name][f"{task}@{rate:g}"] for rate in rates]
            assert summary["finetune_rates"][name][task] == rates[scores.index(max(scores))]
    assert summary["finetune_paired_test"].keys() == summary["mean_finetune"].keys() == mean["ours"].keys()
    assert race.summarize(runs, budget=60.0)["finetune_rates"] is None  # no sweep: no picks
    partial = {
        name: [{**r, "finetune": {k: v for k, v in r["finetune"].items() if "@0.0005" not in k}} for r in rs]
        for name, rs in runs.items()
    }
    assert race.summarize(partial, budget=60.0, sweep=(sweep.finetune_tasks, rates))["finetune_rates"] is None

    report = tmp_path / "rates.json"
    report.write_text(json.dumps({"summary": summary, "runs": runs}))
    chosen = race.parse_args(["--finetune_rates_from", str(report), "--seeds", "0", "1", "2"])
    assert chosen.finetune_rates == summary["finetune_rates"]
    assert race.finetunings(chosen, "ours") == {
        task: (task, [summary["finetune_rates"]["ours"][task]]) for task in race.FINETUNE_TASKS
    }
    no_sweep = tmp_path / "race.json"
    no_sweep.write_text(json.dumps({"summary": {**summary, "finetune_rates": None}, "runs": runs}))
    for argv, message in (
        (
            ["--finetune_rates_from", str(report), "--seeds", "0", "101"],
            f"{str(report)!r} chose its rates on seeds \\[100, 101\\]: race other seeds than \\[0, 101\\]",
        ),
        (["--finetune_rates_from", str(no_sweep)], "a race without --finetune_sweep: it chose no fine-tuning rates"),
        (["--finetune_rates_from", str(tmp_path / "none.json")], "is not a readable --finetune_sweep report"),
        (
            ["--finetune_rates_from", str(report), "--finetune_learning_rates", "1e-4", "2e-4"],
            "--finetune_rates_from gives each model its rates",
        ),
        (["--finetune_sweep", "--finetune_folds", "3"], "--finetune_sweep scores every rate of"),
        (["--finetune_sweep", "--finetune_learning_rates", "1e-4", "2e-4"], "--finetune_sweep scores every rate of"),
    ):
        with pytest.raises(SystemExit):
            race.parse_args(argv)
        assert re.search(message, capsys.readouterr().err), argv
    one_task = tmp_path / "one.json"
    one_task.write_text(
        json.dumps(
            {
                "summary": {
                    **summary,
                    "finetune_rates": {name: {"statement_topic": 3e-4} for name in ("ours", "transformers")},
                },
                "runs": runs,
            }
        )
    )
    with pytest.raises(SystemExit):
        race.parse_args(["--finetune_rates_from", str(one_task), "--seeds", "0"])
    assert "chose no rate for ['fortune_topic']: it swept ['statement_topic']" in capsys.readouterr().err


@pytest.mark.slow
def test_a_finetuning_rate_sweep_runs_end_to_end_and_a_race_on_another_seed_fine_tunes_at_its_picks(
    tmp_path, monkeypatch
):
    """--finetune_sweep on a debug pair (seed 100, two rates, 2 folds): every model fine-tuned at every rate (read off
    each fine-tuning Trainer), the picks and their plot; then a race on seed 0 with --finetune_rates_from: each
    model's fine-tunings run at its own pick, read off its Trainers."""
    race = load_script("benchmark_pretraining")
    trained_at = []

    class RecordingTrainer(race.Trainer):
        def train(self, *a, **k):
            if "SequenceClassification" in type(self.model).__name__:
                trained_at.append((type(self.model).__name__.startswith("BertImpl"), self.args.learning_rate))
            return super().train(*a, **k)

    monkeypatch.setattr(race, "Trainer", RecordingTrainer)
    common = [
        "--budget",
        "1",
        "--evaluations",
        "1",
        "--model_size",
        "debug",
        "--max_seq_length",
        "32",
        "--vocab_size",
        "400",
        "--parity_steps",
        "0",
        "--finetune_epochs",
        "0.05",
        "--finetune_tasks",
        "statement_topic",
        "--finetune_folds",
        "2",
    ]
    sweep = tmp_path / "rates"
    race.main(
        [
            *common,
            "--seeds",
            "100",
            "--finetune_sweep",
            "--finetune_learning_rates",
            "1e-4",
            "1e-3",
            "--out",
            str(sweep),
        ]
    )
    report = json.loads(sweep.with_suffix(".json").read_text())
    assert trained_at == [(ours, rate) for ours in (True, False) for rate in (1e-4, 1e-3) for _fold in range(2)]
    mean = report["summary"]["mean_finetune"]
    assert set(mean) == {"statement_topic@0.0001", "statement_topic@0.001"}
    for name in ("ours", "transformers"):
        low, high = (mean[f"statement_topic@{rate}"][name]["accuracy"] for rate in ("0.0001", "0.001"))
        assert report["summary"]["finetune_rates"][name] == {"statement_topic": 1e-3 if high > low else 1e-4}
    assert (tmp_path / "rates_rates.png").stat().st_size > 10_000

    trained_at.clear()
    race.main(
        [
            *common,
            "--seeds",
            "0",
            "--finetune_rates_from",
            str(sweep.with_suffix(".json")),
            "--out",
            str(tmp_path / "race"),
        ]
    )
    picks = report["summary"]["finetune_rates"]
    assert (
        trained_at
        == [(True, picks["ours"]["statement_topic"])] * 2 + [(False, picks["transformers"]["statement_topic"])] * 2
    )
    raced = json.loads((tmp_path / "race.json").read_text())
    assert raced["settings"]["finetune_rates"] == picks and set(raced["summary"]["mean_finetune"]) == {
        "statement_topic"
    }


def _fortune_folder(folder: Path) -> Path:
    """food: 10 fortunes (one over two lines), one too short; law: 12, one of them also in food; a strfile index,
    a .u8 link and ascii-art beside them."""
    folder.mkdir()
    food = [f"A bagel number {i} is a doughnut\nwith the sin removed." for i in range(10)]
    law = [f"The law number {i} is an ass, said he." for i in range(11)] + [food[3]]
    (folder / "food").write_text("%\n".join(f"{t}\n" for t in [*food, "Too short"]))
    (folder / "law").write_text("%\n".join(f"{t}\n" for t in law))
    (folder / "food.dat").write_bytes(b"\x00\x02binary index")
    (folder / "food.u8").symlink_to("food")
    (folder / "ascii-art").write_text("  ___  ___ ___ ___\n%\n  |_|  |_| |_| |_|\n")
    return folder


def test_fortunes_read_every_topic_file_once_and_make_a_balanced_topic_task(tmp_path):
    folder = _fortune_folder(tmp_path / "fortunes")
    topics = D.fortunes(folder)
    # .dat, .u8 and ascii-art skipped; fewer than 3 words dropped; lines joined; a repeated fortune kept once
    assert topics == {
        "food": [f"A bagel number {i} is a doughnut with the sin removed." for i in range(10)],
        "law": [f"The law number {i} is an ass, said he." for i in range(11)],
    }
    task = D.fortune_topic_task(seed=0, directory=folder, topics=("food", "law"))
    assert task["train"].features["label"].names == ["food", "law"]
    assert [len(task[k]) for k in ("train", "validation", "test")] == [16, 2, 2]
    every = [row for split in task.values() for row in split]
    assert sorted(r["label"] for r in every) == [0] * 10 + [1] * 10  # balanced: the smaller topic's count
    assert len({r["sentence"] for r in every}) == 20
    for row in every:
        assert row["sentence"] in topics[("food", "law")[row["label"]]]
    with pytest.raises(UsageError, match="fortune topics \\['sports'\\] not in"):
        D.fortune_topic_task(directory=folder, topics=("food", "sports"))
    with pytest.raises(UsageError, match="no fortune files at .*apt-get install fortunes"):
        D.fortunes(tmp_path / "nowhere")


@pytest.mark.slow
def test_the_ablation_trains_ours_under_each_lever_through_pretrain_mlm_and_evaluates_at_15_percent(tmp_path):
    """--ablation: ours through pretrain_mlm.py with one option changed per variant; each change is read back off
    what trained (training_facts.json), every variant is evaluated at 15% masking, and the mean
    loss and the lowest variant are recomputed here."""
    race = load_script("benchmark_pretraining")
    out = tmp_path / "ablation"
    variants = ["defaults", "masking 15%", "dense prediction", "cosine schedule", "batch 32", "dropout 0.1"]
    args = ["--ablation", "--ablations", *variants, "--budget", "1", "--evaluations", "1", "--seeds", "0"]
    code = race.main(
        [*args, "--model_size", "debug", "--max_seq_length", "32", "--vocab_size", "400", "--out", str(out)]
    )
    assert code == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    rows = {row["variant"]: row for row in report["ablation"]["rows"]}
    assert list(rows) == variants
    trained = {name: row["runs"][0]["trained_with"] for name, row in rows.items()}
    base = trained["defaults"]
    assert base == {
        "mlm_probability": 0.3,
        "eval_mlm_probability": 0.15,
        "sparse_prediction": True,
        "train_batch_size": 16,
        "learning_rate": 1e-3,
        "warmup_steps": 0.1,
        "lr_scheduler_type": "linear",
        "dropout": [0.0, 0.0],
        "mixed_precision": None,
    }
    changed = {
        "masking 15%": {"mlm_probability": 0.15},
        "dense prediction": {"sparse_prediction": False},
        "cosine schedule": {"lr_scheduler_type": "cosine"},
        "batch 32": {"train_batch_size": 32},
        "dropout 0.1": {"dropout": [0.1, 0.1]},
    }
    for name, change in changed.items():
        assert trained[name] == {**base, **change}, name  # that one lever alone, evaluated at 15% as the rest
    for row in rows.values():
        (run,) = row["runs"]
        assert row["mean_final_loss"] == run["curve"][-1]["eval_loss"] and math.isfinite(row["mean_final_loss"])
        assert row["mean_steps"] == run["steps"] > 0
    assert report["ablation"]["best"] == min(rows, key=lambda name: rows[name]["mean_final_loss"])


@pytest.mark.slow
def test_finetune_variants_fine_tunes_every_variant_as_the_race_fine_tunes_ours_and_tests_it_against_the_defaults(
    tmp_path, monkeypatch
):
    """--ablation --finetune_variants: every variant's model on every seed fine-tuned (ours' class, the rate given,
    every fold; read off each fine-tuning Trainer); the means and the paired test against the defaults recomputed
    here from the stored predictions; an ablation report without fine-tuning is not resumed into one with it."""
    race = load_script("benchmark_pretraining")
    fine_tuned = []

    class RecordingTrainer(race.Trainer):
        def train(self, *a, **k):
            if "SequenceClassification" in type(self.model).__name__:
                fine_tuned.append((type(self.model).__name__, self.args.learning_rate))
            return super().train(*a, **k)

    monkeypatch.setattr(race, "Trainer", RecordingTrainer)
    small = ["--budget", "1", "--evaluations", "1", "--model_size", "debug", "--max_seq_length", "32"]
    small += ["--vocab_size", "400", "--ablation", "--ablations", "defaults", "masking 40%", "--seeds", "0", "1"]
    tuning = ["--finetune_variants", "--finetune_tasks", "statement_topic", "--finetune_folds", "2"]
    tuning += ["--finetune_epochs", "0.05", "--finetune_learning_rate", "1e-3"]
    out = tmp_path / "ablation"
    assert race.main([*small, *tuning, "--out", str(out)]) == 0
    assert fine_tuned == [("BertImplForSequenceClassification", 1e-3)] * 8  # 2 variants x 2 seeds x 2 folds
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["variant"]: row for row in report["ablation"]["rows"]}
    gold = race.finetune_gold(race.FINETUNE_TASKS["statement_topic"][0](), 2)
    right = {}
    for name, row in rows.items():
        results = [run["finetune"]["statement_topic"] for run in row["runs"]]
        assert [r["test_sentences"] for r in results] == [len(gold)] * 2  # every sentence, by the fold left out
        right[name] = np.mean([np.asarray(r["predicted"]) == gold for r in results], axis=0)
        assert row["mean_finetune"]["statement_topic"]["accuracy"] == pytest.approx(right[name].mean())
        assert row["mean_finetune"]["statement_topic"]["mcc"] == pytest.approx(np.mean([r["mcc"] for r in results]))
    assert "finetune_paired_test_vs_defaults" not in rows["defaults"]
    test = rows["masking 40%"]["finetune_paired_test_vs_defaults"]["statement_topic"]
    better, worse = (
        int((right["masking 40%"] > right["defaults"]).sum()),
        int((right["masking 40%"] < right["defaults"]).sum()),
    )
    assert (test["variant_right_more_often"], test["defaults_right_more_often"]) == (better, worse)
    assert test["sentences"] == len(gold) and test["seeds"] == 2 and 0 < test["p_value"] <= 1

    plain = tmp_path / "plain"
    assert race.main([*small[:-2], "0", "--ablations", "defaults", "--out", str(plain)]) == 0
    with pytest.raises(UsageError, match="its finetune_variants is False, this run's is True"):
        race.main([*small, *tuning, "--resume", str(plain.with_suffix(".json")), "--out", str(tmp_path / "no")])
    with pytest.raises(SystemExit):
        race.parse_args(["--finetune_variants"])  # a race fine-tunes both models anyway


@pytest.mark.slow
def test_an_interrupted_ablation_keeps_its_runs_and_resume_trains_only_what_is_missing(tmp_path, monkeypatch):
    """The report is written after every run ("finished": false until the last); --resume takes a variant and seed
    from earlier reports instead of training it again, and refuses a report of other settings or another kind."""
    race = load_script("benchmark_pretraining")
    small = ["--budget", "1", "--evaluations", "1", "--model_size", "debug", "--max_seq_length", "32"]
    small += ["--vocab_size", "400"]
    first = tmp_path / "first"
    args = ["--ablation", "--ablations", "defaults", "batch 32", *small]
    assert race.main([*args, "--seeds", "0", "--out", str(first)]) == 0
    earlier = json.loads(first.with_suffix(".json").read_text())
    assert earlier["finished"] is True
    real_run_ours, trained = race.run_ours, []

    def interrupted(args, seed, files, tokenizer_dir, out, options=()):
        if len(trained) == 1:
            raise KeyboardInterrupt
        trained.append((seed, tuple(options)))
        return real_run_ours(args, seed, files, tokenizer_dir, out, options)

    monkeypatch.setattr(race, "run_ours", interrupted)
    second = tmp_path / "second"
    with pytest.raises(KeyboardInterrupt):
        race.main([*args, "--seeds", "0", "1", "--resume", str(first.with_suffix(".json")), "--out", str(second)])
    assert trained == [(1, ())]  # seed 0 of both variants came from the first report; defaults seed 1 trained
    partial = json.loads(second.with_suffix(".json").read_text())
    assert partial["finished"] is False  # written before batch 32 seed 1 was interrupted
    assert [(row["variant"], [r["seed"] for r in row["runs"]]) for row in partial["ablation"]["rows"]] == [
        ("defaults", [0, 1]),
        ("batch 32", [0]),
    ]
    assert partial["ablation"]["rows"][0]["runs"][0] == earlier["ablation"]["rows"][0]["runs"][0]

    trained.clear()
    monkeypatch.setattr(race, "run_ours", lambda *a, **k: trained.append(a[1]) or real_run_ours(*a, **k))
    third = tmp_path / "third"
    resume = [str(first.with_suffix(".json")), str(second.with_suffix(".json"))]  # both hold defaults seed 0
    assert race.main([*args, "--seeds", "0", "1", "--resume", *resume, "--out", str(third)]) == 0
    assert trained == [1]  # batch 32 seed 1, the one run no report holds
    report = json.loads(third.with_suffix(".json").read_text())
    assert report["finished"] is True
    rows = {row["variant"]: row for row in report["ablation"]["rows"]}
    assert rows["defaults"]["runs"] == partial["ablation"]["rows"][0]["runs"]
    for row in rows.values():
        assert row["mean_final_loss"] == pytest.approx(np.mean([r["curve"][-1]["eval_loss"] for r in row["runs"]]))

    trained.clear()  # --resume_only: one report from others, training nothing; what none holds is left out
    merged = tmp_path / "merged"
    only = ["--resume", resume[0], str(third.with_suffix(".json")), "--resume_only", "--out", str(merged)]
    three = ["--ablations", "defaults", "batch 32", "dropout 0.1", "--seeds", "0", "1", "2"]
    assert race.main([*args, *three, *only]) == 0
    assert trained == []
    report = json.loads(merged.with_suffix(".json").read_text())
    assert report["finished"] is False  # seed 2 and dropout 0.1 are in no report
    assert [(row["variant"], [r["seed"] for r in row["runs"]]) for row in report["ablation"]["rows"]] == [
        ("defaults", [0, 1]),
        ("batch 32", [0, 1]),
    ]
    with pytest.raises(UsageError, match="hold none of these variants"):
        race.main([*args, "--ablations", "dropout 0.1", "--seeds", "0", *only])

    changed = json.loads(third.with_suffix(".json").read_text())
    changed["ablation"]["rows"][0]["runs"][0]["steps"] += 1
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    with pytest.raises(UsageError, match="defaults seed 0 differs between"):
        race.main([*args, "--seeds", "0", "--resume", resume[0], str(tmp_path / "changed.json"), "--out", str(third)])
    for extra, message in (
        (["--budget", "2"], "its budget is 1.0, this run's is 2.0"),
        (["--corpus", "stdlib_docstrings"], "its corpus"),
    ):
        with pytest.raises(UsageError, match=message):
            race.main([*args, *extra, "--seeds", "0", "--resume", resume[0], "--out", str(tmp_path / "no")])
    sweep = ["--sweep", *small, "--seeds", "0", "--resume", resume[0], "--out", str(tmp_path / "no")]
    with pytest.raises(UsageError, match="not a --sweep report"):
        race.main(sweep)
    with pytest.raises(UsageError, match="not a readable report"):
        race.main([*args, "--seeds", "0", "--resume", str(tmp_path / "missing.json"), "--out", str(tmp_path / "no")])
    with pytest.raises(SystemExit):  # argparse: --resume_only needs --resume
        race.parse_args(["--ablation", "--resume_only"])


def test_an_interrupted_race_keeps_its_runs_and_resume_trains_only_what_is_missing(tmp_path, monkeypatch):
    """The race's report is written after every run ("finished": false until the last; the summary over the seeds
    both models have) and its plot after every such seed; --resume takes a model and seed from earlier race reports
    instead of training it again, and refuses one of another opponent, other fine-tuning or another kind. The two
    trainings are replaced by synthetic curves (the race's bookkeeping is what is tested; the slow race test
    trains)."""
    race = load_script("benchmark_pretraining")
    trained = []

    def fake(name, seed, interrupt_at=None):
        if len(trained) == interrupt_at:
            raise KeyboardInterrupt
        trained.append((name, seed))
        start = 7.0 if name == "ours" else 7.5
        curve = [{"seconds": t, "step": 10 * t, "eval_loss": start - 0.1 * t - 0.01 * seed} for t in (1.0, 2.0)]
        return {"curve": curve, "steps": 20, "kernels": {}}

    def patch(interrupt_at=None):
        monkeypatch.setattr(race, "run_ours", lambda args, seed, *rest, **k: fake("ours", seed, interrupt_at))
        monkeypatch.setattr(
            race, "run_transformers", lambda args, seed, *rest: fake("transformers", seed, interrupt_at)
        )

    args = ["--budget", "2", "--evaluations", "2", "--vocab_size", "400", "--parity_steps", "0"]
    args += ["--finetune_tasks", "--opponent", "mlm_probability=0.3,dropout=0"]
    first = tmp_path / "first"
    patch(interrupt_at=2)
    with pytest.raises(KeyboardInterrupt):
        race.main([*args, "--seeds", "0", "1", "--out", str(first)])
    assert trained == [("ours", 0), ("transformers", 0)]  # seed 1 (transformers first) was interrupted
    partial = json.loads(first.with_suffix(".json").read_text())
    assert partial["finished"] is False and first.with_suffix(".png").stat().st_size > 10_000
    assert {name: [r["seed"] for r in rs] for name, rs in partial["runs"].items()} == {
        "ours": [0],
        "transformers": [0],
    }
    (row,) = partial["summary"]["per_seed"]
    assert (row["seed"], row["ours_final_loss"], row["transformers_final_loss"]) == (0, 6.8, 7.3)

    trained.clear()
    patch()
    second = tmp_path / "second"
    assert (
        race.main([*args, "--seeds", "0", "1", "--resume", str(first.with_suffix(".json")), "--out", str(second)]) == 0
    )
    assert trained == [("transformers", 1), ("ours", 1)]  # seed 0 of both came from the first report
    report = json.loads(second.with_suffix(".json").read_text())
    assert report["finished"] is True
    assert report["runs"]["ours"][0] == partial["runs"]["ours"][0]
    assert [row["seed"] for row in report["summary"]["per_seed"]] == [0, 1]
    assert report["summary"]["mean_final_loss"]["ours"] == pytest.approx(np.mean([6.8, 6.79]))

    trained.clear()  # --resume_only: one report from others, training nothing; seed 2 is in none
    merged = tmp_path / "merged"
    only = ["--resume", str(first.with_suffix(".json")), str(second.with_suffix(".json")), "--resume_only"]
    assert race.main([*args, "--seeds", "0", "1", "2", *only, "--out", str(merged)]) == 0
    assert trained == []
    report = json.loads(merged.with_suffix(".json").read_text())
    assert report["finished"] is False and [row["seed"] for row in report["summary"]["per_seed"]] == [0, 1]
    with pytest.raises(UsageError, match="hold no seed with both models"):
        race.main([*args, "--seeds", "2", *only, "--out", str(tmp_path / "no")])

    resume = ["--resume", str(second.with_suffix(".json")), "--out", str(tmp_path / "no")]
    for extra, message in (
        (["--finetune_dropout", "0"], "its finetune_dropout is 0.1, this run's is 0.0"),
        (["--opponent", "run_mlm"], "its opponent is"),
        (["--budget", "3"], "its budget is 2.0, this run's is 3.0"),
    ):
        with pytest.raises(UsageError, match=message):
            race.main([*args, *extra, "--seeds", "0", *resume])
    with pytest.raises(UsageError, match="not a --ablation report"):
        race.main(["--ablation", "--budget", "2", "--evaluations", "2", "--vocab_size", "400", *resume])
    ablation = json.loads(second.with_suffix(".json").read_text())
    ablation = {k: v for k, v in ablation.items() if k not in ("runs", "opponent")} | {"ablation": {"rows": []}}
    (tmp_path / "ablation.json").write_text(json.dumps(ablation))
    with pytest.raises(UsageError, match="not a race report"):
        race.main([*args, "--seeds", "0", "--resume", str(tmp_path / "ablation.json"), "--out", str(tmp_path / "no")])
