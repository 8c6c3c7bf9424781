#!/bin/sh
# Build the local base image retina-base:bookworm without any image registry:
# debootstrap a minimal Debian bookworm from a Debian mirror, then `docker import`.
# The compose override (deploy/docker-compose.local.yml) builds every service on it.
#
#   deploy/images/build-base.sh [--force]
#
# Environment: DEBIAN_MIRROR (default: the first deb.debian.org-style URI in
# /etc/apt/sources.list.d/debian.sources, else http://deb.debian.org/debian),
# BASE_IMAGE (default retina-base:bookworm), DOCKER (default docker).
# Needs root (debootstrap) and a running Docker daemon.
set -eu

BASE_IMAGE=${BASE_IMAGE:-retina-base:bookworm}
DOCKER=${DOCKER:-docker}
FORCE=${1:-}

if [ "$FORCE" != "--force" ] && $DOCKER image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "build-base: $BASE_IMAGE exists (pass --force to rebuild)"
    exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    echo "build-base: debootstrap is missing (apt-get install debootstrap)" >&2
    exit 1
fi

# Use the mirror apt already uses on this machine, so no other host has to be reachable.
if [ -z "${DEBIAN_MIRROR:-}" ] && [ -r /etc/apt/sources.list.d/debian.sources ]; then
    DEBIAN_MIRROR=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' \
        /etc/apt/sources.list.d/debian.sources)
fi
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

ROOT=$(mktemp -d /tmp/retina-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
echo "build-base: debootstrap bookworm from $DEBIAN_MIRROR into $ROOT"
debootstrap --variant=minbase --include=ca-certificates bookworm "$ROOT" "$DEBIAN_MIRROR"

# Same mirror inside the image (with updates and security), no recommends, no apt cache.
cat > "$ROOT/etc/apt/sources.list" <<SOURCES
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main
SOURCES
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
    > "$ROOT/etc/apt/apt.conf.d/90retina-no-recommends"
# Trust the CAs added on this host too (e.g. a TLS-intercepting egress proxy's), so
# that apt and pip inside the images reach the same mirrors as the host does.
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
    chroot "$ROOT" update-ca-certificates >/dev/null
fi
# Packages must not try to start their services at install time: there is no init here.
printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"
chmod 755 "$ROOT/usr/sbin/policy-rc.d"
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*

echo "build-base: importing as $BASE_IMAGE"
tar -C "$ROOT" --numeric-owner -c . | $DOCKER import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$BASE_IMAGE"
$DOCKER image inspect --format 'build-base: {{.Id}} {{.Size}} bytes' "$BASE_IMAGE"
