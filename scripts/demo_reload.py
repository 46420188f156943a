"""The demo's last step, in a fresh process: load a fine-tuned directory the way a user without this
package would (`AutoModelForSequenceClassification.from_pretrained(dir, trust_remote_code=True)`, so
the model code comes from the directory's own copy), predict a labelled file and print the metrics.
It does not import hf_bert_impl.

    python scripts/demo_reload.py --model_dir outputs/demo/statement-topic \
        --data_file outputs/demo/statement_topic_test.jsonl

When the directory holds the fine-tuning run's predictions.jsonl for the same rows, the reloaded
model's predictions are compared with them row by row and a mismatch exits with status 1.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser


@dataclass
class Arguments:
    model_dir: str = field(
        metadata={"help": "A directory written by scripts/finetune.py (or any bert_impl classifier)."}
    )
    data_file: str = field(metadata={"help": "json/jsonl/csv file with the text and label columns."})
    text_column: str = field(default="sentence", metadata={"help": "Column holding the text."})
    label_column: str = field(default="label", metadata={"help": "Column holding the gold label (name or id)."})
    batch_size: int = field(default=64, metadata={"help": "Rows per forward pass."})


def main(argv=None) -> int:
    (args,) = HfArgumentParser(Arguments).parse_args_into_dataclasses(args=argv)
    model_dir, data_file = Path(args.model_dir), Path(args.data_file)
    for path, what in ((model_dir / "config.json", "--model_dir"), (data_file, "--data_file")):
        if not path.is_file():
            print(f"demo_reload.py: error: {what}: {path} does not exist", file=sys.stderr)
            return 2
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(data_file.suffix.lower())
    if kind is None:
        print(f"demo_reload.py: error: --data_file {data_file}: use a .json, .jsonl or .csv file", file=sys.stderr)
        return 2
    rows = datasets.load_dataset(kind, data_files=str(data_file), split="train")
    missing = [c for c in (args.text_column, args.label_column) if c not in rows.column_names]
    if missing:
        print(f"demo_reload.py: error: --data_file {data_file}: missing column(s) {missing}", file=sys.stderr)
        return 2

    # The directory's config.json carries auto_map, so even the tokenizer lookup asks for trust_remote_code.
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, trust_remote_code=True).eval()
    print(
        f"loaded {type(model).__name__} from {type(model).__module__} (the directory's own code), "
        f"{model.num_parameters() / 1e6:.2f}M parameters"
    )

    id2label = {int(k): v for k, v in model.config.id2label.items()}
    label2id = {v: k for k, v in id2label.items()}
    gold = [label2id[g] if isinstance(g, str) else int(g) for g in rows[args.label_column]]
    texts = rows[args.text_column]
    predicted = []
    with torch.inference_mode():
        for start in tqdm(range(0, len(texts), args.batch_size), desc="Predicting", unit="batch"):
            enc = tokenizer(texts[start : start + args.batch_size], padding=True, truncation=True, return_tensors="pt")
            predicted.extend(model(**enc).logits.argmax(-1).tolist())

    binary = set(gold) <= {0, 1}
    metrics = {
        "accuracy": accuracy_score(gold, predicted),
        "f1": f1_score(gold, predicted, average="binary" if binary else "macro", zero_division=0),
        "matthews_correlation": matthews_corrcoef(gold, predicted),
    }
    correct = sum(p == g for p, g in zip(predicted, gold))
    print(f"\nreloaded model on {len(texts)} rows of {data_file.name}: {correct}/{len(texts)} correct")
    for name, value in metrics.items():
        print(f"  {name:22s} {value:.4f}")
    for i in range(min(5, len(texts))):
        print(f"  [{id2label[predicted[i]]:>10s}] (gold {id2label[gold[i]]:>10s})  {texts[i][:90]}")

    saved = model_dir / "predictions.jsonl"
    if saved.is_file():
        before = [json.loads(line) for line in saved.read_text(encoding="utf-8").splitlines()]
        if [b.get(args.text_column) for b in before] == list(texts):
            agree = sum(id2label[p] == b["prediction"] for p, b in zip(predicted, before))
            print(f"\nagreement with the fine-tuning run's own predictions: {agree}/{len(texts)}")
            if agree != len(texts):
                print(
                    "demo_reload.py: error: the reloaded model predicts differently from the saved run",
                    file=sys.stderr,
                )
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
