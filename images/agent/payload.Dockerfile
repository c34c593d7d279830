# A payload image: the agent image plus a payload's extra requirements, nothing else.
#
# Built by orchestrator/backends/docker/images.py from a context with this file, requirements.txt,
# constraints.txt (the agent image's pins, so nothing it has changes) and wheels/ (resolved on
# the host, including a pip wheel). The final image has no pip and no wheels: pip runs from its
# wheel in the build stage (as the agent user) and installs with `--prefix /tmp/delta` using the
# agent's venv as the interpreter, so only the packages the venv lacks land there; they are then
# copied over the venv (root-owned, like the rest of it).
ARG AGENT_IMAGE

FROM ${AGENT_IMAGE} AS build
COPY requirements.txt constraints.txt wheels/ /wheels/
RUN set -eux; \
    mkdir /tmp/delta; \
    pip_wheel="$(echo /wheels/pip-*.whl)"; \
    python "$pip_wheel/pip" install \
        --no-index --find-links /wheels --only-binary=:all: \
        --no-compile --no-cache-dir --disable-pip-version-check --no-warn-script-location \
        --prefix /tmp/delta -r /wheels/requirements.txt -c /wheels/constraints.txt; \
    test ! -e /tmp/delta/local; \
    python -m compileall -q -j 0 --invalidation-mode unchecked-hash \
        -s /tmp/delta -p /opt/venv /tmp/delta \
    || echo "WARNING: some files above could not be compiled (syntax errors: not importable)"

FROM ${AGENT_IMAGE}
COPY --from=build /tmp/delta/ /opt/venv/
ARG AGENT_IMAGE ORCHESTRATOR_VERSION=dev ORCHESTRATOR_CONTENT_HASH=unknown \
    ORCHESTRATOR_REQUIREMENTS=unknown ORCHESTRATOR_CONSTRAINTS=
LABEL orchestrator.kind=payload-image \
      orchestrator.version=${ORCHESTRATOR_VERSION} \
      orchestrator.content-hash=${ORCHESTRATOR_CONTENT_HASH} \
      orchestrator.agent-image=${AGENT_IMAGE} \
      orchestrator.requirements="${ORCHESTRATOR_REQUIREMENTS}" \
      orchestrator.constraints="${ORCHESTRATOR_CONSTRAINTS}"
