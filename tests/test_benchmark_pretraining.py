"""The pretraining race (scripts/benchmark_pretraining.py) on a debug-size model: both models pretrained for the same
time budget, the parity check, the fine-tuning through the package's fine-tuning (test split and K folds), the
paired test, the opponent's recipe sweep, the ablation, the README's table from the published runs, and the fortune
corpus and task the race reads. The collator and the time budget it relies on are tested in tests/test_time_budget.py.
"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from sklearn.model_selection import StratifiedKFold

from hf_bert_impl import data as D
from hf_bert_impl.cli import UsageError

from .conftest import REPO_ROOT, load_script


TINY = ["--model_size", "debug", "--max_seq_length", "32", "--vocab_size", "400", "--evaluations", "2"]


def _seconds_to_reach(curve: list[dict], target: float) -> float | None:
    """Training seconds at which a held-out loss curve first reaches `target`, written out: the first evaluation at
    or below it, linearly between it and the one before (the first evaluation itself if it is the first)."""
    for i, point in enumerate(curve):
        if point["eval_loss"] <= target:
            if i == 0:
                return point["seconds"]
            before = curve[i - 1]
            share = (before["eval_loss"] - target) / (before["eval_loss"] - point["eval_loss"])
            return before["seconds"] + share * (point["seconds"] - before["seconds"])
    return None


def _matthews(gold: list[int], predicted: list[int]) -> float:
    """Matthews correlation of two binary label lists from the confusion counts (0 when a margin is empty)."""
    pairs = list(zip(gold, predicted))
    tp, tn = pairs.count((1, 1)), pairs.count((0, 0))
    fp, fn = pairs.count((0, 1)), pairs.count((1, 0))
    denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denominator == 0 else (tp * tn - fp * fn) / denominator


@pytest.mark.slow
def test_the_race_pretrains_both_models_fine_tunes_them_alike_and_checks_parity(tmp_path, capsys):
    """Two seeds of 2 s each under --bf16, fine-tuned on every sentence of the statement task by 2 folds. Every
    verdict is recomputed here from the raw numbers: parity from the two per-step loss lists (float32 whatever
    --bf16 says, to 1e-5), the speed-up from the curves (this file's own interpolation), accuracy and MCC from the
    recorded predictions against the task's labels in the folds' order, the paired test from those, and the README
    row the race prints from the report."""
    race = load_script("benchmark_pretraining")
    budget, steps = 2.0, 5
    args = ["--budget", str(budget), "--seeds", "0", "1", "--parity_steps", str(steps), "--bf16", *TINY]
    args += ["--finetune_epochs", "0.2", "--finetune_tasks", "statement_topic", "--finetune_folds", "2"]
    code = race.main([*args, "--opponent", "mlm_probability=0.3,dropout=0", "--out", str(tmp_path / "race")])
    report = json.loads((tmp_path / "race.json").read_text())
    assert (tmp_path / "race.png").stat().st_size > 10_000
    assert report["finished"] is True

    losses = report["parity"]["losses"]
    assert len(losses["ours"]) == len(losses["transformers"]) == steps
    worst = max(abs(a - b) for a, b in zip(losses["ours"], losses["transformers"]))
    assert report["parity"]["max_abs_loss_difference"] == worst and report["parity"]["passed"] is (worst <= 1e-5)
    assert code == (0 if worst <= 1e-5 else 1)
    assert worst <= 1e-5, f"ours configured as BERT left transformers' per-step loss by {worst:.2e}"
    assert max(losses["transformers"]) - min(losses["transformers"]) > 0.01, "a flat loss curve proves little"

    runs = report["runs"]
    assert [r["seed"] for r in runs["ours"]] == [r["seed"] for r in runs["transformers"]] == [0, 1]
    for run in runs["ours"] + runs["transformers"]:
        curve = run["curve"]
        assert len(curve) == 2 and curve[-1]["seconds"] >= budget and all(math.isfinite(p["eval_loss"]) for p in curve)
        assert curve[0]["step"] < curve[1]["step"] == run["steps"]
    summary = report["summary"]
    for row, ours, theirs in zip(summary["per_seed"], runs["ours"], runs["transformers"]):
        target = theirs["curve"][-1]["eval_loss"]
        reach = _seconds_to_reach(ours["curve"], target)
        assert (row["ours_final_loss"], row["transformers_final_loss"]) == (ours["curve"][-1]["eval_loss"], target)
        if reach is None:
            assert row["time_to_accuracy_speedup"] is None
        else:
            assert row["ours_seconds_to_transformers_final_loss"] == pytest.approx(reach, rel=1e-9)
            assert row["time_to_accuracy_speedup"] == pytest.approx(budget / reach, rel=1e-9)
    for name in ("ours", "transformers"):
        mean = np.mean([run["curve"][-1]["eval_loss"] for run in runs[name]])
        assert summary["mean_final_loss"][name] == pytest.approx(mean, rel=1e-12)

    # what each trained with, read off the runs: ours its defaults, transformers the recipe asked for; both in bf16
    assert runs["transformers"][0]["trained_with"] == {
        "mlm_probability": 0.3,
        "dropout": [0.0, 0.0],
        "learning_rate": 1e-3,
        "mixed_precision": "bf16",
    }
    ours_facts = runs["ours"][0]["trained_with"]
    assert (ours_facts["mlm_probability"], ours_facts["eval_mlm_probability"]) == (0.3, 0.15)
    assert ours_facts["pretraining_dropout"] == [0.0, 0.0] and ours_facts["mixed_precision"] == "bf16"
    assert ours_facts["sparse_prediction"] is True and runs["ours"][0]["kernels"]["setting"] == "auto"
    assert runs["ours"][0]["kernels"]["kernelized"]["unpadded_encoder_forward"] == 1

    # fine-tuning: every sentence once, by the fold that did not train on it, in the folds' order of the splits
    task = D.statement_topic_task(seed=0)
    gold = np.concatenate([task[split]["label"] for split in ("train", "validation", "test")])
    folds = list(StratifiedKFold(2, shuffle=True, random_state=0).split(gold, gold))
    assert sorted(np.concatenate([test for _, test in folds])) == list(range(len(gold)))
    right = {}
    for name in ("ours", "transformers"):
        right[name] = []
        for run in runs[name]:
            scores = run["finetune"]["statement_topic"]
            predicted = scores["predicted"]
            assert len(predicted) == len(gold) and set(predicted) <= {0, 1}
            assert scores["accuracy"] == pytest.approx(np.mean(np.asarray(predicted) == gold), abs=1e-12)
            assert scores["mcc"] == pytest.approx(_matthews(list(gold), predicted), abs=1e-9)
            right[name].append(np.asarray(predicted) == gold)
        mean = np.mean([run["finetune"]["statement_topic"]["accuracy"] for run in runs[name]])
        assert summary["mean_finetune"]["statement_topic"][name]["accuracy"] == pytest.approx(mean, rel=1e-12)
    shares = {name: np.mean(rights, axis=0) for name, rights in right.items()}
    test = summary["finetune_paired_test"]["statement_topic"]
    assert test["ours_right_more_often"] == int((shares["ours"] > shares["transformers"]).sum())
    assert test["transformers_right_more_often"] == int((shares["ours"] < shares["transformers"]).sum())
    assert 0 < test["p_value"] <= 1

    printed = capsys.readouterr().out
    loss = f"{summary['mean_final_loss']['ours']:.3f} / {summary['mean_final_loss']['transformers']:.3f}"
    assert "| 0.0333333 min, embedded, debug (" in printed and f"| {loss} |" in printed


def test_time_to_reach_interpolates_between_evaluations():
    race = load_script("benchmark_pretraining")
    curve = [
        {"seconds": 10.0, "eval_loss": 8.0},
        {"seconds": 20.0, "eval_loss": 6.0},
        {"seconds": 30.0, "eval_loss": 5.0},
    ]
    assert race.time_to_reach(curve, 7.0) == pytest.approx(15.0)
    assert race.time_to_reach(curve, 5.5) == pytest.approx(25.0)
    assert race.time_to_reach(curve, 9.0) == pytest.approx(10.0)  # the first evaluation already below: its time
    assert race.time_to_reach(curve, 4.0) is None


def test_the_paired_test_counts_sentences_by_their_share_of_seeds_right():
    """Three seeds on 6 sentences (gold 0 1 0 1 0 1): a sentence counts for the model that labelled it right in more
    seeds; ties (0 and 2: both always right; 5: 2 of 3 each) count for neither; the p-value is the exact two-sided
    binomial test's (2 against 1: 1.0; 6 against 0: 2 / 2^6)."""
    race = load_script("benchmark_pretraining")
    gold = np.array([0, 1, 0, 1, 0, 1])
    ours = [[0, 1, 0, 1, 1, 1], [0, 1, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]  # right on 1: 2/3, 3: 3/3, 4: 0/3, 5: 2/3
    theirs = [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 0]]  # 1: 0/3, 3: 1/3, 4: 2/3, 5: 2/3
    test = race.paired_test([{"predicted": p} for p in ours], [{"predicted": p} for p in theirs], gold)
    assert test == {"ours_right_more_often": 2, "transformers_right_more_often": 1, "p_value": pytest.approx(1.0)}
    same = race.paired_test([{"predicted": ours[0]}], [{"predicted": ours[0]}], gold)
    assert (same["ours_right_more_often"], same["transformers_right_more_often"], same["p_value"]) == (0, 0, 1.0)
    gold = np.array([0, 1] * 4)  # ours right on all 8, transformers' wrong on 6 of them
    lopsided = race.paired_test([{"predicted": gold}], [{"predicted": [1, 0, 1, 0, 1, 0, 0, 1]}], gold)
    assert (lopsided["ours_right_more_often"], lopsided["transformers_right_more_often"]) == (6, 0)
    assert lopsided["p_value"] == pytest.approx(2 / 2**6)


def test_opponent_recipes_and_sweep_grids_parse_and_refuse_what_is_not_one(tmp_path, capsys):
    race = load_script("benchmark_pretraining")
    assert race.opponent_recipe("run_mlm", 7e-4) == {"mlm_probability": 0.15, "dropout": 0.1, "learning_rate": 7e-4}
    recipe = race.opponent_recipe("dropout=0, mlm_probability=0.4", 1e-3)
    assert recipe == {"mlm_probability": 0.4, "dropout": 0.0, "learning_rate": 1e-3}
    assert len(race.recipes_of(race.parse_args(["--sweep"]).grid)) == 8
    grid = race.parse_args(["--sweep", "--grid", "mlm_probability=0.3, dropout=0,learning_rate=5e-4/1e-3/5e-4"]).grid
    assert race.recipes_of(grid) == [
        {"mlm_probability": 0.3, "dropout": 0.0, "learning_rate": 5e-4},
        {"mlm_probability": 0.3, "dropout": 0.0, "learning_rate": 1e-3},
    ]
    for spec, message in (
        ("masking=0.3", "--opponent: 'masking=0.3' is not key=value with a key in"),
        ("dropout", "'dropout' is not key=value"),
        ("dropout=none", "'none' is not numbers"),
        ("mlm_probability=1.5", "out of range"),
        ("dropout=0/0.1", "one value per key"),
        (str(tmp_path / "missing.json"), "is not a readable --sweep result"),
    ):
        with pytest.raises(ValueError, match=message):
            race.opponent_recipe(spec, 1e-3)
    for argv, message in (
        (["--opponent", "lr=1"], "--opponent: 'lr=1' is not key=value"),
        (["--sweep", "--grid", "dropout=2"], "--grid: .* out of range"),
        (["--grid", "dropout=0"], "--grid is --sweep's"),
        (["--sweep", "--ablation", "--mlm_probability 0.15"], "separate runs"),
        (["--finetune_dropout", "1.5"], r"--finetune_dropout must be a rate in \[0, 1\), got 1.5"),
        (["--finetune_folds", "1"], "--finetune_folds must be 0 .* got 1"),
        (["--finetune_learning_rate", "0"], "--finetune_learning_rate must be positive, got 0.0"),
        (["--kernels", "fast"], "--kernels: .*got 'fast'"),
    ):
        with pytest.raises(SystemExit):
            race.parse_args(argv)
        assert re.search(message, capsys.readouterr().err), argv


def test_too_many_folds_stop_the_race_before_any_training(tmp_path, monkeypatch):
    race = load_script("benchmark_pretraining")
    monkeypatch.setattr(race.RaceData, "prepare", lambda *a: pytest.fail("prepared a corpus"))
    with pytest.raises(UsageError, match="--finetune_folds 100000: task 'statement_topic' has a class of"):
        race.main(["--finetune_tasks", "statement_topic", "--finetune_folds", "100000", "--out", str(tmp_path / "r")])


@pytest.mark.slow
def test_the_sweep_trains_transformers_under_every_recipe_and_its_best_feeds_the_race(tmp_path):
    """--sweep over two recipes: each read back off what trained; the best is the lowest mean held-out loss at the
    budget, recomputed here; --opponent reads it from the JSON."""
    race = load_script("benchmark_pretraining")
    out = tmp_path / "sweep"
    grid = ["--grid", "mlm_probability=0.3,dropout=0.1/0,learning_rate=1e-3"]
    assert race.main(["--sweep", *grid, "--budget", "1", "--seeds", "0", *TINY, "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000 and report["finished"] is True
    rows = report["sweep"]["rows"]
    assert [row["recipe"]["dropout"] for row in rows] == [0.1, 0.0]
    for row in rows:
        (run,) = row["runs"]
        recipe = row["recipe"]
        assert run["trained_with"] == {**recipe, "dropout": [recipe["dropout"]] * 2, "mixed_precision": None}
        assert row["mean_final_loss"] == run["curve"][-1]["eval_loss"] and math.isfinite(row["mean_final_loss"])
    best = min(rows, key=lambda row: row["runs"][0]["curve"][-1]["eval_loss"])
    assert report["sweep"]["best"]["recipe"] == best["recipe"]
    assert race.opponent_recipe(str(out.with_suffix(".json")), 5e-4) == best["recipe"]


@pytest.mark.slow
def test_the_ablation_trains_ours_under_each_option_and_an_interrupted_run_keeps_its_runs(tmp_path, monkeypatch):
    """--ablation: ours under its defaults and under each pretraining option, each change read back off what trained
    (training_facts.json) and evaluated at 15% masking; OUT.json is written after every run, so a run stopped by
    an error keeps the runs before it ("finished": false)."""
    race = load_script("benchmark_pretraining")
    out = tmp_path / "ablation"
    options = ["--mlm_probability 0.15", "--sparse_prediction false"]
    assert race.main(["--ablation", *options, "--budget", "1", "--seeds", "0", *TINY, "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["label"]: row for row in report["ablation"]["rows"]}
    assert list(rows) == ["defaults", *options]
    trained = {label: row["runs"][0]["trained_with"] for label, row in rows.items()}
    assert trained["defaults"]["mlm_probability"] == 0.3 and trained["defaults"]["sparse_prediction"] is True
    assert trained["--mlm_probability 0.15"]["mlm_probability"] == 0.15
    assert trained["--sparse_prediction false"]["sparse_prediction"] is False
    assert {facts["eval_mlm_probability"] for facts in trained.values()} == {0.15}
    assert report["ablation"]["best"]["label"] == min(rows, key=lambda label: rows[label]["mean_final_loss"])

    calls = []

    def second_run_fails(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("stopped")
        return original(*args)

    original = race.run_ours
    monkeypatch.setattr(race, "run_ours", second_run_fails)
    with pytest.raises(RuntimeError, match="stopped"):
        race.main(["--ablation", options[0], "--budget", "1", "--seeds", "0", *TINY, "--out", str(out)])
    kept = json.loads(out.with_suffix(".json").read_text())
    assert kept["finished"] is False and [row["label"] for row in kept["ablation"]["rows"]] == ["defaults"]


def test_the_table_prints_the_readme_race_rows_from_the_published_runs(capsys):
    """`--table` over benchmarks/'s race reports prints every number of the README's race table."""
    race = load_script("benchmark_pretraining")
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Pretraining race", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows, "the README has a race table"
    assert race.main(["--table", *map(str, sorted((REPO_ROOT / "benchmarks").glob("*_pretraining_*min*.json")))]) == 0
    printed = capsys.readouterr().out.splitlines()
    for row in rows:
        budget_corpus, *figures = (cell.strip() for cell in row.strip("|").split("|"))
        budget, corpus = budget_corpus.split(" (")[0].split(", ")[:2]
        matches = [
            line for line in printed if line.startswith(f"| {budget}, {corpus} (") and all(f in line for f in figures)
        ]
        assert len(matches) == 1, (row, printed)


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
    race = load_script("benchmark_pretraining")
    folder = _fortune_folder(tmp_path / "fortunes")
    topics = race.fortunes(folder)
    # .dat, .u8 and ascii-art skipped; fewer than 3 words dropped; lines joined; a repeated fortune kept once
    assert topics == {
        "food": [f"A bagel number {i} is a doughnut with the sin removed." for i in range(10)],
        "law": [f"The law number {i} is an ass, said he." for i in range(11)],
    }
    task = race.fortune_topic_task(seed=0, directory=folder, topics=("food", "law"))
    assert task["train"].features["label"].names == ["food", "law"]
    assert [len(task[k]) for k in ("train", "validation", "test")] == [16, 2, 2]
    every = [row for split in task.values() for row in split]
    assert sorted(r["label"] for r in every) == [0] * 10 + [1] * 10  # balanced: the smaller topic's count
    assert len({r["sentence"] for r in every}) == 20
    for row in every:
        assert row["sentence"] in topics[("food", "law")[row["label"]]]
    with pytest.raises(UsageError, match="fortune topics \\['sports'\\] not in"):
        race.fortune_topic_task(directory=folder, topics=("food", "sports"))
    with pytest.raises(UsageError, match="no fortune files at .*apt-get install fortunes"):
        race.fortunes(tmp_path / "nowhere")
