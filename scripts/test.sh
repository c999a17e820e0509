#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh machine, then runs it.
# Usage: bash scripts/test.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."

# Debian's Chromium for the real-browser tests (Playwright cannot download its own here).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "warning: could not install chromium; browser tests will fail in CI" >&2
fi

# torch 2.13.0 is the CPU build this machine type installs locally; transformers and peft
# let the tests re-derive parameter counts and saved activations.  DeepSpeed (the test extra)
# is a source package: DS_BUILD_OPS=0 keeps its install to a copy (about 10 s, no CUDA ops built).
DS_BUILD_OPS=0 python3 -m pip install -q --disable-pip-version-check -e ".[test]" "torch==2.13.0" "transformers==5.23.0" \
  "peft==0.21.2" || { echo "error: pip install failed" >&2; exit 1; }

# The widget's JavaScript toolchain, to check that the committed bundle is what js/ builds.
if command -v npm >/dev/null 2>&1; then
  (cd js && npm ci --no-audit --no-fund --silent) || echo "warning: npm ci failed; the bundle check will fail in CI" >&2
fi

python3 -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
