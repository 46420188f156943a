#!/usr/bin/env bash
# Creates / refreshes the project's virtual environment in .venv; safe to run any number of times.
#   TORCH_SPEC      the torch requirement installed first when torch is missing (default: torch==2.13.0,
#                   a CPU build on the project's machines). GPU users: TORCH_SPEC=torch plus, if needed,
#   TORCH_INDEX_URL an index to take it from (e.g. a CUDA wheel index).
#   VENV            where the environment lives (default: .venv in the repository root).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
py="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0} first (CPU build unless you override TORCH_SPEC/TORCH_INDEX_URL)"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" install "${TORCH_SPEC:-torch==2.13.0}" --index-url "$TORCH_INDEX_URL"
  else
    "${pip[@]}" install "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
# Reinstall the project only when its requirements changed (the stamp is pyproject.toml's hash).
stamp="$venv/.hf_bert_impl_stamp"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing hf-bert-impl and its test extra into $venv"
  "${pip[@]}" install -e "$root[test]"
  echo "$want" > "$stamp"
fi
# olah (a self-hosted Hub mirror) serves the Hub round-trip test (tests/test_hub.py). It gets its own
# venv because its dependency fastapi-utils pins psutil<6 and would downgrade the project's psutil.
olah_venv="${OLAH_VENV:-$root/.venv-olah}"
if [ ! -x "$olah_venv/bin/olah-cli" ]; then
  echo "[setup] installing olah (Hub mirror for the tests) into $olah_venv"
  "$py" -m venv "$olah_venv"
  "$olah_venv/bin/python" -m pip --disable-pip-version-check -q install "olah==0.5.4"
fi
