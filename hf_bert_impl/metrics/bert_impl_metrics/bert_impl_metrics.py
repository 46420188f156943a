"""hf-bert-impl's offline evaluation metric, an `evaluate` module computed with scikit-learn / scipy.

Load it through `evaluate` like any Hub metric, without network access:

    import evaluate, hf_bert_impl.metrics as m
    metric = evaluate.load(m.METRIC_PATH, "classification")   # or "regression", "token_classification"
    metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])

Configurations:
    classification        accuracy, f1 (binary when the labels are {0, 1}, else macro), matthews_correlation
                          (the numbers `evaluate.load("glue", task)` reports for the classification tasks)
    regression            pearson, spearmanr, mse (GLUE's STS-B numbers, plus the mean squared error)
    token_classification  accuracy over tokens (predictions and references are lists of per-token label
                          ids; positions whose reference is -100 are skipped), and
                          - with `label_names` (id -> tag) of an IOB / IOBES tag set (every tag "O" or
                            "B-X" / "I-X" / "E-X" / "S-X" ...): precision, recall, f1 over entities, as
                            seqeval computes them (CoNLL-2003 scoring: an entity counts only when its type
                            and both boundaries match; micro average over entity types), the numbers
                            transformers' examples/pytorch/token-classification/run_ner.py reports;
                          - otherwise (POS tags, or no names): f1_macro, f1_micro over tokens.
"""

import re

import datasets
import evaluate
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef, mean_squared_error


_DESCRIPTION = "Classification, regression and token-classification metrics for hf-bert-impl, computed offline."
_CITATION = ""
_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted label ids (classification), values (regression) or lists of label ids per token.
    references: the same shape as `predictions`.
Returns: see the module docstring for each configuration.
"""
CONFIGS = ("classification", "regression", "token_classification")
# seqeval's tag shape: "O" or a prefix (IOB1/IOB2/IOE/IOBES/BILOU) and an entity type.
_IOB_TAG = re.compile(r"O|[BIESLU]-.+")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BertImplMetrics(evaluate.Metric):
    def _info(self):
        if self.config_name not in CONFIGS:
            raise ValueError(f"bert_impl_metrics: unknown configuration {self.config_name!r}; choose one of {CONFIGS}")
        if self.config_name == "regression":
            value = datasets.Value("float32")
        elif self.config_name == "token_classification":
            value = datasets.Sequence(datasets.Value("int64"))
        else:
            value = datasets.Value("int64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": value, "references": value}),
        )

    def _compute(self, predictions, references, label_names=None):
        if self.config_name == "regression":
            from scipy.stats import pearsonr, spearmanr  # the `stats` extra (scikit-learn installs it too)

            return {
                "pearson": float(pearsonr(references, predictions)[0]),
                "spearmanr": float(spearmanr(references, predictions)[0]),
                "mse": float(mean_squared_error(references, predictions)),
            }
        if self.config_name == "token_classification":
            rows = [[(p, r) for p, r in zip(ps, rs) if r != -100] for ps, rs in zip(predictions, references)]
            preds = [p for row in rows for p, _ in row]
            refs = [r for row in rows for _, r in row]
            out = {"accuracy": float(accuracy_score(refs, preds))}
            if label_names is not None and all(_IOB_TAG.fullmatch(str(n)) for n in label_names):
                from seqeval.metrics import f1_score as entity_f1
                from seqeval.metrics import precision_score, recall_score

                true = [[str(label_names[r]) for _, r in row] for row in rows]
                pred = [[str(label_names[p]) for p, _ in row] for row in rows]
                out.update(
                    {
                        "precision": float(precision_score(true, pred, zero_division=0)),
                        "recall": float(recall_score(true, pred, zero_division=0)),
                        "f1": float(entity_f1(true, pred, zero_division=0)),
                    }
                )
            else:
                out.update(
                    {
                        "f1_macro": float(f1_score(refs, preds, average="macro", zero_division=0)),
                        "f1_micro": float(f1_score(refs, preds, average="micro", zero_division=0)),
                    }
                )
            return out
        binary = set(references) <= {0, 1} and set(predictions) <= {0, 1}
        return {
            "accuracy": float(accuracy_score(references, predictions)),
            "f1": float(f1_score(references, predictions, average="binary" if binary else "macro", zero_division=0)),
            "matthews_correlation": float(matthews_corrcoef(references, predictions)),
        }
