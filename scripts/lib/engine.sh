# Shared by the scripts that change how this machine's Docker engine runs
# (enable-checkpoints.sh, use-overlay2.sh): daemon.json edited by merging keys, and dockerd
# restarted the way this machine runs it, safely. Sourced, not run; the caller sets SAY_AS
# (the prefix of its messages) and `set -euo pipefail`.
#
# This machine runs dockerd without a service manager: /usr/sbin/dockerd without arguments,
# in its own session (setsid), output to /var/log/dockerd.log, from the root memory cgroup
# (so the engine is not charged to, or killed with, the shell that restarted it).

DAEMON_JSON=${DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}
DOCKERD=${DOCKERD:-/usr/sbin/dockerd}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dockerd.log}
DOCKER_PID_FILE=${DOCKER_PID_FILE:-/var/run/docker.pid}
#: How long an engine may take to stop, and to answer once started (seconds).
ENGINE_WAIT=${ENGINE_WAIT:-60}

say() { echo "${SAY_AS:-engine}: $*" >&2; }

# Merge the JSON object $1 into daemon.json (every other key kept); prints "yes" when the
# file changed, "no" otherwise.
merge_config() {
    python3 -c '
import json, os, sys
path, wanted = sys.argv[1], json.loads(sys.argv[2])
config = {}
if os.path.exists(path):
    with open(path) as f:
        text = f.read().strip()
    config = json.loads(text) if text else {}
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
' "$DAEMON_JSON" "$1"
}

engine_answers() { docker info >/dev/null 2>&1; }

# Whether this script may go on: run as root, with an engine that answers; says why not.
# $1: what the script does that needs root.
preflight() {
    if [ "$(id -u)" != 0 ]; then
        say "needs root ($1)"
        return 1
    fi
    if ! engine_answers; then
        say "the Docker engine does not answer; start it first"
        return 1
    fi
}

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

# daemon.json as it was: the copy $1, or no file when there was none.
put_back() {
    if [ -e "$1" ]; then
        mv "$1" "$DAEMON_JSON"
    else
        rm -f "$DAEMON_JSON"
    fi
}

# Merge the JSON object $1 into daemon.json and restart dockerd for it. If the old engine
# will not stop, or the new one does not answer, the old daemon.json is put back (and the
# engine started again); returns 1 then. The caller has checked that a restart is safe (what runs survives it, or nothing runs).
restart_with() {
    local wanted=$1 backup
    backup=$(mktemp)
    if [ -e "$DAEMON_JSON" ]; then
        cp -p "$DAEMON_JSON" "$backup"
    else
        rm -f "$backup"
    fi
    merge_config "$wanted" >/dev/null
    if ! stop_engine; then  # the old engine runs on: it must keep the file it started with
        put_back "$backup"
        return 1
    fi
    if start_engine; then
        rm -f "$backup"
        return 0
    fi
    say "the new dockerd did not answer within ${ENGINE_WAIT} s (see $DOCKERD_LOG); putting the old daemon.json back"
    put_back "$backup"
    stop_engine || true
    if start_engine; then
        say "dockerd runs again with the old configuration"
    else
        say "dockerd did not come back either: start it by hand ($DOCKERD, log $DOCKERD_LOG)"
    fi
    return 1
}
