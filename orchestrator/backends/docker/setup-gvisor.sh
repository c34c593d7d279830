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
# Both with --oci-seccomp where this runsc has it: gVisor then applies the container's seccomp
# filter (our profile, seccomp.py) to the sandbox's processes, so a sandbox meets the filter
# and gVisor's kernel (without it, the engine's seccomp option silently does nothing).
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
SECCOMP_FLAG=""
# The list read whole first: piped into `grep -q`, which leaves at the first match, runsc
# could get SIGPIPE mid-list, and under pipefail the flag counted as missing (seen in CI).
RUNSC_FLAGS=$("$RUNSC" flags 2>&1 || true)
if grep -q -- '-oci-seccomp' <<<"$RUNSC_FLAGS"; then
    SECCOMP_FLAG="--oci-seccomp"
else
    echo "setup-gvisor: this runsc has no --oci-seccomp: gVisor sandboxes will run without our seccomp filter" >&2
fi

changed=$(python3 - "$DAEMON_JSON" "$RUNSC" "$SECCOMP_FLAG" <<'PY'
import json, os, sys
path, runsc, seccomp = sys.argv[1], sys.argv[2], sys.argv[3:]
seccomp = [flag for flag in seccomp if flag]
config = {}
if os.path.exists(path):
    with open(path) as f:
        text = f.read().strip()
    config = json.loads(text) if text else {}
wanted = {
    "runsc": {"path": runsc, "runtimeArgs": ["--network=none", *seccomp]},
    "runsc-net": {"path": runsc, "runtimeArgs": ["--network=host", *seccomp]},
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

# Ready when the engine lists both runtimes with the arguments written above (after a SIGHUP
# it lists the old ones until the reload is done).
registered() {
    docker info --format '{{json .Runtimes}}' 2>/dev/null | python3 -c '
import json, sys
runtimes, flag = json.load(sys.stdin), sys.argv[1:]
for name, net in (("runsc", "none"), ("runsc-net", "host")):
    if (runtimes.get(name) or {}).get("runtimeArgs") != [f"--network={net}", *flag]:
        sys.exit(1)
' $SECCOMP_FLAG
}
for _ in $(seq 1 100); do
    if registered; then
        echo "setup-gvisor: ready ($(runsc --version 2>/dev/null | head -1))"
        exit 0
    fi
    sleep 0.1
done
echo "setup-gvisor: dockerd did not pick up the runtimes; see its log" >&2
exit 1
