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
# Other transformers releases for tests/test_compat.py (the Hub files, and the package's scripts, conversion
# and card rendering, under 4.57.x and 5.0), only for the test suite (scripts/test.sh sets WITH_COMPAT=1;
# about 0.4 GB, once): side installs used through PYTHONPATH, next to this venv's torch (never reinstalled).
# --no-deps: their other requirements (numpy, safetensors, ...) come from the venv; each brings the
# huggingface_hub, tokenizers and datasets (Trainer imports it; with the httpx it needs) of its time, the
# versions pyproject.toml's floors name: 4.57 requires huggingface_hub<1.0 (0.36.0 here), 5.0.0 >=1.3.0.
# 4.56.2 checks the too-old-version error. A stamp (.spec) per folder makes a rerun a no-op.
if [ "${WITH_COMPAT:-0}" = 1 ]; then
  for spec in "transformers==4.57.6 huggingface_hub==0.36.0 tokenizers==0.22.1 datasets==4.4.1 httpx==0.28.1 httpcore==1.0.9" \
              "transformers==5.0.0 huggingface_hub==1.3.0 tokenizers==0.22.1 datasets==4.4.1 httpx==0.28.1 httpcore==1.0.9" \
              "transformers==4.56.2"; do
    dir="$root/.venv-compat/transformers-$(echo "$spec" | cut -d' ' -f1 | cut -d= -f3)"
    if [ "$(cat "$dir/.spec" 2>/dev/null)" != "$spec" ]; then
      echo "[setup] side install for tests/test_compat.py: $spec -> $dir"
      rm -rf "$dir"
      # shellcheck disable=SC2086  # the spec is a list of requirements
      "${pip[@]}" install --no-deps --target "$dir" $spec
      echo "$spec" > "$dir/.spec"
    fi
  done
fi
# olah (a self-hosted Hub mirror) serves the Hub round-trip test (tests/test_hub.py). It gets its own
# venv because its dependency fastapi-utils pins psutil<6 and would downgrade the project's psutil.
olah_venv="${OLAH_VENV:-$root/.venv-olah}"
if [ ! -x "$olah_venv/bin/olah-cli" ]; then
  echo "[setup] installing olah (Hub mirror for the tests) into $olah_venv"
  "$py" -m venv "$olah_venv"
  "$olah_venv/bin/python" -m pip --disable-pip-version-check -q install "olah==0.5.4"
fi
