#!/usr/bin/env bash
# A private Docker engine on a machine without systemd and without a reachable registry: start
# it, build the images the deployment needs, stop it and tidy up. tests/deploy/test_compose_e2e.py
# drives the same commands; by hand (as root):
#
#   deploy/local-docker.sh setup          # apt-get install docker.io iptables debootstrap docker-compose python3-pip
#   deploy/local-docker.sh start          # dockerd with its own state directory; prints DOCKER_HOST
#   export DOCKER_HOST=unix://$HOME/.cache/dapo-services/docker/docker.sock
#   deploy/local-docker.sh base-images    # stand-ins for debian:bookworm-slim, python:3.11-slim-bookworm, redis:7.4-alpine
#   deploy/local-docker.sh wheelhouse     # every wheel the CPU image installs, from this machine's pip sources
#   deploy/local-docker.sh build          # dapo-services:cpu from deploy/Dockerfile.cpu, fed by the wheelhouse
#   docker-compose --profile cpu up ...   # see deploy/README.md
#   deploy/local-docker.sh stop           # stop dockerd by its PID and undo what it changed on the host
#   deploy/local-docker.sh purge          # stop, then delete the state directory (images, volumes)
#
# Environment:
#   DAPO_DOCKER_STATE  the engine's state directory: data root, exec root, socket, pid file, log
#                      (default $XDG_CACHE_HOME/dapo-services/docker, i.e. ~/.cache/...)
#   DAPO_CACHE         where the base tarball and the wheelhouse are kept between runs
#                      (default $XDG_CACHE_HOME/dapo-services)
#   WHEELHOUSE_PYTHON  the interpreter whose pip downloads the wheelhouse: the image's Python
#                      version, Debian 12's python3 (default /usr/bin/python3)
#   DAPO_WHEELHOUSE_PORT  the port `build` serves the wheelhouse on, on docker0 (default 8741)
#
# Why stand-ins: no registry is reachable here, so `debootstrap --variant=minbase bookworm` makes
# the Debian 12 root file system, `docker import` turns it into `debian:bookworm-slim`, and the
# Dockerfiles in deploy/standins/ build `python:3.11-slim-bookworm` and `redis:7.4-alpine` from
# it. Tagged with the official names, they satisfy deploy/Dockerfile.cpu's FROM and the compose
# file's `image:` without a pull, so both stay as they are for machines with registry access.
# How the stand-ins differ from the official images is written in their Dockerfiles.
#
# Why a wheelhouse: the CPU build of torch is not on the public index (only the PyTorch CPU index,
# unreachable here, serves it), and downloading ~1 GB inside every build is slow. `wheelhouse`
# downloads every wheel the image installs with this machine's pip configuration (its local wheel
# directories and the index), once; `build` serves it over HTTP on the docker0 bridge and passes
# PIP_FIND_LINKS, PIP_TRUSTED_HOST and PIP_NO_INDEX=1 as build arguments, so pip inside the build
# installs from it alone, with the Dockerfile's own commands.
set -Eeuo pipefail
cd "$(dirname "$0")/.."

CACHE_HOME="${XDG_CACHE_HOME:-$HOME/.cache}"
STATE="${DAPO_DOCKER_STATE:-$CACHE_HOME/dapo-services/docker}"
CACHE="${DAPO_CACHE:-$CACHE_HOME/dapo-services}"
SOCKET="$STATE/docker.sock"
PIDFILE="$STATE/dockerd.pid"
BASE_TAR="$CACHE/debian-bookworm-minbase.tar"
WHEELHOUSE="$CACHE/wheelhouse-cpu"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
WHEELHOUSE_PYTHON="${WHEELHOUSE_PYTHON:-/usr/bin/python3}"
PACKAGES=(docker.io iptables debootstrap docker-compose python3-pip)
# Files and directories dockerd and its containerd create outside the state directory whatever
# their flags say: the daemon's key, plugin sockets, containerd's shim sockets.
HOST_PATHS=(/etc/docker/key.json /run/docker /run/containerd)
# The client of Debian's docker.io, matching its daemon (another `docker` may come first on PATH).
DOCKER="${DOCKER:-$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || command -v docker || echo docker)}"

say() { echo "==> $*" >&2; }
die() { echo "local-docker.sh: error: $*" >&2; exit 1; }
docker_() { DOCKER_HOST="unix://$SOCKET" "$DOCKER" "$@"; }
running_pid() {
  local pid
  [ -f "$PIDFILE" ] && pid="$(cat "$PIDFILE")" && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root (dockerd, iptables, debootstrap)"; }

cmd_setup() {
  need_root setup
  local missing=() pkg
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ "${#missing[@]}" = 0 ]; then say "installed already: ${PACKAGES[*]}"; return; fi
  command -v apt-get >/dev/null || die "no apt-get: install ${missing[*]} by other means"
  say "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

cmd_start() {
  need_root start
  command -v dockerd >/dev/null || die "no dockerd: run '$0 setup' first"
  if running_pid >/dev/null; then say "dockerd already running (pid $(running_pid))"; echo "DOCKER_HOST=unix://$SOCKET"; return; fi
  mkdir -p "$STATE"
  # What dockerd changes on the host, to put back on stop: iptables rules and chains, IP
  # forwarding, network links (docker0 and the compose networks' bridges).
  iptables-save >"$STATE/iptables.before"
  sysctl -n net.ipv4.ip_forward >"$STATE/ip_forward.before"
  ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort >"$STATE/links.before"
  local path
  for path in "${HOST_PATHS[@]}"; do [ -e "$path" ] || echo "$path"; done >"$STATE/paths.created"
  say "starting dockerd (state in $STATE)"
  setsid dockerd --data-root "$STATE/data" --exec-root "$STATE/run" --pidfile "$PIDFILE" \
    --host "unix://$SOCKET" >"$STATE/dockerd.log" 2>&1 </dev/null &
  local started=$SECONDS
  until docker_ info >/dev/null 2>&1; do
    if [ $((SECONDS - started)) -gt 60 ] || ! kill -0 $! 2>/dev/null; then
      tail -20 "$STATE/dockerd.log" >&2
      die "dockerd did not answer within 60 s (log: $STATE/dockerd.log)"
    fi
    sleep 0.5
  done
  say "dockerd ready (pid $(cat "$PIDFILE")) in $((SECONDS - started)) s"
  echo "DOCKER_HOST=unix://$SOCKET"
}

cmd_stop() {
  local pid
  if pid="$(running_pid)"; then
    say "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    local waited=0
    while kill -0 "$pid" 2>/dev/null; do
      if [ "$waited" -ge 60 ]; then say "dockerd still running after 30 s: SIGKILL"; kill -KILL "$pid"; fi
      sleep 0.5; waited=$((waited + 1))
    done
  fi
  [ -d "$STATE" ] || return 0
  # Mounts dockerd left under its state directory (overlay layers, network namespaces), deepest first.
  awk -v root="$STATE/" 'index($2, root) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r mnt; do
    umount -l "$mnt" 2>/dev/null || true
  done
  if [ -f "$STATE/links.before" ]; then
    local link
    ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort | comm -13 "$STATE/links.before" - | while read -r link; do
      case "$link" in docker0|br-*|veth*) ip link delete "$link" 2>/dev/null || true ;; esac
    done
    rm -f "$STATE/links.before"
  fi
  if [ -f "$STATE/paths.created" ]; then
    xargs -r rm -rf <"$STATE/paths.created" && rm -f "$STATE/paths.created"
  fi
  if [ -f "$STATE/iptables.before" ]; then
    iptables-restore <"$STATE/iptables.before" && rm -f "$STATE/iptables.before"
  fi
  if [ -f "$STATE/ip_forward.before" ]; then
    sysctl -q -w "net.ipv4.ip_forward=$(cat "$STATE/ip_forward.before")" && rm -f "$STATE/ip_forward.before"
  fi
  say "dockerd stopped; iptables, IP forwarding, network links and $(IFS=,; echo "${HOST_PATHS[*]}") as before it started"
}

cmd_purge() {
  cmd_stop
  say "deleting $STATE"
  rm -rf "$STATE"
}

cmd_base_images() {
  running_pid >/dev/null || die "dockerd is not running: run '$0 start' first"
  if ! docker_ image inspect debian:bookworm-slim >/dev/null 2>&1; then
    if [ ! -s "$BASE_TAR" ]; then
      command -v debootstrap >/dev/null || die "no debootstrap: run '$0 setup' first"
      local root="$CACHE/bookworm-rootfs.tmp" started=$SECONDS
      rm -rf "$root"; mkdir -p "$CACHE"
      say "debootstrap --variant=minbase bookworm (about a minute; cached in $BASE_TAR)"
      debootstrap --variant=minbase bookworm "$root" "$DEBIAN_MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
      rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
      tar -C "$root" -cf "$BASE_TAR.tmp" . && mv "$BASE_TAR.tmp" "$BASE_TAR"
      rm -rf "$root"
      say "base tarball made in $((SECONDS - started)) s"
    fi
    say "docker import $BASE_TAR as debian:bookworm-slim"
    docker_ import --change 'CMD ["bash"]' "$BASE_TAR" debian:bookworm-slim >/dev/null
  fi
  local image file
  for image in python:3.11-slim-bookworm=deploy/standins/Dockerfile.python redis:7.4-alpine=deploy/standins/Dockerfile.redis; do
    file="${image#*=}"; image="${image%%=*}"
    say "stand-in $image from $file"
    DOCKER_BUILDKIT=0 docker_ build -q -f "$file" -t "$image" deploy/standins >/dev/null
  done
}

cmd_wheelhouse() {
  local stamp image_python started=$SECONDS
  running_pid >/dev/null || die "dockerd is not running: run '$0 start' first"
  docker_ image inspect python:3.11-slim-bookworm >/dev/null 2>&1 || die "no python:3.11-slim-bookworm: run '$0 base-images' first"
  # pip evaluates environment markers (`python_full_version < "3.11.3"`) with the interpreter it
  # runs on, so the wheels are chosen by the same Python the image runs: Debian 12's python3.
  image_python="$(docker_ run --rm python:3.11-slim-bookworm python3 -c 'import platform; print(platform.python_version())')"
  [ "$("$WHEELHOUSE_PYTHON" -c 'import platform; print(platform.python_version())' 2>/dev/null)" = "$image_python" ] \
    || die "$WHEELHOUSE_PYTHON is not Python $image_python (the image's): set WHEELHOUSE_PYTHON to a $image_python interpreter with pip"
  "$WHEELHOUSE_PYTHON" -m pip --version >/dev/null 2>&1 || die "$WHEELHOUSE_PYTHON has no pip (Debian: apt-get install python3-pip)"
  # Keyed by what decides the wheel set: the interpreter and the requirements in pyproject.toml.
  stamp="$( (echo "$image_python"; "$WHEELHOUSE_PYTHON" -c "$PYPROJECT_REQUIREMENTS") | sha256sum | cut -c1-16)"
  if [ -f "$WHEELHOUSE/.complete-$stamp" ]; then say "wheelhouse up to date ($WHEELHOUSE)"; return; fi
  mkdir -p "$WHEELHOUSE"
  say "downloading the CPU image's wheels into $WHEELHOUSE (Python $image_python; log in $CACHE/wheelhouse.log)"
  # What deploy/Dockerfile.cpu installs: pip and wheel, torch (the CPU build where pip is
  # configured with it), the project's own build requirements, and `.[cpu]` with its dependencies.
  local build_requires
  mapfile -t build_requires < <("$WHEELHOUSE_PYTHON" -c "$PYPROJECT_REQUIREMENTS" build)
  "$WHEELHOUSE_PYTHON" -m pip download --disable-pip-version-check --only-binary=:all: --dest "$WHEELHOUSE" \
    pip wheel "${build_requires[@]}" "torch==$(torch_pin)" ".[cpu]" >"$CACHE/wheelhouse.log" 2>&1 \
    || { grep -v "neither a file nor a directory" "$CACHE/wheelhouse.log" | tail -20 >&2; die "pip download failed (log: $CACHE/wheelhouse.log)"; }
  compgen -G "$WHEELHOUSE/torch-$(torch_pin)+cpu-*.whl" >/dev/null \
    || die "the wheelhouse has no CPU build of torch $(torch_pin): give pip a source of it (PIP_FIND_LINKS=DIR, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)"
  rm -f "$WHEELHOUSE"/.complete-*
  touch "$WHEELHOUSE/.complete-$stamp"
  say "wheelhouse ready in $((SECONDS - started)) s: $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
}

# Prints pyproject.toml's requirements: with `build`, the build system's; else also what the CPU
# image installs (the dependencies and the `cpu` extra).
PYPROJECT_REQUIREMENTS='
import sys, tomllib
toml = tomllib.load(open("pyproject.toml", "rb"))
lists = [toml["build-system"]["requires"]]
if sys.argv[1:] != ["build"]:
    lists += [toml["project"]["dependencies"], toml["project"]["optional-dependencies"]["cpu"]]
print("\n".join(r for reqs in lists for r in reqs))
'

torch_pin() { sed -n 's/^ *"torch==\([0-9.]*\)".*/\1/p' pyproject.toml | head -1; }

cmd_build() {
  running_pid >/dev/null || die "dockerd is not running: run '$0 start' first"
  compgen -G "$WHEELHOUSE/.complete-*" >/dev/null || die "no wheelhouse: run '$0 wheelhouse' first"
  local bridge port started=$SECONDS
  bridge="$(ip -4 -o addr show docker0 | awk '{print $4}' | cut -d/ -f1)"
  [ -n "$bridge" ] || die "docker0 has no IPv4 address"
  # A fixed port: the address is part of the build arguments, which are part of the build cache's
  # key, so a new port each time would rebuild every layer.
  port="${DAPO_WHEELHOUSE_PORT:-8741}"
  # The wheelhouse over HTTP on the bridge only: build containers reach the host there.
  "$WHEELHOUSE_PYTHON" -m http.server --bind "$bridge" --directory "$WHEELHOUSE" "$port" >"$STATE/wheelhouse-http.log" 2>&1 &
  WHEEL_SERVER=$!
  trap 'kill "$WHEEL_SERVER" 2>/dev/null || true' EXIT
  local waited=0
  until "$WHEELHOUSE_PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "http://$bridge:$port/" 2>/dev/null; do
    kill -0 "$WHEEL_SERVER" 2>/dev/null \
      || die "the wheelhouse server exited (port $port taken? set DAPO_WHEELHOUSE_PORT): $(tail -2 "$STATE/wheelhouse-http.log")"
    [ "$waited" -lt 20 ] || die "the wheelhouse server does not answer on http://$bridge:$port/"
    sleep 0.5; waited=$((waited + 1))
  done
  # An answer from another process on that port would hand the build someone else's wheels.
  kill -0 "$WHEEL_SERVER" 2>/dev/null || die "port $port on $bridge is served by another process: set DAPO_WHEELHOUSE_PORT"
  say "building dapo-services:cpu (legacy builder; wheels from http://$bridge:$port/)"
  DOCKER_BUILDKIT=0 docker_ build -f deploy/Dockerfile.cpu -t dapo-services:cpu \
    --build-arg "PIP_FIND_LINKS=http://$bridge:$port/" --build-arg "PIP_TRUSTED_HOST=$bridge" --build-arg PIP_NO_INDEX=1 \
    "$@" .
  kill "$WHEEL_SERVER" 2>/dev/null || true
  trap - EXIT
  say "dapo-services:cpu built in $((SECONDS - started)) s"
}

case "${1:-}" in
  setup) cmd_setup ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  purge) cmd_purge ;;
  base-images) cmd_base_images ;;
  wheelhouse) cmd_wheelhouse ;;
  build) shift; cmd_build "$@" ;;
  -h|--help|"") awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; [ -n "${1:-}" ] ;;
  *) die "unknown command: $1 (see $0 --help)" ;;
esac
