#!/usr/bin/env bash
# Turn on what gVisor snapshots need from Docker 20.10 (orchestrator/backends/docker/
# snapshots.py): `"experimental": true` in /etc/docker/daemon.json (`docker checkpoint`
# exists only in experimental mode) and `"live-restore": true` (running containers survive
# an engine restart). Every other key of daemon.json is kept.
#
# dockerd reads `experimental` only when it starts (SIGHUP does not reload it), so this
# restarts the engine when it must, and only then, safely (scripts/lib/engine.sh):
#   - it refuses (exit 1) when containers are running and the running engine has no
#     live-restore: a restart would kill them;
#   - it waits for `docker info` to answer; if the new engine does not come up, it puts the
#     old daemon.json back and starts the engine again.
# Needs root. Idempotent: run it again and it changes nothing.
set -euo pipefail
SAY_AS=enable-checkpoints
# shellcheck source=lib/engine.sh
. "$(dirname "$0")/lib/engine.sh"

WANTED='{"experimental": true, "live-restore": true}'

enable_checkpoints() {
    preflight "it edits $DAEMON_JSON and restarts dockerd" || return 1
    local experimental live running
    experimental=$(docker info -f '{{.ExperimentalBuild}}')
    live=$(docker info -f '{{.LiveRestoreEnabled}}')
    if [ "$experimental" = true ] && [ "$live" = true ]; then
        say "the engine runs with experimental mode and live-restore already; nothing to restart"
        if [ "$(merge_config "$WANTED")" = yes ]; then
            say "daemon.json now says so too"
        fi
        return 0
    fi
    running=$(docker ps -q | wc -l)
    if [ "$running" -gt 0 ] && [ "$live" != true ]; then
        merge_config "$WANTED" >/dev/null
        say "refusing to restart dockerd: $running container(s) running and the running engine has no live-restore, so a restart would kill them. daemon.json now asks for it; restart dockerd when nothing runs."
        return 1
    fi
    say "restarting dockerd (experimental mode is read only at start)"
    restart_with "$WANTED" || return 1
    say "dockerd is back: experimental $(docker info -f '{{.ExperimentalBuild}}'), live-restore $(docker info -f '{{.LiveRestoreEnabled}}')"
}

enable_checkpoints "$@"
