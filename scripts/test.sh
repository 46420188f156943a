#!/usr/bin/env bash
# The README's test command: set up .venv (if needed) and run the whole suite offline.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -k parity  # extra arguments go to pytest
#   bash scripts/test.sh -m "not slow"  # a quick loop: without the end-to-end runs (marked slow)
#   TEST_PROCESSES=0 bash scripts/test.sh   # one process (pytest-xdist's -n; default 2, a test file per process)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WITH_COMPAT=1 bash "$root/scripts/setup_env.sh"  # + the transformers side installs of tests/test_compat.py
cd "$root"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -n "${TEST_PROCESSES:-2}" --dist loadfile "$@"
