#!/usr/bin/env bash
# Creates .venv (Python 3.12) and installs megatron-muon with its test extra. Safe to re-run: it reinstalls only when
# pyproject.toml changed. PYTHON=/path/to/python3.12 picks the interpreter; PIP_CACHE_DIR is honoured.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/3.12"*/bin/python3.12)" \
                     /usr/local/bin/python3.12 /usr/bin/python3.12; do
        for exe in $candidate; do
            if [ -n "$exe" ] && "$exe" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
                echo "$exe"; return 0
            fi
        done
    done
    return 1
}

PY=$(find_python) || { echo "megatron-muon needs Python 3.12 (megatron-core 0.19 requires >= 3.12): install it or set PYTHON=/path/to/python3.12" >&2; exit 2; }
stamp=.venv/.megatron-muon-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setting up .venv with $PY (torch 2.11 + megatron-core 0.19.2; a few minutes on a fresh machine)" >&2
"$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.11 is what the GPU machines run; on CPU-only machines PyPI serves its CUDA build, which runs on CPU.
.venv/bin/python -m pip install -q "torch==2.11.0"
.venv/bin/python -m pip install -q -e ".[test]"
echo "$want" > "$stamp"
