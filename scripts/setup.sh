#!/usr/bin/env bash
# Set up a development environment: a virtualenv in .venv with orchestrator and its test tools.
# On a host that cannot pull images, also makes sure debootstrap is there, so the first run
# can bootstrap a Debian base image without a registry.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
# Each step says what it does first: pip and uv run quietly, and the first time they take
# a minute or two together (a silent wait reads like a hang).
say() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
    say "making the virtualenv .venv"
    "$python" -m venv .venv
fi
# setuptools warns on every editable install that a folder named like the package may shadow
# it (it does not here: the folder *is* the package); a wall of text that says nothing to do.
quiet_build="ignore::UserWarning:setuptools.command.editable_wheel"
say "installing orchestrator and its test tools into .venv (uv, quiet: under a minute the first time, seconds later)"
# uv (a dev dependency, Astral's installer) first, with pip: it installs the rest about four
# times faster than pip does (14 s against 56 s here, caches warm), which CI's setup feels.
# Byte-compiled as pip would (--compile-bytecode): with PYTHONDONTWRITEBYTECODE set, every
# `orchestrator` command would otherwise compile its dependencies' modules again.
.venv/bin/python -m pip install --quiet --upgrade pip uv
# `ray`: the optional extra behind `batch --ray` (orchestrator/cluster/), for tests/cluster/.
# `export`: Inspect AI and pyarrow behind `batch export` (tests/batch/test_export.py). Inspect
# AI needs s3fs, whose aiobotocore caps botocore below the 1.44 that dev and the agent image
# pin; the override keeps 1.44 (aiobotocore is only imported for s3:// logs, never here).
PYTHONWARNINGS=$quiet_build .venv/bin/uv pip install --quiet --native-tls --compile-bytecode \
    --python .venv/bin/python -e '.[dev,ray,export]' --override scripts/export-overrides.txt
# Backends defined outside the project, registered through the entry point as a third party's
# would be (tests/plugins/README.md); the tests use them.
PYTHONWARNINGS=$quiet_build .venv/bin/uv pip install --quiet --native-tls --no-deps \
    --python .venv/bin/python -e tests/plugins/orchestrator_mirror -e tests/plugins/orchestrator_broken
# The project's own modules byte-compiled, as pip compiles an installed package: an editable
# install leaves them as source, and where PYTHONDONTWRITEBYTECODE is set (CI, these machines)
# every `orchestrator` command would compile its ~60 host modules again (0.15-0.2 s of each
# cold run). A module edited since is compiled in memory, as without this.
.venv/bin/python -m compileall -q orchestrator orchestrator_runtime

# Arize Phoenix, the tracing UI smolagents' docs point to, for
# tests/records/test_traces_phoenix.py: in a virtualenv of its own (.venv-phoenix), since its
# ~150 dependencies (pandas, grpcio, SQLAlchemy, ...) would clash with ours. uv (a dev
# dependency) installs it in well under a minute where pip takes three; byte-compiled, or its
# first start compiles it (a minute more). --native-tls: the system's certificates (a proxy's CA
# among them). A no-op when it is there.
say "installing Arize Phoenix for the trace tests into .venv-phoenix (uv, quiet: under a minute the first time)"
if [ ! -x .venv-phoenix/bin/python ]; then
    "$python" -m venv --without-pip .venv-phoenix
fi
.venv/bin/uv pip install --quiet --native-tls --compile-bytecode --python .venv-phoenix/bin/python \
    'arize-phoenix==20.26.1'

# mitmproxy, the secret interceptor's proxy (images/interceptor/), for
# tests/backends/docker/test_interceptor.py: in a virtualenv of its own (.venv-mitmproxy), since
# it pins h11, cryptography and others below what ours need; it runs there as in its image, a
# process of its own.
say "installing mitmproxy for the interceptor tests into .venv-mitmproxy (uv, quiet: seconds)"
if [ ! -x .venv-mitmproxy/bin/python ]; then
    "$python" -m venv --without-pip .venv-mitmproxy
fi
# The image's pin needs Python 3.12+; on an older host Python, the last line that runs there
# (images/interceptor/requirements-py311.txt; the image itself is tested in a container).
mitm_requirements=images/interceptor/requirements.txt
if ! .venv-mitmproxy/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    mitm_requirements=images/interceptor/requirements-py311.txt
fi
.venv/bin/uv pip install --quiet --native-tls --compile-bytecode --python .venv-mitmproxy/bin/python \
    -r "$mitm_requirements"

if ! command -v debootstrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing debootstrap (to build a base image without a registry)" >&2
    apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null
fi
echo "setup: ready (.venv/bin/orchestrator)" >&2
