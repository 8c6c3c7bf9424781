#!/bin/sh
# The connector's container command (installed as retina-cdc-container).
#
# Exits 3 (a malformed event or a refusal), 5 (a replay gap) and 6 (an unsupported
# schema change) need an operator: a restart stops at the same place again, so under
# `restart: unless-stopped` they would become a crash loop. After one of them this
# script keeps the container up and idle instead: its healthcheck (the connector's
# /metrics) fails, Docker shows it unhealthy, and `docker logs` ends with the reason.
# After the fix, `docker-compose restart cdc`. Any other exit is passed on (exit 1:
# the restart policy brings the connector back and it resumes).
# SIGTERM/SIGINT are passed to the connector, so a `stop` is still a clean stop.
set -u

# Trap before starting the connector: a signal that comes before its pid is known
# is remembered and passed on right after.
stopping=""
trap 'stopping=1' TERM INT
retina-cdc "$@" &
child=$!
trap 'stopping=1; kill -TERM "$child" 2>/dev/null' TERM INT
[ -z "$stopping" ] || kill -TERM "$child" 2>/dev/null
# `wait` returns early (above 128) when a trapped signal arrives: wait again while the
# connector runs. If it ended just after such an early return, it is not reaped yet
# and one more `wait` gives its own exit code (127 when there is nothing left to reap).
while :; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break
done
if [ "$rc" -gt 128 ]; then
    wait "$child"
    again=$?
    [ "$again" -eq 127 ] || rc=$again
fi

case "$rc" in
    3|5|6)
        nap=""
        trap 'kill "$nap" 2>/dev/null; exit 0' TERM INT
        # A stop asked for while the connector was ending: honour it, do not idle.
        [ -z "$stopping" ] || exit 0
        echo "retina-cdc-container: retina-cdc exited $rc and needs an operator" \
             "(docs/operations.md, 'Processes and exit codes'); not restarting it." \
             "Fix the cause, then: docker-compose restart cdc" >&2
        while :; do
            sleep 60 </dev/null >/dev/null 2>&1 &
            nap=$!
            wait "$nap"
        done
        ;;
esac
exit "$rc"
