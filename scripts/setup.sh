#!/usr/bin/env bash
# Create .venv and install onnxmerge with the extras a task needs.
#   scripts/setup.sh         runtime + export + text (the demo)
#   scripts/setup.sh test    everything the test suite needs
# torch is installed first, pinned to its CPU build: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="runtime,export,text"
[ "${1:-}" = "test" ] && extras="test"
[ "${1:-}" = "bench" ] && extras="bench"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[${extras}]"
# The Node.js client test runs the generator in onnxruntime-node; its post-install step only
# fetches GPU libraries, so it is skipped.
if [ "${1:-}" = "test" ] && command -v npm >/dev/null; then
  (cd tests/js && npm ci --ignore-scripts --no-audit --no-fund --silent)
fi
# The browser test drives Debian's chromium (Playwright's own browser download needs the network).
# Without it the test skips and says why, so a failed install does not stop the set-up.
if [ "${1:-}" = "test" ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "setup: chromium could not be installed; the browser test will skip" >&2
fi
if [ "${1:-}" = "test" ] && command -v npm >/dev/null; then
  (cd tests/web && npm ci --ignore-scripts --no-audit --no-fund --silent)
fi
# transformers.js for the browser benchmark's side-by-side part (benchmarks/web, about 0.5 GB with
# onnxruntime-node, which it never runs); without it that part says why it was left out.
if [ "${1:-}" = "bench" ] && command -v npm >/dev/null; then
  (cd benchmarks/web && npm ci --ignore-scripts --no-audit --no-fund --silent)
fi
