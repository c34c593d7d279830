#!/bin/sh
# Install the agent's Python environment: a venv at /opt/venv from the wheels in /wheels, and
# the in-sandbox runtime from /opt/orchestrator/orchestrator_runtime, all byte-compiled.
#
# Shared by the Docker image (its build stage) and the E2B template (images/agent/Dockerfile,
# orchestrator/backends/e2b/templates.py), so both get the same environment from the same wheels.
# No network: pip installs with --no-index from /wheels and runs from its wheel, so the venv
# never contains pip or setuptools.
#
# --no-compile + compileall: every module gets an "unchecked-hash" .pyc, valid whatever the
# file times are. The root filesystem is read-only at run time (Docker), so a missing or stale
# .pyc would mean compiling smolagents again on every run.
set -eux
python3 -m venv --without-pip /opt/venv
pip_wheel="$(echo /wheels/pip-*.whl)"
/opt/venv/bin/python "$pip_wheel/pip" install \
    --no-index --find-links /wheels --only-binary=:all: \
    --no-compile --no-cache-dir --disable-pip-version-check \
    -r /wheels/requirements.txt
# bin/ too: a package's script written in Python (jmespath's jp.py, with boto3) is a module
# like any other to the read-only check of every .py having its .pyc.
/opt/venv/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash /opt/venv/lib /opt/venv/bin
# The runtime lives in its own directory, made importable by a .pth file in the venv rather
# than PYTHONPATH, so `python -I` finds it too.
echo /opt/orchestrator > "$(echo /opt/venv/lib/python3*/site-packages)/orchestrator_runtime.pth"
/opt/venv/bin/python -m compileall -q --invalidation-mode unchecked-hash /opt/orchestrator
rm -rf /wheels /install.sh
