"""Masked-LM (optionally + next-sentence) pretraining of hf-bert-impl's BERT with Trainer.

Copy-paste commands (offline; with no data option the embedded corpus is used, see hf_bert_impl/data.py):

    # a tiny model on the embedded corpus, one CPU, a few minutes; the recipe's defaults: batch 16, learning rate
    # 1e-3, warm-up 10%, masking 30%, dropout off while pretraining, sparse prediction (pretraining.RECIPE_DEFAULTS)
    python scripts/pretrain_mlm.py --output_dir out/mlm-tiny --model_size tiny --max_steps 600 --max_seq_length 64 \
        --use_cpu

    # the best model 10 minutes of training can give: the schedule is laid over the time (warm-up 10% of it),
    # held-out loss every minute (evaluation time not counted); on a CPU with bfloat16 instructions (AVX512-BF16,
    # AMX) add --bf16: on an AMD EPYC Zen 4 it trained 1.28x the steps and a 0.13-0.30 lower loss (docs/training.md)
    python scripts/pretrain_mlm.py --output_dir out/mlm-10min --model_size mini --time_budget 10 \
        --eval_every_minutes 1 --use_cpu

    # your files (txt: one text per line; csv / json / jsonl / parquet: a "text" column), a BERT tokenizer
    python scripts/pretrain_mlm.py --output_dir out/mlm --train_file train.txt --validation_file dev.txt \
        --tokenizer_name bert-base-uncased --model_size small --num_train_epochs 3 --bf16

    # MLM + next-sentence prediction (BertImplForPreTraining), whole-word masking
    python scripts/pretrain_mlm.py --output_dir out/pt --nsp --whole_word_mask --max_steps 1000

    # a corpus larger than memory: streamed from local files (txt / jsonl / csv / parquet, globs allowed),
    # tokenizer trained on the first --tokenizer_train_samples texts, blocks packed as they stream in
    python scripts/pretrain_mlm.py --output_dir out/wiki --streaming --train_file 'wiki/*.txt' --max_steps 100000 \
        --validation_file dev.txt --model_size base --bf16

    # one sequence per text, several texts packed into one row without padding (DataCollatorWithFlattening)
    python scripts/pretrain_mlm.py --output_dir out/packed --train_file sentences.txt --pack_sequences --max_steps 1000

    # continue from a transformers BERT checkpoint, converted on the fly (at BERT's own rate, not the recipe's 1e-3)
    python scripts/pretrain_mlm.py --output_dir out/cont --model_name_or_path bert-base-uncased --max_steps 1000 \
        --learning_rate 1e-4

    # data-parallel over N processes (GPUs; on a CPU-only machine N gloo processes), FSDP, resume
    accelerate launch --multi_gpu --num_processes 2 scripts/pretrain_mlm.py --output_dir out/ddp --max_steps 600
    accelerate launch --use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP \
        --fsdp_transformer_layer_cls_to_wrap BertImplLayer --num_processes 2 scripts/pretrain_mlm.py \
        --output_dir out/fsdp
    # (FSDP needs GPUs: on a CPU-only machine accelerate trains with DDP instead; docs/training.md "Scaling out")
    python scripts/pretrain_mlm.py --output_dir out/mlm-tiny --max_steps 600 --resume_from_checkpoint true

    # the plain model, without the speed layer (or force kernels by name: --kernels unpadded)
    python scripts/pretrain_mlm.py --output_dir out/plain --max_steps 600 --kernels reference

Every `TrainingArguments` option works (--bf16, --gradient_checkpointing, --torch_compile, --save_steps,
--eval_strategy ...). The model trains with the package's speed layer (`hf_bert_impl.kernelize(model, --kernels)`:
the kernels of its static table for the device, training or inference, and dtype) and, by default, sparse prediction
(`config.sparse_prediction`: with labels, the MLM decoder runs on the masked positions only); the kernels it ran are
logged at the end and recorded under "kernels" in training_facts.json. The output directory is in Hub format and holds
the plain model: model.safetensors, config.json with auto_map (sparse prediction off: full logits, as transformers'
BERT gives), the code files, the tokenizer, training_facts.json, loss_curve.png and README.md (the model card); each
file of the final save is written complete under a temporary name, then moved into place. The checkpoint-N folders
saved during training (for --resume_from_checkpoint) keep the config as it trains, sparse prediction included.
"""

import sys

from hf_bert_impl.cli import run_cli
from hf_bert_impl.pretraining import main


if __name__ == "__main__":
    sys.exit(run_cli(main))
