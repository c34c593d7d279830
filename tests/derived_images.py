"""The derived images the docker tier runs in: the agent image plus a payload's, a program's
or a model client's requirements. On a bare machine each took its first test a minute or
more to build, in a worker of the docker tier; scripts/test.sh builds them beforehand, in the
background from the fast tier on, through the same `ensure_agent_image` a run calls, so the
tests find them cached (content-addressed: a warm machine builds nothing).

`python -m tests.derived_images` builds them, saying each step; exits non-zero on the first
that fails."""

from __future__ import annotations

import sys

from .conftest import PAYLOADS, REPO

#: The version of mcp tests/backends/docker/test_images.py pins over the constraint
#: (images/agent/constraints.txt).
MCP_PIN = "mcp==1.25.0"


def suite_requirements() -> list[tuple[str, ...]]:
    """Each derived image's requirements, read where the runs read them."""
    from orchestrator.models import PROVIDERS
    from orchestrator.payloads.manifest import load_manifest

    mcp = load_manifest(REPO / "tests" / "programs" / "mcp_tools").requirements
    return [  # in the order the docker tier is likely to need them
        # the web_browser example (tests/lifecycle/test_runner.py,
        # tests/examples/test_web_browser.py).
        load_manifest(PAYLOADS / "web_browser").requirements,
        # tests/models/test_model_routes.py: programs with a LiteLLMModel (the provider's client).
        PROVIDERS["litellm"].extra_requirements,
        # tests/backends/docker/test_images.py, tests/payloads/test_mcp.py and
        # test_mcp_remote.py: `smolagents[mcp]`.
        mcp,
        # tests/backends/docker/test_images.py: a payload's own pin wins over the constraint.
        (*mcp, MCP_PIN),
    ]


def say(message: str) -> None:
    """A build's steps, without the builder's and pip's own lines (as `images build` says)."""
    if not message.startswith(("build: ", "pip: ")):
        print(message, flush=True)


def main() -> int:
    from orchestrator.backends.docker import connect
    from orchestrator.backends.docker.images import ensure_agent_image

    client = connect()
    for requirements in suite_requirements():
        say(f"derived image for {' '.join(requirements)}:")
        say(ensure_agent_image(client, extra_requirements=requirements, progress=say))
    return 0


if __name__ == "__main__":
    sys.exit(main())
