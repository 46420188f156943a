"""Fine-tune hf-bert-impl's BERT for sequence classification (single sentences or pairs; regression
when the label is a float) or token classification (NER / POS style) with Trainer.

Copy-paste commands (offline; with no data option an embedded task is used, see
hf_bert_impl/data.py):

    # the demo's task (statement_topic; or --embedded_task word_order) on a model from scripts/pretrain_mlm.py
    python scripts/finetune.py --model_name_or_path out/mlm-tiny --output_dir out/cls --num_train_epochs 3 \
        --per_device_train_batch_size 32 --learning_rate 5e-4 --use_cpu

    # GLUE-style files: columns sentence1/sentence2 (or question/sentence, question1/question2,
    # premise/hypothesis, sentence, text) and label (int or string classes; float = regression)
    python scripts/finetune.py --model_name_or_path out/mlm-tiny --output_dir out/mrpc \
        --train_file train.csv --validation_file dev.csv --test_file test.csv

    # a Hub dataset and metric (needs the Hub; offline the shipped metric module is used)
    python scripts/finetune.py --model_name_or_path bert-base-uncased --dataset_name nyu-mll/glue \
        --dataset_config_name mrpc --output_dir out/mrpc --bf16

    # token classification: json/jsonl rows {"tokens": [...], "ner_tags": [...]} (tags: names or ids)
    python scripts/finetune.py --model_name_or_path out/mlm-tiny --task_type token --train_file ner.jsonl \
        --output_dir out/ner

    # MNLI: validation_matched is evaluated (and drives best-model selection), validation_mismatched is
    # reported beside it; GLUE test splits carry the placeholder label -1, so they get predictions only
    python scripts/finetune.py --model_name_or_path bert-base-uncased --dataset_name nyu-mll/glue \
        --dataset_config_name mnli --output_dir out/mnli

    # token classification with sequence packing (DataCollatorWithFlattening: no padding tokens)
    python scripts/finetune.py --model_name_or_path out/mlm-tiny --task_type token --train_file ner.jsonl \
        --output_dir out/ner --pack_sequences

    # continue the latest checkpoint-* of --output_dir
    python scripts/finetune.py --model_name_or_path out/mlm-tiny --output_dir out/cls --resume_from_checkpoint true

    # early stopping (needs evaluation and best-model tracking)
    python scripts/finetune.py --model_name_or_path out/mlm-tiny --output_dir out/cls --eval_strategy epoch \
        --save_strategy epoch --load_best_model_at_end --num_train_epochs 20 --early_stopping_patience 2

`--model_name_or_path` takes our checkpoints or a transformers BERT (converted on the fly). Every
`TrainingArguments` option works (`accelerate launch --multi_gpu ...`, --bf16, --gradient_checkpointing).
The model trains and predicts with the package's speed layer (`hf_bert_impl.kernelize(model, --kernels)`: the kernels
of its static table for the device, training or inference, and dtype; `--kernels reference`: the plain model); the
kernels it ran are logged at the end and recorded under "kernels" in training_facts.json. The output directory holds
the plain model in Hub format, the tokenizer, predictions.jsonl (for the test split, else the validation split),
training_facts.json, loss_curve.png and the model card README.md.

Metrics are computed only against real labels: a split whose labels are all placeholders (-1 or None,
as in GLUE's test splits) gets predictions only, and training_facts.json / the model card say so.
Token classification reports seqeval's entity-level precision / recall / F1 (CoNLL scoring) beside
token accuracy when the tags are IOB / IOBES; other tag sets (POS) get token accuracy and F1.
"""

import sys

from hf_bert_impl.cli import run_cli
from hf_bert_impl.finetuning import main


if __name__ == "__main__":
    sys.exit(run_cli(main))
