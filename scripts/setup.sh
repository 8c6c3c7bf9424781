#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system packages, virtual environment,
# the package itself. A second run checks and changes nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${RETINA_VENV:-$root/.venv}"

log() { printf 'setup: %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
    else log "need root to run: $*"; return 1
    fi
}

pg_initdb() {
    command -v initdb >/dev/null 2>&1 && return 0
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}

missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
pg_initdb || missing+=(postgresql)
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
# Only its promtool is used: the tests check and unit-test deploy/prometheus/.
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing system packages: ${missing[*]}"
    as_root apt-get update -qq
    # Debian's packages must not start their own etcd/PostgreSQL services:
    # this project starts private instances on free ports.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # Nor a Prometheus server of its own (it would hold port 9090, which the
    # compose cluster's Prometheus publishes).
    if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
        as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
else
    log "system packages present (etcd, postgresql, java, promtool)"
fi

python="${RETINA_PYTHON:-}"
if [ -z "$python" ]; then
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            python="$candidate"; break
        fi
    done
fi
[ -n "$python" ] || { log "Python 3.11 or newer is required"; exit 1; }

if [ ! -x "$venv/bin/python" ]; then
    log "creating virtual environment $venv"
    "$python" -m venv "$venv"
fi

# constraints.txt pins every Python package (scripts/update_constraints.sh says how to
# update it): a fresh machine installs what the last commit was tested with.
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
stamp="$venv/.retina-installed"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    log "installing the package and its dependencies (pinned by constraints.txt)"
    "$venv/bin/pip" install -q --disable-pip-version-check -c constraints.txt --upgrade pip >/dev/null
    "$venv/bin/pip" install -q --disable-pip-version-check -c constraints.txt \
        --build-constraint constraints.txt -e ".[dev,spark]"
    echo "$want" > "$stamp"
else
    log "virtual environment up to date"
fi
"$venv/bin/python" -m retina_common.codegen
