#!/usr/bin/env bash
# Install gVisor and register it with the local Docker engine (no restart); see README,
# "gVisor". The script itself ships with the package (the error of a run that asks for
# runsc names its installed path): this is the checkout's way to it.
exec bash "$(dirname "$0")/../orchestrator/backends/docker/setup-gvisor.sh" "$@"
