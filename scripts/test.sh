#!/usr/bin/env bash
# The test suite: fast unit tests, integration tests against a real Redis, and the slow
# end-to-end runs (real processes). `scripts/test.sh -m "not slow"` for the quick subset.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh
exec .venv/bin/python -m pytest "${@:-tests}"
