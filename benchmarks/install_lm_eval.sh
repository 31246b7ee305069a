#!/usr/bin/env bash
# Install EleutherAI's lm-evaluation-harness into its own virtualenv, .venv-lmeval, for
# `benchmarks/lm_eval_interop.py` (a client we did not write, driving minserve serve).
#
#     bash benchmarks/install_lm_eval.sh
#
# lm-eval pulls in torch and transformers; torch is pinned to the CPU build first so that pip
# does not fetch a multi-GB CUDA one. The Hugging Face folder of the bundled model
# (.cache/smollm2-hf) is written with minserve's own venv, as for vLLM.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-lmeval"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install --upgrade pip
# torch==2.13.0 resolves to the CPU build where pip's find-links has it (here: /opt/wheels).
"$VENV/bin/pip" install "torch==2.13.0" "lm_eval[api,hf]==0.4.13"
"$VENV/bin/python" -c 'import lm_eval, torch; print("lm_eval", lm_eval.__version__, "torch", torch.__version__)'
"$ROOT/.venv/bin/python" -c 'from minserve.bench.checkpoint import hf_model_folder; print(hf_model_folder())'
