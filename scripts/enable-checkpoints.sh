#!/usr/bin/env bash
# Turn on what gVisor snapshots need from Docker 20.10 (orchestrator/backends/docker/
# snapshots.py): `"experimental": true` in /etc/docker/daemon.json (`docker checkpoint`
# exists only in experimental mode) and `"live-restore": true` (running containers survive
# an engine restart). Every other key of daemon.json is kept.
#
# dockerd reads `experimental` only when it starts (SIGHUP does not reload it), so this
# restarts the engine when it must, and only then, safely:
#   - it refuses (exit 1) when containers are running and the running engine has no
#     live-restore: a restart would kill them;
#   - it restarts dockerd the way this machine runs it (no service manager): /usr/sbin/dockerd
#     without arguments, in its own session (setsid), output to /var/log/dockerd.log, from
#     the root memory cgroup (so the engine is not charged to, or killed with, this shell's);
#   - it waits for `docker info` to answer; if the new engine does not come up, it puts the
#     old daemon.json back and starts the engine again.
# Needs root. Idempotent: run it again and it changes nothing.
set -euo pipefail

DAEMON_JSON=${DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}
DOCKERD=${DOCKERD:-/usr/sbin/dockerd}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dockerd.log}
DOCKER_PID_FILE=${DOCKER_PID_FILE:-/var/run/docker.pid}
#: How long an engine may take to stop, and to answer once started (seconds).
ENGINE_WAIT=${ENGINE_WAIT:-60}

say() { echo "enable-checkpoints: $*" >&2; }

# Merge the two keys into daemon.json; prints "yes" when the file changed, "no" otherwise.
merge_config() {
    python3 -c '
import json, os, sys
path = sys.argv[1]
config = {}
if os.path.exists(path):
    with open(path) as f:
        text = f.read().strip()
    config = json.loads(text) if text else {}
wanted = {"experimental": True, "live-restore": True}
if all(config.get(k) == v for k, v in wanted.items()):
    print("no")
    sys.exit(0)
config.update(wanted)
os.makedirs(os.path.dirname(path), exist_ok=True)
tmp = path + ".orchestrator-tmp"
with open(tmp, "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
os.replace(tmp, path)
print("yes")
' "$DAEMON_JSON"
}

engine_answers() { docker info >/dev/null 2>&1; }

wait_for_engine() {
    local waited=0
    until engine_answers; do
        if [ "$waited" -ge "$((ENGINE_WAIT * 10))" ]; then
            return 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

stop_engine() {
    local pid
    pid=$(cat "$DOCKER_PID_FILE" 2>/dev/null || true)
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
        return 0
    fi
    kill -TERM "$pid"
    local waited=0
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$waited" -ge "$((ENGINE_WAIT * 10))" ]; then
            say "dockerd (pid $pid) did not stop within ${ENGINE_WAIT} s"
            return 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

start_engine() {
    (
        # The engine leaves this shell's memory cgroup for the root one, where it ran ($$
        # would be the script's own shell; this subshell alone moves, and dockerd with it).
        if [ -w /sys/fs/cgroup/memory/cgroup.procs ]; then
            echo "$BASHPID" > /sys/fs/cgroup/memory/cgroup.procs
        fi
        setsid "$DOCKERD" >>"$DOCKERD_LOG" 2>&1 < /dev/null &
    )
    wait_for_engine
}

enable_checkpoints() {
    if [ "$(id -u)" != 0 ]; then
        say "needs root (it edits $DAEMON_JSON and restarts dockerd)"
        return 1
    fi
    if ! engine_answers; then
        say "the Docker engine does not answer; start it first"
        return 1
    fi
    local experimental live running
    experimental=$(docker info -f '{{.ExperimentalBuild}}')
    live=$(docker info -f '{{.LiveRestoreEnabled}}')
    local backup
    backup=$(mktemp)
    if [ -e "$DAEMON_JSON" ]; then
        cp -p "$DAEMON_JSON" "$backup"
    else
        rm -f "$backup"
    fi
    local changed
    changed=$(merge_config)
    if [ "$experimental" = true ] && [ "$live" = true ]; then
        say "the engine runs with experimental mode and live-restore already; nothing to restart"
        if [ "$changed" = yes ]; then
            say "daemon.json now says so too"
        fi
        rm -f "$backup"
        return 0
    fi
    running=$(docker ps -q | wc -l)
    if [ "$running" -gt 0 ] && [ "$live" != true ]; then
        say "refusing to restart dockerd: $running container(s) running and the running engine has no live-restore, so a restart would kill them. daemon.json now asks for it; restart dockerd when nothing runs."
        rm -f "$backup"
        return 1
    fi
    say "restarting dockerd (experimental mode is read only at start)"
    stop_engine
    if start_engine; then
        say "dockerd is back: experimental $(docker info -f '{{.ExperimentalBuild}}'), live-restore $(docker info -f '{{.LiveRestoreEnabled}}')"
        rm -f "$backup"
        return 0
    fi
    say "the new dockerd did not answer within ${ENGINE_WAIT} s (see $DOCKERD_LOG); putting the old daemon.json back"
    if [ -e "$backup" ]; then
        mv "$backup" "$DAEMON_JSON"
    else
        rm -f "$DAEMON_JSON"
    fi
    stop_engine || true
    if start_engine; then
        say "dockerd runs again with the old configuration"
    else
        say "dockerd did not come back either: start it by hand ($DOCKERD, log $DOCKERD_LOG)"
    fi
    return 1
}

enable_checkpoints "$@"
