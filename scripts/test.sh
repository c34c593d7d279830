#!/usr/bin/env bash
# The test command, for a newcomer and for CI alike (.ci/run calls it after it has an engine):
#   bash scripts/test.sh
# Sets up .venv (scripts/setup.sh), installs what the tests need where this machine lets it
# (Debian's chromium and chromium-driver for the browser tests, gVisor registered with the
# engine), says in one line each what it had to skip and why, builds the images in the
# background, then runs the house rules and the three tiers as CI does. Exits non-zero on the
# first tier that fails; a tier that collects no test is a failure too.
#
# Environment: CI_WORKERS=N runs every tier in N xdist workers (0: serially, in one process).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each line says how far into the run it is (bash's SECONDS), so a slow step shows in the log.
log() { echo "test [$((SECONDS / 60))m$((SECONDS % 60))s]: $*" >&2; }

as_root() {  # root, or sudo without a password; fails (status 1) otherwise
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi
}
apt_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    if [ -z "${APT_UPDATED:-}" ]; then as_root apt-get update -qq || return 1; APT_UPDATED=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! docker info >/dev/null 2>&1; then
    log "no Docker engine answers: the tests run real containers (start dockerd, then run this again)"
    exit 1
fi

# 1. The project and its test tools (idempotent: seconds once set up). Then the types (mypy,
#    configured in pyproject.toml) are checked in the background: cold, mypy reads thousands of
#    modules of litellm and openai (minutes on one core), while the steps below mostly wait on
#    apt, the network and the image builds; the run waits for its verdict after the fast tier.
log "setting up .venv"
bash scripts/setup.sh
log "types (in the background)"
types_log=$(mktemp /tmp/test-types.XXXXXX)
.venv/bin/mypy >"$types_log" 2>&1 &
types_check=$!
stop_types() {  # never fails: it runs on the way out
    if [ -n "$types_check" ]; then kill "$types_check" 2>/dev/null || true; fi
    rm -f "$types_log"
}
trap stop_types EXIT

# 2. What the tests need beyond Python, installed where this machine lets it; otherwise the tests
#    that need it are left out, said here in one line.
markers="not browser"
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    markers=""
elif apt_install chromium chromium-driver; then
    markers=""
else
    log "skipped: the browser tests (no chromium and chromium-driver, and apt-get could not install them: run as root, or install them yourself)"
fi
gvisor=1
if ! bash scripts/setup-gvisor.sh >/tmp/orchestrator-setup-gvisor.log 2>&1; then
    gvisor=0
    log "skipped: the gVisor tier ($(tail -n 1 /tmp/orchestrator-setup-gvisor.log))"
fi

# 3. The images the tests use (content-addressed: a warm machine reuses them), built in the
#    background while the checks that need no engine run; their output is shown once they are
#    done, and a build still going when this stops is stopped with it.
#    a. The agent image and the secret interceptor's: the docker tier waits for them.
log "images (in the background)"
images_log=$(mktemp /tmp/test-images.XXXXXX)
(
    .venv/bin/python -c "from orchestrator.backends.docker import connect
from orchestrator.backends.docker.interceptor import ensure_interceptor_image
ensure_interceptor_image(connect(), print)" &
    interceptor_build=$!
    .venv/bin/orchestrator images build
    agent_status=$?
    wait "$interceptor_build" && exit "$agent_status"
) >"$images_log" 2>&1 &
images_build=$!
#    b. The derived images some docker tests run in (the web_browser example's, LiteLLM's
#       client, smolagents[mcp]: tests/derived_images.py), through the code a run calls: on a
#       bare machine each cost its first test a minute or more, one worker of the docker tier
#       held. Started now, they wait for the agent image through its build lock, then build
#       while the fast tier and the docker tier's first modules run (the docker tier does not
#       wait for them: a test that came first would build its image itself). Waited for at
#       the end.
derived_log=$(mktemp /tmp/test-derived.XXXXXX)
.venv/bin/python -m tests.derived_images >"$derived_log" 2>&1 &
derived_build=$!
stop_images() {  # never fails: it runs on the way out
    pkill -P "$images_build" 2>/dev/null || true
    kill "$images_build" 2>/dev/null || true
    if [ -n "$derived_build" ]; then kill "$derived_build" 2>/dev/null || true; fi
    rm -f "$images_log" "$derived_log"
}
trap 'stop_types; stop_images' EXIT

# 4. House rules that need no engine: lint (seconds; the types are being checked since step 1).
#    The layer contracts (lint-imports) and the docs site (`mkdocs build --strict`) are checked
#    by the fast tier's tests/project/test_architecture.py and tests/project/test_docs.py, so
#    not twice here.
log "lint"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

# 5. The tests run in pytest-xdist workers, each running whole modules (tests/conftest.py):
#    two (one per core) for the fast tier; three for the docker tier and two for the gVisor
#    tier beside it, whose tests spend much of their time waiting on sandboxes, deadlines and
#    the E2B server. Tests with a
#    timing window wait for their condition instead, so a busy machine slows them but does not
#    fail them. pytest's default temporary root is shared by every pytest on the machine and
#    rotated (one started meanwhile deletes this run's stores mid-test): this run keeps its
#    own, removed at the end. No PYTHONPYCACHEPREFIX: Python then reads bytecode only from
#    that tree, and where PYTHONDONTWRITEBYTECODE is set (these machines) nothing is ever
#    written there, so every process (hundreds of `python -m orchestrator`, each worker, each
#    LiteLLM probe) compiled everything it imported again: 0.38 s of CPU for `run --help`
#    against 0.10 s, 8.3 s for `import litellm` against 3.9 s. setup.sh byte-compiles .venv
#    and the project in place instead.
basetemp=$(mktemp -d /tmp/ci.XXXXXX)  # short: Ray's sockets under it must fit 107 bytes
gvisor_tier=""
stop_gvisor() {  # never fails: it runs on the way out
    if [ -n "$gvisor_tier" ]; then kill "$gvisor_tier" 2>/dev/null || true; fi
}
trap 'stop_types; stop_images; stop_gvisor; rm -rf "$basetemp"' EXIT
unset PYTHONPYCACHEPREFIX
pytest=(.venv/bin/python -m pytest -q)
workers() { echo "${CI_WORKERS:-$1}"; }  # $CI_WORKERS, else the tier's own number
with() {  # the -m expression of a tier: its own, and the left-out browser tests
    if [ -n "$markers" ]; then echo "($1) and $markers"; else echo "$1"; fi
}
checked() {  # the exit status, 5 (no test ran) made a failure of its own
    local status=$1
    if [ "$status" -eq 5 ]; then log "pytest collected no tests ($2)"; return 1; fi
    return "$status"
}

#    a. The fast tier, before any image is built: every test not marked `docker`, with
#       DOCKER_HOST pointing nowhere, so a test that needs the engine without the mark fails
#       here. A failure stops the run in a few minutes.
log "fast tier"
set +e
DOCKER_HOST=unix:///nonexistent "${pytest[@]}" -n "$(workers 2)" -m "$(with "not docker")" \
    --basetemp "$basetemp/f"
fast_status=$?
set -e
checked "$fast_status" "fast tier"

#    b. The types, checked meanwhile (step 1).
log "types: waiting for mypy"
set +e
wait "$types_check"
types_status=$?
set -e
types_check=""
cat "$types_log"
[ "$types_status" -eq 0 ] || { log "mypy found problems (exit $types_status)"; exit 1; }

#    c. The agent and interceptor images, built meanwhile (step 3a).
log "images: waiting for the build"
set +e
wait "$images_build"
images_status=$?
set -e
cat "$images_log"
[ "$images_status" -eq 0 ] || { log "the images did not build (exit $images_status)"; exit 1; }

#    d. The tests marked `docker`, every sandbox on runc (tests/conftest.py), and beside them
#       those marked `gvisor` again with every sandbox on gVisor: both runtimes covered, not the
#       suite twice. The two tiers run at once (each its own store and temporary root): the
#       docker tier's last minutes are one worker finishing a long module while the cores idle,
#       and the gVisor tier fills them. Its output is shown once the docker tier is done.
gvisor_status=0
if [ "$gvisor" -eq 1 ]; then
    log "gvisor tier (in the background)"
    gvisor_log="$basetemp/gvisor.log"
    ORCHESTRATOR_SANDBOX_RUNTIME=runsc "${pytest[@]}" -n "$(workers 2)" -m "$(with gvisor)" \
        --basetemp "$basetemp/g" >"$gvisor_log" 2>&1 &
    gvisor_tier=$!
fi
log "docker tier (runc)"
set +e
"${pytest[@]}" -n "$(workers 3)" -m "$(with docker)" --durations=40 --basetemp "$basetemp/r"
status=$?
if [ "$gvisor" -eq 1 ]; then
    log "gvisor tier: waiting for it"
    wait "$gvisor_tier"
    gvisor_status=$?
    gvisor_tier=""
    cat "$gvisor_log"
fi
log "derived images (step 3b): waiting for them"
wait "$derived_build"
derived_status=$?
derived_build=""
cat "$derived_log"
set -e
checked "$status" "runc" || exit $?
checked "$gvisor_status" "gvisor"
[ "$derived_status" -eq 0 ] || { log "the derived images did not build (exit $derived_status)"; exit 1; }
log "passed"
