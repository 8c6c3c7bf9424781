#!/bin/sh
# What the containerised cluster needs on the host, installed only if missing:
# Debian's docker.io, docker-compose and debootstrap, and a running Docker daemon
# (started in the background when none answers, e.g. on a machine without systemd).
# Idempotent: a second run checks and changes nothing.
set -eu

log() { printf 'compose-prereqs: %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
    else log "need root to run: $*"; return 1
    fi
}

missing=""
# dockerd, not docker: a machine can carry a Docker client alone (a static
# binary in /usr/local/bin, say) with no engine to talk to.
command -v dockerd >/dev/null 2>&1 || missing="$missing docker.io"
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 \
    || missing="$missing docker-compose"
command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
if [ -n "$missing" ]; then
    log "installing:$missing"
    as_root apt-get update -qq
    # shellcheck disable=SC2086 # the list is meant to split
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

if docker info >/dev/null 2>&1; then
    exit 0
fi
log "no Docker daemon answers: starting dockerd (log: /var/log/retina-dockerd.log)"
as_root sh -c 'nohup dockerd >/var/log/retina-dockerd.log 2>&1 &'
waited=0
until docker info >/dev/null 2>&1; do
    waited=$((waited + 1))
    if [ "$waited" -gt 60 ]; then
        log "dockerd did not answer within 60 s; see /var/log/retina-dockerd.log"
        exit 1
    fi
    sleep 1
done
log "dockerd is up"
