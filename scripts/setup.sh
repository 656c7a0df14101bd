#!/usr/bin/env bash
# Create .venv with lantern and its test tools. torch is pinned to the CPU build that the
# project machines carry (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
# The browser test of `lantern serve` (tests/test_serve_browser.py) drives Debian's chromium through
# chromedriver: installed here when missing, where apt-get is available and we are root.
if { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; } \
    && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# Bytecode is compiled at install on purpose: where PYTHONDONTWRITEBYTECODE=1 (these machines, CI)
# Python never writes it later, and without it every process of the tests (torchrun ranks, CLI
# runs) compiled torch's sources again: `pip install --no-compile` saved 30 s here and cost minutes.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "lantern installed in $(pwd)/.venv"
