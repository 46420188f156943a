"""Offline `evaluate` metric modules shipped with hf-bert-impl (see bert_impl_metrics/)."""

from pathlib import Path


# evaluate.load(METRIC_PATH, config) loads the module from this directory, no Hub needed.
METRIC_PATH = str(Path(__file__).resolve().parent / "bert_impl_metrics")
