#!/usr/bin/env bash
# Make a Docker daemon and the local stand-in base image available for the docker tests.
# Idempotent: each step is skipped when its result is already there.
#
#   .ci/docker.sh            install docker.io/debootstrap if missing, start dockerd, build the base
#
# No image registry is reachable from CI, so `FROM nvidia/cuda...` cannot be pulled; the tests
# build every Dockerfile on a Debian bookworm base made here with debootstrap (python3 3.11,
# the same as the host, so the host-prepared wheelhouse fits it). This is also a new user's path
# where no registry is reachable: `make base-local`, then `make trial-cpu LOCAL_BASE=1`.
set -euo pipefail

BASE_TAG="${CAPTURE_LOCAL_BASE:-capture-local/bookworm-python:base}"
SUITE=bookworm
LOG="${DOCKERD_LOG:-/tmp/dockerd.log}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

say() { echo "docker.sh: $*" >&2; }

# (1) tools
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# (2) daemon: reuse one that answers, otherwise start one with no bridge network
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log: $LOG)"
  # setsid: the daemon must outlive this script and the CI step that ran it
  $SUDO setsid dockerd --bridge=none --iptables=false --ip-masq=false >"$LOG" 2>&1 < /dev/null &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  if ! docker info >/dev/null 2>&1; then
    say "dockerd did not answer within 60 s; last lines of $LOG:"
    tail -n 20 "$LOG" >&2 || true
    exit 1
  fi
fi

# (3) the stand-in base image (python3 3.11 and git: the code probe reads the mounted checkout)
if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  if docker run --rm --network none "$BASE_TAG" git --version >/dev/null 2>&1; then
    say "base image $BASE_TAG present"
    exit 0
  fi
  say "base image $BASE_TAG has no git; rebuilding it"
fi
# The Debian mirror apt already uses on this machine (from its own configuration).
mirror="$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null \
  | awk -v s="$SUITE" '$2 == s {print $1; exit}')"
if [ -z "$mirror" ]; then
  $SUDO apt-get update -qq
  mirror="$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' \
    | awk -v s="$SUITE" '$2 == s {print $1; exit}')"
fi
if [ -z "$mirror" ]; then
  say "no apt source for $SUITE is configured on this machine; cannot debootstrap the base"
  exit 1
fi
root="$(mktemp -d /tmp/capture-base.XXXXXX)"
trap '$SUDO rm -rf "$root"' EXIT
say "debootstrap $SUITE from $mirror (about a minute)"
$SUDO debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,git \
  "$SUITE" "$root" "$mirror" >/tmp/capture-debootstrap.log 2>&1 || {
  say "debootstrap failed; last lines of /tmp/capture-debootstrap.log:"
  tail -n 20 /tmp/capture-debootstrap.log >&2
  exit 1
}
$SUDO rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
$SUDO tar -C "$root" -c . | docker import \
  --change 'CMD ["/bin/bash"]' \
  --change 'ENV LANG=C.UTF-8' \
  --message "debootstrap --variant=minbase $SUITE (capture CI stand-in base)" \
  - "$BASE_TAG" >/dev/null
say "built $BASE_TAG"
