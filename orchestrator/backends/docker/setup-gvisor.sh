#!/usr/bin/env bash
# Install gVisor (Debian's `runsc`) and register it with the local Docker engine, without
# restarting the engine: sandboxes can then run on gVisor's kernel (--sandbox-runtime).
# Idempotent: run it again and it changes nothing. Needs root (apt, /etc/docker).
#
# Two runtimes, because this runsc version (0.0~20221219) cannot run with its default
# network mode ("cannot run with network enabled in root network namespace"):
#   runsc      --network=none  sandboxes without network
#   runsc-net  --network=host  sandboxes on a network (gVisor uses the network stack of the
#                              container's own namespace, which Docker still creates)
# daemon.json keeps every other key and runtime; dockerd gets SIGHUP, which reloads the
# runtimes and leaves running containers alone.
set -euo pipefail

DAEMON_JSON=${DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}

if ! command -v runsc >/dev/null 2>&1; then
    echo "setup-gvisor: installing runsc (apt)"
    # A fresh machine may have no package lists yet: update once if the first try fails.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q runsc >/dev/null 2>&1 || {
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q runsc >/dev/null
    }
fi
RUNSC=$(command -v runsc)

changed=$(python3 - "$DAEMON_JSON" "$RUNSC" <<'PY'
import json, os, sys
path, runsc = sys.argv[1], sys.argv[2]
config = {}
if os.path.exists(path):
    with open(path) as f:
        text = f.read().strip()
    config = json.loads(text) if text else {}
wanted = {
    "runsc": {"path": runsc, "runtimeArgs": ["--network=none"]},
    "runsc-net": {"path": runsc, "runtimeArgs": ["--network=host"]},
}
runtimes = config.setdefault("runtimes", {})
if all(runtimes.get(k) == v for k, v in wanted.items()):
    print("no")
    sys.exit(0)
runtimes.update(wanted)
os.makedirs(os.path.dirname(path), exist_ok=True)
tmp = path + ".orchestrator-tmp"
with open(tmp, "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
os.replace(tmp, path)
print("yes")
PY
)

if [ "$changed" = yes ]; then
    pid=$(pidof dockerd || true)
    if [ -z "$pid" ]; then
        echo "setup-gvisor: $DAEMON_JSON updated; start dockerd to use it" >&2
        exit 0
    fi
    echo "setup-gvisor: registered runsc and runsc-net in $DAEMON_JSON; reloading dockerd (SIGHUP)"
    kill -HUP $pid
fi

for _ in $(seq 1 100); do
    if docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc-net"'; then
        echo "setup-gvisor: ready ($(runsc --version 2>/dev/null | head -1))"
        exit 0
    fi
    sleep 0.1
done
echo "setup-gvisor: dockerd did not pick up the runtimes; see its log" >&2
exit 1
