#!/usr/bin/env bash
# A Docker engine of the project's own and the broker images the
# testcontainers suites start, on a machine with no engine and no image
# registry (docs/testing.md, "Containers").
#
#   scripts/containers.sh up      # engine (installed from Debian when missing), base and broker images
#   scripts/containers.sh env     # prints DOCKER_HOST and the image variables the suites read
#   scripts/containers.sh status
#   scripts/containers.sh down    # stops the engine this script started, and what it left behind
#
# The engine runs as root under a state directory of its own, with no
# bridge, no iptables rules, no IP forwarding or masquerading and no
# userland proxy: it never touches the machine's network setup, and
# containers use the host's network (each listens on a loopback port the
# test chose). The base image is a Debian root file system made with
# debootstrap from the mirror apt already uses; the broker images are
# built FROM it out of docker/*/Dockerfile and tagged with a hash of their
# build context, so they are built once and again only when they change.
# A machine with a registry can build the same Dockerfiles FROM
# debian:bookworm-slim (their default) and needs none of this.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE=${OJS_CONTAINERS_DIR:-/var/lib/ojs-bridge-containers}
RUN=${OJS_CONTAINERS_RUN:-/run/ojs-bridge-containers}
SOCKET="unix://$RUN/docker.sock"
BASE_IMAGE=ojs-bridge-test/debian:bookworm
SUITE=bookworm
BROKERS="rabbitmq tansu moto"

log() { printf 'containers: %s\n' "$*" >&2; }
docker_() { DOCKER_HOST="$SOCKET" docker "$@"; }
engine_up() { docker_ version >/dev/null 2>&1; }

install_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  # Compose v1 is what Debian packages; the suites validate the project's
  # docker-compose.yml with it and bring it up.
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  # Debian's docker.io brings containerd, runc and tini.
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} from Debian"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

start_engine() {
  if engine_up; then log "engine: already answering on $SOCKET"; return; fi
  mkdir -p "$STATE/data" "$RUN/exec"
  log "engine: starting (data in $STATE/data)"
  setsid dockerd \
    --host "$SOCKET" \
    --data-root "$STATE/data" \
    --exec-root "$RUN/exec" \
    --pidfile "$RUN/dockerd.pid" \
    --storage-driver overlay2 \
    --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
    --bridge=none --userland-proxy=false \
    >> "$STATE/dockerd.log" 2>&1 < /dev/null &
  local i
  for ((i = 0; i < 300; i++)); do
    engine_up && { log "engine: up (pid $(cat "$RUN/dockerd.pid"))"; return; }
    sleep 0.1
  done
  log "engine: did not answer within 30 s; its log:"
  tail -20 "$STATE/dockerd.log" >&2
  return 1
}

# The first `deb` mirror of apt's own sources (deb822 or one-line format).
apt_mirror() {
  local m
  m=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1 || true)
  if [ -z "$m" ]; then
    m=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' | grep -v security | head -1 || true)
  fi
  [ -n "$m" ] || { log "no Debian mirror in apt's sources"; return 1; }
  echo "$m"
}

build_base() {
  if docker_ image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base: $BASE_IMAGE present"
    return
  fi
  local mirror rootfs
  mirror=$(apt_mirror)
  rootfs="$STATE/rootfs"
  rm -rf "$rootfs"
  log "base: debootstrap --variant=minbase $SUITE from $mirror"
  debootstrap --variant=minbase "$SUITE" "$rootfs" "$mirror" >> "$STATE/debootstrap.log" 2>&1 \
    || { log "debootstrap failed; its log:"; tail -20 "$STATE/debootstrap.log" >&2; return 1; }
  # What apt on this machine needs to reach its mirror, and the local CAs
  # an intercepting proxy of the package registries may present.
  cp -a /etc/apt/sources.list.d/. "$rootfs/etc/apt/sources.list.d/" 2>/dev/null || true
  [ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$rootfs/etc/apt/sources.list"
  if ls /etc/apt/sources.list.d/*.sources >/dev/null 2>&1; then
    : > "$rootfs/etc/apt/sources.list"
  fi
  grep -lhs 'Acquire::' /etc/apt/apt.conf.d/* | while read -r f; do cp "$f" "$rootfs/etc/apt/apt.conf.d/"; done
  mkdir -p "$rootfs/usr/local/share/ca-certificates" "$rootfs/etc/ssl/certs"
  cp -a /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
  [ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
  rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"*
  tar -C "$rootfs" -c . | docker_ import - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  log "base: $BASE_IMAGE imported"
}

# The tag of a broker image: a hash of its build context.
image_tag() {
  (cd "$ROOT/docker/$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-12
}

image_name() { echo "ojs-bridge-test/$1:$(image_tag "$1")"; }

build_images() {
  local b name
  for b in $BROKERS; do
    name=$(image_name "$b")
    if docker_ image inspect "$name" >/dev/null 2>&1; then
      log "image: $name present"
      continue
    fi
    log "image: building $name"
    docker_ build --quiet --network host --build-arg "BASE=$BASE_IMAGE" -t "$name" "$ROOT/docker/$b" >> "$STATE/build.log" 2>&1 \
      || { log "building $name failed; the log:"; tail -30 "$STATE/build.log" >&2; return 1; }
    # Earlier builds of this image (its Dockerfile changed since) go.
    docker_ image ls --format '{{.Repository}}:{{.Tag}}' "ojs-bridge-test/$b" | grep -vx "$name" \
      | xargs -r env DOCKER_HOST="$SOCKET" docker rmi >/dev/null 2>&1 || true
  done
}

# The runtime stage of the project's own Dockerfile on the local base: the
# image the container tests add the binary cargo built to. That stage copies
# nothing from the build context, so an empty one is sent.
runtime_image() { echo "ojs-bridge-test/runtime:$(sha256sum "$ROOT/Dockerfile" | cut -c1-12)"; }

build_runtime() {
  local name context
  name=$(runtime_image)
  if docker_ image inspect "$name" >/dev/null 2>&1; then
    log "image: $name present"
    return
  fi
  log "image: building $name (the Dockerfile's runtime stage)"
  context="$STATE/empty-context"
  mkdir -p "$context"
  docker_ build --quiet --network host --target runtime --build-arg "BASE=$BASE_IMAGE" \
    -f "$ROOT/Dockerfile" -t "$name" "$context" >> "$STATE/build.log" 2>&1 \
    || { log "building $name failed; the log:"; tail -30 "$STATE/build.log" >&2; return 1; }
  docker_ image ls --format '{{.Repository}}:{{.Tag}}' ojs-bridge-test/runtime | grep -vx "$name" \
    | xargs -r env DOCKER_HOST="$SOCKET" docker rmi >/dev/null 2>&1 || true
}

print_env() {
  echo "export DOCKER_HOST=$SOCKET"
  echo "export OJS_BRIDGE_TEST_RABBITMQ_IMAGE=$(image_name rabbitmq)"
  echo "export OJS_BRIDGE_TEST_KAFKA_IMAGE=$(image_name tansu)"
  echo "export OJS_BRIDGE_TEST_SQS_IMAGE=$(image_name moto)"
  echo "export OJS_BRIDGE_TEST_RUNTIME_IMAGE=$(runtime_image)"
  # moto takes any credentials; the AWS SDK wants some.
  echo 'export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-test}'
  echo 'export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-test}'
  echo 'export AWS_REGION=${AWS_REGION:-us-east-1}'
}

status() {
  if engine_up; then
    log "engine: up on $SOCKET"
    docker_ image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^ojs-bridge-test/' >&2 || true
    docker_ ps --format '{{.ID}} {{.Image}} {{.Status}}' >&2
  else
    log "engine: not running"
  fi
}

down() {
  if engine_up; then
    local ids
    ids=$(docker_ ps -aq)
    [ -z "$ids" ] || docker_ rm -f $ids >/dev/null 2>&1 || true
  fi
  if [ -f "$RUN/dockerd.pid" ]; then
    local pid i
    pid=$(cat "$RUN/dockerd.pid")
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 200; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    log "engine: stopped (pid $pid)"
  fi
  # What an engine that died may leave mounted under its own directories
  # (never anything else).
  grep -E " ($STATE|$RUN)/" /proc/mounts | awk '{print $2}' | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
  rm -rf "$RUN"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up)
    install_packages
    start_engine
    build_base
    build_images
    build_runtime
    ;;
  env) print_env ;;
  status) status ;;
  down) down ;;
  *)
    echo "usage: $0 up|env|status|down" >&2
    exit 2
    ;;
esac
