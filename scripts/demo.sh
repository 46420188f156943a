#!/usr/bin/env bash
# The README's main command: the whole workflow on one CPU in a few minutes, offline.
#   bash scripts/demo.sh                 # everything below, outputs in outputs/demo/ (git-ignored)
#   DEMO_OUT=out/demo bash scripts/demo.sh
#   PRETRAIN_MINUTES=10 bash scripts/demo.sh   # a longer pretraining (better numbers, longer wait)
#   PRETRAIN_STEPS=3000 bash scripts/demo.sh   # a fixed number of steps instead: the same model on every rerun
# 1. sets up .venv (scripts/setup_env.sh; nothing to do the second time)
# 2. pretrains a tiny BERT (masked LM) for a time budget (2.5 minutes of training; the learning-rate
#    schedule is laid over the time, so the wait is the same on any CPU) on the embedded corpus, the
#    Python Language Reference text that ships with Python, with a WordPiece tokenizer trained on it
# 3. fine-tunes it on the embedded statement-topic task (does this sentence come from a section about a
#    statement, such as 'The "with" statement', or from another section? the label is read off the title)
# 4. in a fresh process that does not import hf_bert_impl, reloads the result with
#    AutoModelForSequenceClassification.from_pretrained(dir, trust_remote_code=True), predicts the
#    held-out test sentences and prints the metrics (and checks they match the fine-tuning run's own)
# Steps 2 and 3 train with the package's speed layer (hf_bert_impl.kernelize, --kernels auto: the kernels its static
# table names for a CPU, training or inference, and dtype) and save the plain model, which step 4 runs.
# Safe to run twice: each run starts its output directories afresh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_NO_ADVISORY_WARNINGS=1
py=.venv/bin/python
out="${DEMO_OUT:-outputs/demo}"
minutes="${PRETRAIN_MINUTES:-2.5}"
if [ -n "${PRETRAIN_STEPS:-}" ]; then
  length=(--max_steps "$PRETRAIN_STEPS"); what="$PRETRAIN_STEPS steps"
else
  length=(--time_budget "$minutes"); what="$minutes minutes of training"
fi
rm -rf "$out/mlm-tiny" "$out/statement-topic"
mkdir -p "$out"
start=$(date +%s)

echo "== 1/3 pretraining a tiny BERT (masked LM, $what) on the embedded corpus -> $out/mlm-tiny"
# pretrain_mlm.py's recipe (batch 16, learning rate 1e-3, warm-up 10%, masking 30%, dropout off while pretraining);
# held out at BERT's 15% masking, the usual perplexity
$py scripts/pretrain_mlm.py --output_dir "$out/mlm-tiny" --model_size tiny --tokenizer_vocab_size 4000 \
  --max_seq_length 64 "${length[@]}" \
  --eval_mlm_probability 0.15 \
  --logging_steps 25 --save_strategy no --report_to none --use_cpu --seed 42

echo "== 2/3 fine-tuning it on the embedded statement-topic task -> $out/statement-topic"
$py scripts/finetune.py --model_name_or_path "$out/mlm-tiny" --output_dir "$out/statement-topic" \
  --max_seq_length 48 --per_device_train_batch_size 32 --per_device_eval_batch_size 128 --learning_rate 5e-4 \
  --warmup_steps 10 --num_train_epochs 12 --logging_steps 5 --eval_strategy epoch --save_strategy epoch \
  --save_total_limit 1 --load_best_model_at_end --metric_for_best_model matthews_correlation \
  --report_to none --use_cpu --seed 42

echo "== 3/3 reloading in a fresh process with trust_remote_code and predicting the test split"
test_file="$out/statement_topic_test.jsonl"
$py -c "from hf_bert_impl.data import statement_topic_task as t; t()['test'].to_json('$test_file')" >/dev/null
$py scripts/demo_reload.py --model_dir "$out/statement-topic" --data_file "$test_file"

$py - "$out" "$(( $(date +%s) - start ))" <<'EOF'
import json, sys
out, seconds = sys.argv[1], int(sys.argv[2])
facts = json.load(open(f"{out}/mlm-tiny/training_facts.json"))
mlm, steps = facts["metrics"], facts["hyperparameters"]["max_steps"]
cls = json.load(open(f"{out}/statement-topic/training_facts.json"))["test_metrics"]
print(f"\n== demo done in {seconds // 60} min {seconds % 60} s")
took = f" in {mlm['training_seconds']:.0f} s" if "training_seconds" in mlm else ""
print(f"pretraining ({steps} steps{took}; held-out topics): perplexity {mlm['perplexity']:.1f} "
      f"(a model blind to context: {mlm['unigram_perplexity']:.1f}), "
      f"masked-token accuracy {mlm['eval_masked_accuracy']:.4f}")
print(f"statement topic (test split):  accuracy {cls['test_accuracy']:.4f}, F1 {cls['test_f1']:.4f}, "
      f"MCC {cls['test_matthews_correlation']:.4f}")
kernels = facts["kernels"]
ran = "; ".join(f"{mode}: {', '.join(names) or 'none'}" for mode, names in kernels["kernels"].items())
print(f"speed layer (hf_bert_impl.kernelize, --kernels {kernels['setting']}): kernels in use ({ran}), "
      f"sparse prediction {'on' if kernels['sparse_prediction'] else 'off'} while pretraining")
print(f"model cards: {out}/mlm-tiny/README.md, {out}/statement-topic/README.md; loss curves: loss_curve.png in each")
EOF
