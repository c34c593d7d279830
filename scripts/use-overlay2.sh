#!/usr/bin/env bash
# Move this machine's Docker engine from fuse-overlayfs (or vfs) to overlay2, where the
# kernel's own overlay works on the engine's data root. With fuse-overlayfs every file a
# container opens goes through a FUSE process in user space, and Python's imports open
# hundreds: measured on a 2-core machine (Docker 20.10), a container importing smolagents
# took 0.67 CPU-seconds on fuse-overlayfs and 0.51-0.56 on overlay2 under runc, 1.12 and
# 0.95-0.98 under gVisor. Docker picks overlay2 by itself wherever it can; a daemon.json that
# names fuse-overlayfs (as on these CI machines, whose kernel has overlay) costs that CPU.
#
# A storage driver keeps its own images and containers: those made under the old one stay
# on disk but the engine no longer sees them. So this refuses (exit 1) while the engine has
# any container or image, unless --drop-images names the images' loss (they are rebuilt by
# `orchestrator images build`); CI runs it on a fresh engine, before it builds an image.
# It changes nothing (exit 0, saying why) where the driver is already native, or where a
# test overlay mount under the data root fails. Restarts dockerd (scripts/lib/engine.sh: the
# old daemon.json put back if the new engine does not answer). Needs root. Idempotent.
set -euo pipefail
SAY_AS=use-overlay2
# shellcheck source=lib/engine.sh
. "$(dirname "$0")/lib/engine.sh"

drop_images=no
for arg in "$@"; do
    case $arg in
        --drop-images) drop_images=yes ;;
        *) say "unknown argument $arg (usage: use-overlay2.sh [--drop-images])"; exit 2 ;;
    esac
done

# Whether the kernel mounts an overlay whose upper layer is on the folder $1's file system.
overlay_works_in() {
    local probe status=0
    probe=$(mktemp -d "$1/.orchestrator-overlay-probe.XXXXXX")
    mkdir "$probe/lower" "$probe/upper" "$probe/work" "$probe/merged"
    echo lower > "$probe/lower/file"
    if mount -t overlay overlay \
        -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" \
        2>/dev/null; then
        echo upper > "$probe/merged/written" 2>/dev/null && [ -e "$probe/upper/written" ] \
            || status=1
        umount "$probe/merged" || status=1
    else
        status=1
    fi
    rm -rf "$probe"
    return "$status"
}

use_overlay2() {
    preflight "it mounts a test overlay, edits $DAEMON_JSON and restarts dockerd" || return 1
    local driver root containers images
    driver=$(docker info -f '{{.Driver}}')
    case $driver in
        fuse-overlayfs | vfs) ;;
        *) say "the engine's storage driver is $driver already; nothing to change"; return 0 ;;
    esac
    root=$(docker info -f '{{.DockerRootDir}}')
    if ! overlay_works_in "$root"; then
        say "the kernel's overlay does not mount on $root's file system; the engine keeps $driver"
        return 0
    fi
    containers=$(docker ps -aq | wc -l)
    if [ "$containers" -gt 0 ]; then
        say "refusing: the engine has $containers container(s), which $driver keeps and overlay2 would not see. Remove them first (docker rm), then run this again."
        return 1
    fi
    images=$(docker images -q | wc -l)
    if [ "$images" -gt 0 ] && [ "$drop_images" != yes ]; then
        say "refusing: the engine has $images image(s) under $driver, which overlay2 would not see (they stay on disk). Run with --drop-images to go on, then rebuild: orchestrator images build."
        return 1
    fi
    say "restarting dockerd with the storage driver overlay2 (it was $driver)"
    restart_with '{"storage-driver": "overlay2"}' || return 1
    say "dockerd is back, storage driver $(docker info -f '{{.Driver}}')"
}

use_overlay2 "$@"
