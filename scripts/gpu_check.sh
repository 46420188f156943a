#!/usr/bin/env bash
# The GPU check: versions, the accelerator tests (tests/test_cuda.py) and the bf16 benchmark against
# transformers (scripts/benchmark.py, bert-base, sequence 128 and 512, batch 32), all in one JSON.
#   bash scripts/gpu_check.sh --json benchmarks/cuda_bf16_gpu_check.json        # on a GPU machine
#   bash scripts/gpu_check.sh --device cpu --json out/gpu_check_dry_run.json   # the dry run on the CPU
# PYTHON picks the interpreter (default: python); the repository goes on PYTHONPATH, so a machine with
# torch, transformers, accelerate, safetensors, tokenizers and pytest needs no install. Details in
# docs/gpu.md and scripts/gpu_check.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python}"
if ! command -v "$py" >/dev/null 2>&1; then
  echo "gpu_check.sh: error: no Python interpreter '$py' (set PYTHON=/path/to/python)" >&2
  exit 2
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false
cd "$root"
exec "$py" "$root/scripts/gpu_check.py" "$@"
